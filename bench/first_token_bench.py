"""First-token latency with and without the load-time warmup (not a test).

    .venv/bin/python bench/first_token_bench.py [--model PATH] [--lengths 64,100] [--warmup 1] [--ctx 2048]

One unsharded stage of the model (SmolLM2 by default) in this process: load, then `Stage.warmup` (compiles the
decode step of 1..--warmup sequences and the prefill chunks; 0 skips it, as does a tree without `Stage.warmup`),
then one prompt of each --lengths in turn (slot 0, reset between), each as one step like the engine's callers, or
in pieces of --chunk columns like the coordinator; for each the time to its first token and of the first decode
step after it. With no warmup the first prompt of a new length pays tinygrad's scheduling and compiling.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("MESH_TREE") or str(Path(__file__).resolve().parents[1]))
from common.memory import status_kb  # noqa: E402

TEXT = ("The sea was calm that morning, and the fishing boats left the harbour one after another while the gulls "
        "circled above the masts. Old Tomas watched them from the pier, remembering the winters when the storms had "
        "kept everyone ashore for weeks, the nets drying in the sheds and the children listening to stories by the "
        "stove. Now the water glittered under a pale sky, and the only sound was the slow knock of the hulls against "
        "the wooden posts. He thought about his brother, who had sailed south many years ago and never written, and "
        "about the lighthouse keeper's daughter, who had taught him to read the clouds. ") * 8


def rss_mb() -> float:
    return status_kb("VmRSS") / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--lengths", default="64,100")
    ap.add_argument("--warmup", type=int, default=1, help="decode widths to compile at load; 0: no warmup")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--n-slots", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=0, help="send each prompt in pieces of this many columns")
    a = ap.parse_args()
    from engine.gguf_meta import read_model_meta
    from engine.stage import Column, Stage
    from engine.tokenizer import Tokenizer
    if a.model is None:
        from engine.sources import default_model_path
        a.model = default_model_path()
    ids = Tokenizer.from_gguf(a.model).encode(TEXT)
    t0 = time.perf_counter()
    stage = Stage.load(a.model, 0, read_model_meta(a.model).n_layers, n_slots=a.n_slots, max_context=a.ctx)
    print(f"{a.model.name}: load {time.perf_counter() - t0:.2f} s, RSS {rss_mb():.0f} MB", flush=True)
    if a.warmup and hasattr(stage, "warmup"):
        each, run = [], stage._run  # time each shape's compile: wrap the one-step runner warmup calls per shape

        def timed(x, runs, size, picks, **kw):
            t = time.perf_counter()
            try:
                return run(x, runs, size, picks, **kw)
            finally:
                each.append(f"{size}x{len(runs)}:{time.perf_counter() - t:.1f}s")
        stage._run = timed
        w = stage.warmup(decode_batch=a.warmup)
        del stage._run
        print(f"warmup: {w.shapes} shapes in {w.ms / 1e3:.2f} s ({' '.join(each)}; columns x runs), "
              f"RSS {rss_mb():.0f} MB", flush=True)
    else:
        print("warmup: none", flush=True)
    for n in (int(x) for x in a.lengths.split(",")):
        prompt = ids[:n]
        stage.reset()
        t = time.perf_counter()
        step = a.chunk or n
        for s in range(0, n, step):
            out = stage.step([Column(i, 0, i == n - 1, prompt[i]) for i in range(s, min(s + step, n))])
        first = time.perf_counter() - t
        t = time.perf_counter()
        stage.step([Column(n, 0, True, int(out[0]))])
        decode = time.perf_counter() - t
        print(f"prompt {n:4d} tokens: first token {first:6.2f} s, first decode step {decode:6.3f} s "
              f"(compiled shapes {len(stage._jits)}, RSS {rss_mb():.0f} MB)", flush=True)


if __name__ == "__main__":
    main()
