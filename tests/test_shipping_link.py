"""ship_range and serve_ship over real Links on memory stream pairs: resume, busy, re-ship, failures."""
from __future__ import annotations

import errno
import hashlib
import io
import os
import threading
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio.testing

from engine.gguf_range import LayerRangeError, plan_range_gguf
from mesh import proto
from mesh.link import open_link
from mesh.shipping import (SINK_DEPTH, ProgressBoard, ShipBusy, ShipCache, ShipFailed, ShipReceiver, serve_ship,
                           ship_range)
from tests.test_gguf_range import write_model

TOKEN = b"fleet-token"
CHUNK = 4096


@pytest.fixture
def model(tmp_path):
    return write_model(tmp_path / "model.gguf", n_layers=4, dim=64)


@pytest.fixture
def cache(tmp_path):
    return ShipCache(tmp_path / "cache")


@asynccontextmanager
async def link_pair(**kw):
    """(coordinator side, peer side) Links over one in-memory stream pair."""
    left, right = trio.testing.memory_stream_pair()
    send, receive = trio.open_memory_channel(1)
    async with trio.open_nursery() as nursery:
        async def server() -> None:
            async with open_link(right, token=TOKEN, role="server", **kw) as link:
                await send.send(link)
                await trio.sleep_forever()

        nursery.start_soon(server)
        async with open_link(left, token=TOKEN, role="client", **kw) as client:
            yield client, await receive.receive()
            nursery.cancel_scope.cancel()


async def peer_side(link, cache, results, **kw):
    """What a peer's op loop does: read the ShipBegin, hand the link to serve_ship."""
    while True:
        ev = await link.receive()
        assert isinstance(ev, proto.ShipBegin)
        results.append(await serve_ship(link, ev, cache, **kw))


class CountingWrite:
    """A write function that counts the bytes landing on disk and can fire or fail at a threshold."""

    def __init__(self, *, fire_at=None, fail_at=None):
        self.written, self.fire_at, self.fail_at = 0, fire_at, fail_at
        self.fired = threading.Event()

    def __call__(self, fd, view):
        if self.fail_at is not None and self.written >= self.fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(fd, view)
        self.written += n
        if self.fire_at is not None and self.written >= self.fire_at:
            self.fired.set()
        return n


async def ship(plan, cache, *, write=os.write, board=None):
    """One coordinator-to-peer shipment; the sender's error, if any, is raised as itself."""
    results, error = [], None
    async with link_pair() as (coord, peer), trio.open_nursery() as nursery:
        nursery.start_soon(lambda: peer_side(peer, cache, results, write=write))
        try:
            result = await ship_range(coord, plan, chunk=CHUNK,
                                      board=board or ProgressBoard(io.StringIO(), tty=False))
        except Exception as exc:
            error = exc
        nursery.cancel_scope.cancel()
    if error is not None:
        raise error
    return result, results


async def test_shipping_over_a_link_lands_the_file_and_reports_progress(model, cache, tmp_path):
    out = io.StringIO()
    plan = plan_range_gguf(model, 2, 4)
    result, paths = await ship(plan, cache, board=ProgressBoard(out, tty=False, delay=0))
    entry = cache.entry(plan.fingerprint, 2, 4)
    assert paths == [entry]
    assert (result.resumed_at, result.sent_bytes, result.attempts) == (0, plan.size, 1)
    assert hashlib.sha256(entry.read_bytes()).digest() == plan.sha256()
    last = out.getvalue().splitlines()[-1]          # tqdm's plain line: label, percent, bytes, rate
    assert last.startswith("layers 2..4: 100%") and "\r" not in out.getvalue(), last
    # The next session finds the complete entry: ShipResume(total), then just ShipEnd.
    again, paths = await ship(plan, cache)
    assert (again.resumed_at, again.sent_bytes) == (plan.size, 0) and paths == [entry]


async def test_killed_halfway_resumes_with_only_the_remainder(model, cache):
    plan = plan_range_gguf(model, 0, 4)
    half = plan.size // 2
    first = CountingWrite(fire_at=half)
    with trio.move_on_after(60) as timeout:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(ship, plan, cache, write=first))
            assert await trio.to_thread.run_sync(first.fired.wait, 30)
            nursery.cancel_scope.cancel()  # the coordinator dies mid-transfer
    assert not timeout.cancelled_caught
    part = cache.part(plan.fingerprint, 0, 4)
    held = part.stat().st_size
    assert half <= held < plan.size and not cache.entry(plan.fingerprint, 0, 4).exists()

    second = CountingWrite()
    result, paths = await ship(plan, cache, write=second)
    assert result.resumed_at == held and result.sent_bytes == plan.size - held == second.written
    assert paths == [cache.entry(plan.fingerprint, 0, 4)]
    assert hashlib.sha256(paths[0].read_bytes()).digest() == plan.sha256()


async def test_corrupted_partial_is_reshipped_from_zero(model, cache):
    plan = plan_range_gguf(model, 1, 3)
    with trio.move_on_after(60):
        w = CountingWrite(fire_at=3 * CHUNK)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(ship, plan, cache, write=w))
            assert await trio.to_thread.run_sync(w.fired.wait, 30)
            nursery.cancel_scope.cancel()
    part = cache.part(plan.fingerprint, 1, 3)
    held = part.stat().st_size
    with open(part, "r+b") as f:
        f.seek(7)
        f.write(b"\x00\xff")
    result, paths = await ship(plan, cache)
    assert result.attempts == 2 and result.resumed_at == 0
    assert result.sent_bytes == (plan.size - held) + plan.size
    assert hashlib.sha256(paths[-1].read_bytes()).digest() == plan.sha256()


async def test_second_shipper_is_refused_busy_then_succeeds(model, cache):
    plan = plan_range_gguf(model, 0, 2)
    # The first shipper: another connection that has begun and holds the target.
    first = ShipReceiver(cache)
    assert first.receive(proto.ShipBegin(plan.fingerprint, 0, 2, plan.size, plan.sha256(), plan.name)) \
        == proto.ShipResume(0)
    first.receive(proto.ShipChunk(0, plan.read(0, CHUNK)))
    with pytest.raises(ShipBusy, match="being shipped by another connection"):
        await ship(plan, cache)
    first.close()  # its connection dropped: the target is free, and its bytes are a prefix to resume from
    result, paths = await ship(plan, cache)
    assert (result.resumed_at, result.sent_bytes) == (CHUNK, plan.size - CHUNK)
    assert hashlib.sha256(paths[0].read_bytes()).digest() == plan.sha256()


async def test_full_disk_fails_clearly_and_keeps_the_partial(model, cache):
    plan = plan_range_gguf(model, 0, 4)
    with pytest.raises(ShipFailed, match="disk full; the partial is kept"):
        await ship(plan, cache, write=CountingWrite(fail_at=5 * CHUNK))
    assert cache.part(plan.fingerprint, 0, 4).stat().st_size == 5 * CHUNK
    assert not cache.entry(plan.fingerprint, 0, 4).exists()
    result, _ = await ship(plan, cache)
    assert result.resumed_at == 5 * CHUNK


async def test_wrong_hash_is_refused_and_never_renamed(model, cache):
    plan = plan_range_gguf(model, 0, 4)
    plan._sha256 = hashlib.sha256(b"something else").digest()
    with pytest.raises(ShipFailed, match="is not the announced"):
        await ship(plan, cache)
    assert not cache.entry(plan.fingerprint, 0, 4).exists()
    assert not cache.part(plan.fingerprint, 0, 4).exists()


async def test_range_outside_the_model_fails_before_anything_is_sent(model, cache):
    async with link_pair() as (coord, _peer):
        with pytest.raises(LayerRangeError, match="0..9"):
            await ship_range(coord, model, 0, 9)


class CountingLink:
    """The coordinator's Link, counting the chunk bytes it sends."""

    def __init__(self, link, on_chunk):
        self.link, self.on_chunk = link, on_chunk

    async def send(self, ev):
        await self.link.send(ev)
        if isinstance(ev, proto.ShipChunk):
            self.on_chunk(len(ev.data))

    async def receive(self):
        return await self.link.receive()


async def ship_counted(link, plan, done: trio.Event) -> None:
    """Ship `plan` over a CountingLink without a progress display, then set `done`."""
    await ship_range(link, plan, chunk=CHUNK, board=ProgressBoard(io.StringIO(), tty=False))
    done.set()


async def test_a_stalled_receiver_bounds_what_is_in_flight(model, cache):
    plan = plan_range_gguf(model, 0, 4)
    window = 8 * CHUNK
    written = CountingWrite()
    sent, worst = [0], [0]
    go, flowing = trio.Event(), trio.Event()
    plan.sha256()

    def on_chunk(n):
        sent[0] += n
        worst[0] = max(worst[0], sent[0] - written.written)
        if sent[0] >= window // 2:
            flowing.set()

    async def stalling_peer(link):
        ev = await link.receive()
        rx = ShipReceiver(cache, write=written)
        await link.send(rx.receive(ev))  # ShipResume(0); then the peer stops reading until `go`
        await go.wait()
        while not rx.done:
            reply = rx.receive(await link.receive())
            if reply is not None:
                await link.send(reply)
        rx.close()

    async with link_pair(window=window) as (coord, peer), trio.open_nursery() as nursery:
        nursery.start_soon(stalling_peer, peer)
        done = trio.Event()
        nursery.start_soon(ship_counted, CountingLink(coord, on_chunk), plan, done)
        await flowing.wait()
        for _ in range(20):  # let the sender run (its reads go through a thread) until credit stops it
            await trio.to_thread.run_sync(lambda: None)
            await trio.testing.wait_all_tasks_blocked()
        assert window // 2 <= sent[0] < plan.size and not done.is_set()
        go.set()
        await done.wait()
    # Frames cost their header too, and a frame may overrun the credit by one: the window plus one chunk.
    assert worst[0] <= window + CHUNK
    assert hashlib.sha256(cache.entry(plan.fingerprint, 0, 4).read_bytes()).digest() == plan.sha256()


async def test_a_stalled_disk_bounds_what_the_receiver_holds(model, cache):
    # serve_ship hands chunks to its writer thread without waiting for each write; a disk that stops must still
    # stop the sender, through the sink's few slots and then the Link's credit.
    plan = plan_range_gguf(model, 0, 4)
    window = 8 * CHUNK
    go = threading.Event()
    written, sent, worst = [0], [0], [0]
    plan.sha256()

    def stuck_write(fd, view):
        if written[0] >= 2 * CHUNK:
            assert go.wait(30)
        n = os.write(fd, view)
        written[0] += n
        return n

    def on_chunk(n):
        sent[0] += n
        worst[0] = max(worst[0], sent[0] - written[0])

    results = []
    with trio.fail_after(60):
        async with link_pair(window=window) as (coord, peer), trio.open_nursery() as nursery:
            nursery.start_soon(partial(peer_side, peer, cache, results, write=stuck_write))
            done = trio.Event()
            nursery.start_soon(ship_counted, CountingLink(coord, on_chunk), plan, done)
            # Let both sides run until the stuck write holds everything up (however slow the threads are on a
            # loaded machine; the fail_after bounds it), then some more: the sender must stay stopped.
            while not (written[0] == 2 * CHUNK and sent[0] >= window):
                await trio.to_thread.run_sync(lambda: None)
                await trio.testing.wait_all_tasks_blocked()
            for _ in range(30):
                await trio.to_thread.run_sync(lambda: None)
                await trio.testing.wait_all_tasks_blocked()
            stalled_at = sent[0]
            assert written[0] == 2 * CHUNK and window <= stalled_at < plan.size and not done.is_set()
            go.set()
            await done.wait()
            nursery.cancel_scope.cancel()
    # The Link's window (plus one frame of overrun) and the sink's slots, each a chunk.
    assert worst[0] <= window + (SINK_DEPTH + 1) * CHUNK
    assert results == [cache.entry(plan.fingerprint, 0, 4)]
    assert hashlib.sha256(results[0].read_bytes()).digest() == plan.sha256()


@pytest.mark.parametrize("answer,why", [
    (proto.ShipResume(10**9), "expected ShipResume within"),
    (proto.Error(proto.ErrorCode.BAD_REQUEST, "fingerprint '..' is not a safe cache directory name"),
     "refused the shipment: fingerprint"),
    (proto.Ack(proto.MsgType.LOAD, 0, ""), "expected ShipResume"),
])
async def test_a_wrong_answer_to_ship_begin_fails_clearly(model, answer, why):
    plan = plan_range_gguf(model, 0, 2)
    async with link_pair() as (coord, peer):
        async def bad_peer():
            assert isinstance(await peer.receive(), proto.ShipBegin)
            await peer.send(answer)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(bad_peer)
            with pytest.raises(ShipFailed, match=why):
                await ship_range(coord, plan, board=ProgressBoard(io.StringIO(), tty=False))
