"""GGUF header parsing: metadata KV, tensor table, and the model description derived from them.

This is the engine's one GGUF header reader: `read_gguf` (weights, model description, fingerprint),
`read_metadata` (the tokenizer's keys) and `engine.gguf_range` (which copies metadata pairs byte for byte) all
parse through `_parse`. It reads only the header (never tensor data, apart from the fingerprint's samples).

We parse the header ourselves rather than through `gguf.GGUFReader`: that reader materialises every tokenizer
string as a numpy array and takes 2.4-3.3 s on SmolLM2's header here; this parser walks a memory map, skips
string arrays by their lengths (or decodes only the ones a caller names) and takes a few tens of milliseconds.
The `gguf` package still supplies the tables (value types, quant block sizes, magic, default alignment).
"""
from __future__ import annotations

import hashlib
import mmap
import os
import pickle
import struct
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from .errors import ModelFormatError, UnsupportedModel

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

# Bounds that keep a corrupt header from making us allocate or loop without end.
_MAX_STRING = 64 << 20
_MAX_ARRAY = 1 << 26
_MAX_KV = 1 << 16
_MAX_TENSORS = 1 << 20
_MAX_DIMS = 4

_MAGIC = struct.pack("<I", GGUF_MAGIC)  # b"GGUF"
_U32, _U64, _TYPE_OFFSET = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<IQ")
_SCALARS: dict[int, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"), GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"), GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"), GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"), GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"), GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_STRING, _ARRAY = int(GGUFValueType.STRING), int(GGUFValueType.ARRAY)


@dataclass(frozen=True, slots=True)
class StringArray:
    """A string array from the header that the caller did not ask to decode, kept as its length only."""
    count: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): the reverse of GGUF's ne[]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"ggml type {self.ggml_type}"


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: Path
    kv: dict[str, Any]
    tensors: dict[str, TensorInfo]  # in the order of the file's tensor table
    data_start: int
    file_size: int
    header_sha256: str
    version: int = 3
    alignment: int = GGUF_DEFAULT_ALIGNMENT
    header_end: int = 0  # end of the tensor table, before the alignment padding
    kv_raw: tuple[tuple[str, bytes], ...] = ()  # (key, the pair exactly as encoded); only when asked for


@dataclass(frozen=True, slots=True)
class ModelMeta:
    arch: str
    n_layers: int  # depth of the source model (also for a range-only file)
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_dim: int
    norm_eps: float
    vocab_size: int
    context_length: int
    qk_norm: bool
    tied_output: bool
    fingerprint: str
    path: Path
    range: tuple[int, int] | None = None  # layers this file holds when it is a range-only GGUF
    qkv_bias: bool = False
    rope_neox: bool = True  # False: llama.cpp's NORM rope (adjacent pairs), undone at load by permuting q/k rows
    # Gemma-style layers (see engine/gemma3.py); the defaults describe the llama family
    rope_scale: float = 1.0  # linear rope scaling: positions are multiplied by this (1 / rope.scaling.factor)
    sliding_window: int = 0  # local layers attend to this many positions, the query's own included (0: none)
    swa_pattern: int = 0  # of every swa_pattern layers the last is global, the others local (llama.cpp's rule)
    rope_theta_local: float = 0.0  # rope base of the local layers
    post_norms: bool = False  # RMS norms after attention and after the FFN, before their residual adds
    embed_scale: float = 1.0  # the first stage multiplies the token embeddings by this
    attn_scale: float = 0.0  # the query's scale before q.k (0: 1 / sqrt(head_dim))
    ffn_act: str = "silu"  # the gate's activation: "silu" or "gelu" (tanh approximation)

    def is_sliding(self, layer: int) -> bool:
        """Whether absolute layer `layer` is a local (sliding-window) layer. A function of the index alone, so
        every split of the model gives each layer the same kind."""
        return self.sliding_window > 0 and self.swa_pattern > 0 and layer % self.swa_pattern < self.swa_pattern - 1


class _Cursor:
    """Bounds-checked reads from the mapped file; running past its end means the header is truncated."""

    __slots__ = ("buf", "pos", "end", "path")

    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf, self.pos, self.end, self.path = buf, 0, len(buf), path

    def fail(self, why: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path}: {why}")

    def take(self, n: int) -> int:
        """Advance over `n` bytes; returns where they start."""
        start = self.pos
        if start + n > self.end:
            raise self.fail(f"truncated header (wanted {n} bytes at offset {start}, the file has {self.end})")
        self.pos = start + n
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buf, self.take(8))[0]

    def string(self, what: str) -> str:
        n = self.u64()
        if n > _MAX_STRING:
            raise self.fail(f"{what}: string length {n} exceeds {_MAX_STRING}")
        at = self.take(n)
        try:
            return self.buf[at : at + n].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what}: string at byte {at} is not UTF-8") from None

    def value(self, vtype: int, key: str, expand: bool) -> Any:
        """One metadata value. Arrays: numpy (numbers) and StringArray (strings); Python lists when `expand`."""
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            return scalar.unpack_from(self.buf, self.take(scalar.size))[0]
        if vtype == _STRING:
            return self.string(f"key {key!r}")
        if vtype != _ARRAY:
            raise self.fail(f"key {key!r}: unknown value type {vtype}")
        etype, count = self.u32(), self.u64()
        if count > _MAX_ARRAY:
            raise self.fail(f"key {key!r}: array of {count} items exceeds {_MAX_ARRAY}")
        scalar = _SCALARS.get(etype)
        if scalar is not None:
            at = self.take(scalar.size * count)
            items = np.frombuffer(self.buf, np.dtype(scalar.format), count, at)
            return items.tolist() if expand else items.copy()
        if etype != _STRING:
            raise self.fail(f"key {key!r}: unsupported array element type {etype}")
        if 8 * count > self.end - self.pos:  # each string is at least its length word: refuse absurd counts early
            raise self.fail(f"truncated header (key {key!r}: {count} strings cannot fit in the file)")
        return self._strings(key, count) if expand else self._skip_strings(key, count)

    # The two loops below are the hot path (a vocabulary is ~10^5 strings): locals only, no method calls.
    def _strings(self, key: str, count: int) -> list[str]:
        buf, pos, end, length = self.buf, self.pos, self.end, _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                n = length(buf, pos)[0] if pos + 8 <= end else end
                pos += 8
                if pos + n > end:
                    break
                append(buf[pos : pos + n].decode("utf-8"))
                pos += n
        except UnicodeDecodeError:
            raise self.fail(f"key {key!r}: item {len(out)} is not UTF-8") from None
        if len(out) < count:
            raise self.fail(f"truncated header (key {key!r}: item {len(out)} of {count} runs past the file's end)")
        self.pos = pos
        return out

    def _skip_strings(self, key: str, count: int) -> StringArray:
        # Each length word is read through one of 8 uint64 views of the buffer, the one starting at the word's
        # offset mod 8: an index into a memoryview instead of a struct call, 5x faster (2.5 against 12.8 ms for
        # SmolLM2's 49k tokens; the fixed cost of every stage's load). A length word past the end is an IndexError.
        pos, end = self.pos, self.end
        mv = memoryview(self.buf)
        views = [mv[k:k + (end - k) // 8 * 8].cast("Q") for k in range(min(8, end))]
        try:
            for i in range(count):
                pos += 8 + views[pos & 7][pos >> 3]
                if pos > end:
                    break
        except IndexError:
            pos = end + 1
        finally:
            for v in views:
                v.release()
            mv.release()
        if pos > end:
            raise self.fail(f"truncated header (key {key!r}: an item of the {count} runs past the file's end)")
        self.pos = pos
        return StringArray(count)


@contextmanager
def _mapped(path: Path) -> Iterator[mmap.mmap | bytes]:
    """The file's bytes, memory-mapped (an empty file maps to b"", which then reads as truncated)."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot open ({e.strerror or e})") from None
    with f:
        if os.fstat(f.fileno()).st_size == 0:
            yield b""
            return
        try:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{path}: cannot map ({e})") from None
        with m:
            yield m


_QUANT_SIZES = {int(t): v for t, v in GGML_QUANT_SIZES.items()}  # by plain int: no enum lookup per tensor


def _tensor_nbytes(r: _Cursor, name: str, ne: tuple[int, ...], ggml_type: int) -> int:
    try:
        block, size = _QUANT_SIZES[ggml_type]
    except KeyError:
        raise r.fail(f"tensor {name!r}: unknown ggml type {ggml_type}") from None
    n = 1
    for d in ne:
        n *= d
    if ne and ne[0] % block:
        raise r.fail(f"tensor {name!r}: row length {ne[0]} is not a multiple of the block size {block}")
    return n // block * size


@dataclass(frozen=True, slots=True)
class _Header:
    version: int
    kv: dict[str, Any]
    kv_raw: tuple[tuple[str, bytes], ...]
    tensors: dict[str, TensorInfo]
    alignment: int
    header_end: int
    data_start: int


def _parse(buf: mmap.mmap | bytes, path: Path, *, expand: tuple[str, ...] = (), raw_kv: bool = False,
           tensor_table: bool = True) -> _Header:
    """The one GGUF header parser. `expand`: key prefixes whose arrays become Python lists (strings decoded);
    `raw_kv`: also keep each pair's encoded bytes; `tensor_table=False`: stop after the metadata."""
    r = _Cursor(buf, path)
    if buf[:4] != _MAGIC:
        raise r.fail("not a GGUF file (bad magic)")
    r.pos = 4
    version = r.u32()
    if version not in (2, 3):
        hint = " (big-endian GGUF is not supported)" if version and not version & 0xFFFF else ""
        raise r.fail(f"unsupported GGUF version {version}{hint}")
    n_tensors, n_kv = r.u64(), r.u64()
    if n_tensors > _MAX_TENSORS or n_kv > _MAX_KV:
        raise r.fail(f"implausible counts ({n_tensors} tensors, {n_kv} keys) in the header")
    kv: dict[str, Any] = {}
    kv_raw: list[tuple[str, bytes]] = []
    for _ in range(n_kv):
        start = r.pos
        key = r.string("metadata key")
        if key in kv:
            raise r.fail(f"metadata key {key!r} appears twice")
        kv[key] = r.value(r.u32(), key, bool(expand) and key.startswith(expand))
        if raw_kv:
            kv_raw.append((key, buf[start : r.pos]))
    if not tensor_table:
        return _Header(version, kv, tuple(kv_raw), {}, 0, r.pos, 0)
    raw_infos = []
    for _ in range(n_tensors):
        name = r.string("tensor name")
        n_dims = r.u32()
        if not 1 <= n_dims <= _MAX_DIMS:
            raise r.fail(f"tensor {name!r}: {n_dims} dimensions")
        ne = struct.unpack_from(f"<{n_dims}Q", buf, r.take(8 * n_dims))
        raw_infos.append((name, ne, *_TYPE_OFFSET.unpack_from(buf, r.take(12))))
    header_end = r.pos
    alignment = kv.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise r.fail(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-header_end // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, ne, ggml_type, off in raw_infos:
        nbytes = _tensor_nbytes(r, name, ne, ggml_type)
        if off % alignment:
            raise r.fail(f"tensor {name!r}: offset {off} is not aligned to {alignment}")
        start = data_start + off
        if start + nbytes > r.end:
            raise r.fail(f"truncated: tensor {name!r} needs bytes up to {start + nbytes}, the file has {r.end}")
        if name in tensors:
            raise r.fail(f"tensor {name!r} appears twice")
        tensors[name] = TensorInfo(name, tuple(reversed(ne)), ggml_type, start, nbytes)
    return _Header(version, kv, tuple(kv_raw), tensors, alignment, header_end, data_start)


_SAMPLE = 4096  # bytes hashed from each end of every tensor for the fingerprint


def _fingerprint(buf: mmap.mmap | bytes, h: _Header) -> str:
    # Identity: the header (metadata + tensor table) and a sample of every tensor's bytes. The header alone
    # cannot tell two fine-tunes of one architecture apart; the samples can, for a few KiB read per tensor.
    with memoryview(buf) as mv:  # slices of a memoryview: hashed in place, not copied
        sha = hashlib.sha256(mv[: h.header_end])
        for t in h.tensors.values():
            for at in sorted({t.offset, max(t.offset, t.offset + t.nbytes - _SAMPLE)}):
                sha.update(mv[at : at + min(_SAMPLE, t.nbytes)])
    return sha.hexdigest()


def read_gguf(path: str | Path, *, raw_kv: bool = False) -> GGUFFile:
    """Parse the GGUF header at `path`: metadata, tensor table, bounds checks against the file size, fingerprint.

    `raw_kv=True` also keeps every metadata pair's encoded bytes (`GGUFFile.kv_raw`), for copying them verbatim.
    A file that has not changed since an earlier parse (same path, size, mtime, ctime, inode) is read back from the
    header cache instead (see `_cached`).
    """
    path = Path(path)
    key = None if raw_kv else _stat_key(path)
    if key is not None and (hit := _cached(key)) is not None:
        return replace(hit, path=path, kv=dict(hit.kv), tensors=dict(hit.tensors))
    with _mapped(path) as buf:
        h = _parse(buf, path, raw_kv=raw_kv)
        digest = _fingerprint(buf, h)
        size = len(buf)
    g = GGUFFile(path, h.kv, h.tensors, h.data_start, size, digest, h.version, h.alignment, h.header_end, h.kv_raw)
    if key is not None and _stat_key(path) == key:  # unchanged while it was parsed
        _remember(key, g)
    return g


# ---- the header cache
# Parsing walks every vocabulary and merge string (~100k for SmolLM2: 15-20 ms of a 22 MB stage's ~50 ms load on
# this box) and the fingerprint reads 8 KiB of every tensor, scattered over the file. A peer loads the same file
# again and again (every start, every re-plan), so the parsed header is kept: in this process, and on disk under
# $MESH_CACHE_DIR/headers (default ~/.cache/mesh), one checksummed pickle per file path. An entry is used only for
# the same path, size, mtime, ctime, inode and device (ctime cannot be set back by a user: a file replaced or
# written in place gets a new one), and only files whose times are at least _STABLE_NS old are cached: a write
# within the filesystem's timestamp granularity of the parse could otherwise keep the old times (git's "racy clean"
# problem). MESH_HEADER_CACHE=0 turns it off. Pickles run code when loaded: the directory is the user's own cache,
# trusted as the step templates' (engine/program_cache.py).
_HEADER_MAGIC = b"meshhdr1"
_STABLE_NS = 2_000_000_000
_MEMO: dict[tuple, GGUFFile] = {}
# the classes' fields: an entry written by a version of this module with other fields is not used
_LAYOUT = tuple(tuple(f.name for f in fields(c)) for c in (GGUFFile, TensorInfo, StringArray))


def _stat_key(path: Path) -> tuple | None:
    if os.environ.get("MESH_HEADER_CACHE", "1") == "0":
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None  # the parse names the problem
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < _STABLE_NS:
        return None
    return (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def _header_file(key: tuple) -> Path:
    root = Path(os.environ.get("MESH_CACHE_DIR") or Path.home() / ".cache" / "mesh")
    return root / "headers" / f"{hashlib.sha256(key[0].encode()).hexdigest()[:32]}.bin"


def _cached(key: tuple) -> GGUFFile | None:
    if (hit := _MEMO.get(key)) is not None:
        return hit
    try:
        blob = _header_file(key).read_bytes()
    except OSError:
        return None
    body = memoryview(blob)[len(_HEADER_MAGIC) + 32:]
    m = len(_HEADER_MAGIC)
    if blob[:m] != _HEADER_MAGIC or hashlib.sha256(body).digest() != blob[m:m + 32]:
        return None
    try:
        stored_key, layout, g = pickle.loads(body)
    except Exception:  # checks out but does not unpickle: a foreign or future format
        return None
    if stored_key != key or layout != _LAYOUT or not isinstance(g, GGUFFile):
        return None  # the file at this path changed since
    _remember_here(key, g)
    return g


def _remember_here(key: tuple, g: GGUFFile) -> None:
    if len(_MEMO) >= 32:  # a long-lived process that sees many files keeps the latest few
        del _MEMO[next(iter(_MEMO))]
    _MEMO[key] = g


def _remember(key: tuple, g: GGUFFile) -> None:
    _remember_here(key, g)
    body = pickle.dumps((key, _LAYOUT, g), protocol=pickle.HIGHEST_PROTOCOL)
    path = _header_file(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(_HEADER_MAGIC)
            f.write(hashlib.sha256(body).digest())
            f.write(body)
        os.replace(tmp, path)  # a reader sees the old file or the new one
    except OSError:
        pass  # a cache that cannot be written is only slower


def read_metadata(path: str | Path, *, expand: tuple[str, ...] = ()) -> dict[str, Any]:
    """The metadata section alone (the tensor table is not read). Arrays under the key prefixes in `expand` come
    back as Python lists, strings decoded; the rest as numpy arrays and `StringArray` lengths (cheap to skip)."""
    path = Path(path)
    with _mapped(path) as buf:
        return _parse(buf, path, expand=expand, tensor_table=False).kv


def _need(g: GGUFFile, key: str) -> Any:
    if key not in g.kv:
        raise ModelFormatError(f"{g.path}: missing metadata key {key!r}")
    return g.kv[key]


def meta_from_gguf(g: GGUFFile) -> ModelMeta:
    arch = g.kv.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFormatError(f"{g.path}: missing metadata key 'general.architecture'")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModel(f"{g.path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    p = arch + "."
    file_layers = int(_need(g, p + "block_count"))
    dim = int(_need(g, p + "embedding_length"))
    n_heads = int(_need(g, p + "attention.head_count"))
    n_kv_heads = int(g.kv.get(p + "attention.head_count_kv", n_heads))
    if n_heads <= 0 or n_kv_heads <= 0 or n_heads % n_kv_heads:
        raise ModelFormatError(f"{g.path}: head counts {n_heads}/{n_kv_heads} are inconsistent")
    head_dim = int(g.kv.get(p + "attention.key_length", dim // n_heads))
    if "tokenizer.ggml.tokens" in g.kv:
        tokens = g.kv["tokenizer.ggml.tokens"]
        vocab = tokens.count if isinstance(tokens, StringArray) else len(tokens)
    elif p + "vocab_size" in g.kv:
        vocab = int(g.kv[p + "vocab_size"])
    elif "token_embd.weight" in g.tensors:
        vocab = g.tensors["token_embd.weight"].shape[0]
    else:
        raise ModelFormatError(f"{g.path}: cannot tell the vocabulary size (no tokens, vocab_size or token_embd)")
    src_fp = g.kv.get("mesh.source.fingerprint")
    rng = None
    n_layers = file_layers
    if src_fp is not None:
        n_layers = int(g.kv.get("mesh.source.block_count", file_layers))
        if "mesh.range.start" in g.kv and "mesh.range.end" in g.kv:
            rng = (int(g.kv["mesh.range.start"]), int(g.kv["mesh.range.end"]))
            if not 0 <= rng[0] < rng[1] <= n_layers:
                raise ModelFormatError(f"{g.path}: mesh.range {rng} lies outside the source's {n_layers} layers")
    gemma = _gemma_fields(g, p, dim, n_heads, head_dim, n_layers) if arch == "gemma3" else {}
    scaling = g.kv.get(p + "rope.scaling.type")
    rope_scale = 1.0
    if scaling == "linear" and float(g.kv.get(p + "rope.scaling.factor", 1.0) or 1.0) > 0:
        rope_scale = 1.0 / float(g.kv.get(p + "rope.scaling.factor", 1.0) or 1.0)
    return ModelMeta(
        arch=arch,
        n_layers=n_layers,
        dim=dim,
        ffn_dim=int(_need(g, p + "feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rope_theta=float(g.kv.get(p + "rope.freq_base", 10000.0)),
        rope_dim=int(g.kv.get(p + "rope.dimension_count", head_dim)),
        norm_eps=float(_need(g, p + "attention.layer_norm_rms_epsilon")),
        vocab_size=int(vocab),
        context_length=int(g.kv.get(p + "context_length", 2048)),
        qk_norm=any(n.endswith(".attn_q_norm.weight") for n in g.tensors),
        tied_output="output.weight" not in g.tensors,
        fingerprint=str(src_fp) if src_fp is not None else g.header_sha256,
        path=g.path,
        range=rng,
        qkv_bias=any(n.endswith(".attn_q.bias") for n in g.tensors),
        rope_neox=arch != "llama",
        rope_scale=rope_scale,
        **gemma,
    )


def _gemma_fields(g: GGUFFile, p: str, dim: int, n_heads: int, head_dim: int, n_layers: int) -> dict[str, Any]:
    """Gemma 3 as llama.cpp builds it (src/llama-model.cpp, src/models/gemma3.cpp): of every 6 layers the first 5
    are local, with rope base 10000 and a window of `attention.sliding_window` positions; norms after attention
    and FFN; GELU; embeddings times sqrt(dim); the query scaled by 1/sqrt(head_dim) (the 62-layer 27B model:
    1/sqrt(dim / heads)). The GGUF converter already stored the norms' weights as 1 + w."""
    window = int(_need(g, p + "attention.sliding_window"))
    if window <= 0:
        raise ModelFormatError(f"{g.path}: {p}attention.sliding_window = {window} is not a positive window")
    # no logit soft-capping: llama.cpp's gemma3 graph with a sliding window has none (Gemma 2 had it)
    scale_dim = dim // n_heads if n_layers == 62 else head_dim
    return dict(sliding_window=window, swa_pattern=6, rope_theta_local=10000.0, post_norms=True,
                embed_scale=float(np.sqrt(np.float32(dim), dtype=np.float32)), attn_scale=float(1 / np.sqrt(np.float32(scale_dim), dtype=np.float32)),
                ffn_act="gelu")


def read_model_meta(path: str | Path) -> ModelMeta:
    """Describe the model in the GGUF at `path` from its header alone (no tensor data is read)."""
    return meta_from_gguf(read_gguf(path))
