"""WebSocket as a byte stream over any trio stream, with wsproto in charge of the connection: handshake and framing.

Message boundaries are dissolved: the framed protocol above parses bytes and does not care how they were cut.
`send_all` sends one binary message per call (split into several only past `max_message`), as frames of
`FRAME_BYTES`; `receive_some` hands out payload as wsproto yields it, without waiting for a whole message (wsproto
yields partial frames as they arrive), so memory stays bounded by the read size however large a message is.

Control frames: a ping is answered with a pong; the peer's Close is answered and then reads give EOF (b"");
`aclose` sends Close and lingers briefly for the peer's Close so that our last bytes are not lost to a reset.
"""

from __future__ import annotations

import collections
import operator
import re
from typing import Final

import trio
import wsproto
import wsproto.events as wse
from wsproto.connection import ConnectionState
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from .errors import HandshakeError, WebSocketError

# The protocol's largest frame is 64 MiB of payload plus its header; a send_all of one frame must cross as one message.
DEFAULT_MAX_MESSAGE: Final = 64 * 1024 * 1024 + 64 * 1024
# Outgoing frame size, and how much one read from the inner stream asks for. wsproto allocates a few fresh copies
# of every frame (and of every read it parses); at 512 KiB and up glibc serves and returns them by mmap/trim, and
# page faults double the CPU per MiB. 256 KiB measured best (64 KiB-4 MiB tried): NOTES.md, Transport.
FRAME_BYTES: Final = 256 * 1024
READ_BYTES: Final = 256 * 1024
# How long aclose waits for the peer's Close after sending ours: a lingering close, as web servers do it. Closing a
# TCP socket with unread input sends a reset, which can destroy our own last bytes still in flight. Not a caller
# timeout: the peer may simply never answer, and aclose must still return.
CLOSE_GRACE_S = 1.0
# Where an HTTP head ends, by h11's own rule (it also takes bare LF line ends).
_HEAD_END = re.compile(rb"\n\r?\n")


class WebSocketStream(trio.abc.Stream):
    """A `trio.abc.Stream` over an open WebSocket; made by `ws_connect` or `ws_accept`.

    `connection` is the wsproto connection after its handshake (state OPEN), already fed with any bytes that
    followed the handshake. `path` is the request target; `transport_stream` the stream underneath.
    """

    def __init__(
        self,
        inner: trio.abc.Stream,
        connection: wsproto.WSConnection,
        *,
        path: str,
        max_message: int = DEFAULT_MAX_MESSAGE,
        close_grace: float | None = None,
    ) -> None:
        if max_message < 1:
            raise ValueError(f"max_message must be at least 1, got {max_message}")
        if connection.state is not ConnectionState.OPEN:
            raise ValueError(f"the wsproto connection must be open, it is {connection.state.name}")
        self.transport_stream = inner
        self.path = path
        self.max_message = max_message
        self._ws = connection
        self._close_grace = CLOSE_GRACE_S if close_grace is None else close_grace
        # receive side
        self._chunks: collections.deque[bytes | bytearray] = collections.deque()
        self._offset = 0  # bytes of _chunks[0] already handed out
        self._message_bytes = 0  # received so far of the message in progress
        self._eof = False
        self._error: WebSocketError | None = None
        self._receiving = False
        self._got_close: int | None = None  # the peer's close code
        # send side: one lock serialises writes of send_all, control replies and aclose onto the inner stream
        self._send_lock = trio.Lock()
        self._sending = False
        self._pending = bytearray()  # control frames waiting for the writer
        self._send_broken: str | None = None
        self._closed = False
        # wsproto may already hold frames that came right behind the handshake
        self._handle_events()

    # ---- receiving ----

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)
            if max_bytes < 1:
                raise ValueError("max_bytes must be at least 1")
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this WebSocket")
        self._receiving = True
        try:
            if self._closed:
                raise trio.ClosedResourceError("this WebSocket was closed")
            if self._chunks or self._eof or self._error is not None:
                await trio.lowlevel.checkpoint()
            while not self._chunks:
                if self._error is not None:
                    raise WebSocketError(self._error.reason, code=self._error.code)
                if self._eof:
                    return b""
                await self._pump()
            return self._take(max_bytes)
        finally:
            self._receiving = False

    def _take(self, max_bytes: int | None) -> bytes | bytearray:
        chunk = self._chunks[0]
        start = self._offset
        n = len(chunk) - start if max_bytes is None else min(len(chunk) - start, max_bytes)
        if start + n == len(chunk):
            self._chunks.popleft()
            self._offset = 0
            return chunk if start == 0 else chunk[start:]
        self._offset = start + n
        return chunk[start : start + n]

    async def _pump(self) -> None:
        """Read once from the inner stream and act on what wsproto makes of it."""
        await self._flush_pending()  # e.g. the pong to a ping that came right behind the handshake
        data = await self._read_inner()
        if data:
            self._ws.receive_data(data)
            self._handle_events()
        else:
            # the transport ended without a Close (1006): reported as plain EOF, like TCP's FIN; the framed
            # protocol above notices a truncated frame on its own
            self._eof = True
        await self._flush_pending()

    async def _read_inner(self) -> bytes | bytearray:
        try:
            return await self.transport_stream.receive_some(READ_BYTES)
        except trio.BrokenResourceError:
            if self._closed:
                raise trio.ClosedResourceError("this WebSocket was closed") from None
            raise

    def _handle_events(self) -> None:
        for event in self._ws.events():
            if isinstance(event, wse.BytesMessage):
                # wsproto has no size limit and shows no frame header, so the limit holds as the message accumulates:
                # nothing past it is handed out, and no message is ever buffered whole
                self._message_bytes += len(event.data)
                if self._message_bytes > self.max_message:
                    self._fail(CloseReason.MESSAGE_TOO_BIG, f"a message exceeded the limit of {self.max_message} bytes")
                    return
                if event.data:
                    self._chunks.append(event.data)
                if event.message_finished:
                    self._message_bytes = 0
            elif isinstance(event, wse.Ping):
                if self._ws.state is ConnectionState.OPEN:
                    self._pending += self._ws.send(event.response())
            elif isinstance(event, wse.CloseConnection):
                if self._ws.state in (ConnectionState.REMOTE_CLOSING, ConnectionState.CLOSED):
                    self._got_close = int(event.code)
                    self._eof = True
                    if self._ws.state is ConnectionState.REMOTE_CLOSING:
                        self._pending += self._ws.send(event.response())  # echo, as RFC 6455 5.5.1 asks
                else:
                    # a frame wsproto refused: it reports that as a CloseConnection carrying the code to answer with,
                    # leaving its state unchanged, and parses nothing more
                    self._fail(event.code, event.reason or "bad frame")
                return
            elif isinstance(event, wse.TextMessage):
                self._fail(CloseReason.UNSUPPORTED_DATA, "peer sent a text message; this stream carries binary only")
                return
            # Pong: nothing to do, we never ping

    def _fail(self, code: int, reason: str) -> None:
        if self._ws.state is ConnectionState.OPEN:
            self._pending += self._ws.send(wse.CloseConnection(code=code, reason=reason))
        self._error = WebSocketError(f"peer broke the WebSocket protocol: {reason}", code=int(code))

    async def _flush_pending(self) -> None:
        # Control replies go out now unless a send_all holds the writer: it flushes them between its frames.
        if self._pending and not self._send_lock.locked() and self._send_broken is None:
            try:
                async with self._send_lock:
                    await self._write()
            except trio.BrokenResourceError:
                pass  # best effort: data already received is still handed out, and the next send reports it

    # ---- sending ----

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this WebSocket")
        self._sending = True
        try:
            self._check_can_send()
            view = memoryview(data).cast("B")
            if not view:
                await trio.lowlevel.checkpoint()
                return
            # an uncontended trio.Lock still yields to the scheduler; inner send_all checkpoints anyway
            try:
                self._send_lock.acquire_nowait()
            except trio.WouldBlock:
                await self._send_lock.acquire()
            try:
                for start in range(0, len(view), self.max_message):
                    message = view[start : start + self.max_message]
                    for offset in range(0, len(message), FRAME_BYTES):
                        self._check_can_send()
                        # wsproto frames a memoryview slice as it is: no copy of ours before its own
                        frame = self._ws.send(
                            wse.BytesMessage(
                                data=message[offset : offset + FRAME_BYTES],
                                message_finished=offset + FRAME_BYTES >= len(message),
                            )
                        )
                        await self._write(frame)
            finally:
                self._send_lock.release()
        finally:
            self._sending = False

    def _check_can_send(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this WebSocket was closed")
        if self._send_broken is not None:
            raise trio.BrokenResourceError(self._send_broken)
        if self._error is not None:
            raise WebSocketError(self._error.reason, code=self._error.code)
        if self._got_close is not None:
            raise trio.BrokenResourceError(f"the peer closed the WebSocket (code {self._got_close})")
        if self._ws.state is not ConnectionState.OPEN:
            raise trio.BrokenResourceError("the WebSocket is closing")

    async def _write(self, buffer: bytes | bytearray = b"") -> None:
        """Write `buffer`, then any control frames queued meanwhile. Caller holds the send lock."""
        try:
            if buffer:
                await self.transport_stream.send_all(buffer)
            while self._pending:
                pending, self._pending = self._pending, bytearray()
                await self.transport_stream.send_all(pending)
        except trio.BrokenResourceError as exc:
            self._send_broken = f"the connection under the WebSocket broke: {exc}"
            if self._closed:
                raise trio.ClosedResourceError("this WebSocket was closed") from None
            raise
        except BaseException:
            # a write cut short (cancelled, or the stream closed under us) may leave half a frame on the wire
            self._send_broken = "an earlier send was interrupted part way through a frame"
            raise

    async def wait_send_all_might_not_block(self) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this WebSocket")
        self._sending = True
        try:
            if self._closed:
                raise trio.ClosedResourceError("this WebSocket was closed")
            await self.transport_stream.wait_send_all_might_not_block()
        finally:
            self._sending = False

    # ---- closing ----

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        try:
            # a send_all in progress owns the writer and may be stuck mid-frame: then no Close can be framed
            if not self._send_lock.locked() and self._send_broken is None:
                if self._ws.state is ConnectionState.OPEN:
                    self._pending += self._ws.send(wse.CloseConnection(code=CloseReason.NORMAL_CLOSURE))
                # the grace covers writing our Close too: a peer that reads nothing may leave no room for it
                with trio.move_on_after(self._close_grace):
                    if self._pending:
                        async with self._send_lock:
                            await self._write()
                    # a receive_some in another task owns the inner stream's reading side; closing ends it
                    if (
                        self._ws.state is ConnectionState.LOCAL_CLOSING
                        and self._error is None
                        and not self._eof
                        and not self._receiving
                    ):
                        await self._linger()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer went first; closing is all that is left to do
        finally:
            await self.transport_stream.aclose()

    async def _linger(self) -> None:
        """Read and drop whatever comes until the peer's Close, a frame wsproto refuses, or EOF."""
        while True:
            data = await self.transport_stream.receive_some(READ_BYTES)
            if not data:
                return
            self._ws.receive_data(data)
            for event in self._ws.events():
                if isinstance(event, wse.CloseConnection):
                    if self._ws.state is ConnectionState.CLOSED:
                        self._got_close = int(event.code)
                    return


# ---- opening handshakes ----


async def ws_connect(
    stream: trio.abc.Stream,
    host: str,
    path: str = "/",
    *,
    max_message: int = DEFAULT_MAX_MESSAGE,
) -> WebSocketStream:
    """Run the client side of the upgrade on `stream`; `host` is the Host header (`host:port`).

    Raises `HandshakeError` if the server refuses or answers garbage; the caller still owns `stream` then.
    """
    ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    await stream.send_all(ws.send(wse.Request(host=host, target=path)))
    try:
        while True:
            data = await stream.receive_some(READ_BYTES)
            if not data:
                raise HandshakeError("the server closed the connection before completing the upgrade", peer=host)
            # wsproto's h11 bounds the response head (16 KiB) and keeps what follows the 101 (frames the server
            # sent at once) for the open connection
            ws.receive_data(data)
            for event in ws.events():
                if isinstance(event, wse.AcceptConnection):
                    return WebSocketStream(stream, ws, path=path, max_message=max_message)
                if isinstance(event, wse.RejectConnection):
                    raise HandshakeError(f"the server refused the upgrade with HTTP {event.status_code}", peer=host)
    except RemoteProtocolError as exc:
        raise HandshakeError(_describe(exc, "response"), peer=host) from None


async def ws_accept(
    stream: trio.abc.Stream,
    *,
    max_message: int = DEFAULT_MAX_MESSAGE,
    peer: str | None = None,
) -> WebSocketStream:
    """Run the server side of the upgrade on `stream`.

    A request that is not a valid WebSocket upgrade gets an HTTP error response and raises `HandshakeError`
    (`peer`, if given, is named in it); the caller still owns `stream` then.
    """
    ws = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
    # wsproto's server handshake drops whatever follows the request head, yet a client may send its first frames
    # right behind it: so wsproto is fed the head alone, and the rest once the connection is open.
    tail = b""  # the last bytes fed, as the blank line may straddle two reads
    try:
        while True:
            data = await stream.receive_some(READ_BYTES)
            if not data:
                raise HandshakeError("the client closed the connection during the upgrade request", peer=peer)
            end = _HEAD_END.search(tail + data)
            rest = b""
            if end is not None:
                cut = end.end() - len(tail)
                data, rest = data[:cut], data[cut:]
            ws.receive_data(data)  # its h11 refuses an incomplete head over 16 KiB
            request = next((e for e in ws.events() if isinstance(e, wse.Request)), None)
            if request is not None:
                break
            if end is not None:
                raise RemoteProtocolError("the request head held no request", event_hint=wse.RejectConnection())
            tail = (tail + data)[-2:]
    except RemoteProtocolError as exc:
        reason = _describe(exc, "request")
        await _reject(stream, ws, exc, reason)
        raise HandshakeError(reason, peer=peer) from None
    await stream.send_all(ws.send(wse.AcceptConnection()))
    if rest:
        ws.receive_data(rest)
    return WebSocketStream(stream, ws, path=request.target, max_message=max_message)


def _describe(exc: RemoteProtocolError, what: str) -> str:
    # wsproto reports every HTTP parse failure as "Bad HTTP message"; the h11 error it was raised from says which
    if what == "request":
        return f"bad HTTP request: {exc.__context__}" if exc.__context__ else f"not a WebSocket upgrade: {exc}"
    return f"bad upgrade response: {exc.__context__ or exc}"


async def _reject(stream: trio.abc.Stream, ws: wsproto.WSConnection, exc: RemoteProtocolError, reason: str) -> None:
    """Answer a bad upgrade request with wsproto's suggested HTTP error; a client that already left is no reason to
    fail louder."""
    hint = exc.event_hint if isinstance(exc.event_hint, wse.RejectConnection) else wse.RejectConnection()
    body = reason.encode("utf-8", "replace") + b"\n"
    headers = [
        *hint.headers,
        (b"Content-Type", b"text/plain; charset=utf-8"),
        (b"Content-Length", b"%d" % len(body)),
        (b"Connection", b"close"),
    ]
    try:
        response = ws.send(wse.RejectConnection(status_code=hint.status_code, headers=headers, has_body=True))
        response += ws.send(wse.RejectData(data=body))
    except LocalProtocolError:
        return  # h11 cannot frame a response in its state: closing says enough
    try:
        await stream.send_all(response)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
