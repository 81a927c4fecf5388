"""The GPU split attention's kernels (engine/paged_attention.py) rendered for CUDA and compiled for Hopper here,
without a GPU: each kernel's SASS instruction mix for a step of one run (a sequence alone) and of two runs (beside
another), for this tree and for an earlier commit's engine/paged_attention.py, side by side.

    PATH=$PATH:/usr/local/cuda/bin:/tmp/nvd/nvidia/cu13/bin .venv/bin/python bench/attn_sass.py \
        [--before REF] [--shape 8b|tiny]

Why: batch invariance (a column's bits alone = beside others) needs the same floating-point operations in both
kernels. nvcc contracts `a*b + c` into an FFMA wherever it sees one, so a mask that tinygrad folds away in one
shape and not the other shows up here as FFMA/FMUL/FADD counts that differ between the two columns (seventh
session, before the fix: the tiny shape's part kernel had 1 FFMA alone, 0 beside). The total is a rough cost
only: the kernel mostly waits on its loads. Needs nvcc and nvdisasm (as bench/matvec_sass.py).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"tiny": (2, 1, 32, 32), "8b": (32, 8, 128, 4096)}  # heads, kv heads, head_dim, max_context
KEYS = ("FFMA", "FMUL", "FADD", "FSEL", "FSETP", "FMNMX", "MUFU", "LDG", "LDS", "STS")


def module_at(ref: str):
    """engine/paged_attention.py as it was at `ref`, imported as a module of the engine package."""
    text = subprocess.run(["git", "show", f"{ref}:engine/paged_attention.py"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "paged_attention_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("engine._paged_attention_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def sources(mod, runs: tuple[int, ...], H: int, KvH: int, Hd: int, maxc: int, B: int = 16, slots: int = 4):
    """{kernel kind: CUDA source} of one attention call built on the PYTHON device as a stage builds it."""
    from tinygrad import Tensor, UOp
    from tinygrad.codegen import to_program
    from tinygrad.helpers import Target
    from tinygrad.renderer.cstyle import CUDARenderer
    from tinygrad.uop.ops import Ops

    def dev(a):
        return Tensor(a, device="PYTHON").realize()
    rows = (slots * maxc // B + 1) * B
    q = dev(np.zeros((sum(runs), H * Hd), np.float32))
    pk, pv = (dev(np.zeros((rows, KvH * Hd), np.float32)) for _ in range(2))
    table = dev(np.zeros((slots, maxc // B), np.int32))
    rr, col = [], 0
    for i, n in enumerate(runs):
        rr.append(mod.Run(col, n, UOp.variable(f"slot{i}", 0, slots - 1).bind(0),
                          UOp.variable(f"pos{i}", 0, maxc - 1).bind(0)))
        col += n
    out = mod.paged_attention(q, pk, pv, table, rr, UOp.variable("ctx", 0, maxc).bind(1), maxc, B, H, KvH, Hd,
                              Hd ** -0.5)
    lin, _ = out.linear_with_vars()
    found = {}
    for ast in lin.toposort():
        if ast.op is Ops.SINK and getattr(ast.arg, "name", "").startswith("attn_"):
            prg = to_program(ast, CUDARenderer(Target.parse("CUDA:CUDA:sm_90"), use_nvcc=True))
            found[ast.arg.name.split("_")[1]] = next(s.arg for s in prg.src if s.op is Ops.SOURCE)
    return found


def mix(src: str) -> collections.Counter:
    from bench.matvec_sass import sass
    _, text = sass(src)
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", text)
    return collections.Counter(ops)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="bc92061", help="the commit to compare with (default: before the fix)")
    ap.add_argument("--shape", default="8b,tiny")
    a = ap.parse_args()
    import engine.paged_attention as after
    trees = (("before " + a.before, module_at(a.before)), ("after", after))
    for shape in a.shape.split(","):
        H, KvH, Hd, maxc = SHAPES[shape]
        print(f"{shape}: {H} heads, {KvH} kv heads, head_dim {Hd}, max_context {maxc}")
        for tag, mod in trees:
            per = {runs: sources(mod, runs, H, KvH, Hd, maxc) for runs in ((1,), (1, 1))}
            for kind in per[(1,)]:
                counts = [mix(per[runs][kind]) for runs in ((1,), (1, 1))]
                fp = [tuple(c[k] for k in ("FFMA", "FMUL", "FADD")) for c in counts]
                for runs, c in zip(("alone ", "beside"), counts):
                    print(f"  {tag:16s} {kind:8s} {runs} total {sum(c.values()):5d}  "
                          + " ".join(f"{k} {c[k]}" for k in KEYS))
                print(f"  {tag:16s} {kind:8s} FFMA/FMUL/FADD alone {fp[0]} beside {fp[1]}: "
                      + ("same" if fp[0] == fp[1] else "DIFFER"))


if __name__ == "__main__":
    main()
