"""The GPU matvec (engine/matvec_gpu.py) rendered for CUDA and compiled for Hopper here, without a GPU: its SASS
instruction mix per weight value of the block loop, so a kernel change is judged before any device time.

    PATH=$PATH:/usr/local/cuda/bin:/tmp/nvd/nvidia/cu13/bin .venv/bin/python bench/matvec_sass.py \
        --types Q4_0,Q8_0 --rows 256 --cols 4096 [--n 1,16] [--show]

Needs nvcc (CUDA's compiler, to make a cubin for sm_90) and nvdisasm (the pip package nvidia-cuda-nvdisasm holds
one). The kernel is built on tinygrad's PYTHON device as the engine builds it (QuantWeight.matmul_t), rendered by
tinygrad's CUDA renderer, compiled by `nvcc -cubin -arch=sm_90` (the device compiles the same source through NVRTC
to PTX and the driver's ptxas: the same compiler generation, not the same binary). The block loop is the innermost
backward branch of the SASS; per weight value and column = its instructions / (values a thread decodes per pass x
the columns it takes: a batch's tile, MESH_GPU_MV_COLS or MESH_GPU_MV_WIDE).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def kernel_source(qtype: str, rows: int, cols: int, n: int, mode: str, tc: bool = False) -> tuple[str, str]:
    from gguf import GGMLQuantizationType as Q
    from tinygrad import Tensor
    from tinygrad.codegen import to_program
    from tinygrad.helpers import Target
    from tinygrad.renderer.cstyle import CUDARenderer
    from tinygrad.uop.ops import Ops
    from engine.quant import QuantWeight, interleave_for, repack
    from tests.test_engine_quant import blocks_of
    if tc:  # engine/matvec_gpu_tc.py: its own layout and kernel
        from engine.matvec_gpu_tc import tc_matmul_t, tc_repack
        words, scales = tc_repack(blocks_of(qtype, rows, cols), Q[qtype])
        kw = {"norm": (Tensor(np.ones(cols, np.float32), device="PYTHON"), 1e-5)} if mode == "norm" else {}
        out = tc_matmul_t(Tensor(words, device="PYTHON").realize(), Tensor(scales, device="PYTHON").realize(), Q[qtype],
                          Tensor(np.zeros((n, cols), np.float32), device="PYTHON").realize(), **kw)
        lin, _ = out.linear_with_vars()
        ast = next(u for u in lin.toposort() if u.op is Ops.SINK and getattr(u.arg, "name", "").startswith("mvtc_"))
        prg = to_program(ast, CUDARenderer(Target.parse("CUDA:CUDA:sm_90"), use_nvcc=True))
        return ast.arg.name, next(s.arg for s in prg.src if s.op is Ops.SOURCE)
    rest, halfs = repack(blocks_of(qtype, rows, cols), Q[qtype], interleave_for(rows))
    w = QuantWeight(Tensor(rest, device="PYTHON").realize(), Tensor(halfs, device="PYTHON").realize(), (rows, cols),
                    Q[qtype])
    x = Tensor(np.zeros((n, cols), np.float32), device="PYTHON").realize()
    kw = {"norm": (Tensor(np.ones(cols, np.float32), device="PYTHON"), 1e-5)} if mode == "norm" else {}
    lin, _ = w.matmul_t(x, **kw).linear_with_vars()
    ast = next(u for u in lin.toposort() if u.op is Ops.SINK and getattr(u.arg, "name", "").startswith(("mv_", "mvw_")))
    prg = to_program(ast, CUDARenderer(Target.parse("CUDA:CUDA:sm_90"), use_nvcc=True))
    return ast.arg.name, next(s.arg for s in prg.src if s.op is Ops.SOURCE)


def sass(src: str) -> tuple[str, str]:
    """(ptxas's resource line: registers, spills; the disassembly) of the source compiled for sm_90."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.cu").write_text(src)
        info = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", f"{d}/k.cubin", f"{d}/k.cu", "-Xptxas", "-v"],
                              check=True, capture_output=True, text=True).stderr
        out = subprocess.run(["nvdisasm", "-c", f"{d}/k.cubin"], check=True, capture_output=True, text=True).stdout
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    return f"{regs.group(1) if regs else '?'} registers, {spill.group(1) if spill else '?'} bytes spilled", out


def loop_mix(text: str) -> tuple[collections.Counter, int]:
    """Opcodes of the innermost loop: the instructions between the shortest backward branch and its label."""
    ins, labels = [], {}  # (address, line); label -> address of the next instruction
    pending = []
    for ln in text.splitlines():
        if m := re.match(r"^(\.L_x_\d+):", ln.strip()):
            pending.append(m.group(1))
        elif m := re.search(r"/\*([0-9a-f]{4})\*/\s+(.*)", ln):
            a = int(m.group(1), 16)
            for lb in pending:
                labels[lb] = a
            pending = []
            ins.append((a, m.group(2)))
    best = None
    for a, body in ins:
        if (m := re.search(r"\bBRA\b.*\((\.L_x_\d+)\)", body)) and labels.get(m.group(1), a) < a:
            if best is None or a - labels[m.group(1)] < best[1] - best[0]:
                best = (labels[m.group(1)], a)
    mix = collections.Counter()
    for a, body in ins:
        if best and best[0] <= a <= best[1]:
            op = re.sub(r"^(@!?U?P\w+\s+)", "", body.strip()).split()[0].rstrip(";")
            mix[op.split(".")[0]] += 1
    return mix, (best[1] - best[0]) // 16 + 1 if best else 0


INT = {"LOP3", "SHF", "IADD3", "IMAD", "PRMT", "BFE", "LEA", "ISETP", "IABS", "I2FP", "F2I", "IMNMX", "SEL", "BMSK",
       "VIADD"}
FP = {"FFMA", "FADD", "FMUL", "HADD2", "HFMA2", "FSEL", "FMNMX", "F2F", "F2FP"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_0,Q8_0")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--n", default="1", help="columns (batch) to render, comma separated")
    ap.add_argument("--mode", default="plain", choices=["plain", "norm"])
    ap.add_argument("--show", action="store_true", help="print the CUDA source and the loop's SASS")
    ap.add_argument("--tc", action="store_true", help="the tensor-core kernel (engine/matvec_gpu_tc.py)")
    a = ap.parse_args()
    from engine.matvec_gpu import gpu_layout
    from engine.quant import SPECS
    from gguf import GGMLQuantizationType as Q
    for qt in a.types.split(","):
        spec = SPECS[Q[qt]]
        for n in (int(v) for v in a.n.split(",")):
            name, src = kernel_source(qt, a.rows, a.cols, n, a.mode, a.tc)
            regs, text = sass(src)
            mix, _ = loop_mix(text)
            if a.tc:  # a lane decodes 16 values a tile and block, R tiles (r<R> in the name), U blocks a loop step
                # (u<U>, MESH_GPU_TC_UNROLL); a column tile of 8
                m = re.search(r"r(\d+)n\d+x?(?:u(\d+))?$", name)
                vals, tot = 16 * int(m.group(1)) * int(m.group(2) or 1), sum(mix.values())
                i = sum(v for k, v in mix.items() if k in INT)
                f = sum(v for k, v in mix.items() if k in FP)
                print(f"{qt} n={n} {name}: {regs}; loop {tot} instructions for {vals} values a lane: {tot / vals:.2f} a "
                      f"value ({i / vals:.2f} integer, {f / vals:.2f} float, {mix['HMMA'] / vals:.2f} HMMA); "
                      + " ".join(f"{k}:{v}" for k, v in mix.most_common()))
                if a.show:
                    print(src)
                    print(text)
                continue
            nb = a.cols // (spec.sub * spec.width)
            tw, p, bu = gpu_layout(nb, spec.width, a.rows)
            # lanes (rows a thread: 16, or r<R> in the batch kernel's name) x values a thread decodes per loop pass
            lanes = int(m.group(1)) if (m := re.search(r"r(\d+)c\d+$", name)) else 16
            tile = int(m.group(1)) if (m := re.search(r"c(\d+)$", name)) else 1  # columns a thread takes
            vals = lanes * bu * spec.sub * (spec.width // tw) * tile
            tot = sum(mix.values())
            i = sum(v for k, v in mix.items() if k in INT)
            f = sum(v for k, v in mix.items() if k in FP)
            print(f"{qt} n={n} {name}: {regs}; loop {tot} instructions for {vals // tile} lane-values x {tile} "
                  f"columns: {tot / vals:.2f} a value and column ({i / vals:.2f} integer, {f / vals:.2f} float); "
                  + " ".join(f"{k}:{v}" for k, v in mix.most_common()))
            if a.show:
                print(src)
                print(text)


if __name__ == "__main__":
    main()
