"""mesh-coord: the registry, fleet negotiation, chain wiring and the user's session.

The coordinator owns the tokenizer and the scheduler. Headless (the default), it reads the GGUF's metadata and
vocabulary but loads no weights; with `--layers 0:K` it runs the first K layers in its own worker.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import trio

import transport
from common.values import Sampling
from engine.chat import render_prompt
from engine.gguf_meta import read_model_meta
from engine.tokenizer import StreamDecoder, Tokenizer
from mesh import proto
from mesh.admission import layer_mb, leave_out
from mesh.errors import FleetError, HopError, SessionError, single_errors
from mesh.identity import model_identity
from mesh.link import LinkError, PreAuthGate, RemoteError, open_link
from mesh.logsafe import clean
from mesh.pipeline import ChainPipeline, HubPipeline, Pipeline, generate
from mesh.planner import (LinkSpeed, ModelCost, Placement, PlanError, StageReport, StageSpeed, plan_by_speed,
                          plan_fleet, predict, validate_chain)
from mesh.registry import Member, Registry
from mesh.serve.status import transport_of_addr

log = logging.getLogger("mesh.coord")
RPC_SECONDS = 600.0          # a load may read gigabytes; a ship is bounded separately by its own progress
LINK_PAD = 256 << 10         # filler timed through each peer's control link for its bandwidth (planner.LinkSpeed)
KEEP_UNLESS_GAIN = 0.10      # a re-formed fleet that tiles keeps its layout unless a new plan predicts >10% faster
SINK_GRACE = 6.0             # a dead stage's control link fails within a heartbeat window (5 s) of its death
HANDSHAKE_SECONDS = 10.0     # a connection to the sink must authenticate within this
RTC_SECONDS = 75.0           # both peers gather candidates and ICE checks run; each peer bounds its own steps at 30 s


@dataclass(frozen=True)
class CoordConfig:
    model: Path
    listen: str = "0.0.0.0:9000"
    token: bytes | None = None
    min_peers: int = 1
    settle: float = 2.0
    wait: float = 300.0
    chain: str = "p2p"
    layers: tuple[int, int] | None = None
    device: str | None = None
    auto_webrtc: bool = False
    webrtc_hops: tuple[int, ...] = ()
    ice: object = None                 # signaling.IceConfig; None = no STUN/TURN (host candidates only)
    n_slots: int = 4                   # KV slots on every stage (Load): one a sequence (--max-seqs 4)
    max_context: int = 2048
    warmup: int = 1                    # decode widths the local stage compiles at load (Worker.load); 0: none
    identity: str = ""                 # the model's content identity (mesh.identity); "" = computed from `model`
    stage_warmup: int = 0              # decode widths every peer compiles at load (Load.warmup); 0: each peer's
                                       # own --warmup; -1: the widths the scheduler forms with n_slots over this chain
    placement: str = "speed"           # "speed": by the peers' measured speed (within memory); "memory": memory only
    # the decode loop reads the sink hop's bytes itself while it waits for a token (Link.pump), instead of waking
    # through the sink link's reader task; MESH_HOT_SINK=0 turns it off (A/B: bench/mesh_bench.py --ab)
    hot_sink: bool = field(default_factory=lambda: os.environ.get("MESH_HOT_SINK", "1") != "0")
    # the next decode step of a sequence goes to the first stage as plaintext written directly (ChainPipeline,
    # mesh/proto/steady.py), not a BatchStep built and encoded; MESH_STEADY=0 builds every one (A/B)
    steady: bool = field(default_factory=lambda: os.environ.get("MESH_STEADY", "1") != "0")


def _info_report(m: Member, ev: proto.Info) -> StageReport:
    speed = StageSpeed(ev.decode_ms_layer, ev.prefill_ms_layer, ev.step_ms) if ev.decode_ms_layer > 0 else None
    return StageReport(m.name, ev.start, ev.end, ev.total_layers, ev.memory_mb, ev.pinned, clean(ev.fingerprint),
                       clean(ev.backend), ev.loaded, speed, ev.measures, kv_bytes=ev.kv_bytes)


def _chain(reports: list[StageReport], ranges) -> tuple[tuple[str, int, int], ...]:
    return tuple(sorted(((rep.name, *r) for rep, r in zip(reports, ranges) if r is not None), key=lambda x: x[1]))


def model_cost(path: Path, *, n_slots: int, max_context: int) -> ModelCost:
    """The planner's view of the model: MB one layer needs on a peer (its weights as stored, plus a KV cache for the
    coordinator's slots and context, at f32 here and priced on each peer at the bytes it says it keeps: Info.kv_bytes,
    engine.kv_blocks.kv_type_for) and a column's wire bytes."""
    from engine.gguf_meta import read_gguf
    meta, gguf = read_model_meta(path), read_gguf(path)
    weights = sum(t.nbytes for n, t in gguf.tensors.items() if n.startswith("blk."))
    kv = 2 * meta.n_kv_heads * meta.head_dim * 4 * n_slots * min(max_context, meta.context_length)
    return ModelCost((weights / max(meta.n_layers, 1) + kv) / 2**20, meta.dim * 4, kv_mb=kv / 2**20)


def _memo_dir(kind: str) -> Path:
    from mesh.shipping import default_cache_dir
    return default_cache_dir() / kind


async def _rpc_all(members: list[Member], make: Callable[[Member], object], expect) -> list:
    """Send to every member first, then collect every answer: the peers work in parallel. The answers are awaited
    together, so the first member that fails (a frozen peer's link times out in ~5 s) fails the whole call at once,
    instead of after the slowest member's answer (a load with its compile can take a minute on a busy CPU)."""
    for m in members:
        await m.link.send(make(m))
    out: list = [None] * len(members)

    async def answer(i: int, m: Member) -> None:
        try:
            ev = await m.link.receive()
        except LinkError as exc:
            raise FleetError(f"{m.name}: {exc}") from None
        if not isinstance(ev, expect):
            raise FleetError(f"{m.name}: expected {expect.__name__}, got {type(ev).__name__}")
        out[i] = ev
    with single_errors():
        async with trio.open_nursery() as nursery:
            for i, m in enumerate(members):
                nursery.start_soon(answer, i, m)
    return out


class Fleet:
    """A formed fleet for one session: members in chain order, their ranges, and the means to drive them."""

    def __init__(self, cfg: CoordConfig, registry: Registry, tokenizer: Tokenizer):
        self.cfg = cfg
        self.registry = registry
        self.meta = read_model_meta(cfg.model)
        self.identity = cfg.identity or model_identity(cfg.model, _memo_dir("identities"))
        self.tokenizer = tokenizer
        self.members: list[Member] = []
        self.ranges: list[tuple[int, int]] = []     # each member's layers, chain order (after negotiate)
        self.placement: Placement | None = None
        self._left_out_notes: dict[int, tuple[str, str]] = {}   # member number -> (kind, line) of the last plan
        self.local = None
        self.infos: list[proto.Info] = []       # each member's last Info, in chain order (the status view)
        self.hops: list[str | None] = []        # the transport each hop came up on (tcp/ws/webrtc), in chain order
        self._plans: dict[tuple[int, int], object] = {}
        self._stats_lock = trio.Lock()
        self._stats_owed: list[int] = []
        self.stages = 1                 # stages of the chain being formed, the coordinator's own layers counted
        self.layer_mb = layer_mb(cfg.model)      # the least memory a stage needs: one layer's weights
        self.left_out: list[Member] = []

    @property
    def first_layer(self) -> int:
        return self.cfg.layers[1] if self.cfg.layers else 0

    async def negotiate(self, members: list[Member]) -> str:
        """Info, plan, load (ship where needed), re-check, validate. Returns the topology map."""
        infos = await _rpc_all(members, lambda m: proto.InfoRequest(self.identity), proto.Info)
        reports = [_info_report(m, ev) for m, ev in zip(members, infos)]
        for r in reports:  # a peer that holds its own model must hold ours
            if r.fingerprint and r.fingerprint != self.identity:
                raise FleetError(f"{r.name} holds a different model (identity {r.fingerprint[:16]}, "
                                 f"the coordinator's {self.cfg.model.name} is {self.identity[:16]})")
        members, reports = await self._admit(members, reports)
        ranges = self._keep_loaded(reports)
        if ranges is not None:
            self.placement = Placement("kept", _chain(reports, ranges))
        else:
            try:
                ranges = await self._place(members, reports)
            except PlanError as exc:
                raise FleetError(str(exc)) from None
        if any(not r.pinned for r in reports) and ranges != [(r.start, r.end) for r in reports]:
            log.info("auto-split: layers %d..%d over %d peers -> %s", self.first_layer, self.meta.n_layers,
                     len(members), ", ".join(f"{r[0]}..{r[1]}" if r else "left out" for r in ranges))
        await self._leave_out([m for m, r in zip(members, ranges) if r is None])
        reports = [rep for rep, r in zip(reports, ranges) if r is not None]
        members, ranges = [m for m, r in zip(members, ranges) if r is not None], [r for r in ranges if r is not None]
        self.stages = len(members) + (self.cfg.layers is not None)
        await self._load_all(members, ranges, [rep.pinned for rep in reports])
        infos = await _rpc_all(members, lambda m: proto.InfoRequest(), proto.Info)
        order = sorted(range(len(members)), key=lambda i: infos[i].start)
        self.members = [members[i] for i in order]
        self.ranges = [(infos[i].start, infos[i].end) for i in order]
        self.infos = [infos[i] for i in order]
        try:
            return validate_chain(self.first_layer, [_info_report(members[i], infos[i]) for i in order],
                                  self.identity)
        except PlanError as exc:
            raise FleetError(str(exc)) from None

    def _load_msg(self, r: tuple[int, int], digest: bytes) -> proto.Load:
        """Every stage loads the session's slots and context (the scheduler's sequences live in those slots)."""
        warmup = self.cfg.stage_warmup
        if warmup < 0:
            from mesh.scheduler import decode_widths
            warmup = decode_widths(self.cfg.n_slots, self.stages if self.cfg.chain == "p2p" else 1)
        return proto.Load(r[0], r[1], self.meta.n_layers, self.identity, digest, self.cfg.n_slots,
                          self.cfg.max_context, warmup)

    async def _admit(self, members: list[Member], reports: list[StageReport]):
        """Leave out the peers that cannot take part (mesh.admission), telling each why; plan the rest."""
        out = leave_out(self.first_layer, self.meta.n_layers, reports, self.layer_mb)
        if len(out) == len(members):
            raise FleetError("no peer can take part: " + "; ".join(e.reason for e in out))
        for e in out:
            await self.leave(members[e.index], e.code, e.reason)
        gone = {e.index for e in out}
        for i, m in enumerate(members):
            if i not in gone:
                self.registry.benched.discard(m.key)
        return ([m for i, m in enumerate(members) if i not in gone],
                [r for i, r in enumerate(reports) if i not in gone])

    async def _load_all(self, members: list[Member], ranges: list[tuple[int, int]], pinned: list[bool]) -> None:
        """Load every member's range (all sent before any answer is read); ship the layers to those without them."""
        LC = proto.LoadCode
        digests = [await self._digest(r) if not p else b"" for r, p in zip(ranges, pinned)]
        acks = await _rpc_all(members, lambda m: self._load_msg(ranges[members.index(m)], digests[members.index(m)]),
                              proto.Ack)
        for m, r, ack in zip(members, ranges, acks):
            if ack.code == LC.NEED_WEIGHTS:
                await self._ship(m, r)
            elif ack.code == LC.WRONG_CHECKPOINT:
                raise FleetError(f"{m.name} holds a different model: {clean(ack.reason)}")
            elif ack.code != LC.OK:
                raise FleetError(f"{m.name} could not load layers {r[0]}..{r[1]}: {clean(ack.reason)}")

    async def _place(self, members: list[Member], reports: list[StageReport]) -> list[tuple[int, int] | None]:
        """The plan: by measured speed where every peer has (or can get) figures, else by memory as before."""
        first, total = self.first_layer, self.meta.n_layers
        why = self._no_speed_plan(reports)
        if why is None:
            lacking = [i for i, r in enumerate(reports) if r.speed is None]
            if lacking:
                # The chicken and the egg: a peer measures a stage it has loaded. One middle layer (no embedding, no
                # head) is enough for its per-layer figures, cached on the peer per device and model afterwards.
                k = max(first, total // 2 - 1) if total - first > 1 else first
                log.info("measuring %s on a probe of layer %d", ", ".join(members[i].name for i in lacking), k)
                await self._load_all([members[i] for i in lacking], [(k, k + 1)] * len(lacking), [False] * len(lacking))
                probed = await _rpc_all([members[i] for i in lacking], lambda m: proto.InfoRequest(self.identity),
                                        proto.Info)
                for i, ev in zip(lacking, probed):
                    reports[i] = replace(reports[i], speed=_info_report(members[i], ev).speed)
                still = [members[i].name for i in lacking if reports[i].speed is None]
                why = f"{', '.join(still)} reported no speed after the probe" if still else None
        cost = model_cost(self.cfg.model, n_slots=self.cfg.n_slots, max_context=self.cfg.max_context)
        if why is not None:
            ranges = plan_fleet(first, total, reports)
            predicted = None
            if all(r.speed is not None for r in reports):      # measured all the same: say what memory alone gives
                reports = [replace(r, link=await self._measure_link(m)) for m, r in zip(members, reports)]
                predicted = predict(reports, ranges, cost)
            log.info("placement by memory%s%s", f": predicted {predicted.decode_tok_s:.2f} tok/s decode, "
                     f"{predicted.prefill_tok_s:.0f} tok/s prefill" if predicted else "",
                     f" ({why})" if self.cfg.placement == "speed" else "")
            self.placement = Placement("memory", _chain(reports, ranges), predicted and predicted.decode_tok_s,
                                       predicted and predicted.prefill_tok_s, note=why)
            return ranges
        reports = [replace(r, link=await self._measure_link(m)) for m, r in zip(members, reports)]
        plan = plan_by_speed(first, total, reports, cost)
        ranges = list(plan.ranges)
        try:
            by_memory = predict(reports, plan_fleet(first, total, reports), cost).decode_tok_s
        except PlanError:
            by_memory = None
        kept = self._keep_tiling(reports, plan.prediction.decode_ms, cost)
        if kept is not None:
            ranges = kept
        prediction = predict(reports, ranges, cost)
        notes = {n.index: (n.kind, n.line) for n in plan.left_out if ranges[n.index] is None}
        for i, r in enumerate(ranges):
            if r is None and i not in notes:
                notes[i] = ("other", f"{reports[i].name} is not needed now: the fleet's loaded layout predicts within "
                                     f"{KEEP_UNLESS_GAIN:.0%} of the best plan, so it is kept")
        self._left_out_notes = {members[i].number: note for i, note in notes.items()}
        self.placement = Placement("speed" if kept is None else "kept", _chain(reports, ranges),
                                   prediction.decode_tok_s, prediction.prefill_tok_s, by_memory,
                                   tuple(line for _, line in notes.values()))
        log.info("placement by speed: predicted %.2f tok/s decode, %.0f tok/s prefill%s", prediction.decode_tok_s,
                 prediction.prefill_tok_s, f" (memory-only plan: {by_memory:.2f} tok/s decode)" if by_memory else "")
        return ranges

    def _no_speed_plan(self, reports: list[StageReport]) -> str | None:
        """Why this fleet cannot be planned by speed, or None when it can (perhaps after a probe)."""
        if self.cfg.placement != "speed":
            return "--placement memory"
        if len(reports) == 1 and not self.cfg.layers:
            # One peer holds every layer whatever it measures: a probe would only cost its compile (~20 s cold).
            return "one peer: nothing to place"
        for r in reports:
            if r.speed is None and (r.pinned or not r.measures):
                return f"{r.name} does not measure its speed (it loads with --warmup 0)" if not r.measures else \
                    f"{r.name} is pinned and has no measured speed"
        return None

    def _keep_tiling(self, reports: list[StageReport], best_ms: float, cost: ModelCost) -> list | None:
        """A re-formed fleet whose loaded peers still tile the model keeps that layout (no reload, no re-ship) unless
        the new plan predicts it more than KEEP_UNLESS_GAIN faster; link figures alone vary that much run to run."""
        loaded = [r for r in reports if r.loaded and r.fingerprint == self.identity]
        try:
            validate_chain(self.first_layer, sorted(loaded, key=lambda r: r.start), self.identity)
        except PlanError:
            return None
        ranges = [(r.start, r.end) if r in loaded else None for r in reports]
        if predict(reports, ranges, cost).decode_ms * (1 - KEEP_UNLESS_GAIN) > best_ms:
            return None
        return ranges

    async def _measure_link(self, m: Member) -> LinkSpeed:
        """The peer's control link as the stand-in for its hops, which do not exist before the plan: on a home LAN
        every machine reaches the others through the same switch or access point, so its own link (a laptop on Wi-Fi,
        a desktop on a wire) is what sets its hops' latency and bandwidth. Best of 3 empty round trips, best of 2
        with LINK_PAD bytes out and back."""
        async def round_trip(pad: bytes) -> float:
            t0 = time.perf_counter()
            await m.link.send(proto.InfoRequest("", pad))
            ev = await m.link.receive()
            if not isinstance(ev, proto.Info):
                raise FleetError(f"{m.name}: expected Info, got {type(ev).__name__}")
            return (time.perf_counter() - t0) * 1000
        try:
            rtt = min([await round_trip(b"") for _ in range(3)])
            padded = min([await round_trip(bytes(LINK_PAD)) for _ in range(2)])
        except LinkError as exc:
            raise FleetError(f"{m.name}: {exc}") from None
        return LinkSpeed(rtt, 2 * LINK_PAD / 1e3 / max(padded - rtt, 1e-3))

    async def _leave_out(self, members: list[Member]) -> None:
        """Tell each peer the plan leaves out why (one line with the figures), then send it back to the pool."""
        for m in members:
            codes = {"too_slow": proto.LeftOutCode.TOO_SLOW, "memory": proto.LeftOutCode.MEMORY,
                     "surplus": proto.LeftOutCode.SURPLUS}
            kind, line = self._left_out_notes.get(m.number, ("other", f"{m.name} is not in the kept layout"))
            await self.leave(m, codes.get(kind, proto.LeftOutCode.OTHER), line)

    async def leave(self, m: Member, code: proto.LeftOutCode, reason: str) -> None:
        """Tell `m` why this session goes on without it and release it: it re-joins and waits in the pool."""
        log.warning("left out %s", reason)
        self.left_out.append(m)
        self.registry.benched.add(m.key)    # its re-join is no reason to re-form a serving fleet
        try:
            await m.link.send(proto.LeftOut(code, reason))
        except LinkError:
            pass                                   # gone already; the pool forgets it either way
        m.release()

    def _keep_loaded(self, reports: list[StageReport]) -> list[tuple[int, int]] | None:
        """The ranges the peers already hold, if they already form a valid chain of this model: a fleet that
        re-forms (the next session, a restarted coordinator) keeps its layout instead of reshuffling and reloading."""
        if not all(r.loaded and r.fingerprint == self.identity for r in reports):
            return None
        order = sorted(reports, key=lambda r: r.start)
        try:
            validate_chain(self.first_layer, order, self.identity)
        except PlanError:
            return None
        return [(r.start, r.end) for r in reports]

    def _plan(self, r: tuple[int, int]):
        """The range file this coordinator ships for layers r: it names the model by its content identity."""
        from engine.gguf_range import plan_range_gguf
        key = tuple(r)
        if key not in self._plans:
            self._plans[key] = plan_range_gguf(self.cfg.model, r[0], r[1], fingerprint=self.identity)
        return self._plans[key]

    async def _digest(self, r: tuple[int, int]) -> bytes:
        """SHA-256 of the range file for r, sent with the Load so a peer checks its cached copy byte for byte.
        Remembered on disk (RangePlan.sha256's memo), so a re-formed or restarted coordinator does not re-read it."""
        plan = await trio.to_thread.run_sync(self._plan, r)
        return await trio.to_thread.run_sync(plan.sha256, _memo_dir("digests"))

    async def _ship(self, m: Member, r: tuple[int, int]) -> None:
        from mesh.shipping import ship_range
        log.info("%s has no model: shipping layers %d..%d", m.name, *r)
        # The memo keeps the range file's SHA-256, so a restarted coordinator resumes without re-reading the range.
        plan = await trio.to_thread.run_sync(self._plan, r)
        await ship_range(m.link, plan, label=m.name, digest_memo=_memo_dir("digests"))
        await m.link.send(self._load_msg(r, await self._digest(r)))
        try:
            ack = await m.link.receive()
        except LinkError as exc:
            raise FleetError(f"{m.name}: {exc}") from None
        if not isinstance(ack, proto.Ack) or ack.code != proto.LoadCode.OK:
            raise FleetError(f"{m.name} still cannot load layers {r[0]}..{r[1]} after shipping: "
                             f"{clean(getattr(ack, 'reason', type(ack).__name__))}")

    async def read_stats(self, timeout: float = 2.0) -> list:
        """Each stage's cumulative work (`proto.Stats` as `StageCounters`), None for a stage that did not answer
        in time. Only in p2p mode once the chain is wired: then nothing else reads the control links (in hub mode
        they carry the steps; the scheduler's per-stage times stand in there, mesh/serve/status.py)."""
        from mesh.serve.status import StageCounters
        out: list = [None] * len(self.members)
        if self.cfg.chain != "p2p" or len(self.hops) < len(self.members):
            return out
        async with self._stats_lock:
            owed = self._stats_owed = self._stats_owed or [0] * len(self.members)
            with trio.move_on_after(timeout):
                for k, m in enumerate(self.members):
                    try:
                        await m.link.send(proto.StatsRequest())
                    except LinkError:      # a stage that is gone has no figures; the session hears it elsewhere
                        continue
                    owed[k] += 1
                for k, m in enumerate(self.members):
                    while owed[k]:      # answers come in order; one owed by a poll that timed out is read first
                        try:
                            ev = await m.link.receive()
                        except (LinkError, RemoteError):
                            break
                        if isinstance(ev, proto.Stats):
                            owed[k] -= 1
                            out[k] = StageCounters(trio.current_time(), ev.steps, ev.columns, ev.busy_us / 1e6)
        return out

    async def send_vocab(self) -> None:
        vocab = proto.Vocab(tuple(self.tokenizer.token_bytes(i) for i in range(self.tokenizer.vocab_size)))
        for m in self.members:
            try:
                await m.link.send(vocab)
            except LinkError as exc:
                raise FleetError(f"{m.name} is gone: {exc}") from None


async def _sink_service(token, host: str, send_channel, *, sinks: set | None = None,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The return sink: a link like the others. Only a connection that passed the handshake can touch the session:
    one that fails it (garbage, a half handshake, a wrong token, a port scanner) is logged and dropped, and the
    answer being streamed goes on. Only the end of an authenticated hop is reported to the session. `sinks` holds
    the authenticated sink links while they serve (the decode loop pumps the one it waits on)."""
    gate = PreAuthGate()
    sinks = set() if sinks is None else sinks

    async def handler(stream):
        who = transport.remote_host(stream)
        authenticated = False
        try:
            with trio.fail_after(HANDSHAKE_SECONDS) as handshake:
                async with open_link(stream, token=token, role="server", gate=gate) as link:
                    authenticated = True
                    handshake.deadline = math.inf
                    link.take = functools.partial(_take_done, send_channel)
                    sinks.add(link)
                    try:
                        await _serve_sink(link, who, send_channel)
                    finally:
                        sinks.discard(link)
        except trio.TooSlowError:
            log.warning("sink: a connection from %s sent no handshake within %.0fs; dropped", who, HANDSHAKE_SECONDS)
        except (LinkError, proto.ProtoError, transport.TransportError) as exc:
            if not authenticated:
                log.warning("sink: refused a connection from %s: %s", who, exc)
                return
            log.info("sink: hop from %s ended: %s", who, exc)
            await send_channel.send(_SinkEnded(f"the sink hop from {who} ended: {exc}"))
    await transport.serve_listener(host, 0, handler, task_status=task_status)


async def _serve_sink(link, who: str, send_channel) -> None:
    while True:
        try:
            ev = await link.receive()
        except RemoteError as exc:   # the last stage failed a step: the session must hear it
            ev = proto.Error(exc.code, f"the last stage ({who}): {exc.reason}")
        if isinstance(ev, (proto.Done, proto.Error)):
            try:  # the decode turn: hand the answer over without a pass through the scheduler
                send_channel.send_nowait(ev)
            except trio.WouldBlock:
                await send_channel.send(ev)


def _take_done(send_channel, ev) -> bool:
    """The sink link's reader hands a Done straight to the decode loop (`Link.take`): one pass of trio's scheduler
    less than through the sink task's receive(). Anything else goes the sink task's way."""
    if type(ev) is not proto.Done:
        return False
    try:
        send_channel.send_nowait(ev)
    except trio.WouldBlock:
        return False
    return True


@dataclass(frozen=True)
class _SinkEnded:
    """The sink hop closed. Usually a symptom: a stage upstream died and the chain behind it wound down."""
    reason: str


async def _report_loss(m: Member, send_channel) -> None:
    """In p2p mode the coordinator only reads the sink: a stage that dies mid-chain must still end the wait."""
    why = await m.link.wait_failed()
    await send_channel.send(proto.Error(proto.ErrorCode.INTERNAL, f"{m.name} is gone: {why}"))


async def wire_chain(fleet: Fleet, nursery, stack: AsyncExitStack) -> Pipeline:
    """Connect the stages: hub mode needs nothing; p2p mode has each peer dial its successor and the last dial the sink."""
    names = [m.name for m in fleet.members]
    links = [m.link for m in fleet.members]
    if fleet.cfg.chain == "hub":
        from mesh.serve.status import transport_of_stream
        fleet.hops = [transport_of_stream(link.stream) for link in links]
        return HubPipeline(links, names, fleet.local)
    fleet.hops = []
    send, receive = trio.open_memory_channel(64)
    watchers = await stack.enter_async_context(trio.open_nursery())
    stack.callback(watchers.cancel_scope.cancel)       # runs first at the session's end, then the nursery closes
    for m in fleet.members:
        watchers.start_soon(_report_loss, m, send)
    host = fleet.cfg.listen.rpartition(":")[0] or "0.0.0.0"
    sinks: set = set()
    sink_port = await nursery.start(functools.partial(_sink_service, sinks=sinks), fleet.cfg.token, host, send)
    for k, m in enumerate(fleet.members):
        last = k == len(fleet.members) - 1
        await _wire_hop(fleet, k, f":{sink_port}" if last else fleet.members[k + 1].hop_addr, last)

    async def sink_receive() -> proto.Done:
        while True:     # the hot sink: while one sink hop serves, its bytes are read here, in the decode loop's task
            try:
                ev = receive.receive_nowait()
                break
            except trio.WouldBlock:
                pass
            if not (fleet.cfg.hot_sink and len(sinks) == 1 and await next(iter(sinks)).pump()):
                ev = await receive.receive()
                break
        if isinstance(ev, _SinkEnded):
            # Name the cause, not the symptom: when a middle stage dies, the hops behind it close, often before
            # the coordinator's own control link to the dead stage has failed. Give the watchers a heartbeat
            # window to report it; if no stage is gone, the sink hop itself was the fault.
            with trio.move_on_after(SINK_GRACE):
                while not isinstance(cause := await receive.receive(), proto.Error):
                    pass
                ev = cause
        if isinstance(ev, (proto.Error, _SinkEnded)):
            raise SessionError(ev.reason)
        return ev
    return ChainPipeline(links[0], sink_receive, names, fleet.local, steady=fleet.cfg.steady)


async def _wire_hop(fleet: Fleet, k: int, addr: str, sink: bool) -> None:
    """The transport ladder for hop k -> k+1: a direct dial (TCP or WebSocket), then WebRTC where allowed."""
    m = fleet.members[k]
    forced = (k + 1) in fleet.cfg.webrtc_hops and not sink
    direct_error = "skipped: --webrtc-hops"
    if not forced:
        try:
            await m.link.send(proto.Chain(addr, sink))
            ack = await m.link.receive()
        except RemoteError as exc:
            ack = proto.Ack(proto.MsgType.CHAIN, 1, exc.reason)
        except LinkError as exc:
            raise HopError(f"hop {k + 1}: {m.name} is gone: {exc}") from None
        if isinstance(ack, proto.Ack) and ack.code == 0:
            fleet.hops.append(transport_of_addr(addr))
            return
        direct_error = clean(getattr(ack, "reason", type(ack).__name__))
        if sink or not fleet.cfg.auto_webrtc:
            raise HopError(f"hop {k + 1} ({m.name} -> {'sink' if sink else addr}): {direct_error}")
    nxt = fleet.members[k + 1]
    from signaling import HopProgress, open_rtc_hop
    progress = HopProgress()
    try:
        with trio.fail_after(RTC_SECONDS):
            await open_rtc_hop(m.link, nxt.link, sink=False, hop=f"hop {k + 1}", progress=progress)
    except trio.TooSlowError:
        raise HopError(f"hop {k + 1} ({m.name} -> {nxt.name}): direct dial: {direct_error}; "
                       f"webrtc: timed out after {RTC_SECONDS:.0f}s during {progress.step}") from None
    except Exception as exc:
        raise HopError(f"hop {k + 1} ({m.name} -> {nxt.name}): direct dial: {direct_error}; webrtc: {exc}") from None
    log.info("hop %d (%s -> %s) runs over WebRTC", k + 1, m.name, nxt.name)
    fleet.hops.append("webrtc")


class Coordinator:
    def __init__(self, cfg: CoordConfig, *, out=None, err=None):
        if not cfg.identity:    # hashed once per file (then remembered), before any peer's link needs the loop
            cfg = replace(cfg, identity=model_identity(cfg.model, _memo_dir("identities")))
        self.cfg = cfg
        self.tokenizer = Tokenizer.from_gguf(cfg.model)
        self.registry = Registry(cfg.token)
        self.out = out or sys.stdout
        self.placement: Placement | None = None   # the current fleet's plan, with the measured rate once decoding ran
        self._fleet: Fleet | None = None

    async def serve_registry(self, nursery) -> int:
        host, _, port = self.cfg.listen.rpartition(":")
        return await nursery.start(self.registry.serve, host or "0.0.0.0", int(port))

    async def form(self, nursery, stack: AsyncExitStack, *, min_peers: int | None = None,
                   wait: float | None = None) -> tuple[Fleet, Pipeline]:
        """Wait for peers, negotiate, wire the chain. Tasks (the sink listener) go to `nursery`, clean-ups (member
        release, watchers, the local worker) to `stack`: mesh.session.open_session owns both for one session.
        `min_peers` / `wait` override the config's for this session (a re-form takes whoever survived)."""
        need = self.cfg.min_peers if min_peers is None else min_peers
        wait = self.cfg.wait if wait is None else wait
        with trio.move_on_after(wait) as waiting:
            members = await self.registry.wait_for(need, self.cfg.settle)
        if waiting.cancelled_caught:
            raise FleetError(f"only {len(self.registry.members)} of {need} peers joined "
                             f"{self.cfg.listen} within {wait:.0f}s")
        for m in members:
            stack.callback(m.release)       # the session's end sends every peer back to re-join
        fleet = Fleet(self.cfg, self.registry, self.tokenizer)
        if self.cfg.layers:
            from engine.worker import open_worker
            from mesh.console import activity
            fleet.local = await stack.enter_async_context(open_worker(device=self.cfg.device))
            async with activity(f"loading layers 0..{self.cfg.layers[1]} of {self.cfg.model.name}"
                                + (", compiling step shapes" if self.cfg.warmup else "")):
                await fleet.local.load(self.cfg.model, 0, self.cfg.layers[1], n_slots=self.cfg.n_slots,
                                       max_context=self.cfg.max_context, warmup=self.cfg.warmup)
        with trio.fail_after(RPC_SECONDS):
            topology = await fleet.negotiate(members)
        print(topology, file=sys.stderr, flush=True)
        self.placement = fleet.placement
        self._fleet = fleet                         # the measured decode rate goes onto its placement too
        await fleet.send_vocab()
        pipe = await wire_chain(fleet, nursery, stack)
        return fleet, pipe

    def forget(self, fleet: Fleet) -> None:
        """A session ended: drop the fleet it formed (its members' closed links, range plans, infos), which `form`
        kept for the measured decode rate, so nothing of it lives on until the next session forms."""
        if self._fleet is fleet:
            self._fleet = None

    async def answer(self, pipe: Pipeline, prompt_ids: list[int], *, max_tokens: int, sampling: Sampling,
                     resume_from: int = 0, stream_to=None, on_token=None, note_rate: bool = True) -> list[int]:
        decoder = StreamDecoder(self.tokenizer)
        waiting_first = [True]
        eos = self.tokenizer.eos_ids

        started = trio.current_time()
        stamps: list[float] = []

        def on_each(tok: int) -> None:
            stamps.append(time.perf_counter())
            if waiting_first[0]:
                waiting_first[0] = False
                log.info("first token after %.2fs (%d prompt tokens); decoding", trio.current_time() - started,
                         len(prompt_ids))
            if on_token is not None:
                on_token(tok)
            if stream_to is not None and tok not in eos:
                text = decoder.feed(tok)
                if text:
                    stream_to.write(text)
                    stream_to.flush()
        limit = min(max_tokens, self.cfg.max_context - len(prompt_ids))
        if limit <= 0:
            raise SessionError(f"the prompt has {len(prompt_ids)} tokens, the context holds {self.cfg.max_context}")
        from mesh.console import activity
        todo = len(prompt_ids) - min(resume_from, len(prompt_ids) - 1)
        with single_errors():
            # A prefill that takes over a second shows a bar (prompt tokens done), gone at the first token.
            async with activity(f"prefill of {todo} prompt tokens", total=todo, unit="tok", leave=False) as shown:
                def on_first(tok: int) -> None:
                    if waiting_first[0]:
                        shown.update(todo - shown.n)
                        shown.close()
                    on_each(tok)
                result = await generate(pipe, prompt_ids, max_tokens=limit, sampling=sampling, eos_ids=eos,
                                        resume_from=resume_from, on_token=on_first,
                                        on_prefill=lambda done: shown.update(done - shown.n))
        if stream_to is not None:
            stream_to.write(decoder.flush())
            stream_to.flush()
        if note_rate:       # else the caller logs it (after its own newline: a log line must not end the text's line)
            self.note_decode_rate(stamps)
        return result.tokens

    def note_decode_rate(self, stamps: list[float]) -> None:
        """Log the decode rate an answer just had (`stamps`: when each token came, one clock) next to the planner's
        prediction, and keep it in `placement` for the status view. The CLI's answers and the HTTP service's call it."""
        if len(stamps) < 3:
            return
        rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
        p = self.placement
        if p is not None:
            self.placement = replace(p, measured_decode_tok_s=rate)
            if self._fleet is not None and self._fleet.placement is p:   # the status view reads the fleet's
                self._fleet.placement = self.placement
        predicted = p.predicted_decode_tok_s if p is not None else None
        log.info("decode: %.2f tok/s measured over %d tokens%s", rate, len(stamps) - 1,
                 f", {predicted:.2f} predicted by the planner" if predicted else "")

    def encode(self, text: str, *, template: str, history: tuple = ()) -> list[int]:
        rendered = render_prompt(self.tokenizer, text, mode=template, history=history)
        return self.tokenizer.encode(rendered)
