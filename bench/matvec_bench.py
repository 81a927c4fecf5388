"""The resident-block matvec (engine/quant.py) alone, per weight shape, type and GPU layout: GB/s of weight bytes.

    DEV=CUDA python3 bench/matvec_bench.py --shape 8b --types Q8_0,Q4_0 --layouts default,8:256,2:256
    DEV=CUDA python3 bench/matvec_bench.py --shape 1.1b --types Q8_0 --n 16 --wide 0,16,8 --as-engine
    DEV=CUDA python3 bench/matvec_bench.py --shape 8b --types Q4_0,Q8_0 --n 1 --tc

A layout is MESH_GPU_MV's value, written with ':' so the list can use commas (engine/matvec_gpu.py `gpu_layout`):
"naive" is a thread per row (engine/quant.py); "TW:THREADS" TW threads sharing a block's values, at most THREADS
threads a block; "default" is whatever the engine does unset. First, with --ceiling, a plain device copy of 1 GiB
(bytes read + written over time): the bandwidth ceiling. Each measurement replays, in one
TinyJit, the matvec over enough copies of the weight to exceed 256 MB (so the 60 MB L2 of an H200 holds none of
them between uses), and divides the replay's wall time by the number of matvecs: launch gaps of a replayed graph
included, as in a decode step. Random blocks with small f16 scales (bench/synth_gguf.py's generator); the result
is checked against numpy on the first copy. --n N: a batch of N columns (a batched decode step or a prefill chunk);
--wide crosses every layout with MESH_GPU_MV_WIDE values (0: the tiles of engine/matvec_gpu.py; "16", "8:2":
engine/matvec_gpu_wide.py's columns[:words] a thread block). --tc adds the tensor-core kernel (engine/matvec_gpu_tc.py,
plain matvecs of Q4_0/Q8_0) on the same weights in its own layout, with its time against the first layout's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # (rows, cols) of a decode step's matvecs, q/k/v and gate/up fused as the engine fuses them
    "tiny": {"a": (64, 256), "b": (48, 352)},
    "1.1b": {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632), "head": (32000, 2048)},
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "head": (128256, 4096)},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--types", default="Q8_0,Q4_0")
    ap.add_argument("--layouts", default="default")
    ap.add_argument("--ceiling", action="store_true")
    ap.add_argument("--as-engine", action="store_true", help="fuse as the engine does: the RMS norm into qkv, gate_up "
                    "and head, the residual add into o and down (checked against numpy alike)")
    ap.add_argument("--mats", default="", help="comma list of the shape's matrices (default all)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--n", type=int, default=1, help="columns a matvec (a batch)")
    ap.add_argument("--wide", default="", help="comma list of MESH_GPU_MV_WIDE values, ':' for ','")
    ap.add_argument("--tc", action="store_true", help="also the tensor-core kernel (engine/matvec_gpu_tc.py, its own "
                    "layout; Q4_0/Q8_0, plain): its time against the first layout's, and both errors against float64")
    ap.add_argument("--x8", action="store_true", help="with --tc: also the tensor-core kernel with x in 8 bits "
                    "(engine/matvec_gpu_s8.py), over the same weights")
    ap.add_argument("--tc-layouts", default="", help="comma list of SPLIT:WARPS[:UNROLL] for the tensor-core kernel "
                    "(MESH_GPU_TC_SPLIT, MESH_GPU_TC_WARPS, MESH_GPU_TC_UNROLL: warps over a row's blocks, warps a "
                    "grid keeps, blocks a warp takes a loop step)")
    a = ap.parse_args()
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
    from gguf.quants import dequantize
    from tinygrad import Device, Tensor, TinyJit
    from engine.quant import QuantWeight, interleave_for, repack
    from bench.synth_gguf import _matrix_chunks, _Random
    dev = Device.DEFAULT
    rng, unit = _Random(0), {}
    mats = a.mats.split(",") if a.mats else list(SHAPES[a.shape])
    rows_out = []
    if a.ceiling:
        src = Tensor.ones(1 << 28, dtype="uint32", device=dev).contiguous().realize()

        @TinyJit
        def copy(t: Tensor) -> Tensor:
            return (t ^ 1).realize()
        for _ in range(3):
            copy(src)
        Device[dev].synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            copy(src)
        Device[dev].synchronize()
        line = f"ceiling: copy of 1 GiB (read + write) {2 * src.nbytes() * 10 / (time.perf_counter() - t0) / 1e9:.0f} GB/s"
        print(line, flush=True)
        rows_out.append(line)
        del src
    for qt in a.types.split(","):
        for mname in mats:
            rows, cols = SHAPES[a.shape][mname]
            raw = np.concatenate(list(_matrix_chunks(rng, Q[qt], rows, cols, cols ** -0.5, unit))).reshape(rows, -1)
            nbytes = raw.nbytes
            copies = max(1, -(-(256 << 20) // nbytes)) if a.shape != "tiny" else 2
            rest, halfs = repack(raw, Q[qt], interleave_for(rows))
            ws = [QuantWeight(Tensor(rest, device=dev).contiguous().realize(), Tensor(halfs, device=dev).contiguous().realize(),
                              (rows, cols), Q[qt]) for _ in range(copies)]
            x_np = np.random.default_rng(1).standard_normal((a.n, cols)).astype(np.float32)
            x = Tensor(x_np, device=dev).realize()
            xin, kw, add = x_np.astype(np.float64), {}, 0.0
            if a.as_engine and mname in ("qkv", "gate_up", "head"):
                nw = np.random.default_rng(2).standard_normal(cols).astype(np.float32)
                kw["norm"] = (Tensor(nw, device=dev).realize(), 1e-5)
                xin = xin / np.sqrt((xin ** 2).mean(-1, keepdims=True) + 1e-5) * nw
            elif a.as_engine:
                r = np.random.default_rng(3).standard_normal((a.n, rows)).astype(np.float32)
                kw["residual"] = Tensor(r, device=dev).realize()
                add = r[:, :min(rows, 4096)]
            want = xin @ dequantize(raw[:min(rows, 4096)], Q[qt]).reshape(-1, cols).T.astype(np.float64) + add
            tcw = []
            if a.tc and not kw and not a.as_engine:
                from engine.matvec_gpu_tc import tc_repack, tc_supported
                if tc_supported(Q[qt], rows, cols):
                    words, scales = tc_repack(raw, Q[qt])
                    tcw = [(Tensor(words, device=dev).contiguous().realize(), Tensor(scales, device=dev).contiguous().realize())
                           for _ in range(copies)]
                    del words, scales
            del raw, rest, halfs
            first_us = first_err = None
            for layout, wide in [(lay, wd) for lay in a.layouts.split(",") for wd in (a.wide.split(",") if a.wide else [None])]:
                os.environ["MESH_GPU_MV"] = layout.replace(":", ",")
                if wide is not None:
                    os.environ["MESH_GPU_MV_WIDE"] = wide.replace(":", ",")
                label = layout if wide is None else f"{layout}/w{wide}"

                @TinyJit
                def step(x: Tensor) -> list[Tensor]:
                    return [w.matmul_t(x, **kw).realize() for w in ws]
                try:
                    compile_s, err, us = _time_step(step, x, want, a.reps, copies, dev)
                    first_us, first_err = (us, err) if first_us is None else (first_us, first_err)
                    line = (f"{qt:5s} {mname:8s} {rows:6d}x{cols:<6d} {nbytes / 1e6:8.1f} MB  {label:7s} {us:9.1f} us "
                            + (f"({us / a.n:6.2f} a column) " if a.n > 1 else "")
                            + f"{nbytes / us / 1e3:7.0f} GB/s  err {err:.1e}  ({copies} copies, first calls {compile_s:.1f} s)")
                except Exception as e:  # one layout failing must not hide the others
                    line = f"{qt:5s} {mname:8s} {rows:6d}x{cols:<6d} {label:7s} FAILED {type(e).__name__}: {str(e)[:200]}"
                print(line, flush=True)
                rows_out.append(line)
            for tcl in (a.tc_layouts.split(",") if a.tc_layouts else [""]) if tcw else []:
                if tcl:
                    os.environ["MESH_GPU_TC_SPLIT"], os.environ["MESH_GPU_TC_WARPS"], *u = tcl.split(":")
                    os.environ["MESH_GPU_TC_UNROLL"] = u[0] if u else "1"
                for x8 in (False, True) if a.x8 else (False,):
                    line = _time_tc(tcw, Q[qt], x, want, a.reps, copies, dev, f"{qt:5s} {mname:8s} {rows:6d}x{cols:<6d} "
                                    f"{nbytes / 1e6:8.1f} MB  {'s8' if x8 else 'tc'}{tcl:<8s} ", nbytes, a.n, first_us,
                                    first_err, x8)
                    print(line, flush=True)
                    rows_out.append(line)
            del ws, tcw
    print("\nsummary")
    print("\n".join(rows_out))


def _time_step(step, x, want, reps: int, copies: int, dev: str) -> tuple[float, float, float]:
    """(seconds of the first 3 calls: capture and compiles, the first output's error against float64 relative to
    its largest value, median us a copy over `reps` synchronized calls) of a jitted step over `copies` weights."""
    from tinygrad import Device
    t0 = time.perf_counter()
    for _ in range(3):
        outs = step(x)
    Device[dev].synchronize()
    compile_s = time.perf_counter() - t0
    got = outs[0].numpy()[:, :want.shape[1]]
    err = float(np.abs(got - want).max() / np.abs(want).max())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        step(x)
        Device[dev].synchronize()
        times.append((time.perf_counter() - t) / copies)
    return compile_s, err, statistics.median(times) * 1e6


def _time_tc(tcw, qtype, x, want, reps, copies, dev, head, nbytes, n, base_us, base_err, x8=False) -> str:
    """The tensor-core kernel over the same copies, timed as the layouts are; its error against float64 and its
    time as a ratio to the first layout's (today's kernel, same run). "err ok": within 2x the first layout's error
    (and 1e-6 of the largest output), else "err WORSE". `x8`: x quantized to 8 bits (engine/matvec_gpu_s8.py, the
    quantize kernel timed with it); its error is x's rounding (~1%), not judged."""
    from tinygrad import TinyJit
    from engine.matvec_gpu_s8 import s8_matmul_t, s8_renderer
    from engine.matvec_gpu_tc import tc_matmul_t
    if x8 and not s8_renderer(dev):
        return head + "skipped: this device's renderer has no s8 MMA"
    mm = s8_matmul_t if x8 else tc_matmul_t

    @TinyJit
    def step(x):
        return [mm(w, s, qtype, x).realize() for w, s in tcw]
    try:
        compile_s, err, us = _time_step(step, x, want, reps, copies, dev)
        ratio = f"  {base_us / us:5.2f}x the first layout" if base_us else ""
        ok = " (8-bit x)" if x8 else "" if base_err is None else " ok" if err <= max(2 * base_err, 1e-6) else " WORSE"
        return (head + f"{us:9.1f} us " + (f"({us / n:6.2f} a column) " if n > 1 else "")
                + f"{nbytes / us / 1e3:7.0f} GB/s  err {err:.1e}{ok}{ratio}  (first calls {compile_s:.1f} s)")
    except Exception as e:  # must not hide the other rows
        return head + f"FAILED {type(e).__name__}: {str(e)[:300]}"


if __name__ == "__main__":
    main()
