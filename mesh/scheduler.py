"""Continuous batching through a chain: many sequences share the stages' KV slots and every step.

    sched = Scheduler(pipe, n_slots=8, max_context=2048)
    nursery.start_soon(sched.run)
    async with sched.open(Request(prompt_ids, max_tokens=64, sampling=Sampling(), stop_ids=eos)) as g:
        async for tok in g:
            ...

Requests wait in a bounded queue (`QueueFull` past it) and are admitted between steps into free KV slots. The
sequences in slots are cut into micro-batches, each one step of Columns: a decode batch (one column for each of several
sequences, each with its own Sampling) or one sequence's prefill chunk (at most `prefill_chunk` prompt columns, so a
long prompt never holds the decoding streams for more than one chunk at a time). With S stages up to S micro-batches
are in flight at once: in peer-to-peer mode stage 1 computes one while stage 2 computes the one before it.

The decisions (admission, micro-batches, fairness, slot freeing, why a sequence's tokens do not depend on who shares
its steps) are in NOTES.md, "Mesh", "Scheduler". The bookkeeping is a sans-IO core (`_Core`: admit, form, apply, release) that reads no
clock and awaits nothing; `Scheduler` drives it with one submitting task and one collecting task.
"""
from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Literal, Sequence

import trio

from common.values import Column, Sampling
from mesh import proto
from mesh.errors import MeshError, single_errors
from mesh.pipeline import ChainPipeline, Pipeline

__all__ = ["Request", "Generation", "Scheduler", "SchedulerStats", "SchedulerError", "QueueFull", "SchedulerStopped",
           "decode_widths"]

FinishReason = Literal["stop", "length"]


class SchedulerError(MeshError):
    """Base of the scheduler's errors."""


class QueueFull(SchedulerError):
    """Every slot is busy and the waiting queue is at its bound: come back later (HTTP 429/503)."""


class SchedulerStopped(SchedulerError):
    """The scheduler is not running (any more): its session ended or failed. The reason says which."""


@dataclass(frozen=True)
class Request:
    """One generation: prompt token ids, at most `max_tokens` new ones; a token in `stop_ids` ends it unemitted.

    `replay`: tokens this request already generated on a chain that failed (the service's re-form). They are fed
    after the prompt, cut as that chain computed them (NOTES "Serving", "Replay"), count toward `max_tokens`, and
    are not emitted again: the generation goes on with the token after them, bitwise as if nothing had failed."""
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling = Sampling()
    stop_ids: frozenset[int] = frozenset()
    replay: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerStats:
    active: int                 # sequences holding a KV slot
    queued: int                 # requests waiting for one
    max_seqs: int
    steps: int                  # micro-batches computed so far
    tokens_out: int             # tokens handed to consumers so far
    prompt_tokens: int          # prompt columns prefilled so far
    in_flight: int              # micro-batches in the pipeline now
    micro_batches: int          # how many may be in flight at once (the number of stages in p2p mode)
    step_ms: float | None       # mean submit-to-answer time of recent micro-batches
    stage_ms: tuple[float, ...] | None = None   # per stage, where the pipeline reports it


def decode_widths(n_slots: int, micro_batches: int) -> int:
    """The widest decode step the scheduler forms: what a stage's warmup should compile (widths 1..this)."""
    return min(n_slots, math.ceil(n_slots / max(1, micro_batches)))


# ---- the sans-IO core ------------------------------------------------------------------------------------------

_READY_SINCE = attrgetter("ready_since")

@dataclass(eq=False)
class _Seq:
    """A generation's state inside the scheduler."""
    gen: "Generation"
    req: Request
    limit: int                  # tokens it may emit (max_tokens, cut to what the context holds)
    slot: int = -1
    fed: int = 0                # prompt columns submitted so far
    pos: int = 0                # the position the next decode column feeds
    next_tok: int = -1          # the token that column feeds (-1: none yet)
    emitted: int = 0
    in_flight: int = 0          # micro-batches holding one of its columns
    ending: bool = False        # finished or abandoned: no more columns; the slot goes once in_flight is 0
    ready_since: int = 0        # core tick when it became ready to decode (oldest first)
    resumed: bool = False       # re-opened after its chain failed: queued ahead of new requests, past the bound

    def __post_init__(self) -> None:
        self.ids = (*self.req.prompt_ids, *self.req.replay)    # what is fed before decoding (re)starts
        self.emitted = len(self.req.replay)
        self.chunked = len(self.ids)    # ids[:chunked] go in prefill chunks, the rest as decode columns (_Core.enqueue)

    @property
    def prefilling(self) -> bool:
        return self.fed < self.chunked


@dataclass
class _Batch:
    """One micro-batch: its columns, the sequence of each column, the sampling."""
    cols: list[Column]
    seqs: list[_Seq]
    sampling: Sampling | list[Sampling]
    kind: Literal["decode", "prefill"]
    submitted: float = 0.0


class _Blocks:
    """The chain's KV blocks as the scheduler hands them out (NOTES Engine "Paged KV cache": one allocator, the
    coordinator's): a `BlockPool` the size of the smallest stage pool. A sequence reserves at admission every block
    its prompt and max_tokens can reach, so no step can run out of blocks half way down the chain; its table grows as
    it does (BlockTable in-band ahead of the step that needs it) and ZeroSlot gives the blocks back."""

    def __init__(self, n_blocks: int, block_size: int):
        from engine.kv_blocks import BlockPool, blocks_for      # pure bookkeeping: no tinygrad
        self.pool, self._blocks_for = BlockPool(n_blocks, block_size), blocks_for
        self.block_size = block_size
        self.reserved = 0

    def need(self, seq: _Seq) -> int:
        return self._blocks_for(len(seq.req.prompt_ids) + seq.limit - 1, self.block_size)

    def fits(self, seq: _Seq) -> bool:
        return self.need(seq) <= self.pool.n_blocks - self.reserved

    def reserve(self, seq: _Seq) -> None:
        self.reserved += self.need(seq)

    def release(self, seq: _Seq) -> None:
        self.pool.free(seq.slot)
        self.reserved -= self.need(seq)


class _Core:
    """Slots, the waiting queue and the choice of the next micro-batch. Pure bookkeeping: nothing here awaits.
    A decode batch may have any width, one column included: the engine computes each column the same way whatever
    its step's width (NOTES Engine "Prefill GEMM": the one-column matvec sums in the GEMM's order), so a sequence's
    tokens do not depend on how many others share its steps."""

    def __init__(self, *, slots: Sequence[int], max_queue: int, depth: int, prefill_chunk: int,
                 blocks: _Blocks | None = None):
        self.free: deque[int] = deque(slots)
        self.max_seqs = len(self.free)
        self.max_queue = max_queue
        self.depth = depth
        self.prefill_chunk = prefill_chunk
        self.blocks = blocks
        self.queue: deque[_Seq] = deque()
        self.active: list[_Seq] = []        # in admission order
        self.tick = 0
        self.prefill_turn = False           # alternation between decode batches and prefill chunks
        self.steps = self.tokens_out = self.prompt_tokens = 0

    # admission
    def enqueue(self, seq: _Seq) -> None:
        seq.chunked = self._chunked(seq)
        if seq.resumed:     # an answer already under way goes before new requests, whatever the bound
            at = next((i for i, q in enumerate(self.queue) if not q.resumed), len(self.queue))
            self.queue.insert(at, seq)
            return
        if len(self.queue) >= self.max_queue + len(self.free):    # the bound counts only those that must wait
            raise QueueFull(f"all {self.max_seqs} sequence slots are busy and {len(self.queue)} requests wait "
                            f"(the queue holds {self.max_queue}); retry later")
        self.queue.append(seq)

    def admit(self) -> list[_Seq]:
        """Queue -> free slots, first come first served."""
        out = []
        while self.queue and self.free and (self.blocks is None or self.blocks.fits(self.queue[0])):
            seq = self.queue.popleft()
            if self.blocks is not None:
                self.blocks.reserve(seq)
            seq.slot = self.free.popleft()
            self.active.append(seq)
            out.append(seq)
        return out

    def drop_queued(self, seq: _Seq) -> bool:
        try:
            self.queue.remove(seq)
        except ValueError:
            return False
        return True

    def releasable(self) -> list[_Seq]:
        """Ended sequences with nothing in flight: their slots can be zeroed and reused."""
        done = [s for s in self.active if s.ending and s.in_flight == 0]
        for s in done:
            self.active.remove(s)
        return done

    def release(self, seq: _Seq) -> None:
        if self.blocks is not None:
            self.blocks.release(seq)
        self.free.append(seq.slot)

    def tables(self, batch: "_Batch") -> list[tuple[int, tuple[int, ...]]]:
        """(slot, its whole table) for each slot whose table must grow before `batch` runs."""
        if self.blocks is None:
            return []
        ends: dict[int, int] = {}
        for c in batch.cols:
            ends[c.slot] = max(ends.get(c.slot, 0), c.pos + 1)
        return [(slot, t) for slot, end in ends.items() if (t := self.blocks.pool.ensure(slot, end)) is not None]

    # micro-batches
    def form(self) -> _Batch | None:
        """The next micro-batch to submit, or None when there is nothing to do now.

        Decode batches and prefill chunks alternate while both are waiting, so a long prompt delays each decoding
        stream by at most one chunk at a time and a new request's first token is not starved by decoding ones. A
        decode batch takes the sequences that waited longest, at most ceil(decoding / depth) of them, so the
        decoding sequences spread over `depth` micro-batches that follow each other through the stages."""
        ready: list[_Seq] = []
        prefill: _Seq | None = None     # the oldest live sequence still prefilling
        decoding = 0
        for s in self.active:           # one pass: this runs between every two steps
            if s.ending:
                continue
            if s.fed < s.chunked:
                if prefill is None:
                    prefill = s
                continue
            decoding += 1
            if s.in_flight == 0 and s.next_tok >= 0:
                ready.append(s)
        if not ready and prefill is None:
            return None
        if prefill is not None and (self.prefill_turn or not ready):
            self.prefill_turn = False
            return self._prefill(prefill)
        self.prefill_turn = prefill is not None
        ready.sort(key=_READY_SINCE)    # stable: admission order among equals, as before
        cap = max(1, math.ceil(decoding / self.depth))
        return self._decode(ready[:cap] if cap < len(ready) else ready)

    def _chunked(self, seq: _Seq) -> int:
        """How much of a sequence's ids go in prefill chunks: its prompt, and of a replay (`Request.replay`) the
        whole chunks of `prefill_chunk` columns; the rest of a replay is fed as decode columns.

        A replay must compute what the failed chain computed, bit for bit, or the text after it could differ. Those
        tokens were decode columns; the engine computes a column to the same bits in a step of any width, prefill
        chunks included (NOTES Engine "Prefill GEMM": the one-column matvec sums in the GEMM's order; "Paged KV
        cache"), so whole chunks of `prefill_chunk` (the engine's bucket, 16) replayed columns are steps of 16, and
        the rest go as decode columns, sharing steps with the other sequences. The prompt keeps its own chunks (cut
        at multiples of `prefill_chunk` and at its end), so its tail runs the kernels it ran alone."""
        n, k = len(seq.req.prompt_ids), len(seq.req.replay)
        return n + k - k % self.prefill_chunk

    def _prefill(self, seq: _Seq) -> _Batch:
        """The next prefill chunk: the prompt's, cut at multiples of `prefill_chunk` from position 0 as when it is
        prefilled alone, then whole chunks of a replay (`_chunked`). After the last one, a replay's rest is fed
        as decode columns (`next_tok` from the replay), a prompt's last column picks the first token."""
        ids, n = seq.ids, len(seq.req.prompt_ids)
        a = seq.fed
        b = min(n if a < n else seq.chunked, a + self.prefill_chunk)
        cols = [Column(p, seq.slot, p == len(ids) - 1, ids[p]) for p in range(a, b)]
        seq.fed = b
        seq.in_flight += 1
        self.prompt_tokens += max(0, min(b, n) - a)
        if b == seq.chunked < len(ids):          # the replay's rest goes as decode columns
            seq.pos, seq.next_tok, seq.ready_since = b, ids[b], self.tick
        return _Batch(cols, [seq] * len(cols), seq.req.sampling, "prefill")

    def _decode(self, seqs: list[_Seq]) -> _Batch:
        cols = []
        samplings = []
        first = seqs[0].req.sampling
        same = True
        for s in seqs:
            cols.append(Column(s.pos, s.slot, True, s.next_tok))
            samp = s.req.sampling
            samplings.append(samp)
            if same and samp is not first and samp != first:
                same = False
            s.in_flight += 1
            s.next_tok = -1
        return _Batch(cols, seqs, first if same else samplings, "decode")   # one for all, or one per column

    def apply(self, batch: _Batch, tokens: Sequence[int]) -> list[tuple[_Seq, int | None, str | None]]:
        """A micro-batch's answer: one token per needs_logits column. Returns (seq, token to emit or None,
        finish reason or None) for each sequence that got a token."""
        self.steps += 1
        decode = batch.kind == "decode"     # a column per sequence, each needs logits
        picks = batch.seqs if decode else [s for c, s in zip(batch.cols, batch.seqs) if c.needs_logits]
        if len(tokens) != len(picks):
            raise SchedulerError(f"a step of {len(batch.cols)} columns answered {len(tokens)} tokens for "
                                 f"{len(picks)} columns that need logits")
        for s in (batch.seqs if decode else set(batch.seqs)):
            s.in_flight -= 1
        out = []
        self.tick += 1
        for s, tok in zip(picks, tokens):
            if s.ending:
                continue
            tok = int(tok)
            if decode:
                s.pos += 1
            else:
                s.pos = len(s.ids)
            if s.pos < len(s.ids):      # a replayed column: the token it picked is the replay's next one, fed next
                s.next_tok, s.ready_since = s.ids[s.pos], self.tick
                continue
            if tok in s.req.stop_ids:
                s.ending = True
                out.append((s, None, "stop"))
                continue
            s.emitted += 1
            self.tokens_out += 1
            if s.emitted >= s.limit:
                s.ending = True
                out.append((s, tok, "length"))
            else:
                s.next_tok, s.ready_since = tok, self.tick
                out.append((s, tok, None))
        return out


# ---- the consumer's side ---------------------------------------------------------------------------------------

class Generation:
    """One request's tokens: `async with sched.open(req) as g: async for tok in g`. Leaving the `async with` early
    (a client that disconnects) ends the sequence: no more steps are submitted for it and its slot is zeroed and
    reused as soon as the steps already in the pipeline come back."""

    def __init__(self, sched: "Scheduler", req: Request, limit: int):
        self._sched = sched
        self.request = req
        self.prompt_tokens = len(req.prompt_ids)
        self.completion_tokens = len(req.replay)
        self.finish_reason: FinishReason | None = None
        self.created = time.monotonic()
        self.token_times: list[float] = []    # time.monotonic() when each token was handed over (TTFT, tok/s)
        self._send, self._receive = trio.open_memory_channel(math.inf)
        self._error: BaseException | None = None
        self._seq = _Seq(self, req, limit)

    async def __aenter__(self) -> "Generation":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop this generation (idempotent); what it holds is freed by the scheduler at its next turn."""
        self._sched._leave(self._seq)
        self._receive.close()

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> int:
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            if self._error is not None:
                raise self._error from None
            raise StopAsyncIteration from None
        except trio.ClosedResourceError:
            raise StopAsyncIteration from None

    # the scheduler's side
    def _emit(self, tok: int | None, reason: str | None) -> None:
        if tok is not None:
            self.completion_tokens += 1
            self.token_times.append(time.monotonic())
            try:
                self._send.send_nowait(tok)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        if reason is not None:
            self.finish_reason = reason      # type: ignore[assignment]
            self._send.close()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._send.close()


# ---- the driver ------------------------------------------------------------------------------------------------

class Scheduler:
    """Continuous batching over a Pipeline.

    n_slots: KV slots each stage was loaded with; `max_seqs` (default n_slots) sequences use them at once.
    `micro_batches`: how many steps may be in flight (default: the number of stages in p2p mode, else 1: hub and
    local pipelines compute a step only when it is collected). `prefill_chunk`: prompt columns per prefill step (a
    multiple of the engine's prefill bucket keeps a prompt's chunks, and so its bits, the same as prefilling it
    alone). `vocab_size`: checks ids. `kv_blocks`: the smallest stage's KV pool (Info.kv_blocks, positions
    `kv_block_size` a block): then the scheduler allocates the blocks (`_Blocks`: admission waits for room, each
    table in-band ahead of the step that grows it); None: every stage grows its own tables (its full pool)."""

    def __init__(self, pipe: Pipeline, *, n_slots: int, max_context: int, max_queue: int = 64,
                 max_seqs: int | None = None, micro_batches: int | None = None, prefill_chunk: int = 16,
                 vocab_size: int | None = None, kv_blocks: int | None = None, kv_block_size: int = 16):
        if n_slots < 1:
            raise ValueError(f"n_slots={n_slots}: need at least 1")
        max_seqs = n_slots if max_seqs is None else max_seqs
        if not 1 <= max_seqs <= n_slots:
            raise ValueError(f"max_seqs={max_seqs} is outside [1, {n_slots}] for {n_slots} slots")
        if max_queue < 0 or prefill_chunk < 1 or max_context < 2:
            raise ValueError(f"bad scheduler limits: max_queue={max_queue}, prefill_chunk={prefill_chunk}, "
                             f"max_context={max_context}")
        if micro_batches is None:
            micro_batches = len(pipe.names) + (pipe.local is not None) if isinstance(pipe, ChainPipeline) else 1
        self.pipe = pipe
        self.max_context = max_context
        self.vocab_size = vocab_size
        blocks = _Blocks(kv_blocks, kv_block_size) if kv_blocks else None
        self._core = _Core(slots=range(max_seqs), blocks=blocks, max_queue=max_queue, depth=max(1, micro_batches),
                           prefill_chunk=prefill_chunk)
        # MESH_SCHED_SERIAL=0: the two-task driver at every depth (an A/B switch for bench/serve_bench.py on a device)
        self._serial = self._core.depth == 1 and os.environ.get("MESH_SCHED_SERIAL", "1") != "0"
        self._wake = trio.Event()
        self._running = False
        self._stopped: SchedulerStopped | None = None
        self._step_ms: deque[float] = deque(maxlen=32)
        self._in_flight = 0
        self._idle = trio.Event()           # set while nothing is queued, active or in flight

    # the public face
    def open(self, req: Request, *, resumed: bool = False) -> Generation:
        """Queue a request. Raises ValueError naming what is wrong with it, QueueFull, or SchedulerStopped.
        `resumed`: an answer that was under way on a chain that failed; it waits ahead of new requests and is not
        refused by the queue's bound (a client that already has part of its answer must get the rest)."""
        if self._stopped is not None:
            raise self._stopped
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if not isinstance(req.max_tokens, int) or req.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {req.max_tokens!r}")
        if n >= self.max_context:
            raise ValueError(f"the prompt has {n} tokens; the context holds {self.max_context}, so at most "
                             f"{self.max_context - 1} can be prompt")
        if self.vocab_size is not None and not all(0 <= t < self.vocab_size for t in (*req.prompt_ids, *req.replay)):
            bad = next(t for t in (*req.prompt_ids, *req.replay) if not 0 <= t < self.vocab_size)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if not isinstance(req.sampling, Sampling):
            raise ValueError(f"sampling must be a Sampling, got {type(req.sampling).__name__}")
        # the prompt fills positions [0, n); token k (k >= 1) is fed at n + k - 1, the last one never
        gen = Generation(self, req, min(req.max_tokens, self.max_context - n + 1))
        if len(req.replay) >= gen._seq.limit:
            raise ValueError(f"the replay has {len(req.replay)} tokens; the request may generate only "
                             f"{gen._seq.limit}")
        gen._seq.resumed = resumed
        if self._core.blocks is not None and self._core.blocks.need(gen._seq) > self._core.blocks.pool.n_blocks:
            raise ValueError(f"the prompt and max_tokens need {self._core.blocks.need(gen._seq)} KV blocks of "
                             f"{self._core.blocks.block_size} positions; the stages hold "
                             f"{self._core.blocks.pool.n_blocks}")
        self._core.enqueue(gen._seq)
        self._core.admit()      # a free slot is taken now: requests opened before the loop runs are not "waiting"
        self._wake.set()
        return gen

    def stats(self) -> SchedulerStats:
        c = self._core
        return SchedulerStats(active=len(c.active), queued=len(c.queue), max_seqs=c.max_seqs, steps=c.steps,
                              tokens_out=c.tokens_out, prompt_tokens=c.prompt_tokens, in_flight=self._in_flight,
                              micro_batches=c.depth,
                              step_ms=sum(self._step_ms) / len(self._step_ms) if self._step_ms else None)

    async def wait_idle(self) -> None:
        """Return once nothing is queued, active or in flight (every slot freed); at once if so already."""
        while not self._idle.is_set():
            await self._idle.wait()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Drive steps until cancelled or the pipeline fails (the error is raised here and every open generation's
        iteration raises SchedulerStopped naming it)."""
        if self._running or self._stopped is not None:
            raise SchedulerError("a Scheduler runs once")
        self._running = True
        reason = "the scheduler was stopped"
        try:
            if self._serial:        # one step at a time: submit, collect and apply in one task
                task_status.started()
                await self._serial_loop()
                return
            send, receive = trio.open_memory_channel(math.inf)
            with single_errors():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._collect, receive)
                    task_status.started()
                    await self._submit_loop(send)
        except BaseException as exc:
            if not isinstance(exc, trio.Cancelled):
                reason = f"the scheduler stopped: {exc}"
            raise
        finally:
            discard = getattr(self.pipe, "discard", None)    # a step posted at submit that nobody will collect
            if discard is not None:
                discard()
            self._stop(reason)

    # internals
    def _leave(self, seq: _Seq) -> None:
        if seq.ending:
            return
        seq.ending = True
        if self._core.drop_queued(seq):
            return
        self._wake.set()

    def _stop(self, reason: str) -> None:
        self._stopped = SchedulerStopped(reason)
        c = self._core
        for seq in [*c.queue, *c.active]:
            seq.ending = True
            if seq.gen.finish_reason is None:
                seq.gen._fail(self._stopped)
        c.queue.clear()

    def _set_idle(self) -> None:
        if not (self._core.active or self._core.queue or self._in_flight):
            self._idle.set()
        elif self._idle.is_set():
            self._idle = trio.Event()

    async def _serial_loop(self) -> None:
        """The driver when one micro-batch is in flight at a time (hub and local pipelines, a one-stage chain). A
        step's tokens are applied to the bookkeeping at once, and the next step is formed and submitted before they
        are handed to the consumers: no pass through trio's scheduler between a step's answer and the next step,
        and the consumers' work (their wake-ups, detokenizing, the HTTP chunk of every stream) overlaps the device's
        step instead of standing between two steps (NOTES "Scheduler", "The host's cost per step"). A pipeline that
        sends a step at `submit` (a chain, a worker's posted step) has it on its way before the hand-over; one
        that computes at `collect` still skips the scheduler's passes."""
        core = self._core
        handed: list = []       # the last step's (seq, token, reason), for the consumers once the next step is out

        def hand_over() -> None:
            for seq, tok, reason in handed:
                seq.gen._emit(tok, reason)
            handed.clear()

        if core.blocks is not None:     # tables come from here only: clear what an earlier session left held
            await self.pipe.inband(proto.Reset())
        try:
            while True:
                self._wake = trio.Event()
                released = core.releasable()     # ended, nothing in flight: clear the slot, then reuse it
                if released:
                    hand_over()
                for seq in released:
                    await self.pipe.inband(proto.ZeroSlot(seq.slot))
                    core.release(seq)
                core.admit()
                batch = core.form()
                if batch is None:
                    hand_over()
                    self._set_idle()
                    seq = released = None
                    await self._wake.wait()
                    continue
                self._in_flight = 1
                self._set_idle()
                tables = core.tables(batch)
                if tables:
                    hand_over()
                for slot, table in tables:     # blocks the step writes, ahead of it
                    await self.pipe.inband(proto.BlockTable(slot, table))
                batch.submitted = time.monotonic()
                group = await self.pipe.submit(batch.cols, batch.sampling)
                hand_over()
                tokens = await self.pipe.collect(group)
                self._in_flight = 0
                self._step_ms.append((time.monotonic() - batch.submitted) * 1000)
                handed = core.apply(batch, tokens)
                seq = batch = tokens = released = None  # nothing of this step stays alive while the next is awaited
        finally:
            hand_over()     # tokens already computed reach their consumers, whatever ends the loop

    async def _submit_loop(self, send) -> None:
        core = self._core
        if core.blocks is not None:     # tables come from here only: clear what an earlier session left held
            await self.pipe.inband(proto.Reset())
        while True:
            self._wake = trio.Event()
            for seq in core.releasable():       # ended, nothing in flight: clear the slot, then reuse it
                await self.pipe.inband(proto.ZeroSlot(seq.slot))
                core.release(seq)
            core.admit()
            while self._in_flight < core.depth and (batch := core.form()) is not None:
                for slot, table in core.tables(batch):     # blocks the step writes, ahead of it
                    await self.pipe.inband(proto.BlockTable(slot, table))
                batch.submitted = time.monotonic()
                group = await self.pipe.submit(batch.cols, batch.sampling)
                self._in_flight += 1
                send.send_nowait((group, batch))
            self._set_idle()
            seq = batch = None      # a loop variable would keep an ended sequence (and its client's) alive meanwhile
            await self._wake.wait()

    async def _collect(self, receive) -> None:
        async for group, batch in receive:
            tokens = await self.pipe.collect(group)
            self._in_flight -= 1
            self._step_ms.append((time.monotonic() - batch.submitted) * 1000)
            for seq, tok, reason in self._core.apply(batch, tokens):
                seq.gen._emit(tok, reason)
            seq = batch = None      # nothing of this step stays alive while the next one is awaited
            self._wake.set()
