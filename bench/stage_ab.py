"""One stage's decode step on a GPU, tinygrad's CUDA graph against the lean one (engine/cuda_graph.py), in one process.

    DEV=CUDA python3 bench/stage_ab.py --model m.gguf [--layers 11:22] [--batch 1] [--steps 100] [--rounds 3]

Two copies of the stage are loaded and warmed, the first with MESH_LEAN_GRAPH=0 (its graphs are tinygrad's), the
second with lean graphs; then rounds of --steps decode steps alternate between them (same columns, same inputs),
so the host's state (clocks, caches, other tenants) is the same for both. Each step is split into
- inputs: the hidden state (or the embedding rows) copied into the step's device buffer (`write_into`),
- launch: the rest of the host's work before the output is waited for (graph parameters, tinygrad's call path),
- wait: the output's copy back, which waits for the GPU (`_copy_out`),
- after: the Python after the copy.
A stage that is neither first nor last takes and gives hidden states, as a middle peer of a chain does: the
fixed cost of a partial step is what a chain pays once per stage (issue 10). Also prints the outputs' equality.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layers", default="", help="start:end (default: the middle third)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--pos", type=int, default=100)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile of one round of the lean stage")
    a = ap.parse_args()

    import numpy as np
    from tinygrad import Device
    import engine.stage as st
    from engine.gguf_meta import read_gguf
    from engine.stage import Column, Stage
    from tinygrad.engine.jit import graph_class

    g = read_gguf(a.model)
    n = next(int(v) for k, v in g.kv.items() if k.endswith(".block_count"))
    lo, hi = (int(x) for x in a.layers.split(":")) if a.layers else (n // 3, 2 * n // 3)
    B, ctx = a.batch, a.pos + a.rounds * 2 * a.steps + 64
    stages = {}
    for name, lean in (("tinygrad", "0"), ("lean", "1")):
        os.environ["MESH_LEAN_GRAPH"] = lean
        if lean == "0" and str(Device.DEFAULT).startswith("CUDA"):  # tinygrad's own, whatever a stage installed
            from tinygrad.runtime.graph.cuda import CUDAGraph
            Device[Device.DEFAULT].graph = CUDAGraph
        t = time.perf_counter()
        s = Stage.load(a.model, lo, hi, n_slots=B, max_context=ctx)
        s.warmup(decode_batch=B)
        stages[name] = s
        print(f"{name}: layers {lo}..{hi} of {n} on {Device.DEFAULT}, graph {getattr(graph_class(Device[Device.DEFAULT]), '__name__', None)}"
              f", load + warmup {time.perf_counter() - t:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    dim = stages["lean"].dim
    first, last = stages["lean"].first, stages["lean"].last

    def cols(p: int, logits: bool) -> list:
        return [Column(p, s, logits and last, 1 + (p + s) % 200) for s in range(B)]

    prompts = [None if first else rng.standard_normal((a.pos, dim), dtype=np.float32) for _ in range(B)]
    for s in stages.values():  # the prompt: pos positions in every slot, the same for both copies
        for slot, h in enumerate(prompts):
            s.step([Column(i, slot, last and i == a.pos - 1, 1 + i % 200) for i in range(a.pos)], h)

    marks: list[tuple[str, float]] = []
    orig_copy, orig_write = st._copy_out, st.write_into

    def copy_out(t):
        marks.append(("wait0", time.perf_counter()))
        try:
            return orig_copy(t)
        finally:
            marks.append(("wait1", time.perf_counter()))

    def write_into(t, arr, offset=0):
        marks.append(("in0", time.perf_counter()))
        try:
            return orig_write(t, arr, offset)
        finally:
            marks.append(("in1", time.perf_counter()))
    st._copy_out, st.write_into = copy_out, write_into
    parts = {k: {p: [] for p in ("step", "inputs", "launch", "wait", "after")} for k in stages}
    pos = {k: a.pos for k in stages}
    outs = {k: [] for k in stages}
    try:
        for r in range(a.rounds):
            for name in (("tinygrad", "lean") if r % 2 == 0 else ("lean", "tinygrad")):
                s = stages[name]
                for i in range(a.steps):
                    h = None if first else np.full((B, dim), 0.01 * ((pos[name] % 7) - 3), np.float32)
                    marks.clear()
                    t0 = time.perf_counter()
                    out = s.step(cols(pos[name], True), h)
                    t1 = time.perf_counter()
                    pos[name] += 1
                    if i < 5:
                        outs[name].append(np.asarray(out).tobytes())
                    m = dict(marks)
                    ins = sum(b - a_ for (k, a_), (_, b) in zip(marks, marks[1:]) if k == "in0")
                    w0, w1 = m.get("wait0", t1), m.get("wait1", t1)
                    p = parts[name]
                    p["step"].append(t1 - t0)
                    p["inputs"].append(ins)
                    p["launch"].append(w0 - t0 - ins)
                    p["wait"].append(w1 - w0)
                    p["after"].append(t1 - w1)
    finally:
        st._copy_out, st.write_into = orig_copy, orig_write
    print(f"decode steps of {B} column(s) from position {a.pos}, {a.rounds} rounds of {a.steps} alternating, ms "
          f"(medians):")
    print(f"  {'graph':10s}" + "".join(f"{k:>9s}" for k in parts["lean"]))
    for name, p in parts.items():
        print(f"  {name:10s}" + "".join(f"{statistics.median(v) * 1e3:9.3f}" for v in p.values()))
    print(f"  lean / tinygrad step: {statistics.median(parts['lean']['step']) / statistics.median(parts['tinygrad']['step']):.3f}")
    same = sum(x == y for x, y in zip(outs["lean"], outs["tinygrad"]))
    print(f"  outputs of the first steps of each round equal: {same} of {len(outs['lean'])}")
    if a.profile:
        import cProfile
        import io
        import pstats
        s, pr = stages["lean"], cProfile.Profile()
        pr.enable()
        for i in range(a.steps):
            h = None if first else np.zeros((B, dim), np.float32)
            s.step(cols(pos["lean"], True), h)
            pos["lean"] += 1
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(20)
        print("\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())[:5000])


if __name__ == "__main__":
    main()
