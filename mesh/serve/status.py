"""The mesh's status as one JSON-able dict: what `GET /v1/mesh`, the page's panel and `mesh-coord status` show.

Pure functions from what the coordinator already holds (the fleet's members and their `Info`, the transport each
hop came up on, the scheduler's stats, the stages' own step counters) to plain dicts and text, so every rule here
is tested without HTTP, peers or a clock. Gathering those inputs from a live service is `snapshot`'s job (the one
async function here; `routes` serves it as GET /v1/mesh); drawing them is the page's (static/app.js) and
`format_status`'s (`mesh-coord status`).

Shape (every key always present; unknown figures are null):
    {"object": "mesh.status", "model": str, "state": the service's ("forming"|"serving"|"re-forming"|"stopped"), "detail": str,
     "chain": "p2p"|"hub"|null, "pool": int,
     "stages": [{"name", "host", "device", "layers": [start, end], "memory_mb", "kv_blocks", "kv_block_size", "local",
                 "ms_per_step", "tok_per_s", "busy", "steps"}],
     "hops": [{"from", "to", "transport": "tcp"|"ws"|"webrtc"|null}],
     "scheduler": {"active", "queued", "max_seqs", "steps", "tokens_out", "prompt_tokens", "in_flight",
                   "micro_batches", "ms_per_step"} | null,
     "predicted_tok_per_s": float | null,
     "placement": {"policy", "predicted_decode_tok_per_s", "predicted_prefill_tok_per_s",
                   "measured_decode_tok_per_s", "left_out": [str], "note"} | null}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

TRANSPORTS = ("tcp", "ws", "webrtc")


@dataclass(frozen=True, slots=True)
class StageCounters:
    """One stage's cumulative work at one moment: what a stage reports (mesh/report.py DonorReport's totals)."""
    at: float           # monotonic seconds when read
    steps: int
    columns: int
    busy_s: float       # seconds spent computing those steps


@dataclass(frozen=True, slots=True)
class StageFigures:
    ms_per_step: float | None
    tok_per_s: float | None
    busy: float | None          # fraction of wall time computing, 0..1 (the pipeline's bubble is 1 - busy)
    steps: int | None


def stage_figures(prev: StageCounters | None, cur: StageCounters | None) -> StageFigures | None:
    """Rates over the interval between two readings of one stage; with no earlier reading, or no step in between,
    ms per step over the stage's whole life and no rate (an idle stage shows its last speed and 0 tok/s)."""
    if cur is None:
        return None
    life_ms = 1000.0 * cur.busy_s / cur.steps if cur.steps else None
    if prev is None or cur.at <= prev.at or cur.steps < prev.steps:   # first reading, or the stage was reset
        return StageFigures(life_ms, None, None, cur.steps)
    span, steps = cur.at - prev.at, cur.steps - prev.steps
    if steps == 0:
        return StageFigures(life_ms, 0.0, 0.0, cur.steps)
    busy = max(0.0, cur.busy_s - prev.busy_s)
    return StageFigures(1000.0 * busy / steps, (cur.columns - prev.columns) / span, min(1.0, busy / span), cur.steps)


def transport_of_addr(addr: str) -> str:
    """The transport a direct dial of `addr` uses (transport.parse_addr's schemes): ws:// and wss:// are WebSocket."""
    return "ws" if addr.lower().startswith(("ws://", "wss://")) else "tcp"


def transport_of_stream(stream: Any) -> str | None:
    """tcp or ws for a stream of ours, unwrapping wrappers (`transport_stream`); None when neither is under it."""
    from transport.websocket import WebSocketStream
    import trio
    for _ in range(16):
        if isinstance(stream, WebSocketStream):
            return "ws"
        if isinstance(stream, trio.SocketStream):
            return "tcp"
        stream = getattr(stream, "transport_stream", None)
        if stream is None:
            return None
    return None


def _num(x: float | None, digits: int) -> float | None:
    return None if x is None else round(float(x), digits)


def build_status(*, model: str, state: str, detail: str = "", chain: str | None = None, pool: int = 0,
                 stages: Sequence[Mapping[str, Any]] = (), hops: Sequence[Mapping[str, Any]] = (),
                 figures: Sequence[StageFigures | None] = (), scheduler: Any = None, placement: Any = None) -> dict:
    """The status dict. `stages` are in chain order, each {"name", "host", "device", "layers", "memory_mb",
    "local"}; `figures[k]` belongs to `stages[k]` (a shorter sequence: unknown); `scheduler` is
    the scheduler's stats (mesh/scheduler.py SchedulerStats) or None before one runs; `placement` what the planner
    decided (mesh/planner.py Placement: policy, predicted decode and prefill tok/s, peers left out) or None."""
    out_stages = []
    # Where the stages did not report (hub mode), the scheduler's per-stage times stand in: it times each stage's
    # reply there (SchedulerStats.stage_ms, one per remote stage in chain order).
    stage_ms = list(getattr(scheduler, "stage_ms", None) or ()) if not isinstance(scheduler, Mapping) else []
    remote = [k for k, s in enumerate(stages) if not s.get("local")]
    for k, s in enumerate(stages):
        f = figures[k] if k < len(figures) else None
        r = remote.index(k) if k in remote else -1
        if f is None and 0 <= r < len(stage_ms) and stage_ms[r] is not None:
            f = StageFigures(stage_ms[r], None, None, None)
        layers = s.get("layers")
        out_stages.append({
            "name": str(s.get("name", f"stage {k + 1}")), "host": s.get("host") or None,
            "device": s.get("device") or None, "layers": list(layers) if layers else None,
            "memory_mb": int(s["memory_mb"]) if s.get("memory_mb") else None,
            "kv_blocks": int(s["kv_blocks"]) if s.get("kv_blocks") else None,
            "kv_block_size": int(s["kv_block_size"]) if s.get("kv_block_size") else None,
            "local": bool(s.get("local")),
            "ms_per_step": _num(f.ms_per_step if f else None, 2), "tok_per_s": _num(f.tok_per_s if f else None, 1),
            "busy": _num(f.busy if f else None, 3), "steps": f.steps if f else None,
        })
    out_hops = []
    for h in hops:
        kind = h.get("transport")
        if kind is not None and kind not in TRANSPORTS:
            raise ValueError(f"hop {h.get('from')} -> {h.get('to')}: unknown transport {kind!r}")
        out_hops.append({"from": str(h.get("from")), "to": str(h.get("to")), "transport": kind})
    return {
        "object": "mesh.status", "model": model, "state": state, "detail": detail, "chain": chain, "pool": int(pool),
        "stages": out_stages, "hops": out_hops, "scheduler": scheduler_dict(scheduler),
        "predicted_tok_per_s": _num(getattr(placement, "predicted_decode_tok_s", None), 1),
        "placement": None if placement is None else {
            "policy": getattr(placement, "policy", None),
            "predicted_decode_tok_per_s": _num(getattr(placement, "predicted_decode_tok_s", None), 1),
            "predicted_prefill_tok_per_s": _num(getattr(placement, "predicted_prefill_tok_s", None), 1),
            "measured_decode_tok_per_s": _num(getattr(placement, "measured_decode_tok_s", None), 1),
            "left_out": [str(line) for line in getattr(placement, "left_out", ())],
            "note": str(getattr(placement, "note", "") or ""),
        },
    }


def scheduler_dict(stats: Any) -> dict | None:
    """The scheduler's stats as plain numbers; fields it does not have are null (its stats type may grow)."""
    if stats is None:
        return None
    get = (lambda k: stats.get(k)) if isinstance(stats, Mapping) else (lambda k: getattr(stats, k, None))
    out = {k: get(k) for k in ("active", "queued", "max_seqs", "steps", "tokens_out", "prompt_tokens", "in_flight",
                               "micro_batches")}
    out = {k: (int(v) if v is not None else None) for k, v in out.items()}
    step_ms = get("step_ms")                        # submit-to-answer time of recent micro-batches
    out["ms_per_step"] = _num(step_ms if step_ms is not None else get("ms_per_step"), 2)
    return out


def fleet_stages(members: Iterable[Any], infos: Sequence[Any], *, local: tuple[int, int] | None = None,
                 local_device: str | None = None) -> list[dict]:
    """The stage list of a formed fleet: the coordinator's own first layers (if any), then each member in chain order
    with its `Info` (layers, backend, memory) and registry facts (name, host)."""
    out = []
    if local:
        out.append({"name": "coordinator", "host": "local", "device": local_device, "layers": list(local),
                    "memory_mb": None, "local": True})
    for m, info in zip(members, infos):
        out.append({"name": m.name, "host": m.host, "device": getattr(info, "backend", "") or None,
                    "layers": [info.start, info.end] if getattr(info, "loaded", True) else None,
                    "memory_mb": getattr(info, "memory_mb", 0) or getattr(m.join, "memory_mb", 0),
                    "kv_blocks": getattr(info, "kv_blocks", 0), "kv_block_size": getattr(info, "kv_block_size", 0),
                    "local": False})
    return out


def fleet_hops(chain: str, names: Sequence[str], transports: Sequence[str | None]) -> list[dict]:
    """The hops a step travels, each with the transport it came up on. p2p: coordinator -> stage 1 (its control
    link), stage k -> k+1 (the ladder's outcome), last stage -> the coordinator's sink (a direct dial). hub:
    coordinator <-> each stage (its control link carries the steps both ways). `transports` in that order."""
    if chain == "hub":
        return [{"from": "coordinator", "to": name, "transport": kind} for name, kind in zip(names, transports)]
    ends = ["coordinator", *names, "coordinator (sink)"]
    return [{"from": ends[k], "to": ends[k + 1], "transport": kind}
            for k, kind in enumerate(transports) if k + 1 < len(ends)]


class StageHistory:
    """Recent readings of each stage's counters, so a request's figures are rates over the last few seconds: the
    newest reading at least `min_gap` seconds older than the new one, and no older than `keep` seconds (an idle
    status view must not report a rate averaged over an hour)."""

    def __init__(self, *, keep: float = 15.0, min_gap: float = 0.5):
        self.keep, self.min_gap = keep, min_gap
        self._seen: dict[Any, list[StageCounters]] = {}

    def figures(self, key: Any, cur: StageCounters | None) -> StageFigures | None:
        if cur is None:
            return None
        seen = [c for c in self._seen.get(key, []) if cur.at - c.at <= self.keep]
        prev = next((c for c in reversed(seen) if cur.at - c.at >= self.min_gap), None)
        self._seen[key] = [*seen, cur]
        return stage_figures(prev, cur)

    def forget_except(self, keys: Iterable[Any]) -> None:
        keep = set(keys)
        for key in [k for k in self._seen if k not in keep]:
            del self._seen[key]


async def snapshot(service: Any, history: StageHistory, *, timeout: float = 2.0) -> dict:
    """The live status of a service (mesh/serve/app.py documents what a route may use of it): the session's fleet
    and hops, the stages' counters (asked for now, p2p only; a stage that does not answer within `timeout` has no
    figures this time), the scheduler's stats, the planner's decision."""
    coord = service.coord
    session = getattr(service, "session", None)
    fleet = session.fleet if session is not None else None
    cfg = coord.cfg
    stages, hops, figures = [], [], []
    pooled = list(coord.registry.members)
    if fleet is not None:
        members = list(fleet.members)
        pooled = [m for m in pooled if m not in members]
        local = (0, cfg.layers[1]) if cfg.layers else None
        stages = fleet_stages(members, fleet.infos, local=local, local_device=cfg.device)
        transports = list(getattr(fleet, "hops", []))
        if cfg.chain == "p2p" and members:
            transports = [transport_of_stream(members[0].link.stream), *transports]
        hops = fleet_hops(cfg.chain, [m.name for m in members], transports)
        counters = await fleet.read_stats(timeout)
        keys = [(id(fleet), m.number) for m in members]
        history.forget_except(keys)
        figures = ([None] if local else []) + [history.figures(k, c) for k, c in zip(keys, counters)]
    scheduler = getattr(service, "scheduler", None)
    return build_status(
        model=str(getattr(service, "model_id", "") or cfg.model.name), state=str(getattr(service, "state", "")),
        detail=str(getattr(service, "detail", "") or ""), chain=cfg.chain if fleet is not None else None,
        pool=len(pooled), stages=stages, hops=hops, figures=figures,
        scheduler=scheduler.stats() if scheduler is not None else None,
        placement=getattr(fleet, "placement", None))


def routes(service: Any) -> list:
    """GET /v1/mesh: the status as JSON (behind the API key like every /v1 route)."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    history = StageHistory()

    async def mesh_status(request):
        return JSONResponse(await snapshot(service, history), headers={"Cache-Control": "no-store"})
    return [Route("/v1/mesh", mesh_status, methods=["GET"])]


# ---- the terminal view (mesh-coord status) -------------------------------------------------------------------
def _cell(v: Any, fmt: str = "{}") -> str:
    return "-" if v is None else fmt.format(v)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_status(st: Mapping[str, Any]) -> str:
    """A compact terminal table of a status dict (as `build_status` makes and `GET /v1/mesh` returns)."""
    lines = [f"model {st.get('model') or '-'}  state {st.get('state')}"
             + (f" ({st['detail']})" if st.get("detail") else "")
             + (f"  chain {st['chain']}" if st.get("chain") else "") + f"  pool {st.get('pool', 0)}"]
    sched = st.get("scheduler")
    if sched:
        lines.append(f"sequences: {_cell(sched.get('active'))} active / {_cell(sched.get('max_seqs'))} slots, "
                     f"{_cell(sched.get('queued'))} queued; {_cell(sched.get('steps'))} steps, "
                     f"{_cell(sched.get('tokens_out'))} tokens out"
                     + (f", {sched['ms_per_step']:.1f} ms a step" if sched.get("ms_per_step") is not None else ""))
    pl = st.get("placement")
    if pl:
        said = [f"placement {pl.get('policy') or '-'}"]
        if pl.get("predicted_decode_tok_per_s") is not None:
            said.append(f"predicts {pl['predicted_decode_tok_per_s']:.1f} tok/s decode")
        if pl.get("predicted_prefill_tok_per_s") is not None:
            said.append(f"{pl['predicted_prefill_tok_per_s']:.0f} tok/s prefill")
        if pl.get("measured_decode_tok_per_s") is not None:
            said.append(f"measured {pl['measured_decode_tok_per_s']:.1f} tok/s decode")
        lines.append(", ".join(said) + (f" ({pl['note']})" if pl.get("note") else ""))
        lines += [f"left out: {line}" for line in pl.get("left_out") or ()]
    stages = st.get("stages") or []
    if stages:
        rows = [["#", "name", "device", "layers", "memory", "KV pos", "ms/step", "tok/s", "busy"]]
        for k, s in enumerate(stages):
            layers = s.get("layers")
            row = [str(k + 1), s.get("name") or "-", s.get("device") or "-",
                   f"{layers[0]}..{layers[1]}" if layers else "-",
                   _cell(s.get("memory_mb"), "{} MB"),
                   "-" if not s.get("kv_blocks") else str(s["kv_blocks"] * (s.get("kv_block_size") or 1)),
                   _cell(s.get("ms_per_step"), "{:.1f}"),
                   _cell(s.get("tok_per_s"), "{:.1f}"),
                   "-" if s.get("busy") is None else f"{100 * s['busy']:.0f}%"]
            rows.append(row)
        lines += _table(rows)
    hops = st.get("hops") or []
    if hops:
        lines.append("hops: " + ", ".join(f"{h['from']} -> {h['to']} {h.get('transport') or '?'}" for h in hops))
    return "\n".join(lines)
