"""A shared-memory arena holding two single-producer single-consumer rings of framed records.

The worker process and its client map the same memory (a memfd on Linux, elsewhere a POSIX shm object unlinked at
once, engine.platform.shared_memory_fd; passed by file descriptor). Bulk data (activations in,
activations or token ids out) is written into a ring as a record; only a small `RecordRef` travels over the control
pipe. The reader checks every header field against the ref and against its own expectations before it looks at the
payload, because the other side of the arena is another process that may be buggy or half dead.

Arena layout (little endian):
    0     arena header, 64 bytes: magic b"MA01", version u16, ring count u16, reserved u32, total size u64
    64    ring 0 (INGRESS: client -> worker), then ring 1 (EGRESS: worker -> client); each ring is
          a control block of 128 bytes (write position u64 at 0, read position u64 at 64: separate cache lines,
          one owned by each side) followed by `capacity` data bytes.
Record layout, at a data offset that is a multiple of RECORD_ALIGN:
    magic b"MR01" | version u16 | header length u16 | object id u64 | sequence u64 | extent u64 | flags u32 |
    reserved u32 | payload (extent bytes)
Positions are monotonically increasing byte counters; a ring offset is `position % capacity`. A record never wraps:
when it does not fit before the end of the data area the writer skips to the start, and when the reader has consumed
everything the writer starts over at offset 0.
"""

from __future__ import annotations

import enum
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from engine.errors import EngineError
from engine.platform import Platform, current, shared_memory_fd

ARENA_MAGIC = b"MA01"
ARENA_VERSION = 1
ARENA_HEADER_LEN = 64
RING_CONTROL_LEN = 128
RECORD_MAGIC = b"MR01"
RECORD_VERSION = 1
RECORD_ALIGN = 64
_ARENA_HEADER = struct.Struct("<4sHHIQ")
_RECORD_HEADER = struct.Struct("<4sHHQQQII")
RECORD_HEADER_LEN = _RECORD_HEADER.size  # 40
_POS = struct.Struct("<Q")

INGRESS = 0
EGRESS = 1
RING_NAMES = ("ingress", "egress")

# The fields a reader checks; a RecordError names exactly one of them.
RECORD_FIELDS = ("magic", "version", "header_length", "object_id", "sequence", "extent", "flags", "reserved",
                 "alignment")


class PayloadKind(enum.IntEnum):
    """The low byte of a record's flags: what the payload holds. The shape travels in the command."""
    TOKENS_I32 = 1
    ACT_F16 = 2
    ACT_F32 = 3
    MESSAGE = 4     # a worker command or event with its data (engine.worker_records)


_KIND_DTYPE = {PayloadKind.TOKENS_I32: np.dtype("<i4"), PayloadKind.ACT_F16: np.dtype("<f2"),
               PayloadKind.ACT_F32: np.dtype("<f4"), PayloadKind.MESSAGE: np.dtype("u1")}
_KIND_MASK = 0xFF
_KIND_BY_DTYPE = {dt: kind for kind, dt in _KIND_DTYPE.items() if kind != PayloadKind.MESSAGE}
_ITEMSIZE = {int(kind): dt.itemsize for kind, dt in _KIND_DTYPE.items()}
_DTYPE_BY_VALUE = {int(kind): dt for kind, dt in _KIND_DTYPE.items()}


class ArenaError(EngineError):
    """The arena cannot be created, mapped, or written."""


class RingFull(ArenaError):
    """A record does not fit: larger than the ring, or the reader has not released enough space."""


class RecordError(ArenaError):
    """A ring record failed validation. `field` is one of RECORD_FIELDS."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"bad ring record {field}: {detail}")
        self.field = field
        self.detail = detail


@dataclass(frozen=True, slots=True)
class RecordRef:
    """Where a record lies and what the reader must find there. Small enough for the control pipe."""
    ring: int
    position: int
    object_id: int
    sequence: int
    extent: int


@dataclass(frozen=True, slots=True)
class RecordHeader:
    magic: bytes
    version: int
    header_length: int
    object_id: int
    sequence: int
    extent: int
    flags: int
    reserved: int

    def pack(self) -> bytes:
        return _RECORD_HEADER.pack(self.magic, self.version, self.header_length, self.object_id, self.sequence,
                                   self.extent, self.flags, self.reserved)

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> RecordHeader:
        return cls(*_RECORD_HEADER.unpack(data))


def kind_for_dtype(dtype: np.dtype | type) -> PayloadKind:
    kind = _KIND_BY_DTYPE.get(dtype)  # the per-step case: an array's own dtype, one hash lookup
    if kind is not None:
        return kind
    dt = np.dtype(dtype)
    for kind, kdt in _KIND_DTYPE.items():
        if dt == kdt:
            return kind
    raise ArenaError(f"no ring payload kind for dtype {dt}: rings carry int32 tokens, float16 or float32 activations")


def dtype_for_kind(kind: PayloadKind) -> np.dtype:
    return _KIND_DTYPE[kind]


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def ring_capacity(arena_bytes: int) -> int:
    """Data bytes per ring for an arena of `arena_bytes` (two rings, equal halves)."""
    per_ring = (arena_bytes - ARENA_HEADER_LEN) // 2 - RING_CONTROL_LEN
    return per_ring // RECORD_ALIGN * RECORD_ALIGN


class Arena:
    """The mapped memory and the ring geometry. Owns the mapping (and the fd, when it created it)."""

    def __init__(self, mm: mmap.mmap, fd: int, size: int, *, owns_fd: bool) -> None:
        self._mm = mm
        self.fd = fd
        self.size = size
        self.capacity = ring_capacity(size)
        self._owns_fd = owns_fd
        self.closed = False

    @classmethod
    def create(cls, size: int, platform: Platform | None = None) -> Arena:
        """A fresh anonymous shared-memory arena (nothing to clean up in /dev/shm if a process dies)."""
        if ring_capacity(size) < 4 * RECORD_ALIGN:
            raise ArenaError(f"arena of {size} bytes is too small for two rings")
        try:
            fd = shared_memory_fd(size, platform or current())
        except OSError as exc:
            raise ArenaError(f"cannot create a shared-memory arena of {size} bytes: {exc}") from exc
        try:
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            raise ArenaError(f"cannot create a shared-memory arena of {size} bytes: {exc}") from exc
        _ARENA_HEADER.pack_into(mm, 0, ARENA_MAGIC, ARENA_VERSION, 2, 0, size)
        return cls(mm, fd, size, owns_fd=True)

    @classmethod
    def attach(cls, fd: int, size: int) -> Arena:
        """Map an arena created by the other process; checks its header."""
        try:
            actual = os.fstat(fd).st_size
            if actual < size or actual >= size + mmap.PAGESIZE * 4:   # macOS rounds a shm object up to its pages
                raise ArenaError(f"arena fd {fd} holds {actual} bytes, expected {size}")
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            raise ArenaError(f"cannot map arena fd {fd}: {exc}") from exc
        magic, version, rings, _, total = _ARENA_HEADER.unpack_from(mm, 0)
        if magic != ARENA_MAGIC or version != ARENA_VERSION or rings != 2 or total != size:
            mm.close()
            raise ArenaError(f"arena fd {fd} has a bad header: magic {magic!r}, version {version}, rings {rings}, "
                             f"size {total}")
        return cls(mm, fd, size, owns_fd=False)

    @property
    def buffer(self) -> mmap.mmap:
        if self.closed:
            raise ArenaError("arena is closed")
        return self._mm

    def data_base(self, ring: int) -> int:
        return ARENA_HEADER_LEN + ring * (RING_CONTROL_LEN + self.capacity) + RING_CONTROL_LEN

    def _control(self, ring: int) -> int:
        return ARENA_HEADER_LEN + ring * (RING_CONTROL_LEN + self.capacity)

    def write_position(self, ring: int) -> int:
        return _POS.unpack_from(self.buffer, self._control(ring))[0]

    def set_write_position(self, ring: int, pos: int) -> None:
        _POS.pack_into(self.buffer, self._control(ring), pos)

    def read_position(self, ring: int) -> int:
        return _POS.unpack_from(self.buffer, self._control(ring) + 64)[0]

    def set_read_position(self, ring: int, pos: int) -> None:
        _POS.pack_into(self.buffer, self._control(ring) + 64, pos)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view into the arena; the mapping goes when that view does
        if self._owns_fd:
            os.close(self.fd)


class RingWriter:
    """The producing side of one ring. Single producer: one writer per ring per process."""

    def __init__(self, arena: Arena, ring: int) -> None:
        self.arena = arena
        self.ring = ring
        self._pos = arena.write_position(ring)
        self._floor = self._pos
        self._next_sequence = 0

    @property
    def next_sequence(self) -> int:
        return self._next_sequence

    def write(self, object_id: int, payload: np.ndarray) -> RecordRef:
        """Copy `payload` (a contiguous int32/float16/float32 array) into the ring as one record."""
        kind = kind_for_dtype(payload.dtype)
        data = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
        return self.write_parts(object_id, kind, (data,))

    def write_parts(self, object_id: int, kind: PayloadKind, parts) -> RecordRef:
        """Copy the buffers of `parts` (bytes, memoryviews, contiguous arrays), back to back, into the ring as one
        record of payload `kind`: a message head and its data go in without being joined first."""
        views = [memoryview(p).cast("B") for p in parts]
        extent = sum(v.nbytes for v in views)
        need = _align_up(RECORD_HEADER_LEN + extent, RECORD_ALIGN)
        cap = self.arena.capacity
        name = RING_NAMES[self.ring]
        if need > cap:
            raise RingFull(f"{name} record of {extent} bytes exceeds the ring's {cap} bytes; use a larger arena")
        pos = self._pos
        # all before the floor was consumed when the writer last restarted; the reader's own position lags it
        read = max(self.arena.read_position(self.ring), self._floor)
        if read == pos and pos % cap:
            # empty ring: start again at offset 0. In the request/reply pattern every record then lands on the same
            # warm pages; walking through the whole ring costs a page fault per 4 KiB on first touch.
            pos += cap - pos % cap
            read = self._floor = pos
        elif pos % cap + need > cap:
            pos += cap - pos % cap  # skip the tail: records never wrap
        used = pos + need - read
        if used > cap:
            raise RingFull(f"{name} ring has no room for {need} bytes: the reader has not released earlier records")
        off = self.arena.data_base(self.ring) + pos % cap
        buf = self.arena.buffer
        _RECORD_HEADER.pack_into(buf, off, RECORD_MAGIC, RECORD_VERSION, RECORD_HEADER_LEN, object_id,
                                 self._next_sequence, extent, int(kind), 0)
        at = off + RECORD_HEADER_LEN
        for v in views:
            buf[at:at + v.nbytes] = v
            at += v.nbytes
        ref = RecordRef(self.ring, pos, object_id, self._next_sequence, extent)
        self._next_sequence += 1
        self._pos = pos + need
        self.arena.set_write_position(self.ring, self._pos)
        return ref


class RingReader:
    """The consuming side of one ring: validates each record against its ref and its own expected sequence."""

    def __init__(self, arena: Arena, ring: int) -> None:
        self.arena = arena
        self.ring = ring
        self._next_sequence = 0

    @property
    def next_sequence(self) -> int:
        return self._next_sequence

    def view(self, ref: RecordRef) -> np.ndarray:
        """The payload as a 1-D array aliasing the arena (valid until `release`). Raises RecordError."""
        header = self.check(ref)
        dtype = _DTYPE_BY_VALUE[header.flags & _KIND_MASK]
        off = self.arena.data_base(self.ring) + ref.position % self.arena.capacity + RECORD_HEADER_LEN
        return np.frombuffer(self.arena.buffer, dtype, header.extent // dtype.itemsize, off)

    def payload(self, ref: RecordRef) -> memoryview:
        """The payload bytes aliasing the arena (valid until `release`). Raises RecordError."""
        header = self.check(ref)
        off = self.arena.data_base(self.ring) + ref.position % self.arena.capacity + RECORD_HEADER_LEN
        return memoryview(self.arena.buffer)[off:off + header.extent]

    def release(self, ref: RecordRef) -> None:
        """Done with `ref` (and everything before it): the writer may reuse the space."""
        need = _align_up(RECORD_HEADER_LEN + ref.extent, RECORD_ALIGN)
        self.arena.set_read_position(self.ring, ref.position + need)
        self._next_sequence = ref.sequence + 1

    def take(self, ref: RecordRef) -> np.ndarray:
        """Validate, copy out, release."""
        out = self.view(ref).copy()
        self.release(ref)
        return out

    def check(self, ref: RecordRef) -> RecordHeader:
        name = RING_NAMES[self.ring]
        cap = self.arena.capacity
        where = f"{name} record at position {ref.position}"
        if ref.ring != self.ring:
            raise RecordError("alignment", f"{where}: ref names ring {ref.ring}, this reader reads {self.ring}")
        if ref.position % RECORD_ALIGN:
            raise RecordError("alignment", f"{where}: not a multiple of {RECORD_ALIGN} bytes")
        read = self.arena.read_position(self.ring)
        if ref.position < read:
            raise RecordError("sequence", f"{where}: lies before the read position {read}, already consumed")
        off = ref.position % cap
        if off + RECORD_HEADER_LEN > cap:
            raise RecordError("alignment", f"{where}: header would run past the ring's end ({cap} bytes)")
        h = RecordHeader(*_RECORD_HEADER.unpack_from(self.arena.buffer, self.arena.data_base(self.ring) + off))
        if h.magic != RECORD_MAGIC:
            raise RecordError("magic", f"{where}: magic {h.magic!r}, expected {RECORD_MAGIC!r}")
        if h.version != RECORD_VERSION:
            raise RecordError("version", f"{where}: version {h.version}, expected {RECORD_VERSION}")
        if h.header_length != RECORD_HEADER_LEN:
            raise RecordError("header_length", f"{where}: header length {h.header_length}, expected "
                                               f"{RECORD_HEADER_LEN}")
        if h.reserved != 0:
            raise RecordError("reserved", f"{where}: reserved field is {h.reserved:#x}, must be 0")
        if h.object_id != ref.object_id:
            raise RecordError("object_id", f"{where}: object id {h.object_id}, expected {ref.object_id}")
        if h.sequence != ref.sequence or h.sequence != self._next_sequence:
            raise RecordError("sequence", f"{where}: sequence {h.sequence}, expected {self._next_sequence} "
                                          f"(ref says {ref.sequence})")
        if h.extent != ref.extent or off + RECORD_HEADER_LEN + h.extent > cap:
            raise RecordError("extent", f"{where}: extent {h.extent}, ref says {ref.extent}, room {cap - off - RECORD_HEADER_LEN}")
        itemsize = _ITEMSIZE.get(h.flags)  # a known kind in the low byte and no other bit set
        if itemsize is None:
            raise RecordError("flags", f"{where}: flags {h.flags:#x} name no known payload kind")
        if h.extent % itemsize:
            raise RecordError("alignment", f"{where}: extent {h.extent} is not a multiple of the "
                                           f"{PayloadKind(h.flags).name} item size {itemsize}")
        return h
