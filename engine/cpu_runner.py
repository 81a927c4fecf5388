"""A captured CPU step run by one C call per thread, its kernels' core slices shared by the machine's cores.

tinygrad's CPU backend splits a kernel's outermost GLOBAL axis into `core_id` slices (the matvec kernels of
engine/quant.py do too), but runs the slices one after another in the calling thread: one core works. Here a step
is a list of calls (function pointer, argument words, core slot, number of slices), written once into a command
table. A small runner program walks the table; every thread that runs it walks the same table:

    for each kernel j:  wait until done[j-1] == slices[j-1]          (every slice of the kernel before is finished)
                        while (s = claim[j]++) < slices[j]:  fn_j(args_j with core_id = s);  done[j] += 1

claim and done are atomic adds (`__atomic_fetch_add`), so each slice runs exactly once, on whichever thread claims
it. A slice reads what earlier kernels wrote and writes rows no other slice writes: the results are bit-identical
to running the slices in order on one thread (same C function, same arguments, same rows).

Why slices are claimed, not assigned: on a machine shared with other work (this 2-core box at load 4-6) a thread
is often preempted for milliseconds. With fixed shares every kernel would wait for the absent thread's share (a
first version did: 2 threads were slower than 1 at load 5-6); with claims the running thread takes every slice
and a step is never much slower than one thread alone. The same table serves any number of threads, 1 included.

Why a runner in C, written in tinygrad UOps and compiled by tinygrad's clang path (as tinygrad's own CPU worker
thread, ops_cpu.worker_prog): a step meets ~390 times (every kernel); a Python barrier costs tens of
microseconds a meeting, an atomic counter in C well under one. Waits spin on volatile loads and call sched_yield
every YIELD_EVERY polls; the atomics order the kernels' memory (acquire on claim, release on done) on weakly
ordered CPUs (ARM), and a full fence follows each wait. Plain C from tinygrad's renderer; the only builtins are
clang's __atomic ones (tinygrad's own CPU barrier is __atomic_thread_fence). No intrinsics.

Helper threads (cpu_threads() - 1, one pool per process) wait in Python between steps (no spinning while a stage
idles in a pipeline) and are handed each step; the calling thread starts at once and never waits for them to
wake up: a helper that comes late claims what is left.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from tinygrad import Device, UOp, dtypes
from tinygrad.dtype import AddrSpace
from tinygrad.helpers import NUM_CPU_THREADS, Context
from tinygrad.renderer.cstyle import ClangRenderer
from tinygrad.runtime.ops_cpu import CPUProgram
from tinygrad.uop.ops import KernelInfo, Ops

from .program_cache import compiled

# an entry: wait counter, wait value, claim counter, done counter, slices, function, core argument, arguments...
HEAD = 7
YIELD_EVERY = 16  # polls of a counter between two sched_yield calls (measured: 16 beat 256 and 4096 at load 5)
LINE = 16  # words between two counters: each on its own cache line (128 bytes on Apple's cores, 64 on x86)


def cpu_threads() -> int:
    """Threads a CPU step uses, and the core split of the matvec kernels: MESH_CPU_THREADS, else tinygrad's
    NUM_CPU_THREADS (the CPUs this process may run on; itself overridable by that environment variable)."""
    env = os.environ.get("MESH_CPU_THREADS")
    return max(1, int(env)) if env else NUM_CPU_THREADS.value


def core_index(core: UOp, threads: int) -> UOp:
    """A kernel's core slice index (its GLOBAL axis of `threads`: the runtime `core_id` argument) as the kernel's
    index arithmetic should use it: the same value, written `(int)(unsigned char)core_id` clamped to threads - 1 in
    the C source, so that clang knows its range. With a bare `core_id` term in a row index clang (14) cannot prove
    the 32-bit index sums stay in range, so it neither widens nor vectorizes the loads: SmolLM2's Q4_1 gate/up
    matvec split for 2 cores ran 2.3-2.9x slower per row than the same kernel unsplit (608 against 217
    instructions), which made 2 threads no faster than 1 (NOTES "The hot path on 2 cores, seventh session").
    Written through an opaque CUSTOM op because tinygrad folds `core % threads` or a narrowing cast away (it knows
    the range already); clamped so that tinygrad knows the range of the result too (it wraps an index it cannot
    bound, modulo its buffer: 25x slower). clang computes the three once per call, outside the loops."""
    if threads == 1:
        return core
    narrow = dtypes.uint8 if threads <= 256 else dtypes.uint16
    return UOp(Ops.CUSTOM, narrow, (core,), f"(({narrow.name}){{0}})").cast(dtypes.int).minimum(threads - 1) \
        .cast(core.dtype)


def _atomic_add(ptr: UOp, value: UOp | int, order: str) -> UOp:
    value = value if isinstance(value, UOp) else UOp.const(value, dtypes.uint64)
    return UOp(Ops.CUSTOM, dtypes.uint64, (ptr, value), f"__atomic_fetch_add({{0}}, {{1}}, __ATOMIC_{order})")


def _runner_prog(width: int) -> UOp:
    """The loop above over `n` entries of `width` words; fns = [noop, sched_yield]; polls: this thread's count."""
    table = UOp.param(0, dtypes.uint64, (1 << 40,))
    counters = UOp.param(1, dtypes.uint64, (1 << 40,), volatile=True)
    n = UOp.param(2, dtypes.int, (), vmin_vmax=(0, dtypes.int.max), name="n", addrspace=AddrSpace.ALU)
    fns = UOp.param(3, dtypes.uint64, (2,))
    polls = UOp.param(4, dtypes.uint64, (1,), volatile=True)
    e = UOp.range(n, 0)

    def word(i: int, *after: UOp) -> UOp:
        return table.after(*after).index(e * width + i).load()

    poll = UOp.loop(1)  # wait: spin, calling sched_yield (else noop) every YIELD_EVERY polls
    seen = polls.after(poll, e)[0].load()
    counted = polls.index(0).store(seen + 1)
    pause = fns.after(counted)[(seen & (YIELD_EVERY - 1)).eq(YIELD_EVERY - 1).cast(dtypes.int)].load()
    have = counters.after(pause.call(ret_dtype=dtypes.void)).index(word(0).cast(dtypes.int)).load()
    acquired = UOp(Ops.BARRIER, src=(have.end(poll, have < word(1)),))

    claim = UOp.loop(2)  # claim slices until none is left
    s = _atomic_add(counters.after(acquired, claim).index(word(2, acquired).cast(dtypes.int)), 1, "ACQ_REL")
    go = s < word(4, acquired)
    fn = go.where(word(5, acquired), fns.after(acquired)[0].load())
    core = word(6, acquired)
    args = [core.eq(i).where(s, word(HEAD + i, acquired)) for i in range(width - HEAD)]
    ran = fn.call(*args, ret_dtype=dtypes.void)
    done = _atomic_add(counters.after(ran).index(word(3, ran).cast(dtypes.int)), go.cast(dtypes.uint64), "RELEASE")
    return done.end(claim, go).end(e)


@functools.cache
def _programs(width: int) -> tuple[CPUProgram, CPUProgram]:
    dev = Device["CPU"]
    with Context(EMULATED_DTYPES="", TRACK_MATCH_STATS=0):
        clang = ClangRenderer(replace(dev.renderer.target, renderer="CLANG"))
        # compiled once per machine, not once per process (engine/program_cache.py)
        compile_ = lambda sink: CPUProgram(dev, compiled(sink, clang).to_elf())  # noqa: E731
        runner = compile_(_runner_prog(width).sink(arg=KernelInfo(f"step_runner_{width}"), tag=1))
        noop = compile_(UOp.sink(arg=KernelInfo("step_noop"), tag=1))
    return runner, noop


@functools.cache
def _sched_yield() -> int:
    return ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value


@dataclass(frozen=True)
class Call:
    """One kernel of a step: its function's address, argument words (variables' words are filled per run), the
    word indices of its bound variables, the argument index of its core id (None: no slices), its slices."""
    fn: int
    args: tuple[int, ...]
    variables: tuple[tuple[int, str], ...]
    core: int | None
    slices: int


class StepRunner:
    """The command table of one step; `run(var_vals)` runs it on the calling thread and up to `threads - 1`
    helpers of the process's pool."""

    def __init__(self, calls: Sequence[Call], threads: int) -> None:
        width = HEAD + max((len(c.args) for c in calls), default=0)
        self.programs = self.runner, noop = _programs(width)  # held: the table holds their code's addresses
        self.threads = threads
        rows, where = [], {}
        for j, c in enumerate(calls):  # kernel j: claim counter 2j+1, done counter 2j+2 (0 stays 0)
            args = [*c.args, *[0] * (width - HEAD - len(c.args))]
            wait = (LINE * 2 * j, calls[j - 1].slices if j else 0)
            rows.append([*wait, LINE * (2 * j + 1), LINE * (2 * j + 2), c.slices, c.fn,
                         width if c.core is None else c.core, *args])
            for word, name in c.variables:
                where.setdefault(name, []).append(j * width + HEAD + word)
        last = len(calls)  # one more entry: wait for the last kernel's slices, claim nothing
        rows.append([LINE * 2 * last, calls[-1].slices if calls else 0, LINE * (2 * last + 1), 0, 0, noop.addr,
                     width] + [0] * (width - HEAD))
        self.table = np.array(rows, dtype=np.uint64)
        self.slots = {name: np.array(idx, dtype=np.int64) for name, idx in where.items()}
        self.counters = np.zeros(LINE * (2 * last + 2), dtype=np.uint64)
        self.polls = np.zeros(threads * LINE, dtype=np.uint64)[::LINE]  # one line each: each thread counts its own
        self.fns = np.array([noop.addr, _sched_yield()], dtype=np.uint64)
        self.inside = 0  # helpers walking this table now (guarded by the pool's lock)
        self.args = [(ctypes.c_uint64(self.table.ctypes.data), ctypes.c_uint64(self.counters.ctypes.data),
                      ctypes.c_int(len(self.table)), ctypes.c_uint64(self.fns.ctypes.data),
                      ctypes.c_uint64(self.polls[t:].ctypes.data)) for t in range(threads)]

    def run(self, var_vals: dict[str, int]) -> None:
        flat = self.table.reshape(-1)
        for name, idx in self.slots.items():
            flat[idx] = var_vals[name]
        pool = _pool(self.threads - 1) if self.threads > 1 else None
        if pool is not None and not pool.lock.acquire(blocking=False):
            pool = None  # another step runs on the helpers (a second Python thread): this one runs alone
        try:
            if pool is not None:
                pool.settle(self)
            self.counters[:] = 0
            if pool is not None:
                pool.hand(self)
            self.runner.fxn(*self.args[0])
        finally:
            if pool is not None:
                pool.withdraw(self)
                pool.lock.release()


class _Pool:
    """Helper threads of the process. A step is handed to all of them at once; each takes the newest step it has
    not seen. `settle` waits until no helper is inside a table (before its counters are reset); `withdraw` takes
    a step back once it is over, so a helper that wakes late does not walk a finished table."""

    def __init__(self, n: int) -> None:
        self.lock = threading.Lock()  # one step at a time on the helpers
        self.cond = threading.Condition()
        self.job: StepRunner | None = None
        self.generation = 0
        self.threads = [threading.Thread(target=self._serve, args=(t + 1,), name=f"mesh-cpu-{t + 1}", daemon=True)
                        for t in range(n)]
        for t in self.threads:
            t.start()

    def _serve(self, t: int) -> None:
        seen = 0
        while True:
            with self.cond:
                while self.job is None or self.generation == seen:
                    self.cond.wait()
                seen, job = self.generation, self.job
                job.inside += 1
            try:
                job.runner.fxn(*job.args[t])
            finally:
                with self.cond:
                    job.inside -= 1
                    self.cond.notify_all()

    def settle(self, job: StepRunner) -> None:
        with self.cond:
            while job.inside:
                self.cond.wait()

    def hand(self, job: StepRunner) -> None:
        with self.cond:
            self.job, self.generation = job, self.generation + 1
            self.cond.notify_all()

    def withdraw(self, job: StepRunner) -> None:
        with self.cond:
            if self.job is job:
                self.job = None


@functools.cache
def _pool(n: int) -> _Pool:
    return _Pool(n)


if hasattr(os, "register_at_fork"):  # a forked child has none of its parent's threads: it starts its own pool
    os.register_at_fork(after_in_child=_pool.cache_clear)
