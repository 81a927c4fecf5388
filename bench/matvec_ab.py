"""The CPU matvec kernel (engine/quant.py `_matvec_kernel`) of a git revision against the working tree's, in one process.

    MESH_CPU_THREADS=1 .venv/bin/python bench/matvec_ab.py --base HEAD~1 [--mats gate_up,head] [--reps 15]

SmolLM2-135M's decode shapes (Q4_1 layers, the Q8_0 head), random blocks with small f16 scales, fused as the
engine fuses them (the RMS norm into qkv, gate_up and head). Each kernel runs in a TinyJit; old and new alternate,
so a noisy box slows both alike. Prints median microseconds, their ratio, and whether the outputs are bitwise equal.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHAPES = {"gate_up": (3072, 576, "Q4_1"), "down": (576, 1536, "Q4_1"), "qkv": (960, 576, "Q4_1"),
          "head": (49152, 576, "Q8_0"),
          # other resident types at a Q4_K_M-like layer's shapes (Gemma 3 270M: dim 640, ffn 2048)
          "q4_k": (4096, 1024, "Q4_K"), "q5_k": (4096, 1024, "Q5_K"), "q6_k": (1024, 2048, "Q6_K"),
          "q4_0": (4096, 1024, "Q4_0"), "q5_0": (4096, 1024, "Q5_0"), "q5_1": (4096, 1024, "Q5_1"),
          "q8_0": (4096, 1024, "Q8_0")}


def random_weight(rows: int, cols: int, tname: str, rng: np.random.Generator):
    """A resident quant weight (engine/quant.py QuantWeight) of random blocks whose f16 scales are small and finite."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
    from tinygrad import Tensor
    from engine import quant
    t = Q[tname]
    bs, bb = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (rows, cols // bs * bb), dtype=np.uint8)
    for off in quant.HALF_FIELDS[t]:
        scales = rng.uniform(-0.01, 0.01, (rows, cols // bs)).astype(np.float16)
        raw.reshape(rows, -1, bb)[:, :, off:off + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
    rest, halfs = quant.repack(raw, t, 16)
    return quant.QuantWeight(Tensor(rest).realize(), Tensor(halfs).realize(), (rows, cols), t)


def alternate(fns: dict, x, reps: int) -> tuple[float, float]:
    """Median microseconds of fns["old"](x) and fns["new"](x), run in alternating order so a noisy box slows both."""
    from tinygrad import Device
    ts: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(reps):
        for tag in ("old", "new") if r % 2 else ("new", "old"):
            t0 = time.perf_counter()
            fns[tag](x)
            Device["CPU"].synchronize()
            ts[tag].append(time.perf_counter() - t0)
    return statistics.median(ts["old"]) * 1e6, statistics.median(ts["new"]) * 1e6


def base_module(rev: str, name: str) -> types.ModuleType:
    """engine/<name>.py as it is at git revision `rev`, loaded as the module <name>_base (its relative imports
    written as absolute ones of the engine package): the old kernel of an A/B run against the working tree's."""
    src = subprocess.check_output(["git", "-C", str(ROOT), "show", f"{rev}:engine/{name}.py"], text=True)
    src = re.sub(r"^(\s*)from \.(\w*) import", lambda m: f"{m[1]}from engine{'.' + m[2] if m[2] else ''} import", src,
                 flags=re.M)
    mod = types.ModuleType(f"{name}_base")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(src, f"{mod.__name__}.py", "exec"), mod.__dict__)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD", help="git revision whose engine/quant.py is the old kernel")
    ap.add_argument("--mats", default="gate_up,down,qkv,head", help=f"of {','.join(SHAPES)}")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    from tinygrad import Tensor, TinyJit
    from engine import quant
    old = base_module(a.base, "quant")
    kernels = {"old": old._matvec_kernel, "new": quant._matvec_kernel}
    rng = np.random.default_rng(0)
    for name in a.mats.split(","):
        rows, cols, tname = SHAPES[name]
        w = random_weight(rows, cols, tname, rng)
        x = Tensor(rng.standard_normal((1, cols)).astype(np.float32)).realize()
        nw = Tensor(rng.standard_normal(cols).astype(np.float32)).realize()
        kw = {} if name == "down" else {"norm": (nw, 1e-5)}
        fns, outs = {}, {}
        for tag, k in kernels.items():
            quant._matvec_kernel = k  # matmul_t looks it up when its graph is built
            fns[tag] = TinyJit(lambda x: w.matmul_t(x, **kw).realize())
            for _ in range(3):
                outs[tag] = fns[tag](x).numpy()
        mo, mn = alternate(fns, x, a.reps)
        print(f"{name} {rows}x{cols} {tname}: old {mo:.0f} us, new {mn:.0f} us, {mo / mn:.2f}x, "
              f"bitwise equal {np.array_equal(outs['old'], outs['new'])}")


if __name__ == "__main__":
    main()
