"""Frames on a byte stream: an 8-byte little-endian header, then the payload.

    version:u8  type:u8  flags:u16  length:u32  payload[length]

The first byte of every connection is therefore a version byte (2), never b"G", which lets one listener tell our
clients from WebSocket clients. The length is checked against `max_frame` as soon as the header is complete, before
any of the payload is buffered or allocated.

After the handshake both directions are sealed (`seal()`, mesh/proto/seal.py): every frame's outer type is SEALED
and its real type and payload travel inside the AEAD.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

from .errors import ErrorCode, ProtocolError
from .events import Event, MsgType, decode_payload, encode_payload, is_known
from .seal import SEAL_OVERHEAD, Sealer

HEADER = struct.Struct("<BBHI")
HEADER_SIZE = HEADER.size
PROTOCOL_VERSION = 4
# 2: sealed frames, X25519 in the handshake, the client proves first; 3: BatchStep per-column sampling; 4: Info says
# the bytes of the peer's KV values (a version-3 peer's Info would not decode: it is refused at the handshake instead)
MIN_VERSION = 4
MAX_VERSION = 4
MAX_FRAME = 64 * 1024 * 1024
HANDSHAKE_MAX_FRAME = 1024
"""The largest frame a connection accepts before it authenticated: the biggest handshake frame (a Hello with its
nonce and key, an Error with a reason) is well under this, so a stranger cannot make us buffer more."""
BULK = 64 * 1024
"""A last field this large is written as a buffer of its own rather than copied into the frame (`send_parts`):
below it, one write of a joined frame is cheaper than two writes."""


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
_EMPTY = memoryview(b"")


class Codec:
    """Sans-IO framing, shaped like h11: `receive_data`, `next_event`, `send`.

    Only `ProtocolError` escapes decoding; once raised, the codec is dead and re-raises it. The buffer holds at most
    one frame (header + `max_frame`) plus the last chunk fed, provided the caller drains `next_event()` until
    NEED_DATA before feeding more.

    Received bytes are never copied into a growing buffer: a frame that lies inside one received chunk is decoded
    from a view of it, and a frame spread over several chunks is joined once, exactly, when its last byte is in.
    Every payload is therefore decoded from immutable bytes, which is what lets a bulk field (`ShipChunk.data`)
    come out as a zero-copy read-only view (NOTES.md "Weight shipping").
    """

    __slots__ = ("max_frame", "version", "_head", "_more", "_more_len", "_eof", "_error", "last_size", "_seal_out",
                 "_seal_in")

    def __init__(self, *, max_frame: int = MAX_FRAME, version: int = PROTOCOL_VERSION) -> None:
        if max_frame < 0 or max_frame > 0xFFFFFFFF:
            raise ValueError(f"max_frame must be in [0, 2**32), got {max_frame}")
        self.max_frame = max_frame
        self.version = version
        self._head = _EMPTY  # a view of the oldest unconsumed received bytes
        self._more: list[memoryview] = []  # later chunks, kept as received until a frame needs them
        self._more_len = 0
        self._eof = False
        self._error: ProtocolError | None = None
        self.last_size = 0
        """Size (header + payload) of the frame behind the event last returned by next_event()."""
        self._seal_out: Sealer | None = None
        self._seal_in: Sealer | None = None

    def seal(self, send_key: bytes | None = None, receive_key: bytes | None = None) -> None:
        """From now on, seal every frame sent (with `send_key`) and/or open every frame received (with
        `receive_key`). Takes effect at the next frame boundary, so bytes already buffered behind the last plain
        frame are opened as sealed ones."""
        if send_key is not None:
            self._seal_out = Sealer(send_key)
        if receive_key is not None:
            self._seal_in = Sealer(receive_key)

    @property
    def sealed(self) -> bool:
        return self._seal_out is not None and self._seal_in is not None

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
        if type(data) is not bytes:
            data = bytes(data)  # decoded views must never alias memory the caller may reuse
        if not self._head and not self._more:
            self._head = memoryview(data)
        else:
            self._more.append(memoryview(data))
            self._more_len += len(data)
        self._check_header()  # an oversized or bogus frame is refused before its payload is buffered

    def _fail(self, code: ErrorCode, reason: str) -> ProtocolError:
        self._error = ProtocolError(code, reason)
        self._head = _EMPTY  # let go of whatever the peer sent us
        self._more.clear()
        self._more_len = 0
        return self._error

    def _check_header(self) -> tuple[int, int] | None:
        """Validate the buffered header; (type, length) or None when the header is incomplete."""
        head = self._head
        if len(head) < HEADER_SIZE:
            if len(head) + self._more_len < HEADER_SIZE:
                return None
            if not head:  # the previous frame ended exactly at a chunk's end
                head = self._head = self._more.pop(0)
                self._more_len -= len(head)
        if len(head) < HEADER_SIZE:
            # The header straddles received chunks: gather its 8 bytes alone (the chunks stay uncopied).
            pieces, n = [head], len(head)
            while n < HEADER_SIZE:
                piece = self._more.pop(0)
                self._more_len -= len(piece)
                cut = min(len(piece), HEADER_SIZE - n)
                pieces.append(piece[:cut])
                n += cut
                if cut < len(piece):
                    self._more.insert(0, piece[cut:])
                    self._more_len += len(piece) - cut
            head = self._head = memoryview(b"".join(pieces))
        version, type_byte, flags, length = HEADER.unpack_from(head)
        if version != self.version:
            raise self._fail(ErrorCode.UNSUPPORTED_VERSION,
                             f"frame version {version}, this connection speaks version {self.version}")
        if self._seal_in is not None:
            if type_byte != MsgType.SEALED:
                raise self._fail(ErrorCode.AUTH_FAILED, f"a frame of type {type_byte} arrived in the clear on a "
                                                        f"sealed connection")
            if not SEAL_OVERHEAD <= length <= self.max_frame + SEAL_OVERHEAD:
                raise self._fail(ErrorCode.FRAME_TOO_LARGE,
                                 f"sealed frame announces {length} bytes, max frame is {self.max_frame}")
        elif length > self.max_frame:
            raise self._fail(ErrorCode.FRAME_TOO_LARGE,
                             f"frame of type {type_byte} announces {length} bytes, max frame is {self.max_frame}")
        if type_byte == MsgType.SEALED and self._seal_in is None:
            raise self._fail(ErrorCode.UNEXPECTED, "a sealed frame before the handshake finished")
        if not is_known(type_byte) and type_byte != MsgType.SEALED:
            raise self._fail(ErrorCode.UNKNOWN_TYPE, f"unknown message type {type_byte}")
        if flags:
            raise self._fail(ErrorCode.MALFORMED, f"{MsgType(type_byte).name} frame has reserved flags 0x{flags:04x}")
        return type_byte, length

    def _take_frame(self, end: int) -> memoryview:
        """Remove the first `end` buffered bytes (one whole frame) and return them as a view of immutable bytes."""
        head = self._head
        if len(head) >= end:
            self._head = head[end:]
            return head[:end]
        pieces, n = [head], len(head)
        while True:
            piece = self._more.pop(0)
            self._more_len -= len(piece)
            if n + len(piece) >= end:
                cut = end - n
                pieces.append(piece[:cut])
                rest = piece[cut:]
                if rest:
                    self._head = rest
                elif self._more:
                    self._head = self._more.pop(0)
                    self._more_len -= len(self._head)
                else:
                    self._head = _EMPTY
                return memoryview(b"".join(pieces))
            pieces.append(piece)
            n += len(piece)

    def next_event(self) -> Event | _Sentinel:
        """The next whole event, NEED_DATA, or EOF. Raises ProtocolError."""
        if self._error is not None:
            raise self._error
        header = self._check_header()
        if header is None or self.buffered() < HEADER_SIZE + header[1]:
            if not self._eof:
                return NEED_DATA
            if not self.buffered():
                return EOF_
            want = HEADER_SIZE + header[1] if header else HEADER_SIZE
            raise self._fail(ErrorCode.TRUNCATED,
                             f"connection closed mid-frame ({self.buffered()} of {want} bytes)")
        type_byte, length = header
        end = HEADER_SIZE + length
        frame = self._take_frame(end)
        if self._seal_in is not None:
            event = self.decode_opened(self._open(frame))
        else:
            try:
                event = decode_payload(MsgType(type_byte), frame[HEADER_SIZE:])
            except ProtocolError as exc:
                raise self._fail(exc.code, exc.reason) from None
        self.last_size = end
        return event

    def open_whole(self, data: bytes) -> memoryview | None:
        """`data` that is exactly one whole sealed frame, arriving while nothing else is buffered (a decode step's
        frame, read in one piece): its header checked as `next_event` checks it and the frame opened (the next
        counter); its plaintext back, the inner type byte first, for `decode_opened` or for a reader of its own (a
        peer's steady decode step, mesh/proto/steady.py). None: not such a chunk, or the connection is not sealed yet;
        nothing changed (feed it to `receive_data`). Raises ProtocolError as `next_event` does."""
        if self._seal_in is None or self._head or self._more or self._eof or self._error is not None \
                or len(data) < HEADER_SIZE:
            return None
        version, type_byte, flags, length = HEADER.unpack_from(data)
        if length != len(data) - HEADER_SIZE:
            return None
        if type(data) is not bytes:
            data = bytes(data)  # (as receive_data: what is read from it must not alias the caller's buffer)
        frame = memoryview(data)
        if version != self.version or type_byte != MsgType.SEALED or flags or not SEAL_OVERHEAD <= length \
                <= self.max_frame + SEAL_OVERHEAD:    # the header check's error, from the check itself
            self._head = frame
            self._check_header()    # raises
            self._head = _EMPTY
        plain = self._open(frame)
        self.last_size = len(data)
        return plain

    def _open(self, frame: memoryview) -> memoryview:
        try:
            return memoryview(self._seal_in.open(frame[:HEADER_SIZE], frame[HEADER_SIZE:]))  # type: ignore[union-attr]
        except ProtocolError as exc:
            raise self._fail(exc.code, exc.reason) from None

    def decode_opened(self, plain: memoryview) -> Event:
        """The event of an opened frame's plaintext (`open_whole`). Raises ProtocolError."""
        try:
            type_byte = plain[0]
            if not is_known(type_byte):
                raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {type_byte}")
            return decode_payload(MsgType(type_byte), plain[1:])
        except ProtocolError as exc:
            raise self._fail(exc.code, exc.reason) from None

    def buffered(self) -> int:
        """Bytes received and not yet returned as events."""
        return len(self._head) + self._more_len

    # ------------------------------------------------------------------ sending

    def send(self, event: Event) -> bytes:
        """The bytes of one frame carrying `event`. ValueError if the event cannot be encoded or is too large."""
        return b"".join(self.send_parts(event))

    def send_parts(self, event: Event) -> list:
        """One frame carrying `event`, as buffers to write in order: the header and small fields joined, a bulk last
        field (>= BULK bytes, e.g. ShipChunk.data) left as it is, so a sender does not copy it to frame it.
        ValueError if the event cannot be encoded or is too large."""
        return self.frame(self.prepare(event))

    def prepare(self, event: Event) -> "Prepared":
        """Encode `event` (ValueError if it cannot be, or is too large) without framing it yet. On a sealed
        connection each frame takes the next counter when it is framed, so a writer that several tasks share must
        call `frame()` in the order the frames reach the wire, and `prepare()` (which may wait for credit) before."""
        chunks = encode_payload(event)
        length = sum(len(c) for c in chunks)
        if length > self.max_frame:
            raise ValueError(f"{type(event).__name__} frame of {length} bytes exceeds max_frame {self.max_frame}")
        size = HEADER_SIZE + length + (SEAL_OVERHEAD if self._seal_out is not None else 0)
        return Prepared(event.TYPE, chunks, length, size)

    def frame(self, prepared: "Prepared") -> list:
        """The buffers of one prepared frame, sealed if this direction is sealed."""
        type_byte, chunks, length, _ = prepared
        if self._seal_out is not None:
            header, sealed = self._seal(b"".join([bytes((type_byte,)), *chunks]))
            return [header, sealed] if length >= BULK else [header + sealed]
        header = HEADER.pack(self.version, type_byte, 0, length)
        if chunks and len(chunks[-1]) >= BULK:
            return [b"".join([header, *chunks[:-1]]), chunks[-1]]
        return [b"".join([header, *chunks])]

    def seal_plain(self, plain: bytes) -> bytes:
        """One sealed frame whose plaintext (the inner type byte, then the payload) the caller wrote itself (a
        peer's steady decode step, mesh/proto/steady.py), the next counter. ValueError if it is too large."""
        if len(plain) - 1 > self.max_frame:
            raise ValueError(f"a frame of {len(plain) - 1} bytes exceeds max_frame {self.max_frame}")
        header, sealed = self._seal(plain)
        return header + sealed

    def _seal(self, plain: bytes) -> tuple[bytes, bytes]:
        header = HEADER.pack(self.version, MsgType.SEALED, 0, len(plain) + SEAL_OVERHEAD - 1)
        return header, self._seal_out.seal(header, plain)  # type: ignore[union-attr]


class Prepared(NamedTuple):
    """An encoded event waiting to be framed: its type, payload chunks, payload length and size on the wire."""

    type: int
    chunks: list
    length: int
    size: int
