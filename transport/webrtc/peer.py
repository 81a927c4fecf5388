"""One RTCPeerConnection with one data channel, driven from trio through the bridge.

Signaling is non-trickle: aiortc gathers every candidate inside setLocalDescription, so the SDP a peer hands out
is complete and nothing is pushed later. The loop-side half (`_LoopPeer`) is only touched on the bridge's thread;
the trio-side half (`RtcPeer`) only submits its coroutines.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from typing import Any

import trio
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription

from .bridge import RtcBridge
from .channel import DataChannelStream
from .errors import ChannelError, RtcError, SdpError
from .sdp import check_sdp
from .servers import IceServer

CHANNEL_LABEL = "mesh"
# aiortc refuses messages over 256 KiB and a peer may announce less; 64 KiB is what every stack accepts.
MAX_CHUNK = 64 * 1024
# send() never blocks in aiortc: stop reading from trio above HIGH buffered bytes, resume below LOW.
HIGH_WATER = 1024 * 1024
LOW_WATER = 256 * 1024
# After the trio side closed, how long to wait for the remote to confirm the stream reset (which proves our last
# bytes arrived) before tearing the connection down anyway.
CLOSE_GRACE_S = 10.0


class _LoopPeer:
    """Loop-thread state of one peer connection: the pc, its channel, and the pump once trio opened a stream."""

    def __init__(self, bridge: RtcBridge, servers: Sequence[IceServer]) -> None:
        self._bridge = bridge
        # Always pass the list: aiortc's default configuration would use a public STUN server.
        config = RTCConfiguration(
            iceServers=[RTCIceServer(urls=s.url, username=s.username, credential=s.credential) for s in servers]
        )
        self.pc = RTCPeerConnection(config)
        self.channel: Any = None
        self.chunk = MAX_CHUNK
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inbound: asyncio.Queue[bytes | None] = asyncio.Queue()  # no receive backpressure exists in aiortc
        self._drained = asyncio.Event()
        self._sock: socket.socket | None = None
        self._inbound_ended = False
        self._pump: asyncio.Task[None] | None = None
        self._closed = False
        self.pc.on("connectionstatechange", self._on_state)
        bridge.own(self)

    # --- aiortc events (loop thread) ----------------------------------------------------------------------------
    def _attach(self, channel: Any) -> None:
        if self.channel is not None:
            # Only one channel is negotiated per connection; a second one is a confused or hostile peer.
            channel.close()
            return
        self.channel = channel
        channel.bufferedAmountLowThreshold = LOW_WATER
        # Registered now, not when trio opens the stream: the remote may send the moment the channel opens.
        channel.on("message", self._on_message)
        channel.on("close", self._on_close)
        channel.on("bufferedamountlow", self._drained.set)
        if channel.readyState == "open":
            self._set_ready()
        else:
            channel.on("open", self._set_ready)

    def _set_ready(self) -> None:
        if not self._ready.done():
            self._ready.set_result(None)

    def _fail_ready(self, reason: str) -> None:
        if not self._ready.done():
            self._ready.set_exception(ChannelError(reason))
            self._ready.exception()  # retrieved here so an unopened channel logs no "never retrieved" noise

    def _on_message(self, message: bytes | str) -> None:
        if isinstance(message, str):
            # A text message on a byte pipe is a confused or hostile peer: end the channel, trio reads EOF.
            self.channel.close()
            return
        self._inbound.put_nowait(message)

    def _on_close(self) -> None:
        self._fail_ready("the data channel closed before it opened")
        self._end_inbound()

    def _on_state(self) -> None:
        state = self.pc.connectionState
        if state in ("failed", "closed"):
            self._fail_ready(f"the peer connection {state} (ICE or DTLS could not connect)")
            self._end_inbound()

    def _end_inbound(self) -> None:
        if self._inbound_ended:
            return
        self._inbound_ended = True
        self._inbound.put_nowait(None)
        self._drained.set()
        self._shut_local_sends()

    def _shut_local_sends(self) -> None:
        if self._sock is not None:
            # Local sends now fail at once with EPIPE, while the bytes already received still drain to trio.
            try:
                self._sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass

    # --- steps submitted from trio -------------------------------------------------------------------------------
    async def offer(self) -> str:
        self._attach(self.pc.createDataChannel(CHANNEL_LABEL, ordered=True))
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return str(self.pc.localDescription.sdp)

    async def answer(self, offer_sdp: str, max_message: int) -> str:
        self._set_chunk(max_message)
        self.pc.on("datachannel", self._attach)
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        return str(self.pc.localDescription.sdp)

    async def finish(self, answer_sdp: str, max_message: int) -> None:
        self._set_chunk(max_message)
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer_sdp, type="answer"))

    async def open(self, sock: socket.socket) -> None:
        try:
            if self._pump is not None:
                raise ChannelError("a stream was already opened on this data channel")
            await asyncio.shield(self._ready)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        if self._inbound_ended:  # closed between opening and now: deliver what arrived, then EOF
            self._shut_local_sends()
        self._pump = asyncio.get_running_loop().create_task(self._run_pump(sock))

    async def aclose_on_loop(self) -> None:
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()
            try:
                await self._pump
            except asyncio.CancelledError:
                pass
        await self._teardown()

    # --- the pump ------------------------------------------------------------------------------------------------
    def _set_chunk(self, max_message: int) -> None:
        self.chunk = MAX_CHUNK if max_message == 0 else min(MAX_CHUNK, max_message)

    async def _run_pump(self, sock: socket.socket) -> None:
        try:
            outbound = asyncio.ensure_future(self._sock_to_channel(sock))
            inbound = asyncio.ensure_future(self._channel_to_sock(sock))
            try:
                await outbound
                # The trio side closed (or the channel did). Wait for the remote to confirm the reset, which
                # proves our queued bytes arrived, then stop.
                await asyncio.wait([inbound], timeout=CLOSE_GRACE_S)
            finally:
                for task in (outbound, inbound):
                    task.cancel()
                await asyncio.gather(outbound, inbound, return_exceptions=True)
        finally:
            await self._teardown()

    async def _sock_to_channel(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        channel = self.channel
        while True:
            try:
                data = await loop.sock_recv(sock, self.chunk)
            except OSError:
                data = b""
            if not data or channel.readyState != "open":
                break
            channel.send(data)
            while channel.bufferedAmount > HIGH_WATER and channel.readyState == "open":
                self._drained.clear()
                await self._drained.wait()
        if channel.readyState == "open":
            channel.close()

    async def _channel_to_sock(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while (message := await self._inbound.get()) is not None:
            try:
                await loop.sock_sendall(sock, message)
            except OSError:  # the trio side closed; nobody is reading any more
                return
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    async def _teardown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._bridge.disown(self)
        self._fail_ready("the peer connection was closed")
        try:
            await self.pc.close()
        finally:
            if self._sock is not None:
                _close_quietly(self._sock)


def _close_quietly(sock: socket.socket) -> None:
    """Close the pump's end so that trio reads a clean EOF after the bytes it was given.

    A unix socket closed with unread bytes in its own receive queue makes its peer's reads fail with ECONNRESET.
    Bytes trio sent that will never reach the channel are discarded first; SHUT_RD beforehand makes trio's further
    sends fail at once, so nothing new can arrive between the drain and the close.
    """
    try:
        sock.shutdown(socket.SHUT_RD)
        while sock.recv(65536):
            pass
    except OSError:  # EAGAIN once drained, or the trio end is already gone
        pass
    sock.close()


class RtcPeer:
    """The trio handle of one peer connection; `local_sdp` is this side's complete offer or answer."""

    def __init__(self, bridge: RtcBridge, loop_peer: _LoopPeer, local_sdp: str, role: str) -> None:
        self._bridge = bridge
        self._peer = loop_peer
        self.local_sdp = local_sdp
        self.role = role  # "offerer" or "answerer"
        self._finished = role == "answerer"

    async def finish(self, answer_sdp: str) -> None:
        """Offerer only: apply the remote answer; ICE and DTLS then connect in the background."""
        if self.role != "offerer":
            raise RtcError("finish() applies an answer and belongs to the offerer, not the answerer")
        if self._finished:
            raise RtcError("finish() was already called on this offer")
        summary = check_sdp(answer_sdp, "answer")
        await _mapped(self._bridge.call(self._peer.finish, answer_sdp, summary.max_message_size), "answer")
        self._finished = True

    async def open_stream(self) -> DataChannelStream:
        """Wait until the data channel is open and return it as a stream (bound this with a caller timeout)."""
        if not self._finished:
            raise RtcError("open_stream() before finish(): the offer has no answer yet")
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        try:
            await self._bridge.call(self._peer.open, theirs)
        except BaseException:
            ours.close()
            raise
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
        return DataChannelStream(stream, f"webrtc:{self.role}")

    async def aclose(self) -> None:
        """Close the peer connection (and its stream, if one was opened)."""
        with trio.CancelScope(shield=True):
            try:
                await self._bridge.call(self._peer.aclose_on_loop)
            except RtcError:  # the bridge is already gone, and the connection with it
                pass


async def _mapped(awaitable: Any, what: str) -> Any:
    """aiortc raises ValueError/InvalidStateError/... for descriptions it cannot use: map them to SdpError."""
    try:
        return await awaitable
    except RtcError:
        raise
    except Exception as exc:
        raise SdpError(f"the {what} was rejected by the WebRTC stack: {type(exc).__name__}: {exc}") from exc


async def make_offer(bridge: RtcBridge, servers: Sequence[IceServer] = ()) -> RtcPeer:
    """Create a peer connection with one data channel and return it with its complete offer."""
    holder: list[_LoopPeer] = []

    async def run() -> str:
        holder.append(_LoopPeer(bridge, servers))
        return await holder[0].offer()

    sdp = await _guarded(bridge, run, holder, "offer")
    return RtcPeer(bridge, holder[0], sdp, "offerer")


async def accept_offer(bridge: RtcBridge, offer_sdp: str, servers: Sequence[IceServer] = ()) -> RtcPeer:
    """Answer a remote offer: return the answering peer connection with its complete answer."""
    summary = check_sdp(offer_sdp, "offer")
    holder: list[_LoopPeer] = []

    async def run() -> str:
        holder.append(_LoopPeer(bridge, servers))
        return await holder[0].answer(offer_sdp, summary.max_message_size)

    sdp = await _guarded(bridge, run, holder, "offer")
    return RtcPeer(bridge, holder[0], sdp, "answerer")


async def _guarded(bridge: RtcBridge, run: Any, holder: list[_LoopPeer], what: str) -> str:
    """Run a set-up step; if it fails or is cancelled, close the half-made connection before re-raising."""
    try:
        return await _mapped(bridge.call(run), what)  # type: ignore[no-any-return]
    except BaseException:
        if holder:
            with trio.CancelScope(shield=True):
                try:
                    await bridge.call(holder[0].aclose_on_loop)
                except RtcError:
                    pass
        raise
