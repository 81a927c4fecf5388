"""Probe (eleventh session): the tensor-core matvec with x split by a kernel of its own, on CUDA, step by step:
the split kernel alone (eager, then in a TinyJit's graph), then the matvec that reads it, so a failure names the
part. DEV=CUDA python3 bench/tc_split_probe.py"""
import os
import sys
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from gguf import GGMLQuantizationType as Q
    from tinygrad import Device, Tensor, TinyJit, dtypes
    from engine.matvec_gpu_tc import tc_matmul_t, tc_repack, tc_split_kernel
    from tests.test_engine_quant import blocks_of
    dev = Device.DEFAULT
    N, C, rows = 16, 2048, 256
    x = Tensor(np.random.default_rng(0).standard_normal((N, C)).astype(np.float32), device=dev).realize()

    def split():
        xp = Tensor.empty(3 * N * C, dtype=dtypes.bfloat16, device=dev)
        return Tensor.custom_kernel(xp, x, fxn=tc_split_kernel("q8_0", Q.Q8_0, False))[0]
    for what, fn in (("split eager", lambda: split().realize()),):
        try:
            fn(); Device[dev].synchronize(); print(what, "ok", flush=True)
        except Exception:
            print(what, "FAILED"); traceback.print_exc()
    words, scales = tc_repack(blocks_of("Q8_0", rows, C), Q.Q8_0)
    w = (Tensor(words, device=dev).realize(), Tensor(scales, device=dev).realize())
    for pre in ("0", "1"):
        os.environ["MESH_GPU_TC_PRESPLIT"] = pre
        try:
            y = tc_matmul_t(*w, Q.Q8_0, x).realize(); Device[dev].synchronize()
            print(f"matvec eager presplit={pre} ok", float(y.numpy().sum()), flush=True)
        except Exception:
            print(f"matvec eager presplit={pre} FAILED"); traceback.print_exc()

        @TinyJit
        def f(x):
            return tc_matmul_t(*w, Q.Q8_0, x).realize()
        try:
            for _ in range(3):
                y = f(x)
            Device[dev].synchronize()
            print(f"matvec jit presplit={pre} ok", float(y.numpy().sum()), flush=True)
        except Exception:
            print(f"matvec jit presplit={pre} FAILED"); traceback.print_exc()


if __name__ == "__main__":
    main()
