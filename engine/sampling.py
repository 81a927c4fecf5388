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


def _top(z: np.ndarray, m: int) -> np.ndarray:
    """The first m indices of z in descending order, ties by lower index first: np.argsort(-z, kind="stable")[:m],
    without sorting the whole vocabulary (a stable sort of 49152 float64s took 10-90 ms a column on a busy 2-core
    box, more than the decode step it follows): the m largest by argpartition, the boundary's ties resolved to the
    lowest indices, then only those m sorted."""
    if m >= len(z):
        return np.argsort(-z, kind="stable")
    thr = z[np.argpartition(-z, m - 1)[m - 1]]          # the m-th largest value
    above = np.flatnonzero(z > thr)
    cand = np.concatenate([above, np.flatnonzero(z == thr)[:m - len(above)]])
    cand.sort()                                          # index order, so the stable sort below breaks ties by index
    return cand[np.argsort(-z[cand], kind="stable")]


def pick_token(logits: np.ndarray, s: Sampling, pos: int) -> int:
    """Choose a token from (vocab,) logits for the column at position `pos`.

    Greedy: the first largest logit. Otherwise, with z = logits / temperature (float64): the tokens in descending
    order of z (ties: lower id first), cut to top_k; probabilities exp(z - z_max) over their total; cut to the
    smallest prefix whose mass reaches top_p (renormalized); the token where the cumulative mass first passes
    u * the total, u = uniform_draw(seed, pos). Only as much of the order is sorted as the cut or the draw reads
    (the mass sits in the top few hundred tokens): the top 64, then 8x more, up to the whole vocabulary. With top_k
    every step is as a full sort gives it; without, the vocabulary's total mass is summed in token-id order."""
    if s.temperature == 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / s.temperature
    u = uniform_draw(s.seed, pos)
    if 0 < s.top_k < len(z):     # the top k, in order: small, so each sum runs over them as a full sort has them
        order = _top(z, s.top_k)
        p = np.exp(z[order] - z[order[0]])
        p /= p.sum()
        if s.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), s.top_p)) + 1
            order, p = order[:keep], p[:keep] / p[:keep].sum()
        cdf = np.cumsum(p)
        i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        return int(order[min(i, len(order) - 1)])
    e = np.exp(z - z.max())
    total = e.sum()
    m = 64
    while True:
        order = _top(z, m)
        whole = len(order) == len(z)
        p = e[order] / total
        cum = np.cumsum(p)
        if s.top_p < 1.0:
            keep = int(np.searchsorted(cum, s.top_p)) + 1   # smallest prefix whose mass reaches top_p
            if keep <= len(order) or whole:
                keep = min(keep, len(order))
                p = p[:keep] / p[:keep].sum()
                cdf = np.cumsum(p)
                i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
                return int(order[min(i, keep - 1)])
        else:
            i = int(np.searchsorted(cum, u, side="right"))
            if i < len(order) or whole:
                return int(order[min(i, len(order) - 1)])
        m *= 8
