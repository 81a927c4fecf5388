"""Fleet planning: who holds which layers.

Pure functions over the stages' self-reports, so every rule here is testable without a network. The coordinator
asks each peer for its `Info`, calls `plan_fleet`, sends the loads, then calls `validate_chain` on the fresh
reports before a single token flows.
"""
from __future__ import annotations

from dataclasses import dataclass


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


def plan_fleet(first: int, total: int, stages: list[StageReport]) -> list[tuple[int, int]]:
    """One range per stage (same order as `stages`), keeping every pinned range and filling the gaps with the rest.

    `first` is the number of layers the coordinator holds itself (0 when headless). Unpinned stages are spread over
    the gaps that the pinned ranges leave: every gap needs at least one stage, spare stages go where layers per
    stage is highest, and within a gap layers follow reported memory.
    """
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
