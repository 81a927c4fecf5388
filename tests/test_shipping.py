"""The receiver's file logic, sans-IO: resume, integrity, claims, cache reuse, and every failure's clear error."""
from __future__ import annotations

import errno
import io
import os
import re
import subprocess
import sys

import pytest

from engine.gguf_range import plan_range_gguf
from mesh import proto
from mesh.shipping import (ProgressBoard, ShipAck, ShipCache, ShipProgress, ShipReceiver, cached_ranges,
                           complete_entry, default_cache_dir)
from tests.test_gguf_range import write_model

CHUNK = 4096
E = proto.ErrorCode


@pytest.fixture
def plan(tmp_path):
    src = write_model(tmp_path / "model.gguf", n_layers=4, dim=64)
    return plan_range_gguf(src, 1, 3)


@pytest.fixture
def cache(tmp_path):
    return ShipCache(tmp_path / "cache")


def begin_of(plan, **over):
    fields = dict(fingerprint=plan.fingerprint, start=plan.start, end=plan.end, total_bytes=plan.size,
                  sha256=plan.sha256(), name=plan.name)
    fields.update(over)
    return proto.ShipBegin(**fields)


def feed(rx, plan, offset, upto=None):
    """Feed chunks from `offset` until `upto` bytes (or the end); returns the bytes fed."""
    pos, fed = offset, 0
    for data in plan.iter_chunks(offset, CHUNK):
        if upto is not None and pos >= upto:
            break
        assert rx.receive(proto.ShipChunk(pos, data)) is None
        pos += len(data)
        fed += len(data)
    return fed


def ship(cache, plan, **kw):
    with ShipReceiver(cache, **kw) as rx:
        resume = rx.receive(begin_of(plan))
        assert isinstance(resume, proto.ShipResume)
        fed = feed(rx, plan, resume.offset)
        ack = rx.receive(proto.ShipEnd(plan.sha256()))
        return resume.offset, fed, ack


def leftovers(cache, plan):
    return sorted(p.name for p in cache.entry(plan.fingerprint, plan.start, plan.end).parent.iterdir())


def test_full_shipment_lands_atomically_and_is_reused(cache, plan, tmp_path):
    offset, fed, ack = ship(cache, plan)
    assert (offset, fed, ack) == (0, plan.size, proto.Ack(proto.MsgType.SHIP_END, ShipAck.OK, ""))
    entry = cache.entry(plan.fingerprint, 1, 3)
    assert entry.read_bytes() == plan.write_to(tmp_path / "expected.gguf").read_bytes()
    assert leftovers(cache, plan) == ["1-3.gguf"]
    assert complete_entry(cache.root, plan.fingerprint, 1, 3) == entry
    assert complete_entry(cache.root, plan.fingerprint, 0, 2) is None
    assert cached_ranges(cache.root, plan.fingerprint) == [(1, 3)]
    assert cached_ranges(cache.root, "0" * 64) == [] and cached_ranges(cache.root, "../x") == []
    # A later session: the receiver already holds every byte, so nothing crosses the wire.
    offset, fed, ack = ship(cache, plan)
    assert (offset, fed, ack.code) == (plan.size, 0, ShipAck.OK)
    assert leftovers(cache, plan) == ["1-3.gguf"]


def test_dropped_shipment_resumes_with_only_the_remainder(cache, plan):
    half = plan.size // 2 // CHUNK * CHUNK
    rx = ShipReceiver(cache)
    assert rx.receive(begin_of(plan)) == proto.ShipResume(0)
    feed(rx, plan, 0, upto=half)
    rx.close()  # the connection dropped: no ShipEnd
    assert not cache.entry(plan.fingerprint, 1, 3).exists()
    assert cache.part(plan.fingerprint, 1, 3).stat().st_size == half

    offset, fed, ack = ship(cache, plan)
    assert offset == half and fed == plan.size - half
    assert ack.code == ShipAck.OK  # the hash accumulated across the resume holds


def test_corrupted_partial_is_detected_discarded_and_reshipped(cache, plan):
    rx = ShipReceiver(cache)
    rx.receive(begin_of(plan))
    feed(rx, plan, 0, upto=3 * CHUNK)
    rx.close()
    part = cache.part(plan.fingerprint, 1, 3)
    with open(part, "r+b") as f:  # a bit flips on the peer's disk
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    offset, fed, ack = ship(cache, plan)
    assert offset == 3 * CHUNK
    assert ack.code == ShipAck.HASH_MISMATCH and "discarded" in ack.reason
    assert not part.exists() and not cache.entry(plan.fingerprint, 1, 3).exists()
    offset, fed, ack = ship(cache, plan)
    assert (offset, fed, ack.code) == (0, plan.size, ShipAck.OK)


def test_second_shipper_is_busy_until_the_first_lets_go(cache, plan):
    first = ShipReceiver(cache)
    assert first.receive(begin_of(plan)) == proto.ShipResume(0)
    feed(first, plan, 0, upto=2 * CHUNK)
    second = ShipReceiver(cache)
    refused = second.receive(begin_of(plan))
    assert isinstance(refused, proto.Error) and refused.code == E.BUSY
    assert "another connection" in refused.reason and second.done
    first.close()
    offset, fed, ack = ship(cache, plan)  # the second try resumes the first's bytes
    assert offset == 2 * CHUNK and ack.code == ShipAck.OK


def test_another_process_holding_the_partial_means_busy(cache, plan):
    part = cache.part(plan.fingerprint, 1, 3)
    part.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys\n"
         f"fd = os.open({str(part)!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('locked', flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused = ShipReceiver(cache).receive(begin_of(plan))
        assert isinstance(refused, proto.Error) and refused.code == E.BUSY
        assert "another process" in refused.reason
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    assert ship(cache, plan)[2].code == ShipAck.OK


def test_entry_of_a_different_model_is_never_used(cache, plan, tmp_path):
    other_src = write_model(tmp_path / "other.gguf", n_layers=5, dim=64, seed=7)
    other = plan_range_gguf(other_src, 1, 3)
    assert other.fingerprint != plan.fingerprint
    # Someone put model B's range file where model A's belongs.
    target = cache.entry(plan.fingerprint, 1, 3)
    target.parent.mkdir(parents=True)
    other.write_to(target)
    assert complete_entry(cache.root, plan.fingerprint, 1, 3) is None
    assert cached_ranges(cache.root, plan.fingerprint) == []
    offset, fed, ack = ship(cache, plan)
    assert (offset, fed, ack.code) == (0, plan.size, ShipAck.OK)
    assert complete_entry(cache.root, plan.fingerprint, 1, 3) == target
    assert complete_entry(cache.root, other.fingerprint, 1, 3) is None


def test_same_model_with_other_bytes_never_resumes_a_partial(cache, plan):
    rx = ShipReceiver(cache)
    rx.receive(begin_of(plan))
    feed(rx, plan, 0, upto=2 * CHUNK)
    rx.close()
    # The coordinator now announces different content for the same target (say its GGUF was re-converted).
    with ShipReceiver(cache) as rx:
        assert rx.receive(begin_of(plan, sha256=bytes(32))) == proto.ShipResume(0)


def test_truncated_shipment_keeps_the_partial_and_never_renames(cache, plan):
    with ShipReceiver(cache) as rx:
        rx.receive(begin_of(plan))
        feed(rx, plan, 0, upto=2 * CHUNK)
        ack = rx.receive(proto.ShipEnd(plan.sha256()))
    assert ack.code == ShipAck.TRUNCATED and f"received {2 * CHUNK} of {plan.size} bytes" in ack.reason
    assert not cache.entry(plan.fingerprint, 1, 3).exists()
    assert cache.part(plan.fingerprint, 1, 3).stat().st_size == 2 * CHUNK


def test_wrong_hash_discards_the_partial(cache, plan):
    with ShipReceiver(cache) as rx:
        rx.receive(begin_of(plan, sha256=b"\x01" * 32))
        feed(rx, plan, 0)
        ack = rx.receive(proto.ShipEnd(b"\x01" * 32))
    assert ack.code == ShipAck.HASH_MISMATCH and "is not the announced 0101" in ack.reason
    assert not cache.entry(plan.fingerprint, 1, 3).exists()
    assert not cache.part(plan.fingerprint, 1, 3).exists()


def test_chunk_at_the_wrong_offset_is_an_error_and_later_chunks_are_dropped(cache, plan):
    with ShipReceiver(cache) as rx:
        rx.receive(begin_of(plan))
        feed(rx, plan, 0, upto=CHUNK)
        err = rx.receive(proto.ShipChunk(5 * CHUNK, b"x" * CHUNK))
        assert err == proto.Error(E.BAD_REQUEST, f"chunk at offset {5 * CHUNK}, expected {CHUNK} for "
                                                 f"{plan.fingerprint[:16]}/1-3.gguf")
        assert rx.receive(proto.ShipChunk(CHUNK, b"y" * CHUNK)) is None
        assert rx.receive(proto.ShipEnd(plan.sha256())) is None and rx.done
    assert cache.part(plan.fingerprint, 1, 3).stat().st_size == CHUNK
    with ShipReceiver(cache) as rx:
        overrun = rx.receive(begin_of(plan))
        err = rx.receive(proto.ShipChunk(overrun.offset, bytes(plan.size)))
        assert err.code == E.BAD_REQUEST and "overruns" in err.reason


def test_full_disk_keeps_the_written_prefix_for_a_resume(cache, plan):
    budget = [3 * CHUNK + 100]

    def write(fd, view):
        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(fd, view[: budget[0]])
        budget[0] -= n
        return n

    with ShipReceiver(cache, write=write) as rx:
        rx.receive(begin_of(plan))
        replies = [rx.receive(proto.ShipChunk(off, data)) for off, data in
                   zip(range(0, plan.size, CHUNK), plan.iter_chunks(0, CHUNK))]
        errors = [r for r in replies if r is not None]
        assert len(errors) == 1 and errors[0].code == E.INTERNAL
        assert "disk full; the partial is kept" in errors[0].reason and "1-3.gguf.part" in errors[0].reason
        assert rx.receive(proto.ShipEnd(plan.sha256())) is None
    assert not cache.entry(plan.fingerprint, 1, 3).exists()
    part = cache.part(plan.fingerprint, 1, 3)
    assert part.stat().st_size == 3 * CHUNK + 100
    offset, fed, ack = ship(cache, plan)  # space freed: the resume re-hashes the prefix and completes
    assert offset == 3 * CHUNK + 100 and ack.code == ShipAck.OK


def test_unwritable_cache_dir_is_a_clear_error(tmp_path, plan):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    rx = ShipReceiver(blocker / "cache")
    err = rx.receive(begin_of(plan))
    assert err.code == E.INTERNAL and err.reason.startswith(f"cache dir {blocker / 'cache'}") \
        and "is not writable" in err.reason
    assert rx.done


@pytest.mark.parametrize("over,why", [
    (dict(fingerprint="../../etc"), "is not a safe cache directory name"),
    (dict(fingerprint=""), "is not a safe cache directory name"),
    (dict(name="../evil.gguf"), "is not '1-3.gguf'"),
    (dict(start=3, end=3, name="3-3.gguf"), "empty"),
    (dict(total_bytes=0), "not positive"),
])
def test_bad_begin_is_refused(cache, plan, over, why):
    err = ShipReceiver(cache).receive(begin_of(plan, **over))
    assert isinstance(err, proto.Error) and err.code == E.BAD_REQUEST and why in err.reason


def test_events_out_of_order_are_refused(cache, plan):
    err = ShipReceiver(cache).receive(proto.ShipChunk(0, b"x"))
    assert err.code == E.UNEXPECTED and "before ShipBegin" in err.reason
    with ShipReceiver(cache) as rx:
        rx.receive(begin_of(plan))
        err = rx.receive(proto.Reset())
        assert err.code == E.UNEXPECTED and "Reset in the middle of a shipment" in err.reason
    assert cache.part(plan.fingerprint, 1, 3).exists()


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "mesh"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "mesh"


def test_progress_line_and_board():
    p = ShipProgress("peer-a layers 0..15", total=100_000_000, started=10.0, resumed_at=20_000_000,
                     done=20_000_000, now=10.0)
    p.update(60_000_000, 12.0)
    assert p.rate == 20e6
    assert p.line() == ("peer-a layers 0..15: 60.0/100.0 MB  60.0%    20.0 MB/s ETA 0:00:02, "
                        "resumed at 20.0 MB")
    out = io.StringIO()
    board = ProgressBoard(out, tty=False, delay=0)
    board.update(p)
    p.update(61_000_000, 12.5)
    board.update(p)  # within the interval: no new line on a pipe
    p.update(100_000_000, 14.0)
    board.update(p, final=True)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 2, lines
    assert lines[0].startswith("peer-a layers 0..15:  20%") and lines[-1].startswith("peer-a layers 0..15: 100%")
    assert "100M/100M" in lines[-1]


def test_board_on_a_terminal_redraws_in_place():
    out = io.StringIO()
    board = ProgressBoard(out, tty=True, delay=0)
    a = ShipProgress("peer-a", total=100, started=0.0)
    a.update(50, 1.0)
    board.update(a)
    a.update(100, 2.0)
    board.update(a, final=True)
    assert "\r" in out.getvalue() and "peer-a: 100%" in out.getvalue()
