"""The resident-block matvec on a GPU (CUDA, METAL), written in UOps: y = x @ W.T with W in the split, interleaved
GGUF layout of engine/quant.py (bytes (G, blocks, rest, IL) read as uint32 words of 4 rows, halfs (G, blocks, n, IL)).

Why it looks the way it does (a decode step streams every weight once, so a matvec should run at memory speed; the
H200 needs ~18 bytes a clock per SM, ~7 instructions a byte of Q8_0 at most):
- A thread block per group of IL = 16 rows (fewer when the row count is not a multiple of 16). Each thread holds
  the 16 rows as lanes: a 16-byte load brings the same byte of one block for all of them, and 16 independent
  accumulators take the products.
- TW threads share a block's values, thread jt taking values jt, jt + TW, ... (J = width / TW of each sub-block):
  every load instruction of a warp reads whole 32-byte sectors, and a thread sums J products of a sub-block before
  it scales them once (the old kernel scaled every product, and converted a half for each). The J loads are
  unrolled here in Python, so they are all in flight before the first is used.
- Quants become floats by the exponent trick, not by int->float conversions (Q8_0's signed bytes cost a sign
  extension and a conversion each; the old kernel spent 10.6 SASS instructions a value, this one 5.4): a quant q
  in 0..2^22 OR'ed into the mantissa of 2^23 reads as the float 2^23 + q, exactly, and one subtraction leaves q
  (or q - z: Q8_0's signed bytes are flipped to q + 128 by one XOR, Q4_0's -8 and Q5_0's -16 go into the
  subtracted constant). Same values as a conversion, bit for bit. Q4_0 and Q8_0 (read as words) go further: a
  quant is masked where it lies in its word and the exponent OR'ed over it in one LOP3 (the exponent words come
  from a 3-word input, `magic_word`, so ptxas keeps them in registers), its place 2^pos taken out by the FFMA that
  removes 2^23: Q4_0 3.98 instructions a value instead of 5.30, of them integer 1.25 instead of 2.62
  (bench/matvec_sass.py; Hopper issues integer logic at half the float rate). The same floats, bit for bit.
- A thread block takes up to COLS columns of a batch together (MESH_GPU_MV_COLS; default 1, a column a block: on the
  H200 the tiles ran slower, see COLS below): each decoded quant is
  multiplied into all of them (a batch decoded the weights once a column: 16 streams cost ~16 single steps).
  Each column's operations, and its shared-memory rounds, are those of the column alone: the same bits in any
  batch. SASS per column and value in a tile of 4: Q4_0 1.98, Q8_0 2.03 (128 / 180 registers). With
  MESH_GPU_MV_WIDE set, batches of 5 or more columns go to engine/matvec_gpu_wide.py (off by default: its docstring).
- Sub-blocks that share their scale and offset (Q4_0, Q4_1, Q5_0, Q5_1: the two nibble planes) are summed before
  the one scaling.
- P blocks of a row side by side (blocks p, p + P, ...): TW * P threads a block; their partial sums meet in shared
  memory in two rounds. A fused RMS norm's 1/rms is applied after the sum, each thread summing the squares of the
  x it reads.
`MESH_GPU_MV="TW,THREADS[,BU]"` overrides the layout for A/B runs (THREADS: the most threads a block, BU: blocks a
thread reads per loop step; "naive" selects the thread-per-row kernel in engine/quant.py); `MESH_GPU_CVT=cast`
converts quants by casts instead, `MESH_GPU_CVT=byte` keeps Q4_0/Q8_0 byte-wise (A/B runs). On the H200 (bench/RESULTS.md) the Q8_0 kernel streams 3.44 TB/s, Q4_0 2.16.
"""
from __future__ import annotations

import os

from gguf import GGMLQuantizationType as Q
import numpy as np
from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.device import Buffer
from tinygrad.dtype import AddrSpace
from tinygrad.uop.ops import AxisType, KernelInfo

F32, U32 = dtypes.float32, dtypes.uint32
LOG2E = 1.4426950408889634
MAGIC = 0x4B000000  # the bits of 2^23: OR'ed with an integer below 2^23 the float reads 2^23 + that integer
TW = 8  # threads sharing a block's values (a Q8_0 thread reads 4 of them: 4 16-byte loads)
THREADS = 256  # the most threads of a block


def _float(q: UOp, minus: int = 0) -> UOp:
    """q - minus as a float32, q a uint32 in [0, 2^23): no conversion instruction."""
    return (q | MAGIC).bitcast(F32) - float((1 << 23) + minus)


def _float_signed(q: UOp) -> UOp:
    """Any small int32 value q (|q| < 2^22) as a float32, through 1.5 * 2^23 (the type's generic quant)."""
    return (q + 0x4B400000).cast(U32).bitcast(F32) - 12582912.0


# quant of value j of sub-block s as a float, for the types whose generic form (int, then converted) costs more:
# Q8_0's int8 as unsigned byte ^ 0x80 = q + 128; Q4_0/Q5_0's offsets folded into the subtraction (their offset
# then needs no sum of x)
def _nib(byte: UOp, high: int) -> UOp:
    return (byte >> (high * 4)) & 15


def _fifth(qh, k: UOp) -> UOp:
    return ((qh(k >> 3) >> (k & 7).cast(U32)) & 1) << 4


FAST = {  # ggml type -> (quant as float, offsets folded)
    Q.Q8_0: lambda b, s, j: _float(b(j) ^ 0x80, 128),
    Q.Q4_0: lambda b, s, j: _float(_nib(b(j), s), 8),
    Q.Q5_0: lambda b, s, j: _float(_nib(b(4 + j), s) | _fifth(b, s * 16 + j), 16),
}



def _lane(e: UOp, vals: list, dtype) -> UOp:
    """Lane e's entry of vals (e an unrolled range of 4): a chain of wheres that folds to one constant a lane."""
    out = UOp.const(vals[-1], dtype)
    for i in range(len(vals) - 2, -1, -1):
        out = e.eq(i).where(UOp.const(vals[i], dtype), out)
    return out


def _placed(bits: UOp, pos: UOp, minus: UOp) -> UOp:
    """bits = MAGIC | (v << pos) as a float is 2^23 + v 2^pos exactly: times 2^-pos (exact) minus (2^(23-pos) + z)
    leaves v - z, exactly (one FFMA: its one rounding has nothing to round)."""
    return bits.bitcast(F32) * pos + minus


# The word decode (default where the blocks are read as words: il % 4 == 0): word k of a block holds byte k of 4
# rows (lane e = byte e). The byte-wise decode above shifts each byte down, masks it, ORs the exponent in: 2.5-2.6
# integer instructions a value in SASS (bench/matvec_sass.py), and Hopper issues integer logic at half the float
# rate, so Q4_0 was integer-bound on the H200. Here a quant is masked where it lies in the word and the exponent
# word m is OR'ed over it: one LOP3 a value, since m is read from memory (the magic word, an input the compiler
# cannot fold: with two immediates, (w & 0xF0) | 0x4B000000, ptxas emits two instructions). Its place 2^pos is
# taken out by the FFMA that removes 2^23, so the floats are the byte-wise decode's, bit for bit. Bits 23-31 do
# not fit under the mantissa's 23: those quants are shifted down first (one SHF a word).
def _q4_0_word(word: UOp, e: UOp, s: int, m: UOp) -> UOp:
    """Nibble s of lane e's byte minus 8. Bits 4s + 8e in place for the nibbles below bit 20; the other three
    (lane 2's high one, lane 3's) from word >> 12, at bits 8, 12 and 16."""
    shifted = [False, False, s == 1, True]
    pos = [4 * s + 8 * i - 12 * sh for i, sh in enumerate(shifted)]
    src = (e < 3 - s).where(word, word >> 12)
    bits = (src & _lane(e, [15 << p for p in pos], U32)) | m
    return _placed(bits, _lane(e, [2.0 ** -p for p in pos], F32), _lane(e, [-(2.0 ** (23 - p) + 8) for p in pos], F32))


def _q8_0_word(word: UOp, e: UOp, m: UOp, m80: UOp, m8000: UOp) -> UOp:
    """Lane e's signed byte: lanes 0-1 in place, 2-3 from word >> 16; the sign bit flipped (q + 128) by the XOR
    with MAGIC | 0x80 << pos (m80, m8000: read from memory too), in the same LOP3 as the mask."""
    src = (e < 2).where(word, word >> 16)
    lo = e.eq(0) | e.eq(2)
    bits = (src & lo.where(UOp.const(0xFF, U32), UOp.const(0xFF00, U32))) ^ lo.where(m80, m8000)
    return _placed(bits, lo.where(UOp.const(1.0, F32), UOp.const(2.0 ** -8, F32)),
                   lo.where(UOp.const(-(2.0 ** 23 + 128), F32), UOp.const(-(2.0 ** 15 + 128), F32)))

_MAGIC: dict[str, Tensor] = {}


def magic_word(device: str) -> Tensor:
    """The kernel's exponent words on `device`: MAGIC, MAGIC | 0x80, MAGIC | 0x8000 (uint32), and 0x43004300 (two
    bf16 128s: the tensor-core kernel's Q4_0 decode, engine/matvec_gpu_tc.py), inputs so that no compiler folds them
    into immediates (ptxas splits even a computed MAGIC | 0x80 back into its parts). Written straight into their
    buffer, not through a schedule: a jit capturing the first matvec captures no copy."""
    if device not in _MAGIC:
        buf = Buffer(device, 4, U32).allocate()
        words = np.array([MAGIC, MAGIC | 0x80, MAGIC | 0x8000, 0x43004300], np.uint32)
        Device[buf.device].allocator._copyin(buf._buf, memoryview(words.view(np.uint8)))
        _MAGIC[device] = Tensor(UOp.from_buffer(buf))
    return _MAGIC[device]


# columns a thread block takes together (MESH_GPU_MV_COLS overrides). 1: on the H200 (1.1B Q8_0, 16 columns) a column
# a block ran the step in 5.95 ms against 6.22 with tiles of 4 (128-180 registers a thread: 1-2 blocks an SM), and
# serve_bench's 16 streams 1307 against 1059 tok/s (bench/RESULTS.md, sixth session)
COLS = 1


def gpu_cols(n: int) -> int:
    """Columns a thread block of the matvec takes together, for n columns: each decoded quant is multiplied into
    all of them. At most COLS, and as even as the tiles allow (5 columns: 3 + 2, not 4 + 1, so the last tile repeats
    one column, not three). Not a numerical choice: a column's operations are the same in any tile (tested)."""
    most = max(1, min(n, int(os.environ.get("MESH_GPU_MV_COLS", COLS))))
    return -(-n // -(-n // most))


SMALL_ROWS = 8192  # matrices of at most this many rows (an 8B layer's q/k/v, o, down) may take their own layout


def gpu_layout(nb: int, width: int, rows: int = 0) -> tuple[int, int, int]:
    """(TW, P, BU): TW threads share each sub-block's `width` values, P blocks side by side, BU blocks a thread reads
    per loop step (BU * P divides nb), at most THREADS threads a block. MESH_GPU_MV="TW,THREADS[,BU]" overrides;
    MESH_GPU_MV_SMALL the same for matrices of at most SMALL_ROWS rows (few thread blocks: A/B runs)."""
    env = os.environ.get("MESH_GPU_MV", "")
    if 0 < rows <= SMALL_ROWS and "," in os.environ.get("MESH_GPU_MV_SMALL", ""):
        env = os.environ["MESH_GPU_MV_SMALL"]
    tw, most, bu = (int(v) for v in (env.split(",") + ["1"])[:3]) if "," in env else (TW, THREADS, 1)
    tw = max(d for d in range(1, width + 1) if width % d == 0 and d <= tw)
    bu = max(d for d in range(1, bu + 1) if nb % d == 0)
    return tw, max(d for d in range(1, nb // bu + 1) if (nb // bu) % d == 0 and d * tw <= most), bu


def reg_sum(slot: int, src: UOp, deps: tuple, n: int, index) -> UOp:
    """The sum over i < n of src[index(i)], from 0.0 in this order, in a register (placeholder `slot`, its range
    slot + 1) after `deps`: the partial-sum rounds of both matvec kernels, so their orders are one code."""
    acc = UOp.placeholder((1,), F32, slot, addrspace=AddrSpace.REG)
    i = UOp.range(n, slot + 1, AxisType.REDUCE)
    acc = acc.after(*deps)[0].set(0.0)
    return acc[0].set(acc.after(i)[0] + src[index(i)], end=i)[0]


def thread_sums(blocks, accs: list[UOp], sss: list[UOp] | None, *, bi, BU, P, p, spec, E, W, J, jt, TW, idx, word_q,
                fast, to_float, e, magic, nx, x, xv, norm_w, u, lanes) -> tuple[list[UOp], list[UOp] | None]:
    """A thread's sums over its blocks, for every column of its tile: the loop of this module's kernel and of
    engine/matvec_gpu_wide.py's, one code so that a column's operations, and so its bits, are the same in both.
    `blocks(b)` gives block b's loaders (word, byte, half); `accs` the columns' accumulators (indexed by lane u),
    `sss` their sums of squares for a fused norm (None without). Returns both after the loop over `bi`.
    Per sub-block: J products summed, then the scale (and offset: times the sum of the x read); sub-blocks of one
    (scale, offset) are summed first. BU blocks a step, written out here: all their loads go first. The quant q
    does not depend on the column: one decode serves every column (the same operations per column as alone)."""
    NI, m = len(nx), magic[0]  # MAGIC, read from memory: see the word decode
    terms, sqs = [None] * NI, [None] * NI
    for ub in range(BU):
        b = (bi * BU + ub) * P + p if P > 1 else bi * BU + ub
        word, byte, half = blocks(b)
        bint = lambda k, byte=byte: byte(k).cast(dtypes.int)
        groups: list[dict[tuple, list]] = [{} for _ in range(NI)]
        for si in range(spec.sub):
            base = b * E + si * W
            dots, xss = [None] * NI, [None] * NI
            for jv in range(J):
                jj = jt + jv * TW if TW > 1 else UOp.const(jv, idx)
                if word_q == "q4_0":
                    q = _q4_0_word(word(jj), e, si, m)
                elif word_q == "q8_0":
                    q = _q8_0_word(word(jj), e, m, magic[1], magic[2])
                else:
                    q = fast(byte, si, jj) if fast is not None else to_float(spec.q(bint, si, jj))
                for ci, n in enumerate(nx):
                    if norm_w is not None:
                        sq = x[n, base + jj] * x[n, base + jj]
                        sqs[ci] = sq if sqs[ci] is None else sqs[ci] + sq
                    xj = xv(n, base + jj)
                    dots[ci] = q * xj if dots[ci] is None else dots[ci] + q * xj
                    xss[ci] = xj if xss[ci] is None else xss[ci] + xj
            scale = spec.scale(bint, half, si)
            offset = None if fast is not None or spec.offset is None else spec.offset(bint, half, si)
            for ci in range(NI):
                if (scale, offset) in groups[ci]:
                    groups[ci][(scale, offset)][0] += dots[ci]
                    groups[ci][(scale, offset)][1] += xss[ci]
                else:
                    groups[ci][(scale, offset)] = [dots[ci], xss[ci]]
        for ci in range(NI):
            for (scale, offset), (dot, xs) in groups[ci].items():
                part = dot * scale if offset is None else dot * scale + xs * offset
                terms[ci] = part if terms[ci] is None else terms[ci] + part
    steps = [a[u].store(a.after(bi)[u] + terms[ci]) for ci, a in enumerate(accs)]
    if sss is not None:  # one loop end for both sums (two ends of one range are two loops)
        steps += [a[0].store(a.after(bi)[0] + sqs[ci]) for ci, a in enumerate(sss)]
    step = (UOp.group(*steps) if len(steps) > 1 else steps[0]).end(bi, *lanes)  # the squares have no lanes
    return [a.after(step) for a in accs], None if sss is None else [a.after(step) for a in sss]


def gpu_matvec_kernel(name: str, ggml_type: int, spec, fused):
    """The kernel for custom_kernel(out (N, rows) f32, rest, halfs, x (N, cols or 2 cols with glu) f32, magic_word(),
    [norm weight], [residual]); `spec` is engine.quant's BlockSpec of the type, `fused` its Fused."""
    # MESH_GPU_CVT=cast: quants converted by casts (I2FP on Hopper) instead of the exponent trick, for A/B runs
    cvt = os.environ.get("MESH_GPU_CVT", "")
    fast = None if cvt == "cast" else FAST.get(ggml_type)
    to_float = (lambda q: q.cast(F32)) if cvt == "cast" else _float_signed
    # MESH_GPU_CVT=byte: the byte-wise decode for Q4_0 and Q8_0 too (the same floats, more instructions: A/B runs)
    word_q = None if cvt in ("cast", "byte") else {Q.Q4_0: "q4_0", Q.Q8_0: "q8_0"}.get(ggml_type)

    def kernel(out: UOp, rest: UOp, halfs: UOp, x: UOp, magic: UOp, *extra: UOp) -> UOp:
        G, nb, _, il = halfs.shape
        from engine.matvec_gpu_wide import use_wide, wide_kernel  # batches: 8 rows a thread, up to 16 columns
        # K-quants (8 sub-blocks a block): the one-column kernel is ~254 registers already; in a tile of 4 ptxas
        # spilled 13.6 KB a thread, in the batch kernel 5.4 KB (nvcc 13.0, sm_90): a column a thread block for them
        heavy = spec.sub > 2
        if not heavy and use_wide(x.shape[0], il, il % 4 == 0 and rest.dtype == U32):
            return wide_kernel(name, ggml_type, spec, fused, out, rest, halfs, x, magic, *extra)
        W = spec.width
        N, E, C = x.shape[0], spec.sub * W, nb * spec.sub * W
        TW, P, BU = gpu_layout(nb, W, G * il)
        J = W // TW
        norm_w = extra[0] if fused.norm is not None else None
        res = extra[-1] if fused.residual else None
        g = UOp.range(G, 0, AxisType.GLOBAL)
        zero = UOp.const(0, g.dtype)
        # jt is threadIdx.x: the TW threads of a block read adjacent 16-byte pieces
        jt = UOp.range(TW, 1, AxisType.LOCAL) if TW > 1 else zero
        p = UOp.range(P, 2, AxisType.LOCAL) if P > 1 else zero
        # a thread's il lanes: il // 4 words of 4 bytes (w), byte e of each; one vector load when il >= 8
        words = il % 4 == 0 and rest.dtype == U32
        w = UOp.range(il // 4, 3, AxisType.UPCAST) if words and il >= 8 else zero
        e = UOp.range(min(il, 4), 7, AxisType.UPCAST) if il > 1 else zero
        u = w * 4 + e if words and il >= 8 else e
        NI = 1 if heavy else gpu_cols(N)  # columns a thread block takes together: a decoded quant used for all
        no = UOp.range(-(-N // NI), 4)
        cols = [no * NI + i if NI > 1 else no for i in range(NI)]
        # a last tile past N repeats column N - 1 (same operations, so it stores the same bits there)
        nx = [c if N % NI == 0 else (c < N).where(c, N - 1) for c in cols]
        threads = tuple(r for r in (jt, p) if r is not zero)
        outer = (no, g, *threads)
        lanes = [v for v in (w, e) if v is not zero]
        S = P * TW  # partial sums of each row
        t = p * TW + jt if TW > 1 else p

        def xv(n: UOp, idx: UOp) -> UOp:
            if fused.glu:
                gate = x[n, idx]
                return gate * (1.0 + (gate * -LOG2E).exp2()).reciprocal() * x[n, idx + C]
            return x[n, idx] * norm_w[idx] if norm_w is not None else x[n, idx]

        bi = UOp.range(nb // (P * BU), 5, AxisType.REDUCE)
        # per column ci: il accumulators (and the sum of the squares of its x, for a fused norm)
        accs = [UOp.placeholder((il,), F32, 0 if ci == 0 else 200 + ci, addrspace=AddrSpace.REG) for ci in range(NI)]
        accs = [a.after(*outer)[u].set(0.0) for a in accs]
        if norm_w is not None:
            sss = [UOp.placeholder((1,), F32, 1 if ci == 0 else 300 + ci, addrspace=AddrSpace.REG) for ci in range(NI)]
            sss = [a.after(*outer)[0].set(0.0) for a in sss]
        def blocks(b):  # block b's loaders: its quant words, bytes and f16 scale/offset values
            if words:
                byte = lambda k: (rest[g, b, k, w] >> (e * 8).cast(U32)) & 255
                return (lambda k: rest[g, b, k, w]), byte, (lambda i: halfs[g, b, i, u].cast(F32))
            return None, (lambda k: rest[g, b, k, u].cast(U32)), (lambda i: halfs[g, b, i, u].cast(F32))

        accs, sss = thread_sums(blocks, accs, sss if norm_w is not None else None, bi=bi, BU=BU, P=P, p=p, spec=spec,
                                E=E, W=W, J=J, jt=jt, TW=TW, idx=g.dtype, word_q=word_q if words else None,
                                fast=fast, to_float=to_float, e=e, magic=magic, nx=nx, x=x, xv=xv, norm_w=norm_w,
                                u=u, lanes=lanes)
        # the S partial sums of each row (and of the squares) through shared memory, added in two rounds, one column
        # after the other: smem is reused, each column's stores after the last column's round 1 (a barrier)
        smem = UOp.placeholder((S * il,), F32, 100, addrspace=AddrSpace.LOCAL)
        stores, prev = [], None
        for ci in range(NI):
            sm = smem if prev is None else smem.after(prev)
            parts = sm[t * il + u].store(accs[ci][u]).end(*lanes)
            if norm_w is not None:
                ssm = UOp.placeholder((S,), F32, 101 + 1000 * ci, addrspace=AddrSpace.LOCAL)
                parts = UOp.group(parts, ssm[t].store(sss[ci][0]))
            if S % il == 0 and S > il:
                # round 1: thread t sums the il partials (q + Q i) * il + t % il (q = t // il, Q = S / il) of row t % il;
                # round 2: the first il threads sum the Q of their row. Chains of il + Q adds instead of S
                Qn = S // il
                rA, qA = t % il, t // il
                sa = reg_sum(70 + 1000 * ci, smem.after(parts), (*outer, parts), il, lambda i: (qA + i * Qn) * il + rA)
                smem2 = UOp.placeholder((S,), F32, 102 + 1000 * ci, addrspace=AddrSpace.LOCAL)
                parts2 = smem2[t].store(sa)
                if norm_w is not None:
                    sb = reg_sum(72 + 1000 * ci, ssm.after(parts), (*outer, parts), il, lambda i: qA + i * Qn)
                    ssm2 = UOp.placeholder((S,), F32, 103 + 1000 * ci, addrspace=AddrSpace.LOCAL)
                    parts2 = UOp.group(parts2, ssm2[t].store(sb))
                prev = parts2
                ok = t < il
                r = ok.where(t, 0)
                y, K = reg_sum(60 + 1000 * ci, smem2.after(parts2), (*outer, parts2), Qn, lambda i: i * il + r), 1
                if norm_w is not None:
                    sq = reg_sum(62 + 1000 * ci, ssm2.after(parts2), (*outer, parts2), Qn, lambda i: i * il)
                    y = y * (sq * (1.0 / C) + fused.norm).sqrt().reciprocal()
                kk = zero
            else:  # few threads: thread t finishes rows t, t + S, ..., each the sum of its S partials
                K = -(-il // S)
                kk = UOp.range(K, 64 + 1000 * ci) if K > 1 else zero
                fin = (*outer, kk) if K > 1 else outer
                r = kk * S + t if K > 1 else t
                ok = r < il
                r = ok.where(r, 0)
                y = reg_sum(60 + 1000 * ci, smem.after(parts), (*fin, parts), S, lambda i: i * il + r)
                if norm_w is not None:
                    sq = reg_sum(62 + 1000 * ci, ssm.after(parts), (*fin, parts), S, lambda i: i)
                    y = y * (sq * (1.0 / C) + fused.norm).sqrt().reciprocal()
                # the next column's stores wait for these loads: its smem is its own (few threads: small)
                smem = UOp.placeholder((S * il,), F32, 100 + 1000 * (ci + 1), addrspace=AddrSpace.LOCAL)
            row = g * il + r
            if res is not None:
                y = y + res[nx[ci], row]
            # a repeat of column N - 1 stores the same bits again there (a gate on the column was lost in tinygrad's
            # index simplification: the store landed in column n - NI)
            st = out[nx[ci], row.valid(ok)].store(y)
            stores.append(st.end(kk) if K > 1 else st)
        store = UOp.group(*stores) if len(stores) > 1 else stores[0]
        return store.end(no, g, *threads).sink(arg=KernelInfo(
            name=f"mv_{name}_{G}x{il}_{nb}_t{TW}p{P}u{BU}" + (f"c{NI}" if NI > 1 else ""), opts_to_apply=()))
    return kernel
