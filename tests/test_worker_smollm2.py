"""Done-when of the worker issue: greedy decoding of SmolLM2 through worker processes is bitwise the same whether the
model runs unsharded in one worker or split 2 or 3 ways over workers chained by this test, tokens and activations.

The activations a split hands on at layer k are compared with every other split that also cuts at k, including one
whose upstream is itself split (layer 20: [0,20) in one worker against [0,10)+[10,20) in two). A Stage cannot show
the unsharded run's inner activations, so that cross-check is the strongest one available without a hook in Stage.

One prompt, 64 new tokens (generation goes on past an end-of-turn token: the point is equality, not the answer).
Three worker processes serve every split in turn (a Load replaces the range a worker holds), so each process compiles
its kernels once.
"""
import time

import numpy as np
import pytest

from engine.chat import render_prompt
from engine.sources import SourceError, default_model_path
from engine.stage import Column, Sampling
from engine.tokenizer import Tokenizer
from engine.worker import open_worker

pytestmark = pytest.mark.slow

N_NEW = 64
MAX_CONTEXT = 160


@pytest.fixture(scope="module")
def model_path():
    try:
        return default_model_path()
    except SourceError as exc:
        pytest.skip(str(exc))


def _splits(n: int) -> dict[str, tuple[int, ...]]:
    return {"unsharded": (0, n),
            "2-way a": (0, n // 2, n), "2-way b": (0, 2 * n // 3, n),
            "3-way a": (0, n // 3, 2 * n // 3, n), "3-way b": (0, n // 2, 3 * n // 4, n)}


async def _generate(workers, path, split, prompt, warmup):
    """Greedy-decode N_NEW tokens through len(split)-1 workers; returns the tokens and, per cut layer, the activations
    handed across it at every step."""
    chain = workers[:len(split) - 1]
    for w, a, b in zip(chain, split, split[1:]):
        await w.load(path, a, b, n_slots=1, max_context=MAX_CONTEXT, warmup=warmup)
    tokens, handed = list(prompt), {k: [] for k in split[1:-1]}
    cols = [Column(p, 0, p == len(prompt) - 1, t) for p, t in enumerate(prompt)]
    sampling = Sampling()  # greedy
    for _ in range(N_NEW):
        hidden = None
        for w, cut in zip(chain, split[1:]):
            hidden = await w.step(cols, hidden, sampling)
            if cut in handed:
                handed[cut].append(hidden)
        tokens.append(int(hidden[0]))
        cols = [Column(len(tokens) - 1, 0, True, tokens[-1])]
    return tokens[len(prompt):], handed


async def test_smollm2_greedy_is_bitwise_equal_unsharded_and_split_over_workers(model_path):
    tok = Tokenizer.from_gguf(model_path)
    prompt = tok.encode(render_prompt(tok, "Write a short story about a lighthouse keeper who finds a message in a "
                                           "bottle."))
    assert len(prompt) + N_NEW <= MAX_CONTEXT
    from engine.gguf_meta import read_model_meta
    splits = _splits(read_model_meta(model_path).n_layers)
    results, seconds = {}, {}
    async with open_worker(device="CPU") as w0, open_worker(device="CPU") as w1, open_worker(device="CPU") as w2:
        for name, split in splits.items():
            t0 = time.perf_counter()
            # only the reference compiles its shapes at load (Stage.warmup): the splits, which compile theirs on
            # first use, equal it bit for bit, so the warmup left nothing behind that a step could see
            results[name] = await _generate([w0, w1, w2], model_path, split, prompt, int(name == "unsharded"))
            seconds[name] = time.perf_counter() - t0
    print({k: round(v, 1) for k, v in seconds.items()})

    want = results["unsharded"][0]
    assert len(want) == N_NEW and tok.decode(want).strip()
    for name, (tokens, _) in results.items():
        first_diff = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
        assert tokens == want, f"{name} {splits[name]} diverges from unsharded at new token {first_diff}"

    by_cut: dict[int, list[tuple[str, list[np.ndarray]]]] = {}
    for name, (_, handed) in results.items():
        for cut, acts in handed.items():
            dim = acts[0].shape[1]
            assert len(acts) == N_NEW and acts[0].shape == (len(prompt), dim)
            assert all(a.shape == (1, dim) for a in acts[1:])
            by_cut.setdefault(cut, []).append((name, acts))
    shared = {cut: runs for cut, runs in by_cut.items() if len(runs) > 1}
    assert shared, "the splits were chosen so that some cut is shared"
    for cut, runs in shared.items():
        ref_name, ref = runs[0]
        for name, acts in runs[1:]:
            for step, (a, b) in enumerate(zip(acts, ref)):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), \
                    f"activations at layer {cut}, step {step}: {name} differs from {ref_name}"
