"""The client of a worker process: a Stage that lives in a child process, driven over trio.

    async with open_worker(device="CPU") as w:
        info = await w.load(path, 0, 15, n_slots=4, max_context=2048)
        hidden = await w.step(cols, None, sampling)

Control messages are JSON lines on the child's stdin/stdout (engine.worker_proto); activations and token ids go
through a shared-memory arena of two rings (engine.arena). Commands are answered one at a time, in order; a lock
serializes callers. The reply is read by the call that awaits it: when the child dies its stdout reaches EOF at once,
so a caller waiting for a reply gets `WorkerDied` promptly, with the exit code or signal.

Callers own timeouts (`trio.fail_after` around any call). A reply that arrives after its caller was cancelled is
recognized by its `reply_to` and discarded (its output record is consumed so the ring stays in step).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import numpy as np
import trio

from engine.arena import (EGRESS, INGRESS, RECORD_HEADER_LEN, Arena, ArenaError, RecordError, RecordRef,
                          RingReader, RingWriter)
from engine.errors import EngineError
from engine.worker_proto import (MAX_LINE, BlockTable, Command, CommandError, Done, Envelope, Fatal, Initialize,
                                 Load, Loaded, Ready, Reset, Rollback, Shutdown, Step, StepDone, Stopped, WireColumn,
                                 WireError, WorkerInfo, ZeroSlot, command_name, compact_sampling, decode_event,
                                 encode_command)

__all__ = ["open_worker", "Worker", "WorkerInfo", "WorkerError", "WorkerDied", "WorkerFatal", "WorkerCommandError",
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


def _wire_columns(cols: Sequence[Any]) -> tuple[WireColumn, ...]:
    return tuple(WireColumn(int(c.pos), int(c.slot), bool(c.needs_logits), int(c.token)) for c in cols)


def _wire_sampling(sampling: Any) -> tuple[tuple[dict[str, Any], ...], bool]:
    per_column = isinstance(sampling, (list, tuple))
    out = []
    for s in (sampling if per_column else [sampling]):
        if not dataclasses.is_dataclass(s) or isinstance(s, type):
            raise WorkerCommandError("Step", f"sampling must be an engine.stage.Sampling or a sequence of them, "
                                             f"got {type(s).__name__}")
        fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
        out.append({k: v.item() if isinstance(v, np.generic) else v for k, v in fields.items()})
    if all(compact_sampling(s) for s in out):
        return tuple(out), per_column  # plain finite numbers: nothing for the encoder to refuse
    try:
        json.dumps(out, allow_nan=False)  # refuse here, before a step's input is written to the ring
    except (TypeError, ValueError) as exc:
        raise WorkerCommandError("Step", f"sampling cannot be sent: {exc}") from None
    return tuple(out), per_column


class Worker:
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
        # CLOCK_MONOTONIC in ms (the envelope's mono_ms clock) when the last command line went out and the last event
        # line was taken in: with an event's mono_ms and compute_ms they split a round trip into its legs
        self.sent_mono_ms = 0.0
        self.received_mono_ms = 0.0
        # Poll for a step's reply around the time it is due instead of sleeping through it (see _poll_window_for)
        self.poll = True
        self._compute_s: dict[int, float] = {}  # the last step's compute time, per column count
        self._poll_window: tuple[float, float] | None = None
        self._lock = trio.StrictFIFOLock()
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

    def _loaded(self) -> WorkerInfo:
        if self.info is None:
            raise WorkerError(f"worker process {self.pid} has no model loaded")
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

    async def step(self, cols: Sequence[Any], hidden: np.ndarray | None, sampling: Any) -> np.ndarray:
        """Like `Stage.step`: (len(cols), dim) activations for a non-last stage, int32 token ids for the last."""
        await self._acquire()
        try:
            self._check_usable()
            wire = self._wire_step(cols, sampling)  # everything that can refuse goes before the ring write
            step_id = self._next_step_id()
            ref = None
            if hidden is not None:
                try:
                    ref = self.ingress.write(step_id, np.ascontiguousarray(hidden))
                except ArenaError as exc:
                    self._step_id -= 1
                    raise WorkerCommandError("Step", str(exc)) from None
            return await self._step_locked(step_id, wire, len(cols), ref)
        finally:
            self._lock.release()

    async def step_record(self, cols: Sequence[Any], ref: RecordRef | None, sampling: Any) -> np.ndarray:
        """`step` with an input the caller already wrote to the ingress ring, as
        `w.ingress.write(w.next_step_id, array)`. Lets a caller (or a test) place the record itself."""
        async with self._lock:
            wire = self._wire_step(cols, sampling)
            return await self._step_locked(self._next_step_id(), wire, len(cols), ref)

    @property
    def next_step_id(self) -> int:
        return self._step_id + 1

    def _next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

    def _wire_step(self, cols: Sequence[Any], sampling: Any) -> tuple[Any, ...]:
        if self.info is not None and not self.info.last:
            need = len(cols) * self.info.dim * np.dtype(self.info.act_dtype).itemsize + RECORD_HEADER_LEN
            if need > self.arena.capacity:
                raise WorkerCommandError("Step", f"{len(cols)} columns need {need} bytes of the egress ring, it "
                                                 f"holds {self.arena.capacity}; open the worker with a larger arena")
        return (_wire_columns(cols), *_wire_sampling(sampling))

    async def _step_locked(self, step_id: int, wire: tuple[Any, ...], n_cols: int, ref: RecordRef | None) -> np.ndarray:
        cols, sampling, per_column = wire
        self._poll_window = self._poll_window_for(n_cols)
        try:
            ev = await self._request_locked(lambda cid: Step(cid, step_id, cols, sampling, per_column, ref), StepDone)
        finally:
            self._poll_window = None
        self._compute_s[n_cols] = ev.compute_ms / 1000
        if ev.step_id != step_id or ev.output.object_id != step_id:
            raise self._break(WorkerFatal("protocol", f"step {step_id} answered for step {ev.step_id} "
                                                      f"(object {ev.output.object_id})"))
        out = self._take(ev.output)
        if self.info is not None and not self.info.last:
            out = out.reshape(n_cols, self.info.dim)
        return out

    def _poll_window_for(self, n_cols: int) -> tuple[float, float] | None:
        """When to stop sleeping on the pipe and start polling it, and when to give up polling (perf_counter).

        A process that sleeps through a 50-120 ms step wakes ~220 us after the child's write on this VM (the idle
        vCPU halts; the waker's IPI brings it back), against ~50 us when it is still running. The last step of the
        same width predicts this one's compute well (decode steps are within a few percent), so the caller sleeps
        until just before the reply is due, then polls the pipe, yielding to its other tasks between polls, for a
        bounded window (3% of the step + 2.3 ms); a reply that comes later is waited for as before. Measured on
        SmolLM2: the event-to-read leg ~270 -> ~50 us a call, compute unchanged (NOTES "Worker process")."""
        expect = self._compute_s.get(n_cols) if self.poll else None
        if expect is None:
            return None
        start = time.perf_counter() + 0.97 * expect - 0.0003
        return start, start + 0.03 * expect + 0.0023

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
            return await self._request_locked(make, expect, closing=closing)

    async def _acquire(self) -> None:
        # A decode step takes the lock uncontended; acquire() would still pass through trio's scheduler once.
        # The wait for the reply is the step's checkpoint.
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    async def _request_locked(self, make: Any, expect: type, *, closing: bool = False) -> Any:
        if self._closed and not closing:
            raise WorkerError(f"worker process {self.pid} is closed")
        self._check_usable()
        self._cid += 1
        cmd: Command = make(self._cid)
        try:
            line = encode_command(cmd)
        except (TypeError, ValueError) as exc:  # json: a numpy scalar, NaN, an object
            raise WorkerCommandError(command_name(cmd), f"arguments cannot be sent: {exc}") from None
        await self._send(command_name(cmd), line)
        while True:
            env = await self._next_event(command_name(cmd))
            ev = env.event
            if isinstance(ev, Fatal):
                raise self._break(WorkerFatal(ev.kind, ev.detail))
            if env.reply_to != cmd.cid:
                if env.reply_to < cmd.cid:
                    self._discard_stale(env)
                    continue
                raise self._break(WorkerFatal("protocol", f"reply to command {env.reply_to} before command "
                                                          f"{cmd.cid} was answered"))
            if isinstance(ev, CommandError):
                raise WorkerCommandError(ev.command, ev.reason)
            if not isinstance(ev, expect):
                raise self._break(WorkerFatal("protocol", f"{command_name(cmd)} was answered with "
                                                          f"{type(ev).__name__}, expected {expect.__name__}"))
            return ev

    def _discard_stale(self, env: Envelope) -> None:
        # the caller of that command was cancelled; its output record still has to be consumed in order
        if isinstance(env.event, StepDone):
            self._take(env.event.output)

    def _take(self, ref: RecordRef) -> np.ndarray:
        try:
            return self.egress.take(ref)
        except RecordError as exc:
            raise self._break(WorkerFatal(f"record.{exc.field}", str(exc))) from None

    async def _send(self, name: str, line: bytes) -> None:
        # The line goes straight to the non-blocking pipe: a step's line is far below the pipe's buffer and the
        # child drains stdin between commands, so one write() takes it whole without a trip through the scheduler.
        # What does not fit goes through the stream, shielded: a half-written command line would desynchronize the
        # channel for good.
        self.sent_mono_ms = time.monotonic_ns() / 1e6
        try:
            sent = os.write(self.process.stdin.fileno(), line)
        except BlockingIOError:
            sent = 0
        except OSError:  # EPIPE: the child is gone; EBADF: the pipe was closed
            raise await self._died(name) from None
        if sent < len(line):
            with trio.CancelScope(shield=True):
                try:
                    await self.process.stdin.send_all(memoryview(line)[sent:])
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    raise await self._died(name) from None

    async def _next_event(self, during: str) -> Envelope:
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                self.received_mono_ms = time.monotonic_ns() / 1e6
                line = bytes(self._buf[:nl])
                del self._buf[:nl + 1]
                return self._decode(line)
            if len(self._buf) > MAX_LINE:
                raise self._break(WorkerFatal("protocol", f"event line longer than {MAX_LINE} bytes"))
            # read() on the non-blocking pipe, waiting only when it is empty: the stream's receive_some would add a
            # pass through the scheduler before it looks
            fd = self.process.stdout.fileno()
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                window = self._poll_window
                try:
                    if window is not None and (now := time.perf_counter()) < window[1]:
                        if now < window[0]:  # sleep until the reply is nearly due (or comes early)
                            with trio.move_on_after(window[0] - now):
                                await trio.lowlevel.wait_readable(fd)
                        else:  # poll: the other tasks run between two reads
                            await trio.lowlevel.checkpoint()
                    else:
                        await trio.lowlevel.wait_readable(fd)
                except trio.ClosedResourceError:
                    raise await self._died(during) from None
                continue
            except OSError:
                chunk = b""
            if not chunk:
                raise await self._died(during)
            self._buf += chunk

    def _decode(self, line: bytes) -> Envelope:
        try:
            env = decode_event(line)
        except WireError as exc:
            raise self._break(WorkerFatal("protocol", f"bad event line: {exc}")) from None
        if env.seq != self._last_seq + 1:
            raise self._break(WorkerFatal("protocol", f"event sequence {env.seq} after {self._last_seq}"))
        if env.pid != self.pid:
            raise self._break(WorkerFatal("protocol", f"event from pid {env.pid}, the worker is {self.pid}"))
        self._last_seq = env.seq
        self.events.append(env)
        return env

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
