"""Range-only GGUF planning: selection, byte-exact tensors, valid header, resumable streaming, clear errors."""
from __future__ import annotations

import hashlib
import os
import struct

import gguf
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as Q

from engine.gguf_range import (
    LayerRangeError,
    SourceChangedError,
    SourceFormatError,
    plan_range_gguf,
    read_source_header,
)


def write_model(path, *, n_layers=4, dim=64, tied=True, alignment=None, rope_freqs=False, seed=0):
    """A tiny llama-shaped GGUF with random bytes in several quant types (the planner never decodes them)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    w.add_embedding_length(dim)
    w.add_context_length(128)
    w.add_head_count(4)
    w.add_feed_forward_length(2 * dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(32)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(32)])
    w.add_string("general.name", "tiny ünïcode")
    if alignment:
        w.add_custom_alignment(alignment)

    def quant(name, rows, cols, qtype):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=qtype)

    quant("token_embd.weight", 32, dim, Q.Q8_0)
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", rng.standard_normal(dim // 8).astype(np.float32))
    for i in range(n_layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", rng.standard_normal(dim).astype(np.float32))
        quant(f"blk.{i}.attn_q.weight", dim, dim, Q.Q4_1)
        quant(f"blk.{i}.ffn_down.weight", dim, 2 * dim, Q.Q4_0)
        w.add_tensor(f"blk.{i}.ffn_up.weight", rng.standard_normal((2 * dim, dim)).astype(np.float16))
    w.add_tensor("output_norm.weight", rng.standard_normal(dim).astype(np.float32))
    if not tied:
        quant("output.weight", 32, dim, Q.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tensor_bytes(reader):
    return {t.name: np.asarray(t.data).view(np.uint8).tobytes() for t in reader.tensors}


def field_value(reader, key):
    return reader.fields[key].contents()


@pytest.fixture
def src(tmp_path):
    return write_model(tmp_path / "src.gguf")


def materialize(plan, path):
    plan.write_to(path)
    return gguf.GGUFReader(str(path))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("start,end", [(0, 2), (1, 3), (2, 4), (0, 4), (3, 4)])
def test_planned_file_parses_and_holds_exact_bytes(tmp_path, tied, start, end):
    src = write_model(tmp_path / "src.gguf", tied=tied)
    plan = plan_range_gguf(src, start, end, fingerprint="f" * 64)
    out = materialize(plan, tmp_path / "range.gguf")
    assert os.path.getsize(tmp_path / "range.gguf") == plan.size

    source = gguf.GGUFReader(str(src))
    src_bytes, got = tensor_bytes(source), tensor_bytes(out)
    for name, data in got.items():
        assert data == src_bytes[name], name
    want = {f"blk.{i}.{s}" for i in range(start, end)
            for s in ("attn_norm.weight", "attn_q.weight", "ffn_down.weight", "ffn_up.weight")}
    if start == 0:
        want.add("token_embd.weight")
    if end == 4:
        want.add("output_norm.weight")
        want.add("token_embd.weight" if tied else "output.weight")
    assert set(got) == want
    assert set(plan.tensor_names) == want
    types = {t.name: t.tensor_type for t in out.tensors}
    assert types[f"blk.{start}.attn_q.weight"] == Q.Q4_1  # not re-quantized

    # Every source key survives unchanged, the depth stays the source's, and the provenance keys are added.
    for key, fld in source.fields.items():
        if not key.startswith("GGUF."):
            assert field_value(out, key) == fld.contents(), key
    assert field_value(out, "llama.block_count") == 4
    assert field_value(out, "mesh.source.fingerprint") == "f" * 64
    assert field_value(out, "mesh.source.block_count") == 4
    assert (field_value(out, "mesh.range.start"), field_value(out, "mesh.range.end")) == (start, end)
    assert out.fields["mesh.range.start"].types == [gguf.GGUFValueType.UINT32]


def test_shared_non_layer_tensors_go_to_every_stage(tmp_path):
    src = write_model(tmp_path / "src.gguf", rope_freqs=True)
    for start, end in [(0, 1), (1, 3), (3, 4)]:
        assert "rope_freqs.weight" in plan_range_gguf(src, start, end, fingerprint="x").tensor_names


def test_custom_alignment_is_kept(tmp_path):
    src = write_model(tmp_path / "src.gguf", alignment=64)
    plan = plan_range_gguf(src, 1, 3, fingerprint="x")
    out = materialize(plan, tmp_path / "range.gguf")
    assert out.alignment == 64
    assert out.data_offset % 64 == 0
    assert all((t.data_offset - out.data_offset) % 64 == 0 for t in out.tensors)
    assert tensor_bytes(out).items() <= tensor_bytes(gguf.GGUFReader(str(src))).items()


def test_chunks_from_any_offset_equal_the_file_suffix(src, tmp_path):
    plan = plan_range_gguf(src, 1, 3, fingerprint="x")
    whole = plan.write_to(tmp_path / "r.gguf").read_bytes()
    assert hashlib.sha256(whole).digest() == plan.sha256()
    for chunk in (1, 7, 100, 4096, 1 << 20):
        for offset in (0, 1, len(plan.header) - 1, len(plan.header), len(plan.header) + 13, plan.size - 1,
                       plan.size):
            pieces = list(plan.iter_chunks(offset, chunk))
            assert b"".join(pieces) == whole[offset:], (chunk, offset)
            assert all(len(p) == chunk for p in pieces[:-1])
    assert plan.read(10, 50) == whole[10:60]
    with pytest.raises(ValueError, match="outside"):
        next(plan.iter_chunks(plan.size + 1))


def test_planning_from_a_range_file_gives_the_same_file(src, tmp_path):
    wide = plan_range_gguf(src, 1, 4, fingerprint="abc")
    wide_path = wide.write_to(tmp_path / "1-4.gguf")
    direct = plan_range_gguf(src, 2, 4, fingerprint="abc")
    relayed = plan_range_gguf(wide_path, 2, 4)  # identity comes from the range file's own mesh.* keys
    assert relayed.fingerprint == "abc" and relayed.source_block_count == 4
    assert relayed.size == direct.size and relayed.sha256() == direct.sha256()
    with pytest.raises(LayerRangeError, match="1..4"):
        plan_range_gguf(wide_path, 0, 2)


def test_default_fingerprint_is_the_engines_and_stable(src, tmp_path):
    a = plan_range_gguf(src, 0, 2)
    b = plan_range_gguf(src, 2, 4)
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 64
    other = write_model(tmp_path / "other.gguf", seed=1, n_layers=5)
    assert plan_range_gguf(other, 0, 2).fingerprint != a.fingerprint


def test_engine_meta_reports_source_identity_for_range_file(src, tmp_path):
    gguf_meta = pytest.importorskip("engine.gguf_meta")
    whole = gguf_meta.read_model_meta(src)
    path = plan_range_gguf(src, 1, 3).write_to(tmp_path / "1-3.gguf")
    meta = gguf_meta.read_model_meta(path)
    assert meta.fingerprint == whole.fingerprint
    assert meta.n_layers == whole.n_layers == 4
    assert tuple(meta.range) == (1, 3)


@pytest.mark.parametrize("start,end", [(2, 2), (3, 1), (-1, 2), (0, 5), (4, 5)])
def test_range_outside_the_model_is_refused(src, start, end):
    with pytest.raises(LayerRangeError, match=rf"{start}\.\.{end}.*model depth 4"):
        plan_range_gguf(src, start, end)


def test_truncated_source_is_refused(src, tmp_path):
    data = src.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(SourceFormatError, match="truncated: tensor"):
        plan_range_gguf(cut, 0, 4)
    cut.write_bytes(data[:300])
    with pytest.raises(SourceFormatError, match="truncated header"):
        plan_range_gguf(cut, 0, 4)


def test_not_a_gguf_and_bad_version_are_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(SourceFormatError, match="not a GGUF"):
        read_source_header(bad)
    bad.write_bytes(b"GGUF" + struct.pack(">I", 3) + bytes(100))
    with pytest.raises(SourceFormatError, match="big-endian"):
        read_source_header(bad)
    with pytest.raises(SourceFormatError, match="cannot open"):
        read_source_header(tmp_path / "missing.gguf")


def test_corrupt_counts_and_types_are_refused(src, tmp_path):
    data = bytearray(src.read_bytes())
    huge = tmp_path / "huge.gguf"
    huge.write_bytes(data[:8] + struct.pack("<Q", 1 << 40) + data[16:])
    with pytest.raises(SourceFormatError, match="implausible counts"):
        read_source_header(huge)
    # Corrupt the ggml type of the last tensor in the table (the u32 before its u64 offset).
    header = read_source_header(src)
    type_at = header.header_end - 12
    data[type_at:type_at + 4] = struct.pack("<I", 999)
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(data)
    with pytest.raises(SourceFormatError, match="unknown ggml type 999"):
        read_source_header(odd)


def test_source_changed_after_planning_is_detected(src):
    plan = plan_range_gguf(src, 0, 2, fingerprint="x")
    with open(src, "ab") as f:
        f.write(b"more")
    with pytest.raises(SourceChangedError, match="changed on disk"):
        next(plan.iter_chunks())


def test_sha256_memo_skips_the_second_read_and_notices_a_changed_source(src, tmp_path):
    memo = tmp_path / "memo"
    digest = plan_range_gguf(src, 0, 2, fingerprint="x").sha256(memo)
    (entry,) = memo.iterdir()
    stamp, _ = entry.read_text().rsplit("\n", 2)[0], None
    entry.write_text(stamp + "\n" + "00" * 32 + "\n")
    hit = plan_range_gguf(src, 0, 2, fingerprint="x")
    hit._open_source = None  # a memo hit must not read the source at all
    assert hit.sha256(memo) == bytes(32)
    os.utime(src, ns=(1, 1))  # the source changed (its mtime says so): the memo no longer applies
    assert plan_range_gguf(src, 0, 2, fingerprint="x").sha256(memo) == digest
    assert plan_range_gguf(src, 0, 2, fingerprint="y").sha256(memo) != digest  # another header, other bytes
