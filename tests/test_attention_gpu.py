"""The GPU form of paged attention (engine/paged_attention.py: positions split over thread blocks, then combined) on
tinygrad's PYTHON device, which runs a GPU kernel as a GPU would (thread blocks, shared memory, barriers), against
float64 numpy; and each column's result bitwise the same whatever else is in the step. MESH_GPU_TEST_DEV=CUDA (or
METAL) runs the same checks on a real GPU."""
import os

import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, UOp

from engine.paged_attention import CH, Run, gpu_split_ok, paged_attention

DEV = os.environ.get("MESH_GPU_TEST_DEV", "PYTHON")
B, MAXC = 16, 128


def attend(q, pk, pv, table, runs, H, KvH, Hd, maxc=MAXC):
    """runs: (slot, pos, n) each; q (N, H * Hd). Returns (N, H * Hd) from a jitted step, as a stage runs it."""
    N = q.shape[0]
    slots = [UOp.variable(f"slot{i}", 0, table.shape[0] - 1) for i in range(len(runs))]
    poss = [UOp.variable(f"pos{i}", 0, maxc - 1) for i in range(len(runs))]
    ctx = UOp.variable("ctx", 0, maxc)
    shape_runs, col = [], 0
    for _, _, n in runs:
        shape_runs.append((col, n))
        col += n

    def step(q_, pk_, pv_, tb_, *binds):
        k = len(runs)
        rr = [Run(c, n, binds[i], binds[k + i]) for i, (c, n) in enumerate(shape_runs)]
        return paged_attention(q_, pk_, pv_, tb_, rr, binds[2 * k], maxc, B, H, KvH, Hd, Hd ** -0.5).realize()

    fn = TinyJit(step)
    fn.cnt = 1
    binds = [v.bind(s) for v, (s, _, _) in zip(slots, runs)] + [v.bind(p) for v, (_, p, _) in zip(poss, runs)] + \
        [ctx.bind(max(p + n for _, p, n in runs))]
    ts = [Tensor(a, device=DEV).realize() for a in (q, pk, pv, table)]
    return fn(*ts, *binds).numpy()


def reference(q, pk, pv, table, runs, H, KvH, Hd):
    out, c = np.zeros((q.shape[0], H * Hd)), 0
    G = H // KvH
    for slot, pos0, n in runs:
        for j in range(n):
            pos = pos0 + j
            rows = np.array([table[slot, t // B] * B + t % B for t in range(pos + 1)])
            for h in range(H):
                kv = (h // G) * Hd
                k, v = pk[rows, kv:kv + Hd].astype(np.float64), pv[rows, kv:kv + Hd].astype(np.float64)
                s = k @ q[c, h * Hd:(h + 1) * Hd].astype(np.float64) * Hd ** -0.5
                p = np.exp(s - s.max())
                out[c, h * Hd:(h + 1) * Hd] = p @ v / p.sum()
            c += 1
    return out


def data(H, KvH, Hd, n_cols, slots=3, seed=0, maxc=MAXC):
    rng = np.random.default_rng(seed)
    nblocks = slots * maxc // B
    rows = (nblocks + 1) * B
    pk = rng.standard_normal((rows, KvH * Hd)).astype(np.float32)
    pv = rng.standard_normal((rows, KvH * Hd)).astype(np.float32)
    pk[-B:] = np.nan  # the trash block: read past a sequence's blocks, never allowed to leak
    pv[-B:] = np.nan
    table = rng.permutation(nblocks).astype(np.int32).reshape(slots, maxc // B)
    q = rng.standard_normal((n_cols, (H + 2 * KvH) * Hd)).astype(np.float32)  # the joined q|k|v rows of a step
    return q, pk, pv, table


@pytest.mark.parametrize("H,KvH,Hd", [(4, 2, 32), (2, 1, 64)])
def test_split_attention_matches_numpy(H, KvH, Hd):
    assert gpu_split_ok(Hd, B) and CH % B == 0  # the split form runs (MESH_GPU_ATTN=paged would not)
    q, pk, pv, table = data(H, KvH, Hd, 4)
    table[1, 5:] = len(pk) // B - 1  # slot 1 owns 5 blocks: the rest of its table points at the trash block
    runs = [(0, 70, 1), (1, 30, 2), (2, 0, 1)]  # decode columns, a run of two, a first position
    got = attend(q, pk, pv, table, runs, H, KvH, Hd)
    want = reference(q, pk, pv, table, runs, H, KvH, Hd)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_a_column_gets_the_same_bits_next_to_any_others():
    H, KvH, Hd = 4, 2, 32
    q, pk, pv, table = data(H, KvH, Hd, 3, seed=1)
    alone = attend(q[:1], pk, pv, table, [(0, 20, 1)], H, KvH, Hd)
    crowd = attend(q[[1, 0, 2]], pk, pv, table, [(1, 100, 1), (0, 20, 1), (2, 127, 1)], H, KvH, Hd)
    assert np.array_equal(alone[0], crowd[1])


def test_chunks_past_a_columns_position_load_nothing_and_change_no_bits(monkeypatch):
    """The part kernel skips the key and value loads of a chunk wholly past its column's position (a short column
    beside long ones); such a chunk gives m = -inf, l = 0, o = 0 either way. The same bits with the loads
    (MESH_GPU_ATTN_SKIP=0), and the trash block's NaNs never leak."""
    H, KvH, Hd = 4, 2, 32
    q, pk, pv, table = data(H, KvH, Hd, 4, seed=3)
    runs = [(1, 100, 1), (0, 5, 1), (2, 40, 2)]  # 4 chunks: column 1 has 3 past its position, columns 2-3 two
    got = {}
    for skip in ("1", "0"):
        monkeypatch.setenv("MESH_GPU_ATTN_SKIP", skip)
        got[skip] = attend(q, pk, pv, table, runs, H, KvH, Hd)
    assert np.array_equal(got["1"], got["0"])
    assert np.isfinite(got["1"]).all()
    np.testing.assert_allclose(got["1"], reference(q, pk, pv, table, runs, H, KvH, Hd), rtol=1e-4, atol=1e-5)


def test_the_same_bits_when_the_context_is_one_chunk():
    """max_context <= CH: the chunk index is the constant 0, so for a step of one run `t <= pos` is provably true at
    t = 0 and tinygrad folds that mask away; beside another run (pos is then a where over the runs) it cannot. A
    mask between a multiply and its add made the two compile to different roundings (a fused multiply-add against
    a rounded product: an ulp apart on the PYTHON device, and nvrtc contracts the same way), where the kernel's
    arithmetic must keep its shape whatever folds. The case above (max_context 128, four chunks) never folds."""
    H, KvH, Hd, maxc = 2, 1, 32, 32
    q, pk, pv, table = data(H, KvH, Hd, 3, seed=5, maxc=maxc)
    assert maxc <= CH
    alone = attend(q[:1], pk, pv, table, [(0, 3, 1)], H, KvH, Hd, maxc)
    # beside a shorter sequence, after a longer one (ctx 29), after a run of two
    for crowd_runs, rows in (([(0, 3, 1), (1, 2, 1)], [0, 1]), ([(1, 28, 1), (0, 3, 1)], [1, 0]),
                             ([(2, 0, 2), (0, 3, 1)], [1, 2, 0])):
        crowd = attend(q[rows], pk, pv, table, crowd_runs, H, KvH, Hd, maxc)
        assert np.array_equal(alone[0], crowd[rows.index(0)]), crowd_runs


def test_rope_and_kv_write_in_one_kernel():
    """engine/paged_attention.rope_write_kv: q and k roped at each column's position (half-split pairs, as
    engine.model.rope), q returned, k and v stored at the column's pool row; rows of other positions untouched."""
    from engine.model import rope_tables
    from engine.paged_attention import rope_write_kv
    H, KvH, Hd = 2, 1, 32
    q, pk, pv, table = data(H, KvH, Hd, 3, seed=2)
    pk[-B:] = pv[-B:] = 0.0
    cos, sin = rope_tables(np.arange(MAXC), Hd, 10000.0)
    runs = [(2, 40, 1), (0, 9, 2)]
    binds = {}

    def step(src, c_, s_, pk_, pv_, tb_, *bs):
        rr = [Run(0, 1, bs[0], bs[2]), Run(1, 2, bs[1], bs[3])]
        out = rope_write_kv(src, c_, s_, pk_, pv_, tb_, rr, B, H, KvH, Hd)
        return out, pk_, pv_

    fn = TinyJit(step)
    fn.cnt = 1
    vs = [UOp.variable(n, 0, hi) for n, hi in (("slot0", 2), ("slot1", 2), ("pos0", MAXC - 1), ("pos1", MAXC - 1))]
    bound = [v.bind(x) for v, x in zip(vs, (2, 0, 40, 9))]
    ts = [Tensor(a, device=DEV).realize() for a in (q, cos, sin, pk, pv, table)]
    qo, pk_t, pv_t = fn(*ts, *bound)
    qo, got_k, got_v = qo.numpy(), ts[3].numpy(), ts[4].numpy()

    def roped(x, pos):  # (heads * Hd,) at one position
        x = x.reshape(-1, Hd).astype(np.float64)
        c, s = cos[pos].astype(np.float64), sin[pos].astype(np.float64)
        x1, x2 = x[:, :Hd // 2], x[:, Hd // 2:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=1).reshape(-1)

    want_k, want_v = pk.copy(), pv.copy()
    for col, (slot, pos) in enumerate(((2, 40), (0, 9), (0, 10))):
        np.testing.assert_allclose(qo[col], roped(q[col, :H * Hd], pos), rtol=0, atol=1e-5)
        row = table[slot, pos // B] * B + pos % B
        want_k[row] = roped(q[col, H * Hd:(H + KvH) * Hd], pos)
        want_v[row] = q[col, (H + KvH) * Hd:]
    np.testing.assert_allclose(got_k, want_k, rtol=0, atol=1e-5)
    assert np.array_equal(got_v, want_v)


def test_kv_write_for_layers_that_rope_apart():
    """engine/paged_attention.write_kv's GPU form (layers with q/k norms, Gemma 3): each column's k and v values
    of a joined row stored at its pool row, nothing else touched."""
    from engine.paged_attention import write_kv
    H, KvH, Hd = 2, 1, 32
    q, pk, pv, table = data(H, KvH, Hd, 3, seed=3)
    pk[-B:] = pv[-B:] = 0.0
    W = KvH * Hd

    def step(src, pk_, pv_, tb_, *bs):
        rr = [Run(0, 1, bs[0], bs[2]), Run(1, 2, bs[1], bs[3])]
        Tensor.realize(*write_kv(pk_, pv_, src, tb_, rr, B, H * Hd, H * Hd + W))
        return pk_, pv_

    fn = TinyJit(step)
    fn.cnt = 1
    vs = [UOp.variable(n, 0, hi) for n, hi in (("slot0", 2), ("slot1", 2), ("pos0", MAXC - 1), ("pos1", MAXC - 1))]
    ts = [Tensor(a, device=DEV).realize() for a in (q, pk, pv, table)]
    fn(*ts, *[v.bind(x) for v, x in zip(vs, (1, 2, 77, 15))])
    want_k, want_v = pk.copy(), pv.copy()
    for col, (slot, pos) in enumerate(((1, 77), (2, 15), (2, 16))):
        row = table[slot, pos // B] * B + pos % B
        want_k[row], want_v[row] = q[col, H * Hd:H * Hd + W], q[col, H * Hd + W:]
    assert np.array_equal(ts[1].numpy(), want_k) and np.array_equal(ts[2].numpy(), want_v)


@pytest.mark.slow
def test_a_whole_stage_decode_step_gets_the_same_bits_beside_another_sequence(tmp_path):
    """The one-chunk case (test_the_same_bits_when_the_context_is_one_chunk) through a whole tiny stage (rope + KV
    write, attention, the matvecs, the head) on the PYTHON device, max_context 32: a sequence's decode step alone
    and beside another sequence's step give the same logits bits (helper tc's repro before the fix: 43 of 64 logits
    ~1 ulp apart). Two slots hold the same first token, so one load serves both sides. ~17 s on the 2-core box, so
    slow: the kernel test is the fast loop's guard."""
    from tinygrad.helpers import Context

    from engine.stage import Column, Stage
    from tests.tiny_gguf import write_tiny_gguf
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=1, dim=64, n_heads=2, n_kv_heads=1, ffn_dim=128,
                        vocab_size=64, qtype="Q4_0")
    with Context(DEV=DEV):
        s = Stage.load(p, 0, 1, n_slots=3, max_context=32, jit=False)
        s.step_logits([Column(0, 0, False, 3), Column(0, 2, False, 3), Column(0, 1, False, 9)])
        alone = s.step_logits([Column(1, 0, True, 11)])
        beside = s.step_logits([Column(1, 1, True, 7), Column(1, 2, True, 11)])
    assert alone.shape == (1, 64) and beside.shape == (2, 64)
    assert np.array_equal(alone[0], beside[1])
