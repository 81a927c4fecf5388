"""The peer's side of the WebRTC rung: answer the coordinator's signaling, then serve or install the data channel.

After the SDP exchange, the answerer of a hop serves its channel as an inbound lane (exactly like a dialed-in hop:
same handshake, same op loop) and the offerer installs its channel as the forward chain. From then on the hop is
transport-identical to a TCP or WebSocket one, so the output stays bitwise equal.

This module builds on the peer's public hop API only (`LaneHost`: `serve_hop_stream`, `forward_over`) and imports
nothing from mesh.peer, which imports it: no import circle, no private names. `open_rtc_lanes` owns the nursery the
endpoint and the inbound lanes live in, for as long as the peer runs.
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Protocol

import trio

from mesh import proto

log = logging.getLogger("mesh.peer.rtc")
SIGNAL_SECONDS = 30.0    # candidate gathering and ICE; aioice alone would wait about a minute before giving up


class LaneHost(Protocol):
    """What the rung needs of a peer (mesh.peer.Peer provides it)."""

    async def serve_hop_stream(self, stream) -> None: ...

    async def forward_over(self, connect, *, sink: bool, label: str, nursery) -> None: ...


class RtcLanes:
    """The peer's one RtcEndpoint (its asyncio bridge thread, started on the first WebRTC op) and its lanes."""

    def __init__(self, host: LaneHost, ice, nursery: trio.Nursery) -> None:
        self._host = host
        self._ice = ice
        self._nursery = nursery
        self._endpoint = None

    async def _endpoint_service(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from signaling import open_rtc_endpoint
        async with open_rtc_endpoint(self._ice) as endpoint:
            task_status.started(endpoint)
            await trio.sleep_forever()

    async def endpoint(self):
        if self._endpoint is None:
            self._endpoint = await self._nursery.start(self._endpoint_service)
        return self._endpoint

    async def handle(self, ev, link, session_nursery) -> None:
        """One WebRTC op from the coordinator (Signal, RtcServe, RtcChain), answered on `link`. An outbound lane
        lives in `session_nursery` (it closes with the session); an inbound one as long as its predecessor keeps
        it, like a dialed-in hop (the peer ends it with the session that accepted it)."""
        from signaling import Side, SignalingError, answer_signal

        endpoint = await self.endpoint()
        if isinstance(ev, proto.Signal):
            reply = None
            with trio.move_on_after(SIGNAL_SECONDS):
                reply = await answer_signal(endpoint, ev)
            await link.send(reply or proto.Ack(proto.MsgType.SIGNAL, 1, f"no SDP within {SIGNAL_SECONDS:.0f}s"))
            return
        of = proto.MsgType.RTC_SERVE if isinstance(ev, proto.RtcServe) else proto.MsgType.RTC_CHAIN
        side = Side.ANSWERER if of == proto.MsgType.RTC_SERVE else Side.OFFERER
        try:
            with trio.fail_after(SIGNAL_SECONDS):
                stream = await endpoint.open_stream(side)
                if of == proto.MsgType.RTC_SERVE:
                    self._nursery.start_soon(self._host.serve_hop_stream, stream)
                else:
                    await self._host.forward_over(stream, sink=ev.sink, label="webrtc", nursery=session_nursery)
        except (SignalingError, trio.TooSlowError, OSError) as exc:
            await link.send(proto.Ack(of, 1, f"the data channel did not open: {exc or 'timed out'}"))
            return
        except Exception as exc:
            await link.send(proto.Ack(of, 1, f"{type(exc).__name__}: {exc}"))
            return
        await link.send(proto.Ack(of, 0, ""))


@asynccontextmanager
async def open_rtc_lanes(host: LaneHost, ice) -> AsyncIterator[RtcLanes]:
    """The WebRTC rung of `host` for the duration of the block; leaving it closes the endpoint and inbound lanes."""
    async with trio.open_nursery() as nursery:
        try:
            yield RtcLanes(host, ice, nursery)
        finally:
            nursery.cancel_scope.cancel()
