"""A WebRTC data channel as a `trio.abc.Stream`.

Trio sees one end of a socketpair; the other end lives on the bridge's asyncio loop, where a pump moves bytes
between it and the data channel. Measured here, this beats routing every send through the bridge: the hot path is
two kernel copies and no cross-thread wake-up per call.

Closing is full-duplex, as with a TCP socket: the trio side's `aclose` makes the pump close the channel (after its
queued data, which SCTP delivers before the stream reset), and the remote side then reads EOF; a channel closed by
the remote makes local sends fail with `BrokenResourceError` and local reads end with EOF after the data already
received.
"""

from __future__ import annotations

import trio


class DataChannelStream(trio.abc.Stream):
    """The trio end of one data channel. Obtain it from `RtcPeer.open_stream()`."""

    def __init__(self, inner: trio.SocketStream, label: str) -> None:
        self._inner = inner
        self.label = label  # e.g. "webrtc:offerer" — for logs and error messages

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self._inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __repr__(self) -> str:
        return f"<DataChannelStream {self.label}>"
