"""The coordinator as a service: sessions formed and re-formed for as long as it runs, and HTTP in front of them.

`Service.run` is the forming loop. It opens a session (mesh/session.py), starts a Scheduler in it and serves until
the session ends, then forms the next one:
- a stage failed under a running step (the session raises SessionError): requests in flight get an error, the
  survivors re-join, the next fleet forms from whoever is pooled (as the chat re-forms);
- a member's link failed while the session was idle (`Session.wait_lost`): re-formed before the next request;
- new peers joined and nothing is running or queued: re-formed to include them (the peers already loaded keep
  their layers when the plan allows; NOTES "Mesh").
While no session serves, requests are refused with 503 and Retry-After; `GET /health` says why.

`serve_http` runs the ASGI app under hypercorn's trio worker, in the caller's nursery, on the coordinator's loop.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from pathlib import Path

import trio

from engine.chat import stop_markers
from engine.errors import EngineError
from mesh.errors import FleetError, HopError, MeshError, SessionError, single_errors
from mesh.link import LinkError
from mesh.proto import ProtoError
from mesh.scheduler import Scheduler, SchedulerStopped
from transport import TransportError
from mesh.session import open_session

log = logging.getLogger("mesh.serve")
REJOIN_SECONDS = 15.0     # how long a re-form waits for the members of the last session to re-join
RETRY_SECONDS = 5.0       # after a fleet that would not form (a refused peer, a failed load), try again this much later
IDLE_POLL = 0.5           # while newcomers wait for the scheduler to go idle, look this often
REFORM_WAIT = 60.0        # an answer whose mesh failed waits this long for the next one before it fails (a frozen
                          # peer is noticed in ~5.4 s; the survivors may reload layers and compile)
ANSWER_RETRIES = 3        # ... and is replayed at most this many times


class NoMesh(MeshError):
    """No session is serving (the first fleet has not formed, or a re-form is under way)."""


class Answer:
    """One request's tokens, surviving a re-form: if the mesh fails under its Generation, the request is opened on
    the next session with the tokens already delivered as its replay (`Request.replay`): the new chain computes
    the prompt and those tokens as the old one did, bit for bit, and goes on with the next token. No token is
    generated twice and none is sent twice; greedy and seeded answers are the ones an undisturbed run gives (the
    sampler keeps no state: a draw depends only on the seed and the position, engine/sampling.py, and any split of
    the model computes bitwise the same, NOTES "Mesh"). `async with answer: async for tok in answer: ...`, like a
    Generation."""

    def __init__(self, service: "Service", req, sched: Scheduler, gen):
        self.service, self.request, self.scheduler, self.gen = service, req, sched, gen
        self.tokens: list[int] = []     # delivered so far, over every session
        self.retries = 0

    @property
    def delivered(self) -> int:
        return len(self.tokens)

    @property
    def finish_reason(self) -> str | None:
        return self.gen.finish_reason

    @property
    def prompt_tokens(self) -> int:
        return self.gen.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return max(self.gen.completion_tokens, self.delivered)

    async def __aenter__(self) -> "Answer":
        await self.gen.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.gen.__aexit__(*exc)
        if exc[0] is None and self.retries == 0:    # a whole answer on one fleet: its rate against the prediction
            self.service.coord.note_decode_rate(list(getattr(self.gen, "token_times", ())))

    def __aiter__(self) -> "Answer":
        return self

    async def __anext__(self) -> int:
        while True:
            try:
                tok = await self.gen.__anext__()
            except MeshError as exc:
                await self._again(exc)
                continue
            self.tokens.append(tok)
            return tok

    async def _again(self, exc: MeshError) -> None:
        """Wait for the next session (bounded) and open the request there with its replay; else raise."""
        while True:
            if self.retries >= ANSWER_RETRIES:
                raise exc
            self.retries += 1
            log.info("an answer lost its mesh after %d tokens (%s); replaying it on the next one", self.delivered,
                     exc)
            with trio.move_on_after(REFORM_WAIT):
                await self.service.wait_state(lambda s: s.scheduler is not None and s.scheduler is not self.scheduler)
            sched = self.service.scheduler
            if sched is None or sched is self.scheduler:
                raise exc
            self.scheduler = sched
            try:
                gen = sched.open(replace(self.request, replay=tuple(self.tokens)), resumed=True)
            except SchedulerStopped as stopped:    # that session ended already: wait for the one after it
                exc = stopped
                continue
            except ValueError as refused:          # a smaller KV pool on the new chain, say: the answer fails cleanly
                raise MeshError(f"the re-formed mesh cannot take this answer back: {refused}") from None
            await self.gen.__aexit__(None, None, None)
            self.gen = gen
            self.service.repeated += 1
            await gen.__aenter__()
            return


def stop_ids(tokenizer) -> frozenset[int]:
    """Token ids that end an answer: end of generation, and control tokens that open a new turn."""
    controls = tokenizer.control_tokens()
    return frozenset(tokenizer.eos_ids) | {controls[t] for t in stop_markers(tokenizer) if t in controls}


def _kv_blocks(session) -> int | None:
    """The chain's KV pool for the scheduler's block allocator: the smallest stage's (Info.kv_blocks); None when a
    stage does not report one or the coordinator runs layers of its own (then every stage grows its own tables)."""
    pools = [getattr(i, "kv_blocks", 0) for i in getattr(session.fleet, "infos", ())]
    if not pools or not all(pools) or session.fleet.local is not None:
        return None
    return min(pools)


class Service:
    def __init__(self, coord, *, max_seqs: int = 4, max_queue: int = 64, api_key: str | None = None,
                 template: str = "auto"):
        self.coord = coord
        self.api_key = api_key
        self.template = template
        self.max_seqs, self.max_queue = max_seqs, max_queue
        if max_seqs > coord.cfg.n_slots:     # the stages hold cfg.n_slots (Load): the scheduler's room
            raise ValueError(f"max_seqs {max_seqs} needs {max_seqs} KV slots (one a sequence); the coordinator's "
                             f"configuration gives the stages {coord.cfg.n_slots}")
        self.max_context = coord.cfg.max_context
        self.model_id = Path(coord.cfg.model).name.removesuffix(".gguf")
        self.created = int(time.time())
        self.stop_ids = stop_ids(coord.tokenizer)
        self.session = None
        self.scheduler: Scheduler | None = None
        self.state = "forming"
        self.sessions = 0              # how many sessions have served (a test or a status view can watch it)
        self.repeated = 0              # answers repeated on a re-formed mesh after theirs failed
        self._changed = trio.Event()

    def open(self, req) -> Answer:
        """Admit a request now: NoMesh while no session serves, else the scheduler's QueueFull / ValueError."""
        sched = self.scheduler
        if sched is None:
            raise NoMesh(f"no mesh is formed yet ({self.state}): waiting for peers to join" if not self.sessions else
                         f"the mesh is re-forming ({self.state})")
        return Answer(self, req, sched, sched.open(req))

    async def wait_state(self, predicate) -> None:
        """Wait until predicate(self) holds (tests and status views: 'serving', the next session, ...)."""
        while not predicate(self):
            await self._changed.wait()

    def _set(self, state: str, session=None, scheduler=None) -> None:
        self.state, self.session, self.scheduler = state, session, scheduler
        self._changed.set()
        self._changed = trio.Event()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        lost: list = []            # the members of the last session, which re-join once it ends
        rejoin = 0
        try:
            while True:
                if lost:
                    with trio.move_on_after(REJOIN_SECONDS):
                        await self.coord.registry.wait_rejoined(lost, rejoin)
                min_peers = self.coord.cfg.min_peers if not self.sessions else 1
                members: list = []
                try:
                    async with open_session(self.coord, min_peers=min_peers, wait=math.inf) as s:
                        members = s.members
                        sched = Scheduler(s.pipe, n_slots=self.coord.cfg.n_slots, max_seqs=self.max_seqs,
                                          max_context=self.max_context, max_queue=self.max_queue,
                                          kv_blocks=_kv_blocks(s))
                        await s.start(sched.run)
                        self.sessions += 1
                        self._set("serving", s, sched)
                        log.info("serving %s on %d peer(s)", self.model_id, len(s.members))
                        why, survivors = await self._until_change(s, sched)
                        log.info("re-forming the mesh: %s", why)
                        self._set("re-forming")
                        lost, rejoin = s.members, survivors
                except (SessionError, HopError, LinkError) as exc:
                    self._set("re-forming")
                    log.warning("the mesh session ended: %s; re-forming from the peers that are left", exc)
                    lost, rejoin = members, max(len(members) - 1, 0)
                except (FleetError, EngineError, TransportError, ProtoError, OSError, trio.TooSlowError) as exc:
                    # a refused or failed peer, a local stage (--layers) that failed, a port, a negotiation past its
                    # bound: a service does not exit on these, it tries again
                    self._set("forming" if not self.sessions else "re-forming")
                    log.warning("the fleet could not form: %s; trying again in %.0fs",
                                exc or type(exc).__name__, RETRY_SECONDS)
                    lost, rejoin = [], 0
                    await trio.sleep(RETRY_SECONDS)
                except MeshError as exc:
                    self._set("re-forming")
                    log.warning("the mesh session ended: %s", exc)
                    lost, rejoin = members, max(len(members) - 1, 0)
        finally:
            self._set("stopped")

    async def _until_change(self, s, sched: Scheduler) -> tuple[str, int]:
        """Serve until the fleet changes: returns why, and how many of the session's members should re-join."""
        result: list[tuple[str, int]] = []
        async with trio.open_nursery() as nursery:
            async def lost() -> None:
                why = await s.wait_lost()
                result.append((why, len(s.members) - 1))
                nursery.cancel_scope.cancel()

            async def grown() -> None:
                while True:
                    await self.coord.registry.wait_changed()
                    if not s.newcomers():
                        continue
                    await trio.sleep(self.coord.cfg.settle)     # absorb the rest of a group joining together
                    while (st := sched.stats()).active or st.queued:
                        await trio.sleep(IDLE_POLL)
                    if s.newcomers():
                        result.append((f"{len(s.newcomers())} new peer(s) joined",
                                       len(s.members) + len(s.newcomers())))
                        nursery.cancel_scope.cancel()
                        return
            nursery.start_soon(lost)
            nursery.start_soon(grown)
        return result[0]


async def serve_http(app, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` with hypercorn's trio worker until cancelled; `task_status.started` gets the bound port."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 1.0
    config.keep_alive_timeout = 75.0       # longer than common clients' pool idle time, so they do not race a close

    class _Port:                            # hypercorn reports ["http://HOST:PORT"]; our callers want the port
        up = False

        def started(self, binds=None) -> None:
            self.up = True
            task_status.started(int(binds[0].rsplit(":", 1)[1]))
    status = _Port()
    try:
        with single_errors():               # hypercorn's nursery wraps a bind error in a group
            await serve(app, config, task_status=status)
    except OSError as exc:
        if status.up:
            raise
        raise MeshError(f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc}") from None
