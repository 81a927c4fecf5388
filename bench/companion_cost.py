"""What batch invariance costs one user: the scheduler gives a lone decode step a companion column in a scratch slot
(so a sequence decoded alone runs the same kernels as in a batch, NOTES "Scheduler"). This times one decode step of
one column against the same step with a companion, alternating, on the real model (default: the bundled SmolLM2).

    .venv/bin/python bench/companion_cost.py [--model PATH] [--rounds 40]
"""
from __future__ import annotations

import argparse
import statistics
import time

from engine.sources import default_model_path
from engine.stage import Column, Sampling, Stage


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    model = args.model or default_model_path()
    from engine.gguf_meta import read_model_meta
    depth = read_model_meta(model).n_layers
    st = Stage.load(model, 0, depth, n_slots=5, max_context=512)
    st.warmup(decode_batch=2)
    greedy = Sampling()
    for slot in (0, 4):                                  # a 4-token prompt in the user's slot and the scratch slot
        st.step([Column(i, slot, i == 3, 1 + i) for i in range(4)], None, greedy)
    alone, paired, pos = [], [], 4
    for _ in range(args.rounds):
        t = time.perf_counter()
        st.step([Column(pos, 0, True, 5)], None, greedy)
        alone.append(time.perf_counter() - t)
        t = time.perf_counter()
        st.step([Column(pos, 0, True, 5), Column(pos, 4, True, 5)], None, [greedy, greedy])
        paired.append(time.perf_counter() - t)
        pos += 1
    a, p = statistics.median(alone) * 1e3, statistics.median(paired) * 1e3
    print(f"{model}: one column {a:.2f} ms, with the companion {p:.2f} ms a step: {p / a:.2f}x "
          f"({args.rounds} alternating rounds, medians)")


if __name__ == "__main__":
    main()
