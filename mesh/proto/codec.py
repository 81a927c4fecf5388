"""Frames on a byte stream: an 8-byte little-endian header, then the payload.

    version:u8  type:u8  flags:u16  length:u32  payload[length]

The first byte of every connection is therefore a version byte (1), never b"G", which lets one listener tell our
clients from WebSocket clients. The length is checked against `max_frame` as soon as the header is complete, before
any of the payload is buffered or allocated.
"""
from __future__ import annotations

import struct

from .errors import ErrorCode, ProtocolError
from .events import Event, MsgType, decode_payload, encode_payload, is_known

HEADER = struct.Struct("<BBHI")
HEADER_SIZE = HEADER.size
PROTOCOL_VERSION = 1
MIN_VERSION = 1
MAX_VERSION = 1
MAX_FRAME = 64 * 1024 * 1024


class _Sentinel:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


NEED_DATA = _Sentinel("NEED_DATA")
"""`next_event()`: no whole frame is buffered yet; feed more bytes."""
EOF_ = _Sentinel("EOF")
"""`next_event()`: the peer closed the stream cleanly, between frames."""


class Codec:
    """Sans-IO framing, shaped like h11: `receive_data`, `next_event`, `send`.

    Only `ProtocolError` escapes decoding; once raised, the codec is dead and re-raises it. The buffer holds at most
    one frame (header + `max_frame`) plus the last chunk fed, provided the caller drains `next_event()` until
    NEED_DATA before feeding more.
    """

    __slots__ = ("max_frame", "version", "_buf", "_pending", "_pending_len", "_eof", "_error", "last_size")

    def __init__(self, *, max_frame: int = MAX_FRAME, version: int = PROTOCOL_VERSION) -> None:
        if max_frame < 0 or max_frame > 0xFFFFFFFF:
            raise ValueError(f"max_frame must be in [0, 2**32), got {max_frame}")
        self.max_frame = max_frame
        self.version = version
        self._buf = bytearray()
        # Chunks of a large frame's payload are kept aside and joined once when the frame is complete, rather than
        # grown into the buffer chunk by chunk (each growth can copy the whole buffer).
        self._pending: list[bytes] = []
        self._pending_len = 0
        self._eof = False
        self._error: ProtocolError | None = None
        self.last_size = 0
        """Size (header + payload) of the frame behind the event last returned by next_event()."""

    # ------------------------------------------------------------------ receiving

    def receive_data(self, data: bytes) -> None:
        """Feed bytes from the peer; b"" means the peer closed its side."""
        if self._error is not None:
            raise self._error
        if not data:
            self._eof = True
            return
        if self._eof:
            raise RuntimeError("receive_data after EOF")
        if len(self._buf) < HEADER_SIZE:
            self._buf += data
            self._check_header()
            return
        need = HEADER_SIZE + HEADER.unpack_from(self._buf)[3]  # validated when the header completed
        if len(self._buf) >= need:
            self._buf += data
            return
        self._pending.append(data)
        self._pending_len += len(data)
        if len(self._buf) + self._pending_len >= need:
            self._buf = bytearray().join([self._buf, *self._pending])
            self._pending.clear()
            self._pending_len = 0

    def _fail(self, code: ErrorCode, reason: str) -> ProtocolError:
        self._error = ProtocolError(code, reason)
        self._buf = bytearray()  # let go of whatever the peer sent us
        self._pending.clear()
        self._pending_len = 0
        return self._error

    def _check_header(self) -> tuple[int, int] | None:
        """Validate the buffered header; (type, length) or None when the header is incomplete."""
        if len(self._buf) < HEADER_SIZE:
            return None
        version, type_byte, flags, length = HEADER.unpack_from(self._buf)
        if version != self.version:
            raise self._fail(ErrorCode.UNSUPPORTED_VERSION,
                             f"frame version {version}, this connection speaks version {self.version}")
        if length > self.max_frame:
            raise self._fail(ErrorCode.FRAME_TOO_LARGE,
                             f"frame of type {type_byte} announces {length} bytes, max frame is {self.max_frame}")
        if not is_known(type_byte):
            raise self._fail(ErrorCode.UNKNOWN_TYPE, f"unknown message type {type_byte}")
        if flags:
            raise self._fail(ErrorCode.MALFORMED, f"{MsgType(type_byte).name} frame has reserved flags 0x{flags:04x}")
        return type_byte, length

    def next_event(self) -> Event | _Sentinel:
        """The next whole event, NEED_DATA, or EOF. Raises ProtocolError."""
        if self._error is not None:
            raise self._error
        header = self._check_header()
        if header is None or len(self._buf) < HEADER_SIZE + header[1]:
            if not self._eof:
                return NEED_DATA
            if not self._buf:
                return EOF_
            want = HEADER_SIZE + header[1] if header else HEADER_SIZE
            raise self._fail(ErrorCode.TRUNCATED,
                             f"connection closed mid-frame ({self.buffered()} of {want} bytes)")
        type_byte, length = header
        end = HEADER_SIZE + length
        with memoryview(self._buf) as view:
            try:
                event = decode_payload(MsgType(type_byte), view[HEADER_SIZE:end])
            except ProtocolError as exc:
                raise self._fail(exc.code, exc.reason) from None
        del self._buf[:end]
        self.last_size = end
        return event

    def buffered(self) -> int:
        """Bytes received and not yet returned as events."""
        return len(self._buf) + self._pending_len

    # ------------------------------------------------------------------ sending

    def send(self, event: Event) -> bytes:
        """The bytes of one frame carrying `event`. ValueError if the event cannot be encoded or is too large."""
        chunks = encode_payload(event)
        length = sum(len(c) for c in chunks)
        if length > self.max_frame:
            raise ValueError(f"{type(event).__name__} frame of {length} bytes exceeds max_frame {self.max_frame}")
        return b"".join([HEADER.pack(self.version, event.TYPE, 0, length), *chunks])
