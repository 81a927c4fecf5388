"""The peer's side of the WebRTC rung: answer the coordinator's signaling, then serve or install the data channel.

After the SDP exchange, the answerer of a hop serves its channel as an inbound lane (exactly like a dialed-in hop:
same handshake, same op loop) and the offerer installs its channel as the forward chain. From then on the hop is
transport-identical to a TCP or WebSocket one, so the output stays bitwise equal.
"""
from __future__ import annotations

import logging

import trio

from mesh import proto

log = logging.getLogger("mesh.peer.rtc")
SIGNAL_SECONDS = 30.0    # candidate gathering and ICE; aioice alone would wait about a minute before giving up


async def _endpoint_service(peer, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Own the peer's one RtcEndpoint (its asyncio bridge thread) for the peer's lifetime."""
    from signaling import open_rtc_endpoint
    async with open_rtc_endpoint(peer.cfg.ice) as endpoint:
        task_status.started(endpoint)
        await trio.sleep_forever()


async def _endpoint(peer):
    if peer.rtc is None:
        peer.rtc = await peer.nursery.start(_endpoint_service, peer)
    return peer.rtc


async def handle_rtc_op(peer, ev, link, session_nursery) -> None:
    from signaling import Side, SignalingError, answer_signal
    from mesh.peer import _Forward

    endpoint = await _endpoint(peer)
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
                # An inbound lane lives as long as the predecessor keeps it, like a dialed-in hop.
                peer.nursery.start_soon(peer._serve_inbound, stream)
            else:
                hop = await session_nursery.start(peer._hop, stream)
                peer.forward = _Forward(hop, ev.sink, "webrtc")
                log.info("forwarding to %s over WebRTC", "sink" if ev.sink else "the next peer")
    except (SignalingError, trio.TooSlowError, OSError) as exc:
        await link.send(proto.Ack(of, 1, f"the data channel did not open: {exc or 'timed out'}"))
        return
    except Exception as exc:
        await link.send(proto.Ack(of, 1, f"{type(exc).__name__}: {exc}"))
        return
    await link.send(proto.Ack(of, 0, ""))
