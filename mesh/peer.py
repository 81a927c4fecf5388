"""mesh-peer: hold a layer range, serve it to the coordinator and to the predecessor peer, forward to the successor.

A peer dials out to the coordinator's registry and serves that one socket as its control connection, so it needs no
inbound port for control. It also listens for the predecessor's hop in peer-to-peer chain mode. Both kinds of link
run the same op loop (`_serve_ops`); the stage itself is one worker process shared by all links, serialized by a
lock that also covers the forward write, so the order of outputs down the chain is the order of compute.

What other lanes of a hop build on is public: `serve_hop_stream` (serve an already open stream as an inbound hop)
and `forward_over` (install an address or open stream as the successor hop); the WebRTC rung (mesh.rtc_lane) uses
only these and imports nothing from this module.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

import transport
from engine.arena import PayloadKind
from engine.errors import EngineError
from engine.gguf_meta import read_model_meta
from engine.kv_blocks import KV_BYTES, kv_type_for
from engine.local_stage import LocalStage, open_stage_host
from mesh import proto
from mesh.errors import HopError, MeshError, single_errors
from mesh.identity import model_identity, verify_file
from mesh.link import AuthFailed, LinkClosed, LinkError, PreAuthGate, RemoteError, open_link
from mesh.logsafe import clean
from mesh.report import DonorReport
from mesh.rtc_lane import open_rtc_lanes
from mesh.speed import SpeedCache, measure_stage

log = logging.getLogger("mesh.peer")
HANDSHAKE_SECONDS = 10.0
_RING_KIND = {"f16": PayloadKind.ACT_F16, "f32": PayloadKind.ACT_F32}     # wire dtype -> worker ring kind
_WIRE_DTYPE = {int(v): k for k, v in _RING_KIND.items()}


def _ring_fields(hidden) -> tuple | None:
    """(data, ring kind, dim) of a step's activations for the worker's record ((None, 0, 0) without any); None for
    a dtype the ring does not carry."""
    if hidden is None:
        return None, 0, 0
    kind = _RING_KIND.get(hidden.dtype)
    if kind is None:
        return None
    return hidden.data, kind, (hidden.shape[-1] if hidden.shape else 0)
_TOKENS = int(PayloadKind.TOKENS_I32)
TIMES_BATCH = 64                       # MESH_STAGE_TIMES lines a peer holds before it writes them


@dataclass(frozen=True)
class PeerConfig:
    join: str | None                   # the coordinator's registry; None: find one on the LAN (mesh.discovery)
    token: bytes | None = None
    name: str = ""                     # how the fleet names this peer (--name; the CLI defaults it to the hostname)
    show_text: bool = True             # the [donor] line shows the text being served (--no-show-text: it does not)
    listen: str = "0.0.0.0:0"
    advertise: str | None = None
    model: Path | None = None
    layers: tuple[int, int] | None = None
    memory_mb: int = 0
    cache_dir: Path | None = None
    device: str | None = None
    n_slots: int = 5                   # for a pinned range loaded at start; a session's Load says its own
    max_context: int = 2048
    warmup: int = 1                    # decode widths compiled at load (Worker.load); 0: each shape on first use
    report_every: float = 5.0
    rejoin_delay: float = 0.25         # the first retry after losing the coordinator; doubles up to the cap
    rejoin_max_delay: float = 5.0      # a restarted coordinator has its peers back within 5 s (issue 12, Faults)
    discover_for: float = 10.0         # one round of LAN discovery; then the failure is said and the peer retries
    discovery_port: int = 9000         # mesh.discovery.PORT
    retry_for: float | None = None     # give up after the coordinator was unreachable this long; None: never
    ice: object = None                 # signaling.IceConfig; None = no STUN/TURN (host candidates only)
    # Where the stage runs (engine.local_stage; MESH_STAGE_IN_PEER overrides): "auto" = in this process, as mesh-peer
    # runs it; "0" = a worker process, the default for a Peer embedded in a process that does other
    # things (tests, benches): an inline step stops that process's event loop, and its tinygrad would share the
    # process with the host's own
    stage_in_peer: str = "0"


class AuthRefused(MeshError):
    """The coordinator refused our fleet token: retrying cannot help."""


class PeerRefused(MeshError):
    """The coordinator refused this peer's Join (its name or address): retrying cannot help."""


class _Held:
    """A step computed in the Link reader (`Peer._run_step_now`) whose output the op loop must still send: the
    reply event (or what building or writing it raised) and the step's output."""
    __slots__ = ("reply", "out", "arrived", "decoded")

    def __init__(self, reply, out, arrived: float, decoded: float) -> None:
        self.reply, self.out, self.arrived, self.decoded = reply, out, arrived, decoded


@dataclass
class Forward:
    """The successor hop in peer-to-peer mode: the next peer, or the coordinator's sink when `sink` is set."""
    link: object
    sink: bool
    addr: str


class Peer:
    def __init__(self, cfg: PeerConfig):
        self.cfg = cfg
        self.meta = read_model_meta(cfg.model) if cfg.model else None
        # The fleet names a model by its content (mesh.identity): hashed once per file, then remembered.
        self.identity = model_identity(cfg.model, self._cache_root() / "identities") if cfg.model else ""
        self.worker = None
        self.loaded: tuple[int, int] | None = None
        self.loaded_fingerprint = ""
        self.loaded_total = 0
        self.loaded_kv = (0, 0)  # the loaded stage's KV pool: (blocks, positions a block), reported in Info
        self.loaded_shape: tuple[int, int] | None = None   # (n_slots, max_context) of the loaded stage
        self.backend = ""
        self.speeds = SpeedCache(self._cache_root())   # this device's measured figures, per model
        # One stage, many links: compute and forward in one critical section. A Semaphore, not a Lock: a step rung
        # by a Link's reader (`_take_step`) holds it until the op loop of that link has forwarded the output.
        self.compute = trio.Semaphore(1, max_value=1)
        self._waiting: set = set()          # links whose op loop waits in receive() with nothing queued
        self._posted: dict = {}             # link -> (its head BatchStep, engine.worker.PostedStep, perf_counter)
        # MESH_RING_FROM_READER=1: a step arriving on an idle stage is rung from the Link reader (`_take_step`).
        # Off by default: on 2 shared cores it lost to the op loop's ring in 2 of 4 A/B runs and won 2, by about as
        # much (NOTES "Hot path through a stage"); bench/mesh_bench.py --ab compares the two
        self.ring_from_reader = os.environ.get("MESH_RING_FROM_READER", "0") == "1"
        self.reader_rings = 0               # steps rung from a Link's reader so far
        # A stage in this process computes a step in the Link reader that read it (`_run_step_now`);
        # MESH_STEP_IN_READER=0 leaves every step to the op loop (for A/B runs: bench/mesh_bench.py --ab)
        self.step_in_reader = os.environ.get("MESH_STEP_IN_READER", "1") != "0"
        self.reader_steps = 0               # steps computed and forwarded from a Link's reader (stage in the peer)
        # A hop link of a stage in this process waits for its next step in a blocking poll while the peer has
        # nothing else to do (`Link.hot`): on for mesh-peer (a process of its own), off for a Peer embedded in a
        # process that does other things; MESH_HOT_WAIT=1/0 forces it either way (A/B: bench/mesh_bench.py --ab)
        hot = os.environ.get("MESH_HOT_WAIT", "auto")
        self.hot_wait = hot == "1" or (hot == "auto" and cfg.stage_in_peer == "auto")
        self.reader_held = 0                # steps computed there whose output the op loop had to send
        # A one-column decode step of the shape this link's last step had is computed from its frame's plaintext,
        # undecoded, and its reply's plaintext written directly (`_steady_step`, mesh/proto/steady.py);
        # MESH_STEADY=0 decodes every step (A/B: bench/mesh_bench.py --ab)
        self.steady_on = os.environ.get("MESH_STEADY", "1") != "0"
        self._steady: dict = {}             # link -> the SteadyStep of its last step computed in the reader
        self.steady_steps = 0               # steps computed that way
        self.forward: Forward | None = None
        self.vocab: tuple[bytes, ...] = ()
        self.report = DonorReport(show_text=cfg.show_text)
        self.listen_port = 0
        self.rtc = None                     # mesh.rtc_lane.RtcLanes: the WebRTC rung, for the peer's lifetime
        self.inbound: set[trio.CancelScope] | None = None   # the current session's inbound hops; None between
        self.gate = PreAuthGate()           # inbound hops still authenticating
        self.stage_times = None             # a file that gets one line of phase times per step (MESH_STAGE_TIMES)
        self._times: list[tuple] = []       # its lines not written yet

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def run(self) -> None:
        host, _, port = self.cfg.listen.rpartition(":")
        async with open_stage_host(device=self.cfg.device, default=self.cfg.stage_in_peer) as worker, open_rtc_lanes(self, self.cfg.ice) as rtc:
            self.worker = worker
            self.rtc = rtc
            self.backend = f"{worker.ready.device}" if worker.ready else ""
            if os.environ.get("MESH_STAGE_TIMES"):   # a directory: bench/mesh_bench.py's per-stage breakdown
                self.stage_times = open(Path(os.environ["MESH_STAGE_TIMES"]) / f"peer-{os.getpid()}.txt", "a")
            if self.cfg.layers:
                await self._load(self.cfg.model, *self.cfg.layers, identity=self.identity)
                self.loaded_fingerprint = self.identity
            async with trio.open_nursery() as nursery:
                self.listen_port = await nursery.start(transport.serve_listener, host or "0.0.0.0", int(port or 0),
                                                       self.serve_hop_stream)
                log.info("listening for peer hops on port %d", self.listen_port)
                nursery.start_soon(self._report_loop)
                await self._join_loop()
                nursery.cancel_scope.cancel()

    async def _join_loop(self) -> None:
        delay = self.cfg.rejoin_delay
        unreachable_since: float | None = None      # when the coordinator was last reachable, if it is not now
        while True:
            why = ""
            target = self.cfg.join
            if target is None:                      # no --join: ask the LAN for a coordinator of our fleet
                target, why = await self._discover()
            if target is not None:
                try:
                    with trio.fail_after(HANDSHAKE_SECONDS):
                        stream = await transport.dial(target)
                except trio.TooSlowError:
                    why = "no answer to our dial"
                except transport.DialError as exc:
                    why = exc.reason
                else:
                    unreachable_since = None
                    try:
                        await self._session(stream, target)
                        delay = self.cfg.rejoin_delay
                        continue
                    except AuthRefused as exc:
                        raise AuthRefused(f"coordinator {target} refused us: {exc}") from None
                    except (LinkError, transport.TransportError, HopError) as exc:
                        log.warning("session with coordinator %s ended: %s", target, exc)
            if why:
                now = trio.current_time()
                unreachable_since = now if unreachable_since is None else unreachable_since
                what = f"coordinator {target}" if target else "a coordinator of this fleet"
                if self.cfg.retry_for is not None and now - unreachable_since + delay > self.cfg.retry_for:
                    raise MeshError(f"{what} unreachable for {now - unreachable_since:.0f}s "
                                    f"(--retry-for {self.cfg.retry_for:g}): {why}")
                log.warning("%s unreachable for %s: %s; next try in %.3gs", what, _waited(now - unreachable_since),
                            why, delay)
            await trio.sleep(delay)
            delay = backoff(delay, self.cfg.rejoin_max_delay)

    async def _discover(self) -> tuple[str | None, str]:
        """(the registry address of a coordinator of our fleet on the LAN, "") or (None, why none was found)."""
        from mesh.discovery import DiscoveryError, find_coordinator
        try:
            found = await find_coordinator(self.cfg.token, within=self.cfg.discover_for,
                                           port=self.cfg.discovery_port)
        except DiscoveryError as exc:
            return None, str(exc)
        log.info("found coordinator %s at %s on the local network", clean(found.name, 64) or "(unnamed)", found.addr)
        return found.addr, ""

    async def _session(self, stream, target: str) -> None:
        try:
            with trio.fail_after(HANDSHAKE_SECONDS) as handshake:
                async with open_link(stream, token=self.cfg.token, role="client") as link:
                    handshake.deadline = math.inf       # the deadline bounds the handshake only
                    await link.send(proto.Join(self.listen_port, self.cfg.advertise or "", self.cfg.memory_mb,
                                               *(self.cfg.layers or (-1, -1)), self.cfg.name))
                    log.info("joined coordinator %s as %s", target, self.cfg.name or "an unnamed peer")
                    self.inbound = set()
                    try:
                        with single_errors():
                            async with trio.open_nursery() as session:  # hops and lanes live as long as the session
                                await self._serve_ops(link, session, control=True)
                                session.cancel_scope.cancel()
                    finally:
                        self._write_times()
                        self.forward = None
                        # A predecessor of the ended session may still be computing; its steps must not reach
                        # whatever stage this peer becomes in the next session.
                        for scope in self.inbound:
                            scope.cancel()
                        self.inbound = None
        except trio.TooSlowError:
            raise HopError(f"coordinator {target}: no handshake within {HANDSHAKE_SECONDS:.0f}s") from None
        except (AuthFailed, proto.AuthError) as exc:
            raise AuthRefused(str(exc)) from None

    async def serve_hop_stream(self, stream) -> None:
        """Serve an open stream as an inbound hop: a predecessor's (dialed in, or a WebRTC data channel) or a
        coordinator's hub connection. Authenticate, then serve ops until the hop or the session in which it was
        accepted ends. Between sessions nobody may dial in."""
        peer = transport.remote_host(stream)
        session = self.inbound
        if session is None:
            log.warning("inbound hop from %s refused: this peer is in no session", peer)
            await stream.aclose()
            return
        with trio.CancelScope() as scope:
            session.add(scope)
            try:
                await self._serve_hop(stream, peer)
            finally:
                session.discard(scope)

    async def _serve_hop(self, stream, peer: str) -> None:
        try:
            with trio.fail_after(HANDSHAKE_SECONDS) as handshake:
                async with open_link(stream, token=self.cfg.token, role="server", gate=self.gate) as link:
                    handshake.deadline = math.inf
                    with single_errors():
                        async with trio.open_nursery() as lane:
                            await self._serve_ops(link, lane, control=False)
                            lane.cancel_scope.cancel()
        except trio.TooSlowError:
            log.warning("inbound hop from %s: no handshake within %.0fs", peer, HANDSHAKE_SECONDS)
        except (LinkError, proto.ProtoError, transport.TransportError, HopError) as exc:
            log.warning("inbound hop from %s ended: %s", peer, exc)

    # ---- the op loop ---------------------------------------------------------------------------------------
    async def _serve_ops(self, link, nursery, *, control: bool) -> None:
        local = isinstance(self.worker, LocalStage) and self.step_in_reader
        link.take = functools.partial(self._run_step_now if local else self._take_step, link) \
            if local or self.ring_from_reader else None
        link.hot = local and self.hot_wait
        if local and self.steady_on:
            link.fast, link.fast_type = functools.partial(self._steady_step, link), proto.MsgType.BATCH_STEP
        try:
            await self._op_loop(link, nursery, control)
        finally:
            link.fast = None
            self._steady.pop(link, None)
            if link.hot:
                log.info("%s link: %d steps computed in its reader, %d reads by the hot wait",
                         "control" if control else "hop", self.reader_steps, link.hot_reads)
            link.take = None
            self._waiting.discard(link)
            posted = self._posted.pop(link, None)
            if posted is not None:          # rung, then the link or the session ended before the op loop took it
                if not isinstance(posted[1], _Held):
                    self.worker.abandon(posted[1])
                self.compute.release()

    def _take_step(self, link, ev) -> bool:
        """The Link reader's hook (`Link.take`): a decode or prefill step arriving while this link's op loop waits,
        the stage is idle and nothing is queued before it, is rung into the worker at once, from the reader task
        (the doorbell goes out one scheduler pass sooner than from the op loop); the event stays queued and the op
        loop waits for its reply and forwards as usual. Anything else, or anything that would have to wait, is left
        to the op loop. Never raises."""
        if type(ev) is not proto.BatchStep or link not in self._waiting or self.loaded is None or link in self._posted:
            return False
        ring = _ring_fields(ev.hidden)
        if ring is None:
            return False
        data, kind, dim = ring
        t0 = time.perf_counter()
        try:
            self.compute.acquire_nowait()
        except trio.WouldBlock:
            return False
        try:
            posted = self.worker.post_step_nowait(ev.columns, data, kind, dim, ev.sampling)
        except Exception:   # the worker is busy, or refuses the step: the op loop's ordinary path runs and reports
            self.compute.release()
            return False
        self._posted[link] = (ev, posted, t0)
        self.reader_rings += 1
        return False

    def _run_step_now(self, link, ev) -> bool:
        """The Link reader's hook (`Link.take`) for a stage run in this process: a step arriving while this link's
        op loop waits, the stage is idle and nothing is queued before it is computed right here, in the reader task,
        and its output written to the successor (`Link.send_nowait`) before the reader goes back to its socket:
        no pass of trio's scheduler, no other task woken, between the bytes read and the bytes written. True: done
        (the event is consumed). False: left to the op loop; when the step was computed but the write had to wait
        (another write in progress, no credit, not a TCP stream), the op loop sends the output held for it."""
        if type(ev) is not proto.BatchStep or link not in self._waiting or self.loaded is None or link in self._posted:
            return False
        ring = _ring_fields(ev.hidden)
        if ring is None or not self.worker.runs_inline(ev.columns, ev.sampling):
            return False
        try:
            self.compute.acquire_nowait()
        except trio.WouldBlock:
            return False
        t0 = time.perf_counter()
        try:
            out = self.worker.step_now(ev.columns, *ring, ev.sampling)
        except Exception:   # refused (the op loop runs it again and reports), or busy
            self.compute.release()
            return False
        t1 = time.perf_counter()
        try:
            reply, out_link = self._reply(ev, out, link)
            sent = out_link.send_nowait(reply)
        except Exception as exc:        # a hook must not raise: the op loop raises it, as its own send would have
            sent, reply = False, exc
        if not sent:
            self._posted[link] = (ev, _Held(reply, out, link.arrived, link.decoded), t0, t1)
            self.reader_held += 1
            return False
        self.compute.release()
        self.reader_steps += 1
        self._done(ev.columns, out, out_link, t0, t1, link.arrived, link.decoded)
        if self.steady_on and len(ev.columns) == 1 and link.fast is not None:
            known = self._steady.get(link)
            if known is None or not known.fits(ev):
                self._steady[link] = proto.SteadyStep(ev)     # the next step of this sequence takes `_steady_step`
        return True

    def _steady_step(self, link, plain: memoryview) -> bool:
        """The Link reader's `fast` hook: a BatchStep's plaintext, before it is decoded. When it is the next step
        of the sequence this link's last step belonged to (`SteadyStep.match`: the same in every byte but the
        group, position, token and rows) and it would run in the reader now (as `_run_step_now`, and its reply
        can be written at once), it is computed here and its reply written from plaintext built directly: no
        event decoded, built or encoded on the way (~0.2 ms of cold Python a stage a token on 2 cores). True:
        done. False: nothing was done (the frame is decoded and goes the usual way). Never raises."""
        steady = self._steady.get(link)
        if steady is None or self.forward is None or link not in self._waiting or self.loaded is None \
                or link in self._posted:     # (a hub's stage answers Hidden: the usual way)
            return False
        raw = plain.obj
        found = steady.match(raw)   # type: ignore[arg-type]
        if found is None:
            return False
        out_link = self.forward.link
        if not out_link.can_send_nowait():
            return False
        try:
            self.compute.acquire_nowait()
        except trio.WouldBlock:
            return False
        group, pos, token = found
        slot, needs_logits = steady.column_fields[1:]
        cols = (proto.Column(pos, slot, needs_logits, token),)
        act = steady.act
        t0 = time.perf_counter()
        try:
            if act is None:
                out = self.worker.step_now(cols, None, 0, 0, steady.sampling)
            else:
                out = self.worker.step_now(cols, raw[steady.rows_at:steady.rows_end], _RING_KIND[act[0]],
                                           act[1][-1], steady.sampling)
            t1 = time.perf_counter()
            if out.kind == _TOKENS:
                reply = proto.tokens_reply(proto.MsgType.DONE, group, struct.unpack(f"<{out.rows}i", out.data))
            else:
                reply = steady.forward(raw, proto.activation_head(_WIRE_DTYPE[out.kind], (out.rows, out.cols)),
                                       out.data)
        except Exception:   # refused, busy, or a reply it cannot write: the usual way runs it again and reports
            self.compute.release()
            return False
        try:
            out_link.send_plain_nowait(reply)
        except Exception:   # the successor's connection failed after the frame was sealed: the op loop reports it
            self.compute.release()
            return False
        self.compute.release()
        self.reader_steps += 1
        self.steady_steps += 1
        self._done(cols, out, out_link, t0, t1, link.arrived, link.decoded)
        return True

    def _reply(self, ev, out, link):
        """The event a step's output goes on as, and the link it goes on."""
        if out.kind == _TOKENS:
            tokens = struct.unpack(f"<{out.rows}i", out.data)
            reply = proto.Done(ev.group, tokens) if self.forward else proto.Tokens(ev.group, tokens)
        else:
            act = proto.Activation(_WIRE_DTYPE[out.kind], (out.rows, out.cols), out.data)
            reply = proto.BatchStep(ev.group, ev.wide, ev.columns, act, ev.sampling) if self.forward \
                else proto.Hidden(ev.group, act)
        return reply, (self.forward.link if self.forward else link)

    def _done(self, cols, out, out_link, t0: float, t1: float, arrived: float, decoded: float) -> None:
        t2 = time.perf_counter()
        self.report.record(cols, t2 - t0, self.vocab)
        if self.stage_times is not None:
            # receive (op loop to the worker's post), to the worker (ring + wake-up), compute (Stage.step), back
            # from the worker (ring + wake-up), send (frame, seal, write): what bench/mesh_bench.py prints per stage;
            # then the clock (ms) when the frame's bytes were read, when this step began (rung by the reader or
            # taken by the op loop), when the forward's write began, when the frame was decoded, when the output
            # was held
            # Kept as numbers and written TIMES_BATCH lines at a time (and by the report loop, and when the session
            # ends): a line formatted and flushed per step cost ~0.1 ms of cold Python right after the forward's
            # write, when the successor wants a CPU, in exactly the runs that measure the hop
            self._times.append((self.loaded[0], self.loaded[1], len(cols),
                                (t1 - t0) * 1e3 - (out.received_ms - out.sent_ms),
                                out.done_ms - out.compute_ms - out.sent_ms, out.compute_ms,
                                out.received_ms - out.done_ms, (t2 - t1) * 1e3, arrived * 1e3, t0 * 1e3,
                                out_link.wrote * 1e3, decoded * 1e3, t1 * 1e3))
            if len(self._times) >= TIMES_BATCH:
                self._write_times()

    def _write_times(self) -> None:
        if self.stage_times is not None and self._times:
            self.stage_times.write("".join("%d %d %d " % t[:3] + " ".join("%.4f" % x for x in t[3:]) + "\n"
                                           for t in self._times))
            self.stage_times.flush()
        self._times.clear()

    async def _op_loop(self, link, nursery, control: bool) -> None:
        while True:
            try:
                self._waiting.add(link)
                try:
                    ev = await link.receive()
                finally:
                    self._waiting.discard(link)
            except LinkClosed:
                return
            except RemoteError as exc:
                if control and exc.code == proto.ErrorCode.BAD_REQUEST:
                    # The registry refused our Join (a name or an address it cannot use): retrying cannot help.
                    raise PeerRefused(f"the coordinator refused this peer: {clean(exc.reason)}") from None
                # A predecessor failed a step. In chain mode nobody upstream reads errors, so pass it on toward
                # the sink, where the coordinator is waiting for this step's tokens.
                await self._fail_forward(link, f"{exc.reason}", exc.code)
                continue
            if isinstance(ev, proto.Shutdown):
                return
            if isinstance(ev, proto.LeftOut) and control:
                log.warning("left out of this session by the coordinator: %s (%s); waiting in its pool for the "
                            "next one", clean(ev.reason), ev.code.name.lower().replace("_", " "))
                return
            try:
                await self._dispatch(ev, link, nursery, control)
            except (LinkError, HopError):
                raise
            except Exception as exc:  # one bad op answers with an error; the link and the peer go on
                log.exception("op %s failed", type(ev).__name__)
                await self._fail_forward(link, f"{self._where()}: {type(ev).__name__} failed: {exc}"[:500])

    async def _fail_forward(self, link, reason: str, code=proto.ErrorCode.INTERNAL) -> None:
        """Report a failure where it will be read: down the chain when forwarding, else back on `link`."""
        await (self.forward.link if self.forward else link).send(proto.Error(code, reason))

    def _where(self) -> str:
        return f"layers {self.loaded[0]}..{self.loaded[1]}" if self.loaded else "peer"

    async def _dispatch(self, ev, link, nursery, control: bool) -> None:
        if isinstance(ev, proto.InfoRequest):
            await link.send(self._info(ev))
        elif isinstance(ev, proto.Load):
            code, reason = await self._handle_load(ev)
            await link.send(proto.Ack(proto.MsgType.LOAD, int(code), reason))
        elif isinstance(ev, proto.Chain):
            await self._handle_chain(ev, link, nursery)
        elif isinstance(ev, proto.StatsRequest):
            r = self.report
            await link.send(proto.Stats(r.steps, r.columns, int(r.busy_s * 1e6)))
        elif isinstance(ev, proto.Vocab):
            self.vocab = ev.tokens
        elif isinstance(ev, (proto.BatchStep, proto.Step)):
            await self._handle_step(ev, link)
        elif isinstance(ev, (proto.ZeroSlot, proto.Reset, proto.Rollback, proto.BlockTable)):
            await self._handle_inband(ev)
        elif isinstance(ev, proto.BatchInit):
            await link.send(proto.Ack(proto.MsgType.BATCH_INIT, 0, ""))
        elif isinstance(ev, proto.ShipBegin):
            await self._handle_ship(ev, link)
        elif isinstance(ev, (proto.Signal, proto.RtcServe, proto.RtcChain)):
            await self._handle_rtc(ev, link, nursery)
        elif isinstance(ev, (proto.Draft, proto.DraftBatch, proto.DraftSeed)):
            await link.send(proto.Error(proto.ErrorCode.BAD_REQUEST,
                                        "speculative drafting needs a draft head; this model has none"))
        else:
            await link.send(proto.Error(proto.ErrorCode.UNEXPECTED, f"{type(ev).__name__} is not a request"))

    def _info(self, req: proto.InfoRequest | None = None) -> proto.Info:
        start, end = self.loaded or (0, 0)
        fp = self.loaded_fingerprint or self.identity
        total = self.loaded_total or (self.meta.n_layers if self.meta else 0)
        kv = self.loaded_kv if self.loaded is not None else (0, 0)
        # Figures only from a peer that measures (it warms up at load): one started with --warmup 0 stays out of
        # placement by speed, whatever an earlier run left in the cache, so such a fleet is split by memory
        speed = self.speeds.get(req.fingerprint, self.backend) \
            if req is not None and req.fingerprint and self.cfg.warmup > 0 else None
        return proto.Info(start, end, total, self.cfg.memory_mb, self.cfg.layers is not None, fp,
                          self.backend, self.loaded is not None, *kv,
                          *((speed.decode_ms_per_layer, speed.prefill_ms_per_layer, speed.step_ms) if speed else
                            (0.0, 0.0, 0.0)),
                          self.cfg.warmup > 0, bytes(len(req.pad)) if req is not None else b"", self._kv_bytes())

    def _kv_bytes(self) -> int:
        """The bytes of one KV value this peer's stage keeps (the rule Stage.load follows on this device), 0 where the
        device is not known yet or $MESH_KV_DTYPE is wrong (the load will say so): the planner then prices f32."""
        if not self.backend:
            return 0
        try:
            return KV_BYTES[kv_type_for(self.backend)]
        except EngineError:
            return 0

    # ---- loading and shipping --------------------------------------------------------------------------------
    async def _load(self, path: Path, start: int, end: int, n_slots: int | None = None,
                    max_context: int | None = None, warmup: int = 0, *, identity: str = "") -> None:
        """Load a range; the session's slots, context and decode widths (Load) over the peer's own flags."""
        from mesh.console import activity
        n_slots, max_context = n_slots or self.cfg.n_slots, max_context or self.cfg.max_context
        warmup = min(warmup or self.cfg.warmup, n_slots)
        what = f"loading layers {start}..{end} of {path.name}" + (", compiling step shapes" if warmup else "")
        async with activity(what):          # the worker reports nothing until both are done
            info = await self.worker.load(path, start, end, n_slots=n_slots, max_context=max_context, warmup=warmup)
        self.loaded = (start, end)
        self.loaded_shape = (n_slots, max_context)
        self.loaded_fingerprint = info.fingerprint
        self.loaded_total = info.total
        self.loaded_kv = (info.kv_blocks, info.kv_block_size)
        self.report.layers = (start, end)
        log.info("loaded layers %d..%d of %s (%.1f MB of weights) in %.1f s, compiled %d step shapes in %.1f s",
                 start, end, path.name, info.weight_bytes / 1e6, info.load_ms / 1e3, info.warmup_shapes,
                 info.warmup_ms / 1e3)
        # Measure this device once per model, on compiled shapes only (a load without warmup would time tinygrad's
        # compiler); the planner reads the figure from the cache in every later session.
        if self.cfg.warmup > 0 and identity and self.speeds.get(identity, self.backend) is None:
            try:
                speed = await measure_stage(self.worker, start=start, end=end, dim=info.dim,
                                            act_dtype=info.act_dtype)
                self.speeds.put(identity, self.backend, speed, (start, end))
            except (EngineError, OSError) as exc:   # the fleet plans by memory without it; the stage still serves
                log.warning("could not measure layers %d..%d: %s", start, end, exc)
                return
            log.info("measured layers %d..%d on %s: decode %.2f ms/layer, prefill %.2f ms/layer (16-column chunk), "
                     "%.2f ms a step", start, end, self.backend, speed.decode_ms_per_layer, speed.prefill_ms_per_layer,
                     speed.step_ms)

    async def _handle_load(self, ev: proto.Load) -> tuple[int, str]:
        LC = proto.LoadCode
        shape = (ev.n_slots or self.cfg.n_slots, ev.max_context or self.cfg.max_context)
        if self.loaded == (ev.start, ev.end) and self.loaded_fingerprint == ev.fingerprint \
                and self.loaded_shape == shape:
            return LC.OK, "already loaded"               # an unchanged fleet re-forms without re-reading weights
        if self.cfg.layers and (ev.start, ev.end) != self.cfg.layers:
            return LC.FAIL, f"pinned to layers {self.cfg.layers[0]}..{self.cfg.layers[1]}"
        if self.meta is not None:
            if self.identity != ev.fingerprint:
                return LC.WRONG_CHECKPOINT, (f"local model {self.cfg.model} is {self.identity[:16]}, "
                                             f"the fleet's is {clean(ev.fingerprint[:16])}")
            path = self.cfg.model
        else:
            path = self._cache_entry(ev.fingerprint, ev.start, ev.end)
            if path is None:
                return LC.NEED_WEIGHTS, "no local model; ship layers"
            if not ev.sha256:
                return LC.NEED_WEIGHTS, "no digest came with the Load to check the cached layers by; ship them"
            # Checked byte for byte on every load: a flipped bit changes neither size nor mtime.
            if not await trio.to_thread.run_sync(verify_file, path, ev.sha256):
                log.warning("cached layers %d..%d (%s) do not match the coordinator's digest: corrupt or altered; "
                            "removed, to be shipped again", ev.start, ev.end, path)
                path.unlink(missing_ok=True)
                return LC.NEED_WEIGHTS, f"cached layers {ev.start}..{ev.end} failed their digest check; ship them"
        async with self.compute:
            try:
                await self._load(path, ev.start, ev.end, *shape, ev.warmup, identity=ev.fingerprint)
            except Exception as exc:
                log.error("load of layers %d..%d failed: %s", ev.start, ev.end, exc)
                return LC.FAIL, str(exc)[:500]
        if self.meta is not None:
            self.loaded_fingerprint = self.identity     # the worker reports the header's fingerprint
        return LC.OK, ""

    def _cache_root(self) -> Path:
        from mesh.shipping import default_cache_dir
        return self.cfg.cache_dir or default_cache_dir()

    def _cache_entry(self, fingerprint: str, start: int, end: int) -> Path | None:
        from mesh.shipping import complete_entry
        return complete_entry(self._cache_root(), fingerprint, start, end)

    async def _handle_ship(self, ev, link) -> None:
        from mesh.shipping import serve_ship
        await serve_ship(link, ev, self._cache_root())

    # ---- the chain -----------------------------------------------------------------------------------------
    async def _handle_chain(self, ev: proto.Chain, link, nursery) -> None:
        if not ev.addr:
            self.forward = None
            await link.send(proto.Ack(proto.MsgType.CHAIN, 0, "cleared"))
            return
        addr = ev.addr
        if addr.startswith(":"):  # the sink shorthand: the coordinator's host as seen on our control connection
            addr = f"{_host_for_dial(transport.remote_host(link.stream))}{addr}"
        try:
            await self.forward_over(addr, sink=ev.sink, label=addr, nursery=nursery)
        except (transport.TransportError, LinkError, proto.ProtoError, trio.TooSlowError) as exc:
            self.forward = None
            await link.send(proto.Ack(proto.MsgType.CHAIN, 1, f"dial {addr} failed: {exc}"))
            return
        await link.send(proto.Ack(proto.MsgType.CHAIN, 0, addr))

    async def forward_over(self, connect, *, sink: bool, label: str, nursery) -> None:
        """Open the successor hop over `connect` (an address to dial, or an open stream such as a WebRTC data
        channel) as a task of `nursery` (the session's: the hop closes when the session ends), authenticate it and
        make it this peer's forward. Raises what dialing or the handshake raised; the forward is then unchanged."""
        hop = await nursery.start(self._hop, connect)
        self.forward = Forward(hop, sink, label)
        log.info("forwarding to %s %s", "sink" if sink else "peer", label)

    async def _hop(self, connect, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Own one outbound hop for the rest of the session: connect, authenticate, hand the link over, keep it open.

        `connect` is an address to dial or an already open stream (a WebRTC data channel)."""
        with trio.fail_after(HANDSHAKE_SECONDS) as handshake:   # a silently dropped address must not hang set-up
            stream = await transport.dial(connect) if isinstance(connect, str) else connect
            async with open_link(stream, token=self.cfg.token, role="client") as hop:
                handshake.deadline = math.inf
                task_status.started(hop)
                await trio.sleep_forever()

    async def _handle_step(self, ev, link) -> None:
        """One step: its activations go from the decoded frame's bytes into the worker's step record, the output
        from the StepDone record's bytes into the forwarded frame; no numpy on the way, and the forward is sent by
        this task as soon as the worker's doorbell wakes it (no hand-over to another task)."""
        if self.loaded is None:
            await link.send(proto.Error(proto.ErrorCode.UNEXPECTED, "no layers loaded yet"))
            return
        t0 = time.perf_counter()
        arrived, decoded = link.arrived, link.decoded
        posted = self._posted.pop(link, None)
        if posted is not None and posted[0] is not ev:  # cannot happen (the op loop takes events in order): give up
            if not isinstance(posted[1], _Held):
                self.worker.abandon(posted[1])
            self.compute.release()
            posted = None
        if posted is not None and isinstance(posted[1], _Held):  # computed by the reader, the write left to us
            held, t0, t1 = posted[1], posted[2], posted[3]
            out, reply = held.out, held.reply
            out_link = self.forward.link if self.forward else link
            try:
                if isinstance(reply, Exception):
                    raise reply
                await out_link.send(reply)
            finally:
                self.compute.release()
            self._done(ev.columns, out, out_link, t0, t1, held.arrived, held.decoded)
            return
        if posted is not None:      # rung by the Link's reader (`_take_step`): the compute permit is held already
            posted, t0 = posted[1], posted[2]
        else:
            if isinstance(ev, proto.Step):
                cols = [proto.Column(ev.pos + i, ev.slot, i == len(ev.tokens) - 1, t) for i, t in enumerate(ev.tokens)]
                ev = proto.BatchStep(ev.group, False, tuple(cols), ev.hidden, ev.sampling)
            ring = _ring_fields(ev.hidden)
            if ring is None:
                raise ValueError(f"activations of dtype {ev.hidden.dtype} cannot go to a worker (f16 or f32 only)")
            data, kind, dim = ring
            # Uncontended (every decode step) the lock is taken without a pass through trio's scheduler; the
            # worker's wait for its reply is the checkpoint.
            try:
                self.compute.acquire_nowait()
            except trio.WouldBlock:
                await self.compute.acquire()
        try:
            if posted is not None:
                out = await self.worker.step_posted(posted)
            else:
                out = await self.worker.step_raw(ev.columns, data, kind, dim, ev.sampling)
            t1 = time.perf_counter()
            reply, out_link = self._reply(ev, out, link)
            await out_link.send(reply)
        finally:
            self.compute.release()
        self._done(ev.columns, out, out_link, t0, t1, arrived, decoded)

    async def _handle_inband(self, ev) -> None:
        if self.worker is not None and self.loaded is not None:
            async with self.compute:
                if isinstance(ev, proto.ZeroSlot):
                    await self.worker.zero_slot(ev.slot)
                elif isinstance(ev, proto.Reset):
                    await self.worker.reset()
                elif isinstance(ev, proto.Rollback):
                    await self.worker.rollback(ev.slot, ev.pos)
                elif isinstance(ev, proto.BlockTable):  # row = the slot; applied before any later step
                    await self.worker.block_table(ev.row, ev.blocks)
                if self.forward and not self.forward.sink:
                    await self.forward.link.send(ev)
        elif self.forward and not self.forward.sink:
            await self.forward.link.send(ev)

    # ---- WebRTC --------------------------------------------------------------------------------------------
    async def _handle_rtc(self, ev, link, nursery) -> None:
        await self.rtc.handle(ev, link, nursery)

    # ---- the donor's self-report ---------------------------------------------------------------------------
    async def _report_loop(self) -> None:
        while True:
            await trio.sleep(self.cfg.report_every)
            self._write_times()
            line = self.report.line()
            if line:
                print(line, file=sys.stderr, flush=True)


def backoff(delay: float, cap: float) -> float:
    """The next wait after `delay`: doubled, capped, with up to 10% taken off at random so that peers that lost
    one coordinator together do not all dial it again in the same instant."""
    import random
    return min(delay * 2, cap) * (1 - 0.1 * random.random())


def _waited(seconds: float) -> str:
    s = int(seconds)
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s // 60 % 60:02d}m"


def _host_for_dial(host: str | None) -> str:
    if not host:
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def memory_hint_mb(memory_gb: float | None, device: str | None = None) -> int:
    """The memory this peer offers the planner: --memory-gb, else the platform's default budget for the device it
    will run (engine.platform: available RAM, capped on Apple Silicon by what a METAL GPU may wire); 0 = unknown."""
    if memory_gb:
        return int(memory_gb * 1024)
    from engine import platform
    plat = platform.current()
    device = device or os.environ.get("DEV") or platform.default_device(plat, ask=lambda: "")
    return platform.memory_budget_mb(plat, platform.read_memory(), device)
