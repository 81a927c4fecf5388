"""The resident-block matvec on tensor cores (CUDA mma.sync m16n8k16, bf16 in, f32 out): y = x @ W.T for Q4_0 and
Q8_0 blocks, every batch size from 1 column up, written in UOps with tinygrad's WMMA op (no CUDA C).

Why tensor cores (NOTES "The batch matvec", "Tensor cores"): on CUDA cores a decoded value costs a decode, a place
and a product instruction, and every column of a batch multiplies it again; the 8B Q4_0 step was issue-bound and a
16-column step cost ~4.6 one-column steps. Here a warp decodes a 16-row x 32-value block once into the MMA's A
fragment and the tensor cores multiply it into 8 columns at a time.

Numerics. The quants are small integers, exact in bf16 (Q4_0 v - 8 in -8..7, Q8_0 -128..127). x is split into three
bf16 pieces, x = hi + mid + lo, each the top 8 significant bits of what is left (bit masks and exact f32
subtractions): 24 bits, so the pieces hold x exactly, and bf16 keeps f32's exponent range (f16 pieces would need a
scale per column: small activations go subnormal). So every product in the MMAs is exact and only the order of the
sums differs from f32. A block's partial goes through the MMA chain lo, mid, hi (smallest first) from C = 0, then
acc += d * partial in f32: the block scale d stays out of A. A column's result depends only on its own x (an MMA's
output column reads only its B column), and the order of the sums is fixed by the matrix's shape, never by the
batch: a column has the same bits alone and in any batch.

Layout (`tc_repack`, a one-time repack at load, same bytes as the file): for each 16-row tile and block, the 32
lanes of a warp each load their A fragment's quants with one vector load: lane (g, c) = 4 g + c holds rows g and
g + 8 of the tile. Q4_0: word c (bytes 4c..4c+3) of each of the two rows, 8 bytes a lane; Q8_0: words 2c, 2c + 1 of
each, 16 bytes. The k order inside an MMA is free as long as A and B agree, so the decode takes the nibbles/bytes
as they lie in the words and B gathers x to match (`_k_slots`). Scales: (tiles, blocks, 8, 2) f16, the pair
(row g, row g + 8) one 4-byte load.

Decode to bf16 by the exponent trick: Q4_0 nibbles ((w >> sh) & 0x000F000F) | 0x43004300 read as two bf16 128 + n
(bf16 has 7 mantissa bits: a high nibble is shifted down first); one bf16 subtraction leaves n - 8 exactly. Q8_0 bytes go
through f32 (bf16 has 7 mantissa bits, a byte needs 8): (byte ^ 0x80) | 2^23 bits less 2^23 + 128, then the top
16 bits of the f32 are the bf16 (exact: an integer of 8 bits).

Work split: a thread block is S warps over the blocks of a row (warp s takes blocks s, s + S, ...) and R tiles of
16 rows; each warp keeps R x NT accumulator fragments (NT = ceil(N / 8) column tiles, at most 2: more columns are
groups of 16 on the grid). The S partials of each output meet in shared memory and are added in order s = 0..S-1.
S depends on the matrix only (rows, blocks). A warp takes U of its blocks a loop step (`tc_unroll`: their words
and scales loaded before any is used, then added block after block: the same sums in the same order), so it waits
for memory once a step; with one to three warps a scheduler, that wait was most of a step. For fewer than 8 columns
the thread block splits x into its pieces once, into shared memory, before the loop; otherwise each warp splits its
blocks' x in registers for its R tiles.

Who uses it: a stage decides at load (`tc_stage`): several KV slots on a GPU with CUDA's bf16 MMA -> this kernel for
every weight it takes, at every batch size; one slot -> engine/matvec_gpu.py's (faster at one column on the H200).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.dtype import AddrSpace
from tinygrad.uop.ops import AxisType, KernelInfo

F32, U32, U16, BF16 = dtypes.float32, dtypes.uint32, dtypes.uint16, dtypes.bfloat16
TYPES = (Q.Q4_0, Q.Q8_0)
# words a lane loads per block: Q4_0 one word of each of its two rows, Q8_0 two
LANE_WORDS = {Q.Q4_0: 2, Q.Q8_0: 4}
# the exponent words are engine/matvec_gpu.magic_word's (MAGIC, MAGIC | 0x80, MAGIC | 0x8000, 0x43004300: two bf16
# 128s), read from memory so ptxas keeps them in registers: (w & mask) | M is one LOP3 with one immediate (two
# immediates are two instructions, NOTES "Q4_0 and Q8_0 decoded in the word")


def tc_supported(ggml_type: int, rows: int, cols: int) -> bool:
    return ggml_type in TYPES and rows % 16 == 0 and cols % 32 == 0


def has_bf16_mma(device: str) -> bool:
    """Whether `device` renders CUDA's bf16 mma.sync m16n8k16 (a CUDA GPU of sm_80 or later, or the PYTHON device
    emulating one: DEV=PYTHON::sm_80)."""
    try:
        ren = Device[device].renderer
    except Exception:  # a device this machine cannot open has no tensor cores to offer
        return False
    return ren.target.device == "CUDA" and any(
        tc.dims == (8, 16, 16) and tc.dtype_in == BF16 and tc.dtype_out == F32 for tc in ren.tensor_cores)


def tc_stage(device: str, n_slots: int) -> bool:
    """Whether a stage loading on `device` with `n_slots` KV slots takes the tensor-core kernel, for every matmul it
    supports and every batch size (the lead's decision, seventh session): a column's bits must not depend on its
    batch, so one stage runs one kernel; a stage of several slots serves several sequences, where the tensor cores
    are 2-4x faster at 16 columns (the H200), and a one-slot stage keeps the CUDA-core kernel, faster at one column.
    MESH_GPU_MV=tc forces it on, MESH_GPU_MV_TC=0 off (A/B runs).
    Only from TC_SLOTS slots (MESH_GPU_TC_SLOTS, default 8): at one column the tensor-core stage was slower on the
    H200 (8B Q4_0 engine 226.7 against 367.7 tok/s, 1.1B step 1.57 against 1.05 ms; bench/RESULTS.md), and
    mesh-coord's default --max-seqs is 4, so a home deployment that mostly serves one person keeps the faster
    one-column kernel; a server configured for 8+ sequences takes the kernel that is 1.9x faster at 16 columns."""
    if os.environ.get("MESH_GPU_MV_TC") == "0":
        return False
    if os.environ.get("MESH_GPU_MV") == "tc":
        return device.split(":")[0] in ("CUDA", "PYTHON")
    return n_slots >= int(os.environ.get("MESH_GPU_TC_SLOTS", "8")) and has_bf16_mma(device)


_STAGE: ContextVar[bool | None] = ContextVar("tc_stage", default=None)


@contextmanager
def tc_loading(on: bool):
    """The weights loaded inside take the tensor-core layout where it supports them (`on`), or none do."""
    token = _STAGE.set(on)
    try:
        yield
    finally:
        _STAGE.reset(token)


def tc_wanted(device: str, ggml_type: int, rows: int, cols: int) -> bool:
    """Whether a weight loads in the tensor-core layout: inside `tc_loading` as the stage decided, outside it only when
    MESH_GPU_MV=tc forces it; and only a type and shape the kernel takes."""
    on = _STAGE.get()
    return (tc_stage(device, 1) if on is None else on) and tc_supported(ggml_type, rows, cols)


def tc_shapes(ggml_type: int, rows: int, cols: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes `tc_repack` gives a (rows, cols) weight: words (rows/16, blocks, 32, LANE_WORDS) uint32, scales
    (rows/16, blocks, 8, 2) float16."""
    return (rows // 16, cols // 32, 32, LANE_WORDS[ggml_type]), (rows // 16, cols // 32, 8, 2)


def tc_repack(raw: np.ndarray, ggml_type: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw GGUF rows (rows, row_bytes) -> (quants (rows/16, blocks, 32, LANE_WORDS) uint32, scales (rows/16, blocks,
    8, 2) float16): the same bytes as the file, in the order the warp's lanes load them (module docstring)."""
    rows, row_bytes = raw.shape
    bb = GGML_QUANT_SIZES[Q(ggml_type)][1]
    nb, T = row_bytes // bb, rows // 16
    blocks = raw.reshape(T, 2, 8, nb, bb)  # (tile, h, g, block, bytes): row 16 t + 8 h + g
    d = blocks[..., :2].copy().view(np.float16)[..., 0]  # (T, 2, 8, nb)
    scales = np.ascontiguousarray(d.transpose(0, 3, 2, 1))  # (T, nb, g, h)
    q = blocks[..., 2:]  # (T, 2, 8, nb, 16 or 32)
    per = LANE_WORDS[ggml_type] // 2  # words of a row a lane takes
    q = q.reshape(T, 2, 8, nb, 4, per * 4)  # (..., c, bytes of lane c)
    q = q.transpose(0, 3, 2, 4, 1, 5)  # (T, nb, g, c, h, bytes)
    words = np.ascontiguousarray(q).view(np.uint32).reshape(T, nb, 32, 2 * per)
    return words, scales


def tc_unpack(words: np.ndarray, scales: np.ndarray, ggml_type: int) -> np.ndarray:
    """The inverse of `tc_repack`: raw GGUF rows."""
    T, nb, _, lw = words.shape
    per = lw // 2
    q = words.view(np.uint8).reshape(T, nb, 8, 4, 2, per * 4).transpose(0, 4, 2, 1, 3, 5).reshape(T, 2, 8, nb, -1)
    d = scales.transpose(0, 3, 2, 1)[..., None].copy().view(np.uint8)  # (T, 2, 8, nb, 2)
    return np.concatenate([d, q], axis=-1).reshape(T * 16, -1)


GROUP = 16  # columns a thread block takes (two column tiles of 8); more are groups on the grid
SPLIT = 8  # warps over a row's blocks (a divisor of the blocks: 64..448 at the 1.1B and 8B shapes)
WARPS = 2048  # fewer tiles a warp (R) until the matrix has this many warps (~16 an SM on the H200's 132)
# ... where x's pieces come from shared memory; where each warp splits its x in registers (8+ columns) that split is
# shared by the warp's R tiles, and fewer warps with more tiles each are faster: 1.1B Q8_0 at 16 columns, a layer's
# four matvecs 65.0 -> 59.1 us at 512 (bench/RESULTS.md "Eleventh session")
WIDE_WARPS = 512


def tc_layout(tiles: int, nb: int, n: int, norm: bool = False) -> tuple[int, int, bool] | None:
    """(S, R, shared): S warps share a row's blocks (the order of the sums: from the matrix alone, MESH_GPU_TC_SPLIT
    overrides), R tiles of 16 rows a warp: as many as keep WARPS warps in the grid (MESH_GPU_TC_WARPS overrides) and
    fit shared memory with the n columns' partials (and a fused norm's sums of squares: `norm`; a warp's x pieces
    serve its R tiles; R changes no sum), and whether x is split once into shared memory (`shared_split`), which
    takes precedence over a larger R."""
    # rows too long for x's pieces in shared memory (the 8B ffn_down's 14336): twice the warps over a row's blocks,
    # so a warp can take 2 tiles and split its x in registers once for both (a choice from the matrix alone)
    long = not shared_split(1, nb * 32, SPLIT, 1)
    most = int(os.environ.get("MESH_GPU_TC_SPLIT", 2 * SPLIT if long else SPLIT))
    warps = int(os.environ.get("MESH_GPU_TC_WARPS", WARPS if n < 8 else WIDE_WARPS))
    S = warps_a_row(nb, most)
    extra = n * (32 * S + 16 + 1) * 4 if norm else 0  # the squares' partials, their 16 sums and 1 / rms a column
    fits = tiles_a_warp(tiles, S, n, warps, extra)
    shared = [d for d in fits if shared_split(n, nb * 32, S, d, extra)]
    if not fits:  # n columns' partials do not fit: the caller takes fewer columns a thread block
        return None
    return (S, max(shared), True) if shared else (S, max(fits), False)


SHARED_BYTES = 49152  # tinygrad's CUDA shared-memory limit a block


def warps_a_row(nb: int, most: int) -> int:
    """S, the warps sharing a row's nb blocks: the most up to `most` that divide nb (the order of the sums)."""
    return max(d for d in range(1, min(most, nb) + 1) if nb % d == 0)


def tiles_a_warp(tiles: int, S: int, n: int, warps: int, extra: int = 0) -> list[int]:
    """The R (tiles of 16 rows a warp) of 1, 2, 4, 8 that divide the tiles, fit the S warps' partials of n columns
    (and `extra` bytes) in shared memory, and keep at least `warps` warps in the grid (R = 1 always may)."""
    nt = -(-n // 8)
    return [d for d in (1, 2, 4, 8) if tiles % d == 0 and S * 16 * d * (8 * nt + 1) * 4 + extra <= SHARED_BYTES
            and (tiles // d * S >= warps or d == 1)]


def tc_unroll(steps: int) -> int:
    """Blocks a warp takes a loop step (MESH_GPU_TC_UNROLL, default UNROLL): the most of 1, 2, 4 up to it that divide
    the warp's `steps` blocks."""
    most = int(os.environ.get("MESH_GPU_TC_UNROLL", UNROLL))
    return max(u for u in (1, 2, 4) if u <= most and steps % u == 0)


# 2 (fifteenth session, bench/RESULTS.md "Fifteenth session"): a warp waits for its blocks' words once a loop step,
# not once a block. decode_ab on the H200, interleaved in one process: 1.1B Q8_0 one column 1.66 -> 1.31 ms, 16
# columns 2.59 -> 2.37; 8B Q4_0 one column 4.96 -> 3.85, 16 columns 8.11 -> 7.49. SPLIT 16 helped the 1.1B shape at 16
# columns and hurt the 8B; 8 columns a thread block did neither: both left as they were
UNROLL = 2


def shared_split(n: int, cols: int, S: int, R: int, extra: int = 0) -> bool:
    """Whether the x pieces of n columns fit shared memory beside the partials and `extra` bytes (3 bf16 a value):
    one column of up to ~7K values (every matrix of the 1.1B and 8B shapes but the 8B ffn_down)."""
    return n < 8 and 6 * n * cols + S * 16 * R * 9 * 4 + extra <= SHARED_BYTES


def _bf(word: UOp, high: bool) -> UOp:
    """The low or high bf16 of a uint32."""
    return ((word >> 16) if high else word).cast(U16).bitcast(BF16)


def _k_slots(ggml_type: int, c: UOp) -> list[list[UOp]]:
    """Positions in the block of the 4 B values (b0..b3) of lane column-quarter c, for each of the block's 2 MMAs:
    the values its A fragment holds (the decode's order)."""
    if ggml_type == Q.Q4_0:  # word c: low nibbles of bytes (0, 2), (1, 3), then the high nibbles (+16)
        return [[c * 4 + o + 16 * m for o in (0, 2, 1, 3)] for m in range(2)]
    return [[c * 8 + 4 * m + o for o in range(4)] for m in range(2)]  # Q8_0: bytes 8c..8c+7 in order


def _lane_order(ggml_type: int, k: UOp) -> UOp:
    """Where value k of a row goes in the shared-memory copy of x: block b's 32 values as [lane quarter c][mma m]
    [slot j], so that a lane's 4 B values of both MMAs are 8 contiguous bf16 (one 16-byte load). The inverse of
    `_k_slots`: Q8_0's order is the identity; Q4_0's slots (4c, 4c+2, 4c+1, 4c+3) + 16 m."""
    if ggml_type == Q.Q8_0:
        return k
    j = k % 32
    o = j % 4
    return k - j + ((j % 16) // 4) * 8 + (j // 16) * 4 + (o % 2) * 2 + o // 2


def _decode(ggml_type: int, words: list[UOp], magic: UOp) -> list[list[list[UOp]]]:
    """A values as bf16 [mma][row half h][j] (j: the 4 k slots of `_k_slots`) from the lane's words."""
    if ggml_type == Q.Q4_0:
        m43 = magic[3]
        out = [[[None] * 4 for _ in range(2)] for _ in range(2)]
        for h in range(2):
            w = words[h]
            for m in range(2):  # low nibbles, then high ones
                for part in range(2):  # bytes (0, 2) then (1, 3)
                    sh = 8 * part + 4 * m
                    v = ((w >> sh) if sh else w) & 0x000F000F | m43  # two bf16 128 + n
                    for e in range(2):
                        out[m][h][2 * part + e] = _bf(v, e == 1) - UOp.const(136.0, BF16)
        return out
    m80, m8000 = magic[1], magic[2]
    out = [[[None] * 4 for _ in range(2)] for _ in range(2)]
    for h in range(2):
        for wi in range(2):  # word wi of the row: bytes 4 wi .. 4 wi + 3 = MMA wi's 4 slots
            w = words[2 * h + wi]
            for e in range(4):
                src = w if e < 2 else w >> 16
                bits = (src & (0xFF if e % 2 == 0 else 0xFF00)) ^ (m80 if e % 2 == 0 else m8000)
                f = bits.bitcast(F32) * (1.0 if e % 2 == 0 else 2.0 ** -8) - (2.0 ** 23 + 128 if e % 2 == 0 else 2.0 ** 15 + 128)
                out[wi][h][e] = _bf(f.bitcast(U32), True)
    return out


def _pieces(v: UOp) -> list[UOp]:
    """x (f32) as three bf16 pieces lo, mid, hi with hi + mid + lo = x exactly: each the top 8 significant bits of
    what is left (a mask), the rest an exact f32 subtraction; the last rest has at most 8 bits."""
    hi = v.bitcast(U32) & 0xFFFF0000
    r = v - hi.bitcast(F32)
    mid = r.bitcast(U32) & 0xFFFF0000
    lo = (r - mid.bitcast(F32)).bitcast(U32)
    return [_bf(lo, True), _bf(mid, True), _bf(hi, True)]


def tc_matvec_kernel(name: str, ggml_type: int, norm: float | None = None, residual: bool = False):
    """The kernel for custom_kernel(out (N, rows) f32, words (T, nb, 32, LANE_WORDS) u32, scales (T, nb, 8, 2) f16,
    x (N, cols) f32, magic_word(), [norm weight (cols,) f32], [residual (N, rows) f32]). With `norm` (eps) x is
    RMS-normalized by the weight (x * w split into pieces, the output times 1 / sqrt(mean(x^2) + eps), as the CUDA-core
    kernel does); with `residual` it is added to the output. Every buffer passed must be read: tinygrad's graph
    passes a kernel all of its call's buffers, used or not, and the driver refuses a node whose arguments outnumber
    the kernel's parameters (`cuGraphAddKernelNode`: CUDA Error 1)."""
    def kernel(out: UOp, words: UOp, scales: UOp, x: UOp, magic: UOp, *extra: UOp) -> UOp:
        T, nb = words.shape[:2]
        N = x.shape[0]
        norm_w = extra[0] if norm is not None else None
        res = extra[-1] if residual else None

        def xin(n: UOp, k: UOp) -> UOp:
            return x[n, k] * norm_w[k] if norm_w is not None else x[n, k]
        # column groups of at most GROUP columns, a grid dimension (a prefill chunk: more columns than registers
        # for their pieces and accumulators); a column's operations do not depend on its group
        # (fewer than GROUP when their partials and a norm's sums do not fit shared memory: the 8B ffn_down's 16 warps)
        most = int(os.environ.get("MESH_GPU_TC_GROUP", GROUP))  # fewer columns a block, for A/B runs
        group = next(gc for gc in (GROUP, 8, 4, 2, 1) if gc <= most and tc_layout(T, nb, min(N, gc), norm_w is not None)
                     is not None)
        NG, NC = -(-N // group), min(N, group)
        S, R, shared = tc_layout(T, nb, NC, norm_w is not None)
        NT = -(-NC // 8)
        # threadIdx.x = 32 s + lane, lane (g, c) = 4 g + c. Thread indices, not ranges: tinygrad merges and splits
        # ranges indexed together (c and g in 4 g + c) and may hand them to the thread dimensions in another order,
        # and the MMA's fragments are defined by the lane number
        tid = UOp.special(32 * S, "lidx0")
        c, g, s = tid % 4, (tid // 4) % 8, tid // 32
        tg = UOp.special(T // R, "gidx0")  # R tiles a thread block
        gn = UOp.special(NG, "gidx1") if NG > 1 else None
        lanes = () if gn is None else (gn,)

        column = column_of(N, NC, group, NG, gn)
        U = tc_unroll(nb // S)
        bi = UOp.range(nb // S // U, 4, AxisType.REDUCE)
        # U blocks a loop step, in the warp's order (blocks s, s + S, ...): their loads are issued together, so a
        # warp waits for memory once a step, not once a block; the sums are the same, in the same order
        ks = [bi * U + u for u in range(U)] if U > 1 else [bi]
        bs = [k * S + s if S > 1 else k for k in ks]
        lane = tid % 32
        # the B values of this lane, column n = nt * 8 + g of each column tile (a column past N repeats N - 1:
        # the same operations on the same values, so the same bits where it lands)
        slots = _k_slots(ggml_type, c)
        C = nb * 32
        cols = [column(nt * 8 + g, NT * 8) for nt in range(NT)]
        if shared:
            # few columns: the thread block splits x once into shared memory (xs[piece, n, position]) before the loop,
            # each value by one thread, in the order the lanes read it (`_lane_order`: a lane's 8 values of a block
            # contiguous), instead of every column group of every warp splitting the same x in registers. The same
            # `_pieces`, so the same bf16 values as the register split: a column's bits do not depend on the path
            nthr, total = 32 * S, N * C  # shared: one group (N < 8)
            xs = UOp.placeholder((3 * total,), BF16, 101, addrspace=AddrSpace.LOCAL)
            # thread q takes x[n, q], x[n, q + 32 S], ... of each column n: with a fused norm it sums their squares
            # on the way, in the order (and with the expression) of the register path's own loop (`squares`)
            nr = UOp.range(N, 7) if N > 1 else UOp.const(0, tid.dtype)
            kq = UOp.range(C // nthr, 11, AxisType.REDUCE)
            k = kq * nthr + tid
            xr = x[nr, k]
            pcs = _pieces(xr * norm_w[k] if norm_w is not None else xr)
            body = [xs[p * total + nr * C + _lane_order(ggml_type, k)].store(pcs[p]) for p in range(3)]
            if norm_w is not None:
                sacc = UOp.placeholder((1,), F32, 61, addrspace=AddrSpace.REG)
                sacc = sacc.after(tg, *((nr,) if N > 1 else ()))[0].set(0.0)
                body.append(sacc[0].store(sacc.after(kq)[0] + xr * xr))
            split = UOp.group(*body).end(kq)
            if norm_w is not None:
                ssp = UOp.placeholder((NC * nthr,), F32, 102, addrspace=AddrSpace.LOCAL)
                split = ssp[nr * nthr + tid].store(sacc.after(split)[0])
                ssp = ssp.after(split.end(nr) if N > 1 else split)
            split = split.end(nr) if N > 1 else split
            xs = xs.after(split)
            bvecs = [[[[[xs[p * total + n * C + b * 32 + c * 8 + m * 4 + j] for p in range(3)] for j in range(4)]
                       for m in range(2)] for n in cols] for b in bs]
        else:  # [u][nt][m][j][piece]
            bvecs = [[[[_pieces(xin(n, b * 32 + k)) for k in slots[m]] for m in range(2)] for n in cols] for b in bs]
        accs = accumulators(R * NT, tg, lanes)
        stores = []
        for r in range(R):
            wds, ds = tile_loads(words, scales, tg * R + r, bs, lane, g)
            parts = [[None] * NT for _ in bs]
            for u, bvec in enumerate(bvecs):
                A = _decode(ggml_type, wds[u], magic)
                avec = [UOp.stack(A[m][0][0], A[m][0][1], A[m][1][0], A[m][1][1],
                                  A[m][0][2], A[m][0][3], A[m][1][2], A[m][1][3]) for m in range(2)]
                for nt in range(NT):
                    part = UOp.const((0.0,) * 4, F32)
                    for p in range(3):  # lo, mid, hi: the smallest first
                        for m in range(2):
                            bv = UOp.stack(*[bvec[nt][m][j][p] for j in range(4)])
                            part = UOp.wmma(avec[m], bv, part, (8, 16, 16), "CUDA", 32)
                    parts[u][nt] = part
            for nt in range(NT):
                acc = accs[r * NT + nt]
                for i in range(4):
                    v = acc.after(bi)[i]
                    for u in range(len(bs)):  # acc += d * partial, block after block
                        v = v + ds[u][i // 2] * parts[u][nt].index(UOp.const(i, dtypes.int))
                    stores.append(acc[i].store(v))
        step = UOp.group(*stores).end(bi)
        nthr = 32 * S
        scale = None
        if norm_w is not None and not shared:  # the squares of each column: thread q sums x[n, q], x[n, q + 32 S], ...
            nr = UOp.range(NC, 8)
            kq2 = UOp.range(C // nthr, 9, AxisType.REDUCE)
            sacc = UOp.placeholder((1,), F32, 61, addrspace=AddrSpace.REG)
            sacc = sacc.after(tg, *lanes, nr)[0].set(0.0)
            xk = x[column(nr, NC), kq2 * nthr + tid]
            sacc = sacc[0].set(sacc.after(kq2)[0] + xk * xk, end=kq2)[0]
            ssp = UOp.placeholder((NC * nthr,), F32, 102, addrspace=AddrSpace.LOCAL)
            ssp = ssp.after(ssp[nr * nthr + tid].store(sacc).end(nr))
        if norm_w is not None:
            scale = lambda lcol: _inv_rms(ssp, tid, tg, lanes, NC, nthr, C, norm)[lcol]  # noqa: E731
        st = partials_out(accs, step, tid, tg, lanes, S, R, NT, NC, column, out, res, scale)
        fu = ("_norm" if norm_w is not None else "") + ("_res" if res is not None else "") + (f"_g{NG}" if NG > 1 else "")
        return st.sink(arg=KernelInfo(name=f"mvtc_{name}{fu}_{T}x16_{nb}_s{S}r{R}n{NT}" + ("x" if shared else "")
                                      + (f"u{U}" if U > 1 else ""),
                                                      opts_to_apply=()))
    return kernel


def column_of(N: int, NC: int, group: int, NG: int, gn: UOp | None):
    """column(local, bound): the output column of local column `local` of this thread block's group; a column past
    N repeats N - 1 (the same operations on the same values, so the same bits where it lands)."""
    def column(local: UOp | int, bound: int) -> UOp:
        n = local if gn is None else gn * group + local
        return (n < N).where(n, N - 1) if NG * group > N or bound > NC else n
    return column


def tile_loads(words: UOp, scales: UOp, t: UOp, bs: list[UOp], lane: UOp, g: UOp) -> tuple[list, list]:
    """Row tile t's loads for the loop step's blocks `bs`, every block's before any is used: the lane's words of each
    block and its two rows' scales (rows g, g + 8) as f32."""
    wds = [[words[t, b, lane, k] for k in range(words.shape[3])] for b in bs]
    return wds, [[scales[t, b, g, h].cast(F32) for h in range(2)] for b in bs]


def accumulators(count: int, tg: UOp, lanes: tuple) -> list[UOp]:
    """`count` fragments of 4 f32 accumulators (R x NT), set to 0 inside the thread's ranges."""
    accs = []
    for i in range(count):
        a = UOp.placeholder((4,), F32, 10 + i, addrspace=AddrSpace.REG).after(tg, *lanes)
        accs.append(a.after(UOp.group(*[a[e].store(0.0) for e in range(4)])))
    return accs


def partials_out(accs: list[UOp], step: UOp, tid: UOp, tg: UOp, lanes: tuple, S: int, R: int, NT: int, NC: int,
                 column, out: UOp, res: UOp | None, scale=None) -> UOp:
    """The epilogue of both tensor-core kernels: the S warps' partials of each output (the accumulator fragments,
    after the loop `step`) meet in shared memory, smem[s, row in the R tiles, column of the NT tiles], and thread q
    of the block adds outputs q, q + 32 S, ... (row fastest) over s in order; times `scale(local column)` (a fused
    norm's 1 / rms), plus the residual; the store."""
    c, g, s = tid % 4, (tid // 4) % 8, tid // 32
    # rows padded to CC + 1 words: the sum below reads consecutive rows in consecutive threads, which a stride of
    # CC (16) words put in two banks (ncu: 16-way conflicts on every load, s14); the same values either way
    RR, CC = 16 * R, 8 * NT
    CP = CC + 1
    smem = UOp.placeholder((S * RR * CP,), F32, 100, addrspace=AddrSpace.LOCAL)
    parts = []
    for r in range(R):
        for nt in range(NT):
            acc = accs[r * NT + nt].after(step)
            for i in range(4):
                row, col = r * 16 + g + 8 * (i // 2), nt * 8 + c * 2 + i % 2
                parts.append(smem[(s * RR + row) * CP + col].store(acc[i]))
    parts = UOp.group(*parts)
    nthr, total = 32 * S, RR * NC
    K = -(-total // nthr)
    kk = UOp.range(K, 5) if K > 1 else UOp.const(0, tid.dtype)
    o = kk * nthr + tid
    o = (o < total).where(o, total - 1) if K * nthr > total else o
    row, lcol = o % RR, o // RR
    col = column(lcol, NC)
    acc = UOp.placeholder((1,), F32, 60, addrspace=AddrSpace.REG)
    si = UOp.range(S, 6, AxisType.REDUCE)
    acc = acc.after(tg, *lanes, *((kk,) if K > 1 else ()), parts)[0].set(0.0)
    y = acc[0].set(acc.after(si)[0] + smem.after(parts)[(si * RR + row) * CP + lcol], end=si)[0]
    if scale is not None:
        y = y * scale(lcol)
    if res is not None:
        y = y + res[col, tg * RR + row]
    st = out[col, tg * RR + row].store(y)
    return st.end(kk) if K > 1 else st


def _inv_rms(ssp: UOp, tid: UOp, tg: UOp, lanes: tuple, NC: int, nthr: int, C: int, eps: float) -> UOp:
    """1 / sqrt(mean(x^2) + eps) of each of NC columns, in shared memory, from the nthr partial sums of squares of
    each (ssp[n * nthr + q]): 16 threads a column each add nthr / 16 partials in order, then a thread a column adds
    the 16 (a thread of the output adding all nthr in a row was ~256 dependent shared-memory loads a block)."""
    per, NA = nthr // 16, NC * 16
    KA = -(-NA // nthr)
    ka = UOp.range(KA, 14) if KA > 1 else None
    a = tid if ka is None else ka * nthr + tid
    a = (a < NA).where(a, NA - 1) if KA * nthr > NA else a  # past the last: the last again, the same value
    ra = UOp.placeholder((1,), F32, 63, addrspace=AddrSpace.REG)
    ra = ra.after(tg, *lanes, *((ka,) if ka is not None else ()), ssp)[0].set(0.0)
    ia = UOp.range(per, 12, AxisType.REDUCE)
    ra = ra[0].set(ra.after(ia)[0] + ssp[(a // 16) * nthr + (a % 16) * per + ia], end=ia)[0]
    ssp2 = UOp.placeholder((NA,), F32, 103, addrspace=AddrSpace.LOCAL)
    st = ssp2[a].store(ra)
    ssp2 = ssp2.after(st.end(ka) if ka is not None else st)
    tb = (tid < NC).where(tid, NC - 1) if nthr > NC else tid
    rb = UOp.placeholder((1,), F32, 64, addrspace=AddrSpace.REG)
    rb = rb.after(tg, *lanes, ssp2)[0].set(0.0)
    ib = UOp.range(16, 13, AxisType.REDUCE)
    rb = rb[0].set(rb.after(ib)[0] + ssp2[tb * 16 + ib], end=ib)[0]
    invs = UOp.placeholder((NC,), F32, 104, addrspace=AddrSpace.LOCAL)
    return invs.after(invs[tb].store((rb * (1.0 / C) + eps).sqrt().reciprocal()))


def tc_matmul_t(words: Tensor, scales: Tensor, ggml_type: int, x: Tensor, *, norm: tuple[Tensor, float] | None = None,
                residual: Tensor | None = None) -> Tensor:
    """x (N, cols) @ W.T -> (N, rows) f32 with W in the tensor-core layout (`tc_repack`); `norm` (weight, eps) and
    `residual` fused as in engine/quant.py's QuantWeight.matmul_t."""
    from engine.matvec_gpu import magic_word
    T = words.shape[0]
    out = Tensor.empty(x.shape[0], T * 16, dtype=F32, device=words.device)
    kern = tc_matvec_kernel(Q(ggml_type).name.lower(), ggml_type, None if norm is None else float(norm[1]),
                            residual is not None)
    extra = ([norm[0].cast(F32).contiguous()] if norm is not None else []) + \
            ([residual.cast(F32).contiguous()] if residual is not None else [])
    return Tensor.custom_kernel(out, words, scales, x.cast(F32).contiguous(), magic_word(str(words.device)), *extra,
                                fxn=kern)[0]
