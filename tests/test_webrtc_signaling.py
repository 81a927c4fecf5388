"""signaling: the SDP relay over control links, the peer endpoint, ICE flags, and the transport ladder."""

from __future__ import annotations

import os
import threading

import pytest
import trio
import trio.testing

from mesh import proto
from signaling import (
    HopError,
    HopProgress,
    IceConfig,
    IceConfigError,
    RtcEndpoint,
    Side,
    SignalingError,
    answer_signal,
    climb,
    open_rtc_endpoint,
    open_rtc_hop,
    relay_webrtc,
)

from tests.test_webrtc import _new_threads, loopback_host_candidates  # noqa: F401  (autouse: host candidates on 127.0.0.1)


class FakeLink:
    """One end of a control connection: events in both directions through memory channels."""

    def __init__(self, send: trio.MemorySendChannel, receive: trio.MemoryReceiveChannel) -> None:
        self._send, self._receive = send, receive

    async def send(self, event: proto.Event) -> None:
        await self._send.send(event)

    async def receive(self) -> proto.Event:
        return await self._receive.receive()


def link_pair() -> tuple[FakeLink, FakeLink]:
    a_send, b_receive = trio.open_memory_channel(8)
    b_send, a_receive = trio.open_memory_channel(8)
    return FakeLink(a_send, a_receive), FakeLink(b_send, b_receive)


async def serve_control(link: FakeLink, endpoint: RtcEndpoint, streams: dict[Side, trio.abc.Stream]) -> None:
    """What a peer's op loop does with the coordinator's WebRTC events (mesh.peer does this for real)."""
    while True:
        event = await link.receive()
        if isinstance(event, proto.Signal):
            with trio.fail_after(20):
                await link.send(await answer_signal(endpoint, event))
        else:
            side, of = (Side.ANSWERER, proto.MsgType.RTC_SERVE) if isinstance(event, proto.RtcServe) else (
                Side.OFFERER, proto.MsgType.RTC_CHAIN)
            with trio.fail_after(20):
                streams[side] = await endpoint.open_stream(side)
            await link.send(proto.Ack(of))


async def test_coordinator_relays_a_hop_and_the_peers_get_a_working_stream() -> None:
    threads = set(threading.enumerate())
    data = os.urandom(300_000)
    got_a: dict[Side, trio.abc.Stream] = {}
    got_b: dict[Side, trio.abc.Stream] = {}
    coord_a, peer_a = link_pair()
    coord_b, peer_b = link_pair()
    async with open_rtc_endpoint() as ep_a, open_rtc_endpoint() as ep_b, trio.open_nursery() as nursery:
        nursery.start_soon(serve_control, peer_a, ep_a, got_a)
        nursery.start_soon(serve_control, peer_b, ep_b, got_b)
        with trio.fail_after(30):
            await open_rtc_hop(coord_a, coord_b, hop="hop 1 (a -> b)")
        forward, inbound = got_a[Side.OFFERER], got_b[Side.ANSWERER]
        with trio.fail_after(30):
            await forward.send_all(data)
            received = bytearray()
            while len(received) < len(data):
                received += await inbound.receive_some()
            await inbound.send_all(b"token")
            assert await forward.receive_some() == b"token"
        assert received == data
        await forward.aclose()
        await inbound.aclose()
        nursery.cancel_scope.cancel()
    assert not _new_threads(threads)


class Scripted:
    """A fake peer link that answers each request from a script (or raises, or never answers)."""

    def __init__(self, *replies: object) -> None:
        self.replies = list(replies)
        self.sent: list[proto.Event] = []

    async def send(self, event: proto.Event) -> None:
        self.sent.append(event)

    async def receive(self) -> proto.Event:
        reply = self.replies.pop(0)
        if reply is None:
            await trio.sleep_forever()
        if isinstance(reply, BaseException):
            raise reply
        return reply  # type: ignore[return-value]


OFFER = proto.Signal(proto.SignalKind.OFFER, "v=0 offer")
ANSWER = proto.Signal(proto.SignalKind.ANSWER, "v=0 answer")
ACK = proto.Ack(proto.MsgType.SIGNAL)


async def test_relay_moves_opaque_blobs_in_order() -> None:
    a, b = Scripted(OFFER, ACK), Scripted(ANSWER)
    await relay_webrtc(a, b)
    assert a.sent == [proto.Signal(proto.SignalKind.OFFER), proto.Signal(proto.SignalKind.FINISH, "v=0 answer")]
    assert b.sent == [proto.Signal(proto.SignalKind.ANSWER, "v=0 offer")]


@pytest.mark.parametrize(
    ("a", "b", "reason"),
    [
        (Scripted(proto.Ack(proto.MsgType.SIGNAL, 1, "no webrtc here")), Scripted(), "the offerer failed: no webrtc"),
        (Scripted(ANSWER), Scripted(), r"expected Signal\(OFFER\) from the offerer, got Signal\(ANSWER\)"),
        (Scripted(proto.Signal(proto.SignalKind.OFFER, "")), Scripted(), "the offerer sent an empty offer"),
        (Scripted(OFFER), Scripted(proto.Pong(0)), r"expected Signal\(ANSWER\) from the answerer, got Pong"),
        (Scripted(OFFER), Scripted(trio.EndOfChannel()), "answering the offer: the control link failed"),
        (Scripted(OFFER), Scripted(proto.Error(proto.ErrorCode.SHUTTING_DOWN, "bye")), "the peer closed its link"),
        (Scripted(OFFER, proto.Ack(proto.MsgType.SIGNAL, 1, "bad answer")), Scripted(ANSWER), "applying the answer"),
    ],
)
async def test_relay_names_the_hop_and_the_step_that_failed(a: Scripted, b: Scripted, reason: str) -> None:
    with pytest.raises(SignalingError, match=f"hop 3 .*{reason}"):
        await relay_webrtc(a, b, hop="hop 3 (x -> y)")


async def test_open_rtc_hop_serves_then_chains() -> None:
    a = Scripted(OFFER, ACK, proto.Ack(proto.MsgType.RTC_CHAIN))
    b = Scripted(ANSWER, proto.Ack(proto.MsgType.RTC_SERVE))
    await open_rtc_hop(a, b, sink=True)
    assert a.sent[-1] == proto.RtcChain(True) and b.sent[-1] == proto.RtcServe()
    b = Scripted(ANSWER, proto.Ack(proto.MsgType.RTC_SERVE, 1, "channel closed before it opened"))
    with pytest.raises(SignalingError, match="inbound lane failed: channel closed"):
        await open_rtc_hop(Scripted(OFFER, ACK), b, hop="hop 2")


async def test_a_peer_that_never_answers_is_a_hop_error_within_the_callers_bound(autojump_clock) -> None:
    async def direct() -> None:
        raise OSError("connection refused")

    progress = HopProgress()

    async def rtc() -> None:
        with trio.fail_after(10):
            await open_rtc_hop(Scripted(OFFER, ACK), Scripted(None), hop="hop 2", progress=progress)

    with pytest.raises(HopError) as info:
        await climb("hop 2 (a -> b)", direct, rtc, progress=progress)
    assert str(info.value) == (
        "hop 2 (a -> b): direct dial: OSError: connection refused; "
        "webrtc: timed out while waiting for the answerer answering the offer"
    )
    assert info.value.hop == "hop 2 (a -> b)" and isinstance(info.value.direct_error, OSError)


async def test_ladder_takes_the_first_rung_that_works() -> None:
    async def ok() -> str:
        return "tcp"

    async def fail() -> str:
        raise SignalingError("no")

    async def rtc() -> str:
        return "webrtc"

    assert await climb("hop 1", ok, fail) == "tcp"
    assert await climb("hop 1", fail, rtc) == "webrtc"
    with pytest.raises(HopError, match="hop 1: direct dial: SignalingError: no; webrtc: not allowed"):
        await climb("hop 1", fail, None)


async def test_endpoint_refuses_steps_out_of_order_and_garbage_sdp() -> None:
    async with open_rtc_endpoint() as ep:
        with pytest.raises(SignalingError, match="no pending offer"):
            await ep.finish("v=0")
        with pytest.raises(SignalingError, match="no pending WebRTC connection as answerer"):
            await ep.open_stream(Side.ANSWERER)
        reply = await answer_signal(ep, proto.Signal(proto.SignalKind.ANSWER, "not an sdp"))
        assert isinstance(reply, proto.Ack) and not reply.ok
        assert "could not accept the offer: offer SDP does not start with 'v=0'" in reply.reason
        offer = await answer_signal(ep, proto.Signal(proto.SignalKind.OFFER))
        assert isinstance(offer, proto.Signal) and "a=candidate" in offer.sdp
        with pytest.raises(SignalingError, match="never got an answer"):
            await ep.open_stream(Side.OFFERER)


def test_ice_flags() -> None:
    assert IceConfig.from_flags().servers == ()
    cfg = IceConfig.from_flags(["198.18.0.1"], ["turn:198.18.0.1:3478?transport=udp"], "u", "secret")
    assert [s.url for s in cfg.servers] == ["stun:198.18.0.1", "turn:198.18.0.1:3478?transport=udp"]
    assert cfg.servers[1].username == "u" and cfg.servers[1].credential == "secret"
    assert "secret" not in repr(cfg) and "secret" not in cfg.describe()
    assert IceConfig.from_flags(["stun:stun.lan:19302"]).servers[0].url == "stun:stun.lan:19302"


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        ((["http://x"],), "--stun 'http://x': expected stun:HOST"),
        ((["stun:h:70000"],), "port 70000"),
        ((["a", "b"],), "--stun given 2 times"),
        (([], ["turn:h"]), "needs both --turn-user and --turn-pass"),
        (([], ["turn:h?transport=sctp"], "u", "p"), "expected turn:HOST"),
        (([], ["turns:h?transport=udp"], "u", "p"), "tcp only"),
        (([], [], "u", ""), "without --turn"),
    ],
)
def test_bad_ice_flags_are_named(args: tuple, reason: str) -> None:
    with pytest.raises(IceConfigError, match=reason.replace("?", r"\?")):
        IceConfig.from_flags(*args)


async def test_a_new_offer_replaces_and_closes_an_unopened_one() -> None:
    fds = len(os.listdir("/proc/self/fd"))
    async with open_rtc_endpoint() as ep:
        await ep.make_offer()
        with_one = len(os.listdir("/proc/self/fd"))
        await ep.make_offer()
        await ep.make_offer()
        assert len(os.listdir("/proc/self/fd")) == with_one  # the replaced offers' sockets are closed
    assert len(os.listdir("/proc/self/fd")) == fds
