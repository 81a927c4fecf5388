"""Range-only GGUF files planned straight from a source GGUF, streamed without a temporary copy.

A peer that serves layers [start, end) of a model needs only those blocks' tensors, plus the non-layer tensors at
the ends of the stack it touches. `plan_range_gguf` reads the source's header (never its tensor data), computes the
header of a valid GGUF v3 file holding exactly those tensors, and describes the rest of the file as byte ranges of
the source. `RangePlan.iter_chunks(offset)` then produces the file's bytes from any offset (so a dropped transfer
resumes) by `os.pread` of the source: tensor data is copied byte for byte, nothing is re-quantized, and nothing
larger than one chunk is ever held in memory.

What the planned file keeps, and why:
- every metadata key of the source, byte for byte, including `{arch}.block_count` (the source's depth: tensor
  names are the original `blk.N.*`, so a loader indexes layers exactly as it would in the full file);
- four keys naming its provenance: `mesh.source.fingerprint` (str), `mesh.source.block_count`, `mesh.range.start`,
  `mesh.range.end` (u32). `engine.gguf_meta` reports the source fingerprint and depth from them, so a shipped file
  and the coordinator's full file agree on the model's identity;
- the blocks' tensors `blk.{start..end-1}.*`; `token_embd.*` on the first stage; `output_norm.*` and `output.*` on
  the last stage, and `token_embd.*` there too when the output is tied (no `output.weight`); every other non-layer
  tensor (e.g. `rope_freqs.weight`) on every stage, because every block reads it.
"""
from __future__ import annotations

import bisect
import hashlib
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGUF_MAGIC, GGUFValueType

from .errors import ModelFormatError
from .gguf_meta import GGUFFile, meta_from_gguf, read_gguf

__all__ = [
    "CHUNK_BYTES",
    "RangeGGUFError",
    "SourceFormatError",
    "LayerRangeError",
    "SourceChangedError",
    "RangePlan",
    "SourceHeader",
    "TensorEntry",
    "plan_range_gguf",
    "read_source_header",
    "range_file_name",
]

CHUNK_BYTES = 1 << 20  # one wire chunk; big enough that per-chunk overhead vanishes, small for the credit window
OUT_VERSION = 3  # the layout this module writes

KEY_FINGERPRINT = "mesh.source.fingerprint"
KEY_SOURCE_DEPTH = "mesh.source.block_count"
KEY_RANGE_START = "mesh.range.start"
KEY_RANGE_END = "mesh.range.end"
_MESH_KEYS = (KEY_FINGERPRINT, KEY_SOURCE_DEPTH, KEY_RANGE_START, KEY_RANGE_END)

_T_STRING, _T_UINT32 = int(GGUFValueType.STRING), int(GGUFValueType.UINT32)
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


class RangeGGUFError(Exception):
    """Base of every error this module raises; the message names the file and the reason."""


class SourceFormatError(RangeGGUFError):
    """The source is not a GGUF this planner can read (truncated, corrupt, unknown type, big-endian)."""


class LayerRangeError(RangeGGUFError, ValueError):
    """The requested layer range is empty or outside the source model."""


class SourceChangedError(RangeGGUFError):
    """The source file changed on disk after the plan was made; its byte ranges no longer hold."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the innermost (row) length
    ggml_type: int
    offset: int  # absolute offset of the tensor's data in the source file
    nbytes: int


@dataclass(frozen=True, slots=True)
class SourceHeader:
    """What the planner needs of a GGUF header: raw KV bytes to copy and the tensor table."""

    path: Path
    version: int
    kv_raw: tuple[tuple[str, bytes], ...]  # (key, the key-value pair exactly as encoded in the source)
    kv_values: dict[str, object]  # scalar and string values (arrays are kept only raw)
    tensors: tuple[TensorEntry, ...]
    alignment: int
    header_end: int  # end of the tensor table, before alignment padding
    data_start: int
    file_size: int

    @property
    def arch(self) -> str:
        arch = self.kv_values.get("general.architecture")
        if not isinstance(arch, str):
            raise SourceFormatError(f"{self.path}: no general.architecture key")
        return arch

    @property
    def block_count(self) -> int:
        n = self.kv_values.get(f"{self.arch}.block_count")
        if not isinstance(n, int) or n <= 0:
            raise SourceFormatError(f"{self.path}: no valid {self.arch}.block_count key")
        return n


def _read(path: Path) -> GGUFFile:
    """The source's header through the engine's one GGUF reader, its errors mapped to ours."""
    try:
        return read_gguf(path, raw_kv=True)
    except ModelFormatError as e:
        raise SourceFormatError(str(e)) from None


def _source_header(g: GGUFFile) -> SourceHeader:
    values = {k: v for k, v in g.kv.items() if isinstance(v, (str, int, float))}
    tensors = tuple(TensorEntry(t.name, tuple(reversed(t.shape)), t.ggml_type, t.offset, t.nbytes)
                    for t in g.tensors.values())
    return SourceHeader(g.path, g.version, g.kv_raw, values, tensors, g.alignment, g.header_end, g.data_start,
                        g.file_size)


def read_source_header(path: str | os.PathLike) -> SourceHeader:
    """Parse a GGUF's header (metadata and tensor table); of the tensor data, only the fingerprint's samples are read."""
    return _source_header(_read(Path(path)))


def _layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def _wants(name: str, start: int, end: int, depth: int, tied: bool) -> bool:
    layer = _layer_of(name)
    if layer is not None:
        return start <= layer < end
    first, last = start == 0, end == depth
    stem = name.split(".", 1)[0]
    if stem == "token_embd":
        return first or (last and tied)
    if stem in ("output_norm", "output"):
        return last
    return True  # shared by every block (rope_freqs and the like): small, and every stage needs it


def _enc_str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _enc_kv_str(key: str, value: str) -> bytes:
    return _enc_str(key) + struct.pack("<I", _T_STRING) + _enc_str(value)


def _enc_kv_u32(key: str, value: int) -> bytes:
    return _enc_str(key) + struct.pack("<II", _T_UINT32, value)


def range_file_name(start: int, end: int) -> str:
    """The planned file's canonical name: the cache stores it as `<cache>/<fingerprint>/<start>-<end>.gguf`."""
    return f"{start}-{end}.gguf"


# Segment kinds of the planned file: bytes of the header, bytes of the source, or zero padding.
_HEADER, _SOURCE, _ZEROS = 0, 1, 2


@dataclass(eq=False)
class RangePlan:
    """The planned range-only GGUF: its exact size, header, and where each later byte comes from in the source."""

    source: Path
    start: int
    end: int
    fingerprint: str
    source_block_count: int
    header: bytes
    tensors: tuple[TensorEntry, ...]  # in the order they appear in the planned file
    size: int
    _segments: list[tuple[int, int, int, int]] = field(repr=False)  # (out_offset, length, kind, src_offset)
    _source_stat: tuple[int, int] = field(repr=False)  # (size, mtime_ns) when planned
    _sha256: bytes | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return range_file_name(self.start, self.end)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    def iter_chunks(self, offset: int = 0, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
        """Yield the planned file's bytes from `offset` to the end, `chunk` bytes at a time (the last may be short).

        The source is opened when iteration starts and closed when the generator finishes or is closed.
        """
        if not 0 <= offset <= self.size:
            raise ValueError(f"offset {offset} is outside the planned file's {self.size} bytes")
        if chunk <= 0:
            raise ValueError(f"chunk size must be positive, got {chunk}")
        fd = self._open_source()
        try:
            pos = offset
            while pos < self.size:
                n = min(chunk, self.size - pos)
                yield self._read(fd, pos, n)
                pos += n
        finally:
            os.close(fd)

    def read(self, offset: int, n: int) -> bytes:
        """The planned file's bytes [offset, offset + n), clipped at its end."""
        if not 0 <= offset <= self.size or n < 0:
            raise ValueError(f"range {offset}+{n} is outside the planned file's {self.size} bytes")
        fd = self._open_source()
        try:
            return self._read(fd, offset, min(n, self.size - offset))
        finally:
            os.close(fd)

    def sha256(self, memo_dir: str | os.PathLike | None = None) -> bytes:
        """SHA-256 of the whole planned file, computed once by streaming it, then remembered.

        With `memo_dir`, the digest is also kept on disk, keyed by the source's path, size and mtime and by the
        planned header, so a coordinator restarted to resume a shipment does not re-read gigabytes first.
        """
        if self._sha256 is None:
            memo, stamp = self._memo(memo_dir)
            if memo is not None:
                try:
                    text = memo.read_text()
                    if text.startswith(stamp):
                        self._sha256 = bytes.fromhex(text[len(stamp):].strip())
                except (OSError, ValueError):
                    pass
            if self._sha256 is None or len(self._sha256) != 32:
                h = hashlib.sha256()
                for piece in self.iter_chunks(0, 4 * CHUNK_BYTES):
                    h.update(piece)
                self._sha256 = h.digest()
                if memo is not None:
                    try:
                        memo.parent.mkdir(parents=True, exist_ok=True)
                        tmp = memo.with_name(memo.name + f".{os.getpid()}.tmp")
                        tmp.write_text(stamp + self._sha256.hex() + "\n")
                        os.replace(tmp, memo)
                    except OSError:
                        pass  # a memo is an optimisation; failing to keep one costs only time
        return self._sha256

    def _memo(self, memo_dir: str | os.PathLike | None) -> tuple[Path | None, str]:
        if memo_dir is None:
            return None, ""
        key = hashlib.sha256(f"{os.path.realpath(self.source)}\0{self.start}\0{self.end}".encode()).hexdigest()
        size, mtime = self._source_stat
        stamp = f"{os.path.realpath(self.source)}\n{size} {mtime} {hashlib.sha256(self.header).hexdigest()}\n"
        return Path(memo_dir) / f"{key[:32]}.sha256", stamp

    def write_to(self, path: str | os.PathLike) -> Path:
        """Materialize the planned file (tests, manual copies); shipping streams instead."""
        path = Path(path)
        with open(path, "wb") as out:
            for piece in self.iter_chunks(0, 4 * CHUNK_BYTES):
                out.write(piece)
        return path

    def _open_source(self) -> int:
        try:
            fd = os.open(self.source, os.O_RDONLY)
        except OSError as e:
            raise SourceChangedError(f"{self.source}: cannot open the planned source: {e.strerror or e}") from None
        st = os.fstat(fd)
        if (st.st_size, st.st_mtime_ns) != self._source_stat:
            os.close(fd)
            raise SourceChangedError(f"{self.source}: changed on disk since the range {self.name} was planned")
        return fd

    def _read(self, fd: int, pos: int, n: int) -> bytes:
        pieces = []
        i = bisect.bisect_right(self._segments, (pos, float("inf"))) - 1
        want_end = pos + n
        while pos < want_end:
            out_off, length, kind, src = self._segments[i]
            lo, hi = pos - out_off, min(length, want_end - out_off)
            if kind == _HEADER:
                pieces.append(self.header[lo:hi])
            elif kind == _ZEROS:
                pieces.append(bytes(hi - lo))
            else:
                got = os.pread(fd, hi - lo, src + lo)
                if len(got) != hi - lo:
                    raise SourceChangedError(f"{self.source}: short read at byte {src + lo}; the file shrank")
                pieces.append(got)
            pos = out_off + hi
            i += 1
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def plan_range_gguf(src_path: str | os.PathLike, start: int, end: int, *,
                    fingerprint: str | None = None) -> RangePlan:
    """Plan the range-only GGUF for layers [start, end) of `src_path`, reading only the source's header.

    `fingerprint` overrides the source identity written into the file (default: the engine's fingerprint of the
    source, or the one a range-file source already carries).
    """
    src = Path(src_path)
    g = _read(src)
    header = _source_header(g)
    depth = header.block_count
    carried_depth = header.kv_values.get(KEY_SOURCE_DEPTH)
    if isinstance(carried_depth, int):
        depth = carried_depth
    have_lo, have_hi = 0, depth
    if isinstance(header.kv_values.get(KEY_RANGE_START), int):
        have_lo, have_hi = header.kv_values[KEY_RANGE_START], header.kv_values[KEY_RANGE_END]
    if not (isinstance(start, int) and isinstance(end, int)) or not have_lo <= start < end <= have_hi:
        raise LayerRangeError(
            f"{src}: layer range {start}..{end} is not a non-empty range inside the file's layers "
            f"{have_lo}..{have_hi} (model depth {depth})")

    tied = not any(t.name == "output.weight" for t in header.tensors)
    picked = sorted((t for t in header.tensors if _wants(t.name, start, end, depth, tied)), key=lambda t: t.offset)
    present = {_layer_of(t.name) for t in picked}
    missing = [i for i in range(start, end) if i not in present]
    if missing:
        raise SourceFormatError(f"{src}: no tensors for layer(s) {missing[:8]} of the requested range {start}..{end}")
    if end == depth and not any(t.name.startswith(("output.", "token_embd.")) for t in picked):
        raise SourceFormatError(f"{src}: the last stage needs output.weight or a tied token_embd, found neither")
    if start == 0 and not any(t.name.startswith("token_embd.") for t in picked):
        raise SourceFormatError(f"{src}: the first stage needs token_embd, which the file lacks")

    # engine.gguf_meta owns the fingerprint's definition (and reads a range-file source's carried identity)
    fp = fingerprint if fingerprint is not None else meta_from_gguf(g).fingerprint
    align = header.alignment
    kvs = [raw for key, raw in header.kv_raw if key not in _MESH_KEYS]
    kvs += [_enc_kv_str(KEY_FINGERPRINT, fp), _enc_kv_u32(KEY_SOURCE_DEPTH, depth),
            _enc_kv_u32(KEY_RANGE_START, start), _enc_kv_u32(KEY_RANGE_END, end)]

    infos, rel = [], 0
    for t in picked:
        infos.append(_enc_str(t.name) + struct.pack(f"<I{len(t.dims)}Q", len(t.dims), *t.dims)
                     + struct.pack("<IQ", t.ggml_type, rel))
        rel += -(-t.nbytes // align) * align
    head = b"".join([struct.pack("<IIQQ", GGUF_MAGIC, OUT_VERSION, len(picked), len(kvs)), *kvs, *infos])
    head += bytes(-len(head) % align)

    segments, out = [(0, len(head), _HEADER, 0)], len(head)
    for t in picked:
        segments.append((out, t.nbytes, _SOURCE, t.offset))
        out += t.nbytes
        pad = -t.nbytes % align
        if pad:
            segments.append((out, pad, _ZEROS, 0))
            out += pad
    st = os.stat(src)
    return RangePlan(src, start, end, fp, depth, head, tuple(picked), out, segments, (st.st_size, st.st_mtime_ns))
