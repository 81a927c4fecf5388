"""The worker process: one `engine.stage.Stage` driven by typed commands, answering with typed events.

Run as `python -m engine.worker_main --arena-fd FD --arena-bytes N` by `engine.worker.open_worker`.
Commands arrive as records in the arena's ingress ring, events leave as records in its egress ring
(engine.worker_records); the pipes carry only doorbells, one `RecordRef` per record: the loop blocks in read() on
stdin until the client rings, and rings the client on the event fd. The real stdout is kept (as a private,
non-inheritable fd) for doorbells only; fd 1 and `sys.stdout` are pointed at stderr, so tinygrad's DEBUG prints and
anything a compiler subprocess writes cannot corrupt the channel.

A Step's activations are read by the Stage straight from its ingress record (a numpy view of the arena: one copy,
into the device's input buffer), and its output is written into the StepDone record behind the event's fields.

Rules the loop enforces:
- a command out of order (Load before Initialize, Step before Load) or with wrong arguments is answered with a
  CommandError and the worker carries on;
- a corrupt ingress record, an unreadable command line, a failed device probe or an unexpected exception is answered
  with a Fatal naming the problem, and the process exits.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time
import traceback
from typing import NoReturn

import numpy as np

from engine.arena import (EGRESS, INGRESS, Arena, ArenaError, PayloadKind, RecordError, RecordRef, RingFull,
                          RingReader, RingWriter)
from engine.device import (DeviceChoice, DeviceError, apply_device, choose_device, cpu_choice, probe_device,
                           quick_default)
from engine.platform import current
from engine.errors import EngineError
from engine.worker_proto import (BlockTable, CommandError, Done, Event, Fatal, Initialize, Load, Loaded, Ready, Reset, Rollback,
                                 Shutdown, Step, Stopped, WireError, WorkerInfo, ZeroSlot, command_name)
from engine.worker_records import (DOORBELL, doorbell, DTYPE_NAME, KIND_BY_DTYPE, StepRecord, decode_command_record,
                                   encode_event_record, step_done_head)


# Test-only (bench/placement_bench.py, tests/test_placement.py): every step of this worker sleeps this many ms per
# layer it holds, so a peer on the same machine behaves like a slower device. Unset everywhere else.
_SLOW_MS_PER_LAYER = float(os.environ.get("MESH_TEST_SLOW_MS_PER_LAYER") or 0)


def slowdown_s(stage) -> float:
    """The sleep each step of `stage` adds under MESH_TEST_SLOW_MS_PER_LAYER (0.0 when unset), wherever the stage
    runs: this worker, or a peer's own process (engine/local_stage.py)."""
    return _SLOW_MS_PER_LAYER * (stage.end - stage.start) / 1000


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


class _Refuse(Exception):
    """Raised inside a handler to answer the current command with a CommandError."""


class Emitter:
    """Stamps events with the envelope, writes each as a record to the egress ring and rings the client."""

    def __init__(self, fd: int, egress: RingWriter | None) -> None:
        self.fd = fd
        self.egress = egress
        self.pid = os.getpid()
        self.seq = 0

    def emit(self, event: Event, reply_to: int) -> None:
        record = encode_event_record(event, reply_to, self.seq + 1, self.pid)
        self.seq += 1
        self.post([record], reply_to)

    def post(self, parts, reply_to: int) -> None:
        """One event record (its parts back to back), then its doorbell. A record that cannot be written (the
        client stopped reading) leaves a line on stderr and exits: the client then sees EOF and names the death."""
        if self.egress is None:
            raise _Exit(1)
        try:
            ref = self.egress.write_parts(reply_to, PayloadKind.MESSAGE, parts)
        except ArenaError as exc:
            print(f"worker {self.pid}: event {self.seq} cannot be written: {exc}", file=sys.stderr, flush=True)
            raise _Exit(1) from None
        view = memoryview(doorbell(ref))
        while view:
            view = view[os.write(self.fd, view):]


class WorkerLoop:
    def __init__(self, arena: Arena, emitter: Emitter) -> None:
        self.arena = arena
        self.out = emitter
        self.ingress = RingReader(arena, INGRESS)
        self.egress = RingWriter(arena, EGRESS)
        self.initialized = False
        self.stage = None
        self.last_step_id = -1
        self.handlers = {Initialize: self.on_initialize, Load: self.on_load, Step: self.on_json_step,
                         ZeroSlot: self.on_zero_slot, BlockTable: self.on_block_table, Reset: self.on_reset,
                         Rollback: self.on_rollback,
                         Shutdown: self.on_shutdown}

    # ---- dispatch ----

    def handle(self, ref: RecordRef) -> None:
        """One command record: check it, decode it, act, answer with one event record."""
        try:
            payload = self.ingress.payload(ref)
        except RecordError as exc:
            self.fatal(f"record.{exc.field}", str(exc), 0)
        try:
            cmd = decode_command_record(payload)
        except WireError as exc:
            _release(payload)
            self.ingress.release(ref)
            if exc.command is None or exc.cid is None:
                self.fatal("protocol", str(exc), 0)
            self.out.emit(CommandError(exc.command, str(exc)), exc.cid)
            return
        if type(cmd) is StepRecord:
            try:
                self.guarded(cmd.cmd, lambda: self.on_step(cmd, payload))
            finally:
                _release(payload)
                self.ingress.release(ref)  # a refused Step still consumes its record
            return
        _release(payload)
        self.ingress.release(ref)
        self.guarded(cmd, lambda: self.out.emit(self.handlers[type(cmd)](cmd), cmd.cid))

    def guarded(self, cmd, run) -> None:
        try:
            run()
        except _Refuse as exc:
            self.out.emit(CommandError(command_name(cmd), str(exc)), cmd.cid)
        except _Exit:
            raise
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            self.fatal("crash", f"{command_name(cmd)} raised {type(exc).__name__}: {exc}", cmd.cid)

    def fatal(self, kind: str, detail: str, reply_to: int) -> NoReturn:
        self.out.emit(Fatal(kind, detail), reply_to)
        raise _Exit(1)

    def _need_stage(self, what: str):
        if self.stage is None:
            raise _Refuse(f"no model is loaded: send Load before {what}")
        return self.stage

    # ---- commands ----

    def on_initialize(self, cmd: Initialize) -> Event:
        if self.initialized:
            raise _Refuse("the worker is already initialized")
        try:
            ready = initialize_device(cmd.device)
        except DeviceError as exc:
            self.fatal("device", str(exc), cmd.cid)
        self.initialized = True
        return ready

    def on_load(self, cmd: Load) -> Event:
        if not self.initialized:
            raise _Refuse("the worker is not initialized: send Initialize before Load")
        self.stage = None  # a Load replaces what was held, and frees it before loading the new range
        try:
            self.stage, info = load_stage(cmd)
        except LoadRefused as exc:
            raise _Refuse(str(exc)) from None
        self.last_step_id = -1
        return Loaded(info)

    def on_json_step(self, cmd: Step) -> Event:
        raise _Refuse("a Step travels as a step record, not as JSON")

    def on_step(self, rec: StepRecord, payload: memoryview) -> None:
        cmd = rec.cmd
        stage = self._need_stage("Step")
        if cmd.step_id <= self.last_step_id:
            raise _Refuse(f"step id {cmd.step_id} does not follow the previous step id {self.last_step_id}")
        if not cmd.columns:
            raise _Refuse("a step needs at least one column")
        hidden = None
        if stage.first:
            if rec.act_kind:
                raise _Refuse("the first stage takes tokens from the columns, not input activations")
        else:
            if not rec.act_kind:
                raise _Refuse(f"stage [{stage.start}, {stage.end}) needs input activations, none were given")
            want = np.dtype(stage.act_dtype)
            if np.dtype(DTYPE_NAME[rec.act_kind]) != want or rec.dim != stage.meta.dim:
                raise _Refuse(f"input holds {len(cmd.columns)}x{rec.dim} {np.dtype(DTYPE_NAME[rec.act_kind])} "
                              f"values, the stage needs {len(cmd.columns)}x{stage.meta.dim} {want}")
            # a view of the record: the Stage copies it once, into its device input buffer
            hidden = np.frombuffer(payload, want, len(cmd.columns) * rec.dim, rec.act_offset)
            hidden = hidden.reshape(len(cmd.columns), rec.dim)
        if not cmd.per_column and len(cmd.sampling) != 1:
            raise _Refuse(f"{len(cmd.sampling)} sampling entries where one applies to all columns")
        t0 = time.perf_counter()
        try:
            out = stage.step(cmd.columns, hidden, cmd.sampling if cmd.per_column else cmd.sampling[0])
        except EngineError as exc:
            raise _Refuse(f"{type(exc).__name__}: {exc}") from None
        finally:
            del hidden
        if _SLOW_MS_PER_LAYER:  # test-only: a device this many ms per layer slower (a sleep: it costs no CPU)
            time.sleep(slowdown_s(stage))
        compute_ms = (time.perf_counter() - t0) * 1000
        self.last_step_id = cmd.step_id
        out = np.ascontiguousarray(out)
        kind = KIND_BY_DTYPE.get(out.dtype.name)
        if kind is None:
            self.fatal("output", f"step {cmd.step_id} output has dtype {out.dtype}, no ring kind", cmd.cid)
        rows, cols = (out.shape[0], 1) if out.ndim == 1 else out.shape
        out_ = self.out
        out_.seq += 1
        head = step_done_head(cmd.cid, out_.seq, out_.pid, cmd.step_id, compute_ms, kind, rows, cols)
        try:
            ref = self.egress.write_parts(cmd.cid, PayloadKind.MESSAGE, (head, out.reshape(-1).view(np.uint8)))
        except RingFull as exc:
            out_.seq -= 1
            self.fatal("ring_full", f"step {cmd.step_id} output could not be written: {exc}", cmd.cid)
        except ArenaError as exc:
            out_.seq -= 1
            self.fatal("output", f"step {cmd.step_id} output could not be written: {exc}", cmd.cid)
        view = memoryview(doorbell(ref))
        while view:
            view = view[os.write(out_.fd, view):]

    def _stage_call(self, what: str, fn, *args) -> Event:
        self._need_stage(what)
        try:
            fn(*args)
        except EngineError as exc:
            raise _Refuse(f"{type(exc).__name__}: {exc}") from None
        return Done(what)

    def on_zero_slot(self, cmd: ZeroSlot) -> Event:
        return self._stage_call("ZeroSlot", lambda: self.stage.zero_slot(cmd.slot))

    def on_block_table(self, cmd: BlockTable) -> Event:
        return self._stage_call("BlockTable", lambda: self.stage.block_table(cmd.slot, cmd.blocks))

    def on_reset(self, cmd: Reset) -> Event:
        return self._stage_call("Reset", lambda: self.stage.reset())

    def on_rollback(self, cmd: Rollback) -> Event:
        return self._stage_call("Rollback", lambda: self.stage.rollback(cmd.slot, cmd.pos))

    def on_shutdown(self, cmd: Shutdown) -> Event:
        self.out.emit(Stopped("shutdown"), cmd.cid)
        raise _Exit(0)


class LoadRefused(Exception):
    """A Load that cannot be carried out (bad arguments, or the Stage raised an EngineError): the reason."""


def initialize_device(requested: str | None) -> Ready:
    """Choose the device (with its fallbacks), make it tinygrad's default in this process and probe it; a METAL that
    fails its probe falls back to the CPU. Raises DeviceError. The worker's Initialize, and a peer that runs its
    stage in its own process (engine.local_stage), both start here."""
    choice = choose_device(requested, default=quick_default)
    apply_device(choice)
    try:
        probe = probe_device()
    except DeviceError as exc:
        # METAL -> CPU: a Mac whose Metal does not work (a VM, a broken driver) still serves on its CPU
        if choice.selected.split(":")[0].upper() != "METAL":
            raise
        cpu = cpu_choice(choice.requested, current())
        choice = DeviceChoice(choice.requested, cpu.selected, cpu.compiler,
                              "; ".join(r for r in (f"METAL failed its probe: {exc}", cpu.reason) if r))
        apply_device(choice)
        probe = probe_device()
    return Ready(choice.requested, choice.selected, choice.compiler, choice.reason, probe.values, probe.ms)


def load_stage(cmd: Load):
    """(Stage, WorkerInfo) for a Load: its arguments checked, the range loaded and its step shapes compiled
    (`Stage.warmup`), so that the first steps of a session do not wait seconds for tinygrad. Raises LoadRefused."""
    if not os.path.isfile(cmd.path):
        raise LoadRefused(f"model file {cmd.path!r} does not exist or is not a file")
    if not 0 <= cmd.start < cmd.end:
        raise LoadRefused(f"layer range [{cmd.start}, {cmd.end}) is empty or negative")
    if cmd.n_slots < 1 or cmd.max_context < 1:
        raise LoadRefused(f"n_slots ({cmd.n_slots}) and max_context ({cmd.max_context}) must be at least 1")
    if not 0 <= cmd.warmup <= cmd.n_slots:
        raise LoadRefused(f"warmup ({cmd.warmup}) must lie in [0, n_slots = {cmd.n_slots}]")
    if cmd.kv_blocks < 0:
        raise LoadRefused(f"kv_blocks ({cmd.kv_blocks}) must be at least 1, or 0 for the default")
    from engine.stage import Stage
    t0 = time.perf_counter()
    gc.unfreeze()        # what the last load froze may be garbage now (in a cycle): the collector sees it again
    try:
        stage = Stage.load(cmd.path, cmd.start, cmd.end, n_slots=cmd.n_slots, max_context=cmd.max_context,
                           kv_blocks=cmd.kv_blocks or None)
        load_ms = (time.perf_counter() - t0) * 1000
        warm = stage.warmup(decode_batch=cmd.warmup) if cmd.warmup else None
    except EngineError as exc:
        raise LoadRefused(f"{type(exc).__name__}: {exc}") from None
    # A loaded, warmed stage holds ~600 thousand gc-tracked objects (tinygrad's lowered kernels). A full collection
    # scans them all, 0.3-1.3 s on a CPU, and one triggered by a step's allocations would stall the chain that
    # long. Collected once here and frozen (in the worker, or the peer that holds the stage), they stay out of
    # every later scan; what the process makes afterwards is collected as usual.
    gc.collect()
    gc.freeze()
    return stage, WorkerInfo(start=stage.start, end=stage.end, total=stage.meta.n_layers, dim=stage.meta.dim,
                             act_dtype=np.dtype(stage.act_dtype).name, weight_bytes=int(stage.weight_bytes),
                             kv_bytes=int(stage.kv_bytes), fingerprint=stage.meta.fingerprint, load_ms=load_ms,
                             warmup_ms=warm.ms if warm else 0.0, warmup_shapes=warm.shapes if warm else 0,
                             kv_blocks=stage.kv_blocks, kv_block_size=stage.kv_block_size)


def _release(view: memoryview) -> None:
    try:
        view.release()
    except BufferError:
        pass  # something still holds a view of the record; the arena mapping outlives it, the ring moves on


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="engine.worker_main")
    parser.add_argument("--arena-fd", type=int, required=True)
    parser.add_argument("--arena-bytes", type=int, required=True)
    args = parser.parse_args(argv)

    # the client owns this process's life (Shutdown, or EOF on stdin when it goes away); a Ctrl-C in the terminal
    # reaches the whole process group and must not kill the worker under a client that is still shutting down
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    event_fd = os.dup(1)  # non-inheritable: compiler subprocesses never see the event channel
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        arena = Arena.attach(args.arena_fd, args.arena_bytes)
    except ArenaError as exc:
        print(f"worker {os.getpid()}: {exc}", file=sys.stderr, flush=True)
        return 1  # no ring to answer in: the client sees EOF and names the exit
    loop = WorkerLoop(arena, None)
    loop.out = Emitter(event_fd, loop.egress)
    stdin = sys.stdin.buffer
    try:
        while True:
            bell = stdin.read(DOORBELL.size)  # blocks until the client rings: the one wake-up of this direction
            if not bell:
                return 0  # the client went away: nobody is left to answer
            if len(bell) != DOORBELL.size:
                loop.fatal("protocol", f"doorbell of {len(bell)} bytes, expected {DOORBELL.size}", 0)
            loop.handle(RecordRef(*DOORBELL.unpack(bell)))
    except _Exit as exc:
        return exc.code
    except BrokenPipeError:
        return 1
    finally:
        del loop
        arena.close()


if __name__ == "__main__":
    sys.exit(main())
