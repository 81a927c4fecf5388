"""The coordinator side: relay a non-trickle SDP exchange between two peers' control links, never parsing it.

The coordinator owns both links for the duration (request, reply, in order), like every other control exchange.
It moves opaque blobs: pull an offer from the offerer, hand it to the answerer, hand the answer back. Then, for a
chain hop, the answerer serves the channel as its inbound lane and the offerer installs it as its forward chain.
The caller bounds the whole thing with `trio.fail_after`; pass a `HopProgress` to learn which step a timeout hit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from mesh import proto

from .errors import SignalingError


class ControlLink(Protocol):
    """What the relay needs of a link: `mesh.link.Link` fits."""

    async def send(self, event: proto.Event) -> None: ...

    async def receive(self) -> proto.Event: ...


@dataclass(slots=True)
class HopProgress:
    """The step a relay is in; read it after a timeout to say where the hop got stuck."""

    step: str = "not started"


async def relay_webrtc(
    offerer: ControlLink, answerer: ControlLink, *, hop: str = "webrtc hop", progress: HopProgress | None = None
) -> None:
    """Pull an offer from `offerer`, get `answerer`'s answer to it, hand that back. Raises SignalingError(hop...)."""
    progress = progress if progress is not None else HopProgress()
    reply = await _exchange(offerer, proto.Signal(proto.SignalKind.OFFER), hop, "the offerer making an offer", progress)
    offer = _sdp(reply, proto.SignalKind.OFFER, hop, "the offerer")
    reply = await _exchange(answerer, proto.Signal(proto.SignalKind.ANSWER, offer), hop,
                            "the answerer answering the offer", progress)
    answer = _sdp(reply, proto.SignalKind.ANSWER, hop, "the answerer")
    reply = await _exchange(offerer, proto.Signal(proto.SignalKind.FINISH, answer), hop,
                            "the offerer applying the answer", progress)
    _ok(reply, proto.MsgType.SIGNAL, hop, "the offerer applying the answer")
    progress.step = "signaled"


async def open_rtc_hop(
    offerer: ControlLink,
    answerer: ControlLink,
    *,
    sink: bool = False,
    hop: str = "webrtc hop",
    progress: HopProgress | None = None,
) -> None:
    """Bring a forward hop offerer -> answerer up over WebRTC: signal, RtcServe on the answerer, RtcChain on the
    offerer (`sink`: the answerer is the coordinator's return sink)."""
    progress = progress if progress is not None else HopProgress()
    await relay_webrtc(offerer, answerer, hop=hop, progress=progress)
    step = "the answerer opening the channel as its inbound lane"
    _ok(await _exchange(answerer, proto.RtcServe(), hop, step, progress), proto.MsgType.RTC_SERVE, hop, step)
    step = "the offerer installing the channel as its forward chain"
    _ok(await _exchange(offerer, proto.RtcChain(sink), hop, step, progress), proto.MsgType.RTC_CHAIN, hop, step)
    progress.step = "open"


async def _exchange(link: ControlLink, request: proto.Event, hop: str, step: str, progress: HopProgress) -> proto.Event:
    progress.step = step
    try:
        await link.send(request)
        reply = await link.receive()
    except SignalingError:
        raise
    except Exception as exc:  # the link's own errors: a closed or broken control connection mid-step
        raise SignalingError(f"{hop}: {step}: the control link failed: {type(exc).__name__}: {exc}") from exc
    if isinstance(reply, proto.Error):
        raise SignalingError(f"{hop}: {step}: the peer closed its link: {reply.code.name}: {reply.reason}")
    return reply


def _sdp(reply: proto.Event, kind: proto.SignalKind, hop: str, who: str) -> str:
    if isinstance(reply, proto.Ack) and not reply.ok:
        raise SignalingError(f"{hop}: {who} failed: {reply.reason}")
    if not isinstance(reply, proto.Signal) or reply.kind != kind:
        raise SignalingError(f"{hop}: expected Signal({kind.name}) from {who}, got {_name(reply)}")
    if not reply.sdp:
        raise SignalingError(f"{hop}: {who} sent an empty {kind.name.lower()}")
    return reply.sdp


def _ok(reply: proto.Event, of: proto.MsgType, hop: str, step: str) -> None:
    if not isinstance(reply, proto.Ack) or reply.of != of:
        raise SignalingError(f"{hop}: {step}: expected an Ack for {of.name}, got {_name(reply)}")
    if not reply.ok:
        raise SignalingError(f"{hop}: {step} failed: {reply.reason}")


def _name(event: object) -> str:
    if isinstance(event, proto.Signal):
        return f"Signal({event.kind.name})"
    if isinstance(event, proto.Ack):
        return f"Ack({event.of.name}, code={event.code})"
    return type(event).__name__
