"""Fleet planning: who holds which layers.

Pure functions over the stages' self-reports, so every rule here is testable without a network. The coordinator
asks each peer for its `Info`, calls `plan_by_speed` (every unpinned peer measured) or `plan_fleet` (memory alone),
sends the loads, then calls `validate_chain` on the fresh reports before a single token flows.

The cost model of placement by speed (NOTES "Mesh", "Placement by measured speed"): one sequence's decode token
passes every stage in turn, so its time is the *sum* over the chain of each stage's
    layers x decode ms per layer + the stage's fixed ms per step + half its link's round trip + a column's bytes / bandwidth
(the link terms are each peer's own link to the coordinator, standing in for the hops, which do not exist before the
plan). The order of the stages does not change that sum, so the plan picks which peers take part and how many layers
each holds: the fastest fill up to their memory, and a peer whose layers and hop cost more than they save is left out.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field


class PlanError(Exception):
    """The fleet cannot serve this model as reported; the message says which stage and why."""


@dataclass(frozen=True, slots=True)
class StageReport:
    """What one peer says about itself (the `Info` message, minus the wire)."""
    name: str                 # how logs and errors name the peer, e.g. "peer 2 (10.0.0.5:7000)"
    start: int
    end: int
    total_layers: int
    memory_mb: int            # planning hint; 0 = unknown
    pinned: bool              # started with --layers: its range is not ours to change
    fingerprint: str          # source model identity; "" = holds no model
    backend: str = ""
    loaded: bool = False
    speed: "StageSpeed | None" = None    # measured on the peer's device for this model; None = not measured
    measures: bool = False               # it measures a stage it loads (so a probe load gives it a speed)
    link: "LinkSpeed | None" = None      # its link to the coordinator, measured before the plan
    kv_bytes: int = 0                    # bytes of one KV value its stage keeps (2 f16, 4 f32; 0 = not said)


@dataclass(frozen=True, slots=True)
class StageSpeed:
    """A peer's own compute, measured on its device (mesh.speed): ms per layer of a one-column decode step and of a
    16-column prefill chunk, and the ms a step costs whatever its layers (the worker's round trip)."""
    decode_ms_per_layer: float
    prefill_ms_per_layer: float
    step_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class LinkSpeed:
    """Round trip and bandwidth of a peer's control link, the stand-in for its hops. mb_per_s 0 = not measured."""
    rtt_ms: float
    mb_per_s: float = 0.0

    def transfer_ms(self, nbytes: int) -> float:
        return nbytes / (self.mb_per_s * 1e3) if self.mb_per_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class ModelCost:
    """What the planner needs of the model: memory one layer takes on a peer (weights + KV cache) and the bytes of
    one column's hidden state on the wire. layer_mb 0 = unknown (memory bounds nothing). layer_mb prices the KV
    cache at f32; kv_mb is that part of it, priced on each stage at the bytes it keeps (`layer_mb_on`)."""
    layer_mb: float
    hidden_bytes: int
    prefill_columns: int = 64      # the coordinator's prefill chunk on the wire
    engine_chunk: int = 16         # the engine's prefill chunk, the shape the prefill figure was measured on
    kv_mb: float = 0.0

    def layer_mb_on(self, s: StageReport) -> float:
        """MB one layer takes on stage s: its KV cache at the bytes of a value the peer said it keeps (a CPU peer
        keeps f16: half), at f32 where it did not say."""
        return self.layer_mb - self.kv_mb * (1 - s.kv_bytes / 4) if s.kv_bytes else self.layer_mb


@dataclass(frozen=True, slots=True)
class Prediction:
    """Predicted figures of a chain: decode ms per token (one sequence), prefill tokens/s of a long prompt."""
    decode_ms: float
    prefill_tok_s: float

    @property
    def decode_tok_s(self) -> float:
        return 1000.0 / self.decode_ms if self.decode_ms > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Placement:
    """What placement decided for a session and how fast it said the chain would be; the coordinator keeps the
    current one as `Fleet.placement` and `Coordinator.placement` (the latter gains the measured rate once a
    decode ran), for its logs and the status view."""
    policy: str                                      # "speed", "memory" or "kept" (a re-formed fleet kept its layout)
    ranges: tuple[tuple[str, int, int], ...]         # (peer, start, end) in chain order
    predicted_decode_tok_s: float | None = None      # one sequence
    predicted_prefill_tok_s: float | None = None     # a long prompt
    memory_plan_decode_tok_s: float | None = None    # the memory-only plan's prediction, for comparison
    left_out: tuple[str, ...] = ()                   # one line each, with the figures
    measured_decode_tok_s: float | None = None       # the last answer's decode rate, once one ran
    note: str = ""                                   # why the plan is not by speed


@dataclass(frozen=True, slots=True)
class LeftOutNote:
    index: int                    # into the stages list
    kind: str                     # "too_slow" | "memory" | "surplus"
    line: str                     # one line with the figures, for the log and for the peer


@dataclass(frozen=True, slots=True)
class SpeedPlan:
    ranges: tuple[tuple[int, int] | None, ...]   # per stage (same order as the input), None = left out
    prediction: Prediction
    left_out: tuple[LeftOutNote, ...] = field(default=())


def plan_split(first: int, total: int, memory_mb: list[int]) -> list[tuple[int, int]]:
    """Apportion layers [first, total) over stages in chain order.

    Proportional to reported memory when every stage reports one, equal shares otherwise; largest-remainder
    rounding (ties to the earlier stage); every stage gets at least one layer.
    """
    n, remaining = len(memory_mb), total - first
    if n == 0:
        raise PlanError("no peer stages to plan")
    if remaining < n:
        raise PlanError(f"{remaining} layers ({first}..{total}) cannot give {n} stages at least one layer each")
    weights = [float(m) for m in memory_mb] if all(m > 0 for m in memory_mb) else [1.0] * n
    shares = [remaining * w / sum(weights) for w in weights]
    counts = [int(s) for s in shares]
    by_remainder = sorted(range(n), key=lambda i: (-(shares[i] - counts[i]), i))
    for k in range(remaining - sum(counts)):
        counts[by_remainder[k % n]] += 1
    while 0 in counts:  # the floor of one layer: take from the fattest stage (earliest on ties)
        fat = max(range(n), key=lambda i: (counts[i], -i))
        counts[fat] -= 1
        counts[counts.index(0)] += 1
    ranges, cursor = [], first
    for c in counts:
        ranges.append((cursor, cursor + c))
        cursor += c
    return ranges


def _gaps(first: int, total: int, stages: list[StageReport]) -> list[tuple[int, int]]:
    """The layer ranges the pinned stages leave free, in order; refuses pins that overlap or overrun the model."""
    pinned = sorted((s.start, s.end, s.name) for s in stages if s.pinned)
    gaps, cursor = [], first
    for start, end, name in pinned:
        if start < cursor:
            raise PlanError(f"{name} is pinned to layers {start}..{end}, which overlaps layers below {cursor}")
        if start > cursor:
            gaps.append((cursor, start))
        cursor = end
    if cursor > total:
        raise PlanError(f"pinned ranges reach layer {cursor} but the model has {total} layers")
    if cursor < total:
        gaps.append((cursor, total))
    return gaps


def plan_fleet(first: int, total: int, stages: list[StageReport]) -> list[tuple[int, int]]:
    """One range per stage (same order as `stages`), keeping every pinned range and filling the gaps with the rest.

    `first` is the number of layers the coordinator holds itself (0 when headless). Unpinned stages are spread over
    the gaps that the pinned ranges leave: every gap needs at least one stage, spare stages go where layers per
    stage is highest, and within a gap layers follow reported memory.
    """
    gaps = _gaps(first, total, stages)
    free = [i for i, s in enumerate(stages) if not s.pinned]
    if len(free) < len(gaps):
        holes = ", ".join(f"{a}..{b}" for a, b in gaps)
        raise PlanError(f"pinned ranges leave layers {holes} uncovered and only {len(free)} unpinned peers")
    if not gaps and free:
        raise PlanError(f"pinned ranges cover every layer; {len(free)} unpinned peers would hold nothing")
    per_gap = [1] * len(gaps)
    for _ in range(len(free) - len(gaps)):
        best = max(range(len(gaps)), key=lambda g: ((gaps[g][1] - gaps[g][0]) / per_gap[g], -g))
        if gaps[best][1] - gaps[best][0] <= per_gap[best]:
            raise PlanError(f"{len(free)} unpinned peers are more than the {sum(b - a for a, b in gaps)} free layers")
        per_gap[best] += 1
    ranges: dict[int, tuple[int, int]] = {i: (s.start, s.end) for i, s in enumerate(stages) if s.pinned}
    it = iter(free)
    for (a, b), k in zip(gaps, per_gap):
        members = [next(it) for _ in range(k)]
        for i, r in zip(members, plan_split(a, b, [stages[i].memory_mb for i in members])):
            ranges[i] = r
    return [ranges[i] for i in range(len(stages))]


# ---- placement by measured speed -------------------------------------------------------------------------------
SEARCH_LIMIT = 4096   # assignments tried exhaustively; past that only the fastest peers are candidates


def capacity(s: StageReport, cost: ModelCost, total: int) -> int:
    """How many layers a peer's memory holds (unbounded where memory or the layer size is unknown)."""
    if s.memory_mb <= 0 or cost.layer_mb <= 0:
        return total
    return int(s.memory_mb // cost.layer_mb_on(s))


def _need_speed(s: StageReport) -> StageSpeed:
    if s.speed is None:
        raise PlanError(f"{s.name} has no measured speed: plan by memory instead")
    return s.speed


def stage_ms(s: StageReport, layers: int, cost: ModelCost) -> float:
    """One decode token's time in this stage: its layers, its fixed cost per step, and its share of the hops."""
    sp, ln = _need_speed(s), s.link or LinkSpeed(0.0)
    return layers * sp.decode_ms_per_layer + sp.step_ms + ln.rtt_ms / 2 + ln.transfer_ms(cost.hidden_bytes)


def predict(stages: list[StageReport], ranges, cost: ModelCost) -> Prediction:
    """The figures of a chain: ranges per stage (None = left out), every member measured. Decode is the sum of the
    stages (one sequence walks them in turn); a long prefill streams chunks through all stages at once, so its rate
    is set by the slowest stage's chunk."""
    decode, slowest = 0.0, 0.0
    for s, r in zip(stages, ranges):
        if r is None:
            continue
        n = r[1] - r[0]
        decode += stage_ms(s, n, cost)
        ln = s.link or LinkSpeed(0.0)
        chunk = (n * s.speed.prefill_ms_per_layer * cost.prefill_columns / cost.engine_chunk + s.speed.step_ms
                 + ln.rtt_ms / 2 + ln.transfer_ms(cost.hidden_bytes * cost.prefill_columns))
        slowest = max(slowest, chunk)
    return Prediction(decode, cost.prefill_columns * 1000.0 / slowest if slowest > 0 else 0.0)


def _fill(gap: tuple[int, int], members: list[int], stages: list[StageReport], cost: ModelCost,
          total: int) -> dict[int, tuple[int, int]] | None:
    """The best split of one gap over these peers: one layer each, then the rest to the fastest first, each up to
    its memory (optimal for costs linear in layers). Ranges follow the input order. None if they cannot hold it."""
    a, b = gap
    if not members or len(members) > b - a:
        return None
    caps = {i: min(capacity(stages[i], cost, total), b - a) for i in members}
    if min(caps.values()) < 1 or sum(caps.values()) < b - a:
        return None
    counts = dict.fromkeys(members, 1)
    left = b - a - len(members)
    for i in sorted(members, key=lambda i: (stages[i].speed.decode_ms_per_layer, i)):
        take = min(left, caps[i] - 1)
        counts[i] += take
        left -= take
    out, cursor = {}, a
    for i in sorted(members):
        out[i] = (cursor, cursor + counts[i])
        cursor += counts[i]
    return out


def _search(first: int, total: int, stages: list[StageReport], cost: ModelCost,
            forced: frozenset[int] = frozenset()) -> tuple[list, float] | None:
    """The cheapest assignment of the unpinned peers to the gaps (or to nothing), `forced` ones included."""
    gaps = _gaps(first, total, stages)
    free = [i for i, s in enumerate(stages) if not s.pinned]
    base = {i: (s.start, s.end) for i, s in enumerate(stages) if s.pinned}
    by_speed = sorted(free, key=lambda i: (i not in forced, stages[i].speed.decode_ms_per_layer, i))
    k = len(by_speed)
    while k > 0 and (len(gaps) + 1) ** k > SEARCH_LIMIT:
        k -= 1
    candidates = by_speed[:max(k, len(forced))]
    best, best_ms = None, math.inf
    for choice in itertools.product(range(-1, len(gaps)), repeat=len(candidates)):
        if any(g == -1 and i in forced for i, g in zip(candidates, choice)):
            continue
        ranges = dict(base)
        for g, gap in enumerate(gaps):
            filled = _fill(gap, [i for i, c in zip(candidates, choice) if c == g], stages, cost, total)
            if filled is None:
                break
            ranges.update(filled)
        else:
            ms = sum(stage_ms(stages[i], r[1] - r[0], cost) for i, r in ranges.items())
            if ms < best_ms - 1e-9:
                best, best_ms = [ranges.get(i) for i in range(len(stages))], ms
    return None if best is None else (best, best_ms)


def plan_by_speed(first: int, total: int, stages: list[StageReport], cost: ModelCost) -> SpeedPlan:
    """Contiguous ranges that minimise the predicted decode time per token, within each peer's memory; pinned
    ranges are kept. A peer that would slow the chain gets no range, and a note that says why with the figures."""
    for s in stages:
        _need_speed(s)
    found = _search(first, total, stages, cost)
    if found is None:
        need = f"{cost.layer_mb:.0f} MB a layer" if cost.layer_mb > 0 else "one layer each"
        raise PlanError(f"the peers cannot hold layers {first}..{total} ({need}; memory: "
                        + ", ".join(f"{s.name} {s.memory_mb} MB" for s in stages if not s.pinned) + ")")
    ranges, _ = found
    prediction = predict(stages, ranges, cost)
    notes = []
    for i, r in enumerate(ranges):
        if r is not None:
            continue
        s = stages[i]
        if capacity(s, cost, total) < 1:
            notes.append(LeftOutNote(i, "memory", f"{s.name} offers {s.memory_mb} MB, one layer needs "
                                                  f"{cost.layer_mb_on(s):.0f} MB"))
            continue
        forced = _search(first, total, stages, cost, frozenset({i}))
        if forced is None:
            notes.append(LeftOutNote(i, "surplus", f"{s.name} is not needed: no layers are left for it"))
            continue
        with_it = predict(stages, forced[0], cost)
        fastest = min(x.speed.decode_ms_per_layer for x, rr in zip(stages, ranges) if rr is not None)
        ln = s.link or LinkSpeed(0.0)
        notes.append(LeftOutNote(i, "too_slow", (
            f"{s.name} would slow the chain: decode {s.speed.decode_ms_per_layer:.2f} ms/layer (fastest in the chain "
            f"{fastest:.2f}) + {s.speed.step_ms:.1f} ms a step, link rtt {ln.rtt_ms:.1f} ms; with it the best plan "
            f"predicts {with_it.decode_tok_s:.2f} tok/s, without it {prediction.decode_tok_s:.2f}")))
    return SpeedPlan(tuple(ranges), prediction, tuple(notes))


def chain_order(ranges: list[tuple[int, int]]) -> list[int]:
    """Stage indices sorted by the first layer they hold: the order tokens flow through them."""
    return sorted(range(len(ranges)), key=lambda i: ranges[i][0])


def validate_chain(first: int, stages: list[StageReport], fingerprint: str) -> str:
    """Check that the stages, in chain order, tile [first, total) of one model; return the topology map."""
    if not stages:
        raise PlanError("no peer stages joined")
    total = stages[0].total_layers
    lines = [f"stage 0: coordinator, layers 0..{first} (local)" if first else
             "stage 0: coordinator, headless (tokenizer and scheduler only)"]
    cursor = first
    for k, s in enumerate(stages, 1):
        if s.fingerprint != fingerprint:
            raise PlanError(f"{s.name} holds a different model (fingerprint {s.fingerprint[:16] or 'none'}, "
                            f"the coordinator's is {fingerprint[:16]})")
        if s.total_layers != total:
            raise PlanError(f"{s.name} reports a model of {s.total_layers} layers, others {total}")
        if s.start != cursor:
            what = "gap" if s.start > cursor else "overlap"
            raise PlanError(f"{s.name} holds layers {s.start}..{s.end} but the chain is at layer {cursor}: {what}")
        if not (s.start < s.end <= total):
            raise PlanError(f"{s.name} holds layers {s.start}..{s.end}, not a valid range of {total}")
        lines.append(f"stage {k}: {s.name}, layers {s.start}..{s.end} on {s.backend or '?'}"
                     f"{' (pinned)' if s.pinned else ''}")
        cursor = s.end
    if cursor != total:
        raise PlanError(f"the chain ends at layer {cursor} but the model has {total}: the last stage must own the head")
    return "\n".join(lines)
