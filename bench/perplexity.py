"""Perplexity of the engine's CPU numerics against llama.cpp's on the same text and windows (not a test).

    .venv/bin/python bench/perplexity.py [--model PATH] [--text FILE] [--window 128] [--windows 8]
    MESH_CPU_INT8=0 .venv/bin/python bench/perplexity.py ...      (f32 activations, for an A/B)

Greedy agreement (bench/fidelity.py) counts how long two paths pick the same tokens, which near ties decide; this
measures what a numerics change costs the model's predictions: the text (default: this repository's README.md) is
tokenized once, cut into --windows windows of --window tokens (each led by BOS where the model's tokenizer adds it),
and each window is run from an empty cache; the
perplexity is exp of the mean negative log-likelihood of every next token inside the windows. The engine's run is
one unsharded stage with the process's settings (MESH_CPU_INT8 picks the activations); llama.cpp (llama-cpp-python,
if it imports) evaluates the same windows with logits for every position.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.gguf_meta import read_model_meta  # noqa: E402
from engine.sources import default_model_path  # noqa: E402
from engine.stage import Column, Stage  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402


def nll(logits: np.ndarray, targets: list[int]) -> list[float]:
    """Negative log-likelihood of each target under its row of logits (float64 log-softmax)."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return [-float(logp[i, t]) for i, t in enumerate(targets)]


def windows(ids: list[int], size: int, n: int, bos: int | None) -> list[list[int]]:
    """n windows of `size` tokens; each starts with the model's BOS where its tokenizer adds one (Gemma's logits
    without it are far off for every path), followed by size - 1 tokens of the text."""
    step = size - (bos is not None)
    out = [([bos] if bos is not None else []) + ids[i:i + step] for i in range(0, len(ids) - step + 1, step)][:n]
    if len(out) < n:
        raise SystemExit(f"the text gives {len(out)} windows of {size} tokens, {n} asked")
    return out


def engine_nll(model: Path, wins: list[list[int]]) -> list[float]:
    st = Stage.load(model, 0, read_model_meta(model).n_layers, n_slots=1, max_context=len(wins[0]))
    out: list[float] = []
    for w in wins:
        st.reset()
        logits = st.step_logits([Column(i, 0, True, t) for i, t in enumerate(w)])
        out += nll(logits[:-1], w[1:])
    return out


def llama_nll(model: Path, wins: list[list[int]], threads: int) -> list[float] | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=len(wins[0]), n_threads=threads, n_threads_batch=threads,
                          logits_all=True, verbose=False)
    out: list[float] = []
    for w in wins:
        llm.reset()
        llm.eval(w)
        out += nll(np.array(llm.scores[:len(w)], dtype=np.float32)[:-1], w[1:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--text", type=Path, default=Path(__file__).resolve().parent.parent / "README.md")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--skip-llama", action="store_true")
    a = ap.parse_args()
    model = a.model or default_model_path()
    tok = Tokenizer.from_gguf(model)
    text_ids = tok.encode(a.text.read_text())
    if tok.add_bos and text_ids and text_ids[0] == tok.bos_id:
        text_ids = text_ids[1:]
    wins = windows(text_ids, a.window, a.windows, tok.bos_id if tok.add_bos else None)
    eng = engine_nll(model, wins)
    print(f"model {model.name}, {a.windows} windows of {a.window} tokens from {a.text.name}, "
          f"MESH_CPU_INT8={os.environ.get('MESH_CPU_INT8', 'default')}")
    print(f"engine    perplexity {math.exp(np.mean(eng)):.4f}")
    ll = None if a.skip_llama else llama_nll(model, wins, a.threads)
    if ll is not None:
        diff = np.abs(np.array(eng) - np.array(ll))
        print(f"llama.cpp perplexity {math.exp(np.mean(ll)):.4f}; per-token |nll difference| mean {diff.mean():.4f}, "
              f"max {diff.max():.4f}")


if __name__ == "__main__":
    main()
