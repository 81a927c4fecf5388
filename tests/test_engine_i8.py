"""CPU matmuls with 8-bit activations (engine/quant_i8.py): x's quantization bitwise against numpy's, each type's
result against a numpy model of the scheme, the VNNI code bitwise the portable code, and a column's bits the same in
a step of any width with every fused option (batch invariance)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from tinygrad import Tensor

from engine import quant_i8
from tests.test_engine_gemm import weight
from tests.test_engine_quant import blocks_of

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"]


@pytest.fixture(autouse=True)
def _int8(monkeypatch):
    monkeypatch.setenv("MESH_CPU_INT8", "1")  # on every host: the portable code where there is no VNNI


def quantized(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's Q8 scheme for x (N, C) f32 in numpy: per block of 32, d = amax / 127, q = rint(x * (1 / d));
    the quants' sums per 16."""
    b = x.reshape(x.shape[0], -1, 32)
    d = np.abs(b).max(axis=2) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
    q = np.rint(b * inv[..., None]).astype(np.int32)  # the sums: per half block of 16
    return q.reshape(x.shape).astype(np.int8), d.astype(np.float32), \
        q.reshape(x.shape[0], -1, 16).sum(axis=2).astype(np.int32)


def reference(raw: np.ndarray, qtype: str, x: np.ndarray) -> np.ndarray:
    """The kernel's sums in float64: per block, (integer dot of the quants) x d_w x d_x, plus Q4_1's m_w x d_x x
    sum(q_x). The weights' quants and scales come from gguf's dequantizer (value = q d + m)."""
    rows = raw.shape[0]
    w = dequantize(raw, Q[qtype]).reshape(rows, -1).astype(np.float64)
    q, d, _ = quantized(x)
    xhat = q.astype(np.float64).reshape(x.shape[0], -1, 32) * d[..., None]
    return xhat.reshape(x.shape) @ w.T  # sum over blocks of (q_w d_w + m_w) q_x d_x: the same products


def test_x_is_quantized_as_numpy_does():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 96)) * rng.uniform(0.01, 30, (5, 1))).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero block: d = 0, quants 0
    x[2, 5] = 127 * 0.5  # a tie after scaling goes to even
    q, d, s = (t.numpy() for t in quant_i8.quantize(Tensor(x)))
    wq, wd, ws = quantized(x)
    np.testing.assert_array_equal(q, wq)
    np.testing.assert_array_equal(d, wd)
    np.testing.assert_array_equal(s, ws)


@pytest.mark.parametrize("qtype", TYPES)
def test_each_type_matches_the_numpy_model_of_the_scheme(qtype):
    rows, cols = 64, 512  # 4 groups of 16 rows, 16 blocks a row
    raw = blocks_of(qtype, rows, cols)
    w, want_w = weight(qtype, rows, cols)
    rng = np.random.default_rng(2)
    for n in (1, 3, 8, 17):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        r = rng.standard_normal((n, rows)).astype(np.float32)
        got = w.matmul_t(Tensor(x), residual=Tensor(r)).numpy()
        want = reference(raw, qtype, x) + r
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max(), err_msg=f"{n} columns")
        exact = x.astype(np.float64) @ want_w.T + r  # against f32 activations: the int8 rounding of x
        assert np.abs(got - exact).max() < 2e-2 * np.abs(exact).max()


ISAS = ["generic"] + (["avx2"] if "avx2" in quant_i8.cpu_flags() else []) + (["vnni"] if quant_i8.vnni() else [])


@pytest.mark.skipif(len(ISAS) < 2, reason="only the portable code runs on this host")
@pytest.mark.parametrize("qtype", TYPES)
def test_every_dot_this_host_runs_gives_the_portable_codes_bits(qtype, monkeypatch):
    w, _ = weight(qtype, 96, 256)
    x = np.random.default_rng(4).standard_normal((9, 256)).astype(np.float32)
    x[3, :32] *= 50  # large quants next to small ones: vpmaddubsw's int16 pairs near their range
    outs = []
    for isa in ISAS:
        monkeypatch.setenv("MESH_CPU_INT8_ISA", isa)
        outs.append(w.matmul_t(Tensor(x)).numpy())
    assert all(np.array_equal(o, outs[0]) for o in outs[1:]), ISAS


@pytest.mark.parametrize("qtype", TYPES)
def test_a_column_has_the_same_bits_in_a_step_of_any_width(qtype):
    rows, cols = 96, 256
    w, _ = weight(qtype, rows, cols)
    rng = np.random.default_rng(5)
    for fused in ("norm", "glu", "residual"):
        width = 2 * cols if fused == "glu" else cols
        x = rng.standard_normal((11, width)).astype(np.float32)
        r = rng.standard_normal((11, rows)).astype(np.float32)
        nw = Tensor(rng.standard_normal(cols).astype(np.float32))

        def run(xs, rs):
            kw = {"norm": (nw, 1e-5)} if fused == "norm" else {"glu": True} if fused == "glu" else \
                {"residual": Tensor(rs)}
            return w.matmul_t(Tensor(xs), **kw).numpy()
        together = run(x, r)
        for i in (0, 5, 10):
            assert np.array_equal(run(x[i:i + 1], r[i:i + 1])[0], together[i]), (fused, i)


def test_glu_inside_the_quantize_kernel_is_the_glu_kernels(monkeypatch):
    """With glu, the quantize kernel computes silu(gate) * up itself: the same quants as engine/cpu_kernels.py's glu
    kernel (the Tensor expression's values, bitwise) followed by the plain quantize, exp2's guards included (a
    gate past 128 or below -150 after the scaling, zeros of both signs); a matmul with glu=True gives the same
    bits with the setting off."""
    from engine.cpu_kernels import glu
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((5, 2 * 96)) * rng.choice([0.05, 1.0, 30.0, 300.0], (5, 2 * 96))).astype(np.float32)
    x[0, :4] = [-120.0, 150.0, 0.0, -0.0]
    fused = [t.numpy() for t in quant_i8.quantize(Tensor(x), glu=True)]
    apart = [t.numpy() for t in quant_i8.quantize(glu(Tensor(x)))]
    assert all(np.array_equal(a, b) for a, b in zip(fused, apart))
    with pytest.raises(ValueError, match="glu and a norm"):
        quant_i8.quantize(Tensor(x), (Tensor(np.ones(96, np.float32)), 1e-5), glu=True)
    w, _ = weight("Q4_1", 32, 96)
    on = w.matmul_t(Tensor(x), glu=True).numpy()
    monkeypatch.setenv("MESH_CPU_GLU_QUANT", "0")
    assert np.array_equal(on, w.matmul_t(Tensor(x), glu=True).numpy())


def test_many_columns_are_split_into_kernels(monkeypatch):
    monkeypatch.setattr(quant_i8, "MAX_COLUMNS", 4)  # 10 columns: kernels of 4, 4 and 2
    w, _ = weight("Q8_0", 32, 64)
    x = np.random.default_rng(6).standard_normal((10, 64)).astype(np.float32)
    together = w.matmul_t(Tensor(x)).numpy()
    assert np.array_equal(together[7], w.matmul_t(Tensor(x[7:8])).numpy()[0])


def test_prefetch_hints_from_three_columns_and_a_bad_setting_is_named(monkeypatch):
    """The hints go into kernels of PREFETCH_COLUMNS or more columns (bits: the widths test above compares a kernel
    with hints against one without); MESH_CPU_PREFETCH sets the distance, 0 none, anything else is refused."""
    assert quant_i8._prefetch(256, 64, 1) == quant_i8._prefetch(256, 64, 2) == ""
    hints = quant_i8._prefetch(256, 64, 8)
    assert hints.count("__builtin_prefetch") == 5 and f"r + {quant_i8.PREFETCH}" in hints
    monkeypatch.setenv("MESH_CPU_PREFETCH", "0")
    assert quant_i8._prefetch(256, 64, 8) == ""
    monkeypatch.setenv("MESH_CPU_PREFETCH", "4 KB")
    with pytest.raises(ValueError, match="MESH_CPU_PREFETCH='4 KB': expected a number of bytes"):
        quant_i8._prefetch(256, 64, 8)


def test_which_weights_take_the_path(monkeypatch):
    assert quant_i8.wanted(Q.Q4_1, 16, "CPU")
    assert not quant_i8.wanted(Q.Q5_K, 16, "CPU")  # keeps the f32 path
    assert not quant_i8.wanted(Q.Q4_1, 8, "CPU")  # rows not in groups of 16
    assert not quant_i8.wanted(Q.Q4_1, 16, "CUDA")
    monkeypatch.setenv("MESH_CPU_INT8", "0")
    assert not quant_i8.wanted(Q.Q4_1, 16, "CPU")
    monkeypatch.delenv("MESH_CPU_INT8")
    assert quant_i8.wanted(Q.Q8_0, 16, "CPU") == (quant_i8.isa() is not None)  # the default: x86 with AVX2 or VNNI


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_stage_on_8_bit_activations_is_close_to_f32_and_any_split_is_bitwise_the_whole(qtype, tmp_path,
                                                                                          monkeypatch):
    from engine.stage import Column, Stage
    from tests.tiny_gguf import write_tiny_gguf
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=4, dim=64, ffn_dim=128, vocab_size=256, qtype=qtype)
    prompt = [Column(i, 0, True, (37 * i + 5) % 256) for i in range(20)]

    def logits(cuts: list[int]) -> np.ndarray:
        bounds = [0, *cuts, 4]
        stages = [Stage.load(p, a, b, n_slots=1, max_context=64) for a, b in zip(bounds, bounds[1:])]
        hidden = None
        for s in stages[:-1]:
            hidden = s.step(prompt, hidden)
        return stages[-1].step_logits(prompt, hidden)
    whole = logits([])
    assert np.array_equal(logits([1, 3]), whole)  # 3 stages: the same bits
    monkeypatch.setenv("MESH_CPU_INT8", "0")
    f32 = logits([])
    assert not np.array_equal(whole, f32)  # the 8-bit path ran
    err, top = np.abs(whole - f32), np.abs(f32).max()  # the rounding of x, carried through 4 layers of 64
    assert err.max() < 0.1 * top and err.mean() < 1.5e-2 * top, (err.max() / top, err.mean() / top)


def test_the_norm_inside_the_quantize_kernel_is_the_norm_kernels():
    """With a norm, the quantize kernel normalizes x itself: the same quants as engine/cpu_kernels.py's norm kernel
    (the Tensor expression's values, bitwise) followed by the plain quantize."""
    from engine.cpu_kernels import rms_norm_rows
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((6, 192)) * rng.uniform(0.01, 20, (6, 1))).astype(np.float32)
    w = Tensor(rng.standard_normal(192).astype(np.float32))
    fused = [t.numpy() for t in quant_i8.quantize(Tensor(x), (w, 1e-5))]
    apart = [t.numpy() for t in quant_i8.quantize(rms_norm_rows(Tensor(x), w, 1e-5))]
    assert all(np.array_equal(a, b) for a, b in zip(fused, apart))
