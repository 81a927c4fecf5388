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

Helper threads (cpu_threads() - 1, one pool per process) sleep between steps (no spinning while a stage idles in a
pipeline) and are handed each step; the calling thread starts at once and never waits for them to wake up: a
helper that comes late claims what is left. On Linux the helpers wait in C (`_FutexPool`): each sleeps in a futex
on the pool's generation word and never takes the GIL, and the calling thread hands a step, runs its share and
takes it back in one C call. The Python pool (`_Pool`, a threading.Condition; other systems, MESH_CPU_FUTEX=0)
costs a step ~0.1 ms on a stage's path on this 2-core VM (NOTES "The hot path on 2 cores, eighth session"): the
notify (~45 us, the woken helper at once wanting the GIL the caller holds), the helper's own Python before it
joins, and its GIL again after the walk, taken while the caller writes the step's output.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
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


@functools.cache
def _syscall() -> int:
    return ctypes.cast(ctypes.CDLL(None).syscall, ctypes.c_void_p).value if sys.platform == "linux" else 0


# the futex system call's number where the helpers may wait in C (Linux); elsewhere the Python pool serves
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98}
FUTEX_WAIT, FUTEX_WAKE = 128, 129  # the _PRIVATE forms: the word is this process's
GEN, JOB, INSIDE = 0, LINE, 2 * LINE  # words of a futex pool's control block: generation (low 32 bits), job, inside


def _futex_number() -> int | None:
    if sys.platform != "linux" or os.environ.get("MESH_CPU_FUTEX") == "0":
        return None
    return _SYS_FUTEX.get(platform.machine().lower())


# The futex pool's two sides, C in one CUSTOM statement each (the runner's own loop stays tinygrad UOps). A job is a
# StepRunner's `words`: runner address, table, counters, entries, fns, then one polls address per thread. The
# control block's words are touched only through __atomic builtins (sequentially consistent): a helper counts itself
# INSIDE before it reads JOB, and the lead clears JOB after its share, then waits until INSIDE is 0, so when the
# lead returns no helper walks the table (a helper that reads JOB late finds 0 and walks nothing): the step's table
# may be reset or freed (a Python helper held a reference to its StepRunner for that; a C one holds none). A helper
# leaves a finished table within microseconds (every slice is claimed, every wait is met).
_LEAD = """unsigned long *ctl = (unsigned long *){0}, *job = (unsigned long *){1}, *fns = (unsigned long *){4};
  volatile unsigned long *counters = (volatile unsigned long *){2};
  unsigned int *gen = (unsigned int *)&ctl[@GEN@];
  while (__atomic_load_n(&ctl[@INSIDE@], __ATOMIC_SEQ_CST)) ((long (*)(void))fns[1])();
  for (int i = 0; i < {3}; i++) counters[i] = 0;  /* volatile: stores, not a memset call (no libc here) */
  __atomic_store_n(&ctl[@JOB@], (unsigned long)job, __ATOMIC_SEQ_CST);
  __atomic_fetch_add(gen, 1u, __ATOMIC_SEQ_CST);
  ((long (*)(long, long, long, long))fns[2])(@SYS@, (long)gen, @WAKE@, 0x7fffffff);
  ((void (*)(unsigned long, unsigned long, int, unsigned long, unsigned long))job[0])(
    job[1], job[2], (int)job[3], job[4], job[5]);
  __atomic_store_n(&ctl[@JOB@], 0ul, __ATOMIC_SEQ_CST);
  while (__atomic_load_n(&ctl[@INSIDE@], __ATOMIC_SEQ_CST)) ((long (*)(void))fns[1])();"""
_SERVE = """unsigned long *ctl = (unsigned long *){0}, *fns = (unsigned long *){1};
  unsigned int *gen = (unsigned int *)&ctl[@GEN@];
  unsigned int seen = __atomic_load_n(gen, __ATOMIC_SEQ_CST);
  for (;;) {{
    unsigned int now = __atomic_load_n(gen, __ATOMIC_SEQ_CST);
    if (now == seen) {{  /* asleep until the lead's wake (or a spurious one: look again) */
      ((long (*)(long, long, long, long, long))fns[2])(@SYS@, (long)gen, @WAIT@, (long)seen, 0l);
      continue;
    }}
    seen = now;
    __atomic_fetch_add(&ctl[@INSIDE@], 1ul, __ATOMIC_SEQ_CST);
    unsigned long *job = (unsigned long *)__atomic_load_n(&ctl[@JOB@], __ATOMIC_SEQ_CST);
    if (job) ((void (*)(unsigned long, unsigned long, int, unsigned long, unsigned long))job[0])(
      job[1], job[2], (int)job[3], job[4], job[5 + {2}]);
    __atomic_fetch_sub(&ctl[@INSIDE@], 1ul, __ATOMIC_SEQ_CST);
  }}"""


@functools.cache
def _futex_programs(sys_futex: int) -> tuple[CPUProgram, CPUProgram]:
    """The lead (the stepping thread: hand the step, run its share, take it back) and the helpers' serve loop."""
    dev = Device["CPU"]
    word = lambda i: UOp.param(i, dtypes.uint64, (), addrspace=AddrSpace.ALU, name=f"w{i}")  # noqa: E731
    count = lambda i: UOp.param(i, dtypes.int, (), vmin_vmax=(0, dtypes.int.max), addrspace=AddrSpace.ALU,  # noqa: E731
                                name=f"n{i}")
    consts = dict(GEN=GEN, JOB=JOB, INSIDE=INSIDE, SYS=sys_futex, WAIT=FUTEX_WAIT, WAKE=FUTEX_WAKE)

    def fill(text: str) -> str:  # the renderer formats the text with the sources ({0}...); @NAME@ are constants
        for name, value in consts.items():
            text = text.replace(f"@{name}@", str(value))
        return text
    lead = UOp(Ops.CUSTOM, dtypes.void, (word(0), word(1), word(2), count(3), word(4)), fill(_LEAD))
    serve = UOp(Ops.CUSTOM, dtypes.void, (word(0), word(1), count(2)), fill(_SERVE))
    with Context(EMULATED_DTYPES="", TRACK_MATCH_STATS=0):
        clang = ClangRenderer(replace(dev.renderer.target, renderer="CLANG"))
        compile_ = lambda sink: CPUProgram(dev, compiled(sink, clang).to_elf())  # noqa: E731
        return (compile_(lead.sink(arg=KernelInfo("step_lead"), tag=1)),
                compile_(serve.sink(arg=KernelInfo("step_serve"), tag=1)))


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
        self.fns = np.array([noop.addr, _sched_yield(), _syscall()], dtype=np.uint64)
        self.inside = 0  # helpers walking this table now (guarded by the pool's lock)
        self.args = [(ctypes.c_uint64(self.table.ctypes.data), ctypes.c_uint64(self.counters.ctypes.data),
                      ctypes.c_int(len(self.table)), ctypes.c_uint64(self.fns.ctypes.data),
                      ctypes.c_uint64(self.polls[t:].ctypes.data)) for t in range(threads)]
        # the futex pool's job: the runner and its arguments as words, one polls address per thread
        self.words = np.array([self.runner.addr, *(a.value for a in self.args[0][:4]),
                               *(a[4].value for a in self.args)], dtype=np.uint64)
        self._lead: tuple = (None, ())  # (pool, the lead's arguments for it)

    def run(self, var_vals: dict[str, int]) -> None:
        flat = self.table.reshape(-1)
        for name, idx in self.slots.items():
            flat[idx] = var_vals[name]
        pool = _pool(self.threads - 1) if self.threads > 1 else None
        if pool is None or not pool.lock.acquire(blocking=False):
            # no helpers, or another step runs on them (a second Python thread): this one runs alone
            self.counters[:] = 0
            self.runner.fxn(*self.args[0])
            return
        try:
            if isinstance(pool, _FutexPool):
                if self._lead[0] is not pool:
                    self._lead = (pool, (ctypes.c_uint64(pool.ctl.ctypes.data), ctypes.c_uint64(self.words.ctypes.data),
                                         ctypes.c_uint64(self.counters.ctypes.data), ctypes.c_int(len(self.counters)),
                                         ctypes.c_uint64(self.fns.ctypes.data)))
                pool.lead.fxn(*self._lead[1])
                return
            pool.settle(self)
            self.counters[:] = 0
            pool.hand(self)
            try:
                self.runner.fxn(*self.args[0])
            finally:
                pool.withdraw(self)
        finally:
            pool.lock.release()


class _FutexPool:
    """Helper threads that wait in C (Linux): each runs `step_serve` for ever, asleep in a futex on the control
    block's generation word between steps; `step_lead` (the stepping thread's one C call) waits until no helper is
    inside a table, resets the step's counters, publishes the job, bumps the generation, wakes the helpers, runs
    the caller's share, clears the job and waits until no helper is inside. No Python and no GIL between a
    helper's wake-up and its first claim."""

    def __init__(self, n: int, sys_futex: int) -> None:
        self.lock = threading.Lock()  # one step at a time on the helpers
        self.lead, serve = _futex_programs(sys_futex)
        self.ctl = np.zeros(3 * LINE, dtype=np.uint64)   # generation, job, inside: a cache line each
        self.fns = np.array([0, _sched_yield(), _syscall()], dtype=np.uint64)
        # daemon threads in a C call that never returns: ctypes released the GIL, they never take it again
        self.threads = [threading.Thread(target=serve.fxn, name=f"mesh-cpu-{t + 1}", daemon=True,
                                         args=(ctypes.c_uint64(self.ctl.ctypes.data),
                                               ctypes.c_uint64(self.fns.ctypes.data), ctypes.c_int(t + 1)))
                        for t in range(n)]
        for t in self.threads:
            t.start()


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
def _pool(n: int) -> _Pool | _FutexPool:
    sys_futex = _futex_number()
    return _Pool(n) if sys_futex is None else _FutexPool(n, sys_futex)


if hasattr(os, "register_at_fork"):  # a forked child has none of its parent's threads: it starts its own pool
    os.register_at_fork(after_in_child=_pool.cache_clear)
