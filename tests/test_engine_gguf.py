"""GGUF metadata, range loading and the errors bad files get."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

import engine.loader as loader
from engine.errors import EngineError, ModelFormatError, RangeError, UnsupportedModel
from engine.gguf_meta import read_gguf, read_model_meta
from engine.stage import Stage
from tests.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("g") / "llama.gguf", n_layers=4)


def test_meta_fields(tmp_path):
    m = read_model_meta(write_tiny_gguf(tmp_path / "q3.gguf", arch="qwen3", n_layers=3, dim=64, n_heads=4,
                                        n_kv_heads=1, head_dim=32, ffn_dim=96, vocab_size=320, tied_output=False))
    assert (m.arch, m.n_layers, m.dim, m.ffn_dim, m.n_heads, m.n_kv_heads, m.head_dim) == ("qwen3", 3, 64, 96, 4, 1, 32)
    assert (m.vocab_size, m.context_length, m.rope_dim, m.qk_norm, m.tied_output) == (320, 512, 32, True, False)
    assert m.range is None and m.rope_neox and not m.qkv_bias and len(m.fingerprint) == 64
    q2 = read_model_meta(write_tiny_gguf(tmp_path / "q2.gguf", arch="qwen2"))
    assert q2.qkv_bias and q2.tied_output and not q2.qk_norm
    assert not read_model_meta(write_tiny_gguf(tmp_path / "l.gguf")).rope_neox


def test_fingerprint_identifies_the_model_not_the_path(tmp_path):
    a = read_model_meta(write_tiny_gguf(tmp_path / "a.gguf", seed=1))
    b = read_model_meta(write_tiny_gguf(tmp_path / "b.gguf", seed=1))
    c = read_model_meta(write_tiny_gguf(tmp_path / "c.gguf", n_layers=5, seed=1))
    assert a.fingerprint == b.fingerprint != c.fingerprint


def test_range_only_file_reports_its_source(tmp_path):
    src = "ab" * 32
    p = write_tiny_gguf(tmp_path / "r.gguf", n_layers=4, extra_kv={
        "mesh.source.fingerprint": src, "mesh.source.block_count": 30, "mesh.range.start": 1, "mesh.range.end": 3})
    m = read_model_meta(p)
    assert (m.fingerprint, m.n_layers, m.range) == (src, 30, (1, 3))
    s = Stage.load(p, 1, 3, max_context=16)
    assert (s.first, s.last, s.start, s.end) == (False, False, 1, 3)
    with pytest.raises(RangeError, match=r"layers this file holds \[1, 3\)"):
        Stage.load(p, 0, 2, max_context=16)


def test_loader_reads_only_its_range(llama, monkeypatch):
    read = []
    real = loader.read_rows
    monkeypatch.setattr(loader, "read_rows", lambda g, info, *rows, **kw: read.append(info.name) or real(g, info, *rows, **kw))
    s = Stage.load(llama, 2, 3, max_context=16, weights="f32")
    assert read and all(n.startswith("blk.2.") for n in read)
    tensors = read_gguf(llama).tensors
    assert s.weight_bytes == sum(4 * int(np.prod(tensors[n].shape)) for n in read)  # held as f32
    read.clear()
    Stage.load(llama, 3, 4, max_context=16)  # last stage of a tied model: its blocks, the final norm, the embeddings
    assert sorted({n.split(".")[0] for n in read}) == ["blk", "output_norm", "token_embd"]


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantization_matches_gguf(tmp_path, qtype):
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=1, dim=256, ffn_dim=256, n_heads=4, vocab_size=256, qtype=qtype)
    g = read_gguf(p)
    ref = {t.name: t for t in GGUFReader(p).tensors}
    name = "blk.0.ffn_up.weight"
    got = loader.load_weight(g, g.tensors[name], "f32").value().numpy()
    want = dequantize(ref[name].data, ref[name].tensor_type).reshape(got.shape)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_unsupported_quant_type(tmp_path):
    p = write_tiny_gguf(tmp_path / "q2k.gguf", n_layers=1, dim=256, ffn_dim=256, qtype="Q2_K", embed_qtype="Q8_0")
    with pytest.raises(UnsupportedModel, match="Q2_K"):
        Stage.load(p, 0, 1, max_context=16)


def test_unsupported_architecture(tmp_path):
    p = write_tiny_gguf(tmp_path / "f.gguf", arch="falcon")
    with pytest.raises(UnsupportedModel, match=r"f\.gguf.*'falcon'"):
        read_model_meta(p)


def test_truncated_and_corrupt_files(llama, tmp_path):
    data = llama.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelFormatError, match=r"cut\.gguf: truncated"):
        Stage.load(cut, 0, 1)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:200])
    with pytest.raises(ModelFormatError, match=r"head\.gguf: truncated header"):
        read_model_meta(head)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ModelFormatError, match="bad magic"):
        read_model_meta(bad)
    huge = tmp_path / "huge.gguf"
    huge.write_bytes(data[:8] + (2**40).to_bytes(8, "little") + data[16:])
    with pytest.raises(ModelFormatError, match="implausible"):
        read_model_meta(huge)
    with pytest.raises(ModelFormatError, match="cannot open"):
        read_model_meta(tmp_path / "missing.gguf")
    assert issubclass(ModelFormatError, EngineError)


def test_range_validation(llama):
    for start, end in [(-1, 2), (2, 2), (3, 1), (0, 5)]:
        with pytest.raises(RangeError, match=rf"llama\.gguf: layer range \[{start}, {end}\)"):
            Stage.load(llama, start, end)
    with pytest.raises(RangeError, match="max_context"):
        Stage.load(llama, 0, 1, max_context=0)
    assert Stage.load(llama, 0, 1, max_context=100_000).max_context == 512  # clamped to the model's context


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_q8_weights(tmp_path, qtype):
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=1, qtype=qtype)
    g = read_gguf(p)
    info = g.tensors["blk.0.ffn_gate.weight"]
    dense = loader.load_weight(g, info, "f32").value().numpy()
    w = loader.load_weight(g, info, "q8")
    assert w.tensor.dtype.itemsize == 1 and w.nbytes == dense.size + dense.size // 32 * 4
    got = w.value().numpy()
    if qtype == "Q8_0":  # same scheme: nothing lost beyond float rounding of the scale
        np.testing.assert_allclose(got, dense, rtol=1e-6, atol=1e-7)
    else:
        bound = np.abs(dense.reshape(-1, 32)).max(-1, keepdims=True) / 254 + 1e-7
        assert (np.abs(got - dense).reshape(-1, 32) <= bound).all()
