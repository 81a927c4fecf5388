"""Sequences through a formed chain: admission, a bounded queue, slots, and each sequence's tokens to its reader.

THIN VERSION (helper "api", issue 11): one sequence at a time through `mesh.pipeline.generate`, behind the
interface the continuous-batching scheduler (helper "sched") keeps; that one replaces this file. What the interface
promises, and this version keeps:
- `open(req)` checks the request (ValueError names what is wrong) and the queue bound (QueueFull) at once, before
  anything waits; a Generation holds a place from then until its `async with` is left.
- Leaving the `async with` early (a client gone, a stop string seen) frees the place: a queued one is dropped, the
  running one stops before its next step (a step already sent down the chain is collected first, so the chain never
  holds an answer nobody reads).
- When the chain fails (`run` raises), every open Generation's reader gets a SessionError instead of waiting forever.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import trio

from common.values import Sampling
from mesh.errors import MeshError, SessionError
from mesh.pipeline import Pipeline, generate


@dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    stop_ids: frozenset[int]          # e.g. eos; a stop id ends the sequence and is not emitted


class SchedulerError(MeshError):
    """The scheduler cannot take or finish a sequence."""


class QueueFull(SchedulerError):
    """Every slot is busy and the queue is at its bound: try again later (HTTP 429 with Retry-After)."""


@dataclass(frozen=True)
class SchedulerStats:
    active: int
    queued: int
    max_seqs: int
    steps: int
    tokens_out: int


class _Abandoned(Exception):
    """The reader left: stop this sequence between steps."""


_END = object()


class Generation:
    """One sequence: `async with scheduler.open(req) as g: async for tok in g: ...`."""

    def __init__(self, scheduler: "Scheduler", req: Request, limit: int):
        self._scheduler, self.request, self.limit = scheduler, req, limit
        # a token is handed over from inside generate()'s synchronous callback: room for all of them up front
        self._send, self._receive = trio.open_memory_channel(limit + 2)
        self.finish_reason: str | None = None
        self.prompt_tokens = len(req.prompt_ids)
        self.completion_tokens = 0
        self.closed = False

    async def __aenter__(self) -> "Generation":
        return self

    async def __aexit__(self, *exc) -> None:
        self.closed = True
        self._scheduler._forget(self)

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> int:
        item = await self._receive.receive()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def _end(self, item=_END) -> None:
        try:
            self._send.send_nowait(item)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass


class Scheduler:
    def __init__(self, pipe: Pipeline, *, n_slots: int, max_context: int, max_queue: int = 64):
        if n_slots < 1 or max_queue < 0:
            raise ValueError(f"n_slots must be >= 1 and max_queue >= 0 (got {n_slots}, {max_queue})")
        self.pipe, self.n_slots, self.max_context, self.max_queue = pipe, n_slots, max_context, max_queue
        self._waiting: collections.deque[Generation] = collections.deque()
        self._running: Generation | None = None
        self._open: set[Generation] = set()
        self._wake = trio.Event()
        self._steps = 0
        self._tokens = 0
        self._failed: BaseException | None = None

    def open(self, req: Request) -> Generation:
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_context:
            raise ValueError(f"the prompt has {n} tokens; the context holds {self.max_context}, and at least one "
                             f"must be left for the answer")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (got {req.max_tokens})")
        if self._failed is not None:
            raise SessionError(f"the mesh session has ended: {self._failed}")
        if len(self._open) >= self.n_slots + self.max_queue:
            raise QueueFull(f"{self.n_slots} sequences are running and {self.max_queue} are queued")
        gen = Generation(self, req, min(req.max_tokens, self.max_context - n))
        self._open.add(gen)
        self._waiting.append(gen)
        self._wake.set()
        return gen

    def stats(self) -> SchedulerStats:
        active = len(self._open) - len(self._waiting)
        return SchedulerStats(active=active, queued=len(self._waiting), max_seqs=self.n_slots, steps=self._steps,
                              tokens_out=self._tokens)

    def _forget(self, gen: Generation) -> None:
        self._open.discard(gen)
        if gen in self._waiting:
            self._waiting.remove(gen)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                while not self._waiting:
                    self._wake = trio.Event()
                    await self._wake.wait()
                gen = self._waiting.popleft()
                if not gen.closed:
                    self._running = gen
                    try:
                        await self._generate(gen)
                    finally:
                        self._running = None
        except BaseException as exc:
            why = exc if isinstance(exc, MeshError) else "the mesh session ended"
            self._failed = why
            for gen in list(self._open):
                gen._end(SessionError(str(why)))
            raise

    async def _generate(self, gen: Generation) -> None:
        req = gen.request

        def on_token(tok: int) -> None:
            self._steps += 1
            if gen.closed:
                raise _Abandoned()
            if tok in req.stop_ids:
                gen.finish_reason = "stop"
                return
            gen.completion_tokens += 1
            self._tokens += 1
            gen._send.send_nowait(tok)
        try:
            result = await generate(self.pipe, list(req.prompt_ids), max_tokens=gen.limit, sampling=req.sampling,
                                    eos_ids=req.stop_ids, on_token=on_token)
        except _Abandoned:
            return
        gen.finish_reason = "stop" if result.stopped_by_eos else "length"
        gen._end()
