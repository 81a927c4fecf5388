"""The worker client against a misbehaving child: a small fake worker (no tinygrad, starts in a blink) that breaks
the protocol in one chosen way. Every breach must surface as a typed WorkerFatal naming it, and the child is killed."""
import subprocess
import sys
from contextlib import asynccontextmanager

import numpy as np
import pytest
import trio

from common.values import Column, Sampling
from engine.arena import Arena
from engine.worker import WorkerCommandError, WorkerDied, WorkerFatal, Worker, _PROJECT_ROOT

FAKE_CHILD = r"""
import os, struct, sys
import numpy as np
from engine.arena import EGRESS, INGRESS, Arena, PayloadKind, RecordRef, RingReader, RingWriter
from engine.worker_proto import Done, Loaded, WorkerInfo
from engine.worker_records import (DOORBELL, StepRecord, decode_command_record, doorbell, encode_event_record,
                                   step_done_head)

mode, fd, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
arena = Arena.attach(fd, size)
ingress, egress = RingReader(arena, INGRESS), RingWriter(arena, EGRESS)
seq = 0

def post(parts, reply_to):
    ref = egress.write_parts(reply_to, PayloadKind.MESSAGE, parts)
    off = arena.data_base(EGRESS) + ref.position % arena.capacity
    if mode == "egress-flags":
        arena.buffer[off + 33] = 0x01  # a flag bit outside the payload kind
    elif mode == "egress-object":
        struct.pack_into("<Q", arena.buffer, off + 8, reply_to + 1)  # the header names another object
    elif mode == "bad-record":
        arena.buffer[off + 40] = 0x7F  # a message type nobody knows
    os.write(1, doorbell(ref))

def emit(event, reply_to, pid=os.getpid(), skip=0):
    global seq
    seq += 1 + skip
    post([encode_event_record(event, reply_to, seq, pid)], reply_to)

while bell := sys.stdin.buffer.read(DOORBELL.size):
    ref = RecordRef(*DOORBELL.unpack(bell))
    view = ingress.payload(ref)
    cmd = decode_command_record(view)
    view.release()
    ingress.release(ref)
    if isinstance(cmd, StepRecord):
        seq += 1
        post([step_done_head(cmd.cmd.cid, seq, os.getpid(), cmd.cmd.step_id, 0.0, 1, 1, 1),
              np.array([7], dtype=np.int32)], cmd.cmd.cid)
    elif mode == "seq-gap":
        emit(Done("Reset"), cmd.cid, skip=1)
    elif mode == "wrong-pid":
        emit(Done("Reset"), cmd.cid, pid=1)
    elif mode == "wrong-type":
        emit(Loaded(WorkerInfo(0, 1, 1, 4, "float32", 0, 0, "x", 0.0, 0.0, 0)), cmd.cid)
    elif mode == "future-reply":
        emit(Done("Reset"), cmd.cid + 5)
    else:
        emit(Done("Reset"), cmd.cid)
"""


def Col(pos, slot):
    return Column(pos, slot, True, 1)


def Greedy():
    return Sampling()


@asynccontextmanager
async def fake_worker(mode):
    arena = Arena.create(1 << 16)
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", FAKE_CHILD, mode, str(arena.fd), str(arena.size)], cwd=_PROJECT_ROOT,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(arena.fd,))
    w = Worker(proc, arena)
    try:
        yield w
    finally:
        await w.aclose()


@pytest.mark.parametrize("mode, field", [("egress-flags", "flags"), ("egress-object", "object_id")])
async def test_corrupt_egress_record_is_fatal_naming_the_field(mode, field):
    async with fake_worker(mode) as w:
        with trio.fail_after(10), pytest.raises(WorkerFatal) as info:
            await w.step([Col(0, 0)], None, Greedy())
        assert info.value.kind == f"record.{field}" and info.value.field == field
        await w.process.wait()  # killed by the client, not trusted to exit
        with pytest.raises(WorkerFatal):
            await w.reset()


@pytest.mark.parametrize("mode, match", [
    ("seq-gap", r"event 2 \(after 0\)"),
    ("wrong-pid", "from pid 1 "),
    ("bad-record", "bad event record"),
    ("wrong-type", "Reset was answered with Loaded, expected Done"),
    ("future-reply", "reply to command 6 before command 1"),
])
async def test_protocol_breaches_are_fatal(mode, match):
    async with fake_worker(mode) as w:
        with trio.fail_after(10), pytest.raises(WorkerFatal, match=match) as info:
            await w.reset()
        assert info.value.kind == "protocol"
        await w.process.wait()
    assert w.process.returncode is not None


async def test_a_well_behaved_fake_passes():
    async with fake_worker("ok") as w:
        await w.reset()
        assert np.array_equal(await w.step([Col(0, 0)], None, Greedy()), np.array([7], dtype=np.int32))
        assert [e.seq for e in w.events] == [1, 2]


async def test_a_reply_after_its_caller_was_cancelled_is_released_and_skipped():
    async with fake_worker("ok") as w:
        with trio.move_on_after(0):  # cancelled before the reply is read: the reply stays in the ring
            await w.step([Col(0, 0)], None, Greedy())
        assert np.array_equal(await w.step([Col(1, 0)], None, Greedy()), np.array([7], dtype=np.int32))
        await w.reset()
        assert [e.seq for e in w.events] == [1, 2, 3]


async def test_a_step_posted_by_one_task_is_awaited_by_another_and_a_second_post_waits():
    """post_step_nowait rings the child at once (a peer's Link reader does, as the frame is decoded); the reply is
    awaited by another task with step_posted. While one is in flight, a second post is refused (nothing sent)."""
    async with fake_worker("ok") as w:
        posted = w.post_step_nowait([Col(0, 0)], None, 0, 0, Greedy())
        with pytest.raises(trio.WouldBlock):
            w.post_step_nowait([Col(1, 0)], None, 0, 0, Greedy())
        got = []

        async def other_task():
            got.append(await w.step_posted(posted))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other_task)
        (out,) = got
        assert out.data == np.array([7], dtype=np.int32).tobytes() and out.sent_ms <= out.received_ms
        assert np.array_equal(await w.step([Col(1, 0)], None, Greedy()), np.array([7], dtype=np.int32))
        assert [e.seq for e in w.events] == [1, 2]


async def test_an_abandoned_posted_step_frees_the_worker_and_its_reply_is_skipped():
    async with fake_worker("ok") as w:
        w.abandon(w.post_step_nowait([Col(0, 0)], None, 0, 0, Greedy()))
        with trio.fail_after(10):
            assert np.array_equal(await w.step([Col(1, 0)], None, Greedy()), np.array([7], dtype=np.int32))
            await w.reset()
        assert [e.seq for e in w.events] == [1, 2, 3]     # the abandoned step's reply was read and skipped


async def test_a_posted_step_that_cannot_be_sent_raises_and_leaves_the_worker_free():
    async with fake_worker("ok") as w:
        with pytest.raises(WorkerCommandError, match="2 Sampling entries for 1 columns"):
            w.post_step_nowait([Col(0, 0)], None, 0, 0, [Greedy(), Greedy()])   # two samplings for one column
        assert np.array_equal(await w.step([Col(1, 0)], None, Greedy()), np.array([7], dtype=np.int32))


async def test_a_step_posted_to_a_dead_child_names_its_death_when_awaited():
    async with fake_worker("ok") as w:
        w.process.kill()
        await w.process.wait()
        posted = w.post_step_nowait([Col(0, 0)], None, 0, 0, Greedy())    # the doorbell meets a closed pipe
        with trio.fail_after(10), pytest.raises(WorkerDied) as info:
            await w.step_posted(posted)
        assert info.value.returncode == -9
