"""WebSocket as a byte stream over any trio stream: wsproto/h11 for the opening handshake, `wsframe` after it.

Message boundaries are dissolved: the framed protocol above parses bytes and does not care how they were cut.
`send_all` sends one binary message per call (split into several only past `max_message`), fragmented into frames
of `FRAME_BYTES`; `receive_some` hands out payload as it arrives, without waiting for a whole message, so memory
stays bounded by the read size however large a message is.

Control frames: a ping is answered with a pong; the peer's Close is answered and then reads give EOF (b"");
`aclose` sends Close and lingers briefly for the peer's Close so that our last bytes are not lost to a reset.
"""

from __future__ import annotations

import collections
import operator
from typing import Final

import h11
import trio
import wsproto
import wsproto.events as wse
import wsproto.utilities

from . import wsframe
from .errors import HandshakeError, WebSocketError
from .wsframe import CloseCode, FrameError

# The protocol's largest frame is 64 MiB of payload plus its header; a send_all of one frame must cross as one message.
DEFAULT_MAX_MESSAGE: Final = 64 * 1024 * 1024 + 64 * 1024
# Outgoing fragment size: big enough that per-frame Python overhead vanishes, small enough that masking a fragment
# does not double a 64 MiB message's memory.
FRAME_BYTES: Final = 1024 * 1024
# How much one read from the inner stream asks for.
READ_BYTES: Final = 256 * 1024
# How long aclose waits for the peer's Close after sending ours: a lingering close, as web servers do it. Closing a
# TCP socket with unread input sends a reset, which can destroy our own last bytes still in flight. Not a caller
# timeout: the peer may simply never answer, and aclose must still return.
CLOSE_GRACE_S = 1.0
# The opening handshake is bounded by h11's limit on an incomplete request or response head (16 KiB).
_MAX_HEAD = 16 * 1024


class WebSocketStream(trio.abc.Stream):
    """A `trio.abc.Stream` over an open WebSocket; made by `ws_connect` or `ws_accept`.

    `path` is the request target; `transport_stream` the stream underneath.
    """

    def __init__(
        self,
        inner: trio.abc.Stream,
        *,
        client: bool,
        path: str,
        received: bytes = b"",
        max_message: int = DEFAULT_MAX_MESSAGE,
        close_grace: float | None = None,
    ) -> None:
        if max_message < 1:
            raise ValueError(f"max_message must be at least 1, got {max_message}")
        self.transport_stream = inner
        self.path = path
        self.max_message = max_message
        self._client = client  # a client masks what it sends
        self._decoder = wsframe.FrameDecoder(client=client, max_message=max_message)
        self._decoder.receive_data(received)
        self._close_grace = CLOSE_GRACE_S if close_grace is None else close_grace
        # receive side
        self._chunks: collections.deque[bytes | bytearray] = collections.deque()
        self._offset = 0  # bytes of _chunks[0] already handed out
        self._eof = False
        self._error: WebSocketError | None = None
        self._receiving = False
        # the closing handshake
        self._sent_close = False
        self._got_close: int | None = None  # the peer's close code
        # send side: one lock serialises writes of send_all, control replies and aclose onto the inner stream
        self._send_lock = trio.Lock()
        self._sending = False
        self._pending = bytearray()  # control frames waiting for the writer
        self._send_broken: str | None = None
        self._closed = False

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
        """Read once from the inner stream (unless events are already waiting) and act on what arrived."""
        self._handle_events()
        if not (self._chunks or self._eof or self._error is not None):
            data = await self._read_inner()
            if data:
                self._decoder.receive_data(data)
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
        try:
            while (event := self._decoder.next_event()) is not None:
                if isinstance(event, wsframe.Data):
                    if event.payload:
                        self._chunks.append(event.payload)
                elif isinstance(event, wsframe.Ping):
                    if not self._sent_close:
                        self._pending += wsframe.encode_pong(event.payload, masked=self._client)
                elif isinstance(event, wsframe.Close):
                    self._got_close = event.code
                    self._eof = True
                    if not self._sent_close:
                        self._send_close(event.code)  # echo the peer's code, as RFC 6455 5.5.1 asks
                    return
                # Pong: nothing to do, we never ping
        except FrameError as exc:
            if not self._sent_close:
                self._send_close(exc.code, exc.reason)
            self._error = WebSocketError(f"peer broke the WebSocket protocol: {exc.reason}", code=exc.code)

    def _send_close(self, code: int, reason: str = "") -> None:
        self._pending += wsframe.encode_close(code, reason, masked=self._client)
        self._sent_close = True

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
                        await self._write(
                            *wsframe.encode_frame(
                                message[offset : offset + FRAME_BYTES],
                                opcode=wsframe.Opcode.CONTINUATION if offset else wsframe.Opcode.BINARY,
                                fin=offset + FRAME_BYTES >= len(message),
                                masked=self._client,
                            )
                        )
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
        if self._sent_close:
            raise trio.BrokenResourceError("the WebSocket is closing")

    async def _write(self, *buffers: bytes | bytearray | memoryview) -> None:
        """Write `buffers`, then any control frames queued meanwhile. Caller holds the send lock."""
        try:
            for buffer in buffers:
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
                if not self._sent_close:
                    self._send_close(CloseCode.NORMAL)
                # the grace covers writing our Close too: a peer that reads nothing may leave no room for it
                with trio.move_on_after(self._close_grace):
                    if self._pending:
                        async with self._send_lock:
                            await self._write()
                    # a receive_some in another task owns the inner stream's reading side; closing ends it
                    if self._got_close is None and self._error is None and not self._eof and not self._receiving:
                        await self._linger()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer went first; closing is all that is left to do
        finally:
            await self.transport_stream.aclose()

    async def _linger(self) -> None:
        """Read and drop whatever comes until the peer's Close, a framing error or EOF."""
        while True:
            data = await self.transport_stream.receive_some(READ_BYTES)
            if not data:
                return
            self._decoder.receive_data(data)
            try:
                while (event := self._decoder.next_event()) is not None:
                    if isinstance(event, wsframe.Close):
                        self._got_close = event.code
                        return
            except FrameError:
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
    # The server may send frames right behind its 101 response; wsproto would keep them inside its own framing,
    # so it is handed exactly the response head and the rest goes to our decoder.
    head = bytearray()
    while (end := head.find(b"\r\n\r\n")) < 0:
        if len(head) > _MAX_HEAD:
            raise HandshakeError(f"upgrade response head over {_MAX_HEAD} bytes", peer=host)
        data = await stream.receive_some(READ_BYTES)
        if not data:
            raise HandshakeError("the server closed the connection before completing the upgrade", peer=host)
        head += data
    rest = bytes(head[end + 4 :])
    try:
        ws.receive_data(bytes(head[: end + 4]))
        for event in ws.events():
            if isinstance(event, wse.AcceptConnection):
                return WebSocketStream(stream, client=True, path=path, received=rest, max_message=max_message)
            if isinstance(event, wse.RejectConnection):
                raise HandshakeError(f"the server refused the upgrade with HTTP {event.status_code}", peer=host)
    except wsproto.utilities.RemoteProtocolError as exc:
        raise HandshakeError(f"bad upgrade response: {exc}", peer=host) from None
    raise HandshakeError("bad upgrade response: no complete HTTP response head", peer=host)


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
    # h11 parses the request (it refuses an incomplete head over 16 KiB) and keeps the bytes that follow it, which
    # wsproto's own server handshake would drop; wsproto then checks the upgrade and writes the 101.
    http = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
    while True:
        try:
            event = http.next_event()
        except h11.RemoteProtocolError as exc:
            await _reject(stream, 400, f"bad HTTP request: {exc}")
            raise HandshakeError(f"bad HTTP request: {exc}", peer=peer) from None
        if event is h11.NEED_DATA:
            data = await stream.receive_some(READ_BYTES)
            if not data:
                raise HandshakeError("the client closed the connection during the upgrade request", peer=peer)
            http.receive_data(data)
            continue
        if isinstance(event, h11.Request):
            break
        raise HandshakeError(f"unexpected HTTP event {type(event).__name__}", peer=peer)
    ws = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
    try:
        if event.method != b"GET":
            raise wsproto.utilities.RemoteProtocolError(f"method must be GET, got {event.method.decode('latin-1')}")
        ws.initiate_upgrade_connection(list(event.headers), event.target)
        request = next(ws.events())
    except wsproto.utilities.RemoteProtocolError as exc:
        hint = exc.event_hint
        status = hint.status_code if isinstance(hint, wse.RejectConnection) else 400
        extra = list(hint.headers) if isinstance(hint, wse.RejectConnection) else []
        await _reject(stream, status, f"not a WebSocket upgrade: {exc}", extra)
        raise HandshakeError(f"not a WebSocket upgrade: {exc}", peer=peer) from None
    assert isinstance(request, wse.Request)
    await stream.send_all(ws.send(wse.AcceptConnection()))
    trailing, _ = http.trailing_data
    return WebSocketStream(
        stream, client=False, path=request.target, received=bytes(trailing), max_message=max_message
    )


async def _reject(
    stream: trio.abc.Stream, status: int, reason: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Send a plain HTTP error response; a client that already left is no reason to fail louder."""
    body = reason.encode("utf-8", "replace") + b"\n"
    head = [f"HTTP/1.1 {status} {_STATUS_TEXT.get(status, 'Error')}".encode()]
    head += [name + b": " + value for name, value in extra or []]
    head += [b"Content-Type: text/plain; charset=utf-8", b"Content-Length: %d" % len(body), b"Connection: close"]
    try:
        await stream.send_all(b"\r\n".join(head) + b"\r\n\r\n" + body)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


_STATUS_TEXT = {400: "Bad Request", 426: "Upgrade Required"}
