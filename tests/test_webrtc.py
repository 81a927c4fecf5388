"""transport.webrtc: the bridge, the data channel stream, SDP checks, cancellation and clean shutdown.

Two peer connections in one process talk over 127.0.0.1; the NAT case across namespaces lives in
test_netns_webrtc.py.
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import trio
import trio.testing
import aioice.ice

from transport.webrtc import (
    ChannelError,
    DataChannelStream,
    RtcError,
    SdpError,
    accept_offer,
    check_sdp,
    make_offer,
    open_rtc_bridge,
)


def _new_threads(before: set[threading.Thread]) -> set[threading.Thread]:
    """Threads alive now that were not before: what a test left behind. Comparing counts would also see a thread
    of an earlier test ending meanwhile (trio's idle worker threads exit after ~10 s), which on a busy box made
    the count drop mid-test."""
    return set(threading.enumerate()) - before


@pytest.fixture(autouse=True)
def loopback_host_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """aioice leaves 127.0.0.1 out of its host candidates (a real peer never wants it). In-process tests want exactly
    that address: the same on every machine, independent of its interfaces, nothing sent on a real network."""
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])


def _fds() -> set[tuple[str, str]]:
    """Open descriptors as (number, what it points at)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:            # closed meanwhile (the listing's own descriptor, or another thread's)
            pass
    return out


def _new_fds(before: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """Descriptors open now that were not before: what a test left open. Comparing counts would also see an earlier
    test's leftover closing meanwhile (its socket collected, a process reaped), as with threads."""
    return _fds() - before


async def _pair(bridge_a, bridge_b) -> tuple[DataChannelStream, DataChannelStream]:
    with trio.fail_after(20):
        offerer = await make_offer(bridge_a)
        answerer = await accept_offer(bridge_b, offerer.local_sdp)
        await offerer.finish(answerer.local_sdp)
        return await offerer.open_stream(), await answerer.open_stream()


async def test_data_channel_passes_check_two_way_stream() -> None:
    async with open_rtc_bridge() as a, open_rtc_bridge() as b:
        await trio.testing.check_two_way_stream(lambda: _pair(a, b), None)


async def test_megabytes_cross_byte_exact_and_nothing_is_left_behind() -> None:
    threads, fds = set(threading.enumerate()), _fds()
    data = os.urandom(3 * 1024 * 1024 + 17)  # not a multiple of the 64 KiB chunk
    async with open_rtc_bridge() as a, open_rtc_bridge() as b:
        s1, s2 = await _pair(a, b)

        async def echo() -> None:
            while chunk := await s2.receive_some(100_000):
                await s2.send_all(chunk)
            await s2.aclose()

        got = bytearray()
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(echo)
                nursery.start_soon(s1.send_all, data)
                while len(got) < len(data):
                    got += await s1.receive_some()
                await s1.aclose()
        assert got == data
    assert not _new_threads(threads)
    assert not _new_fds(fds)


async def test_data_sent_before_the_answerer_opens_its_stream_is_kept() -> None:
    async with open_rtc_bridge() as a, open_rtc_bridge() as b:
        with trio.fail_after(20):
            offerer = await make_offer(a)
            answerer = await accept_offer(b, offerer.local_sdp)
            await offerer.finish(answerer.local_sdp)
            s1 = await offerer.open_stream()
            await s1.send_all(b"early bytes")
            await s1.aclose()  # closed before the other side even looked
            s2 = await answerer.open_stream()
            got = bytearray()
            while chunk := await s2.receive_some():
                got += chunk
        assert got == b"early bytes"
        await s2.aclose()


async def test_cancelling_a_call_cancels_the_asyncio_task() -> None:
    unwound = []
    started = trio.Event()
    token = trio.lowlevel.current_trio_token()

    async def forever() -> None:
        token.run_sync_soon(started.set)
        try:
            await asyncio.Event().wait()
        finally:
            unwound.append(asyncio.current_task().cancelling())  # type: ignore[union-attr]

    async with open_rtc_bridge() as bridge:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(bridge.call, forever)
            await started.wait()
            nursery.cancel_scope.cancel()
        # The asyncio side had finished unwinding before trio saw Cancelled.
        assert unwound == [1]

        async def add(x: int, y: int) -> int:
            return x + y

        assert await bridge.call(add, 2, 3) == 5


async def test_exceptions_cross_the_bridge_and_the_thread_is_joined() -> None:
    threads = set(threading.enumerate())

    async def boom() -> None:
        raise KeyError("from asyncio")

    async with open_rtc_bridge() as bridge:
        assert len(_new_threads(threads)) == 1
        with pytest.raises(KeyError, match="from asyncio"):
            await bridge.call(boom)
    assert not _new_threads(threads)
    with pytest.raises(RtcError, match="closed"):
        await bridge.call(boom)


async def test_open_stream_waiting_for_an_answer_that_never_comes_is_cancellable() -> None:
    threads, fds = set(threading.enumerate()), _fds()
    async with open_rtc_bridge() as a, open_rtc_bridge() as b:
        offerer = await make_offer(a)
        answerer = await accept_offer(b, offerer.local_sdp)  # the offerer is never finished: ICE cannot start
        with trio.move_on_after(0.3) as scope:
            await answerer.open_stream()
        assert scope.cancelled_caught
        with pytest.raises(RtcError, match="before finish"):
            await offerer.open_stream()
    assert not _new_threads(threads)
    assert not _new_fds(fds)


async def test_a_closed_peer_connection_fails_open_stream_with_channel_error() -> None:
    async with open_rtc_bridge() as a, open_rtc_bridge() as b:
        offerer = await make_offer(a)
        answerer = await accept_offer(b, offerer.local_sdp)
        await offerer.finish(answerer.local_sdp)
        await offerer.aclose()
        with pytest.raises(ChannelError, match="closed"):
            with trio.fail_after(20):
                await offerer.open_stream()


GOOD_OFFER_LINES = [
    "v=0",
    "o=- 1 1 IN IP4 0.0.0.0",
    "s=-",
    "t=0 0",
    "m=application 9 UDP/DTLS/SCTP webrtc-datachannel",
    "c=IN IP4 198.18.0.5",
    "a=mid:0",
    "a=sctp-port:5000",
    "a=max-message-size:65536",
    "a=candidate:1 1 udp 2130706431 198.18.0.5 40000 typ host",
    "a=ice-ufrag:abcd",
    "a=ice-pwd:abcdefghijklmnopqrstuv",
    "a=fingerprint:sha-256 " + ":".join(["AB"] * 32),
    "a=setup:actpass",
]


def _sdp(drop: str | None = None, extra: list[str] | None = None) -> str:
    lines = [line for line in GOOD_OFFER_LINES if drop is None or not line.startswith(drop)]
    return "\r\n".join(lines + (extra or [])) + "\r\n"


def test_check_sdp_accepts_a_minimal_data_channel_offer() -> None:
    summary = check_sdp(_sdp(), "offer")
    assert summary.candidates == 1 and summary.max_message_size == 65536


@pytest.mark.parametrize(
    ("sdp", "reason"),
    [
        ("", "empty"),
        ("hello there", "does not start with 'v=0'"),
        (b"v=0", "must be text"),
        ("v=0\r\n" + "a=x\r\n" * 20000, "over the"),
        (_sdp(drop="a=candidate"), "no ICE candidates"),
        (_sdp(drop="a=ice-pwd"), "lacks ICE credentials"),
        (_sdp(drop="a=fingerprint"), "lacks a DTLS fingerprint"),
        (_sdp(drop="m="), "0 data channel"),
        (_sdp(extra=["m=audio 9 UDP/TLS/RTP/SAVPF 0"]), "media sections"),
        ("v=0\r\nm=application 9\r\n", "does not parse"),
    ],
)
def test_check_sdp_names_what_is_wrong(sdp: object, reason: str) -> None:
    with pytest.raises(SdpError, match=reason):
        check_sdp(sdp, "offer")


async def test_garbage_sdp_is_refused_before_aiortc_sees_it() -> None:
    async with open_rtc_bridge() as bridge:
        with pytest.raises(SdpError, match="offer SDP does not start"):
            await accept_offer(bridge, "garbage")
        offerer = await make_offer(bridge)
        with pytest.raises(SdpError, match="answer SDP has no ICE candidates"):
            await offerer.finish(_sdp(drop="a=candidate"))
        # An offer handed back where an answer belongs parses, but the WebRTC stack refuses it; named, not raw.
        with pytest.raises(SdpError, match="rejected"):
            await offerer.finish(offerer.local_sdp)


async def test_no_ice_server_is_used_unless_configured() -> None:
    async with open_rtc_bridge() as bridge:
        offerer = await make_offer(bridge)
        kinds = {line.split(" typ ")[1].split()[0] for line in offerer.local_sdp.splitlines() if " typ " in line}
        assert kinds <= {"host"}  # aiortc's default would have added a Google STUN (srflx) candidate
        await offerer.aclose()


async def test_a_remote_connection_closing_mid_stream_ends_the_local_stream() -> None:
    async with open_rtc_bridge() as a, open_rtc_bridge() as b:
        with trio.fail_after(20):
            offerer = await make_offer(a)
            answerer = await accept_offer(b, offerer.local_sdp)
            await offerer.finish(answerer.local_sdp)
            local = await offerer.open_stream()
            remote = await answerer.open_stream()  # held: a collected stream closes its socket, and the channel
            await local.send_all(b"x" * 100_000)
        await answerer.aclose()  # the whole remote connection goes, not just its stream
        with trio.fail_after(10):
            assert await local.receive_some() == b""
            with pytest.raises(trio.BrokenResourceError):
                while True:
                    await local.send_all(b"y" * 1000)
        await local.aclose()
        await remote.aclose()


async def test_a_call_that_is_not_a_coroutine_function_fails_instead_of_hanging() -> None:
    async with open_rtc_bridge() as bridge:
        with trio.fail_after(5), pytest.raises(TypeError):
            await bridge.call(len, "not awaitable")  # type: ignore[arg-type]


async def test_a_text_message_ends_the_byte_channel() -> None:
    async with open_rtc_bridge() as a, open_rtc_bridge() as b:
        with trio.fail_after(20):
            offerer = await make_offer(a)
            answerer = await accept_offer(b, offerer.local_sdp)
            await offerer.finish(answerer.local_sdp)
            local, remote = await offerer.open_stream(), await answerer.open_stream()
            await remote.send_all(b"bytes first")

            async def send_text() -> None:  # what a browser peer could do; our streams never send text
                answerer._peer.channel.send("some text")

            await b.call(send_text)
            got = bytearray()
            while chunk := await local.receive_some():
                got += chunk
        assert got == b"bytes first"
        await local.aclose()
        await remote.aclose()
