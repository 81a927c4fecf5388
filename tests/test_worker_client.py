"""The worker client against a misbehaving child: a small fake worker (no tinygrad, starts in a blink) that breaks
the protocol in one chosen way. Every breach must surface as a typed WorkerFatal naming it, and the child is killed."""
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import numpy as np
import pytest
import trio

from engine.arena import Arena
from engine.worker import WorkerFatal, Worker, _PROJECT_ROOT

FAKE_CHILD = r"""
import os, struct, sys
import numpy as np
from engine.arena import EGRESS, Arena, RingWriter
from engine.worker_proto import Done, Loaded, Step, StepDone, WorkerInfo, decode_command, encode_event

mode, fd, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
arena = Arena.attach(fd, size)
egress = RingWriter(arena, EGRESS)
seq = 0

def emit(event, reply_to, pid=os.getpid(), skip=0):
    global seq
    seq += 1 + skip
    sys.stdout.buffer.write(encode_event(event, seq=seq, wall_ms=0.0, mono_ms=0.0, span_id="fake", pid=pid,
                                         reply_to=reply_to))
    sys.stdout.flush()

for line in sys.stdin.buffer:
    cmd = decode_command(line)
    if isinstance(cmd, Step):
        ref = egress.write(cmd.step_id, np.array([7], dtype=np.int32))
        off = arena.data_base(EGRESS) + ref.position % arena.capacity
        if mode == "egress-flags":
            arena.buffer[off + 33] = 0x01  # a flag bit outside the payload kind
        elif mode == "egress-object":
            struct.pack_into("<Q", arena.buffer, off + 8, cmd.step_id + 1)  # the header names another object
        emit(StepDone(cmd.step_id, ref, 0.0), cmd.cid)
    elif mode == "seq-gap":
        emit(Done("Reset"), cmd.cid, skip=1)
    elif mode == "wrong-pid":
        emit(Done("Reset"), cmd.cid, pid=1)
    elif mode == "bad-json":
        sys.stdout.buffer.write(b"{half an event\n")
        sys.stdout.flush()
    elif mode == "wrong-type":
        emit(Loaded(WorkerInfo(0, 1, 1, 4, "float32", 0, 0, "x", 0.0, 0.0, 0)), cmd.cid)
    elif mode == "future-reply":
        emit(Done("Reset"), cmd.cid + 5)
    else:
        emit(Done("Reset"), cmd.cid)
"""


@dataclass(frozen=True)
class Col:
    pos: int
    slot: int
    needs_logits: bool = True
    token: int = 1


@dataclass(frozen=True)
class Greedy:
    temperature: float = 0.0


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
    ("seq-gap", "event sequence 2 after 0"),
    ("wrong-pid", "from pid 1"),
    ("bad-json", "bad event line"),
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


async def test_a_step_polls_for_its_reply_only_in_the_window_its_last_compute_predicts():
    async with fake_worker("ok") as w:
        assert w._poll_window_for(1) is None  # no step of this width yet: sleep on the pipe
        for _ in range(3):  # the fake computes in 0 ms, so these poll from the start; replies still arrive
            assert np.array_equal(await w.step([Col(0, 0)], None, Greedy()), np.array([7], dtype=np.int32))
        start, end = w._poll_window_for(1)
        assert start <= time.perf_counter() and end - start == pytest.approx(0.0023)
        assert w._poll_window_for(2) is None
        w.poll = False
        assert w._poll_window_for(1) is None
        assert np.array_equal(await w.step([Col(0, 0)], None, Greedy()), np.array([7], dtype=np.int32))
        assert [e.seq for e in w.events] == [1, 2, 3, 4]
