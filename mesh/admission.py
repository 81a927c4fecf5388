"""Who takes part in a session: the joined peers the planner can use, and why the others are left out.

Pure, like the planner: the coordinator asks every peer for its `Info`, calls `leave_out`, tells each left-out peer
why in a `LeftOut` message (and releases it back to the pool, where it waits for a later session), then plans the
rest. Before this, one peer pinned over another's range, or one peer too many, stopped the whole coordinator.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mesh.planner import StageReport
from mesh.proto import LeftOutCode


@dataclass(frozen=True, slots=True)
class Exclusion:
    index: int              # into the stage list given to leave_out
    code: LeftOutCode
    reason: str             # one line, addressed to the peer and printed by the coordinator


def layer_mb(path: Path) -> float:
    """The largest layer's weights of the GGUF at `path`, in MiB: the least memory a stage needs."""
    from engine.gguf_meta import read_gguf
    sizes: dict[str, int] = {}
    for name, t in read_gguf(path).tensors.items():
        if name.startswith("blk."):
            block = name.split(".")[1]
            sizes[block] = sizes.get(block, 0) + t.nbytes
    return max(sizes.values(), default=0) / 2**20


def leave_out(first: int, total: int, stages: list[StageReport], need_mb: float) -> list[Exclusion]:
    """The stages that cannot take part, in `stages` order (join order: the earlier peer keeps a contested range).

    - MEMORY: an unpinned peer that reports less memory than one layer needs (`need_mb`; 0 memory = unknown, kept);
    - PINNED_OVERLAP: a pinned range that overlaps one pinned earlier, or the coordinator's own layers [0, first);
    - OTHER: a pinned range beyond the model's depth;
    - SURPLUS: unpinned peers beyond the free layers (the latest joined go first), or all of them when the pinned
      ranges cover every layer.
    """
    out: list[Exclusion] = []
    kept: list[StageReport] = []
    for i, s in enumerate(stages):
        if not s.pinned:
            if 0 < s.memory_mb < need_mb:
                out.append(Exclusion(i, LeftOutCode.MEMORY, f"{s.name} offers {s.memory_mb} MB; one layer of this "
                                                            f"model needs {need_mb:.0f} MB"))
            continue
        if s.end > total:
            out.append(Exclusion(i, LeftOutCode.OTHER, f"{s.name} is pinned to layers {s.start}..{s.end}, but the "
                                                       f"model has {total} layers"))
        elif s.start < first:
            out.append(Exclusion(i, LeftOutCode.PINNED_OVERLAP,
                                 f"{s.name} is pinned to layers {s.start}..{s.end}, which overlap the coordinator's "
                                 f"own layers 0..{first}"))
        elif (other := next((k for k in kept if s.start < k.end and k.start < s.end), None)) is not None:
            out.append(Exclusion(i, LeftOutCode.PINNED_OVERLAP,
                                 f"{s.name} is pinned to layers {s.start}..{s.end}, which overlap layers "
                                 f"{other.start}..{other.end} of {other.name}, pinned first"))
        else:
            kept.append(s)
    left = {e.index for e in out}
    free_layers = (total - first) - sum(k.end - k.start for k in kept)
    unpinned = [i for i, s in enumerate(stages) if not s.pinned and i not in left]
    if free_layers == 0:
        spare = unpinned
        why = "the pinned peers hold every layer"
    else:
        spare = unpinned[free_layers:]
        why = f"{len(unpinned)} unpinned peers for {free_layers} free layers"
    for i in spare:
        out.append(Exclusion(i, LeftOutCode.SURPLUS, f"{stages[i].name} is not needed: {why}"))
    return sorted(out, key=lambda e: e.index)
