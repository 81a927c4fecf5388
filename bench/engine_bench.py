"""Engine benchmark (not a test): the unsharded engine against llama.cpp in the same run, and each stage's memory.

    .venv/bin/python bench/engine_bench.py [--model PATH] [--tokens 64] [--weights f32] [--splits 0,10,20,30]
    DEV=CUDA python3 bench/engine_bench.py --model synth.gguf --synthetic-prompt 64 --skip llama,memory,batch,split \
        --llama-bench path/to/llama-bench

A model without real text (bench/synth_gguf.py writes one) takes `--synthetic-prompt N`: N random token ids
(seeded) instead of the tokenized chat prompt. `--llama-bench BIN` also runs llama.cpp's own llama-bench binary
(`-p 0 -n TOKENS -ngl 99`: decode at batch 1, every layer on the GPU) on the same file, for machines without
llama-cpp-python (a GPU box); its figure is tg TOKENS, a mean over whole generations.

Reports, for SmolLM2 by default:
  * tinygrad engine: load time, first-token latency cold (kernels compiled in this process) and warm (a second
    prompt after reset), steady decode tok/s (median step);
  * batched decode: --batch sequences in separate slots, one column each per step (aggregate tok/s);
  * split overhead: the --splits stages chained in this process against one stage holding every layer, decode
    steps interleaved, median ms per step of each stage and of the whole (what sharding costs before any network);
  * llama.cpp (llama-cpp-python, if installed) on the same token ids and thread count: first token, decode tok/s;
  * llama.cpp's llama-bench binary (--llama-bench): decode tok/s (tg), same file;
  * per stage of --splits, in a fresh subprocess each: range load time, weight and KV bytes, peak RSS above the
    process's RSS before loading (interpreter + tinygrad), and its ratio to weight + KV bytes.
Set JITBEAM=2 to let tinygrad search kernels for the decode step (cached on disk after the first run).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.memory import status_kb  # noqa: E402

QUESTION = "Write a short poem about the sea."


def prompt_ids(path: Path) -> list[int]:
    from engine.chat import render_prompt
    from engine.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(path)
    return tok.encode(render_prompt(tok, QUESTION))


def synthetic_prompt(path: Path, n: int, seed: int = 0) -> list[int]:
    """n token ids drawn from the model's vocabulary (past its first two, the synthetic files' control tokens)."""
    import numpy as np
    from engine.gguf_meta import read_model_meta
    vocab = read_model_meta(path).vocab_size
    return [int(x) for x in np.random.default_rng(seed).integers(2, vocab, n)]


def streamed_bytes(path: Path) -> int:
    """Bytes of weights a decode step reads from device memory: every tensor but the embedding table (looked up on
    the host), which the head reads when the output is tied."""
    from engine.gguf_meta import read_gguf, read_model_meta
    tied = read_model_meta(path).tied_output
    return sum(t.nbytes for name, t in read_gguf(path).tensors.items() if tied or name != "token_embd.weight")


def bench_llama_bench(binary: str, path: Path, n: int) -> dict | None:
    """llama.cpp's llama-bench: tg n (decode at batch 1 from an empty context, all layers offloaded), 3 repetitions."""
    cmd = [binary, "-m", str(path), "-p", "0", "-n", str(n), "-ngl", "99", "-r", "3", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        print(f"llama-bench failed ({out.returncode}): {out.stderr[-1500:]}")
        return None
    rows = json.loads(out.stdout)
    r = rows[-1]
    return {"decode_tok_s": r["avg_ts"], "stddev": r.get("stddev_ts", 0.0), "build": r.get("build_commit", "?"),
            "backend": r.get("backends", r.get("backend", "?")), "gpu": r.get("gpu_info", "?"),
            "model_gb": r.get("model_size", 0) / 1e9, "cmd": " ".join(cmd)}


def prompt64(prompt: list[int]) -> list[int]:
    """A 64-token prompt made of the chat prompt's ids, repeated: the same ids for both engines."""
    return (prompt * (64 // len(prompt) + 1))[:64]


def bench_engine(path: Path, prompt: list[int], n: int, weights: str, ctx: int) -> dict:
    from engine.stage import Column, Stage
    t0 = time.perf_counter()
    stage = Stage.load(path, 0, stage_depth(path), n_slots=1, max_context=ctx, weights=weights)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    shapes = stage.warmup().shapes  # what a peer does before it reports ready
    warmup_s = time.perf_counter() - t0

    def run() -> tuple[float, list[float], list[int]]:
        t = time.perf_counter()
        out = stage.step([Column(i, 0, i == len(prompt) - 1, tk) for i, tk in enumerate(prompt)])
        first = time.perf_counter() - t
        toks, steps = [int(out[0])], []
        for i in range(n - 1):
            t = time.perf_counter()
            toks.append(int(stage.step([Column(len(prompt) + i, 0, True, toks[-1])])[0]))
            steps.append(time.perf_counter() - t)
        return first, steps, toks

    cold_first, cold_steps, toks = run()
    stage.reset()
    warm_first, warm_steps, toks2 = run()
    steady = statistics.median(warm_steps[2:] or warm_steps)
    firsts = []
    for rep in range(3):  # the yardstick: the first token of a 64-token prompt, kernels compiled
        stage.reset()
        t = time.perf_counter()
        stage.step([Column(i, 0, i == 63, tk) for i, tk in enumerate(prompt64(prompt[rep:] + prompt[:rep]))])
        firsts.append(time.perf_counter() - t)
    return {"load_s": load_s, "warmup_s": warmup_s, "warmup_shapes": shapes, "first64_s": min(firsts),
            "first_token_cold_s": cold_first, "first_token_warm_s": warm_first,
            "decode_tok_s": 1.0 / steady, "first_decode_steps_s": [round(x, 3) for x in cold_steps[:3]],
            "weight_mb": stage.weight_bytes / 1e6, "kv_mb": stage.kv_bytes / 1e6, "tokens": toks,
            "deterministic": toks == toks2, "stage": stage}


def bench_batched(path: Path, prompt: list[int], n: int, weights: str, ctx: int, batch: int) -> dict:
    """Aggregate decode rate with `batch` sequences in separate slots, one column each per step."""
    from engine.stage import Column, Stage
    stage = Stage.load(path, 0, stage_depth(path), n_slots=batch, max_context=ctx, weights=weights)
    last = []
    for slot in range(batch):
        out = stage.step([Column(i, slot, i == len(prompt) - 1, tk) for i, tk in enumerate(prompt)])
        last.append(int(out[0]))
    steps = []
    for i in range(n):
        t = time.perf_counter()
        out = stage.step([Column(len(prompt) + i, slot, True, last[slot]) for slot in range(batch)])
        steps.append(time.perf_counter() - t)
        last = [int(x) for x in out]
    step = statistics.median(steps[2:] or steps)
    return {"batch": batch, "step_s": step, "tok_s": batch / step}


def bench_split(path: Path, prompt: list[int], n: int, weights: str, ctx: int, cuts: list[int]) -> dict:
    """Median decode step of each stage of a split and of the unsharded stage, run alternately in one process."""
    from engine.stage import Column, Stage
    full = Stage.load(path, cuts[0], cuts[-1], n_slots=1, max_context=ctx, weights=weights)
    parts = [Stage.load(path, a, b, n_slots=1, max_context=ctx, weights=weights) for a, b in zip(cuts, cuts[1:])]
    chains = {"full": [full], "split": parts}
    cols = {k: [Column(i, 0, i == len(prompt) - 1, tk) for i, tk in enumerate(prompt)] for k in chains}
    times = {k: [[] for _ in v] for k, v in chains.items()}
    toks: dict[str, list[int]] = {k: [] for k in chains}
    for step in range(n):
        for k, chain in chains.items():
            h = None
            for j, s in enumerate(chain):
                t = time.perf_counter()
                h = s.step(cols[k], h)
                if step >= 3:  # after the prefill and the first (compiling) decode steps
                    times[k][j].append(time.perf_counter() - t)
            toks[k].append(int(h[0]))
            cols[k] = [Column(len(prompt) + step, 0, True, toks[k][-1])]
    med = {k: [statistics.median(t) * 1e3 for t in v] for k, v in times.items()}
    return {"full_ms": med["full"][0], "stage_ms": med["split"], "same_tokens": toks["full"] == toks["split"]}


def bench_llama_cpp(path: Path, prompt: list[int], n: int, threads: int) -> dict | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    out, times = [], []
    t = time.perf_counter()
    for tk in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        times.append(time.perf_counter() - t)
        t = time.perf_counter()
        out.append(int(tk))
        if len(out) == n:
            break
    firsts = []
    for rep in range(3):  # a new first token each time: llama-cpp-python reuses a cached prefix of the last prompt
        t = time.perf_counter()
        next(iter(llm.generate(prompt64(prompt[rep:] + prompt[:rep]), top_k=1, temp=0.0, reset=True)))
        firsts.append(time.perf_counter() - t)
    return {"first_token_s": times[0], "decode_tok_s": 1.0 / statistics.median(times[1:]), "tokens": out,
            "first64_s": min(firsts), "version": llama_cpp.__version__, "llm": llm}


def first64_interleaved(stage, llm, prompt: list[int], reps: int) -> tuple[list[float], list[float], list[float],
                                                                          list[float]]:
    """The first token of a 64-token prompt, the engine and llama.cpp alternately (a new rotation of the prompt each
    round, the same ids for both): on a shared machine both see the same load, which drifts over a run. Returns
    wall times and the calling thread's CPU times (all of the work when both run on one thread: `--threads 1` with
    MESH_CPU_THREADS=1, a measure that the machine's other jobs barely move)."""
    from engine.stage import Column
    eng, ll, eng_cpu, ll_cpu = [], [], [], []
    for rep in range(reps):
        ids = prompt64(prompt[rep % len(prompt):] + prompt[:rep % len(prompt)])
        stage.reset()
        t, c = time.perf_counter(), time.thread_time()
        stage.step([Column(i, 0, i == 63, tk) for i, tk in enumerate(ids)])
        eng.append(time.perf_counter() - t)
        eng_cpu.append(time.thread_time() - c)
        t, c = time.perf_counter(), time.thread_time()
        next(iter(llm.generate(ids, top_k=1, temp=0.0, reset=True)))
        ll.append(time.perf_counter() - t)
        ll_cpu.append(time.thread_time() - c)
    return eng, ll, eng_cpu, ll_cpu


def stage_depth(path: Path) -> int:
    from engine.gguf_meta import read_model_meta
    return read_model_meta(path).n_layers


def child(path: Path, start: int, end: int, weights: str, ctx: int) -> None:
    """Runs in a fresh process: load one stage, run a few steps, report its memory."""
    import numpy as np
    from engine.stage import Column, Stage
    from tinygrad import Tensor
    (Tensor([1.0]) * 2).realize()  # the device and its worker threads count in the baseline, not in the stage
    page_in(path, start, end)  # the range in the page cache for both the load and the floor
    base = status_kb("VmRSS")
    t, c = time.perf_counter(), time.thread_time()
    s = Stage.load(path, start, end, n_slots=1, max_context=ctx, weights=weights)
    load_s, load_cpu = time.perf_counter() - t, time.thread_time() - c
    cols = [Column(i, 0, i == 7, 1) for i in range(8)]
    hidden = None if s.first else np.zeros((8, s.dim), np.float32)
    s.step(cols, hidden)
    for i in range(4):
        s.step([Column(8 + i, 0, True, 1)], None if s.first else np.zeros((1, s.dim), np.float32))
    peak = status_kb("VmHWM")
    file_bytes, copy_s, copy_cpu = read_and_copy(path, start, end)
    print(json.dumps({"range": [start, end], "load_s": load_s, "load_cpu_s": load_cpu, "copy_cpu_s": copy_cpu,
                      "weight_mb": s.weight_bytes / 1e6,
                      "kv_mb": s.kv_bytes / 1e6, "base_rss_mb": base / 1e3, "peak_rss_mb": peak / 1e3,
                      "file_mb": file_bytes / 1e6, "copy_s": copy_s,
                      "ratio": (peak - base) * 1e3 / (file_bytes + s.kv_bytes)}))


def range_tensors(path: Path, start: int, end: int) -> list:
    """The GGUF tensors a stage [start, end) needs: what the user's file spends on that range."""
    from engine.gguf_meta import read_gguf, read_model_meta
    meta, g = read_model_meta(path), read_gguf(path)
    def wanted(name: str) -> bool:
        if name.startswith("blk."):
            return start <= int(name.split(".")[1]) < end
        if name == "token_embd.weight":
            return start == 0 or (end == meta.n_layers and meta.tied_output)
        return end == meta.n_layers  # output_norm, output
    return [t for name, t in g.tensors.items() if wanted(name)]


def page_in(path: Path, start: int, end: int) -> None:
    """Read the range's tensor bytes once through a small buffer: into the OS page cache, not into this process."""
    buf = bytearray(1 << 20)
    with open(path, "rb") as f:
        for info in range_tensors(path, start, end):
            for off in range(info.offset, info.offset + info.nbytes, len(buf)):
                f.seek(off)
                f.readinto(buf)


def read_and_copy(path: Path, start: int, end: int) -> tuple[int, float, float]:
    """The floor a load is measured against: read the range's tensor bytes from the file and copy them into
    device buffers, nothing else. Returns (bytes, seconds, seconds of this thread's CPU). The device buffers are held
    until the end, as a stage holds its weights: freed one by one, tinygrad's allocator would hand the same memory
    back for the next tensor of that size and the floor would skip the page faults of new memory that every load
    pays. The bytes are read into one reused host buffer, as the loader's own (`loader.scratch`)."""
    import numpy as np
    from engine.loader import device_empty, free_device_cache, write_into
    from tinygrad import dtypes
    tensors = range_tensors(path, start, end)
    held = []
    t, c = time.perf_counter(), time.thread_time()
    buf = np.empty(max(info.nbytes for info in tensors), np.uint8)
    with open(path, "rb") as f:
        for info in tensors:
            raw = buf[:info.nbytes]
            f.seek(info.offset)
            f.readinto(memoryview(raw))
            held.append(dev := device_empty((info.nbytes,), dtypes.uint8))
            write_into(dev, raw)
    took, cpu = time.perf_counter() - t, time.thread_time() - c
    del held, dev
    free_device_cache()
    return sum(t.nbytes for t in tensors), took, cpu


def coldstart_child(path: Path, ctx: int) -> None:
    """A fresh process as a peer runs it: load, warm up, then the first token of a 64-token prompt; prints when
    each is done so the parent times them from the process's start."""
    from engine.device import apply_device, choose_device, quick_default
    from engine.stage import Column, Stage
    from tinygrad import Device
    apply_device(choose_device(None, default=quick_default))  # as a peer's worker picks its device
    Device[Device.DEFAULT]  # and opens it
    print("DEVICE", flush=True)
    s = Stage.load(path, 0, stage_depth(path), n_slots=1, max_context=ctx)
    print("LOADED", flush=True)
    s.warmup()
    print("READY", flush=True)
    prompt = prompt64(prompt_ids(path))
    s.step([Column(i, 0, i == 63, tk) for i, tk in enumerate(prompt)])
    print("FIRST", flush=True)


def bench_coldstart(path: Path, ctx: int) -> dict:
    """Times from the start of a fresh process: tinygrad imported and its device open, the stage loaded, warmed
    up (ready), the first token of a 64-token prompt."""
    # with the bytecode of our modules kept, as any installed copy has it (this box sets PYTHONDONTWRITEBYTECODE,
    # which made every fresh process compile the engine's sources again: ~0.2 s of a cold start)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.setdefault("PYTHONPYCACHEPREFIX", str(Path(os.environ.get("MESH_CACHE_DIR") or Path.home() / ".cache" / "mesh")
                                              / "pycache"))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--model", str(path), "--ctx", str(ctx), "--coldstart"],
                            stdout=subprocess.PIPE, text=True, env=env)
    marks = {}
    for line in proc.stdout:
        marks[line.strip()] = time.perf_counter() - t0
    proc.wait()
    return {"device_s": marks.get("DEVICE"), "loaded_s": marks.get("LOADED"), "ready_s": marks.get("READY"),
            "first_s": marks.get("FIRST")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--weights", default="gguf", choices=["gguf", "f32", "f16", "q8"])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--splits", default="0,10,20,30")
    ap.add_argument("--batch", type=int, default=4, help="sequences decoded together in the batched measurement")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: engine,batch,split,llama,coldstart,memory")
    ap.add_argument("--synthetic-prompt", type=int, default=0, metavar="N",
                    help="N random token ids as the prompt (a synthetic model has no text to tokenize)")
    ap.add_argument("--llama-bench", metavar="BIN", help="also run llama.cpp's llama-bench binary on the model")
    ap.add_argument("--first-reps", type=int, default=8,
                    help="rounds of the alternating 64-token first-token measurement (engine, then llama.cpp)")
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--coldstart", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.model is None:
        from engine.sources import default_model_path
        a.model = default_model_path()
    if a.child:
        return child(a.model, a.child[0], a.child[1], a.weights, a.ctx)
    if a.coldstart:
        return coldstart_child(a.model, a.ctx)
    skip = set(a.skip.split(","))
    prompt = synthetic_prompt(a.model, a.synthetic_prompt) if a.synthetic_prompt else prompt_ids(a.model)
    print(f"model {a.model.name}, prompt {len(prompt)} tokens, {a.tokens} new, weights={a.weights}, "
          f"JITBEAM={os.environ.get('JITBEAM', '0')}, {a.threads} threads")
    eng = None
    if "engine" not in skip:
        eng = bench_engine(a.model, prompt, a.tokens, a.weights, a.ctx)
        print(f"tinygrad engine : load {eng['load_s']:.2f} s, warmup {eng['warmup_s']:.2f} s ({eng['warmup_shapes']} shapes), "
              f"first token of 64-token prompt {eng['first64_s']:.3f} s")
        print(f"tinygrad engine : load {eng['load_s']:.2f} s, first token cold {eng['first_token_cold_s']:.2f} s / "
              f"warm {eng['first_token_warm_s']:.3f} s, decode {eng['decode_tok_s']:.1f} tok/s "
              f"(first steps {eng['first_decode_steps_s']}), weights {eng['weight_mb']:.0f} MB, KV {eng['kv_mb']:.0f} MB, "
              f"repeatable {eng['deterministic']}")
        gb = streamed_bytes(a.model) / 1e9
        print(f"weights read per decode step {gb:.3f} GB: {gb * eng['decode_tok_s']:.0f} GB/s at that rate")
    if "batch" not in skip:
        b = bench_batched(a.model, prompt, 16, a.weights, a.ctx, a.batch)
        print(f"batched decode  : {b['batch']} sequences, {b['step_s'] * 1e3:.0f} ms per step, {b['tok_s']:.1f} tok/s in all")
    if "split" not in skip:
        cuts = [int(x) for x in a.splits.split(",")]
        r = bench_split(a.model, prompt, 24, a.weights, a.ctx, cuts)
        stages = " + ".join(f"{x:.1f}" for x in r["stage_ms"])
        print(f"split decode    : stages {cuts} {stages} = {sum(r['stage_ms']):.1f} ms per step, unsharded "
              f"{r['full_ms']:.1f} ms ({r['full_ms'] / sum(r['stage_ms']):.3f}), same tokens {r['same_tokens']}")
    if "llama" not in skip:
        ll = bench_llama_cpp(a.model, prompt, a.tokens, a.threads)
        if ll is None:
            print("llama.cpp       : llama-cpp-python not installed")
        else:
            print(f"llama.cpp {ll['version']}: first token {ll['first_token_s']:.3f} s, decode {ll['decode_tok_s']:.1f} tok/s")
            if eng is not None:
                same = next((i for i, (x, y) in enumerate(zip(eng["tokens"], ll["tokens"])) if x != y), len(ll["tokens"]))
                print(f"greedy agreement: first {same} of {len(ll['tokens'])} tokens identical")
                print(f"ratios          : decode engine/llama.cpp {eng['decode_tok_s'] / ll['decode_tok_s']:.3f} "
                      f"(goal >= 0.5 on 2 CPU cores); first token of a 64-token prompt engine {eng['first64_s']:.3f} s / "
                      f"llama.cpp {ll['first64_s']:.3f} s = {eng['first64_s'] / ll['first64_s']:.2f}x (goal <= 2)")
                e, l, ec, lc = first64_interleaved(eng["stage"], ll["llm"], prompt, a.first_reps)
                print(f"first token 64  : alternating, {a.first_reps} rounds: engine min {min(e):.3f} / median "
                      f"{statistics.median(e):.3f} s, llama.cpp min {min(l):.3f} / median {statistics.median(l):.3f} s"
                      f": {min(e) / min(l):.2f}x of the minima, {statistics.median(e) / statistics.median(l):.2f}x of "
                      f"the medians (goal <= 2)")
                from engine.cpu_runner import cpu_threads
                if a.threads == 1 and cpu_threads() == 1:
                    print(f"first token 64  : one thread each, CPU time: engine min {min(ec) * 1e3:.1f} / median "
                          f"{statistics.median(ec) * 1e3:.1f} ms, llama.cpp min {min(lc) * 1e3:.1f} / median "
                          f"{statistics.median(lc) * 1e3:.1f} ms: {min(ec) / min(lc):.2f}x of the minima")
    if a.llama_bench:
        lb = bench_llama_bench(a.llama_bench, a.model, a.tokens)
        if lb is not None:
            print(f"llama-bench     : tg{a.tokens} {lb['decode_tok_s']:.1f} +- {lb['stddev']:.1f} tok/s ({lb['backend']}, "
                  f"{lb['gpu']}, build {lb['build']}, model {lb['model_gb']:.2f} GB)")
            if eng is not None:
                print(f"engine / llama.cpp decode: {eng['decode_tok_s'] / lb['decode_tok_s']:.3f}")
    if "coldstart" not in skip and not a.synthetic_prompt:
        for run in (1, 2):  # the first may compile (a changed engine or setting); the second runs from the cache
            c = bench_coldstart(a.model, a.ctx)
            print(f"cold start {run}    : a fresh process: tinygrad and its device {c['device_s']:.2f} s, loaded at "
                  f"{c['loaded_s']:.2f} s, ready at {c['ready_s']:.2f} s (warmup {c['ready_s'] - c['loaded_s']:.2f} s), "
                  f"first token of a 64-token prompt at {c['first_s']:.2f} s: {c['first_s'] - c['ready_s']:.3f} s "
                  f"after ready, {c['first_s'] - c['device_s']:.2f} s after the device")
    if "memory" not in skip:
        cuts = [int(x) for x in a.splits.split(",")]
        for s, e in zip(cuts, cuts[1:]):
            out = subprocess.run([sys.executable, __file__, "--model", str(a.model), "--weights", a.weights,
                                  "--ctx", str(a.ctx), "--child", str(s), str(e)], capture_output=True, text=True)
            if out.returncode:
                print(f"stage [{s},{e}): failed\n{out.stderr[-2000:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"stage [{s:2d},{e:2d}): resident weights {r['weight_mb']:.1f} MB / file {r['file_mb']:.1f} MB = "
                  f"{r['weight_mb'] / r['file_mb']:.3f} (goal <= 1.05); peak RSS growth / (file + KV {r['kv_mb']:.0f} MB) = "
                  f"{r['ratio']:.2f} (goal <= 1.3); load {r['load_s']:.3f} s / read+copy {r['copy_s']:.3f} s = "
                  f"{r['load_s'] / r['copy_s']:.2f} (goal <= 2), in CPU time {r['load_cpu_s']:.3f} / "
                  f"{r['copy_cpu_s']:.3f} s = {r['load_cpu_s'] / r['copy_cpu_s']:.2f}")


if __name__ == "__main__":
    main()
