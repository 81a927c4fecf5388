"""Prefill on CPU: a GEMM over resident GGUF blocks that decodes each block once for all the step's columns.

The matvec (engine/quant.py `_matvec_kernel`) makes its whole pass once per column: with N columns every block is
decoded N times, and decoding (byte loads, shifts, int -> float) costs more than the multiply-adds it feeds, so a
16-column prefill chunk ran at ~7-10 GFLOPS on 2 cores. Here, per group of IL = 16 interleaved rows:

    accm[N][IL] = 0                                          every column's sums for these rows (stack memory)
    for each block:
        wb[value][IL] = q * d + m                            1. the block decoded once, into ~2 KB (16 KB K-quant)
        for each tile of T columns:                          2. multiplied into T columns at a time
            acc[T][IL] = accm[tile]                             T x IL accumulators in registers
            for each value j: acc[t][:] += wb[j][:] * x[column t, j]
            accm[tile] = acc
    out[column][rows] = accm (+ residual)

The inner loop is 2 vector loads of wb, T broadcasts of x and 2T 8-wide FMAs; with T = 4 the 8 accumulators, 2
weights and the broadcasts fit AVX2's 16 registers (clang's output, read with llvm-mca: 8 FMAs an iteration, no
spills; T = 8 spills there). With AVX-512 a row group is one 16-wide register and T = 8 (`default_tile`), and
GROUPS = 2 row groups run side by side (each block of both decoded, then the tile's 2 x T sums fed together): each
broadcast of x feeds 2 FMAs, and 16 independent chains are in flight instead of 8. The decode is amortized over all
N columns. How the C has to look for clang to vectorize it
(tinygrad leaves vectorization to clang's SLP and loop vectorizers), each found by reading the generated code:
  * wb and accm are REG placeholders, which tinygrad never groups into float4 accesses: a float4 store of the
    accumulators made SLP pick 4-wide vectors and spill half of them;
  * their indices are offset by one: tinygrad emits a run of stores base+1 ... base+15 with base+0 last, and
    clang 14's SLP then starts its vectors at lane 1 (shuffles, scalar FMAs); with every index base+k, k >= 1, the
    runs line up;
  * the decode's lane loop is a real loop, not an UPCAST: clang's loop vectorizer turns it into 8 bytes -> 8 floats
    per instruction group; unrolled lanes in a j loop were instead vectorized across j with byte gathers (5x slower).

The sum is the f32 path's: value = q * d + m in f32, times x, one chain per row and column in order of the
values; the CPU matvec (engine/quant.py) sums in exactly this order, so a column's result does not depend on how
many columns its step has (batch invariance without padding a lone decode column). A ragged last tile re-reads the
last column and its extra sums are never stored. The RMS norm of the input (and silu(gate) * up) run as a small
kernel before the GEMM (engine/cpu_kernels.py: the same expressions the matvec evaluates inline, so both multiply
the same floats): fused, they would be recomputed for every group of rows. Only the CPU takes this path (GPUs keep
their per-column matvec kernels), and one column (decode) takes the matvec.
"""
from __future__ import annotations

import functools
import os
import platform
from typing import TYPE_CHECKING

from tinygrad import Tensor, UOp, dtypes
from tinygrad.dtype import AddrSpace
from tinygrad.uop.ops import AxisType, KernelInfo

from . import cpu_kernels
from .cpu_runner import core_index

if TYPE_CHECKING:  # quant imports this module
    from .quant import BlockSpec

F32 = dtypes.float32
MAX_COLUMNS = 256  # columns per kernel: 16 KB of sums on a thread's stack (a step of several long runs is split)


def default_tile() -> int:
    """Columns per tile: T x IL accumulators in registers. 4 x 16 floats are 8 of AVX2's 16 registers and 16 of
    NEON's 32. With AVX-512 (tinygrad compiles for the host's own CPU, -march=native) 16 floats are one of 32
    registers: 4 columns leave 4 dependent FMA chains, fewer than the 2 FMA pipes x 4 cycles of latency keep busy,
    and 8 columns (8 chains) ran 1.12-1.2x faster on Zen 5 (bench/RESULTS.md, "First token"); 12 and 16 spilled.
    The tile never changes a column's sum (each column is summed alone, in order): outputs are bitwise the same.
    MESH_GEMM_TILE overrides it (A/B runs)."""
    if env := os.environ.get("MESH_GEMM_TILE"):
        return max(1, int(env))
    return 8 if _avx512() else 4


def _avx512() -> bool:
    """Whether this is an x86 CPU with AVX-512 (its /proc/cpuinfo flags; False where there is none)."""
    return "avx512f" in cpu_flags()


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The x86 CPU's feature flags from /proc/cpuinfo (empty on other machines and systems)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


_WIDE: set[str] = set()


def wide_vectors(device: str) -> None:
    """Have clang vectorize this CPU device's kernels 16 floats wide (zmm) on an AVX-512 host: tinygrad compiles
    with -march=native, and clang 14 takes its tuning from the CPU it names. For Intel server cores (this box: a
    Xeon that clang calls "rocketlake") that tuning prefers 256-bit vectors, so every kernel ran in ymm halves: the
    GEMM's tile of 8 columns was 16 ymm sums and 64 FMAs plus 32 broadcasts every 4 values; with zmm it is 8 sums
    and 32 FMAs with embedded broadcasts (the same C, read in clang's output). Zen 4/5 tunings prefer 512 already.
    Vector width changes no sum: each row's chain is the same operations in the same order (no reassociation
    without fast-math), so outputs are bitwise the same; the flag only goes into the device's default arch
    ("x86_64,native" -> tinygrad passes ",prefer-vector-width=512" on as -mprefer-vector-width=512), which is part
    of the renderer's target and so of every program cache key. A DEV that names an arch or another renderer
    (CPU:X86, CPU:LLVM) is left alone. Called where a CPU matmul's graph is built, before anything renders it;
    MESH_CPU_WIDE=0 keeps clang's own choice (A/B runs)."""
    if device in _WIDE:
        return
    _WIDE.add(device)
    if os.environ.get("MESH_CPU_WIDE", "1") == "0" or not _avx512():
        return
    from tinygrad import Device
    dev = Device[device]
    arch = getattr(dev, "arch", None)
    if type(dev.renderer).__name__ == "ClangRenderer" and isinstance(arch, str) and arch.startswith("x86_64,") \
            and "prefer-vector-width" not in arch:
        dev.arch = arch + ",prefer-vector-width=512"


TILE = default_tile()
SLICES_PER_THREAD = int(os.environ.get("MESH_GEMM_SLICES", "4"))  # core slices a thread (see `slices`)
UNROLL = int(os.environ.get("MESH_GEMM_UNROLL", "4"))  # values a step of the inner loop (see gemm_kernel)
# Row groups of il rows worked on at once (gemm_kernel). With AVX-512 and a tile of 8, 2 groups are 16 zmm sums and
# 8 of the decoded block's vectors, no spills (clang's output read): each x broadcast feeds 2 FMAs (40 loads per 64
# FMAs instead of 72) and 16 chains are in flight. An 8-column decode step 16.8-17.5 -> 15.6-16.4 ms (bench/RESULTS.md
# "Ninth session: the CPU GEMM at 8 streams"). AVX2 keeps 1: 2 x 4 columns x 2 ymm would not fit its 16 registers.
# A group's rows are summed exactly as alone: outputs bitwise the same for any GROUPS. MESH_GEMM_GROUPS overrides it.
GROUPS = int(os.environ.get("MESH_GEMM_GROUPS", "2" if _avx512() else "1"))


def gemm_kernel(name: str, spec: BlockSpec, threads: int, tile: int, residual: bool):
    def kernel(out: UOp, rest: UOp, halfs: UOp, x: UOp, *extra: UOp) -> UOp:
        G, nb, _, il = rest.shape
        N, E, W = x.shape[0], spec.sub * spec.width, spec.width
        T = min(tile, N)
        NT = -(-N // T)
        res = extra[0] if residual else None
        R = GROUPS if (G // threads) % GROUPS == 0 else 1
        core, gi = UOp.range(threads, 0, AxisType.GLOBAL), UOp.range(G // threads // R, 1)
        group = lambda r: core_index(core, threads) * (G // threads) + gi * R + r
        # the sums of every column for these R groups' rows, in memory (R x N x il floats): a tile's R x T x il
        # accumulators are loaded into registers for one block, then written back. accm and wb are indexed from 1
        accm = UOp.placeholder((R * NT * T * il + 1,), F32, 0, addrspace=AddrSpace.REG)
        z = UOp.range(R * NT * T * il + 1, 2)
        accm = accm.after(gi, core)[z].set(0.0, end=z)
        b = UOp.range(nb, 3, AxisType.REDUCE)
        byte = lambda k: rest[g, b, k, lane].cast(dtypes.int)
        half = lambda i: halfs[g, b, i, lane].cast(F32)
        # 1. decode the block of il rows of each of the R groups once: wb[group][value][lane] = q * d + m
        wb = UOp.placeholder((R * E * il + 1,), F32, 1, addrspace=AddrSpace.REG)
        decs = []
        for si in range(spec.sub):  # unrolled in Python: constant shifts and offsets per sub-block
            r = UOp.range(R, 60 + si, AxisType.UPCAST)
            g, j, lane = group(r), UOp.range(W, 10 + 2 * si), UOp.range(il, 11 + 2 * si)
            w = spec.q(byte, si, j).cast(F32) * spec.scale(byte, half, si)
            if spec.offset is not None:
                w = w + spec.offset(byte, half, si)
            decs.append(wb.after(accm, b)[((r * spec.sub + si) * W + j) * il + lane + 1].store(w).end(lane, j, r))
        wb = wb.after(*decs)
        # 2. multiply the decoded block into each tile of T columns. The il rows are a plain loop inside each step
        # (not an UPCAST that tinygrad writes out): clang's loop vectorizer makes them one vector (two with AVX2)
        # per column, and keeps the tile's T sums in registers across the values
        nt, t, r = UOp.range(NT, 4), UOp.range(T, 6, AxisType.UPCAST), UOp.range(R, 95, AxisType.UPCAST)
        col = nt * T + t
        n = (col < N).where(col, N - 1) if N % T else col  # a ragged last tile re-reads the last column
        acc = UOp.placeholder((R * T * il,), F32, 2, addrspace=AddrSpace.REG)
        lane = UOp.range(il, 150)  # ids above the decode's (10 + 2 * sub)
        ai, mi = (r * T + t) * il + lane, (r * NT * T + col) * il + lane + 1
        acc = acc.after(nt, b)[ai].set(accm.after(wb)[mi], end=lane)
        # the values in order, UNROLL at a time in one loop step (unrolled here, so the sums keep their order): a
        # loop of one value a step made clang copy every accumulator and broadcast once a step (FMAs of the 213
        # form, the last step peeled), ~20% of the kernel's time on Zen 5
        U = UNROLL if E % UNROLL == 0 else 1
        jo, lane = UOp.range(E // U, 7, AxisType.REDUCE), UOp.range(il, 151)
        ai = (r * T + t) * il + lane
        val = acc.after(jo)[ai]
        for u in range(U):
            jj = jo * U + u
            val = val + wb[(r * E + jj) * il + lane + 1] * x[n, b * E + jj]
        acc = acc[ai].set(val, end=(lane, jo))
        lane = UOp.range(il, 152)
        back = accm[(r * NT * T + col) * il + lane + 1].store(acc[(r * T + t) * il + lane]).end(lane, t, r) \
            .end(nt).end(b)
        # 3. the real columns out, with the residual
        r, c, ls = UOp.range(R, 96), UOp.range(N, 8), UOp.range(il, 9, AxisType.UPCAST)
        row = group(r) * il + ls
        y = accm.after(back)[(r * NT * T + c) * il + ls + 1]
        if res is not None:
            y = y + res[c, row]
        return out[c, row].store(y).end(ls).end(c).end(r).end(gi, core).sink(
            arg=KernelInfo(name=f"mm_{name}_{G}x{il}_{nb}_t{T}", opts_to_apply=()))
    return kernel


def slices(groups: int, threads: int) -> int:
    """How many core slices a GEMM's row groups are cut into: the largest divisor of `groups` not above
    SLICES_PER_THREAD x threads. The step runner hands slices to whichever thread claims them (engine/cpu_runner.py),
    so with more slices than threads a thread that the OS takes away for a while (a shared machine) holds back one
    small slice, not half the kernel. A slice is whole row groups: outputs are bitwise the same for any count."""
    limit = max(1, threads) * SLICES_PER_THREAD
    return next(t for t in range(min(limit, groups), 0, -1) if groups % t == 0)


def enabled(x_rows: int, device: str) -> bool:
    """Whether a matmul of x_rows columns on `device` takes the GEMM: more than one column, on the CPU.
    MESH_PREFILL_GEMM=0 keeps the matvec for every column count (A/B runs)."""
    return x_rows > 1 and device.startswith("CPU") and os.environ.get("MESH_PREFILL_GEMM", "1") != "0"


def gemm_t(rest: Tensor, halfs: Tensor, spec: BlockSpec, name: str, rows: int, threads: int, x: Tensor, *,
           norm: tuple[Tensor, float] | None = None, glu: bool = False, residual: Tensor | None = None,
           tile: int = TILE) -> Tensor:
    """x (N, cols) @ W.T -> (N, rows) f32 for W's resident blocks (rest, halfs); the same options as
    `QuantWeight.matmul_t`: an RMS norm of x by (weight, eps), silu(gate) * up of x = [gate | up], a residual."""
    x = x.cast(F32)
    if glu:  # silu(gate) * up, bitwise the Tensor expression, as a plain loop (engine/cpu_kernels.py)
        x = cpu_kernels.glu(x)
    if norm is not None:  # x * 1/sqrt(mean(x^2) + eps) * weight, bitwise the Tensor expression, in one kernel
        x = cpu_kernels.rms_norm_rows(x, norm[0], norm[1])
    if x.shape[0] > MAX_COLUMNS:  # the sums of all columns sit on the stack of each core's thread: bound them
        parts = [gemm_t(rest, halfs, spec, name, rows, threads, x[i:i + MAX_COLUMNS], tile=tile,
                        residual=None if residual is None else residual[i:i + MAX_COLUMNS])
                 for i in range(0, x.shape[0], MAX_COLUMNS)]
        return parts[0].cat(*parts[1:], dim=0)
    out = Tensor.empty(x.shape[0], rows, dtype=F32, device=rest.device)
    extra = [residual.cast(F32).contiguous()] if residual is not None else []
    fxn = gemm_kernel(name, spec, slices(rest.shape[0], threads), tile, residual is not None)
    return Tensor.custom_kernel(out, rest, halfs, x.contiguous(), *extra, fxn=fxn)[0]
