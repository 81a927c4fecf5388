"""Driving a formed chain: one step in, tokens out, in either chain mode; and generation on top of that.

Hub and spoke: the coordinator sends each stage its input and gets its output back, relaying hidden states.
Peer to peer: the coordinator sends the first stage its step; each stage forwards to its successor and the last
one sends only tokens to the coordinator's sink. Either way the stages compute the same thing in the same order,
so both modes give bitwise the same tokens.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

import trio

from common.values import Column, Sampling, SamplingArg, samplings_for
from mesh import proto
from mesh.convert import to_activation
from mesh.errors import SessionError
from mesh.link import LinkError

log = logging.getLogger("mesh.pipeline")


class LocalStage(Protocol):
    """The coordinator's own first layers (`--layers 0:K`): a worker client."""
    async def step(self, cols, hidden, sampling): ...
    async def zero_slot(self, slot): ...
    async def rollback(self, slot, pos): ...
    async def block_table(self, slot, blocks): ...
    async def reset(self): ...


async def _send(link, ev, who: str) -> None:
    try:
        await link.send(ev)
    except LinkError as exc:
        raise SessionError(f"{who} is gone: {exc}") from None


async def _receive(link, kind, who: str):
    try:
        ev = await link.receive()
    except LinkError as exc:
        raise SessionError(f"{who}: {exc}") from None
    if not isinstance(ev, kind):
        raise SessionError(f"{who}: expected {kind.__name__}, got {type(ev).__name__}")
    return ev


class Pipeline:
    """Base: the local stage (if any) and the group counter that pairs each step with its answer."""

    def __init__(self, local: LocalStage | None, names: list[str]):
        self.local = local
        self.names = names
        self._group = 0

    def next_group(self) -> int:
        self._group = (self._group + 1) & 0xFFFFFFFF
        return self._group

    async def _local(self, cols: list[Column], sampling: SamplingArg):
        if self.local is None:
            return None
        return to_activation(await self.local.step(cols, None, sampling))

    async def inband(self, ev) -> None:
        """ZeroSlot / Rollback / Reset / BlockTable, ahead of the steps they precede, to every stage in order."""
        if self.local is not None:
            if isinstance(ev, proto.ZeroSlot):
                await self.local.zero_slot(ev.slot)
            elif isinstance(ev, proto.Rollback):
                await self.local.rollback(ev.slot, ev.pos)
            elif isinstance(ev, proto.BlockTable):
                await self.local.block_table(ev.row, ev.blocks)
            elif isinstance(ev, proto.Reset):
                await self.local.reset()
        await self._send_inband(ev)

    async def submit(self, cols: list[Column], sampling: SamplingArg) -> int:
        """Start one step: `sampling` is one Sampling for every column that needs logits, or one per such column
        (each sequence of a batch with its own parameters and seed). Returns the group that `collect` takes."""
        raise NotImplementedError

    async def collect(self, group: int) -> tuple[int, ...]:
        """The step's tokens, one per column with needs_logits, in column order."""
        raise NotImplementedError

    async def step(self, cols: list[Column], sampling: SamplingArg) -> tuple[int, ...]:
        return await self.collect(await self.submit(cols, sampling))


class _Deferred(Pipeline):
    """A pipeline that computes a step only when its answer is collected (the coordinator drives every stage)."""

    def __init__(self, local: LocalStage | None, names: list[str]):
        super().__init__(local, names)
        self._pending: dict[int, tuple[list[Column], tuple[Sampling, ...]]] = {}

    async def submit(self, cols, sampling) -> int:
        sampling = samplings_for(sampling, cols)   # a bad count is the caller's error, raised here
        group = self.next_group()
        self._pending[group] = (cols, sampling)
        return group


class HubPipeline(_Deferred):
    """The coordinator relays every hidden state: stage links in chain order, each answering on its own link."""

    def __init__(self, links: list, names: list[str], local: LocalStage | None = None):
        super().__init__(local, names)
        self.links = links

    async def _send_inband(self, ev) -> None:
        for link, name in zip(self.links, self.names):
            await _send(link, ev, name)

    async def collect(self, group: int) -> tuple[int, ...]:
        cols, sampling = self._pending.pop(group)
        hidden = await self._local(cols, sampling)
        cols = tuple(cols)
        for k, (link, name) in enumerate(zip(self.links, self.names)):
            await _send(link, proto.BatchStep(group, len(cols) > 16, cols, hidden, sampling), name)
            last = k == len(self.links) - 1
            ev = await _receive(link, proto.Tokens if last else proto.Hidden, name)
            if ev.group != group:
                raise SessionError(f"{name}: answered step {ev.group}, expected {group}")
            if last:
                return ev.tokens
            hidden = ev.activation
        raise SessionError("empty chain")


class ChainPipeline(Pipeline):
    """True peer to peer: steps go to the first stage, tokens come back on the sink, matched by group."""

    def __init__(self, first_link, sink_receive: Callable[[], Awaitable[proto.Done]], names: list[str],
                 local: LocalStage | None = None, *, steady: bool = True):
        super().__init__(local, names)
        self.first = first_link
        self.sink_receive = sink_receive
        # the last one-column step sent: the next of its sequence is written as plaintext (SteadyStep.plain_for)
        # without a BatchStep built and encoded (cold Python on every token); CoordConfig.steady
        self._steady: proto.SteadyStep | None = None
        self._steady_on = steady

    async def _send_inband(self, ev) -> None:
        await _send(self.first, ev, self.names[0])    # each stage applies it and forwards it ahead of the next step

    async def submit(self, cols, sampling) -> int:
        sampling = samplings_for(sampling, cols)
        group = self.next_group()
        hidden = await self._local(cols, sampling)
        steady = self._steady if hidden is None and len(cols) == 1 else None
        plain = None if steady is None else steady.plain_for(group, cols[0], sampling)
        try:   # written at once when nothing stands in the way: no pass of trio's scheduler before the bytes leave
            if plain is not None and self.first.can_send_nowait():
                self.first.send_plain_nowait(plain)
                return group
            ev = proto.BatchStep(group, len(cols) > 16, tuple(cols), hidden, sampling)
            sent = self.first.send_nowait(ev)
        except LinkError as exc:
            raise SessionError(f"{self.names[0]} is gone: {exc}") from None
        if not sent:
            await _send(self.first, ev, self.names[0])
        if plain is None and hidden is None and len(cols) == 1 and self._steady_on:
            self._steady = proto.SteadyStep(ev)
        return group

    async def collect(self, group: int) -> tuple[int, ...]:
        done = await self.sink_receive()
        if done.group != group:
            raise SessionError(f"the sink answered step {done.group}, expected {group}")
        return done.tokens


class LocalPipeline(_Deferred):
    """Every layer in one stage of our own (a worker holding the whole model): the unsharded reference.

    A step goes to a worker at `submit` when it can go at once (`post_step_nowait`: the record written, the
    doorbell rung, no pass through trio's scheduler), so the caller's work between `submit` and `collect` (the
    scheduler handing the last step's tokens to its consumers) overlaps the step. Otherwise (another command in
    flight, a stage that posts nothing) the step runs at `collect`, as in any deferred pipeline. A posted step holds
    the worker until it is collected: in-band ops wait for it, so the caller collects before it sends one."""

    def __init__(self, stage: LocalStage):
        super().__init__(None, ["local"])
        self.stage = stage
        self._posted: dict[int, object] = {}

    async def submit(self, cols, sampling) -> int:
        post = getattr(self.stage, "post_step_nowait", None)
        if post is None:
            return await super().submit(cols, sampling)
        sampling = samplings_for(sampling, cols)
        group = self.next_group()
        try:
            self._posted[group] = post(cols, None, 0, 0, sampling)
        except trio.WouldBlock:
            self._pending[group] = (cols, sampling)
        return group

    async def _send_inband(self, ev) -> None:
        if isinstance(ev, proto.ZeroSlot):
            await self.stage.zero_slot(ev.slot)
        elif isinstance(ev, proto.Rollback):
            await self.stage.rollback(ev.slot, ev.pos)
        elif isinstance(ev, proto.BlockTable):
            await self.stage.block_table(ev.row, ev.blocks)
        elif isinstance(ev, proto.Reset):
            await self.stage.reset()

    def discard(self) -> None:
        """Give up the steps posted and never collected (their caller stopped): the worker is free for the next
        command and skips their replies (`Worker.abandon`)."""
        posted, self._posted = self._posted, {}
        abandon = getattr(self.stage, "abandon", None)
        for p in posted.values():
            if abandon is not None:
                abandon(p)

    async def collect(self, group: int) -> tuple[int, ...]:
        posted = self._posted.pop(group, None)
        if posted is not None:
            return tuple((await self.stage.step_posted(posted)).array().tolist())
        cols, sampling = self._pending.pop(group)
        return tuple(int(t) for t in await self.stage.step(cols, None, sampling))


@dataclass(frozen=True)
class GenerationResult:
    prompt_tokens: int
    tokens: list[int]
    stopped_by_eos: bool


async def generate(pipe: Pipeline, prompt: list[int], *, max_tokens: int, sampling: Sampling,
                   eos_ids: frozenset[int], slot: int = 0, resume_from: int = 0, chunk: int = 64,
                   on_token: Callable[[int], None] | None = None,
                   on_prefill: Callable[[int], None] | None = None) -> GenerationResult:
    """Prefill `prompt[resume_from:]` in chunks (KV before `resume_from` is kept), then decode up to `max_tokens`.
    `on_prefill(columns done)` is called as each prefill chunk comes back (a progress display).

    Prefill chunks are all submitted before any answer is awaited: in peer-to-peer mode stage 1 computes chunk 2
    while stage 2 computes chunk 1. Only the last prefill column asks for logits.
    """
    if not prompt:
        raise SessionError("empty prompt")
    resume_from = min(resume_from, len(prompt) - 1)
    await pipe.inband(proto.Rollback(slot, resume_from) if resume_from else proto.ZeroSlot(slot))
    groups = []
    for a in range(resume_from, len(prompt), chunk):
        b = min(a + chunk, len(prompt))
        cols = [Column(p, slot, p == len(prompt) - 1, prompt[p]) for p in range(a, b)]
        groups.append(await pipe.submit(cols, sampling))
    answers, done = [], 0
    for g in groups:
        answers.append(await pipe.collect(g))
        done = min(done + chunk, len(prompt) - resume_from)
        if on_prefill:
            on_prefill(done)
    if not answers[-1]:
        raise SessionError("the last stage returned no token for the prompt")
    out: list[int] = []
    tok, pos = int(answers[-1][-1]), len(prompt)
    while True:
        out.append(tok)
        if on_token:
            on_token(tok)
        if tok in eos_ids:
            return GenerationResult(len(prompt), out, True)
        if len(out) >= max_tokens:
            return GenerationResult(len(prompt), out, False)
        (tok,) = await pipe.step([Column(pos, slot, True, tok)], sampling)
        pos += 1
