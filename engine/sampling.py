"""Next-token choice from one column's logits: greedy, or temperature / top-k / top-p with a reproducible draw.

The draw for a column comes from a Philox generator keyed by (seed, position) alone, so the same sequence
samples the same tokens however the model is split and whatever else shares the step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import EngineError

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Sampling:
    """temperature 0 means greedy; top_k 0 means no cut; top_p 1.0 means no nucleus cut."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and self.top_k >= 0 and 0.0 < self.top_p <= 1.0):
            raise EngineError(f"bad sampling parameters: {self}")


def uniform_draw(seed: int, pos: int) -> float:
    """The one uniform number in [0, 1) that decides the token at `pos` of a sequence sampled with `seed`."""
    key = np.array([seed & _MASK64, pos & _MASK64], dtype=np.uint64)
    return float(np.random.Generator(np.random.Philox(key=key)).random())


def pick_token(logits: np.ndarray, s: Sampling, pos: int) -> int:
    """Choose a token from (vocab,) logits for the column at position `pos`."""
    if s.temperature == 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / s.temperature
    order = np.argsort(-z, kind="stable")  # ties broken by token id, so the order is reproducible
    if 0 < s.top_k < len(order):
        order = order[:s.top_k]
    zk = z[order]
    p = np.exp(zk - zk[0])
    p /= p.sum()
    if s.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), s.top_p)) + 1  # smallest prefix whose mass reaches top_p
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    cdf = np.cumsum(p)
    i = int(np.searchsorted(cdf, uniform_draw(s.seed, pos) * cdf[-1], side="right"))
    return int(order[min(i, len(order) - 1)])
