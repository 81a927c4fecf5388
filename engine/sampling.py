"""Next-token choice from one column's logits: greedy, or temperature / top-k / top-p with a reproducible draw.

The draw for a column comes from a Philox generator keyed by (seed, position) alone, so the same sequence
samples the same tokens however the model is split and whatever else shares the step.
"""
from __future__ import annotations

import numpy as np

from common.values import Sampling  # defined once for every package (NOTES "Layout and dependency direction")

__all__ = ["Sampling", "pick_token", "uniform_draw"]

_MASK64 = (1 << 64) - 1


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
