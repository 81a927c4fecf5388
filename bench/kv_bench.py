"""Paged KV cache and batched attention, before/after in one run (not a test).

    .venv/bin/python bench/kv_bench.py [--before REF] [--model PATH] [--batches 1,4,8] [--steps 24] [--rounds 2]

`--before` (default: the first parent of the commit that brought in engine/paged_attention.py) is exported with
`git archive` into a temporary directory; each measurement runs in a fresh child process of either tree, before and
after alternating, so both see the same machine load. Per tree and batch size B: B sequences with prompts of
different lengths (20 + 37 i tokens) in slots 0..B-1, then `--steps` decode steps of B columns; median step ->
aggregate tok/s. Memory: the KV bytes a sequence holds at lengths 16..2048 (before: a slot's whole max_context in
every layer; after: its blocks), and the measured RSS growth of a stage after prefilling 8 sequences of those lengths.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def child(model: str, batch: int, steps: int, ctx: int, n_slots: int) -> dict:
    from engine.stage import Column, Stage
    stage = Stage.load(model, 0, Stage_depth(model), n_slots=n_slots, max_context=ctx)
    stage.warmup(decode_batch=batch)
    prompts = [[(7 * i + 13 * s) % 900 + 10 for i in range(20 + 37 * s)] for s in range(batch)]
    last = []
    for s, p in enumerate(prompts):
        last.append(int(stage.step([Column(i, s, i == len(p) - 1, t) for i, t in enumerate(p)])[0]))
    times, toks = [], [[t] for t in last]
    for k in range(steps):
        cols = [Column(len(p) + k, s, True, toks[s][-1]) for s, p in enumerate(prompts)]
        t0 = time.perf_counter()
        out = stage.step(cols)
        times.append(time.perf_counter() - t0)
        for s in range(batch):
            toks[s].append(int(out[s]))
    step = statistics.median(times[2:])
    return {"batch": batch, "step_ms": step * 1e3, "tok_s": batch / step, "tokens": toks}


def child_memory(model: str, ctx: int, lengths: list[int]) -> dict:
    from engine.stage import Column, Stage
    stage = Stage.load(model, 0, Stage_depth(model), n_slots=len(lengths), max_context=ctx)
    stage.warmup(decode_batch=1)
    base = _rss_kb()
    for s, n in enumerate(lengths):
        stage.step([Column(i, s, False, 5 + i % 50) for i in range(n)])
    return {"rss_growth_mb": (_rss_kb() - base) / 1e3, "kv_alloc_mb": stage.kv_bytes / 1e6,
            "per_position_bytes": stage.kv_bytes // ((getattr(stage, "kv_blocks", 0) + 1) * 16)
            if hasattr(stage, "kv_blocks") else stage.kv_bytes // (len(lengths) * stage.max_context)}


def Stage_depth(model: str) -> int:
    from engine.gguf_meta import read_model_meta
    return read_model_meta(model).n_layers


def run_child(tree: Path, args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child-json", *args], cwd=tree, env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"child in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def default_before() -> str:
    out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", "engine/paged_attention.py"],
                         cwd=ROOT, capture_output=True, text=True).stdout.split()
    return f"{out[-1]}^" if out else "HEAD"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--skip", default="", help="decode,memory")
    ap.add_argument("--child-json", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child_json:
        kind, *rest = a.child_json
        if kind == "decode":
            model, batch, steps, ctx, slots = rest
            res = child(model, int(batch), int(steps), int(ctx), int(slots))
        else:
            model, ctx, lengths = rest
            res = child_memory(model, int(ctx), [int(x) for x in lengths.split(",")])
        print(json.dumps(res))
        return
    if a.model is None:
        from engine.sources import default_model_path
        a.model = str(default_model_path())
    before = a.before or default_before()
    sha = subprocess.run(["git", "rev-parse", "--short", before], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    batches = [int(b) for b in a.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        old.mkdir()
        subprocess.run(f"git archive {before} | tar -x -C {old}", shell=True, cwd=ROOT, check=True)
        (old / "bench").mkdir(exist_ok=True)
        trees = {"before": old, "after": ROOT}
        print(f"model {a.model}; before = {before} ({sha}), after = working tree; load {os.getloadavg()}")
        if "decode" not in a.skip:
            res: dict = {}
            for r in range(a.rounds):
                for b in batches:
                    for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                        out = run_child(trees[name], ["decode", a.model, str(b), str(a.steps), str(a.ctx),
                                                      str(max(batches))])
                        res.setdefault((name, b), []).append(out)
                        print(f"  round {r} {name:6s} batch {b}: {out['step_ms']:.1f} ms a step, "
                              f"{out['tok_s']:.1f} tok/s", flush=True)
            print(f"decode, {max(batches)} slots, context {a.ctx} (best of {a.rounds} rounds; tok/s in all):")
            print("| sequences | before tok/s | after tok/s | after/before | same tokens |")
            print("|---|---|---|---|---|")
            for b in batches:
                bt = max(x["tok_s"] for x in res[("before", b)])
                at = max(x["tok_s"] for x in res[("after", b)])
                same = res[("before", b)][0]["tokens"] == res[("after", b)][0]["tokens"]
                print(f"| {b} | {bt:.1f} | {at:.1f} | {at / bt:.2f} | {same} |")
            one = {n: max(x["tok_s"] for x in res[(n, batches[0])]) for n in trees}
            for b in batches[1:]:
                print(f"  {b} vs {batches[0]} sequences: before {max(x['tok_s'] for x in res[('before', b)]) / one['before']:.2f}x, "
                      f"after {max(x['tok_s'] for x in res[('after', b)]) / one['after']:.2f}x")
        if "memory" not in a.skip:
            lengths = [16, 64, 256, 1024]
            print(f"memory: one stage, {len(lengths)} slots, context {a.ctx}, sequences of {lengths} positions")
            for name in ("before", "after"):
                out = run_child(trees[name], ["memory", a.model, str(a.ctx), ",".join(map(str, lengths))])
                per = out["per_position_bytes"]
                held = [(a.ctx if name == "before" else -(-n // 16) * 16) * per / 1e6 for n in lengths]
                print(f"  {name}: KV allocated {out['kv_alloc_mb']:.1f} MB, RSS growth after the prefills "
                      f"{out['rss_growth_mb']:.1f} MB; KV held per sequence (MB) at {lengths}: "
                      f"{', '.join(f'{h:.2f}' for h in held)}")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
