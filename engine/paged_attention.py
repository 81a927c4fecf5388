"""Attention over a paged KV cache: one set of kernels for every column of a step, whatever sequences they belong to.

A layer's keys and values live in two pools of rows, `(n_blocks + 1) * block_size` rows of `n_kv_heads * head_dim`
values: position p of a sequence sits in row `table[slot, p // B] * B + p % B` (engine/kv_blocks.py hands out the
blocks; the table is a stage-wide int32 tensor, one row of block ids per slot). The last block is the trash block:
every table entry a slot does not own points there, so a padded prefill chunk's pad rows write somewhere harmless and
a read past a sequence's own blocks reads finite data that the mask drops. On the CPU each block of the key pool is
stored transposed ([block][value][position], `_k_at`): the same memory, so the scores kernel loads a block's positions
of one value as one vector.

A step's columns come in runs (one slot, consecutive positions; the run structure is the compiled shape, slot and
start position are bound variables), so a column's slot and position are expressions of those variables: the
kernels need no per-step input beyond the table. Four kernels per layer for all columns together:

    write:   pool_k[row(c, pos_c)] = k[c],  pool_v[row(c, pos_c)] = v[c]      (all columns, before any read)
    scores:  s[c, h, t] = scale * sum_d q[c, h, d] * pool_k[row(c, t), kvh(h), d]        t < ctx
    softmax: m = max_t s, p[c, h, t] = exp(s - m), l[c, h] = 1 / sum_t p            over t <= pos_c only
    values:  out[c, h, d] = l[c, h] * sum_t p[c, h, t] * pool_v[row(c, t), kvh(h), d]  over t <= pos_c only

`ctx` (a bound variable: the longest run's end) bounds the loops; a key past a column's own position contributes an
exact zero (a `where`, not a multiply by zero, so even garbage in a trash row cannot leak), and every sum runs in the
same order whatever else is in the step. So a column's attention is bitwise the same whether it steps alone or next
to sequences of any length, and splits stay bitwise equal (every stage runs the same kernels for a layer).
Written in UOps with tinygrad's `custom_kernel`: no CUDA C, no intrinsics; the same code renders for CPU and GPUs.
On a CPU whose kernels clang compiles, scores, softmax and values run as one C kernel instead
(engine/attention_cpu.py: each column's loops end at its own position), bitwise the same.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from tinygrad import Tensor, UOp, dtypes
from tinygrad.dtype import AddrSpace
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

from . import attention_cpu
from .cpu_runner import core_index, cpu_threads

F32 = dtypes.float32
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Run:
    """Columns [col, col + n) of a step: one slot's consecutive positions from `pos` (slot, pos: bound UOps)."""
    col: int
    n: int
    slot: UOp
    pos: UOp


def _kvar(u: UOp) -> UOp:
    """A bound variable as kernels see it (an ALU PARAM): the jit passes its value with the step's bindings."""
    var = u if u.is_variable else u.unbind()[0]
    lo, hi = var.arg.vmin_vmax
    return UOp.variable(var.arg.name, lo, hi, dtype=var.dtype, param=True)


def _kruns(runs: Sequence[Run]) -> tuple[Run, ...]:
    return tuple(Run(r.col, r.n, _kvar(r.slot), _kvar(r.pos)) for r in runs)


def _per_column(c: UOp, runs: Sequence[Run], f) -> UOp:
    """f(run) for the run that column c (a range) falls in: a chain of wheres over the run boundaries."""
    expr = f(runs[-1])
    for r in reversed(runs[:-1]):
        expr = (c < r.col + r.n).where(f(r), expr)
    return expr


def _slot_pos(c: UOp, runs: Sequence[Run]) -> tuple[UOp, UOp]:
    return _per_column(c, runs, lambda r: r.slot), _per_column(c, runs, lambda r: r.pos + (c - r.col))


def _row(table: UOp, slot: UOp, t: UOp, B: int, rows: int) -> UOp:
    """The pool row of position t of the slot. The block id is clamped to the pool, so tinygrad can prove the
    index in bounds and a bad table cannot reach outside the pool. (The pools come flat: a 2-D index with a
    loaded row costs a modulo per load.)"""
    blk = table[slot, t // B].cast(dtypes.int).maximum(0).minimum(rows // B - 1)
    return blk * B + t % B


def _outer(gpu: bool) -> AxisType:
    """Loops over outputs: a GPU runs them as threads; the CPU runs the write kernel's loops as they are."""
    return AxisType.GLOBAL if gpu else AxisType.WEAK


def _cpu_pairs(N: int, H: int) -> tuple[UOp, UOp, tuple[UOp, UOp]]:
    """(column, head) of a CPU kernel whose pairs are split over the cores (the largest divisor of N * H not above
    the thread count, as the matvec splits its rows), and the two loops to end, inner first."""
    P = N * H
    T = next(t for t in range(min(cpu_threads(), P), 0, -1) if P % t == 0)
    core, k = UOp.range(T, 0, AxisType.GLOBAL), UOp.range(P // T, 1)
    pair = core_index(core, T) * (P // T) + k
    return pair // H, pair % H, (k, core)


def _k_at(row: UOp, j: UOp | int, W: int, B: int, gpu: bool) -> UOp:
    """Where value j of pool row `row` (= block * B + i) of the keys lives. GPUs: rows as they are. The CPU keeps
    each block transposed, [block][j][i]: the scores kernel then reads a block's B positions of one value as one
    contiguous vector load instead of B loads a row apart (3-4x faster at 64 positions, the same sums)."""
    return row * W + j if gpu else (row // B) * (B * W) + j * B + row % B


def _write_kernel(runs: Sequence[Run], B: int, width: int, k_off: int, v_off: int, gpu: bool, tag: str):
    def kernel_gpu(pk: UOp, pv: UOp, src: UOp, table: UOp) -> UOp:
        # one launch axis over k's and v's values of a column (two sets of launch axes in one kernel ran the
        # write ~0.8 ms a layer on the H200: 8B decode at 34 tok/s), each store gated to its half
        # and a thread block of T threads (global ranges alone, with no opts, launch one thread a block on a GPU)
        N, W = src.shape[0], width
        T = next((t for t in (128, 64, 32) if (2 * W) % t == 0), 1)
        c, jb = UOp.range(N, 0, AxisType.GLOBAL), UOp.range(2 * W // T, 1, AxisType.GLOBAL)
        jl = UOp.range(T, 2, AxisType.LOCAL) if T > 1 else UOp.const(dtypes.int, 0)
        j = jb * T + jl
        slot, pos = _slot_pos(c, runs)
        row = _row(table, slot, pos, B, pk.shape[0] // W)
        val = src[c, (j < W).where(j + k_off, j - W + v_off)]
        st = UOp.group(pk[(row * W + j).valid(j < W)].store(val.cast(pk.dtype)),
                       pv[(row * W + j - W).valid(j >= W)].store(val.cast(pv.dtype)))
        return (st.end(jl, jb, c) if T > 1 else st.end(jb, c)).sink(arg=KernelInfo(name=f"kv_write_{tag}",
                                                                                    opts_to_apply=()))

    def kernel(pk: UOp, pv: UOp, src: UOp, table: UOp) -> UOp:
        N, W = src.shape[0], width
        if N > 1 and os.environ.get("MESH_CPU_SPLIT_SMALL", "1") != "0":
            # columns split over the cores (engine/cpu_kernels.py: a one-slice kernel leaves the other thread
            # spinning; ~4 us a layer at 8 columns); a copy, so the same values in any split
            c, _, ends = _cpu_pairs(N, 1)
            slot, pos = _slot_pos(c, runs)
            stores = []
            for i, (pool, off) in enumerate(((pk, k_off), (pv, v_off))):
                j = UOp.range(W, 2 + i)
                row = _row(table, slot, pos, B, pool.shape[0] // W)
                at = _k_at(row, j, W, B, gpu) if pool is pk else row * W + j
                stores.append(pool[at].store(src[c, j + off].cast(pool.dtype)).end(j))
            return UOp.group(*stores).end(*ends).sink(arg=KernelInfo(name=f"kv_write_{tag}", opts_to_apply=()))
        stores = []
        for i, (pool, off) in enumerate(((pk, k_off), (pv, v_off))):
            c, j = UOp.range(N, 2 * i, _outer(gpu)), UOp.range(W, 2 * i + 1, _outer(gpu))
            slot, pos = _slot_pos(c, runs)
            row = _row(table, slot, pos, B, pool.shape[0] // W)
            at = _k_at(row, j, W, B, gpu) if pool is pk else row * W + j
            stores.append(pool[at].store(src[c, j + off].cast(pool.dtype)).end(j, c))
        return UOp.sink(*stores, arg=KernelInfo(name=f"kv_write_{tag}", opts_to_apply=()))
    return kernel_gpu if gpu else kernel


def _scores_kernel(runs: Sequence[Run], ctx: UOp, B: int, H: int, KvH: int, Hd: int, scale: float, gpu: bool,
                   tag: str):
    G, W = H // KvH, KvH * Hd

    def kernel_gpu(s: UOp, q: UOp, pk: UOp, table: UOp) -> UOp:  # a thread per (column, head, position)
        N = q.shape[0]
        # ctx.maximum(1): a CUDA graph computes launch sizes with the variables at 0, and a 0 launch is refused
        c, h, t = (UOp.range(n, i, AxisType.GLOBAL) for i, n in enumerate((N, H, ctx.maximum(1))))
        slot, pos = _slot_pos(c, runs)
        row = _row(table, slot, t, B, pk.shape[0] // W)
        d = UOp.range(Hd, 3, AxisType.REDUCE)
        acc = UOp.placeholder((1,), F32, 0, addrspace=AddrSpace.REG)
        acc = acc.after(t, h, c)[0].set(0.0)
        acc = acc[0].set(acc.after(d)[0] + q[c, h * Hd + d] * pk[row * W + (h // G) * Hd + d].cast(F32), end=d)
        val = (t <= pos).where(acc[0] * scale, float("-inf"))
        return s[c, h, t].store(val).end(t, h, c).sink(arg=KernelInfo(name=f"attn_scores_{tag}", opts_to_apply=()))

    def kernel(s: UOp, q: UOp, pk: UOp, table: UOp) -> UOp:
        # a block's B positions at once: B independent sums (each over head_dim in order), one table read a block.
        # One sum at a time was a chain of dependent adds (4 cycles each): 8 sequences of ~300 positions took
        # ~55 ms a step in SmolLM2's 30 layers
        N = q.shape[0]
        c, h, ends = _cpu_pairs(N, H)
        tb = UOp.range((ctx + (B - 1)) // B, 2)
        i = UOp.range(B, 3, AxisType.UPCAST)
        slot, pos = _slot_pos(c, runs)
        blk = table[slot, tb].cast(dtypes.int).maximum(0).minimum(pk.shape[0] // W // B - 1)
        acc = UOp.placeholder((B + 1,), F32, 0, addrspace=AddrSpace.REG)
        acc = acc.after(tb, *ends)[i + 1].set(0.0)
        d = UOp.range(Hd, 4, AxisType.REDUCE)
        k = pk[blk * (B * W) + ((h // G) * Hd + d) * B + i]  # the block transposed: B positions side by side
        acc = acc[i + 1].set(acc.after(d)[i + 1] + q[c, h * Hd + d] * k.cast(F32), end=d)
        t = tb * B + i
        val = (t <= pos).where(acc[i + 1] * scale, float("-inf"))
        return s[c, h, t].store(val).end(i).end(tb, *ends).sink(
            arg=KernelInfo(name=f"attn_scores_{tag}", opts_to_apply=()))
    return kernel_gpu if gpu else kernel


def _softmax_kernel(runs: Sequence[Run], ctx: UOp, H: int, gpu: bool, tag: str):
    """p = exp(s - max) over each column's positions (0 past them) and l = 1 / sum(p): the values kernel scales its
    sums by l once instead of dividing every p (one pass over the positions fewer, no exp computed twice)."""
    def kernel(p: UOp, inv: UOp, s: UOp) -> UOp:
        N = s.shape[0]
        if gpu:
            c, h = UOp.range(N, 0, AxisType.GLOBAL), UOp.range(H, 1, AxisType.GLOBAL)
            ends = (h, c)
        else:
            c, h, ends = _cpu_pairs(N, H)
        _, pos = _slot_pos(c, runs)
        t1 = UOp.range(ctx, 2, AxisType.REDUCE)
        m = UOp.placeholder((1,), F32, 0, addrspace=AddrSpace.REG)
        m = m.after(*ends)[0].set(float("-inf"))
        m = m[0].set((t1 <= pos).where(m.after(t1)[0].maximum(s[c, h, t1]), m.after(t1)[0]), end=t1)
        t2 = UOp.range(ctx, 3, AxisType.REDUCE)
        e = (t2 <= pos).where(((s[c, h, t2] - m[0]) * LOG2E).exp2(), 0.0)
        tot = UOp.placeholder((1,), F32, 1, addrspace=AddrSpace.REG)
        if gpu:
            st = p[c, h, t2].store(e)
            tot = tot.after(m)[0].set(0.0)
            tot = tot.after(st)[0].set(tot.after(t2)[0] + e, end=t2)
        else:  # the exps in a loop of their own, which clang vectorizes; then their sum, in the same order
            written = p.after(m)[c, h, t2].store(e).end(t2)
            t3 = UOp.range(ctx, 4, AxisType.REDUCE)
            tot = tot.after(written)[0].set(0.0)
            tot = tot[0].set(tot.after(t3)[0] + p.after(written)[c, h, t3], end=t3)
        return inv[c, h].store(tot[0].reciprocal()).end(*ends).sink(
            arg=KernelInfo(name=f"attn_softmax_{tag}", opts_to_apply=()))
    return kernel


def _values_kernel(runs: Sequence[Run], ctx: UOp, B: int, H: int, KvH: int, Hd: int, gpu: bool, tag: str):
    G = H // KvH

    def kernel_gpu(o: UOp, p: UOp, inv: UOp, pv: UOp, table: UOp) -> UOp:
        # a thread per output value, the positions in order
        N = p.shape[0]
        c, h, d = (UOp.range(n, i, AxisType.GLOBAL) for i, n in enumerate((N, H, Hd)))
        slot, pos = _slot_pos(c, runs)
        t = UOp.range(ctx, 3, AxisType.REDUCE)
        row = _row(table, slot, t, B, pv.shape[0] // (KvH * Hd))
        acc = UOp.placeholder((1,), F32, 0, addrspace=AddrSpace.REG)
        acc = acc.after(d, h, c)[0].set(0.0)
        term = (t <= pos).where(p[c, h, t] * pv[row * (KvH * Hd) + (h // G) * Hd + d].cast(F32), 0.0)
        acc = acc[0].set(acc.after(t)[0] + term, end=t)
        return o[c, h * Hd + d].store(acc[0] * inv[c, h]).end(d, h, c).sink(
            arg=KernelInfo(name=f"attn_values_{tag}", opts_to_apply=()))

    def kernel(o: UOp, p: UOp, inv: UOp, pv: UOp, table: UOp) -> UOp:
        # per (column, head): Hd sums side by side, one pass over the positions; each sum still runs in position
        # order (lanes are independent accumulators, nothing reassociates), and the lanes vectorize. The REG sums
        # are indexed from 1 (engine/quant_gemm.py: clang's SLP lines its vectors up from there)
        N = p.shape[0]
        c, h, ends = _cpu_pairs(N, H)
        slot, pos = _slot_pos(c, runs)
        acc = UOp.placeholder((Hd + 1,), F32, 0, addrspace=AddrSpace.REG)
        d0 = UOp.range(Hd, 2)
        acc = acc.after(*ends)[d0 + 1].set(0.0, end=d0)
        t = UOp.range(ctx, 3, AxisType.REDUCE)
        row = _row(table, slot, t, B, pv.shape[0] // (KvH * Hd))
        w = p[c, h, t]
        d = UOp.range(Hd, 4)
        term = (t <= pos).where(w * pv[row * (KvH * Hd) + (h // G) * Hd + d].cast(F32), 0.0)
        acc = acc[d + 1].set(acc.after(t)[d + 1] + term, end=(d, t))
        d2 = UOp.range(Hd, 5)
        return o[c, h * Hd + d2].store(acc[d2 + 1] * inv[c, h]).end(d2).end(*ends).sink(
            arg=KernelInfo(name=f"attn_values_{tag}", opts_to_apply=()))
    return kernel_gpu if gpu else kernel


# ---- GPU: split-positions attention (flash-decoding style), two kernels a layer

CH = 32  # positions one thread block attends to (two KV blocks of 16)


def gpu_split_ok(head_dim: int, block_size: int) -> bool:
    """Whether the GPU's split kernels serve this head size (MESH_GPU_ATTN=paged keeps the three-kernel form)."""
    return os.environ.get("MESH_GPU_ATTN", "") != "paged" and head_dim % CH == 0 and head_dim <= 1024 \
        and CH % block_size == 0


def _chunks(ctx: UOp) -> UOp:
    # >= 1 even at ctx = 0: a CUDA graph sizes launches with the variables at 0, and a 0 launch is refused
    return ((ctx + (CH - 1)) // CH).maximum(1)


def _part_kernel(runs: Sequence[Run], ctx: UOp, B: int, H: int, KvH: int, Hd: int, scale: float, tag: str):
    """A thread block per (column, head, chunk of CH positions), a thread per value of head_dim. The block's CH keys
    and values are loaded at once (each thread its own element of every row: a warp reads whole rows), the CH dot
    products are summed through shared memory (thread d sums segment d // CH of position d % CH, then each thread
    adds the Hd / CH segments of every position in order), and every thread computes the chunk's max m of the raw
    dot products, the probabilities p_t = exp2((s_t - m) scale log2 e) and l = sum p_t itself (same operations,
    same order: the same values), then o[d] = sum_t p_t v[t, d]. Positions past the column's own are exact zeros:
    a chunk holding none of them gives m = -inf, l = 0, o = 0, which the combine adds as exact zeros.

    Batch invariance needs more than sums in a fixed order: the arithmetic must not depend on which masks the
    compiler can prove. With one run and max_context <= CH (one chunk) `t <= pos` is provably true for t = 0, so a
    mask on a term (`o + where(ok, p v, 0)`) folds to `o + p v` and becomes one fused multiply-add (PYTHON's
    MULACC, nvrtc's contraction), while beside another run the where stays and the product is rounded on its own:
    an ulp apart (seventh session). So no where sits between a multiply and the add it feeds: the mask goes on the
    values (v_t masked to 0; p_t = exp2(-inf) = 0 needs none), and the scale is applied after the subtraction of
    the max, not before it (tot * scale - m would contract the same way). Whatever folds, the chain of multiplies
    and adds keeps its shape. So nothing a column gets depends on ctx or on the other columns of the step."""
    G, W, NS, KB = H // KvH, KvH * Hd, Hd // CH, CH // B

    def kernel(po: UOp, pm: UOp, pl: UOp, q: UOp, pk: UOp, pv: UOp, table: UOp) -> UOp:
        N, per_seq = q.shape[0], table.shape[1]
        c, h, ch = (UOp.range(n, i, AxisType.GLOBAL) for i, n in enumerate((N, H, _chunks(ctx))))
        d = UOp.range(Hd, 3, AxisType.LOCAL)
        slot, pos = _slot_pos(c, runs)
        kv = (h // G) * Hd
        last_blk = pk.shape[0] // W // B - 1
        blks = [table[slot, (ch * KB + i).minimum(per_seq - 1)].cast(dtypes.int).maximum(0).minimum(last_blk)
                for i in range(KB)]
        qd = q[c, h * Hd + d]
        prods = UOp.placeholder((CH * (Hd + 1),), F32, 100, addrspace=AddrSpace.LOCAL)  # rows padded: no conflicts
        # a chunk wholly past the column's position (a shorter column beside longer ones: up to a third of a serving
        # step's blocks) loads nothing: its keys and values read as 0, and every one of its terms is masked anyway
        # (MESH_GPU_ATTN_SKIP=0 loads them, for A/B runs)
        live = ch * CH <= pos if os.environ.get("MESH_GPU_ATTN_SKIP", "1") != "0" else None
        stores, vals = [], []
        for j in range(CH):
            row = (blks[j // B] * B + j % B) * W + kv + d
            if live is not None:
                row = row.valid(live)
            stores.append(prods[j * (Hd + 1) + d].store(qd * pk[row].cast(F32)))
            vals.append(pv[row].cast(F32))
        st1 = UOp.group(*stores)
        jr, sg = d % CH, d // CH
        seg = UOp.placeholder((1,), F32, 0, addrspace=AddrSpace.REG)
        i = UOp.range(CH, 4, AxisType.REDUCE)
        seg = seg.after(c, h, ch, d, st1)[0].set(0.0)
        seg = seg[0].set(seg.after(i)[0] + prods.after(st1)[jr * (Hd + 1) + sg * CH + i], end=i)
        sums = UOp.placeholder((Hd,), F32, 101, addrspace=AddrSpace.LOCAL)
        st2 = sums[d].store(seg[0])  # d = sg * CH + jr
        ok = [ch * CH + j <= pos for j in range(CH)]
        s = []
        for j in range(CH):  # raw dot products: no multiply here for the max's subtraction to fuse with
            tot = sums.after(st2)[j]
            for g in range(1, NS):
                tot = tot + sums.after(st2)[g * CH + j]
            s.append(ok[j].where(tot, float("-inf")))
        m = s[0]
        for sj in s[1:]:
            m = m.maximum(sj)
        # p_t needs no mask of its own: a masked s_t is -inf, exp2(-inf) = 0 (m is floored to a finite value, so a
        # chunk past the column's position gives 0, not -inf - -inf). The values are masked as operands (trash rows
        # may hold anything), never between the multiply and the add it feeds
        mf = m.maximum(-3.0e38)
        p = [((s[j] - mf) * (scale * LOG2E)).exp2() for j in range(CH)]
        l, o = p[0], p[0] * ok[0].where(vals[0], 0.0)
        for j in range(1, CH):
            l = l + p[j]
            o = o + p[j] * ok[j].where(vals[j], 0.0)
        first = d < 1
        out = UOp.group(po[c, h, ch, d].store(o), pm[c, h, ch.valid(first)].store(m), pl[c, h, ch.valid(first)].store(l))
        return out.end(d, ch, h, c).sink(arg=KernelInfo(name=f"attn_part_{tag}", opts_to_apply=()))
    return kernel


def _combine_kernel(ctx: UOp, H: int, Hd: int, scale: float, tag: str):
    """out[c, h, d] = sum_i o_i[d] w_i / sum_i l_i w_i with w_i = exp((m_i - max m) scale), over the chunks in order
    (a thread block per (column, head), a thread per value; m_i are the parts' raw dot-product maxima)."""
    def kernel(o: UOp, po: UOp, pm: UOp, pl: UOp) -> UOp:
        N = o.shape[0]
        c, h = UOp.range(N, 0, AxisType.GLOBAL), UOp.range(H, 1, AxisType.GLOBAL)
        d = UOp.range(Hd, 2, AxisType.LOCAL)
        i1 = UOp.range(_chunks(ctx), 3, AxisType.REDUCE)
        mx = UOp.placeholder((1,), F32, 0, addrspace=AddrSpace.REG)
        mx = mx.after(c, h, d)[0].set(float("-inf"))
        mx = mx[0].set(mx.after(i1)[0].maximum(pm[c, h, i1]), end=i1)
        i2 = UOp.range(_chunks(ctx), 4, AxisType.REDUCE)
        w = ((pm[c, h, i2] - mx[0]) * (scale * LOG2E)).exp2()
        lt = UOp.placeholder((1,), F32, 1, addrspace=AddrSpace.REG)
        ot = UOp.placeholder((1,), F32, 2, addrspace=AddrSpace.REG)
        lt = lt.after(mx)[0].set(0.0)
        ot = ot.after(mx)[0].set(0.0)
        step = UOp.group(lt[0].store(lt.after(i2)[0] + pl[c, h, i2] * w), ot[0].store(ot.after(i2)[0] + po[c, h, i2, d] * w))
        step = step.end(i2)
        lt, ot = lt.after(step), ot.after(step)
        return o[c, h * Hd + d].store(ot[0] * lt[0].reciprocal()).end(d, h, c).sink(
            arg=KernelInfo(name=f"attn_combine_{tag}", opts_to_apply=()))
    return kernel


def _gpu(t: Tensor) -> bool:
    return not str(t.device).startswith("CPU")


def write_kv(pool_k: Tensor, pool_v: Tensor, src: Tensor, table: Tensor, runs: Sequence[Run], block_size: int,
             k_offset: int, v_offset: int) -> list[Tensor]:
    """Store each column's k and v, the W = pool width values of src (N, ...) row from k_offset and from v_offset,
    into the pools at its slot's position. Returns the pools after the write (realize them before a read)."""
    W = pool_k.shape[1]
    tag = f"{src.shape[0]}x{W}_r{len(runs)}"
    out = Tensor.custom_kernel(pool_k.reshape(-1), pool_v.reshape(-1), src.contiguous(), table,
                               fxn=_write_kernel(_kruns(runs), block_size, W, k_offset, v_offset, _gpu(src), tag))
    return out[:2]


def _rope_write_kernel(runs: Sequence[Run], B: int, H: int, KvH: int, Hd: int, max_context: int, tag: str):
    """A thread per value of a column's q|k|v row (the qkv matmul's output): q and k roped (half-split pairs, the
    cos/sin of the column's position read from stage-wide tables), q stored for attention, k and v into the pools at
    the column's row. One kernel where the Tensor graph took two (the roped join, then the write)."""
    HH, W, R2 = H * Hd, KvH * Hd, Hd // 2

    def kernel(qo: UOp, pk: UOp, pv: UOp, src: UOp, cos: UOp, sin: UOp, table: UOp) -> UOp:
        N = src.shape[0]
        # a thread block per head of the row, a thread per value: with both ranges global (and no opts) the launch
        # was a thread block of one thread per value, 6144 of them at the 8B shape (6.0 us a layer on the H200)
        c, hb = UOp.range(N, 0, AxisType.GLOBAL), UOp.range((HH + 2 * W) // Hd, 1, AxisType.GLOBAL)
        e = UOp.range(Hd, 2, AxisType.LOCAL)
        slot, pos = _slot_pos(c, runs)
        base = hb * Hd
        j, i = base + e, e % R2
        x1, x2 = src[c, base + i], src[c, base + i + R2]
        p = pos.minimum(max_context - 1)  # a padded chunk's pad rows: positions past the context write the trash
        cs, sn = cos[p, i], sin[p, i]
        roped = (e < R2).where(x1 * cs - x2 * sn, x2 * cs + x1 * sn)
        row = _row(table, slot, pos, B, pk.shape[0] // W)
        st = UOp.group(qo[c, j.valid(j < HH)].store(roped),
                       pk[(row * W + j - HH).valid((j >= HH) & (j < HH + W))].store(roped.cast(pk.dtype)),
                       pv[(row * W + j - (HH + W)).valid(j >= HH + W)].store(src[c, j].cast(pv.dtype)))
        return st.end(e, hb, c).sink(arg=KernelInfo(name=f"rope_kv_write_{tag}", opts_to_apply=()))
    return kernel


def rope_write_kv(src: Tensor, cos: Tensor, sin: Tensor, pool_k: Tensor, pool_v: Tensor, table: Tensor,
                  runs: Sequence[Run], block_size: int, n_heads: int, n_kv_heads: int, head_dim: int) -> Tensor:
    """src (N, (H + 2 KvH) Hd) float32 rows of q|k|v before rope; cos/sin (max_context, Hd / 2) tables of every
    position. Writes each column's roped k and its v into the pools (as write_kv) and returns its roped q (N, H Hd)
    float32, all realized: attention may read them next."""
    N, HH = src.shape[0], n_heads * head_dim
    tag = f"{N}x{src.shape[1]}_r{len(runs)}"
    qo = Tensor.empty(N, HH, dtype=F32, device=src.device)
    out = Tensor.custom_kernel(qo, pool_k.reshape(-1), pool_v.reshape(-1), src.contiguous(), cos, sin, table,
                               fxn=_rope_write_kernel(_kruns(runs), block_size, n_heads, n_kv_heads, head_dim,
                                                      cos.shape[0], tag))
    Tensor.realize(*out[:3])
    return out[0]


def paged_attention_x8(q: Tensor, pool_k: Tensor, pool_v: Tensor, table: Tensor, runs: Sequence[Run], ctx: UOp,
                       max_context: int, block_size: int, n_heads: int, n_kv_heads: int, head_dim: int,
                       scale: float) -> tuple[Tensor, attention_cpu.X8 | None]:
    """`paged_attention`, and its result quantized for an 8-bit output matmul where the CPU's kernel does that too
    (engine/attention_cpu.py `attention_x8`; else None)."""
    if not _gpu(q) and attention_cpu.wanted(str(q.device), block_size, head_dim):
        return attention_cpu.attention_x8(q.cast(F32).contiguous(), pool_k, pool_v, table, _kruns(runs), max_context,
                                          n_heads, n_kv_heads, head_dim, scale)
    return paged_attention(q, pool_k, pool_v, table, runs, ctx, max_context, block_size, n_heads, n_kv_heads, head_dim,
                           scale), None


def paged_attention(q: Tensor, pool_k: Tensor, pool_v: Tensor, table: Tensor, runs: Sequence[Run], ctx: UOp,
                    max_context: int, block_size: int, n_heads: int, n_kv_heads: int, head_dim: int,
                    scale: float) -> Tensor:
    """q (N, H * Hd and more: only each row's first H * Hd values are read) against each column's own sequence in
    the pools -> (N, H * Hd) float32. `ctx` is a bound variable at least every run's end (pos + n); the scratch is
    sized for max_context."""
    N, H, Hd = q.shape[0], n_heads, head_dim
    runs, ctx = _kruns(runs), _kvar(ctx)
    tag = f"{N}x{H}x{Hd}_r{len(runs)}"
    q = q.cast(F32).contiguous()
    gpu = _gpu(q)
    if not gpu and attention_cpu.wanted(str(q.device), block_size, Hd):  # one C kernel, the same bits
        return attention_cpu.attention(q, pool_k, pool_v, table, runs, max_context, H, n_kv_heads, Hd, scale)
    if gpu and gpu_split_ok(Hd, block_size):
        nch = -(-max_context // CH)
        po = Tensor.empty(N, H, nch, Hd, dtype=F32, device=q.device)
        pm, pl = (Tensor.empty(N, H, nch, dtype=F32, device=q.device) for _ in range(2))
        po, pm, pl = Tensor.custom_kernel(po, pm, pl, q, pool_k.reshape(-1), pool_v.reshape(-1), table,
                                          fxn=_part_kernel(runs, ctx, block_size, H, n_kv_heads, Hd, scale, tag))[:3]
        o = Tensor.empty(N, H * Hd, dtype=F32, device=q.device)
        return Tensor.custom_kernel(o, po, pm, pl, fxn=_combine_kernel(ctx, H, Hd, scale, tag))[0]
    s = Tensor.empty(N, H, -(-max_context // block_size) * block_size, dtype=F32, device=q.device)  # whole blocks
    s = Tensor.custom_kernel(s, q, pool_k.reshape(-1), table,
                             fxn=_scores_kernel(runs, ctx, block_size, H, n_kv_heads, Hd, scale, gpu, tag))[0]
    p, inv = Tensor.empty(N, H, max_context, dtype=F32, device=q.device), Tensor.empty(N, H, dtype=F32, device=q.device)
    p, inv = Tensor.custom_kernel(p, inv, s, fxn=_softmax_kernel(runs, ctx, H, gpu, tag))[:2]
    o = Tensor.empty(N, H * Hd, dtype=F32, device=q.device)
    return Tensor.custom_kernel(o, p, inv, pool_v.reshape(-1), table,
                                fxn=_values_kernel(runs, ctx, block_size, H, n_kv_heads, Hd, gpu, tag))[0]
