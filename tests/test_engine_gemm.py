"""The CPU prefill GEMM over resident GGUF blocks (engine/quant_gemm.py): every resident type against gguf's own
dequantizer times numpy for column counts on and off the tile; every column bitwise equal to the one-column matvec
(batch invariance: the two sum in one order), with the fused norm, glu and residual; and a stage's prefill bitwise
equal to the same prompt decoded one column at a time."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from tinygrad import Tensor

from engine import quant_gemm
from engine.quant import SPECS, QuantWeight, interleave_for, repack
from engine.stage import Column, Stage
from tests.test_engine_quant import TYPES, blocks_of
from tests.tiny_gguf import write_tiny_gguf


@pytest.fixture(autouse=True)
def _f32_activations(monkeypatch):
    """These tests are about the f32-activation kernels: keep every type off the 8-bit path (engine/quant_i8.py, the
    default on AVX-512 VNNI hosts; tests/test_engine_i8.py tests it)."""
    monkeypatch.setenv("MESH_CPU_INT8", "0")


def weight(qtype: str, rows: int, cols: int) -> tuple[QuantWeight, np.ndarray]:
    raw = blocks_of(qtype, rows, cols)
    rest, halfs = repack(raw, Q[qtype], interleave_for(rows))
    w = QuantWeight(Tensor(rest).realize(), Tensor(halfs).realize(), (rows, cols), Q[qtype])
    return w, dequantize(raw, Q[qtype]).reshape(rows, cols).astype(np.float64)


@pytest.mark.parametrize("qtype", TYPES)
def test_gemm_decodes_every_type_as_gguf_does(qtype):
    rows, cols = 64, 512  # 4 groups of 16 rows (2 a core), 2 K-quant blocks a row
    w, want_w = weight(qtype, rows, cols)
    rng = np.random.default_rng(2)
    for n in (2, 3, 16, 17):  # less than a tile, a ragged one, whole tiles, whole tiles and a ragged one
        assert quant_gemm.enabled(n, "CPU")
        x = rng.standard_normal((n, cols)).astype(np.float32)
        r = rng.standard_normal((n, rows)).astype(np.float32)
        want = x.astype(np.float64) @ want_w.T + r
        got = w.matmul_t(Tensor(x), residual=Tensor(r)).numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max(), err_msg=f"{n} columns")


def test_gemm_splits_many_columns(monkeypatch):
    monkeypatch.setattr(quant_gemm, "MAX_COLUMNS", 4)  # 10 columns: kernels of 4, 4 and 2
    w, want_w = weight("Q8_0", 32, 64)
    rng = np.random.default_rng(5)
    x, r = rng.standard_normal((10, 64)).astype(np.float32), rng.standard_normal((10, 32)).astype(np.float32)
    want = x.astype(np.float64) @ want_w.T + r
    np.testing.assert_allclose(w.matmul_t(Tensor(x), residual=Tensor(r)).numpy(), want, rtol=0,
                               atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("tile", [1, 3, 8])
def test_gemm_tiles_agree(tile):
    w, want_w = weight("Q4_1", 32, 256)
    x = np.random.default_rng(3).standard_normal((7, 256)).astype(np.float32)
    got = quant_gemm.gemm_t(w.rest, w.halfs, SPECS[Q.Q4_1], "q4_1", 32, 2, Tensor(x), tile=tile).numpy()
    want = x.astype(np.float64) @ want_w.T
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K"])
def test_tile_and_unroll_never_change_a_bit(qtype, monkeypatch):
    """The tile (columns a decoded block meets at once) and the unroll (values a loop step) are speed only: every
    column is summed alone, in value order, whatever they are."""
    w, _ = weight(qtype, 32, 512)
    x = np.random.default_rng(7).standard_normal((11, 512)).astype(np.float32)
    outs = []
    for tile, unroll in [(1, 1), (4, 1), (8, 4), (3, 2), (8, 8)]:
        monkeypatch.setattr(quant_gemm, "UNROLL", unroll)
        outs.append(quant_gemm.gemm_t(w.rest, w.halfs, SPECS[Q[qtype]], qtype.lower(), 32, 2, Tensor(x),
                                      tile=tile).numpy())
    assert all(np.array_equal(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("qtype", TYPES)
def test_every_column_equals_the_one_column_matvec_bitwise(qtype):
    """Batch invariance of the CPU kernels: a column's result is the same bits whatever its step's width (the
    matvec for one column, the GEMM for more, on and off the tile), with each fused option. 96 rows: 3 groups of 16
    a core, so the matvec works on 3 row groups at once (its GROUPS fallback)."""
    rows, cols = 96, 512
    w, _ = weight(qtype, rows, cols)
    rng = np.random.default_rng(4)
    for fused in ("norm", "glu", "residual"):
        x = rng.standard_normal((6, 2 * cols if fused == "glu" else cols)).astype(np.float32)
        r = rng.standard_normal((6, rows)).astype(np.float32)
        kw = dict(norm=(Tensor(rng.standard_normal(cols).astype(np.float32)), 1e-5)) if fused == "norm" else \
            dict(glu=True) if fused == "glu" else dict(residual=Tensor(r))
        alone = np.stack([w.matmul_t(Tensor(x[i:i + 1]), **{k: (Tensor(r[i:i + 1]) if k == "residual" else v)
                                                             for k, v in kw.items()}).numpy()[0] for i in range(6)])
        for n in (2, 5, 6):
            assert quant_gemm.enabled(n, "CPU")
            kn = {k: (Tensor(r[:n]) if k == "residual" else v) for k, v in kw.items()}
            assert w.matmul_t(Tensor(x[:n]), **kn).numpy().tobytes() == alone[:n].tobytes(), f"{fused}, {n} columns"


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K"])
def test_stage_prefill_matches_decoding_column_by_column(tmp_path, qtype):
    """A prompt in one step (chunks through the GEMM) against the same prompt one column a step (the matvec):
    the logits of every position and the KV the next step reads are the same bits."""
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=2, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2,
                        vocab_size=256, qtype=qtype, embed_qtype="Q8_0")
    prompt = [3, 17, 42, 7, 99, 5, 61, 200, 11, 8, 150, 33, 2, 90, 77, 14, 120, 9, 40, 250]  # 16 + 4 of 16
    a = Stage.load(p, 0, 2, n_slots=1, max_context=64)
    b = Stage.load(p, 0, 2, n_slots=1, max_context=64)
    got = a.step_logits([Column(i, 0, True, t) for i, t in enumerate(prompt)])
    want = np.concatenate([b.step_logits([Column(i, 0, True, t)]) for i, t in enumerate(prompt)])
    assert got.tobytes() == want.tobytes()
    nxt = [Column(len(prompt), 0, True, 64)]  # a decode step after either reads the KV the prefill wrote
    assert a.step_logits(nxt).tobytes() == b.step_logits(nxt).tobytes()
