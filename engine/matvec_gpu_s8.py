"""The tensor-core matvec with 8-bit x (CUDA mma.sync m16n8k32, s8 x s8 -> s32): y = x @ W.T for Q4_0 and Q8_0
blocks in engine/matvec_gpu_tc.py's resident layout, x quantized to int8 per block of 32 by a kernel of its own.

Why (NOTES "The tensor-core matvec waits, not computes"): at 16 columns the bf16 kernel's warps wait on their loads,
and most of what they load is x: every thread block reads every column's f32 x (1.1B gate_up: ~45 MB through L2 a
call against 24.5 MB of weights), then splits it into three bf16 pieces in registers for six MMAs a block. Here x
is quantized once a step (a byte a value and a scale a block), a warp loads the bytes its B fragment holds as they
lie, and one integer MMA does a block and 8 columns: Q8_0's quants go into the A fragment as the file holds them,
Q4_0's nibbles after one mask.

Numerics: llama.cpp's CUDA kernels quantize x the same way (q8_1), as engine/quant_i8.py does on the CPU (the
lead's decision there, thirteenth session): per block of 32, d = amax / 127, q = rint(v / d) (the inverse
multiplied; rint by the 1.5 * 2^23 add, which nvcc fuses with the multiply into one FFMA, and tinygrad's rewrites
make the inverse 127 / amax: the quants are a function of the block's values alone either way, not numpy's to the
bit in every tie). The integer sums are exact; per block, in block order,
    acc = acc + float(isum) * (d_w * d_x)      isum = sum q_w q_x (Q4_0: sum n q_x - 8 sum q_x, the -8 sum in C)
A fused RMS norm quantizes x * w and puts 1 / rms into d_x; silu(gate) * up is made in the quantize kernel.
A column's result depends on its own x alone (its MMA column, its d_x) and the order of the float steps on the
matrix alone, so a column has the same bits alone and in any batch: the stage's contract (one kernel every width).

tinygrad renders mma.sync for float inputs only, so `s8_renderer` gives a CUDA device's C renderer the s8 form
(the same asm template with s8 / s32 and the vector structs its fragments need); the PYTHON device emulates the
(8, 16, 32) MMA in integers as it is, so the tests run there.
"""
from __future__ import annotations

import os

from gguf import GGMLQuantizationType as Q
from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.dtype import AddrSpace
from tinygrad.helpers import strip_parens
from tinygrad.renderer.cstyle import CUDARenderer, _wmma_name
from tinygrad.uop.ops import AxisType, GroupOp, KernelInfo, Ops, PatternMatcher, UPat

from .matvec_gpu_tc import (GROUP, SPLIT, WARPS, accumulators, column_of, partials_out, tc_unroll, tile_loads,
                            tiles_a_warp, warps_a_row)

F32, U32, I32, I8 = dtypes.float32, dtypes.uint32, dtypes.int32, dtypes.int8
BLOCK = 32
LOG2E = 1.4426950408889634
ROUND = 12582912.0  # 1.5 * 2^23: v + ROUND rounds v to an integer (ties to even) in the low bits, |v| < 2^22


def x8_wanted() -> bool:
    """Whether a tensor-core stage quantizes x to 8 bits: yes unless MESH_GPU_TC_X8=0 (the bf16 kernel, for A/B runs).
    On the H200 the 16-column step is 23-34% shorter (1.1B and 8B shapes), the one-column step 1-6% longer
    (bench/RESULTS.md, sixteenth and seventeenth sessions); a serving stage is for many columns."""
    return os.environ.get("MESH_GPU_TC_X8", "1") != "0"


def s8_renderer(device: str) -> bool:
    """Make `device` render s8 MMAs; False where it cannot (not tinygrad's CUDA C renderer, e.g. CUDA:PTX). The
    PYTHON device needs nothing."""
    if device.split(":")[0] == "PYTHON":
        return True
    ren = Device[device].renderer
    if type(ren) is CUDARenderer:
        ren.__class__ = S8CUDARenderer  # a class of this module: the compile pool pickles the renderer
    return isinstance(ren, S8CUDARenderer)


def _alu_in_order(ctx, x: UOp) -> str:
    """An ALU op in C with its sources' parentheses kept where C's left-to-right grouping would change a float result.
    tinygrad 0.14's C renderer drops them around any source of the same associative op, so a float a * (b * c) is
    written a * b * c, which C computes as (a * b) * c. Here only the first source (C's own grouping) and integer
    ones lose them. Found on the H200 (bench/s8_bisect.py): `isum * (d_w * d_x)` kept its grouping where d_w * d_x
    had two uses (a one-column kernel: both of a lane's columns are column 0) and lost it elsewhere, so a column's
    bits alone and in a batch differed by an ulp."""
    assoc = {Ops.ADD, Ops.MUL, Ops.XOR, Ops.OR, Ops.AND}
    return ctx.code_for_op[x.op](*[strip_parens(ctx[v]) if v.op is x.op and x.op in assoc and
                                   (i == 0 or not dtypes.is_float(x.dtype)) else ctx[v] for i, v in enumerate(x.src)],
                                 x.dtype)


ALU_IN_ORDER = PatternMatcher([(UPat(GroupOp.ALU, name="x"), _alu_in_order)])  # ahead of a C renderer's rules


class S8CUDARenderer(CUDARenderer):
    """tinygrad's CUDA C renderer, with the s8 form of mma.sync for the WMMA ops whose inputs are int8, and float
    sums and products grouped as the UOps group them (`_alu_in_order`)."""

    string_rewrite = ALU_IN_ORDER + CUDARenderer.string_rewrite

    def render_kernel(self, function_name, kernel, bufs, uops, prefix=None):
        s8 = {u for u in uops if u.op is Ops.WMMA and u.arg[1] == I8}
        src = super().render_kernel(function_name, kernel, bufs, [u for u in uops if u not in s8], prefix)
        if not s8:
            return src
        # the fragments: 16 and 8 int8 (structs, as tinygrad makes its half vectors), C / D an int4 (CUDA's own)
        defs = [self.render_vector_prefix(I8, n) for n in (16, 8)]
        for name in sorted({_wmma_name(u) for u in s8}):
            defs.append(f"""__device__ int4 __{name}(signed_char16 a, signed_char8 b, int4 c) {{
  const int *a_pk = (const int *)(&a), *b_pk = (const int *)(&b);
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};"
      : "+r"(c.x), "+r"(c.y), "+r"(c.z), "+r"(c.w)
      : "r"(a_pk[0]), "r"(a_pk[1]), "r"(a_pk[2]), "r"(a_pk[3]), "r"(b_pk[0]), "r"(b_pk[1]));
  return c;
}}""")
        return "\n".join(defs) + "\n" + src


def _bytes(word: UOp) -> list[UOp]:
    """The 4 bytes of a uint32 as int8, low first (ptxas keeps the word: no byte is moved)."""
    return [((word >> (8 * j)) & 0xFF if j else word & 0xFF).cast(dtypes.uint8).bitcast(I8) for j in range(4)]


def _quantize_kernel(eps: float | None, glu: bool, sums: bool):
    """custom_kernel(xq (N, C/4) u32, xd (C/32, N) f32, [xs (C/32, N) i32 with `sums`], x (N, C, or 2C with glu)
    f32, [norm w]). A thread block a column, a thread a block of 32 (up to 1024 threads; past that thread t takes
    blocks t, t + P, ...). With the norm, each thread sums its blocks' squares first (values in order), and the P
    partials meet in shared memory in two levels of sums in order (groups of K, then the groups), the same for every
    thread."""
    def kernel(xq: UOp, xd: UOp, *rest: UOp) -> UOp:
        xs, x, *norm_w = rest if sums else (None, *rest)
        N, C = xq.shape[0], xq.shape[1] * 4
        nb = C // BLOCK
        P = max(p for p in range(1, min(nb, 1024) + 1) if nb % p == 0)
        n, t = UOp.special(N, "gidx0"), UOp.special(P, "lidx0")

        def xv(k: UOp) -> UOp:
            if not glu:
                return x[n, k]
            gate = x[n, k]
            return gate * (1.0 + (gate * -LOG2E).exp2()).reciprocal() * x[n, k + C]

        def summed(buf: UOp, count: int, start: UOp | int, slot: int, *deps: UOp) -> UOp:
            acc = UOp.placeholder((1,), F32, slot, addrspace=AddrSpace.REG).after(n, t, *deps)[0].set(0.0)
            i = UOp.range(count, slot, AxisType.REDUCE)
            return acc[0].set(acc.after(i)[0] + buf[start + i], end=i)[0]
        rs = None
        if norm_w:
            bj = UOp.range(nb // P, 1, AxisType.REDUCE)
            sq = UOp.placeholder((1,), F32, 20, addrspace=AddrSpace.REG)
            sq = sq.after(n, t)[0].set(0.0)
            vals = [xv((bj * P + t) * BLOCK + j) for j in range(BLOCK)]
            v = sq.after(bj)[0]
            for e in vals:
                v = v + e * e
            sq = sq[0].set(v, end=bj)[0]
            K = min(k for k in range(1, P + 1) if P % k == 0 and k * k >= P)
            ssp = UOp.placeholder((P,), F32, 21, addrspace=AddrSpace.LOCAL)
            ssp = ssp.after(ssp[t].store(sq))
            part = summed(ssp, K, (t // K) * K, 22, ssp)  # every thread of a group the same sum
            ssp2 = UOp.placeholder((P // K,), F32, 23, addrspace=AddrSpace.LOCAL)
            ssp2 = ssp2.after(ssp2[t // K].store(part))
            tot = summed(ssp2, P // K, 0, 24, ssp2)
            rs = (tot * (1.0 / C) + eps).sqrt().reciprocal()
        bi = UOp.range(nb // P, 3)
        b = bi * P + t
        vals = [xv(b * BLOCK + j) for j in range(BLOCK)]
        if norm_w:
            vals = [v * norm_w[0][b * BLOCK + j] for j, v in enumerate(vals)]
        amax = None
        for v in vals:
            a = v.maximum(-v)
            amax = a if amax is None else amax.maximum(a)
        d = amax * (1.0 / 127.0)
        inv = (d != 0.0).where(d.reciprocal(), 0.0)
        qs = [(v * inv + ROUND).bitcast(I32) - 0x4B400000 for v in vals]  # the rounded integer, -127..127
        stores = []
        for w in range(BLOCK // 4):
            word = UOp.const(0, U32)
            for j in range(4):
                byte = qs[4 * w + j].bitcast(U32) & 0xFF
                word = word | (byte << (8 * j)) if j else byte
            stores.append(xq[n, b * (BLOCK // 4) + w].store(word))
        if sums:
            s = qs[0]
            for q in qs[1:]:
                s = s + q
            stores.append(xs[b, n].store(s))
        stores.append(xd[b, n].store(d * rs if rs is not None else d))
        name = f"q8xtc_{N}x{C}" + ("_norm" if norm_w else "") + ("_glu" if glu else "") + ("_sums" if sums else "")
        return UOp.group(*stores).end(bi).sink(arg=KernelInfo(name=name, opts_to_apply=()))
    return kernel


def quantize(x: Tensor, norm: tuple[Tensor, float] | None = None, glu: bool = False,
             sums: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
    """x (N, C) f32 (with `glu`: (N, 2C) [gate | up], silu(gate) * up quantized) -> (q (N, C/4) uint32: 4 int8 a word,
    d (C/32, N) f32: a block's scale (times 1 / rms with `norm`), s (C/32, N) int32: a block's sum of q, or None
    without `sums`: a buffer no kernel reads is not written)."""
    N, C = x.shape[0], x.shape[1] // (2 if glu else 1)
    q = Tensor.empty(N, C // 4, dtype=U32, device=x.device)
    d = Tensor.empty(C // BLOCK, N, dtype=F32, device=x.device)
    s = [Tensor.empty(C // BLOCK, N, dtype=I32, device=x.device)] if sums else []
    w = [] if norm is None else [norm[0].cast(F32).contiguous()]
    q, d, *rest = Tensor.custom_kernel(q, d, *s, x.cast(F32).contiguous(), *w,
                                       fxn=_quantize_kernel(None if norm is None else float(norm[1]), glu, sums))
    return q, d, rest[0] if sums else None


def s8_layout(tiles: int, nb: int, n: int) -> tuple[int, int] | None:
    """(S, R): S warps over a row's blocks (engine/matvec_gpu_tc.py's rule), R tiles of 16 rows a warp, as many as
    keep the grid at WARPS warps and fit the S partials in shared memory. At every width: the bf16 kernel's fewer,
    fuller warps at 8+ columns (WIDE_WARPS) shared a warp's split of x, which this kernel does not make; on the H200
    the 1.1B step at 16 columns took 1.90 ms at WARPS against 2.24 at WIDE_WARPS (bench/RESULTS.md)."""
    S = warps_a_row(nb, int(os.environ.get("MESH_GPU_TC_SPLIT", SPLIT)))
    fits = tiles_a_warp(tiles, S, n, int(os.environ.get("MESH_GPU_TC_WARPS", WARPS)))
    return (S, max(fits)) if fits else None


def s8_matvec_kernel(name: str, ggml_type: int, residual: bool = False):
    """The kernel for custom_kernel(out (N, rows) f32, words (T, nb, 32, LANE_WORDS) u32, scales (T, nb, 8, 2) f16,
    xq, xd, [xs] (`quantize`'s; xs for Q4_0 only), [residual (N, rows) f32]). Every buffer passed is read: a CUDA
    graph node with more arguments than its kernel's parameters is refused (engine/matvec_gpu_tc.py)."""
    def kernel(out: UOp, words: UOp, scales: UOp, xq: UOp, xd: UOp, *extra: UOp) -> UOp:
        T, nb = words.shape[:2]
        N = xq.shape[0]
        xs = extra[0] if ggml_type == Q.Q4_0 else None
        res = extra[-1] if residual else None
        most = int(os.environ.get("MESH_GPU_TC_GROUP", GROUP))
        group = next(gc for gc in (GROUP, 8, 4, 2, 1) if gc <= most and s8_layout(T, nb, min(N, gc)) is not None)
        NG, NC = -(-N // group), min(N, group)
        S, R = s8_layout(T, nb, NC)
        NT = -(-NC // 8)
        # threadIdx.x = 32 s + lane, lane (g, c) = 4 g + c (the fragments are defined by the lane number)
        tid = UOp.special(32 * S, "lidx0")
        c, g, s = tid % 4, (tid // 4) % 8, tid // 32
        tg = UOp.special(T // R, "gidx0")
        gn = UOp.special(NG, "gidx1") if NG > 1 else None
        lanes = () if gn is None else (gn,)

        column = column_of(N, NC, group, NG, gn)
        U = tc_unroll(nb // S)
        bi = UOp.range(nb // S // U, 4, AxisType.REDUCE)
        ks = [bi * U + u for u in range(U)] if U > 1 else [bi]  # the warp's blocks s, s + S, ..., U a loop step
        bs = [k * S + s if S > 1 else k for k in ks]
        lane = tid % 32
        # B: column nt * 8 + g, the 8 values of MMA slots 4c..4c+3 and 4c+16..4c+19 (the A fragment's k order:
        # Q8_0 bytes 8c..8c+7 of the block, Q4_0 values 4c..4c+3 and 4c+16..4c+19: words c and c + 4)
        bcols = [column(nt * 8 + g, NT * 8) for nt in range(NT)]
        wi = (lambda b: (b * 8 + 2 * c, b * 8 + 2 * c + 1)) if ggml_type == Q.Q8_0 else \
            (lambda b: (b * 8 + c, b * 8 + c + 4))
        bvec = [[UOp.stack(*[e for k in wi(b) for e in _bytes(xq[n, k])]) for n in bcols] for b in bs]
        # C: columns nt * 8 + 2c + e of the lane's elements (e = i % 2), their scales (and Q4_0's -8 sum q_x)
        ccols = [[column(nt * 8 + 2 * c + e, NT * 8) for e in range(2)] for nt in range(NT)]
        dx = [[[xd[b, n] for n in cc] for cc in ccols] for b in bs]
        cinit = [[UOp.stack(*[xs[b, cc[i % 2]] * -8 for i in range(4)]) if ggml_type == Q.Q4_0
                  else UOp.const((0,) * 4, I32) for cc in ccols] for b in bs]
        accs = accumulators(R * NT, tg, lanes)
        stores = []
        for r in range(R):
            wds, ds = tile_loads(words, scales, tg * R + r, bs, lane, g)
            parts = []
            for u in range(len(bs)):
                w = wds[u]
                if ggml_type == Q.Q8_0:  # rows g, g + 8 of words 2c (slots 4c..), then of words 2c + 1 (4c + 16..)
                    avec = UOp.stack(*[e for k in (0, 2, 1, 3) for e in _bytes(w[k])])
                else:  # nibbles n of rows g, g + 8: low (values 4c..4c+3), then high (4c+16..4c+19)
                    lo = [w[h] & 0x0F0F0F0F for h in range(2)]
                    hi = [(w[h] >> 4) & 0x0F0F0F0F for h in range(2)]
                    avec = UOp.stack(*[e for word in (*lo, *hi) for e in _bytes(word)])
                parts.append([UOp.wmma(avec, bvec[u][nt], cinit[u][nt], (8, 16, 32), "CUDA", 32) for nt in range(NT)])
            for nt in range(NT):
                acc = accs[r * NT + nt]
                for i in range(4):
                    v = acc.after(bi)[i]
                    for u in range(len(bs)):  # acc += float(isum) * (d_w * d_x), block after block
                        isum = parts[u][nt].index(UOp.const(i, dtypes.int)).cast(F32)
                        v = v + isum * (ds[u][i // 2] * dx[u][nt][i % 2])
                    stores.append(acc[i].store(v))
        step = UOp.group(*stores).end(bi)
        st = partials_out(accs, step, tid, tg, lanes, S, R, NT, NC, column, out, res)
        fu = ("_res" if res is not None else "") + (f"_g{NG}" if NG > 1 else "")
        return st.sink(arg=KernelInfo(name=f"mvs8_{name}{fu}_{T}x16_{nb}_s{S}r{R}n{NT}" + (f"u{U}" if U > 1 else ""),
                                      opts_to_apply=()))
    return kernel


def s8_matmul_t(words: Tensor, scales: Tensor, ggml_type: int, x: Tensor, *, norm: tuple[Tensor, float] | None = None,
                glu: bool = False, residual: Tensor | None = None) -> Tensor:
    """x (N, cols) @ W.T -> (N, rows) f32 with W in the tensor-core layout, x quantized to 8 bits a block of 32;
    `norm` (weight, eps) and `glu` (x (N, 2 cols) [gate | up]) in the quantize kernel, `residual` added at the end."""
    T = words.shape[0]
    q4 = ggml_type == Q.Q4_0  # Q8_0's weights are signed: no -8 sum q_x to take off, no sums made
    xq, xd, xs = quantize(x, norm, glu, sums=q4)
    out = Tensor.empty(x.shape[0], T * 16, dtype=F32, device=words.device)
    extra = [residual.cast(F32).contiguous()] if residual is not None else []
    kern = s8_matvec_kernel(Q(ggml_type).name.lower(), ggml_type, residual is not None)
    return Tensor.custom_kernel(out, words, scales, xq, xd, *([xs] if q4 else []), *extra, fxn=kern)[0]
