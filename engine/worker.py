"""The client of a worker process: a Stage that lives in a child process, driven over trio.

    async with open_worker(device="CPU") as w:
        info = await w.load(path, 0, 15, n_slots=4, max_context=2048)
        hidden = await w.step(cols, None, sampling)

Commands and events are records in a shared-memory arena of two rings (engine.arena, layouts in
engine.worker_records); a Step's record carries its columns, its sampling and its input activations, a StepDone's
its output. The pipes carry one doorbell (the record's ref) per message: the child blocks reading its stdin, this
client waits in `trio.lowlevel.wait_readable` on the child's stdout. Commands are answered one at a time, in order;
a lock serializes callers. The reply is read by the call that awaits it: when the child dies its stdout reaches EOF
at once, so a caller waiting for a reply gets `WorkerDied` promptly, with the exit code or signal.

Callers own timeouts (`trio.fail_after` around any call). A reply that arrives after its caller was cancelled is
recognized by its `reply_to` and discarded (its record is released so the ring stays in step).
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import numpy as np
import trio

from common.values import Column, Sampling, SamplingArg, samplings_for
from engine.arena import (EGRESS, INGRESS, RECORD_HEADER_LEN, Arena, ArenaError, PayloadKind, RecordError, RecordRef,
                          RingReader, RingWriter)
from engine.errors import EngineError
from engine.worker_proto import (BlockTable, Command, CommandError, Done, Envelope, Fatal, Initialize, Load, Loaded, Ready, Reset,
                                 Rollback, Shutdown, StepDone, Stopped, WireError, WorkerInfo, ZeroSlot, command_name)
from engine.worker_records import (DOORBELL, doorbell, DTYPE_NAME, KIND_BY_DTYPE, decode_event_record, encode_small,
                                   step_head)

__all__ = ["open_worker", "Worker", "StepOut", "PostedStep", "WorkerInfo", "WorkerError", "WorkerDied", "WorkerFatal", "WorkerCommandError",
           "DEFAULT_ARENA_BYTES"]

DEFAULT_ARENA_BYTES = 64 << 20  # memfd pages are only backed once touched; 32 MiB per ring fits big prefills
SHUTDOWN_GRACE_S = 5.0  # how long aclose waits for a graceful Stopped before it kills the child
_PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)


class WorkerError(EngineError):
    """Base of the errors a worker client raises."""


class WorkerDied(WorkerError):
    """The child process exited or was killed. `returncode` is negative for a signal, as in subprocess."""

    def __init__(self, pid: int, returncode: int | None, during: str) -> None:
        self.pid = pid
        self.returncode = returncode
        self.signal = -returncode if returncode is not None and returncode < 0 else None
        self.exit_code = returncode if returncode is not None and returncode >= 0 else None
        if self.signal is not None:
            how = f"was killed by {signal.Signals(self.signal).name}"
        elif returncode is not None:
            how = f"exited with code {returncode}"
        else:
            how = "closed its event channel"
        super().__init__(f"worker process {pid} {how} during {during}")


class WorkerFatal(WorkerError):
    """The worker reported a fatal problem (and exits), or sent something this client cannot trust.
    `kind` names it; for a corrupt ring record it is "record.<field>"."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"worker fatal {kind}: {detail}")
        self.kind = kind
        self.detail = detail

    @property
    def field(self) -> str | None:
        return self.kind.removeprefix("record.") if self.kind.startswith("record.") else None


class WorkerCommandError(WorkerError):
    """The worker refused a command (out of order, wrong arguments) or it failed harmlessly; the worker goes on."""

    def __init__(self, command: str, reason: str) -> None:
        super().__init__(f"worker refused {command}: {reason}")
        self.command = command
        self.reason = reason


class StepOut:
    """A step's output as raw bytes out of the StepDone record: `kind` (engine.arena.PayloadKind: int32 tokens,
    float16 or float32 activations), `rows` x `cols` values. What a peer forwards without a numpy round trip."""
    __slots__ = ("kind", "rows", "cols", "data", "compute_ms", "sent_ms", "done_ms", "received_ms")

    def __init__(self, kind: int, rows: int, cols: int, data: bytes, compute_ms: float, sent_ms: float,
                 done_ms: float, received_ms: float) -> None:
        self.kind, self.rows, self.cols, self.data, self.compute_ms = kind, rows, cols, data, compute_ms
        # CLOCK_MONOTONIC ms: the doorbell went out, the child finished the step, the client took the event
        self.sent_ms, self.done_ms, self.received_ms = sent_ms, done_ms, received_ms

    def array(self) -> np.ndarray:
        a = np.frombuffer(self.data, DTYPE_NAME[self.kind])
        return a if self.kind == PayloadKind.TOKENS_I32 else a.reshape(self.rows, self.cols)


_BROKEN = b"broken"   # _post_nowait's marker (by identity) for a doorbell the pipe refused: the child is gone


class PostedStep:
    """A step whose record is written and whose doorbell rang (`Worker.post_step_nowait`): its command id, step
    id, and what of the doorbell is still to be written (None when nothing is)."""
    __slots__ = ("cid", "step_id", "unsent")

    def __init__(self, cid: int, step_id: int, unsent: bytes | None) -> None:
        self.cid, self.step_id, self.unsent = cid, step_id, unsent


class LoadedRange:
    """What a stage holder (a `Worker`, or engine/local_stage.py's `LocalStage`) tells of the range it loaded: its
    `info` (None until a Load succeeds), read through properties that name the process when nothing is loaded."""
    info: WorkerInfo | None
    pid: int
    _holder = "worker process"

    def _loaded(self) -> WorkerInfo:
        if self.info is None:
            raise WorkerError(f"{self._holder} {self.pid} has no model loaded")
        return self.info

    @property
    def first(self) -> bool:
        return self._loaded().first

    @property
    def last(self) -> bool:
        return self._loaded().last

    @property
    def dim(self) -> int:
        return self._loaded().dim

    @property
    def act_dtype(self) -> np.dtype:
        return np.dtype(self._loaded().act_dtype)


class Worker(LoadedRange):
    """A running worker process. Build it with `open_worker`."""

    def __init__(self, process: trio.Process, arena: Arena) -> None:
        self.process = process
        self.pid = process.pid
        self.arena = arena
        self.ingress = RingWriter(arena, INGRESS)
        self.egress = RingReader(arena, EGRESS)
        self.ready: Ready | None = None
        self.info: WorkerInfo | None = None
        self.events: deque[Envelope] = deque(maxlen=64)  # the most recent envelopes, for diagnostics
        # CLOCK_MONOTONIC in ms (the envelope's mono_ms clock) when the last doorbell went out and the last event
        # was taken in: with an event's mono_ms and compute_ms they split a round trip into its legs
        self.sent_mono_ms = 0.0
        self.received_mono_ms = 0.0
        # Not a Lock: a step posted by one task (a peer's Link reader) is awaited, and released, by another
        self._lock = trio.Semaphore(1, max_value=1)
        self._cid = 0
        self._step_id = 0
        self._last_seq = 0
        self._buf = bytearray()
        self._broken: WorkerError | None = None
        self._closed = False

    # ---- the Stage-like API ----

    async def load(self, path: str | os.PathLike, start: int, end: int, *, n_slots: int = 4,
                   max_context: int = 2048, warmup: int = 1, kv_blocks: int = 0) -> WorkerInfo:
        """Load layers [start, end) and compile the steps of a session before answering (`Stage.warmup`): decode
        steps of 1..`warmup` sequences (a mesh session decodes one) and the prefill chunks; 0 skips that, and the
        first step of each shape compiles it instead (seconds on a real model; tests of tiny ones can skip it).
        `kv_blocks`: the KV pool's size in blocks (0: enough for every slot at max_context)."""
        self.info = None  # the worker drops what it held before it loads; a failed Load leaves nothing loaded
        ev = await self._request(lambda cid: Load(cid, os.fspath(path), start, end, n_slots, max_context, warmup,
                                                  kv_blocks), Loaded)
        self.info = ev.info
        return ev.info

    async def step(self, cols: Sequence[Column], hidden: np.ndarray | None, sampling: SamplingArg) -> np.ndarray:
        """Like `Stage.step`: (len(cols), dim) activations for a non-last stage, int32 token ids for the last."""
        data, kind, dim = None, 0, 0
        if hidden is not None:
            hidden = np.ascontiguousarray(hidden)
            kind = KIND_BY_DTYPE.get(hidden.dtype.name, 0)
            if kind not in (PayloadKind.ACT_F16, PayloadKind.ACT_F32):
                raise WorkerCommandError("Step", f"activations must be float16 or float32, got {hidden.dtype}")
            dim = hidden.shape[-1] if hidden.ndim > 1 else hidden.size // max(len(cols), 1)
            data = hidden.reshape(-1).view(np.uint8)
        return (await self.step_raw(cols, data, kind, dim, sampling)).array().copy()

    async def step_raw(self, cols: Sequence[Column], data, kind: int, dim: int, sampling: SamplingArg) -> StepOut:
        """`step` on raw bytes: `data` (bytes-like, len(cols) x dim values of `kind`, or None) goes straight into the
        Step record; the output comes back as the bytes of the StepDone record. No numpy on the way."""
        # A decode step takes the lock uncontended; acquire() would pass through trio's scheduler once. The wait for
        # the reply is the step's checkpoint.
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()
        try:
            posted = self._post_step(cols, data, kind, dim, sampling)
        except BaseException:
            self._lock.release()
            raise
        return await self.step_posted(posted)

    def post_step_nowait(self, cols: Sequence[Column], data, kind: int, dim: int,
                         sampling: SamplingArg) -> "PostedStep":
        """The first half of `step_raw`, synchronous: write the Step record and ring the child now, from whatever
        task holds the bytes (a peer's Link reader, as the frame is decoded), and hand the wait for the reply to
        `step_posted`, which must follow (or `abandon`). Raises trio.WouldBlock when another command is in flight
        (nothing was sent then) and what `step_raw` raises for a step that cannot be sent."""
        self._lock.acquire_nowait()
        try:
            return self._post_step(cols, data, kind, dim, sampling)
        except BaseException:
            self._lock.release()
            raise

    async def step_posted(self, posted: "PostedStep") -> StepOut:
        """Wait for the reply to a posted step; releases the client for the next command."""
        try:
            if posted.unsent:
                await self._ring_rest(posted.unsent, "Step")
            env, out, ref, view = await self._reply(posted.cid, "Step", StepDone)
            try:
                ev = env.event
                if ev.step_id != posted.step_id:
                    raise self._break(WorkerFatal("protocol", f"step {posted.step_id} answered for step {ev.step_id}"))
                data_out = bytes(view[out.offset:out.offset + out.nbytes])
            finally:
                self._release(ref, view)
            return StepOut(out.kind, out.rows, out.cols, data_out, ev.compute_ms, self.sent_mono_ms, env.mono_ms,
                           self.received_mono_ms)
        finally:
            self._lock.release()

    def abandon(self, posted: "PostedStep") -> None:
        """Give up on a posted step nobody will wait for (its caller went away): the client is free again, and the
        step's reply, when it comes, is skipped as stale (its cid is below the next command's)."""
        if posted.unsent:       # half a doorbell would desynchronize the channel: a worker in that state is unusable
            self._break(WorkerError(f"worker process {self.pid}: a step was abandoned before its doorbell was out"))
        self._lock.release()

    def _post_step(self, cols, data, kind: int, dim: int, sampling: SamplingArg) -> "PostedStep":
        """Check, write the Step record, ring (as far as the pipe takes it without waiting). Lock held."""
        try:
            samplings = samplings_for(sampling, cols)
        except ValueError as exc:
            raise WorkerCommandError("Step", str(exc)) from None
        per_column = not isinstance(sampling, Sampling)
        self._check_usable()
        if self._closed:
            raise WorkerError(f"worker process {self.pid} is closed")
        if self.info is not None and not self.info.last:
            need = len(cols) * self.info.dim * np.dtype(self.info.act_dtype).itemsize + 4 * RECORD_HEADER_LEN
            if need > self.arena.capacity:
                raise WorkerCommandError("Step", f"{len(cols)} columns need {need} bytes of the egress ring, it "
                                                 f"holds {self.arena.capacity}; open the worker with a larger arena")
        try:
            head = step_head(self._cid + 1, self._step_id + 1, cols, samplings, per_column, kind, dim)
        except (struct.error, TypeError, AttributeError) as exc:
            raise WorkerCommandError("Step", f"columns or sampling cannot be sent: {exc}") from None
        self._cid += 1
        self._step_id += 1
        unsent = self._post_nowait((head, data) if data is not None else (head,), self._cid, "Step")
        return PostedStep(self._cid, self._step_id, unsent)

    async def zero_slot(self, slot: int) -> None:
        await self._request(lambda cid: ZeroSlot(cid, slot), Done)

    async def block_table(self, slot: int, blocks: tuple[int, ...] | list[int]) -> None:
        """Make `blocks` the slot's KV block table (Stage.block_table; refused: WorkerCommandError)."""
        await self._request(lambda cid: BlockTable(cid, slot, tuple(int(b) for b in blocks)), Done)

    async def reset(self) -> None:
        await self._request(lambda cid: Reset(cid), Done)

    async def rollback(self, slot: int, pos: int) -> None:
        await self._request(lambda cid: Rollback(cid, slot, pos), Done)

    async def aclose(self) -> None:
        """Ask the child to stop; kill it if it lingers or cannot be asked. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            if self._broken is None and self.process.returncode is None:
                with trio.move_on_after(SHUTDOWN_GRACE_S):
                    try:
                        await self._request(lambda cid: Shutdown(cid), Stopped, closing=True)
                        await self.process.wait()
                    except WorkerError:
                        pass
            if self.process.returncode is None:
                self.process.kill()
            await self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                if stream is not None:
                    await stream.aclose()
            if self._broken is None:
                self._broken = WorkerError(f"worker process {self.pid} is closed")
            self.arena.close()

    # ---- request / reply ----

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken

    async def _request(self, make: Any, expect: type, *, closing: bool = False) -> Any:
        async with self._lock:
            if self._closed and not closing:
                raise WorkerError(f"worker process {self.pid} is closed")
            self._check_usable()
            self._cid += 1
            cmd: Command = make(self._cid)
            try:
                payload = encode_small(cmd)
            except (TypeError, ValueError) as exc:  # json: a numpy scalar, NaN, an object
                raise WorkerCommandError(command_name(cmd), f"arguments cannot be sent: {exc}") from None
            await self._post((payload,), cmd.cid, command_name(cmd))
            env, _, ref, view = await self._reply(cmd.cid, command_name(cmd), expect)
            self._release(ref, view)
            return env.event

    async def _post(self, parts, cid: int, name: str) -> None:
        """Write one command record and ring the child (see `_post_nowait`)."""
        unsent = self._post_nowait(parts, cid, name)
        if unsent:
            await self._ring_rest(unsent, name)

    def _post_nowait(self, parts, cid: int, name: str) -> bytes | None:
        """Write one command record and ring the child. The doorbell goes straight to the non-blocking pipe (40
        bytes, far below its buffer, which the child drains between commands): no pass through the scheduler.
        Returns what of the doorbell did not fit (None: all of it went), for `_ring_rest`; b"" when the pipe is
        broken (the child is gone: `_ring_rest` names how it ended)."""
        try:
            ref = self.ingress.write_parts(cid, PayloadKind.MESSAGE, parts)
        except ArenaError as exc:
            raise WorkerCommandError(name, str(exc)) from None
        bell = doorbell(ref)
        self.sent_mono_ms = time.monotonic_ns() / 1e6
        try:
            sent = os.write(self.process.stdin.fileno(), bell)
        except BlockingIOError:
            sent = 0
        except OSError:  # EPIPE: the child is gone; EBADF: the pipe was closed
            return _BROKEN
        return bell[sent:] if sent < len(bell) else None

    async def _ring_rest(self, unsent: bytes, name: str) -> None:
        """The rest of a doorbell the pipe did not take at once, shielded: half a doorbell would desynchronize the
        channel for good."""
        if unsent is _BROKEN:
            raise await self._died(name)
        with trio.CancelScope(shield=True):
            try:
                await self.process.stdin.send_all(unsent)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise await self._died(name) from None

    async def _reply(self, cid: int, name: str, expect: type):
        """Wait for the event answering command `cid`: (envelope, step output or None, record ref, payload view);
        the caller releases the record. Stale replies (to a cancelled caller's command) are released and skipped."""
        while True:
            env, out, ref, view = await self._next_event(name)
            ev = env.event
            if isinstance(ev, Fatal):
                self._release(ref, view)
                raise self._break(WorkerFatal(ev.kind, ev.detail))
            if env.reply_to != cid:
                self._release(ref, view)
                if env.reply_to < cid:
                    continue
                raise self._break(WorkerFatal("protocol", f"reply to command {env.reply_to} before command "
                                                          f"{cid} was answered"))
            if isinstance(ev, CommandError):
                self._release(ref, view)
                raise WorkerCommandError(ev.command, ev.reason)
            if not isinstance(ev, expect):
                self._release(ref, view)
                raise self._break(WorkerFatal("protocol", f"{name} was answered with {type(ev).__name__}, "
                                                          f"expected {expect.__name__}"))
            return env, out, ref, view

    async def _next_event(self, during: str):
        bell = await self._read_doorbell(during)
        self.received_mono_ms = time.monotonic_ns() / 1e6
        ref = RecordRef(*DOORBELL.unpack(bell))
        try:
            view = self.egress.payload(ref)
        except RecordError as exc:
            raise self._break(WorkerFatal(f"record.{exc.field}", str(exc))) from None
        try:
            env, out = decode_event_record(view, ref)
        except WireError as exc:
            self._release(ref, view)
            raise self._break(WorkerFatal("protocol", f"bad event record: {exc}")) from None
        if env.seq != self._last_seq + 1 or env.pid != self.pid or env.reply_to != ref.object_id:
            self._release(ref, view)
            raise self._break(WorkerFatal("protocol", f"event {env.seq} (after {self._last_seq}) from pid {env.pid} "
                                                      f"replying to {env.reply_to} in record {ref.object_id}; the "
                                                      f"worker is {self.pid}"))
        self._last_seq = env.seq
        self.events.append(env)
        return env, out, ref, view

    async def _read_doorbell(self, during: str) -> bytes:
        # read() on the non-blocking pipe, waiting in wait_readable only when it is empty: the one wake-up of this
        # direction. No poll, no timer: the child's write is what wakes us, its death (EOF) too.
        fd = self.process.stdout.fileno()
        while len(self._buf) < DOORBELL.size:
            try:
                chunk = os.read(fd, 1 << 12)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(fd)
                except trio.ClosedResourceError:
                    raise await self._died(during) from None
                continue
            except OSError:
                chunk = b""
            if not chunk:
                raise await self._died(during)
            self._buf += chunk
        bell = bytes(self._buf[:DOORBELL.size])
        del self._buf[:DOORBELL.size]
        return bell

    def _release(self, ref: RecordRef, view: memoryview) -> None:
        try:
            view.release()
        except BufferError:
            pass
        self.egress.release(ref)

    async def _died(self, during: str) -> WorkerError:
        if self._broken is not None:
            return self._broken
        # EOF on stdout: the child is gone or going; its exit status follows at once
        with trio.CancelScope(shield=True):
            with trio.move_on_after(SHUTDOWN_GRACE_S):
                await self.process.wait()
            if self.process.returncode is None:
                self.process.kill()
                await self.process.wait()
        return self._break(WorkerDied(self.pid, self.process.returncode, during))

    def _break(self, exc: WorkerError) -> WorkerError:
        """Record that the worker can no longer be used; a fatal worker is killed now rather than trusted to exit."""
        if self._broken is None:
            self._broken = exc
            if self.process.returncode is None and not isinstance(exc, WorkerDied):
                self.process.kill()
        return exc

@asynccontextmanager
async def open_worker(*, device: str | None = None, arena_bytes: int = DEFAULT_ARENA_BYTES,
                      env: dict[str, str] | None = None) -> AsyncIterator[Worker]:
    """Start a worker process, initialize its device (probe included) and yield the client. On exit the worker is
    shut down (killed if it lingers). `device` is a tinygrad DEV value ("CPU", "CUDA", "CPU:X86"); None lets the
    child choose. `env` replaces the child's environment (PYTHONPATH is set so `engine` is importable)."""
    arena = Arena.create(arena_bytes)
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT_ROOT, child_env.get("PYTHONPATH")) if p)
    try:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "engine.worker_main", "--arena-fd", str(arena.fd), "--arena-bytes",
             str(arena_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, pass_fds=(arena.fd,), env=child_env)
    except OSError as exc:
        arena.close()
        raise WorkerError(f"cannot start the worker process: {exc}") from exc
    worker = Worker(process, arena)
    try:
        worker.ready = await worker._request(lambda cid: Initialize(cid, device), Ready)
        yield worker
    finally:
        await worker.aclose()
