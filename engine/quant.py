"""GGUF block-quantized weights kept resident at their file size and decoded inside the matmul kernels.

A weight's GGUF blocks are split once at load into their float16 fields (the block scales) and the rest of their
bytes (quants, packed sub-block scales), and IL consecutive rows are put side by side:

    file:      (rows, blocks, block_bytes)                      one row's blocks after another
    resident:  bytes  (rows // IL, blocks, rest_bytes, IL) uint8
               halfs  (rows // IL, blocks, n_halfs, IL)   float16

Nothing is widened: the resident bytes equal the file's. Why this layout: a matvec reads, for IL rows at once, the
same byte of the same block. Those IL bytes (and the IL scales) are one contiguous load, and the IL rows are
independent accumulators, so the C compiler turns them into SIMD lanes without reassociating any float sum (clang
does not reorder float adds at -O2). Read along a row instead, a block's products must be summed horizontally and
stay scalar: the old int8 path streamed ~1.5 GB/s that way. Scales read from inside the blocks cost two byte loads,
a shift and a bitcast per row and block; apart, they are one vector load and conversion (3.7 -> 2.1 ms for a
4096x4096 Q4_1 matvec on 2 cores).

On the CPU a row's sum is one chain over its values in order, acc += (q * d + m) * x with value = q * d + m per
sub-block in f32: the order of the prefill GEMM (engine/quant_gemm.py), so a column gets the same bits in a step of
any width (batch invariance). The GPU matvecs sum q * x within a sub-block first and scale once (llama.cpp's
order); they take every width one column at a time. Quants of one byte plane (low nibbles, high nibbles) are
multiplied with the matching slice of x rather than gathered into one array, which would cost a select per element. The layouts follow ggml's
(ggml-common.h); every type is checked against gguf's own numpy dequantizer in the tests.
"""
from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.dtype import AddrSpace
from tinygrad.uop.ops import AxisType, KernelInfo

from .cpu_runner import core_index, cpu_threads

from engine import quant_gemm, quant_i8
from engine.matvec_gpu import gpu_matvec_kernel, magic_word
from engine.matvec_gpu_s8 import s8_matmul_t, s8_renderer, x8_wanted
from engine.matvec_gpu_tc import tc_matmul_t, tc_unpack

F32 = dtypes.float32
# byte offsets of each type's float16 fields inside its block; the remaining bytes keep their order
HALF_FIELDS: dict[int, tuple[int, ...]] = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}
# ---- the matvec kernel, written in UOps
#
# Each type is described by how its block splits into sub-blocks and how to read one value: `q(byte, s, j)` is
# the integer quant of value j of sub-block s (an int32 UOp; byte(k) loads rest byte k of this block and lane),
# `scale` and `offset` give that sub-block's d and m (float UOps; half(i) is float16 field i), value = q * d + m.

Load = Callable[[UOp], UOp]


@dataclass(frozen=True)
class BlockSpec:
    sub: int  # sub-blocks per block
    width: int  # values per sub-block
    q: Callable[[Load, int, UOp], UOp]  # (byte, sub-block, value index range)
    scale: Callable[[Load, Load, int], UOp]  # (byte, half, sub-block)
    offset: Callable[[Load, Load, int], UOp] | None = None


def _nib(byte: UOp, high: int) -> UOp:  # the low (high=0) or high (high=1) nibble
    return (byte >> (high * 4)) & 15


def _fifth(qh: Load, k: UOp) -> UOp:  # bit k of the 32 fifth bits, moved to bit 4
    return ((qh(k >> 3) >> (k & 7)) & 1) << 4


def _signed(byte: UOp) -> UOp:  # an int8 read as unsigned, back to its signed value
    return byte - ((byte >> 7) << 8)


def _k_scale(byte: Load, s: int, mins: bool) -> UOp:
    """Six-bit scale (or min) of sub-block s packed in 12 bytes (Q4_K, Q5_K): entries 0-3 in the low 6 bits of
    bytes 0-3 (scales) / 4-7 (mins); entries 4-7 from the nibbles of bytes 8-11 plus the top 2 bits of bytes 0-7."""
    if s < 4:
        return (byte(s + (4 if mins else 0)) & 63).cast(F32)
    low, high = byte(s - 4 + (4 if mins else 0)), byte(4 + s)
    return (((high >> 4) if mins else (high & 15)) | ((low >> 6) << 4)).cast(F32)


def _q6_k(byte: Load, s: int, j: UOp) -> UOp:
    """Q6_K sub-block s of 16: half n = s//8, quarter k = (s//2)%4, lane l = 16(s%2) + j. Low 4 bits from nibble
    k//2 of byte 64n + 32(k%2) + l, high 2 bits from bits 2k of byte 128 + 32n + l; values are offset by 32."""
    n, k, lane = s >> 3, (s >> 1) & 3, ((s & 1) << 4) + j
    low = _nib(byte(n * 64 + (k & 1) * 32 + lane), k >> 1)
    high = (byte(128 + n * 32 + lane) >> (k * 2)) & 3
    return (low | (high << 4)) - 32


def _d(byte, half, s): return half(0)
def _m(byte, half, s): return half(1)


SPECS: dict[int, BlockSpec] = {
    # 16 bytes of nibbles: value j is the low nibble of byte j, value 16+j the high one (sub-block = nibble)
    Q.Q4_0: BlockSpec(2, 16, lambda b, s, j: _nib(b(j), s), _d, lambda b, h, s: h(0) * -8),
    Q.Q4_1: BlockSpec(2, 16, lambda b, s, j: _nib(b(j), s), _d, _m),
    # 4 bytes of fifth bits (bit k: value k), then 16 bytes of nibbles
    Q.Q5_0: BlockSpec(2, 16, lambda b, s, j: _nib(b(4 + j), s) | _fifth(b, s * 16 + j), _d, lambda b, h, s: h(0) * -16),
    Q.Q5_1: BlockSpec(2, 16, lambda b, s, j: _nib(b(4 + j), s) | _fifth(b, s * 16 + j), _d, _m),
    Q.Q8_0: BlockSpec(1, 32, lambda b, s, j: _signed(b(j)), _d),
    # 256 values, 8 sub-blocks of 32: 12 bytes of scales/mins, (Q5_K: 32 bytes of fifth bits, bit s of byte j),
    # 128 bytes of nibbles: chunk c of 32 bytes holds sub-block 2c in its low nibbles and 2c+1 in its high ones
    Q.Q4_K: BlockSpec(8, 32, lambda b, s, j: _nib(b(12 + (s >> 1) * 32 + j), s & 1),
                      lambda b, h, s: h(0) * _k_scale(b, s, False), lambda b, h, s: h(1) * -_k_scale(b, s, True)),
    Q.Q5_K: BlockSpec(8, 32, lambda b, s, j: _nib(b(44 + (s >> 1) * 32 + j), s & 1) | (((b(12 + j) >> s) & 1) << 4),
                      lambda b, h, s: h(0) * _k_scale(b, s, False), lambda b, h, s: h(1) * -_k_scale(b, s, True)),
    Q.Q6_K: BlockSpec(16, 16, _q6_k, lambda b, h, s: h(0) * _signed(b(192 + s)).cast(F32)),
}
DOTS = SPECS  # the types whose blocks stay resident and are decoded in the kernel


@dataclass(frozen=True)
class Fused:
    """What a matvec does around its dot products, so that the ops next to a linear layer cost no kernel of their own:
    `norm` eps: x is RMS-normalized with a weight first (computed per group of rows: ~1/16 of the products);
    `glu`: x holds [gate | up] and the input is silu(gate) * up; `residual`: the output adds a residual."""
    norm: float | None = None
    glu: bool = False
    residual: bool = False


LOG2E = 1.4426950408889634


def fused_input(x: UOp, n: UOp, C: int, fused: Fused, norm_w: UOp | None, resets: tuple[UOp, ...]):
    """idx -> value idx of column n of the matvec's input, with `fused`'s norm or glu applied to x (N, C or 2C): the
    same expressions, op for op, as the kernels the GEMM's input goes through first (engine/cpu_kernels.py: a row's
    sum of squares in order, (x / sqrt(ss / C + eps)) * w; silu(gate) * up), so both multiply the same floats
    (tests/test_engine_gemm.py checks it bitwise). The norm's sum of squares is a serial chain per column, its reset
    tied to `resets` (the loops around)."""
    if fused.norm is not None:
        ss = UOp.placeholder((1,), F32, 60, addrspace=AddrSpace.REG)
        c = UOp.range(C, 60, AxisType.REDUCE)
        ss = ss.after(*resets)[0].set(0.0)
        ss = ss[0].set(ss.after(c)[0] + x[n, c] * x[n, c], end=c)
        inv = (ss[0] * (1.0 / C) + fused.norm).sqrt().reciprocal()

    def xv(idx: UOp) -> UOp:
        if fused.glu:
            gate = x[n, idx]
            return gate * (1.0 + (gate * -LOG2E).exp2()).reciprocal() * x[n, idx + C]
        return x[n, idx] * inv * norm_w[idx] if fused.norm is not None else x[n, idx]
    return xv


# The CPU matvec sums in the prefill GEMM's order (engine/quant_gemm.py), so a column's result is bitwise the same
# whether its step has one column (this kernel) or several (the GEMM): for each row, one chain over the values in
# order, acc += (q * d + m) * x, each value decoded to f32 as the GEMM decodes it. That chain is serial (4 cycles
# an FMA), so GROUPS groups of IL rows are worked on at once: independent chains in flight, same order per row.
GROUPS = 4


def _matvec_kernel(name: str, spec: BlockSpec, threads: int, gpu: bool, fused: Fused):
    def kernel(out: UOp, rest: UOp, halfs: UOp, x: UOp, *extra: UOp) -> UOp:
        G, nb, _, il = rest.shape
        N, E, C = x.shape[0], spec.sub * spec.width, nb * spec.sub * spec.width
        norm_w = extra[0] if fused.norm is not None else None
        res = extra[-1] if fused.residual else None
        if gpu:  # a thread per row: lanes of a group read adjacent bytes, so the loads coalesce
            g, lane, ends = UOp.range(G, 0, AxisType.GLOBAL), UOp.range(il, 1, AxisType.LOCAL), ()
            acc_lane, gi, core, u = UOp.const(0, dtypes.int), g, g, None
            n = UOp.range(N, 3)
        else:  # a thread per core, U row groups at once (independent chains in flight). Columns outside the row
            # groups: the norm's sum of squares (a serial chain of C dependent adds, which clang keeps scalar) runs
            # once per column and core, not once per group (SmolLM2's head: 3072 times)
            U = next(k for k in (GROUPS, 3, 2, 1) if k <= GROUPS and (G // threads) % k == 0)
            core, n = UOp.range(threads, 0, AxisType.GLOBAL), UOp.range(N, 1)
            gi, u = UOp.range(G // threads // U, 2), UOp.range(U, 97, AxisType.UPCAST)
            g, ends = core_index(core, threads) * (G // threads) + gi * U + u, (gi, n, core)
        # every reset names all its enclosing loops: a loop of one iteration (one block per row) is folded away,
        # and a reset tied only to it would run once for the whole kernel
        outer = (n, g, lane) if gpu else (n, gi, core)
        xv = fused_input(x, n, C, fused, norm_w, (n, g, lane) if gpu else (n, core))
        b = UOp.range(nb, 4, AxisType.REDUCE)
        regs = (1,) if gpu else (U * il + 1,)
        acc = UOp.placeholder(regs, F32, 0, addrspace=AddrSpace.REG)
        # sub-blocks are unrolled here, in Python: their shifts and byte offsets become constants (Q4_1 2x, Q4_K
        # 5x faster than a loop over them)
        if not gpu:  # the GEMM's order: one chain per row through every value of every block
            # A group's il rows are a plain loop inside the loop over values, not an UPCAST: clang's loop vectorizer
            # makes it one 16-float vector per row group (two with AVX2), keeps the U x il sums in registers across
            # the values and hoists the scales' loads out of them (read in the assembly). Written out by tinygrad
            # (UPCAST), the same kernel was 16x more UOps to rewrite (a Q6_K matvec 27k, 11 s to build; now ~2k,
            # 1 s), for the same or slower code. REG sums indexed from 1 (engine/quant_gemm.py says why).
            lane = UOp.range(il, 190)
            acc = acc.after(*outer)[u * il + lane + 1].set(0.0, end=lane)
            for si in range(spec.sub):
                j, lane = UOp.range(spec.width, 5 + 2 * si, AxisType.REDUCE), UOp.range(il, 200 + si)
                byte = lambda k, lane=lane: rest[g, b, k, lane].cast(dtypes.int)
                half = lambda i, lane=lane: halfs[g, b, i, lane].cast(F32)
                w = spec.q(byte, si, j).cast(F32) * spec.scale(byte, half, si)
                if spec.offset is not None:
                    w = w + spec.offset(byte, half, si)
                i = u * il + lane + 1
                acc = acc[i].set(acc.after(b, j)[i] + w * xv(b * E + si * spec.width + j),
                                 end=(lane, j, b, u) if si == spec.sub - 1 else (lane, j))
            lane, u = UOp.range(il, 99), UOp.range(U, 98)  # the results leave in loops of their own; ids above
            acc_lane, g = u * il + lane + 1, core_index(core, threads) * (G // threads) + gi * U + u  # every sub-block's (5 + 2 * sub)
        else:  # GPU (MESH_GPU_MV=naive): q * x summed per sub-block, scaled once (llama.cpp's order)
            byte = lambda k: rest[g, b, k, lane].cast(dtypes.int)
            half = lambda i: halfs[g, b, i, lane].cast(F32)
            acc = acc.after(*outer)[acc_lane].set(0.0)
            term = None
            for si in range(spec.sub):
                s, rid = si, 5 + 2 * si  # a Python int: constant offsets that tinygrad can prove in bounds
                j, j2 = UOp.range(spec.width, rid, AxisType.REDUCE), UOp.range(spec.width, rid + 1, AxisType.REDUCE)
                base = b * E + si * spec.width
                dot = UOp.placeholder(regs, F32, 1 + 2 * si, addrspace=AddrSpace.REG)
                dot = dot.after(*outer, b)[acc_lane].set(0.0)
                dot = dot[acc_lane].set(dot.after(j)[acc_lane] + spec.q(byte, s, j).cast(F32) * xv(base + j), end=j)
                part = dot[acc_lane] * spec.scale(byte, half, s)
                if spec.offset is not None:
                    xs = UOp.placeholder((1,), F32, 2 + 2 * si, addrspace=AddrSpace.REG)
                    xs = xs.after(*outer, b)[0].set(0.0)
                    xs = xs[0].set(xs.after(j2)[0] + xv(base + j2), end=j2)
                    part = part + xs[0] * spec.offset(byte, half, s)
                term = part if term is None else term + part
            acc = acc[acc_lane].set(acc.after(b)[acc_lane] + term, end=b)
        row = g * il + lane
        store = out[n, row].store(acc[acc_lane] + res[n, row] if res is not None else acc[acc_lane])
        store = store.end(lane, n, g) if gpu else store.end(lane, u).end(*ends)
        return store.sink(arg=KernelInfo(name=f"mv_{name}_{G}x{il}_{nb}", opts_to_apply=()))
    return kernel


INTERLEAVE = 16  # rows side by side: IL bytes and IL scales per load, IL independent accumulators


def interleave_for(rows: int) -> int:
    return next(il for il in (INTERLEAVE, 8, 4, 2, 1) if rows % il == 0)


def _rest_mask(ggml_type: int) -> np.ndarray:
    bb = GGML_QUANT_SIZES[Q(ggml_type)][1]
    keep = np.ones(bb, dtype=bool)
    for off in HALF_FIELDS[ggml_type]:
        keep[off:off + 2] = False
    return keep


@functools.lru_cache(maxsize=None)
def _rest_runs(ggml_type: int) -> tuple[tuple[int, int], ...]:
    """The kept (non-float16) bytes of a block as runs [a, b): one strided copy each."""
    keep, out, a = _rest_mask(ggml_type), [], None
    for i, k in enumerate([*keep, False]):
        if k and a is None:
            a = i
        elif not k and a is not None:
            out.append((a, i))
            a = None
    return tuple(out)


def resident_shapes(ggml_type: int, rows: int, cols: int, il: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes `repack` gives a (rows, cols) weight: bytes (rows/il, blocks, rest, il), halfs (rows/il, blocks,
    n, il)."""
    nb = cols // GGML_QUANT_SIZES[Q(ggml_type)][0]
    return (rows // il, nb, sum(b - a for a, b in _rest_runs(ggml_type)), il), \
        (rows // il, nb, len(HALF_FIELDS[ggml_type]), il)


def repack(raw: np.ndarray, ggml_type: int, il: int,
           out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Raw GGUF rows (rows, row_bytes) -> (bytes (rows/il, blocks, rest, il) uint8, halfs (rows/il, blocks, n, il)
    float16): the same bytes, regrouped, into `out` when given (the device's memory on the CPU). Each run of kept
    bytes and each float16 field goes in one strided copy straight into its place (a boolean-mask gather and a
    transposed copy took 3-12x longer: 28 -> 2.4 ms for a 3072-row Q6_K matrix)."""
    rows, row_bytes = raw.shape
    bb = GGML_QUANT_SIZES[Q(ggml_type)][1]
    nb = row_bytes // bb
    blocks = raw.reshape(rows // il, il, nb, bb)
    runs = _rest_runs(ggml_type)
    fields = HALF_FIELDS[ggml_type]
    if out is None:
        rest = np.empty((rows // il, nb, sum(b - a for a, b in runs), il), np.uint8)
        halfs = np.empty((rows // il, nb, len(fields), il), np.float16)
    else:
        rest, halfs = out
    d = 0
    for a, b in runs:
        rest[:, :, d:d + b - a, :] = blocks[:, :, :, a:b].transpose(0, 2, 3, 1)
        d += b - a
    for i, off in enumerate(fields):
        halfs[:, :, i, :] = blocks[..., off:off + 2].view(np.float16)[..., 0].transpose(0, 2, 1)
    return rest, halfs


def unpack(rest: np.ndarray, halfs: np.ndarray, ggml_type: int) -> np.ndarray:
    """The inverse of `repack`: the raw GGUF rows (rows, row_bytes)."""
    g, nb, _, il = rest.shape
    bb = GGML_QUANT_SIZES[Q(ggml_type)][1]
    out = np.empty((g, il, nb, bb), dtype=np.uint8)
    out[..., _rest_mask(ggml_type)] = rest.transpose(0, 3, 1, 2)
    for i, off in enumerate(HALF_FIELDS[ggml_type]):
        out[..., off:off + 2] = np.ascontiguousarray(halfs[:, :, i, :].transpose(0, 2, 1)).view(np.uint8).reshape(g, il, nb, 2)
    return out.reshape(g * il, nb * bb)


@dataclass(slots=True)
class QuantWeight:
    """A 2-D weight (rows, cols) held as its GGUF blocks in the split, interleaved resident layout, or (layout "tc",
    MESH_GPU_MV=tc on CUDA) in the tensor-core kernel's lane order (engine/matvec_gpu_tc.py `tc_repack`): rest the
    quant words (rows // 16, blocks, 32, words a lane) uint32, halfs the scales (rows // 16, blocks, 8, 2) float16."""
    rest: Tensor  # (rows // il, blocks per row, rest bytes, il) uint8
    halfs: Tensor  # (rows // il, blocks per row, half fields, il) float16
    shape: tuple[int, int]
    ggml_type: int
    layout: str = "blocks"

    @property
    def il(self) -> int:
        return 16 if self.layout == "tc" else self.rest.shape[3]

    @property
    def nbytes(self) -> int:
        return self.rest.nbytes() + self.halfs.nbytes()

    @property
    def takes_x8(self) -> bool:
        """Whether `matmul_t` runs the CPU's 8-bit path, where an x quantized by the kernel that made it saves the
        quantize kernel (engine/attention_cpu.py `attention_x8`)."""
        return self.layout != "tc" and quant_i8.wanted(self.ggml_type, self.il, str(self.rest.device))

    @property
    def glu_once(self) -> bool:
        """Whether `matmul_t(x, glu=True)` computes silu(gate) * up once per value (inside the quantize kernel of the
        8-bit path, engine/quant_i8.py), not once per group of rows as the f32 matvec would."""
        return self.takes_x8 and quant_i8.glu_in_quantize()

    def matmul_t(self, x: Tensor, *, norm: tuple[Tensor, float] | None = None, glu: bool = False,
                 residual: Tensor | None = None, x8: quant_i8.X8 | None = None) -> Tensor:
        """x (N, cols) @ weight.T -> (N, rows) float32, the blocks decoded inside the kernel. With `norm` (weight,
        eps) x is RMS-normalized first; with `glu` x is (N, 2 cols) [gate | up] and silu(gate) * up is used; with
        `residual` (N, rows) it is added to the result. All inside the one kernel (see Fused). `x8`: x quantized
        already (`takes_x8`), used by the CPU's 8-bit path, ignored by the others."""
        if self.layout == "tc":  # the tensor-core kernel: the norm and the residual fused, silu(gate) * up before it
            if x8_wanted() and s8_renderer(str(self.rest.device)):  # x in 8 bits (engine/matvec_gpu_s8.py)
                return s8_matmul_t(self.rest, self.halfs, self.ggml_type, x, norm=norm, glu=glu, residual=residual)
            if glu:
                C = x.shape[1] // 2
                gate = x[:, :C].cast(F32)
                x = gate * (1.0 + (gate * -LOG2E).exp2()).reciprocal() * x[:, C:].cast(F32)
            return tc_matmul_t(self.rest, self.halfs, self.ggml_type, x, norm=norm, residual=residual)
        G = self.rest.shape[0]
        gpu = not str(self.rest.device).startswith("CPU")
        if not gpu:  # 512-bit vectors on an AVX-512 host, before any of the step's kernels is rendered
            quant_gemm.wide_vectors(str(self.rest.device))
        if quant_i8.wanted(self.ggml_type, self.il, str(self.rest.device)):  # x in 8 bits, integer dots
            return quant_i8.matmul_t(self.rest, self.halfs, self.ggml_type, self.shape[0], x, norm=norm, glu=glu,
                                     residual=residual, x8=x8)
        threads = next(t for t in range(min(cpu_threads(), G), 0, -1) if G % t == 0)
        fused = Fused(norm=None if norm is None else float(norm[1]), glu=glu, residual=residual is not None)
        if quant_gemm.enabled(x.shape[0], str(self.rest.device)):  # several columns on CPU: decode blocks once
            return quant_gemm.gemm_t(self.rest, self.halfs, SPECS[self.ggml_type], Q(self.ggml_type).name.lower(),
                                     self.shape[0], threads, x, norm=norm, glu=glu, residual=residual)
        rest = self.rest
        if gpu and os.environ.get("MESH_GPU_MV") != "naive":  # "naive": a thread per row (below), kept for A/B runs
            kernel = gpu_matvec_kernel(Q(self.ggml_type).name.lower(), self.ggml_type, SPECS[self.ggml_type], fused)
            if self.il % 4 == 0 and rest.uop.is_realized:
                rest = _words(rest)
            consts = [magic_word(str(self.rest.device))]
        else:
            kernel = _matvec_kernel(Q(self.ggml_type).name.lower(), SPECS[self.ggml_type], threads, gpu, fused)
            consts = []
        out = Tensor.empty(x.shape[0], self.shape[0], dtype=F32, device=self.rest.device)
        extra = ([norm[0].cast(F32).contiguous()] if norm is not None else []) + \
                ([residual.cast(F32).contiguous()] if residual is not None else [])
        return Tensor.custom_kernel(out, rest, self.halfs, x.cast(F32).contiguous(), *consts, *extra, fxn=kernel)[0]

    def read_row(self, r: int) -> np.ndarray:
        """Row r's raw GGUF bytes, read back from the resident blocks (the embedding of a tied model)."""
        return self.read_rows(np.array([r]))[0]

    def host_views(self) -> tuple[np.ndarray, np.ndarray] | None:
        """numpy views (no copy) of the resident blocks where they lie in host memory (a CPU device, the blocks
        layout): rest (groups, blocks, rest bytes, il) uint8 and halfs (groups, blocks, fields, il) float16, valid
        while this weight lives. None elsewhere (a GPU's memory, the tensor-core layout)."""
        if self.layout != "blocks" or not str(self.rest.device).startswith("CPU"):
            return None
        out = []
        for t, dtype in ((self.rest, np.uint8), (self.halfs, np.float16)):
            buf = t.uop.buffer.ensure_allocated()
            addr = getattr(buf._buf, "va_addr", None)
            if addr is None or buf.offset:
                return None
            n = buf.nbytes
            out.append(np.frombuffer((ctypes.c_char * n).from_address(int(addr)), dtype).reshape(t.shape))
        return out[0], out[1]

    def read_rows(self, rows: np.ndarray, views: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """The raw GGUF bytes (len(rows), row bytes) of the given rows. From `views` (`host_views`), each row's bytes
        are gathered where they lie; else each group of il rows they touch is copied out once and all of them are
        unpacked together (a prompt's embeddings: one unpack, not one per token)."""
        if views is not None:   # a CPU stage's embeddings: 3 numpy gathers, no copy of whole groups
            rest_v, halfs_v = views
            g, lane = np.divmod(np.asarray(rows, dtype=np.int64), self.il)
            rest, halfs = rest_v[g, :, :, lane], halfs_v[g, :, :, lane]   # (N, blocks, rest bytes), (N, blocks, fields)
            bb = GGML_QUANT_SIZES[Q(self.ggml_type)][1]
            out = np.empty((len(g), rest.shape[1], bb), np.uint8)
            out[..., _rest_mask(self.ggml_type)] = rest
            for i, off in enumerate(HALF_FIELDS[self.ggml_type]):
                out[..., off:off + 2] = np.ascontiguousarray(halfs[..., i]).view(np.uint8).reshape(*halfs.shape[:2], 2)
            return out.reshape(len(g), -1)
        groups, where = np.unique(np.asarray(rows, dtype=np.int64) // self.il, return_inverse=True)
        if self.layout == "tc":  # a tile's words and scales, unpacked by the tensor-core layout's inverse
            _, nb, _, lw = self.rest.shape
            wn, sn = nb * 32 * lw * 4, nb * 16 * 2  # bytes of a tile's words and of its scales
            raw = []
            for g in groups.tolist():
                words = _read(self.rest, g * wn, wn).view(np.uint32).reshape(1, nb, 32, lw)
                scales = _read(self.halfs, g * sn, sn).view(np.float16).reshape(1, nb, 8, 2)
                raw.append(tc_unpack(words, scales, self.ggml_type))
            raw = np.stack(raw)
            return raw[where.reshape(-1), np.asarray(rows, dtype=np.int64) % 16]
        _, nb, n_rest, il = self.rest.shape
        n_halfs = self.halfs.shape[2]
        rest = np.empty((len(groups), nb, n_rest, il), np.uint8)
        halfs = np.empty((len(groups), nb, n_halfs, il), np.float16)
        for k, g in enumerate(groups.tolist()):
            rest[k] = _read(self.rest, g * rest[k].nbytes, rest[k].nbytes).reshape(nb, n_rest, il)
            halfs[k] = _read(self.halfs, g * halfs[k].nbytes, halfs[k].nbytes).view(np.float16).reshape(nb, n_halfs, il)
        raw = unpack(rest, halfs, self.ggml_type).reshape(len(groups), il, -1)
        return raw[where.reshape(-1), np.asarray(rows, dtype=np.int64) % il]


def _words(t: Tensor) -> Tensor:
    """A realized uint8 tensor (..., il) seen as uint32 (..., il / 4): a view of the same device memory, no copy."""
    buf = t.uop.buffer
    view = buf.view(buf.size // 4, dtypes.uint32, 0)
    return Tensor(UOp.from_buffer(view)).reshape(*t.shape[:-1], t.shape[-1] // 4)


def _read(t: Tensor, offset: int, nbytes: int) -> np.ndarray:
    """nbytes of a realized device tensor from a byte offset, copied out without a schedule."""
    buf = t.uop.buffer
    alloc = Device[buf.device].allocator
    out = np.empty(nbytes, dtype=np.uint8)
    alloc._copyout(memoryview(out), alloc._offset(buf._buf, nbytes, offset))
    return out


def concat(parts: list[QuantWeight]) -> QuantWeight | None:
    """One weight holding the rows of `parts` in order (q, k and v in one matmul), or None if they cannot share
    one layout (different types or interleave)."""
    first = parts[0]
    if any((p.ggml_type, p.il, p.shape[1], p.layout) != (first.ggml_type, first.il, first.shape[1], first.layout)
           for p in parts):
        return None
    rest = Tensor.cat(*[p.rest for p in parts], dim=0).contiguous().realize()
    halfs = Tensor.cat(*[p.halfs for p in parts], dim=0).contiguous().realize()
    return QuantWeight(rest, halfs, (sum(p.shape[0] for p in parts), first.shape[1]), first.ggml_type, first.layout)
