"""A stream that hands back bytes already read from it before reading on.

The listener reads a connection's first bytes to tell a WebSocket client (first byte `G`) from a protocol client
(first byte 1); those bytes belong to whoever handles the connection, so they are replayed from here.
"""

from __future__ import annotations

import operator

import trio


class PrefixStream(trio.abc.HalfCloseableStream):
    """`inner`, with `prefix` returned by the first `receive_some` calls before anything new is read.

    Half-closing works when the inner stream supports it (a TCP `SocketStream` does).
    """

    def __init__(self, inner: trio.abc.Stream, prefix: bytes) -> None:
        self.transport_stream = inner
        self._prefix = memoryview(bytes(prefix))
        self._receiving = False
        self._closed = False

    @property
    def prefix_left(self) -> int:
        """Bytes of the prefix not yet returned (a reader of the inner socket itself must wait for 0)."""
        return len(self._prefix)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.transport_stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport_stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        send_eof = getattr(self.transport_stream, "send_eof", None)
        if send_eof is None:
            raise TypeError(f"{type(self.transport_stream).__name__} cannot half-close")
        await send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)
            if max_bytes < 1:
                raise ValueError("max_bytes must be at least 1")
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this stream")
        if self._closed:
            await trio.lowlevel.checkpoint()
            raise trio.ClosedResourceError("this stream was closed")
        if not self._prefix:
            return await self.transport_stream.receive_some(max_bytes)
        self._receiving = True
        try:
            await trio.lowlevel.checkpoint()
            n = len(self._prefix) if max_bytes is None else min(max_bytes, len(self._prefix))
            chunk, self._prefix = bytes(self._prefix[:n]), self._prefix[n:]
            return chunk
        finally:
            self._receiving = False

    async def aclose(self) -> None:
        self._closed = True
        self._prefix = memoryview(b"")
        await self.transport_stream.aclose()
