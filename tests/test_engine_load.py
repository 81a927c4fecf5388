"""A stage's load (engine/loader.py) and the GGUF header cache (engine/gguf_meta.py): the resident bytes are the
file's bytes whatever path they took to the device, and a cached header is the parsed one."""
from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
from tinygrad import Device, UOp, dtypes

import engine.gguf_meta as gguf_meta
import engine.loader as loader
from engine.gguf_meta import read_gguf
from engine.quant import interleave_for, repack, resident_shapes, unpack
from engine.stage import Column, Stage
from tests.tiny_gguf import write_tiny_gguf

FUSED = {"attn_qkv.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
         "ffn_gate_up.weight": ("ffn_gate.weight", "ffn_up.weight"),
         "attn_qkv.bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias")}


def file_rows(g, name: str, heads: int = 0) -> np.ndarray:
    """A tensor's raw rows as the file has them (q/k un-permuted for llama's rope, as the loader does)."""
    rows = loader.read_rows(g, g.tensors[name])
    return loader.unpermute_rope_rows(rows, heads) if heads else rows


@pytest.mark.parametrize("arch,path", [("llama", "device memory"), ("qwen2", "device memory"), ("llama", "copies")])
def test_resident_blocks_are_the_files_bytes(tmp_path, monkeypatch, arch, path):
    # chunks of 16 rows: every weight goes to the device in several chunks through the reused host buffer
    monkeypatch.setattr(loader, "BLOCK_CHUNK_ROWS", 16)
    if path == "copies":  # as on an accelerator: regrouped on the host and copied in, the device waited for often
        monkeypatch.setattr(loader, "host_view", lambda t: None)
        monkeypatch.setattr(loader, "SYNC_EVERY", 4096)
    p = write_tiny_gguf(tmp_path / "m.gguf", arch=arch, n_layers=3, qtype="Q4_1", embed_qtype="Q8_0")
    g = read_gguf(p)
    s = Stage.load(p, 0, 3, n_slots=1, max_context=16)
    m = s.meta
    heads = {"attn_q.weight": m.n_heads, "attn_k.weight": m.n_kv_heads} if arch == "llama" else {}
    for i, block in enumerate(s._blocks):
        for short, w in block.w.items():
            if w.quant is None:  # norms (and qwen2's biases, joined on the device): f32
                want = np.concatenate([file_rows(g, f"blk.{i}.{n}").view(np.float32)[0]
                                       for n in FUSED.get(short, (short,))]).reshape(w.shape)
                np.testing.assert_array_equal(w.tensor.numpy(), want)
                continue
            parts = FUSED.get(short, (short,))
            want = np.concatenate([file_rows(g, f"blk.{i}.{n}", heads.get(n, 0)) for n in parts])
            got = unpack(w.quant.rest.numpy(), w.quant.halfs.numpy(), w.quant.ggml_type)
            np.testing.assert_array_equal(got, want)
    head = s._head.output.quant  # the tied head: 256 rows in 16 chunks
    np.testing.assert_array_equal(unpack(head.rest.numpy(), head.halfs.numpy(), head.ggml_type),
                                  file_rows(g, "token_embd.weight"))
    np.testing.assert_array_equal(s._head.norm.tensor.numpy(), file_rows(g, "output_norm.weight").view(np.float32)[0])


def test_repack_into_device_memory_equals_host_repack():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (48, 2 * 20), dtype=np.uint8)  # Q4_1: two 20-byte blocks a row
    from gguf import GGMLQuantizationType as Q
    il = interleave_for(48)
    want = repack(raw, Q.Q4_1, il)
    rest_shape, halfs_shape = resident_shapes(Q.Q4_1, 48, 64, il)
    assert (rest_shape, halfs_shape) == (want[0].shape, want[1].shape)
    rest, halfs = loader.device_empty(rest_shape, dtypes.uint8), loader.device_empty(halfs_shape, dtypes.float16)
    views = loader.host_view(rest), loader.host_view(halfs)
    if views[0] is None:
        pytest.skip(f"{Device.DEFAULT} memory is not host-addressable")
    repack(raw, Q.Q4_1, il, out=views)
    np.testing.assert_array_equal(rest.numpy(), want[0])
    np.testing.assert_array_equal(halfs.numpy().view(np.uint16), want[1].view(np.uint16))


def test_shaped_is_the_same_uop_as_reshape():
    for shape in [(36, 18, 16, 16), (576,), (1, 576), (7, 1, 3)]:
        buf = UOp.new_buffer(Device.DEFAULT, int(np.prod(shape)), dtypes.uint8)
        assert loader._shaped(buf, shape) is buf.reshape(shape)


def test_a_load_waits_for_its_device_every_so_many_copied_bytes(tmp_path, monkeypatch):
    """CUDA frees the pinned host memory staging each copy only when the device is synchronized."""
    g = read_gguf(write_tiny_gguf(tmp_path / "m.gguf", n_layers=1))
    t = loader.device_empty((8,), dtypes.uint8)
    waits = []
    monkeypatch.setattr(type(Device[Device.DEFAULT]), "synchronize", lambda d: waits.append(1))
    monkeypatch.setattr(loader, "SYNC_EVERY", 100)
    loader._copied(t, 500)  # outside a load: nothing counted
    with loader.reading(g):
        for n, want in ((60, 0), (39, 0), (1, 1), (99, 1), (250, 2)):
            loader._copied(t, n)
            assert len(waits) == want
    assert len(waits) == 2


def test_reads_outside_a_load_and_inside_agree(tmp_path):
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=1)
    g = read_gguf(p)
    info = g.tensors["blk.0.ffn_down.weight"]
    plain = loader.read_rows(g, info).copy()
    with loader.reading(g):
        assert np.array_equal(loader.read_rows(g, info), plain)
        assert np.array_equal(loader.read_rows(g, info, 3, 7), plain[3:7])
        into = loader.scratch((4, plain.shape[1]))
        assert loader.read_rows(g, info, 1, 5, into=into) is into and np.array_equal(into, plain[1:5])
    with pytest.raises(ValueError, match="bytes to read rows"):
        loader.read_rows(g, info, 0, 2, into=np.empty((1, plain.shape[1]), np.uint8))


# ---- the header cache

@pytest.fixture
def header_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_meta, "_STABLE_NS", 0)  # files written by the test count as settled
    monkeypatch.setattr(gguf_meta, "_MEMO", {})
    return tmp_path / "cache" / "headers"


def test_cached_header_equals_the_parse(tmp_path, header_cache, monkeypatch):
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=2)
    parsed = read_gguf(p)
    assert len(list(header_cache.iterdir())) == 1
    gguf_meta._MEMO.clear()  # from the disk this time
    monkeypatch.setattr(gguf_meta, "_parse", lambda *a, **k: pytest.fail("parsed again"))
    cached = read_gguf(p)
    assert cached.tensors == parsed.tensors and cached.header_sha256 == parsed.header_sha256
    assert (cached.data_start, cached.file_size, cached.path) == (parsed.data_start, parsed.file_size, p)
    assert cached.kv.keys() == parsed.kv.keys()
    cached.kv.clear()  # each caller gets its own dicts
    assert read_gguf(p).kv.keys() == parsed.kv.keys()


def test_a_changed_file_is_parsed_again(tmp_path, header_cache):
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=2, seed=1)
    first = read_gguf(p)
    write_tiny_gguf(p, n_layers=2, seed=2)  # same size, new bytes
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, first_mtime := st.st_mtime_ns))  # even with the mtime kept, the ctime moves
    assert first_mtime and read_gguf(p).header_sha256 != first.header_sha256
    p.write_bytes(p.read_bytes()[:100])  # truncated: the parse's error, not the cache's entry
    with pytest.raises(gguf_meta.ModelFormatError, match="truncated"):
        read_gguf(p)


def test_a_damaged_or_foreign_cache_file_is_ignored(tmp_path, header_cache):
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=2)
    want = read_gguf(p)
    (f,) = header_cache.iterdir()
    for body in (f.read_bytes()[:-1] + b"x", b"junk", b""):
        f.write_bytes(body)
        gguf_meta._MEMO.clear()
        assert read_gguf(p).tensors == want.tensors
    assert gguf_meta._cached(gguf_meta._stat_key(p)) is not None  # rewritten by the last parse


def test_fresh_files_and_the_switch_bypass_the_cache(tmp_path, monkeypatch, header_cache):
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=1)
    monkeypatch.setattr(gguf_meta, "_STABLE_NS", 10 ** 12)  # written just now: its times may not show a rewrite yet
    read_gguf(p)
    assert not header_cache.exists() and not gguf_meta._MEMO
    monkeypatch.setattr(gguf_meta, "_STABLE_NS", 0)
    monkeypatch.setenv("MESH_HEADER_CACHE", "0")
    read_gguf(p)
    assert not header_cache.exists()


def test_stage_from_a_cached_header_steps_the_same(tmp_path, header_cache):
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=2)
    cols = [Column(i, 0, i == 3, 5 + i) for i in range(4)]
    parsed = Stage.load(p, 0, 2, n_slots=1, max_context=16, jit=False).step_logits(cols)
    assert gguf_meta._MEMO
    cached = Stage.load(p, 0, 2, n_slots=1, max_context=16, jit=False).step_logits(cols)
    np.testing.assert_array_equal(parsed, cached)
