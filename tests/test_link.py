"""mesh.link over in-memory streams: handshake, auth failures, heartbeats, flow control, bad peers. No sleeps:
virtual time (autojump_clock) where time matters."""
from __future__ import annotations

import os
import secrets
import select
from contextlib import asynccontextmanager

import pytest

import trio
import trio.testing

import mesh.link as link_mod
import mesh.proto as p
from mesh.link import AuthFailed, LinkClosed, LinkDead, ProtocolViolation, RemoteError, open_link
from mesh.proto.codec import HEADER

TOKEN = b"fleet-token-for-tests-0123456789"


@asynccontextmanager
async def link_pair(client_token=TOKEN, server_token=TOKEN, **kw):
    """(client link, server link) over one memory stream pair."""
    left, right = trio.testing.memory_stream_pair()
    got = trio.open_memory_channel(1)
    async with trio.open_nursery() as nursery:
        async def server() -> None:
            async with open_link(right, token=server_token, role="server", **kw) as link:
                await got[0].send(link)
                await trio.sleep_forever()

        nursery.start_soon(server)
        async with open_link(left, token=client_token, role="client", **kw) as client:
            yield client, await got[1].receive()
        nursery.cancel_scope.cancel()


class Raw:
    """A hand-driven peer: a Codec on the bare stream, for peers that misbehave on purpose."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.codec = p.Codec()

    async def send(self, *events) -> None:
        await self.stream.send_all(b"".join(self.codec.send(e) for e in events))

    async def receive(self):
        while (ev := self.codec.next_event()) is p.NEED_DATA:
            self.codec.receive_data(await self.stream.receive_some(65536))
        return ev

    async def handshake_as_server(self, token=TOKEN):
        hs = p.ServerHandshake(token, secrets.token_bytes(32))
        while not hs.done:
            replies = hs.receive(await self.receive())
            out = b""
            for reply in [*replies, *([p.WindowUpdate(1 << 20)] if hs.done else [])]:
                out += self.codec.send(reply)
                if isinstance(reply, p.Welcome):   # the last frame in the clear: everything after it is sealed
                    self.codec.seal(hs.keys.send, hs.keys.receive)
            await self.stream.send_all(out)
        await self.receive_until(p.WindowUpdate)  # the client's grant ends its handshake

    async def receive_until(self, cls):
        while not isinstance(ev := await self.receive(), cls):
            assert ev is not p.EOF, f"EOF before {cls.__name__}"
        return ev


async def test_events_both_ways_and_clean_close():
    async with link_pair() as (client, server):
        assert client.peer_version == server.peer_version == p.PROTOCOL_VERSION
        act = p.Activation("f32", (1, 2), b"\x00\x00\x80\x3f\x00\x00\x00\xc0")
        await client.send(p.Step(1, 0, 5, (), act))
        assert await server.receive() == p.Step(1, 0, 5, (), act)
        await server.send(p.Tokens(1, (42,)))
        assert await client.receive() == p.Tokens(1, (42,))
        await client.aclose()
        with pytest.raises(LinkClosed, match="shut the link down"):
            await server.receive()
        with pytest.raises(LinkClosed):
            await client.send(p.Reset())


async def test_open_fleet_without_tokens():
    async with link_pair(None, None) as (client, server):
        await server.send(p.InfoRequest())
        assert await client.receive() == p.InfoRequest()


async def test_remote_error_is_raised_and_the_link_goes_on():
    async with link_pair() as (client, server):
        await server.send(p.Error(p.ErrorCode.BAD_REQUEST, "layer range 9..3 is empty"))
        await server.send(p.Ack(p.MsgType.LOAD))
        with pytest.raises(RemoteError, match="9..3 is empty") as exc:
            await client.receive()
        assert exc.value.code == p.ErrorCode.BAD_REQUEST
        assert await client.receive() == p.Ack(p.MsgType.LOAD)


async def _handshake_outcome(client_token, server_token):
    left, right = trio.testing.memory_stream_pair()
    outcome = {}

    async def side(name, stream, token, role):
        try:
            async with open_link(stream, token=token, role=role):
                outcome[name] = "ok"
        except AuthFailed as exc:
            outcome[name] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, "server", right, server_token, "server")
        nursery.start_soon(side, "client", left, client_token, "client")
    return outcome


async def test_wrong_token_fails_on_both_sides():
    out = await _handshake_outcome(b"not the fleet token", TOKEN)
    assert out["client"].code == p.ErrorCode.AUTH_FAILED and "mismatch" in out["client"].reason
    # The client proves first: its sealed proof does not open with the server's key, and the server's sealed refusal
    # does not open with the client's.
    assert out["server"].code == p.ErrorCode.AUTH_FAILED and "mismatch" in out["server"].reason


async def test_missing_token_on_the_client():
    out = await _handshake_outcome(None, TOKEN)
    assert out["server"].code == p.ErrorCode.AUTH_REQUIRED
    assert "requires a fleet token" in out["client"].reason


async def test_missing_token_on_the_server():
    out = await _handshake_outcome(TOKEN, None)
    assert "has none" in out["server"].reason and "has none" in out["client"].reason


class Recorder(trio.abc.Stream):
    """Passes through, remembering every byte sent."""

    def __init__(self, inner) -> None:
        self.inner, self.sent = inner, b""

    async def send_all(self, data) -> None:
        self.sent += bytes(data)
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None):
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_recorded_handshake_replayed_on_a_new_connection_fails():
    left, right = trio.testing.memory_stream_pair()
    rec = Recorder(left)
    async with trio.open_nursery() as nursery:
        async def server():
            async with open_link(right, token=TOKEN, role="server"):
                pass
        nursery.start_soon(server)
        async with open_link(rec, token=TOKEN, role="client"):
            pass
    # The client's first two frames: Hello (clear) and its sealed AuthProof.
    hello_len = HEADER.size + HEADER.unpack_from(rec.sent)[3]
    proof_len = HEADER.size + HEADER.unpack_from(rec.sent, hello_len)[3]
    hello_and_proof = rec.sent[:hello_len + proof_len]
    assert HEADER.unpack_from(rec.sent, hello_len)[1] == p.MsgType.SEALED

    left, right = trio.testing.memory_stream_pair()
    await left.send_all(hello_and_proof)  # a memory stream buffers it all
    with pytest.raises(AuthFailed, match="mismatch"):   # a fresh key exchange: the old proof does not even open
        async with open_link(right, token=TOKEN, role="server"):
            pass
    raw = Raw(left)
    assert isinstance(await raw.receive(), p.Welcome)
    assert TOKEN not in hello_and_proof


async def test_non_auth_first_message_on_a_tokened_fleet():
    left, right = trio.testing.memory_stream_pair()
    raw = Raw(left)
    await raw.send(p.Step(0, 0, 0, (1, 2, 3)))
    with pytest.raises(AuthFailed, match="first message must be Hello") as exc:
        async with open_link(right, token=TOKEN, role="server"):
            pass
    assert exc.value.code == p.ErrorCode.AUTH_REQUIRED
    err = await raw.receive()
    assert err == p.Error(p.ErrorCode.AUTH_REQUIRED, "the first message must be Hello, got Step")
    assert await raw.receive() is p.EOF


async def test_websocket_bytes_get_an_error_not_a_crash():
    left, right = trio.testing.memory_stream_pair()
    await left.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    with pytest.raises(ProtocolViolation) as exc:
        async with open_link(right, token=None, role="server"):
            pass
    assert exc.value.code == p.ErrorCode.UNSUPPORTED_VERSION


async def test_heartbeats_keep_an_idle_link_alive(autojump_clock):
    async with link_pair() as (client, server):
        await trio.sleep(60)  # virtual: twelve times dead_after, with pings every second
        await client.send(p.Reset())
        assert await server.receive() == p.Reset()
        assert client.rtt is not None and server.rtt is not None


async def test_silent_peer_is_declared_dead(autojump_clock):
    left, right = trio.testing.memory_stream_pair()
    raw = Raw(right)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(raw.handshake_as_server)
        async with open_link(left, token=TOKEN, role="client", ping_interval=1.0, dead_after=5.0) as link:
            start = trio.current_time()
            with pytest.raises(LinkDead, match="5s"):
                await link.receive()  # the raw peer never answers a ping
            assert 5.0 <= trio.current_time() - start < 5.5
            with pytest.raises(LinkDead):
                await link.send(p.Reset())


async def test_dead_peer_unblocks_a_sender_stuck_on_a_full_pipe(autojump_clock):
    left, right = trio.testing.lockstep_stream_pair()  # no buffering: a send blocks until the peer reads
    raw = Raw(right)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(raw.handshake_as_server)
        async with open_link(left, token=TOKEN, role="client") as link:
            with pytest.raises(LinkDead):
                await link.send(p.ShipChunk(0, bytes(1000)))


async def test_slow_reader_blocks_the_writer_at_the_window(autojump_clock):
    window, chunk = 64 * 1024, 1000
    async with link_pair(window=window) as (client, server):
        sent = 0

        async def writer():
            nonlocal sent
            for i in range(200):
                await client.send(p.ShipChunk(i * chunk, bytes(chunk)))
                sent += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            await trio.sleep(10)  # virtual; the reader does not read
            frame = len(p.Codec().send(p.ShipChunk(0, bytes(chunk)))) + p.SEAL_OVERHEAD
            assert 0 < sent < 200
            assert (sent - 1) * frame < window <= sent * frame  # stopped at the window, overshoot < one frame
            assert server._flow.buffered() == sent * frame <= window + frame
            got = [await server.receive() for _ in range(200)]
        assert sent == 200 and [e.offset for e in got] == [i * chunk for i in range(200)]


async def test_peer_overrunning_its_credit_is_cut_off():
    left, right = trio.testing.memory_stream_pair()
    raw = Raw(right)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(raw.handshake_as_server)
        async with open_link(left, token=TOKEN, role="client", window=4096, max_frame=4096) as link:
            await raw.send(*[p.ShipChunk(0, bytes(1000)) for _ in range(10)])  # granted 4096
            for _ in range(7):  # what fits in window + one frame is delivered (sealed frames of 1037 bytes)
                await link.receive()
            with pytest.raises(ProtocolViolation) as exc:
                await link.receive()
            assert exc.value.code == p.ErrorCode.FLOW_CONTROL
    err = await raw.receive_until(p.Error)
    assert err.code == p.ErrorCode.FLOW_CONTROL


async def test_garbage_mid_link_closes_that_link_only():
    async with link_pair() as (a_client, a_server), link_pair() as (b_client, b_server):
        await a_client.stream.send_all(HEADER.pack(p.PROTOCOL_VERSION, 250, 0, 0))  # a clear frame, under its feet
        with pytest.raises(ProtocolViolation, match="in the clear on a sealed connection"):
            await a_server.receive()
        with pytest.raises((RemoteError, LinkClosed)):
            await a_client.receive()
        await b_client.send(p.Reset())
        assert await b_server.receive() == p.Reset()


async def test_handshake_messages_after_the_handshake_are_refused():
    async with link_pair() as (client, server):
        await client.send(p.Hello(2, 2, bytes(32), bytes(32), False))
        with pytest.raises(ProtocolViolation, match="Hello after the handshake"):
            await server.receive()


async def test_wait_failed_reports_why_the_link_ended(autojump_clock):
    async with link_pair() as (client, server):
        async with trio.open_nursery() as nursery:
            why = []

            async def watch():
                why.append(await server.wait_failed())

            nursery.start_soon(watch)
            await trio.sleep(30)  # virtual: an idle link stays up
            assert why == []
            await client.aclose()
        assert isinstance(why[0], LinkClosed) and "shut the link down" in str(why[0])


async def test_an_error_in_the_body_leaves_as_itself_not_as_a_group():
    """`except LinkError` around `open_link` must work: the link's own nursery may not wrap the caller's error."""
    left, right = trio.testing.memory_stream_pair()

    async def server() -> None:
        async with open_link(right, token=TOKEN, role="server"):
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server)
        with pytest.raises(LinkClosed, match="gone") as caught:
            async with open_link(left, token=TOKEN, role="client"):
                raise LinkClosed("gone")
        assert type(caught.value) is LinkClosed
        nursery.cancel_scope.cancel()


async def test_take_consumes_events_in_the_reader_and_returns_their_credit():
    """A `take` hook sees each flow-controlled event that arrives on an empty queue, in the reader; what it keeps
    never reaches receive(), and its bytes are credited back (a writer far past the window is not stalled)."""
    window, chunk = 64 * 1024, 1000
    async with link_pair(window=window) as (client, server):
        taken = []
        server.take = lambda ev: isinstance(ev, p.ShipChunk) and not taken.append(ev.offset)
        with trio.fail_after(10):
            for i in range(200):                    # ~3x the window: only returned credit lets these through
                await client.send(p.ShipChunk(i * chunk, bytes(chunk)))
            await client.send(p.Ack(p.MsgType.LOAD))    # not taken: queued for receive()
            assert await server.receive() == p.Ack(p.MsgType.LOAD)
        assert taken == [i * chunk for i in range(200)]


async def test_take_is_not_offered_errors_nor_events_behind_queued_ones():
    async with link_pair() as (client, server):
        offered = []
        server.take = lambda ev: offered.append(ev) and False
        await client.send(p.Error(p.ErrorCode.BAD_REQUEST, "no"))
        await client.send(p.Ack(p.MsgType.LOAD, 1))       # the Error is still queued: not offered
        await trio.testing.wait_all_tasks_blocked()        # both read before anything is received
        with trio.fail_after(10):
            with pytest.raises(RemoteError):
                await server.receive()
            assert await server.receive() == p.Ack(p.MsgType.LOAD, 1)
            await client.send(p.Ack(p.MsgType.LOAD, 2))    # the queue is empty now: offered, then queued
            assert await server.receive() == p.Ack(p.MsgType.LOAD, 2)
        assert offered == [p.Ack(p.MsgType.LOAD, 2)]


@asynccontextmanager
async def socket_link_pair(**kw):
    """(client link, server link) over a connected pair of trio sockets (TCP streams as `send_nowait` needs)."""
    a, b = trio.socket.socketpair()
    got = trio.open_memory_channel(1)
    async with trio.open_nursery() as nursery:
        async def server() -> None:
            async with open_link(trio.SocketStream(b), token=TOKEN, role="server", **kw) as link:
                await got[0].send(link)
                await trio.sleep_forever()

        nursery.start_soon(server)
        async with open_link(trio.SocketStream(a), token=TOKEN, role="client", **kw) as client:
            yield client, await got[1].receive()
        nursery.cancel_scope.cancel()


async def test_send_nowait_writes_from_sync_code_and_a_partial_frame_goes_out_before_the_next():
    """send_nowait writes a frame without yielding. What the socket does not take at once (a frame larger than its
    buffer, the reader not reading yet) goes out, whole and first, before any frame sent after it."""
    big = bytes(range(256)) * 16 * 1024                     # 4 MiB: more than a socket buffer takes at once
    async with socket_link_pair() as (client, server):
        with trio.fail_after(20):
            await trio.testing.wait_all_tasks_blocked()     # the handshake's credit has arrived, no write runs
            assert client.send_nowait(p.Ack(p.MsgType.LOAD, 1))
            assert await server.receive() == p.Ack(p.MsgType.LOAD, 1)
            assert client.send_nowait(p.ShipChunk(0, big))
            assert client._tail                              # the rest waits for the control task
            assert not client.send_nowait(p.Ack(p.MsgType.LOAD, 2))    # nothing may overtake it: refused
            await client.send(p.Ack(p.MsgType.LOAD, 3))     # an ordinary send: after the tail
            got = await server.receive()
            assert isinstance(got, p.ShipChunk) and bytes(got.data) == big
            assert await server.receive() == p.Ack(p.MsgType.LOAD, 3)
            assert not client._tail


async def test_a_frame_written_whole_from_sync_code_hands_the_cpu_on_once(monkeypatch):
    """After a hop's frame is written whole (send_nowait, send_plain_nowait) the writer yields once, so a receiver
    queued on its CPU runs first (common/handoff.py); a frame the socket took only part of yields nothing (its tail
    goes out later), and neither does an ordinary send. MESH_WRITE_YIELD=0 turns the yield off."""
    from common import handoff
    calls = []
    monkeypatch.setattr(handoff, "YIELD", True)
    monkeypatch.setattr(handoff.os, "sched_yield", lambda: calls.append(1), raising=False)
    big = bytes(range(256)) * 16 * 1024
    async with socket_link_pair() as (client, server):
        with trio.fail_after(20):
            await trio.testing.wait_all_tasks_blocked()
            assert client.send_nowait(p.Ack(p.MsgType.LOAD, 1)) and calls == [1]
            assert await server.receive() == p.Ack(p.MsgType.LOAD, 1)
            await client.send(p.Ack(p.MsgType.LOAD, 2))
            assert await server.receive() == p.Ack(p.MsgType.LOAD, 2) and calls == [1]
            assert client.send_nowait(p.ShipChunk(0, big)) and client._tail and calls == [1]
            assert bytes((await server.receive()).data) == big
            await trio.testing.wait_all_tasks_blocked()
            monkeypatch.setattr(handoff, "YIELD", False)
            assert client.send_nowait(p.Ack(p.MsgType.LOAD, 3)) and calls == [1]
            assert await server.receive() == p.Ack(p.MsgType.LOAD, 3)
    assert handoff.enabled({}) == hasattr(os, "sched_yield")
    assert not handoff.enabled({handoff.ENV: "0"})


async def test_send_nowait_declines_what_it_cannot_write_at_once():
    async with link_pair() as (client, server):            # a memory stream: not a socket
        assert not client.send_nowait(p.Ack(p.MsgType.LOAD))
        assert not client.send_nowait(p.Ping(1))           # not flow-controlled: never
        await client.send(p.Ack(p.MsgType.LOAD, 4))
        assert await server.receive() == p.Ack(p.MsgType.LOAD, 4)


@pytest.mark.parametrize("spin", [0.0, 0.002])
async def test_a_hot_link_reads_in_a_blocking_wait_and_the_process_other_sockets_are_still_served(monkeypatch, spin):
    """`Link.hot`: after `take` consumed an event, the reader waits for the next bytes in a blocking poll (while no
    other task is runnable) instead of trio's loop; frames arrive in order and whole, and another link of the same
    thread still sends and receives meanwhile (its bytes end the blocking wait, or wait at most HOT_BLOCK). With
    `SPIN` the wait polls without sleeping first: the same events, the other link still served."""
    monkeypatch.setattr(link_mod, "HOT_WINDOW", 60.0)      # hot however slowly a loaded machine runs this
    monkeypatch.setattr(link_mod, "SPIN", spin)
    async with socket_link_pair() as (a, b), socket_link_pair() as (c, d):
        taken_in, taken_out = trio.open_memory_channel(16)
        b.take = lambda ev: (taken_in.send_nowait(ev), True)[1]
        b.hot = True
        with trio.fail_after(20):
            for i in range(6):
                await a.send(p.Ack(p.MsgType.LOAD, i))
                assert await taken_out.receive() == p.Ack(p.MsgType.LOAD, i)
                await c.send(p.Ack(p.MsgType.VOCAB, i))         # the other link, while b's reader is hot
                assert await d.receive() == p.Ack(p.MsgType.VOCAB, i)
            await a.send(p.ShipChunk(0, bytes(range(256)) * 4096))   # 1 MiB: several reads, joined whole
            got = await taken_out.receive()
            assert isinstance(got, p.ShipChunk) and bytes(got.data) == bytes(range(256)) * 4096
        assert b.hot_reads >= 5          # every event after the first came through the blocking wait
        b.hot = False


def test_the_spin_setting_is_microseconds_and_a_bad_one_is_named():
    assert link_mod.spin_from_env({}) == 0.0
    assert link_mod.spin_from_env({"MESH_SPIN_US": "250"}) == pytest.approx(250e-6)
    for bad in ("fast", "-1", "nan", "1e9"):
        with pytest.raises(ValueError, match=f"MESH_SPIN_US={bad!r}: expected microseconds"):
            link_mod.spin_from_env({"MESH_SPIN_US": bad})


def pumped_events(link):
    """The consumer side of `Link.pump` as the coordinator's sink has it: `take` feeds a channel; the function
    returned gives the next event, pumping the link while the channel is empty."""
    got_in, got_out = trio.open_memory_channel(16)
    link.take = lambda ev: (got_in.send_nowait(ev), True)[1]

    async def next_event():
        while True:
            try:
                return got_out.receive_nowait()
            except trio.WouldBlock:
                pass
            if not await link.pump():
                return await got_out.receive()
    return next_event


@pytest.mark.parametrize("spin", [0.0, 0.002])
async def test_pump_reads_the_next_bytes_in_the_consumers_task(monkeypatch, spin):
    """`Link.pump`: a consumer fed by `take` (the coordinator's sink) reads the link's next bytes in its own task
    by the hot wait while the reader task stays parked in its socket wait: events arrive in order and whole (what
    the reader took meanwhile too), nothing is pumped before the link is hot (no `take` yet), and an ended link is
    reported as the reader would (the pump says False, wait_failed names it). With and without `SPIN`."""
    monkeypatch.setattr(link_mod, "HOT_WINDOW", 60.0)      # hot however slowly a loaded machine runs this
    monkeypatch.setattr(link_mod, "SPIN", spin)
    async with socket_link_pair() as (a, b), socket_link_pair() as (c, d):
        next_event = pumped_events(b)
        assert not await b.pump()           # no event taken yet: not hot

        with trio.fail_after(20):
            await a.send(p.Ack(p.MsgType.LOAD, 0))
            assert await next_event() == p.Ack(p.MsgType.LOAD, 0)
            before = b.hot_reads
            for i in range(1, 6):
                # Every task parked first (the other link's reader and writers, b's credit owed), then written
                # without a checkpoint: b's reader has had no chance at these bytes, and the pump finds nothing
                # runnable that would send it through trio's loop, where the reader could take them.
                await trio.testing.wait_all_tasks_blocked()
                assert a.send_nowait(p.Ack(p.MsgType.LOAD, i))
                assert await next_event() == p.Ack(p.MsgType.LOAD, i)
                await c.send(p.Ack(p.MsgType.VOCAB, i))         # the other link of the thread, between two pumps
                assert await d.receive() == p.Ack(p.MsgType.VOCAB, i)
            await a.send(p.ShipChunk(0, bytes(range(256)) * 4096))   # 1 MiB: several reads, joined whole
            got = await next_event()
            assert isinstance(got, p.ShipChunk) and bytes(got.data) == bytes(range(256)) * 4096
            assert b.hot_reads >= before + 5    # read by the pump, not by the reader task
            await a.aclose()
            assert not await b.pump()
            assert isinstance(await b.wait_failed(), link_mod.LinkClosed)


async def test_a_pump_does_not_block_before_the_tasks_woken_with_its_consumer_have_run(monkeypatch):
    """A task woken in the same batch as the pump's consumer is in neither trio's run queue nor its socket waits
    while the consumer runs: a pump that blocked at once waited for the poll's deadline when the bytes it wanted
    needed that task (one stream through an in-process chain ran at 5-12 tok/s). Here the writer of the next event
    and the consumer wake from one Event; trio runs a batch in either order, so 12 rounds meet both orders (the
    old pump's poll waited for a deadline in some of them: this test fails on it)."""
    monkeypatch.setattr(link_mod, "HOT_WINDOW", 60.0)      # hot however slowly a loaded machine runs this
    waited_out = []     # blocking polls that ended with nothing ready (the old pump's, until a heartbeat was due)
    real_poll = select.poll

    class Poll:
        def __init__(self):
            self.inner = real_poll()
            self.register = self.inner.register

        def poll(self, ms=None):
            ready = self.inner.poll(ms)
            if ms and not ready:
                waited_out.append(ms)
            return ready
    monkeypatch.setattr(link_mod.select, "poll", Poll)
    async with socket_link_pair() as (a, b):
        next_event = pumped_events(b)

        with trio.fail_after(20):
            await a.send(p.Ack(p.MsgType.LOAD, 0))
            assert await next_event() == p.Ack(p.MsgType.LOAD, 0)     # taken: the link is hot
            for i in range(1, 13):
                go = trio.Event()

                async def writer(i=i, go=go):
                    await go.wait()
                    assert a.send_nowait(p.Ack(p.MsgType.LOAD, i))

                async def setter(go=go):
                    await trio.testing.wait_all_tasks_blocked()
                    go.set()        # wakes this task and the writer together

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(writer)
                    nursery.start_soon(setter)
                    await go.wait()
                    assert await next_event() == p.Ack(p.MsgType.LOAD, i)
    assert not waited_out


class _HoldingStream(trio.abc.Stream):
    """A TCP stream whose receive_some, once armed, keeps what it read until released: what trio's own receive_some
    does for a pass of the scheduler after a read that succeeds at once."""

    def __init__(self, inner: trio.SocketStream) -> None:
        self.transport_stream = inner
        self.armed, self.holding, self.release = False, trio.Event(), trio.Event()

    async def send_all(self, data) -> None:
        await self.transport_stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport_stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None):
        data = await self.transport_stream.receive_some(max_bytes)
        if self.armed:
            self.holding.set()
            await self.release.wait()
        return data

    async def aclose(self) -> None:
        await self.transport_stream.aclose()


async def test_the_reader_never_holds_bytes_while_a_pump_reads_later_ones(monkeypatch):
    """The coordinator's sink is read by its reader task and pumped by the decode loop. The reader must not hold
    bytes it read across a pass of the scheduler (trio's receive_some does, after a read that succeeds at once):
    the pump would read the next frame and open it first, out of order, and the sealed link would fail
    (AUTH_FAILED, seen in CI). A TCP link's reader reads the socket itself: every frame arrives, in order."""
    monkeypatch.setattr(link_mod, "HOT_WINDOW", 60.0)      # hot however slowly a loaded machine runs this
    a_sock, b_sock = trio.socket.socketpair()
    held = _HoldingStream(trio.SocketStream(b_sock))
    got_in, got_out = trio.open_memory_channel(16)
    async with trio.open_nursery() as nursery:
        links = trio.open_memory_channel(1)

        async def server() -> None:
            async with open_link(held, token=TOKEN, role="server") as link:
                await links[0].send(link)
                await trio.sleep_forever()
        nursery.start_soon(server)
        async with open_link(trio.SocketStream(a_sock), token=TOKEN, role="client") as a:
            b = await links[1].receive()
            b.take = lambda ev: (got_in.send_nowait(ev), True)[1]
            with trio.fail_after(20):
                await a.send(p.Ack(p.MsgType.LOAD, 0))
                assert await got_out.receive() == p.Ack(p.MsgType.LOAD, 0)    # taken: the link is hot
                held.armed = True
                await trio.testing.wait_all_tasks_blocked()
                assert a.send_nowait(p.Ack(p.MsgType.LOAD, 1))
                await trio.testing.wait_all_tasks_blocked()     # read by b's reader (held there, if it may be)
                assert a.send_nowait(p.Ack(p.MsgType.LOAD, 2))  # no checkpoint: the pump finds nothing runnable
                pumped = await b.pump()
                held.release.set()
                await trio.testing.wait_all_tasks_blocked()
            assert b._failure is None, b._failure
            assert [got_out.receive_nowait(), got_out.receive_nowait()] == [p.Ack(p.MsgType.LOAD, 1),
                                                                            p.Ack(p.MsgType.LOAD, 2)]
            assert not held.holding.is_set() and pumped     # the reader read the socket itself; the pump, frame 2
        nursery.cancel_scope.cancel()


async def test_bytes_a_listener_peeked_at_are_read_before_the_socket_itself():
    """A listener's PrefixStream returns the bytes it peeked at first: until they are gone the link reads through
    the stream (receive_some), then from the socket itself."""
    from transport.prefix import PrefixStream
    a, b = trio.socket.socketpair()
    with a, b:
        stream = PrefixStream(trio.SocketStream(b), b"MESH")
        assert link_mod._read_fd(stream) is None
        assert await stream.receive_some(16) == b"MESH"
        assert link_mod._read_fd(stream) == b.fileno()


async def test_the_hot_wait_watches_every_socket_trios_loop_waits_on():
    """`_trio_waits` reads trio's epoll waiters (trio internals: this fails when a trio upgrade changes them, and
    the hot wait would fall back to watching the hot links alone): a task waiting to read a socket is in it, and
    so is trio's wake-up socket."""
    a, b = trio.socket.socketpair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.lowlevel.wait_readable, b)
        await trio.testing.wait_all_tasks_blocked()
        waits = link_mod._trio_waits()
        assert waits is not None and (b.fileno(), select.POLLIN) in waits and len(waits) >= 2
        nursery.cancel_scope.cancel()
    a.close()
    b.close()
