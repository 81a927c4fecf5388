"""The GPU split attention (engine/paged_attention.py) of this tree against an earlier version of the file, timed
side by side on one device: a step of --layers attention calls (one per layer, each layer its own pools, as a
stage's step), B decode columns of B sequences all at one context length, captured once per version and timed in
interleaved rounds (median per round, then the median of those). Prints ms a step per version, the ratio, and the
largest difference between the two versions' outputs (arithmetic order changes: ~1e-7 of the values, not more).

    git show bc92061:engine/paged_attention.py > bench/_attn_before.py    # untracked: it travels with the tree
    DEV=CUDA python3 bench/attn_ab.py --before-file bench/_attn_before.py [--shape 8b] [--batches 1,16] \
        [--contexts 512,4096] [--layers 32] [--rounds 5] [--steps 20]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"8b": (32, 8, 128), "1b": (32, 4, 64), "smollm2": (9, 3, 64), "tiny": (2, 1, 32)}  # heads, kv heads, head_dim
# ("tiny": a smoke run on the PYTHON device)
B = 16


def load_file(path: str):
    spec = importlib.util.spec_from_file_location("engine._attn_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def step_fn(mod, n: int, layers: int, H: int, KvH: int, Hd: int, maxc: int):
    """A jitted step: `layers` attention calls over n columns (run i: slot i, one position)."""
    from tinygrad import TinyJit

    def step(q, table, *rest):
        pools, binds = rest[:2 * layers], rest[2 * layers:]
        runs = [mod.Run(i, 1, binds[i], binds[n + i]) for i in range(n)]
        outs = [mod.paged_attention(q, pools[2 * i], pools[2 * i + 1], table, runs, binds[2 * n], maxc, B, H, KvH,
                                    Hd, Hd ** -0.5) for i in range(layers)]
        return [o.realize() for o in outs]
    fn = TinyJit(step)
    fn.cnt = 1  # capture on the first call
    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before-file", required=True)
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    from tinygrad import Device, Tensor, UOp
    import engine.paged_attention as after
    before = load_file(a.before_file)
    H, KvH, Hd = SHAPES[a.shape]
    dev = Device.DEFAULT
    contexts = [int(c) for c in a.contexts.split(",")]
    maxc = -(-max(contexts) // B) * B
    rng = np.random.default_rng(0)
    print(f"{dev}, shape {a.shape} ({H} heads, {KvH} kv heads, head_dim {Hd}), {a.layers} layers, max_context {maxc}")
    for n in (int(x) for x in a.batches.split(",")):
        rows = (n * maxc // B + 1) * B
        pools = [Tensor(rng.standard_normal((rows, KvH * Hd), dtype=np.float32), device=dev).realize()
                 for _ in range(2 * a.layers)]
        table = Tensor(rng.permutation(n * maxc // B).astype(np.int32).reshape(n, maxc // B), device=dev).realize()
        q = Tensor(rng.standard_normal((n, H * Hd), dtype=np.float32), device=dev).realize()
        slots = [UOp.variable(f"slot{i}", 0, n - 1) for i in range(n)]
        poss = [UOp.variable(f"pos{i}", 0, maxc - 1) for i in range(n)]
        vctx = UOp.variable("ctx", 0, maxc)
        fns = {"before": step_fn(before, n, a.layers, H, KvH, Hd, maxc), "after": step_fn(after, n, a.layers, H, KvH,
                                                                                          Hd, maxc)}
        for ctx in contexts:
            binds = [v.bind(i) for i, v in enumerate(slots)] + [v.bind(ctx - 1) for v in poss] + [vctx.bind(ctx)]
            outs = {k: [o.numpy() for o in f(q, table, *pools, *binds)] for k, f in fns.items()}
            diff = max(float(np.abs(x - y).max()) for x, y in zip(outs["before"], outs["after"]))
            scale = max(float(np.abs(x).max()) for x in outs["before"])
            per = {k: [] for k in fns}
            for _ in range(a.rounds):
                for k, f in fns.items():
                    Device[dev].synchronize()
                    t0 = time.perf_counter()
                    for _ in range(a.steps):
                        f(q, table, *pools, *binds)
                    Device[dev].synchronize()
                    per[k].append((time.perf_counter() - t0) / a.steps * 1e3)
            med = {k: statistics.median(v) for k, v in per.items()}
            print(f"  batch {n:2d} context {ctx:5d}: before {med['before']:.3f} ms  after {med['after']:.3f} ms  "
                  f"after/before {med['after'] / med['before']:.3f}  (rounds: "
                  + ", ".join(f"{b:.3f}/{c:.3f}" for b, c in zip(per['before'], per['after']))
                  + f")  max |after - before| {diff:.2e} of {scale:.2e}")


if __name__ == "__main__":
    main()
