"""A session is a scope: one formed fleet, from the wait for peers to their release.

`async with open_session(coord) as s:` waits for peers, negotiates, wires the chain and yields a Session. Everything
the session started lives inside that block and ends with it, in this order: its tasks (the sink listener, the
watchers, a scheduler started with `s.start`) are cancelled, then the chain's watchers close, the local worker
(`--layers`) closes and every member is released (each peer re-joins for the next session). Before this scope the
CLI's chat left each old session's sink listener running in the program's nursery, and patched the coordinator's
config to re-form; now a re-form is a new `open_session(coord, min_peers=...)`.

A session ends early, by raising out of the block, when its chain fails under a running step (SessionError from
the pipeline or a task in it). `wait_lost()` is for a session that is idle: it returns when any member's control link
fails (the heartbeat notices a silent peer within 5 s), so a service can re-form before the next request arrives.

Memory: after negotiating and at the end, the C heap's free pages go back to the OS (`common.memory.trim_heap`), and
the coordinator forgets the session's fleet, so a coordinator that re-forms for weeks stays at its size (NOTES
"Faults", tests/test_reform_memory.py).
"""
from __future__ import annotations

import logging
from contextlib import AsyncExitStack, asynccontextmanager
from typing import AsyncIterator

import trio

from common.memory import trim_heap
from mesh.errors import single_errors

log = logging.getLogger("mesh.session")


class Session:
    def __init__(self, coord, fleet, pipe, nursery):
        self.coord, self.fleet, self.pipe = coord, fleet, pipe
        self.members = list(fleet.members)
        self._nursery = nursery
        self._lost = trio.Event()
        self.lost_reason: str | None = None
        for m in self.members:
            nursery.start_soon(self._watch, m)

    @property
    def ranges(self) -> list[tuple[str, int, int]]:
        """(member name, first layer, end) in chain order, after the coordinator's own layers if it holds some."""
        return [(m.name, *r) for m, r in zip(self.members, self.fleet.ranges)]

    async def start(self, async_fn, *args):
        """Run a task for this session's lifetime (`nursery.start` semantics): it is cancelled when the session
        ends, and if it fails the session ends with its error."""
        return await self._nursery.start(async_fn, *args)

    async def wait_lost(self) -> str:
        """Wait until a member's control link fails; returns why (a peer gone while the session was idle)."""
        await self._lost.wait()
        return self.lost_reason or "a peer is gone"

    def newcomers(self) -> list:
        """Peers pooled since this session formed: a service may re-form to use them when it is idle."""
        return [m for m in self.coord.registry.members if m not in self.members
                and m.key not in self.coord.registry.benched]     # a left-out peer's re-join changes nothing

    async def _watch(self, m) -> None:
        why = await m.link.wait_failed()
        if self.lost_reason is None:
            self.lost_reason = f"{m.name} is gone: {why}"
        self._lost.set()


@asynccontextmanager
async def open_session(coord, *, min_peers: int | None = None, wait: float | None = None) -> AsyncIterator[Session]:
    """Form a fleet from the registry's pool (waiting for `min_peers`, default the config's) and own it."""
    try:
        with single_errors():      # the error that ended the session, not trio's group around it
            async with AsyncExitStack() as stack:
                nursery = await stack.enter_async_context(trio.open_nursery())
                fleet = None
                try:
                    fleet, pipe = await coord.form(nursery, stack, min_peers=min_peers, wait=wait)
                    session = Session(coord, fleet, pipe, nursery)
                    trim_heap()           # the negotiation's transient memory (see below), before serving
                    yield session
                finally:
                    # The session's tasks stop first (a scheduler must not step a chain being released); the stack
                    # then closes the watchers, the local worker and the members, and last the nursery itself.
                    nursery.cancel_scope.cancel()
                    if fleet is not None:
                        coord.forget(fleet)
    finally:
        # What the session held is gone; what a re-form allocated and freed (GGUF headers parsed and range files
        # hashed in worker threads, the vocabulary message, negotiation buffers) glibc would keep as free heap, and
        # a long-lived coordinator would step up at each new kind of re-form (common/memory.py).
        trim_heap()
