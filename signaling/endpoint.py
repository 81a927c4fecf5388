"""The peer side of WebRTC signaling: one `RtcEndpoint` per peer process owns the bridge and its connections.

A peer in a chain can be the answerer of its inbound hop and the offerer of its outbound hop at once, so the
endpoint keeps one pending connection per side: `make_offer`/`finish` fill the offerer slot and `accept_offer` the
answerer slot; `open_stream(Side.OFFERER)` (the coordinator's RtcChain) and `open_stream(Side.ANSWERER)` (its
RtcServe) take them. A new offer or answer replaces (and closes) a pending one that was never opened.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


from mesh import proto
from transport.webrtc import DataChannelStream, RtcBridge, RtcError, RtcPeer, accept_offer, make_offer, open_rtc_bridge

from .errors import SignalingError
from .ice import IceConfig


class Side(enum.Enum):
    OFFERER = "offerer"    # installs the channel as its forward chain (RtcChain)
    ANSWERER = "answerer"  # serves the channel as an inbound lane (RtcServe)


class RtcEndpoint:
    """Make, accept and finish SDP offers; open the resulting data channels as trio streams.

    Every method may wait on the network (candidate gathering, ICE): bound each with `trio.fail_after`.
    """

    def __init__(self, bridge: RtcBridge, ice: IceConfig) -> None:
        self._bridge = bridge
        self.ice = ice
        self._pending: dict[Side, RtcPeer] = {}
        self._finished = False  # the pending offer got its answer

    async def make_offer(self) -> str:
        """Start a new outbound connection; return its complete (non-trickle) offer SDP."""
        peer = await self._step("make an offer", make_offer(self._bridge, self.ice.servers))
        await self._replace(Side.OFFERER, peer)
        self._finished = False
        return peer.local_sdp

    async def accept_offer(self, sdp: str) -> str:
        """Answer a remote offer with a new inbound connection; return the complete answer SDP."""
        peer = await self._step("accept the offer", accept_offer(self._bridge, sdp, self.ice.servers))
        await self._replace(Side.ANSWERER, peer)
        return peer.local_sdp

    async def finish(self, answer_sdp: str) -> None:
        """Apply the remote answer to the pending offer; the channel then connects in the background."""
        peer = self._pending.get(Side.OFFERER)
        if peer is None:
            raise SignalingError("cannot apply the answer: this peer has no pending offer (FINISH before OFFER)")
        await self._step("apply the answer", peer.finish(answer_sdp))
        self._finished = True

    async def open_stream(self, side: Side) -> DataChannelStream:
        """Wait for the pending `side` connection's data channel to open and return it as a stream."""
        peer = self._pending.get(side)
        if peer is None:
            raise SignalingError(f"no pending WebRTC connection as {side.value}: the SDP exchange did not happen")
        if side is Side.OFFERER and not self._finished:
            raise SignalingError("the pending offer never got an answer (no FINISH): the channel cannot open")
        stream = await self._step(f"open the data channel as {side.value}", peer.open_stream())
        # The stream now owns the connection: closing the stream closes it (the bridge closes it at exit).
        del self._pending[side]
        return stream  # type: ignore[no-any-return]

    async def _replace(self, side: Side, peer: RtcPeer) -> None:
        old = self._pending.pop(side, None)
        self._pending[side] = peer
        if old is not None:
            await old.aclose()

    @staticmethod
    async def _step(what: str, awaitable):  # type: ignore[no-untyped-def]
        try:
            return await awaitable
        except RtcError as exc:
            raise SignalingError(f"could not {what}: {exc}") from exc


@asynccontextmanager
async def open_rtc_endpoint(ice: IceConfig | None = None) -> AsyncIterator[RtcEndpoint]:
    """Start the bridge thread; on exit close every connection and stream of this endpoint and join the thread."""
    async with open_rtc_bridge() as bridge:
        yield RtcEndpoint(bridge, ice or IceConfig())


async def answer_signal(endpoint: RtcEndpoint, event: proto.Signal) -> proto.Event:
    """The peer's reply to a coordinator's Signal: Signal(OFFER|ANSWER, sdp), or an Ack (ok, or failed + reason).

    The caller bounds it (`trio.move_on_after`) and answers a failed Ack itself when it times out.
    """
    try:
        if event.kind is proto.SignalKind.OFFER:
            return proto.Signal(proto.SignalKind.OFFER, await endpoint.make_offer())
        if event.kind is proto.SignalKind.ANSWER:
            return proto.Signal(proto.SignalKind.ANSWER, await endpoint.accept_offer(event.sdp))
        await endpoint.finish(event.sdp)
        return proto.Ack(proto.MsgType.SIGNAL)
    except SignalingError as exc:
        return proto.Ack(proto.MsgType.SIGNAL, 1, str(exc))


__all__ = ["RtcEndpoint", "Side", "answer_signal", "open_rtc_endpoint"]
