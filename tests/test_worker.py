"""The worker process end to end: lifecycle, typed errors, death detection, ring corruption, and a tiny model run
through worker processes matching the in-process Stage bitwise."""
import dataclasses
import os
import signal
import time

import numpy as np
import pytest
import trio
import trio.testing

from engine.arena import INGRESS, PayloadKind, RecordRef
from engine.worker_proto import Reset
from engine.worker_records import doorbell, encode_small
from engine.worker import WorkerCommandError, WorkerDied, WorkerFatal, open_worker

pytestmark = pytest.mark.slow  # each test starts a process that imports tinygrad


async def test_ready_carries_the_probe_and_events_carry_the_envelope():
    async with open_worker(device="CPU") as w:
        assert w.ready.probe == (2, 4, 6) and w.ready.device in ("CPU", "CPU:X86")  # X86: no usable clang
        os.kill(w.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the worker too; its client decides
        with pytest.raises(WorkerCommandError):
            await w.reset()
        envs = list(w.events)
        assert [e.seq for e in envs] == list(range(1, len(envs) + 1))
        assert all(e.pid == w.pid and e.span_id.startswith(f"worker-{w.pid}/") for e in envs)
        assert all(e.wall_ms > 1e12 and e.mono_ms > 0 for e in envs)
        assert envs[-1].mono_ms >= envs[0].mono_ms
    assert w.process.returncode == 0  # graceful Shutdown answered with Stopped


async def test_out_of_order_and_wrong_arguments_are_command_errors_not_fatal(tmp_path):
    from engine.stage import Column, Sampling
    async with open_worker(device="CPU") as w:
        with pytest.raises(WorkerCommandError, match="send Load before Step") as info:
            await w.step([Column(0, 0, True, 1)], None, Sampling())
        assert info.value.command == "Step"
        with pytest.raises(WorkerCommandError, match="does not exist"):
            await w.load(tmp_path / "missing.gguf", 0, 2)
        junk = tmp_path / "junk.gguf"
        junk.write_bytes(b"not a gguf")
        with pytest.raises(WorkerCommandError, match=r"layer range \[3, 1\)"):
            await w.load(junk, 3, 1)
        with pytest.raises(WorkerCommandError, match="Load.start: expected an integer"):
            await w.load(junk, "zero", 1)
        with pytest.raises(WorkerCommandError, match=r"warmup \(5\) must lie in \[0, n_slots = 4\]"):
            await w.load(junk, 0, 1, warmup=5)
        with pytest.raises(WorkerCommandError, match="junk.gguf"):  # the loader's own error, passed on
            await w.load(junk, 0, 1)
        with pytest.raises(WorkerCommandError, match="send Load before Rollback"):
            await w.rollback(0, 0)
        # refused at the client, before anything reaches the ring or the pipe
        with pytest.raises(WorkerCommandError, match="sampling entries must be Sampling"):
            await w.step([Column(0, 0, True, 1)], np.zeros((1, 4), np.float32), "greedy")
        with pytest.raises(WorkerCommandError, match="cannot be sent"):
            await w.load(junk, np.int64(0), 1)
        with pytest.raises(WorkerCommandError, match="send Load before Step"):  # the ring is still in step
            await w.step([Column(0, 0, True, 1)], np.zeros((1, 4), np.float32), Sampling())
        assert w.process.returncode is None  # still alive and answering


async def test_killed_worker_is_reported_while_a_caller_waits():
    async with open_worker(device="CPU") as w:
        os.kill(w.pid, signal.SIGSTOP)  # it cannot answer: the caller below is certainly waiting
        outcome = {}

        async def call():
            t0 = time.monotonic()
            with pytest.raises(WorkerDied) as info:
                await w.reset()
            outcome["err"], outcome["s"] = info.value, time.monotonic() - t0

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                await trio.testing.wait_all_tasks_blocked()
                os.kill(w.pid, signal.SIGKILL)
        err = outcome["err"]
        assert err.signal == signal.SIGKILL and err.returncode == -signal.SIGKILL and "SIGKILL" in str(err)
        assert outcome["s"] < 5
        with pytest.raises(WorkerDied):  # stays dead
            await w.reset()


async def test_a_worker_that_exits_reports_its_exit_code():
    async with open_worker(device="CPU") as w:
        await w.process.stdin.aclose()  # EOF on its commands: the worker leaves quietly, code 0
        with trio.fail_after(10), pytest.raises(WorkerDied) as info:
            await w.reset()
        assert info.value.exit_code == 0 and info.value.signal is None and "exited with code 0" in str(info.value)


def _command_record(w, cid: int) -> RecordRef:
    """A well-formed Reset record in the ingress ring, not yet announced."""
    return w.ingress.write_parts(cid, PayloadKind.MESSAGE, [encode_small(Reset(cid))])


async def test_corrupt_ingress_record_is_a_fatal_naming_the_field():
    async with open_worker(device="CPU") as w:
        ref = _command_record(w, 1000)
        off = w.arena.data_base(INGRESS) + ref.position % w.arena.capacity
        w.arena.buffer[off:off + 4] = b"JUNK"
        await w.process.stdin.send_all(doorbell(ref))
        with pytest.raises(WorkerFatal) as info:
            await w.reset()
        assert info.value.kind == "record.magic" and info.value.field == "magic"
        with pytest.raises(WorkerFatal):  # the worker is gone for good
            await w.reset()
    assert w.process.returncode != 0


async def test_out_of_sequence_ingress_record_is_fatal():
    async with open_worker(device="CPU") as w:
        _command_record(w, 1000)  # written, never announced
        await w.process.stdin.send_all(doorbell(_command_record(w, 1001)))
        with pytest.raises(WorkerFatal) as info:
            await w.reset()
        assert info.value.field == "sequence"


async def test_garbage_on_the_doorbell_pipe_is_fatal():
    async with open_worker(device="CPU") as w:
        await w.process.stdin.send_all(b"\x00garbage\n")  # the next doorbell is read out of step: a ref to nowhere
        with pytest.raises(WorkerFatal) as info:
            await w.reset()
        assert info.value.kind.startswith("record.")


async def test_unknown_device_fails_its_probe_fatally():
    with pytest.raises(WorkerFatal) as info:
        async with open_worker(device="NOSUCHDEVICE"):
            pass  # pragma: no cover
    assert info.value.kind == "device" and "NOSUCHDEVICE" in info.value.detail


# ---- a tiny model through worker processes ----

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.tiny_gguf import write_tiny_gguf
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layers=4, dim=64, vocab_size=256)


def _decode_in_process(path, split, prompt, n_new):
    """Greedy decode with in-process Stages; returns the tokens and each boundary's activations per step."""
    from engine.stage import Column, Sampling, Stage
    stages = [Stage.load(path, a, b, n_slots=2, max_context=64) for a, b in zip(split, split[1:])]
    return _decode(lambda i, cols, hidden: stages[i].step(cols, hidden, Sampling()), len(stages), prompt, n_new,
                   Column)


def _decode(run, n_stages, prompt, n_new, Column):
    tokens, boundaries = list(prompt), []
    cols = [Column(p, 1, p == len(prompt) - 1, t) for p, t in enumerate(prompt)]
    for _ in range(n_new):
        hidden, acts = None, []
        for i in range(n_stages):
            hidden = run(i, cols, hidden)
            acts.append(hidden)
        boundaries.append(acts[:-1])
        tokens.append(int(hidden[0]))
        cols = [Column(len(tokens) - 1, 1, True, tokens[-1])]
    return tokens, boundaries


async def test_tiny_model_through_two_workers_equals_in_process_stage_bitwise(tiny_model):
    from engine.stage import PREFILL_BUCKETS, Column, Sampling
    prompt, n_new = [3, 17, 42, 99, 7], 4
    want_tokens, want_acts = _decode_in_process(tiny_model, [0, 2, 4], prompt, n_new)
    async with open_worker(device="CPU") as a, open_worker(device="CPU") as b:
        ia = await a.load(tiny_model, 0, 2, n_slots=2, max_context=64, warmup=0)
        ib = await b.load(tiny_model, 2, 4, n_slots=2, max_context=64)  # warmup=1: the decode step and the chunks
        assert (ia.first, ia.last, ib.first, ib.last) == (True, False, False, True)
        assert ia.total == 4 and ia.dim == 64 and ia.act_dtype == "float32" and ia.weight_bytes > 0
        assert ia.kv_bytes > 0 and ia.fingerprint and ia.load_ms > 0
        # b answered Loaded after its warmup: the decode step and the prefill chunks are compiled, and the steps below
        # (which run in those shapes) still equal an in-process stage's that compiled them on first use
        assert ib.warmup_shapes == 1 + len(PREFILL_BUCKETS) and ib.warmup_ms > 0
        assert ia.warmup_shapes == 0 and ia.warmup_ms == 0.0
        workers, got_tokens, got_acts = [a, b], list(prompt), []
        cols = [Column(p, 1, p == len(prompt) - 1, t) for p, t in enumerate(prompt)]
        for _ in range(n_new):
            hidden = await a.step(cols, None, Sampling())
            out = await b.step(cols, hidden, Sampling())
            got_acts.append([hidden])
            got_tokens.append(int(out[0]))
            cols = [Column(len(got_tokens) - 1, 1, True, got_tokens[-1])]
        assert got_tokens == want_tokens
        for got, want in zip(got_acts, want_acts):
            assert got[0].dtype == want[0].dtype and got[0].tobytes() == want[0].tobytes()

        # slot operations reach the stage: after a rollback the same position computes the same token again
        await b.rollback(1, len(got_tokens) - 2)
        await a.rollback(1, len(got_tokens) - 2)
        col = [Column(len(got_tokens) - 2, 1, True, got_tokens[-2])]
        again = await b.step(col, await a.step(col, None, Sampling()), Sampling())
        assert int(again[0]) == got_tokens[-1]
        with pytest.raises(WorkerCommandError, match="RangeError"):
            await a.zero_slot(5)
        await a.zero_slot(1)
        await a.reset()
        await b.reset()
        # block tables reach the stage, and a conflicting one is refused without harming the worker
        assert (ia.kv_blocks, ia.kv_block_size) == (2 * 64 // 16, 16)
        await a.block_table(0, (3, 1))
        with pytest.raises(WorkerCommandError, match="block 3 belongs to slot 0"):
            await a.block_table(1, (3,))
        await a.reset()
        # per-column sampling crosses the wire as a list
        out = await b.step([Column(0, 0, True, 3)],
                           await a.step([Column(0, 0, True, 3)], None, Sampling()), [Sampling(seed=1)])
        assert out.shape == (1,) and out.dtype == np.int32


async def test_a_cancelled_step_leaves_the_worker_usable(tiny_model):
    from engine.stage import Column, Sampling
    async with open_worker(device="CPU") as w:
        info = await w.load(tiny_model, 0, 2, n_slots=2, max_context=64, warmup=0)
        assert info.warmup_shapes == 0 and info.warmup_ms == 0.0
        os.kill(w.pid, signal.SIGSTOP)
        with trio.CancelScope() as scope:
            async def cancel_when_waiting():
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_when_waiting)
                await w.step([Column(0, 0, False, 5)], None, Sampling())
        assert scope.cancelled_caught
        os.kill(w.pid, signal.SIGCONT)
        # the late reply to the cancelled step is recognized and its output record consumed
        out = await w.step([Column(1, 0, False, 6)], None, Sampling())
        assert out.shape == (1, 64) and (w.first, w.last, w.dim, w.act_dtype) == (True, False, 64, np.float32)
        # a failed Load leaves nothing loaded, on both sides
        with pytest.raises(WorkerCommandError, match="does not exist"):
            await w.load(tiny_model.with_name("gone.gguf"), 0, 2)
        assert w.info is None
        with pytest.raises(WorkerCommandError, match="send Load before Step"):
            await w.step([Column(2, 0, False, 7)], None, Sampling())
