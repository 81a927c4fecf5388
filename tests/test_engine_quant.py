"""Resident GGUF blocks (engine/quant.py): every type's in-kernel decoding against gguf's own dequantizer, the
regrouping at load, and a stage's resident bytes against the file's."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from tinygrad import Tensor

from engine.gguf_meta import read_gguf
from engine.quant import SPECS, QuantWeight, interleave_for, repack, unpack
from engine.stage import Column, Stage
from tests.tiny_gguf import _encode, write_tiny_gguf

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(autouse=True)
def _f32_activations(monkeypatch):
    """These tests are about the f32-activation kernels: keep every type off the 8-bit path (engine/quant_i8.py, the
    default on AVX-512 VNNI hosts; tests/test_engine_i8.py tests it)."""
    monkeypatch.setenv("MESH_CPU_INT8", "0")


def blocks_of(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return _encode(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, Q[qtype], rng).view(np.uint8).reshape(rows, -1)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("cols", [256, 512])  # one K-quant block per row (its loop folds away), or two
def test_matvec_decodes_every_type_as_gguf_does(qtype, cols, monkeypatch):
    monkeypatch.setenv("MESH_PREFILL_GEMM", "0")  # 3 columns would take the prefill GEMM (tests/test_engine_gemm.py)
    rows = 48  # interleave 16, 3 groups
    raw = blocks_of(qtype, rows, cols)
    want_w = dequantize(raw, Q[qtype]).reshape(rows, cols)
    rest, halfs = repack(raw, Q[qtype], interleave_for(rows))
    assert rest.nbytes + halfs.nbytes == raw.nbytes  # regrouped, not widened
    np.testing.assert_array_equal(unpack(rest, halfs, Q[qtype]), raw)
    w = QuantWeight(Tensor(rest).realize(), Tensor(halfs).realize(), (rows, cols), Q[qtype])
    x = np.random.default_rng(1).standard_normal((3, cols)).astype(np.float32)
    want = x.astype(np.float64) @ want_w.T.astype(np.float64)
    got = w.matmul_t(Tensor(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    for r in (0, 17, 47):  # the embedding of a tied model reads rows back from the resident blocks
        np.testing.assert_array_equal(w.read_row(r), raw[r])
    ids = np.array([47, 3, 17, 3, 0, 46, 16])  # a prompt's rows at once: repeats, groups out of order
    np.testing.assert_array_equal(w.read_rows(ids), raw[ids])
    views = w.host_views()  # on the CPU, gathered where the blocks lie (no copy)
    assert views is not None and views[0].base is not None
    np.testing.assert_array_equal(w.read_rows(ids, views), raw[ids])


def test_interleave_divides_the_rows():
    assert [interleave_for(r) for r in (4096, 960, 192, 24, 7)] == [16, 16, 16, 8, 1]
    assert set(SPECS) == {Q[t] for t in TYPES}


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q6_K"])
def test_stage_holds_its_range_at_the_file_size(tmp_path, qtype):
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=2, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2,
                        vocab_size=256, qtype=qtype, embed_qtype="Q8_0")
    g = read_gguf(p)
    file_bytes = sum(t.nbytes for t in g.tensors.values())
    s = Stage.load(p, 0, 2, n_slots=1, max_context=32)  # holds everything: tied embeddings and head counted once
    assert s.weight_bytes == file_bytes
    f32 = Stage.load(p, 0, 2, n_slots=1, max_context=32, weights="f32")
    cols = [Column(i, 0, i == 4, 3 + i) for i in range(5)]
    want = f32.step_logits(cols)
    np.testing.assert_allclose(s.step_logits(cols), want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("embed_qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("end", [1, 2])
def test_an_embedding_row_has_the_dequantizers_bits(tmp_path, embed_qtype, end):
    """A first stage's token rows: gathered from the tied head's resident blocks where they lie on the CPU (the
    whole model, end 2), or from the raw rows it holds (layers 0..1 of 2: no head); a Q8_0 row as q * d directly.
    Either way the float32 values gguf's dequantizer gives for the row's GGUF bytes."""
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=2, dim=256, ffn_dim=512, vocab_size=256, qtype="Q4_1",
                        embed_qtype=embed_qtype)
    emb = Stage.load(p, 0, end, n_slots=1, max_context=32)._embed
    assert (emb.shared is not None and emb._views is not None) == (end == 2)
    ids = np.array([255, 3, 17, 3, 0, 16])
    raw = emb.shared.read_rows(ids) if emb.shared is not None else emb.rows[ids]
    want = dequantize(raw, Q[embed_qtype]).reshape(len(ids), -1).astype(np.float32)
    np.testing.assert_array_equal(emb.lookup(ids).view(np.uint32), want.view(np.uint32))
