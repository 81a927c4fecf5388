"""Payload field codecs: little-endian, length-prefixed, validated before anything is allocated.

Every message payload is a sequence of fields, each written and read by one of the codecs below. Decoding never
lets `struct.error`, `IndexError`, `UnicodeDecodeError` or `ValueError` escape: a bad payload is a
`ProtocolError(MALFORMED)` that names the message and the field.
"""
from __future__ import annotations

import struct
from enum import IntEnum
from typing import Any

from .errors import ErrorCode, ProtocolError


class Reader:
    """A cursor over one frame's payload."""

    __slots__ = ("view", "pos", "what")

    def __init__(self, payload: memoryview, what: str) -> None:
        self.view = payload
        self.pos = 0
        self.what = what

    def fail(self, reason: str) -> ProtocolError:
        return ProtocolError(ErrorCode.MALFORMED, f"{self.what}: {reason}")

    def remaining(self) -> int:
        return len(self.view) - self.pos

    def need(self, n: int, field: str, part: str = "") -> None:
        # Names are formatted only on failure: this runs several times per frame on the decode path.
        if self.pos + n > len(self.view):
            name = f"{field} {part}" if part else field
            raise self.fail(f"{name} needs {n} bytes at offset {self.pos}, payload has {self.remaining()} left")

    def take(self, n: int, field: str, part: str = "") -> memoryview:
        self.need(n, field, part)
        start = self.pos
        self.pos += n
        return self.view[start:self.pos]

    def unpack(self, st: struct.Struct, field: str, part: str = "") -> tuple:
        self.need(st.size, field, part)
        values = st.unpack_from(self.view, self.pos)
        self.pos += st.size
        return values

    def finish(self) -> None:
        if self.pos != len(self.view):
            raise self.fail(f"{len(self.view) - self.pos} trailing bytes after the last field")


class Field:
    """Writes a value into a list of byte chunks; reads it back from a `Reader`."""

    __slots__ = ()
    label = "field"

    def put(self, out: list, value: Any) -> None:
        raise NotImplementedError

    def get(self, r: Reader, field: str) -> Any:
        raise NotImplementedError


class Int(Field):
    __slots__ = ("st", "label")

    def __init__(self, fmt: str, label: str) -> None:
        self.st = struct.Struct("<" + fmt)
        self.label = label

    def put(self, out: list, value: Any) -> None:
        if type(value) is bool or not isinstance(value, int):
            raise TypeError(f"expected an int for {self.label}, got {type(value).__name__}")
        out.append(self.st.pack(value))

    def get(self, r: Reader, field: str) -> int:
        return r.unpack(self.st, field)[0]


class Float(Field):
    __slots__ = ()
    label = "f64"
    st = struct.Struct("<d")

    def put(self, out: list, value: Any) -> None:
        out.append(self.st.pack(float(value)))

    def get(self, r: Reader, field: str) -> float:
        return r.unpack(self.st, field)[0]


class Bool(Field):
    __slots__ = ()
    label = "bool"

    def put(self, out: list, value: Any) -> None:
        out.append(b"\x01" if value else b"\x00")

    def get(self, r: Reader, field: str) -> bool:
        b = r.take(1, field)[0]
        if b > 1:
            raise r.fail(f"{field} is a bool and must be 0 or 1, got {b}")
        return b == 1


class Enum(Field):
    __slots__ = ("st", "cls", "label")

    def __init__(self, cls: type[IntEnum], fmt: str) -> None:
        self.st = struct.Struct("<" + fmt)
        self.cls = cls
        self.label = cls.__name__

    def put(self, out: list, value: Any) -> None:
        out.append(self.st.pack(self.cls(value)))

    def get(self, r: Reader, field: str) -> IntEnum:
        raw = r.unpack(self.st, field)[0]
        try:
            return self.cls(raw)
        except ValueError:
            raise r.fail(f"{field}: {raw} is not a valid {self.cls.__name__}") from None


_LEN = struct.Struct("<I")


class Bytes(Field):
    __slots__ = ()
    label = "bytes"

    def put(self, out: list, value: Any) -> None:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"expected bytes, got {type(value).__name__}")
        out.append(_LEN.pack(len(value)))
        out.append(value)

    def get(self, r: Reader, field: str) -> bytes:
        (n,) = r.unpack(_LEN, field, "length")
        return bytes(r.take(n, field))


class View(Bytes):
    """Bytes that decode to a read-only view of the payload instead of a copy: for bulk data (a 1 MiB ShipChunk
    would otherwise be copied once more on the receive path). The Codec decodes only from immutable bytes, so the
    view can never change under its holder; a payload over mutable memory is copied."""

    __slots__ = ()

    def get(self, r: Reader, field: str) -> bytes | memoryview:
        (n,) = r.unpack(_LEN, field, "length")
        view = r.take(n, field)
        return view if view.readonly else bytes(view)


class Str(Field):
    __slots__ = ()
    label = "str"

    def put(self, out: list, value: Any) -> None:
        if not isinstance(value, str):
            raise TypeError(f"expected str, got {type(value).__name__}")
        raw = value.encode("utf-8")
        out.append(_LEN.pack(len(raw)))
        out.append(raw)

    def get(self, r: Reader, field: str) -> str:
        (n,) = r.unpack(_LEN, field, "length")
        raw = r.take(n, field)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise r.fail(f"{field} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


class Array(Field):
    """A u32 count followed by that many fixed-size records; a record of one value decodes to a plain int."""

    __slots__ = ("fmt", "width", "size", "label")

    def __init__(self, fmt: str, label: str) -> None:
        self.fmt = fmt
        self.width = len(fmt)
        self.size = struct.calcsize("<" + fmt)
        self.label = label

    def put(self, out: list, value: Any) -> None:
        n = len(value)
        out.append(_LEN.pack(n))
        if self.width == 1:
            out.append(struct.pack(f"<{n}{self.fmt}", *value))
        else:
            out.append(struct.pack("<" + self.fmt * n, *(x for rec in value for x in rec)))

    def get(self, r: Reader, field: str) -> tuple:
        (n,) = r.unpack(_LEN, field, "count")
        # The count is checked against the bytes actually present before any tuple is built.
        raw = r.take(n * self.size, field, self.label)
        if self.width == 1:
            return struct.unpack(f"<{n}{self.fmt}", raw)
        return tuple(struct.iter_unpack("<" + self.fmt, raw))


class Optional(Field):
    __slots__ = ("inner", "label")

    def __init__(self, inner: Field) -> None:
        self.inner = inner
        self.label = f"optional {inner.label}"

    def put(self, out: list, value: Any) -> None:
        if value is None:
            out.append(b"\x00")
        else:
            out.append(b"\x01")
            self.inner.put(out, value)

    def get(self, r: Reader, field: str) -> Any:
        flag = r.take(1, field, "presence")[0]
        if flag == 0:
            return None
        if flag != 1:
            raise r.fail(f"{field} presence flag must be 0 or 1, got {flag}")
        return self.inner.get(r, field)


U8 = Int("B", "u8")
U16 = Int("H", "u16")
U32 = Int("I", "u32")
U64 = Int("Q", "u64")
I32 = Int("i", "i32")
F64 = Float()
BOOL = Bool()
BYTES = Bytes()
VIEW = View()
STR = Str()
U32S = Array("I", "u32")
