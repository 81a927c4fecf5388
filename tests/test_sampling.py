"""pick_token sorts only the head of the vocabulary: the same token as a full stable sort, tie-breaking included."""
import numpy as np
import pytest

from common.values import Sampling
from engine.sampling import _top, pick_token, uniform_draw


def full_sort_pick(logits: np.ndarray, s: Sampling, pos: int) -> int:
    """The definition, sorting the whole vocabulary (what pick_token did until 2026-12-02)."""
    if s.temperature == 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / s.temperature
    order = np.argsort(-z, kind="stable")
    if 0 < s.top_k < len(order):
        order = order[:s.top_k]
    zk = z[order]
    p = np.exp(zk - zk[0])
    p /= p.sum()
    if s.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), s.top_p)) + 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    cdf = np.cumsum(p)
    i = int(np.searchsorted(cdf, uniform_draw(s.seed, pos) * cdf[-1], side="right"))
    return int(order[min(i, len(order) - 1)])


def cases(seed: int, n: int):
    rng = np.random.default_rng(seed)
    for trial in range(n):
        vocab = int(rng.choice([2, 7, 100, 3000]))
        x = (rng.standard_normal(vocab) * rng.choice([0.3, 3.0, 12.0])).astype(np.float32)
        if trial % 5 == 0:
            x = np.round(x)             # many ties, across the cut points too
        if trial % 13 == 0:
            x[:] = 0.5                  # every token tied
        s = Sampling(temperature=float(rng.choice([0.2, 0.8, 1.0, 2.0])), top_k=int(rng.choice([0, 1, 3, 64, 700])),
                     top_p=float(rng.choice([1.0, 0.95, 0.5, 0.0])), seed=int(rng.integers(0, 2 ** 63)))
        yield x, s


def test_the_head_sort_is_the_full_sort_prefix_ties_by_lower_id():
    rng = np.random.default_rng(3)
    for _ in range(200):
        z = np.round(rng.standard_normal(int(rng.integers(1, 400))) * 2)
        m = int(rng.integers(1, len(z) + 2))
        assert _top(z, m).tolist() == np.argsort(-z, kind="stable")[:m].tolist()


@pytest.mark.parametrize("seed", [0, 1])
def test_pick_token_equals_the_full_sort(seed):
    for x, s in cases(seed, 150):
        for pos in (0, 1, 977):
            assert pick_token(x, s, pos) == full_sort_pick(x, s, pos), (s, pos, x[:8])


def test_a_flat_large_vocabulary_reads_past_the_first_heads():
    # a flat distribution puts the draw deep in the order: the head grows (64, 512, ...) until it holds the token
    x = np.zeros(49152, np.float32)
    x[::3] = 0.01
    for pos in range(5):
        s = Sampling(temperature=1.0, seed=11)
        assert pick_token(x, s, pos) == full_sort_pick(x, s, pos)
        s = Sampling(temperature=1.0, top_p=0.9, seed=12)
        assert pick_token(x, s, pos) == full_sort_pick(x, s, pos)
