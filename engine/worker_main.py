"""The worker process: one `engine.stage.Stage` driven by typed commands on stdin, answering with typed events.

Run as `python -m engine.worker_main --arena-fd FD --arena-bytes N` by `engine.worker.open_worker`.
The real stdout is kept (as a private, non-inheritable fd) for events only; fd 1 and `sys.stdout` are pointed at
stderr, so tinygrad's DEBUG prints and anything a compiler subprocess writes cannot corrupt the event channel.

Rules the loop enforces:
- a command out of order (Load before Initialize, Step before Load) or with wrong arguments is answered with a
  CommandError and the worker carries on;
- a corrupt ingress record, an unreadable command line, a failed device probe or an unexpected exception is answered
  with a Fatal naming the problem, and the process exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from typing import NoReturn

import numpy as np

from engine.arena import EGRESS, INGRESS, Arena, ArenaError, RecordError, RingFull, RingReader, RingWriter
from engine.device import (DeviceChoice, DeviceError, apply_device, choose_device, cpu_choice, probe_device,
                           quick_default)
from engine.platform import current
from engine.errors import EngineError
from engine.worker_proto import (MAX_LINE, BlockTable, CommandError, Done, Event, Fatal, Initialize, Load, Loaded,
                                 Ready, Reset, Rollback, Shutdown, Step, StepDone, Stopped, WireError, WorkerInfo,
                                 ZeroSlot, command_name, decode_command, encode_event)


# Test-only (bench/placement_bench.py, tests/test_placement.py): every step of this worker sleeps this many ms per
# layer it holds, so a peer on the same machine behaves like a slower device. Unset everywhere else.
_SLOW_MS_PER_LAYER = float(os.environ.get("MESH_TEST_SLOW_MS_PER_LAYER") or 0)


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


class _Refuse(Exception):
    """Raised inside a handler to answer the current command with a CommandError."""


class Emitter:
    """Stamps events with the envelope and writes them, one line each, to the event fd."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pid = os.getpid()
        self.seq = 0

    def emit(self, event: Event, reply_to: int) -> None:
        self.seq += 1
        line = encode_event(event, seq=self.seq, wall_ms=time.time_ns() / 1e6, mono_ms=time.monotonic_ns() / 1e6,
                            span_id=f"worker-{self.pid}/{self.seq}/{type(event).__name__}", pid=self.pid,
                            reply_to=reply_to)
        view = memoryview(line)
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
        self.handlers = {Initialize: self.on_initialize, Load: self.on_load, Step: self.on_step,
                         ZeroSlot: self.on_zero_slot, BlockTable: self.on_block_table, Reset: self.on_reset,
                         Rollback: self.on_rollback,
                         Shutdown: self.on_shutdown}

    # ---- dispatch ----

    def handle(self, line: bytes) -> None:
        try:
            cmd = decode_command(line)
        except WireError as exc:
            if exc.command is None or exc.cid is None:
                self.fatal("protocol", str(exc), 0)
            self.out.emit(CommandError(exc.command, str(exc)), exc.cid)
            return
        try:
            self.out.emit(self.handlers[type(cmd)](cmd), cmd.cid)
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
            choice = choose_device(cmd.device, default=quick_default)
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
        except DeviceError as exc:
            self.fatal("device", str(exc), cmd.cid)
        self.initialized = True
        return Ready(choice.requested, choice.selected, choice.compiler, choice.reason, probe.values, probe.ms)

    def on_load(self, cmd: Load) -> Event:
        if not self.initialized:
            raise _Refuse("the worker is not initialized: send Initialize before Load")
        self.stage = None  # a Load replaces what was held, and frees it before loading the new range
        if not os.path.isfile(cmd.path):
            raise _Refuse(f"model file {cmd.path!r} does not exist or is not a file")
        if not 0 <= cmd.start < cmd.end:
            raise _Refuse(f"layer range [{cmd.start}, {cmd.end}) is empty or negative")
        if cmd.n_slots < 1 or cmd.max_context < 1:
            raise _Refuse(f"n_slots ({cmd.n_slots}) and max_context ({cmd.max_context}) must be at least 1")
        if not 0 <= cmd.warmup <= cmd.n_slots:
            raise _Refuse(f"warmup ({cmd.warmup}) must lie in [0, n_slots = {cmd.n_slots}]")
        if cmd.kv_blocks < 0:
            raise _Refuse(f"kv_blocks ({cmd.kv_blocks}) must be at least 1, or 0 for the default")
        from engine.stage import Stage
        t0 = time.perf_counter()
        try:
            stage = Stage.load(cmd.path, cmd.start, cmd.end, n_slots=cmd.n_slots, max_context=cmd.max_context,
                               kv_blocks=cmd.kv_blocks or None)
            load_ms = (time.perf_counter() - t0) * 1000
            # compile every step shape now, so that the first steps of a session (and a prompt of a new length)
            # do not wait seconds for tinygrad: Loaded means ready to step at full speed
            warm = stage.warmup(decode_batch=cmd.warmup) if cmd.warmup else None
        except EngineError as exc:
            raise _Refuse(f"{type(exc).__name__}: {exc}") from None
        self.stage = stage
        self.last_step_id = -1
        return Loaded(WorkerInfo(start=stage.start, end=stage.end, total=stage.meta.n_layers, dim=stage.meta.dim,
                                 act_dtype=np.dtype(stage.act_dtype).name, weight_bytes=int(stage.weight_bytes),
                                 kv_bytes=int(stage.kv_bytes), fingerprint=stage.meta.fingerprint, load_ms=load_ms,
                                 warmup_ms=warm.ms if warm else 0.0, warmup_shapes=warm.shapes if warm else 0,
                                 kv_blocks=stage.kv_blocks, kv_block_size=stage.kv_block_size))

    def on_step(self, cmd: Step) -> Event:
        hidden = None
        if cmd.input is not None:
            try:
                hidden = self.ingress.view(cmd.input)
            except RecordError as exc:
                self.fatal(f"record.{exc.field}", str(exc), cmd.cid)
        try:
            return self._step(cmd, hidden)
        finally:
            if cmd.input is not None:
                del hidden
                self.ingress.release(cmd.input)

    def _step(self, cmd: Step, hidden: np.ndarray | None) -> Event:
        stage = self._need_stage("Step")
        from common.values import Column, Sampling
        if cmd.step_id <= self.last_step_id:
            raise _Refuse(f"step id {cmd.step_id} does not follow the previous step id {self.last_step_id}")
        if not cmd.columns:
            raise _Refuse("a step needs at least one column")
        if stage.first:
            if cmd.input is not None:
                raise _Refuse("the first stage takes tokens from the columns, not an input record")
        else:
            if cmd.input is None:
                raise _Refuse(f"stage [{stage.start}, {stage.end}) needs input activations, none were given")
            if cmd.input.object_id != cmd.step_id:
                raise _Refuse(f"input record object id {cmd.input.object_id} is not the step id {cmd.step_id}")
            want = np.dtype(stage.act_dtype)
            if hidden.dtype != want or hidden.size != len(cmd.columns) * stage.meta.dim:
                raise _Refuse(f"input holds {hidden.size} {hidden.dtype} values, the stage needs "
                              f"{len(cmd.columns)}x{stage.meta.dim} {want}")
            hidden = hidden.reshape(len(cmd.columns), stage.meta.dim)
        try:
            cols = [Column(c.pos, c.slot, c.needs_logits, c.token) for c in cmd.columns]
            samplings = [Sampling(**s) for s in cmd.sampling]
        except (TypeError, ValueError, EngineError) as exc:
            raise _Refuse(f"bad columns or sampling: {exc}") from None
        if not cmd.per_column and len(samplings) != 1:
            raise _Refuse(f"{len(samplings)} sampling entries where one applies to all columns")
        sampling = samplings if cmd.per_column else samplings[0]
        t0 = time.perf_counter()
        try:
            out = stage.step(cols, hidden, sampling)
        except EngineError as exc:
            raise _Refuse(f"{type(exc).__name__}: {exc}") from None
        if _SLOW_MS_PER_LAYER:  # test-only: a device this many ms per layer slower (a sleep: it costs no CPU)
            time.sleep(_SLOW_MS_PER_LAYER * (stage.end - stage.start) / 1000)
        compute_ms = (time.perf_counter() - t0) * 1000
        self.last_step_id = cmd.step_id
        try:
            ref = self.egress.write(cmd.step_id, np.ascontiguousarray(out))
        except RingFull as exc:
            self.fatal("ring_full", f"step {cmd.step_id} output could not be written: {exc}", cmd.cid)
        except ArenaError as exc:
            self.fatal("output", f"step {cmd.step_id} output could not be written: {exc}", cmd.cid)
        return StepDone(cmd.step_id, ref, compute_ms)

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
    emitter = Emitter(event_fd)
    try:
        arena = Arena.attach(args.arena_fd, args.arena_bytes)
    except ArenaError as exc:
        emitter.emit(Fatal("arena", str(exc)), 0)
        return 1
    loop = WorkerLoop(arena, emitter)
    stdin = sys.stdin.buffer
    try:
        while True:
            line = stdin.readline(MAX_LINE + 1)
            if not line:
                return 0  # the client went away: nobody is left to answer
            if not line.endswith(b"\n"):
                loop.fatal("protocol", f"command line longer than {MAX_LINE} bytes or cut short", 0)
            if line.strip():
                loop.handle(line)
    except _Exit as exc:
        return exc.code
    except BrokenPipeError:
        return 1
    finally:
        del loop
        arena.close()


if __name__ == "__main__":
    sys.exit(main())
