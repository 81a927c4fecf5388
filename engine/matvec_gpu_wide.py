"""The GPU matvec for batches (issue 11): a thread takes WORDS = 2 words of 4 rows (8 rows, not 16) and up to
WIDE = 16 columns, so a 16-column decode step or prefill chunk decodes each quant once, not once per tile of 4.
Same arithmetic as engine/matvec_gpu.py's kernel for one column, operation for operation: a column's output has
the same bits alone, in a batch of either kernel, and in any tile.

Why this shape (bench/matvec_sass.py counts, sm_90; not yet measured on a GPU):
- The one-column kernel holds 16 rows a thread (a 16-byte load brings byte k of 16 rows) and takes up to 4 columns
  a thread block; 8 columns of 16 rows are 255 registers. A 16-column batch then decodes every quant 4 times and
  reads every weight from L2 4 times. Here a thread holds 8 rows x 16 columns (128 accumulators); the il / 8 row
  halves of a group are thread blocks side by side on the grid (blockIdx.x: one group's DRAM sectors are read
  once, then from L2 by the other half: 2 passes over the weights, not 4).
- The order of a column's sums is fixed by the one-column kernel: TW threads share a block's values, P blocks side
  by side, a thread's J products of a sub-block summed then scaled, its blocks p, p + P, ... in order, then the
  S = TW * P partial sums of a row added in two rounds (groups of il partials a stride S / il apart, then the
  groups). Changing any of that for batches would change a column's bits with its companions. So TW, P, BU come
  from the same `gpu_layout`, the per-thread code is the same expressions, and the rounds below are the same sums
  in the same order, only spread over the threads differently. (That order is also what bounds the tile: with
  S = 256 chains a row, 16 rows x 16 columns would be 64K accumulators, the whole register file of an SM.)
- Rows a thread: every x a thread loads (and its norm product, square, or silu) serves its rows, so 4 rows a thread
  cost an x load per 4 products (Q8_0, 16 columns: 1.72 instructions a value and column, 2.24 with the fused norm)
  against 1.57 / 1.85 with 8 rows (255 registers, no spills); the tiles of 4: 2.04 / 2.18.
- The rounds take several columns at once (CG columns' partials in shared memory together, at most SMEM floats):
  the one-column kernel's tiles run them column after column, two barriers each, which for 16 columns would leave
  the block waiting on barriers more than it computes. A round's tasks are spread over all S threads; a thread
  past the last task repeats the last one (the same value stored to the same place, so no gate is needed: a gated
  store lost its gate in tinygrad's index simplification before, engine/matvec_gpu.py).
- From FROM = 5 columns: with fewer, the tiles of the one-column kernel take fewer instructions (Q8_0, 8 rows a
  thread against the tiles, plain / norm: 4 columns 2.15 / 2.45 against 2.03 / 2.18 5
  columns 1.98 / 2.28 against 2.27 / 2.42, 8 columns 1.77 / 2.06 against 2.04 / 2.18).
Off by default (measured on the H200, sixth session, bench/RESULTS.md): a 16-column 1.1B Q8_0 step took 6.12 ms
with this kernel against 5.95 ms with a column a thread block, and on CUDA one case of its bit test failed (Q4_0,
residual, 5 columns: a column in the batch 1 ulp from the column alone, where the compiler contracted another
product into an FMA than in the one-column kernel; the PYTHON device contracts nothing). So it is an A/B kernel
until a batch kernel is both faster and bit-equal on the device: `MESH_GPU_MV_WIDE="COLS[,WORDS[,FROM]]"` turns it
on (columns a thread block, e.g. 16; words of 4 rows a thread, default 2; the fewest columns it takes, default 5).
Batches of one column never come here, nor K-quants (engine/matvec_gpu.py: a column a thread block for them).
"""
from __future__ import annotations

import os

from gguf import GGMLQuantizationType as Q
from tinygrad import UOp, dtypes
from tinygrad.dtype import AddrSpace
from tinygrad.uop.ops import AxisType, KernelInfo

from engine import matvec_gpu as mv

F32, U32 = dtypes.float32, dtypes.uint32
WIDE = 0  # columns a thread block takes together; 0: off (the module docstring says why), MESH_GPU_MV_WIDE=16 on
WORDS = 2  # words of 4 rows a thread (see the module docstring: x loads, L2 passes)
FROM = 5  # the fewest columns this kernel takes (fewer: engine/matvec_gpu.py's tiles)
SMEM = 8192  # floats of shared memory for the partial sums of a round's columns (32 KB)


def wide_setting() -> tuple[int, int, int]:
    """(columns a thread block, words of 4 rows a thread, fewest columns) from MESH_GPU_MV_WIDE; columns <= 1: this
    kernel is off."""
    env = os.environ.get("MESH_GPU_MV_WIDE", "").split(",") + ["", ""]
    return int(env[0] or WIDE), max(1, int(env[1] or WORDS)), max(2, int(env[2] or FROM))


def wide_cols(n: int) -> int:
    """Columns a thread block takes for a batch of n: at most the setting, tiles as even as can be (as gpu_cols)."""
    most = max(1, min(n, wide_setting()[0]))
    return -(-n // -(-n // most))


def use_wide(n: int, il: int, words: bool) -> bool:
    """This kernel for a batch of n columns: FROM columns or more, blocks read as words, 8+ interleaved rows."""
    cols, rw, least = wide_setting()
    return n >= least and cols > 1 and words and il >= 8 and il % (4 * rw) == 0


def wide_kernel(name: str, ggml_type: int, spec, fused, out: UOp, rest: UOp, halfs: UOp, x: UOp, magic: UOp,
                *extra: UOp) -> UOp:
    """engine/matvec_gpu.py's kernel body for batches (see the module docstring): the same arguments."""
    cvt = os.environ.get("MESH_GPU_CVT", "")
    fast = None if cvt == "cast" else mv.FAST.get(ggml_type)
    to_float = (lambda q: q.cast(F32)) if cvt == "cast" else mv._float_signed
    word_q = None if cvt in ("cast", "byte") else {Q.Q4_0: "q4_0", Q.Q8_0: "q8_0"}.get(ggml_type)
    G, nb, _, il = halfs.shape
    W = spec.width
    N, E, C = x.shape[0], spec.sub * W, nb * spec.sub * W
    TW, P, BU = mv.gpu_layout(nb, W, G * il)  # the one-column kernel's layout: its order of sums
    J = W // TW
    RW = wide_setting()[1]
    R = 4 * RW  # rows a thread
    norm_w = extra[0] if fused.norm is not None else None
    res = extra[-1] if fused.residual else None
    g = UOp.range(G, 0, AxisType.GLOBAL)
    zero = UOp.const(0, g.dtype)
    wg = UOp.range(il // R, 8, AxisType.GLOBAL) if il > R else zero  # which R rows of the group
    jt = UOp.range(TW, 1, AxisType.LOCAL) if TW > 1 else zero
    p = UOp.range(P, 2, AxisType.LOCAL) if P > 1 else zero
    wl = UOp.range(RW, 3, AxisType.UPCAST) if RW > 1 else zero
    e = UOp.range(4, 7, AxisType.UPCAST)
    w = wg * RW + wl  # the word of the group's il // 4
    u = wl * 4 + e if RW > 1 else e  # the thread's lane
    NI = wide_cols(N)
    no = UOp.range(-(-N // NI), 4)
    col = lambda i: no * NI + i if NI > 1 else no
    clamp = lambda c: c if N % NI == 0 else (c < N).where(c, N - 1)  # a last tile past N repeats column N - 1
    nx = [clamp(col(i)) for i in range(NI)]
    threads = tuple(r for r in (jt, p) if r is not zero)
    outer = tuple(r for r in (no, g, wg) if r is not zero) + threads
    lanes = [v for v in (wl, e) if v is not zero]
    S = P * TW
    t = p * TW + jt if TW > 1 else p

    def xv(n: UOp, idx: UOp) -> UOp:
        if fused.glu:
            gate = x[n, idx]
            return gate * (1.0 + (gate * -mv.LOG2E).exp2()).reciprocal() * x[n, idx + C]
        return x[n, idx] * norm_w[idx] if norm_w is not None else x[n, idx]

    # the thread's sums: engine/matvec_gpu.py's own loop (thread_sums), with R lanes instead of il
    bi = UOp.range(nb // (P * BU), 5, AxisType.REDUCE)
    accs = [UOp.placeholder((R,), F32, 0 if ci == 0 else 200 + ci, addrspace=AddrSpace.REG) for ci in range(NI)]
    accs = [a.after(*outer)[u].set(0.0) for a in accs]
    if norm_w is not None:
        sss = [UOp.placeholder((1,), F32, 1 if ci == 0 else 300 + ci, addrspace=AddrSpace.REG) for ci in range(NI)]
        sss = [a.after(*outer)[0].set(0.0) for a in sss]

    def blocks(b):  # block b's loaders: its quant words, bytes and f16 scale/offset values
        byte = lambda k: (rest[g, b, k, w] >> (e * 8).cast(U32)) & 255
        return (lambda k: rest[g, b, k, w]), byte, (lambda i: halfs[g, b, i, w * 4 + e].cast(F32))

    accs, sss = mv.thread_sums(blocks, accs, sss if norm_w is not None else None, bi=bi, BU=BU, P=P, p=p, spec=spec,
                               E=E, W=W, J=J, jt=jt, TW=TW, idx=g.dtype, word_q=word_q, fast=fast,
                               to_float=to_float, e=e, magic=magic, nx=nx, x=x, xv=xv, norm_w=norm_w, u=u, lanes=lanes)

    # the rounds, CG columns at a time. Partials: part[(c S + t) R + r] = thread t's sum of row r, column c
    CG = max(1, min(NI, SMEM // (S * R)))
    split = S % il == 0 and S > il  # the one-column kernel's two rounds (else: one sum of S partials a row)
    Qn = S // il if split else 0
    part = UOp.placeholder((CG * S * R,), F32, 100, addrspace=AddrSpace.LOCAL)
    ssp = UOp.placeholder((CG * S,), F32, 101, addrspace=AddrSpace.LOCAL) if norm_w is not None else None
    stores, prev, aid = [], None, 1000

    def tasks(count: int, *deps: UOp) -> tuple[UOp, tuple[UOp, ...], UOp | None]:
        """This thread's task of `count` (spread over the S threads; past the last: the last again), the ranges a
        sum inside it runs after, and the loop over a thread's tasks (None when one each is enough)."""
        nonlocal aid
        K = -(-count // S)
        k = UOp.range(K, aid) if K > 1 else None
        aid += 1
        task = k * S + t if k is not None else t
        task = task if count == K * S else (task < count).where(task, count - 1)
        return task, (*outer, *((k,) if k is not None else ()), *deps), k

    def total(src: UOp, deps: tuple, terms_n: int, index) -> UOp:
        """sum over i < terms_n of src[index(i)], from 0.0 in order (the one-column kernel's register sums)."""
        nonlocal aid
        aid += 2
        return mv.reg_sum(aid - 2, src, deps, terms_n, index)

    for c0 in range(0, NI, CG):
        cg = min(CG, NI - c0)
        pm = part if prev is None else part.after(prev)
        parts = [pm[((ci - c0) * S + t) * R + u].store(accs[ci][u]).end(*lanes) for ci in range(c0, c0 + cg)]
        if norm_w is not None:
            sm = ssp if prev is None else ssp.after(prev)
            parts += [sm[(ci - c0) * S + t].store(sss[ci][0]) for ci in range(c0, c0 + cg)]
        parts = UOp.group(*parts) if len(parts) > 1 else parts[0]
        pa = part.after(parts)
        if split:
            # round 1, task (c, qA, r): the il partials qA + i Qn of row r, column c
            r1 = UOp.placeholder((cg * Qn * R,), F32, 5000 + aid, addrspace=AddrSpace.LOCAL)
            task, deps, k = tasks(cg * Qn * R, parts)
            r, qA, c = task % R, (task // R) % Qn, task // (R * Qn)
            st = r1[task].store(total(pa, deps, il, lambda i: ((c * S + qA + i * Qn) * R + r)))
            round1 = [st.end(k) if k is not None else st]
            if norm_w is not None:
                s1 = UOp.placeholder((cg * Qn,), F32, 6000 + aid, addrspace=AddrSpace.LOCAL)
                sa = ssp.after(parts)
                task, deps, k = tasks(cg * Qn, parts)
                qA, c = task % Qn, task // Qn
                st = s1[task].store(total(sa, deps, il, lambda i: c * S + qA + i * Qn))
                round1.append(st.end(k) if k is not None else st)
            prev = UOp.group(*round1) if len(round1) > 1 else round1[0]
            # round 2, task (c, r): the Qn sums of round 1 in order
            task, deps, k = tasks(cg * R, prev)
            r, c = task % R, task // R
            y = total(r1.after(prev), deps, Qn, lambda i: (c * Qn + i) * R + r)
            if norm_w is not None:
                sq = total(s1.after(prev), deps, Qn, lambda i: c * Qn + i)
        else:
            task, deps, k = tasks(cg * R, parts)
            r, c = task % R, task // R
            y = total(pa, deps, S, lambda i: (c * S + i) * R + r)
            if norm_w is not None:
                sq = total(ssp.after(parts), deps, S, lambda i: c * S + i)
            prev = parts  # the next columns' partials wait for these loads (a barrier)
        if norm_w is not None:
            y = y * (sq * (1.0 / C) + fused.norm).sqrt().reciprocal()
        n = clamp(col(c0) + c) if NI > 1 else no
        row = g * il + wg * R + r
        if res is not None:
            y = y + res[n, row]
        st = out[n, row].store(y)
        stores.append(st.end(k) if k is not None else st)
        if not split:
            prev = UOp.group(prev, stores[-1])
    store = UOp.group(*stores) if len(stores) > 1 else stores[0]
    return store.end(*outer).sink(arg=KernelInfo(
        name=f"mvw_{name}_{G}x{il}_{nb}_t{TW}p{P}u{BU}r{R}c{NI}", opts_to_apply=()))
