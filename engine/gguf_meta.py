"""GGUF header parsing: metadata KV, tensor table, and the model description derived from them.

Reads only the header (never tensor data). We parse the header ourselves rather than through
`gguf.GGUFReader`: the reader materialises every tokenizer string as a numpy array and took 2.8 s on
SmolLM2's header here; this parser skips string arrays by length and takes a few tens of milliseconds.
The `gguf` package still supplies the type tables (value types, quant block sizes).
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .errors import ModelFormatError, UnsupportedModel

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")

# Bounds that keep a corrupt header from making us allocate or loop without end.
_MAX_STRING = 64 << 20
_MAX_ARRAY = 1 << 26
_MAX_KV = 1 << 16
_MAX_TENSORS = 1 << 20
_MAX_DIMS = 4

_SCALARS: dict[int, tuple[str, int]] = {
    GGUFValueType.UINT8: ("<B", 1), GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2), GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4), GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4), GGUFValueType.BOOL: ("<?", 1),
    GGUFValueType.UINT64: ("<Q", 8), GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}


@dataclass(frozen=True, slots=True)
class StringArray:
    """A string array from the header, kept as its length only (tokenizer vocabularies are large)."""
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
    tensors: dict[str, TensorInfo]
    data_start: int
    file_size: int
    header_sha256: str


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


class _Reader:
    """Bounded reads from a header; a short read means the file is truncated."""

    def __init__(self, f: BinaryIO, path: Path) -> None:
        self._f, self._path, self.pos = f, path, 0

    def fail(self, why: str) -> ModelFormatError:
        return ModelFormatError(f"{self._path}: {why}")

    def read(self, n: int) -> bytes:
        data = self._f.read(n)
        if len(data) != n:
            raise self.fail(f"truncated header (wanted {n} bytes at offset {self.pos}, file ends)")
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        self.read(n) if n < 4096 else self._skip_seek(n)

    def _skip_seek(self, n: int) -> None:
        self._f.seek(n, 1)
        self.pos += n

    def scalar(self, vtype: int) -> Any:
        fmt, size = _SCALARS[vtype]
        return struct.unpack(fmt, self.read(size))[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def string(self, what: str) -> str:
        n = self.u64()
        if n > _MAX_STRING:
            raise self.fail(f"{what}: string length {n} exceeds {_MAX_STRING}")
        raw = self.read(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what}: string is not UTF-8") from None

    def value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string(key)
        if vtype == GGUFValueType.ARRAY:
            etype, count = self.u32(), self.u64()
            if count > _MAX_ARRAY:
                raise self.fail(f"key {key!r}: array of {count} items exceeds {_MAX_ARRAY}")
            if etype in _SCALARS:
                fmt, size = _SCALARS[etype]
                return np.frombuffer(self.read(size * count), dtype=np.dtype(fmt)).copy()
            if etype == GGUFValueType.STRING:
                for _ in range(count):
                    n = self.u64()
                    if n > _MAX_STRING:
                        raise self.fail(f"key {key!r}: string length {n} exceeds {_MAX_STRING}")
                    self.skip(n)
                return StringArray(count)
            raise self.fail(f"key {key!r}: unsupported array element type {etype}")
        raise self.fail(f"key {key!r}: unknown value type {vtype}")


def _tensor_nbytes(r: _Reader, name: str, ne: tuple[int, ...], ggml_type: int) -> int:
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise r.fail(f"tensor {name!r}: unknown ggml type {ggml_type}") from None
    n = 1
    for d in ne:
        n *= d
    if ne and ne[0] % block:
        raise r.fail(f"tensor {name!r}: row length {ne[0]} is not a multiple of the block size {block}")
    return n // block * size


_SAMPLE = 4096  # bytes hashed from each end of every tensor for the fingerprint


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the GGUF header at `path`: metadata, tensor table, and bounds checks against the file size."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot open ({e.strerror or e})") from None
    with f:
        file_size = path.stat().st_size
        r = _Reader(f, path)
        if r.read(4) != b"GGUF":
            raise r.fail("not a GGUF file (bad magic)")
        version = r.u32()
        if version not in (2, 3):
            raise r.fail(f"unsupported GGUF version {version}")
        n_tensors, n_kv = r.u64(), r.u64()
        if n_tensors > _MAX_TENSORS or n_kv > _MAX_KV:
            raise r.fail(f"implausible header counts ({n_tensors} tensors, {n_kv} keys)")
        kv: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string("metadata key")
            kv[key] = r.value(r.u32(), key)
        raw_infos = []
        for _ in range(n_tensors):
            name = r.string("tensor name")
            n_dims = r.u32()
            if not 1 <= n_dims <= _MAX_DIMS:
                raise r.fail(f"tensor {name!r}: {n_dims} dimensions")
            ne = tuple(r.u64() for _ in range(n_dims))
            raw_infos.append((name, ne, r.u32(), r.u64()))
        header_end = r.pos
        alignment = int(kv.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
            raise r.fail(f"general.alignment {alignment} is not a power of two")
        data_start = -(-header_end // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, ne, ggml_type, off in raw_infos:
            nbytes = _tensor_nbytes(r, name, ne, ggml_type)
            if off % alignment:
                raise r.fail(f"tensor {name!r}: offset {off} is not aligned to {alignment}")
            start = data_start + off
            if start + nbytes > file_size:
                raise r.fail(f"truncated: tensor {name!r} needs bytes up to {start + nbytes}, file has {file_size}")
            if name in tensors:
                raise r.fail(f"tensor {name!r} appears twice")
            tensors[name] = TensorInfo(name, tuple(reversed(ne)), ggml_type, start, nbytes)
        # Identity: the header (metadata + tensor table) and a sample of every tensor's bytes. The header alone
        # cannot tell two fine-tunes of one architecture apart; the samples can, for a few KiB read per tensor.
        h = hashlib.sha256()
        f.seek(0)
        h.update(f.read(header_end))
        for t in tensors.values():
            for at in sorted({t.offset, max(t.offset, t.offset + t.nbytes - _SAMPLE)}):
                f.seek(at)
                h.update(f.read(min(_SAMPLE, t.nbytes)))
        digest = h.hexdigest()
    return GGUFFile(path, kv, tensors, data_start, file_size, digest)


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
    )


def read_model_meta(path: str | Path) -> ModelMeta:
    """Describe the model in the GGUF at `path` from its header alone (no tensor data is read)."""
    return meta_from_gguf(read_gguf(path))
