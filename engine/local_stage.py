"""A stage run in the calling process, behind the worker client's API: what a peer uses on its hot path.

    async with open_stage_host(device=None) as host:    # a LocalStage in this process (or a worker process)
        info = await host.load(path, 10, 20, n_slots=4, max_context=2048)
        out = await host.step_raw(cols, data, kind, dim, sampling)

Why (issue 10): a token crossing a stage that lives in a worker process wakes two more processes (the doorbell in,
the doorbell out) and runs the step's Python on both sides of the pipe, each part with caches the last compute
emptied. On 2 shared cores that was ~0.75 ms a stage of the ~2 ms on the token's path; on the H200 (8B Q4_0, 3
peers, bench/RESULTS.md "sixth session") the worker's hop cost 0.7 ms a stage: 0.478 of unsharded with workers,
0.637 with the stage in the peer. So `open_stage_host` runs the stage in the caller on every device
(MESH_STAGE_IN_PEER: "auto", the default, and "1"; "0": a worker process).

What the worker process gave, and where it went: it isolated a device that can crash its process or hang in a
driver. With the stage in the peer, such a crash or hang takes the peer down or silences it, and the coordinator
names the peer that is gone (its heartbeats stop), as for any lost peer. The device's choice, set-up, fallbacks
and probe run here by the same code as in a worker (`engine.worker_main.initialize_device`). A Peer embedded in a
process that does other things (tests, benches) keeps the worker by default (PeerConfig.stage_in_peer "0").

A step of a shape this stage has run before (`_shape_key`) is run inline, in the trio thread: the event loop stops for the
step (10-40 ms of a decode step on SmolLM2's CPU, ~1.3 ms of an 8B third on the H200), as it would wait for the
worker's reply anyway, and no thread or process is woken on the way. A step of a shape not seen yet may compile for
seconds (a stage loaded without warmup), so it runs in a thread: the peer's links keep answering heartbeats
meanwhile. Loads run in a thread too. A failure inside the Stage (EngineError) is `WorkerCommandError`, as from a
worker; the process can crash only with the peer, and the coordinator names a peer that is gone.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Sequence

import numpy as np
import trio

from common.values import Column, Sampling, SamplingArg
from engine.arena import PayloadKind
from engine.errors import EngineError
from engine.worker import LoadedRange, PostedStep, StepOut, WorkerCommandError, WorkerError, open_worker
from engine.worker_proto import Load, Ready, WorkerInfo
from engine.worker_records import DTYPE_NAME, KIND_BY_DTYPE

__all__ = ["LocalStage", "open_stage_host", "stage_in_process"]

# tinygrad's compiler and caches are not made for two threads at once. Loads and new shapes run in threads (one per
# LocalStage, and a test process may hold several stages): they take this lock; an inline step (a replay of compiled
# kernels) runs only while no thread holds it.
_TINYGRAD = threading.Lock()
# a step output's payload kind by its numpy dtype (numpy's `dtype.name` is Python code: ~28 us cold, per step)
_KIND_OF = {np.dtype(name): kind for name, kind in KIND_BY_DTYPE.items()}


def _locked(fn, *args):
    with _TINYGRAD:
        return fn(*args)


def stage_in_process(device: str | None = None, env: dict | None = None, default: str = "auto") -> bool:
    """Whether a peer runs its stage in its own process: MESH_STAGE_IN_PEER (else `default`) "0" never (a worker
    process), "1" and "auto" always, whatever the device (the module's docstring says why)."""
    env = os.environ if env is None else env
    mode = env.get("MESH_STAGE_IN_PEER", default)
    if mode not in ("0", "1", "auto"):
        raise ValueError(f"MESH_STAGE_IN_PEER={mode!r}: expected auto, 1 or 0")
    return mode != "0"


class LocalStage(LoadedRange):
    """The worker client's API over a Stage held by this process. Build it with `open_stage_host`."""
    _holder = "process"

    def __init__(self, ready: Ready) -> None:
        self.ready = ready
        self.pid = os.getpid()
        self.info: WorkerInfo | None = None
        self.stage = None
        self._delay = 0.0
        self._seen: set = set()                       # step shapes run before: these run inline
        self._lock = trio.Semaphore(1, max_value=1)
        self._closed = False
        self._bytes = os.environ.get("MESH_STEP_BYTES", "1") != "0"   # step_now's bytes lane (A/B: 0 leaves it)

    # ---- what the peer and mesh.speed use of a worker ----
    async def load(self, path, start: int, end: int, *, n_slots: int = 4, max_context: int = 2048,
                   warmup: int = 1, kv_blocks: int = 0) -> WorkerInfo:
        from engine.worker_main import LoadRefused, load_stage, slowdown_s
        async with self._lock:
            self._check_open()
            self.info, self.stage, self._seen = None, None, set()  # the old range is freed before the new loads
            try:
                stage, info = await trio.to_thread.run_sync(_locked, load_stage, Load(
                    0, os.fspath(path), start, end, n_slots, max_context, warmup, kv_blocks))
            except LoadRefused as exc:
                raise WorkerCommandError("Load", str(exc)) from None
            self.stage, self.info = stage, info
            self._delay = slowdown_s(stage)   # test-only slowness (MESH_TEST_SLOW_MS_PER_LAYER), as in a worker
            if warmup:   # Stage.warmup compiled the decode widths up to `warmup` and the prefill chunks
                self._seen.update(((1,) * n, (True,) * n, g) for n in range(1, warmup + 1) for g in (True, False))
            return info

    async def step(self, cols: Sequence[Column], hidden: np.ndarray | None, sampling: SamplingArg) -> np.ndarray:
        async with self._lock:
            return np.array(await self._step(cols, hidden, sampling), copy=True)

    async def step_raw(self, cols: Sequence[Column], data, kind: int, dim: int, sampling: SamplingArg) -> StepOut:
        """`Worker.step_raw`: `data` (bytes-like, len(cols) x dim values of `kind`, or None) is read in place; the
        output comes back as bytes. Inline when `runs_inline`, else in a thread."""
        if self._lock.value and self.runs_inline(cols, sampling):
            try:
                return self.step_now(cols, data, kind, dim, sampling)
            except trio.WouldBlock:     # a thread of another stage of this process took tinygrad meanwhile
                pass
        hidden = _hidden(cols, data, kind, dim)
        async with self._lock:
            t0 = time.monotonic_ns()
            out = await self._step(cols, hidden, sampling)
            return _step_out(out, t0, time.monotonic_ns())

    def runs_inline(self, cols: Sequence[Column], sampling: SamplingArg = None) -> bool:
        """Whether a step of these columns has a shape this stage ran before (compiled: `step_now` may run it)."""
        return _shape_key(cols, sampling) in self._seen and not _TINYGRAD.locked()

    def step_now(self, cols: Sequence[Column], data, kind: int, dim: int, sampling: SamplingArg) -> StepOut:
        """`step_raw` synchronously, in the calling thread (a Link reader's hook, or the trio thread): for shapes
        that `runs_inline`. trio.WouldBlock when another call holds the stage."""
        # float32 rows as they came (bytes), or none: the bytes lane first (Stage.step_bytes, a decode step replayed
        # before: bytes in, bytes out, no numpy arrays between), else `step` as for any other
        lane = self._bytes and (data is None or (kind == PayloadKind.ACT_F32 and type(data) is bytes))
        hidden = None if lane else _hidden(cols, data, kind, dim)
        if not _TINYGRAD.acquire(blocking=False):
            raise trio.WouldBlock
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            _TINYGRAD.release()
            raise
        try:
            self._check_open()
            if self.stage is None:
                raise WorkerCommandError("Step", "no model is loaded: send Load before Step")
            t0 = time.monotonic_ns()
            try:
                fast = self.stage.step_bytes(cols, data, sampling) if lane else None
                if fast is None:
                    out = self.stage.step(cols, _hidden(cols, data, kind, dim) if lane else hidden, sampling)
            except EngineError as exc:
                raise WorkerCommandError("Step", f"{type(exc).__name__}: {exc}") from None
            if self._delay:
                time.sleep(self._delay)
            t1 = time.monotonic_ns()
            if fast is None:
                return _step_out(out, t0, t1)
            dtype, shape, raw = fast
            done = t1 / 1e6
            return StepOut(_KIND_OF[dtype], shape[0], shape[1] if len(shape) > 1 else 1, raw,
                           (t1 - t0) / 1e6, t0 / 1e6, done, done)
        finally:
            self._lock.release()
            _TINYGRAD.release()

    async def _step(self, cols, hidden, sampling) -> np.ndarray:
        self._check_open()
        stage = self.stage
        if stage is None:
            raise WorkerCommandError("Step", "no model is loaded: send Load before Step")
        key = _shape_key(cols, sampling)
        try:
            if key in self._seen and _TINYGRAD.acquire(blocking=False):   # compiled: inline, nothing woken
                try:
                    out = stage.step(cols, hidden, sampling)
                finally:
                    _TINYGRAD.release()
            else:                       # may compile for seconds: off the event loop
                out = await trio.to_thread.run_sync(_locked, stage.step, cols, hidden, sampling)
                self._seen.add(key)
        except EngineError as exc:
            raise WorkerCommandError("Step", f"{type(exc).__name__}: {exc}") from None
        if self._delay:
            time.sleep(self._delay)
        return out

    # The split step of a worker (a Link reader rings, the op loop awaits) wins nothing here: refused, so the peer
    # takes its ordinary path
    def post_step_nowait(self, *args, **kwargs) -> PostedStep:
        raise trio.WouldBlock

    async def step_posted(self, posted: PostedStep) -> StepOut:
        raise WorkerError("a local stage posts no steps")

    def abandon(self, posted: PostedStep) -> None:
        pass

    async def _call(self, what: str, fn, *args) -> None:
        async with self._lock:
            self._check_open()
            if self.stage is None:
                raise WorkerCommandError(what, f"no model is loaded: send Load before {what}")
            call = getattr(self.stage, fn)
            try:
                if _TINYGRAD.acquire(blocking=False):
                    try:
                        call(*args)
                    finally:
                        _TINYGRAD.release()
                else:           # another stage of this process compiles in a thread: after it
                    await trio.to_thread.run_sync(_locked, call, *args)
            except EngineError as exc:
                raise WorkerCommandError(what, f"{type(exc).__name__}: {exc}") from None

    async def zero_slot(self, slot: int) -> None:
        await self._call("ZeroSlot", "zero_slot", slot)

    async def block_table(self, slot: int, blocks) -> None:
        await self._call("BlockTable", "block_table", slot, tuple(int(b) for b in blocks))

    async def reset(self) -> None:
        await self._call("Reset", "reset")

    async def rollback(self, slot: int, pos: int) -> None:
        await self._call("Rollback", "rollback", slot, pos)

    def _check_open(self) -> None:
        if self._closed:
            raise WorkerError(f"the stage of process {self.pid} is closed")

    async def aclose(self) -> None:
        self._closed = True
        self.stage = self.info = None


_shared_db = None


def _shape_key(cols, sampling=None) -> tuple:
    """What decides a step's compiled shape in the Stage, near enough: its runs of consecutive positions of one slot
    (a prefill is one run, a decode step of n sequences n runs of 1), which columns want logits, and whether every
    sampling is greedy (the last stage then picks the tokens on the device: another compiled shape)."""
    if sampling is None or isinstance(sampling, Sampling):
        greedy = sampling is None or sampling.temperature == 0.0
    else:
        greedy = all(s.temperature == 0.0 for s in sampling)
    runs: list[int] = []
    prev = None
    for c in cols:
        if prev is not None and c.slot == prev.slot and c.pos == prev.pos + 1:
            runs[-1] += 1
        else:
            runs.append(1)
        prev = c
    return tuple(runs), tuple(c.needs_logits for c in cols), greedy


def _hidden(cols, data, kind: int, dim: int) -> np.ndarray | None:
    if data is None:
        return None
    if kind not in (PayloadKind.ACT_F16, PayloadKind.ACT_F32):
        raise WorkerCommandError("Step", f"activations of kind {kind} (float16 or float32 only)")
    return np.frombuffer(data, DTYPE_NAME[kind]).reshape(len(cols), dim)


def _step_out(out: np.ndarray, t0_ns: int, t1_ns: int) -> StepOut:
    out = np.ascontiguousarray(out)
    kind = _KIND_OF.get(out.dtype)
    if kind is None:
        raise WorkerError(f"step output has dtype {out.dtype}, which no hop carries")
    rows, cols = (out.shape[0], 1) if out.ndim == 1 else out.shape
    done = t1_ns / 1e6
    return StepOut(kind, rows, cols, out.tobytes(), (t1_ns - t0_ns) / 1e6, t0_ns / 1e6, done, done)


def _share_tinygrad_cache() -> None:
    """Open tinygrad's disk-cache database for any thread of this process. tinygrad opens it on first use with
    sqlite3's default check_same_thread=True, so a Stage loaded in a thread (a load must not stop the event loop
    for seconds) could not compile in the trio thread afterwards, nor the other way round. Every tinygrad call of a
    LocalStage is serialized by its lock, which is what check_same_thread guards against; the connection is opened
    exactly as tinygrad opens it otherwise."""
    import sqlite3
    from tinygrad import helpers
    global _shared_db
    if _shared_db is not None and helpers._db_connection is _shared_db:
        return
    os.makedirs(os.path.dirname(helpers.CACHEDB), exist_ok=True)
    conn = sqlite3.connect(helpers.CACHEDB, timeout=60, isolation_level="IMMEDIATE", check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode=WAL").fetchone()
    except sqlite3.OperationalError:
        pass                    # another connection set it already, or holds the lock while it does
    conn.execute("PRAGMA synchronous=NORMAL")
    helpers._db_connection = _shared_db = conn    # one opened by a thread before (a test's own Stage) is dropped


@asynccontextmanager
async def open_stage_host(*, device: str | None = None, default: str = "auto") -> AsyncIterator[LocalStage | object]:
    """The stage host a peer drives: a LocalStage when `stage_in_process(device, default=default)`, else a worker
    process (`engine.worker.open_worker`). The device is chosen, set up and probed as a worker would."""
    if not stage_in_process(device, default=default):
        async with open_worker(device=device) as worker:
            yield worker
        return
    from engine.device import DeviceError
    from engine.worker_main import initialize_device
    _share_tinygrad_cache()
    try:
        ready = await trio.to_thread.run_sync(_locked, initialize_device, device)
    except DeviceError as exc:
        raise WorkerError(f"device: {exc}") from None
    host = LocalStage(ready)
    try:
        yield host
    finally:
        await host.aclose()
