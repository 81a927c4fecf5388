"""Fidelity check (not a test): greedy tokens of the engine's weight modes against each other and against llama.cpp.

    .venv/bin/python bench/fidelity.py [--model PATH] [--tokens 32] [--weights MODE,MODE,...] [--prompts N]

Every path decodes the same prompt token ids greedily (the engine: `Sampling()`, i.e. argmax of its logits;
llama.cpp: top_k=1, temp=0) for --tokens new tokens, past an end-of-turn token if one comes, so every path always
yields the same number of tokens. Paths: each --weights mode of the unsharded engine (default: `Stage.load`'s own
default mode, read from its signature, and "f32", the exactly dequantized weights) and llama.cpp through
llama-cpp-python when it imports. Reported:
  * per prompt, for every pair of paths, the prefix agreement (leading tokens identical) and, at the first
    difference, each engine path's logit margin of its own pick over the other path's pick (a small margin is a
    near tie that rounding decides, a large one is a real error);
  * per pair, prompts agreeing over all tokens and the mean prefix;
  * the acceptance rule: every non-f32 mode agrees with llama.cpp at least as well as f32 does (no fewer fully
    agreeing prompts and no shorter mean prefix).
Each path is loaded once and reused across prompts (`stage.reset()` between them); one stage is freed before the next
loads. The comparison and its report are pure functions (up to `report`), tested in tests/test_fidelity_report.py.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import itertools
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA = "llama.cpp"
TOP = 8  # logits kept per step and path: enough to find the other path's pick at a near tie

# (name, chat template?, text): varied on purpose; --prompts N takes the first N
PROMPTS: list[tuple[str, bool, str]] = [
    ("fact", True, "What is the capital of France?"),
    ("code", True, "Write a Python function that returns the factorial of n."),
    ("list", True, "List five fruits that are red."),
    ("arith", True, "What is 17 + 25? Answer with the number only."),
    ("french", True, "Quelle est la plus haute montagne d'Europe ?"),
    ("long", True, "You are helping a small bakery. Write a friendly note for its customers that explains that the "
                   "shop will be closed next Monday for repairs, that orders placed before Sunday evening will be "
                   "ready on Tuesday morning, and that loyalty cards stay valid. Keep it under 80 words."),
    ("raw-text", False, "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village by the sea,"),
    ("raw-code", False, "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("german", True, "Erkläre in zwei Sätzen, warum der Himmel blau ist."),
    ("story", True, "Tell me a story about a robot who learns to paint."),
]


# --- pure comparison logic ------------------------------------------------------------------------------------------


def prefix_agreement(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens identical in a and b."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def pair_prefixes(tokens: dict[str, list[list[int]]]) -> dict[tuple[str, str], list[int]]:
    """Per pair of paths (in the paths' order), the prefix agreement of each prompt."""
    return {(a, b): [prefix_agreement(x, y) for x, y in zip(tokens[a], tokens[b])]
            for a, b in itertools.combinations(tokens, 2)}


def summarize(prefixes: Sequence[int], n_tokens: int) -> tuple[int, float]:
    """(prompts whose whole n_tokens agree, mean prefix length)."""
    return sum(p >= n_tokens for p in prefixes), (statistics.fmean(prefixes) if prefixes else 0.0)


def at_least_as_good(cand: Sequence[int], base: Sequence[int], n_tokens: int) -> bool:
    """The acceptance rule: cand's prefixes against the reference are no worse than base's in both figures."""
    (cf, cm), (bf, bm) = summarize(cand, n_tokens), summarize(base, n_tokens)
    return cf >= bf and cm >= bm


def margin(top: dict[int, float], pick: int, other: int) -> float | None:
    """How far this path's logit for its pick leads its logit for the other path's pick; None when the other pick
    is outside the recorded top logits (the margin is then at least the spread of those)."""
    return top[pick] - top[other] if pick in top and other in top else None


def format_margin(name: str, top: dict[int, float], pick: int, other: int) -> str:
    m = margin(top, pick, other)
    return f"{name} margin {m:.3f}" if m is not None else f"{name} margin > {top[pick] - min(top.values()):.2f}"


def report(rows: Sequence[tuple[str, bool, int]], tokens: dict[str, list[list[int]]],
           tops: dict[str, list[list[dict[int, float]]]], n: int, decode) -> list[str]:
    """The printed comparison: rows are (name, chat?, prompt length) per prompt, tokens and tops per path (engine
    paths have tops, llama.cpp has none), decode turns ids into text."""
    pairs, first = pair_prefixes(tokens), next(iter(tokens))
    out = []
    for p, (name, chat, n_prompt) in enumerate(rows):
        cells = "  ".join(f"{x}|{y} {pre[p]:2d}" for (x, y), pre in pairs.items())
        out.append(f"{p + 1:2d} {name:8s} {'chat' if chat else 'raw':4s} {n_prompt:3d}+{n}  {cells}  "
                   f"{first}: {decode(tokens[first][p])[:60]!r}")
        for (x, y), pre in pairs.items():
            k = pre[p]
            if k >= n:
                continue
            tx, ty = tokens[x][p][k], tokens[y][p][k]
            # both paths saw the same k tokens before this one, so each margin is over the same history
            picks = {x: (tx, ty), y: (ty, tx)}
            why = [format_margin(m, tops[m][p][k], *picks[m]) for m in (x, y) if m in tops]
            out.append(f"   {x}|{y} first differ at token {k}: {decode([tx])!r} vs {decode([ty])!r}"
                       + (f" ({', '.join(why)})" if why else ""))
    out.append("")
    for (x, y), pre in pairs.items():
        full, mean = summarize(pre, n)
        out.append(f"{x}|{y}: {full} of {len(pre)} prompts agree over all {n} tokens, mean prefix {mean:.1f}")
    if LLAMA not in tokens or "f32" not in tokens:
        out.append("acceptance rule not checked: it needs both llama.cpp and the f32 engine")
        return out
    base = pairs[("f32", LLAMA)]
    for mode in tokens:
        if mode not in ("f32", LLAMA):
            cand = pairs[(mode, LLAMA)]
            (cf, cm), (bf, bm) = summarize(cand, n), summarize(base, n)
            out.append(f"{mode} agrees with llama.cpp at least as well as f32 does: "
                       f"{'yes' if at_least_as_good(cand, base, n) else 'NO'} "
                       f"(fully agreeing prompts {cf} vs {bf}, mean prefix {cm:.1f} vs {bm:.1f})")
    return out


# --- the paths ------------------------------------------------------------------------------------------------------


def default_weights_mode() -> str:
    # read, not hard-coded: the default mode is being changed, and this check should follow whatever it is
    from engine.stage import Stage
    return inspect.signature(Stage.load).parameters["weights"].default


def run_engine(path: Path, prompts: list[list[int]], n: int, weights: str, ctx: int) -> tuple[list, list, dict]:
    """Greedy tokens and per-step top logits of one weight mode, one stage reused across prompts."""
    import numpy as np
    from engine.sampling import pick_token
    from engine.stage import Column, Sampling, Stage
    from engine.gguf_meta import read_model_meta
    t0 = time.perf_counter()
    stage = Stage.load(path, 0, read_model_meta(path).n_layers, n_slots=1, max_context=ctx, weights=weights)
    info = {"load_s": time.perf_counter() - t0, "weight_mb": stage.weight_bytes / 1e6}
    all_toks, all_tops = [], []
    for ids in prompts:
        stage.reset()
        cols = [Column(i, 0, i == len(ids) - 1, tk) for i, tk in enumerate(ids)]
        toks, tops = [], []
        for _ in range(n):
            logits = stage.step_logits(cols)[0]
            # step() picks with exactly this call; step_logits is its forward pass without the pick
            toks.append(pick_token(logits, Sampling(), cols[-1].pos))
            best = np.argpartition(-logits, TOP)[:TOP]
            tops.append({int(t): float(logits[t]) for t in best})
            cols = [Column(cols[-1].pos + 1, 0, True, toks[-1])]
        all_toks.append(toks)
        all_tops.append(tops)
    info["total_s"] = time.perf_counter() - t0
    del stage
    gc.collect()  # the next mode's stage loads into the memory this one held
    return all_toks, all_tops, info


def run_llama_cpp(path: Path, prompts: list[list[int]], n: int, ctx: int, threads: int) -> tuple[list, dict] | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    out = []
    for ids in prompts:
        # generate() would keep the KV of a prefix shared with the previous prompt (the chat template's system
        # prompt); reset first so each prompt is one whole prefill, like the engine's
        llm.reset()
        toks = []
        for tk in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            toks.append(int(tk))
            if len(toks) == n:
                break
        out.append(toks)
    info = {"total_s": time.perf_counter() - t0, "version": llama_cpp.__version__}
    del llm
    gc.collect()
    return out, info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--weights", help="comma list of engine weight modes (default: Stage.load's default, f32)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"the first N of {len(PROMPTS)} prompts")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    a = ap.parse_args()
    from engine.chat import render_prompt
    from engine.sources import default_model_path
    from engine.tokenizer import Tokenizer
    model = a.model or default_model_path()
    default = default_weights_mode()
    modes = list(dict.fromkeys(a.weights.split(",") if a.weights else [default, "f32"]))
    tok = Tokenizer.from_gguf(model)
    chosen = PROMPTS[:a.prompts]
    prompts = [tok.encode(render_prompt(tok, text, mode="auto" if chat else "raw")) for _, chat, text in chosen]
    print(f"model {model.name}, {len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
          f"{a.tokens} new tokens each, greedy; Stage.load default weights={default!r}; comparing {modes}; "
          f"{a.threads} threads")

    tokens: dict[str, list[list[int]]] = {}
    tops: dict[str, list[list[dict[int, float]]]] = {}
    for mode in modes:
        tokens[mode], tops[mode], info = run_engine(model, prompts, a.tokens, mode, a.ctx)
        print(f"engine {mode:5s}: load {info['load_s']:.1f} s, all prompts {info['total_s']:.1f} s, "
              f"weights {info['weight_mb']:.0f} MB")
    ll = run_llama_cpp(model, prompts, a.tokens, a.ctx, a.threads)
    if ll is None:
        print(f"{LLAMA}: skipped, llama-cpp-python is not installed in this interpreter ({sys.executable})")
    else:
        tokens[LLAMA], info = ll
        print(f"{LLAMA} {info['version']}: all prompts {info['total_s']:.1f} s")

    print()
    for line in report([(name, chat, len(ids)) for (name, chat, _), ids in zip(chosen, prompts)], tokens, tops,
                       a.tokens, tok.decode):
        print(line)

if __name__ == "__main__":
    main()
