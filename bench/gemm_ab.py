"""The CPU prefill GEMM (engine/quant_gemm.py `gemm_kernel`) of a git revision against the working tree's, in one
process.

    MESH_CPU_THREADS=1 .venv/bin/python bench/gemm_ab.py --base HEAD~1 [--mats gate_up,q6_k] [--cols 16] [--reps 15]

Shapes as bench/matvec_ab.py's (SmolLM2-135M's Q4_1 layers, the Q8_0 head's 576 columns on 3072 rows, and layers of
the other resident types), random blocks with small f16 scales, x already normalized (the GEMM's norm and glu are
kernels of their own, engine/cpu_kernels.py). Each kernel runs in a TinyJit; old and new alternate, so a noisy box
slows both alike. Prints median microseconds, their ratio, each kernel's build time (tinygrad's rewrite, linearize
and render: CPU seconds, the compiler cache aside) and whether the outputs are bitwise equal.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.matvec_ab import SHAPES, alternate, base_module, random_weight  # noqa: E402

SHAPES = {**SHAPES, "head": (3072, 576, "Q8_0")}  # a slice of the head: the GEMM never runs it, prefill wants no logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD", help="git revision whose engine/quant_gemm.py is the old kernel")
    ap.add_argument("--mats", default="gate_up,down,qkv", help=f"of {','.join(SHAPES)}")
    ap.add_argument("--cols", type=int, default=16, help="columns of the step (a prefill chunk is 16)")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    from tinygrad import Tensor, TinyJit
    from engine import quant_gemm
    old = base_module(a.base, "quant_gemm")
    kernels = {"old": old.gemm_kernel, "new": quant_gemm.gemm_kernel}
    rng = np.random.default_rng(0)
    for name in a.mats.split(","):
        rows, cols, tname = SHAPES[name]
        w = random_weight(rows, cols, tname, rng)
        x = Tensor(rng.standard_normal((a.cols, cols)).astype(np.float32)).realize()
        fns, outs, build = {}, {}, {}
        for tag, k in kernels.items():
            quant_gemm.gemm_kernel = k  # gemm_t looks it up when its graph is built
            fns[tag] = TinyJit(lambda x: w.matmul_t(x).realize())
            t0 = time.process_time()
            outs[tag] = fns[tag](x).numpy()
            build[tag] = time.process_time() - t0
            for _ in range(2):
                outs[tag] = fns[tag](x).numpy()
        mo, mn = alternate(fns, x, a.reps)
        print(f"{name} {rows}x{cols} {tname} x {a.cols} columns: old {mo:.0f} us, new {mn:.0f} us, {mo / mn:.2f}x, "
              f"build old {build['old']:.2f} s, new {build['new']:.2f} s, "
              f"bitwise equal {np.array_equal(outs['old'], outs['new'])}")


if __name__ == "__main__":
    main()
