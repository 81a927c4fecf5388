"""The CPU's C attention kernel (engine/attention_cpu.py) bitwise against the tinygrad kernels it replaces
(engine/paged_attention.py, MESH_CPU_ATTN=0), in steps of ragged runs over shuffled block tables."""
import numpy as np
import pytest
from tinygrad import Device, Tensor, TinyJit, UOp, dtypes

from engine import attention_cpu, quant_i8
from engine.paged_attention import Run, paged_attention, paged_attention_x8

B = 16


def _clang() -> bool:
    return type(Device["CPU"].renderer).__name__ == "ClangRenderer"


pytestmark = pytest.mark.skipif(not _clang(), reason="the C kernel needs clang's renderer")


def _attend(monkeypatch, c_kernel: bool, q, pk, pv, table, runs, H, KvH, Hd, scale, max_context, x8=False):
    """runs: (col, n, slot, pos) each. Returns (N, H * Hd) from a jitted step, as a stage runs it; with `x8`,
    paged_attention_x8's result: o and the quantized o's (q, d, s), or o and None."""
    monkeypatch.setenv("MESH_CPU_ATTN", "1" if c_kernel else "0")
    assert attention_cpu.wanted("CPU", B, Hd) == c_kernel
    k = len(runs)
    slots = [UOp.variable(f"slot{i}", 0, table.shape[0] - 1) for i in range(k)]
    poss = [UOp.variable(f"pos{i}", 0, max_context - 1) for i in range(k)]
    ctx = UOp.variable("ctx", 0, max_context)

    def step(q_, pk_, pv_, tb_, *binds):
        rr = [Run(col, n, binds[i], binds[k + i]) for i, (col, n, _, _) in enumerate(runs)]
        args = (q_, pk_, pv_, tb_, rr, binds[2 * k], max_context, B, H, KvH, Hd, scale)
        if not x8:
            return paged_attention(*args).realize()
        o, q8 = paged_attention_x8(*args)
        Tensor.realize(o, *(q8 or ()))
        return (o, *(q8 or ()))

    fn = TinyJit(step)
    fn.cnt = 1  # captured at its first call
    binds = [v.bind(r[2]) for v, r in zip(slots, runs)] + [v.bind(r[3]) for v, r in zip(poss, runs)] + \
        [ctx.bind(max(pos + n for _, n, _, pos in runs))]
    got = fn(Tensor(q).realize(), pk, pv, Tensor(table).realize(), *binds)
    if not x8:
        return got.numpy()
    return got[0].numpy(), [t.numpy() for t in got[1:]] or None


@pytest.mark.parametrize("H,KvH,Hd,kv", [(9, 3, 64, "f32"), (4, 1, 32, "f32"), (6, 2, 80, "f16"),
                                         (8, 8, 16, "f32")])
def test_c_kernel_gives_the_tinygrad_kernels_bits(monkeypatch, H, KvH, Hd, kv):
    rng = np.random.default_rng(H * 100 + Hd)
    slots, max_context = 4, 96
    per_slot = max_context // B
    n_blocks = slots * per_slot
    W = KvH * Hd
    dt = dtypes.float16 if kv == "f16" else dtypes.float32
    npdt = np.float16 if kv == "f16" else np.float32
    pk = Tensor(rng.standard_normal(((n_blocks + 1) * B, W)).astype(npdt), dtype=dt).realize()
    pv = Tensor(rng.standard_normal(((n_blocks + 1) * B, W)).astype(npdt), dtype=dt).realize()
    table = rng.permutation(n_blocks).reshape(slots, per_slot).astype(np.int32)  # blocks in no order
    table[3, 4:] = n_blocks  # slot 3 owns 4 blocks: the rest point at the trash block
    # runs: a prompt chunk of 5 in slot 2 from position 40, single decode columns at 0, 63 and 17 (slot 3 reads
    # only its own blocks), a chunk of 3 at the very end of the context
    runs = [(0, 5, 2, 40), (5, 1, 0, 0), (6, 1, 1, 63), (7, 1, 3, 17), (8, 3, 0, max_context - 3)]
    N = 11
    q = rng.standard_normal((N, H * Hd + 2 * W)).astype(np.float32) * 2  # q and more: the qkv row
    scale = 1.0 / Hd ** 0.5
    want = _attend(monkeypatch, False, q, pk, pv, table, runs, H, KvH, Hd, scale, max_context)
    got = _attend(monkeypatch, True, q, pk, pv, table, runs, H, KvH, Hd, scale, max_context)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_column_alone_is_bitwise_itself_in_a_step(monkeypatch):
    rng = np.random.default_rng(7)
    H, KvH, Hd, max_context, slots = 9, 3, 64, 64, 3
    n_blocks = slots * (max_context // B)
    pk = Tensor(rng.standard_normal(((n_blocks + 1) * B, KvH * Hd)).astype(np.float32)).realize()
    pv = Tensor(rng.standard_normal(((n_blocks + 1) * B, KvH * Hd)).astype(np.float32)).realize()
    table = np.arange(n_blocks, dtype=np.int32).reshape(slots, -1)
    q = rng.standard_normal((3, H * Hd)).astype(np.float32)
    together = _attend(monkeypatch, True, q, pk, pv, table, [(0, 1, 0, 5), (1, 1, 1, 50), (2, 1, 2, 33)],
                       H, KvH, Hd, 0.125, max_context)
    alone = _attend(monkeypatch, True, q[1:2], pk, pv, table, [(0, 1, 1, 50)], H, KvH, Hd, 0.125, max_context)
    np.testing.assert_array_equal(together[1], alone[0])


@pytest.mark.parametrize("Hd,fused", [(64, True), (80, False)])
def test_the_output_quantized_by_the_kernel_is_the_quantize_kernels(monkeypatch, Hd, fused):
    """attention_x8: the kernel also quantizes its output for the 8-bit output matmul, bitwise what
    engine/quant_i8.py's quantize kernel makes of that output; its o is the plain kernel's. With head_dim 80 a pass
    of the values loop holds 16 values, no whole block of 32: no quantized output (quantized apart)."""
    rng = np.random.default_rng(Hd)
    H, KvH, max_context, slots = 6, 2, 64, 3
    n_blocks = slots * (max_context // B)
    pk = Tensor(rng.standard_normal(((n_blocks + 1) * B, KvH * Hd)).astype(np.float32)).realize()
    pv = Tensor(rng.standard_normal(((n_blocks + 1) * B, KvH * Hd)).astype(np.float32)).realize()
    table = rng.permutation(n_blocks).reshape(slots, -1).astype(np.int32)
    q = rng.standard_normal((5, H * Hd)).astype(np.float32)
    runs = [(0, 3, 0, 7), (3, 1, 1, 50), (4, 1, 2, 0)]
    plain = _attend(monkeypatch, True, q, pk, pv, table, runs, H, KvH, Hd, 0.125, max_context)
    o, q8 = _attend(monkeypatch, True, q, pk, pv, table, runs, H, KvH, Hd, 0.125, max_context, x8=True)
    np.testing.assert_array_equal(o.view(np.uint32), plain.view(np.uint32))
    assert (q8 is not None) == fused
    if fused:
        want = [t.numpy() for t in quant_i8.quantize(Tensor(plain))]
        assert all(np.array_equal(a, b) for a, b in zip(q8, want))
