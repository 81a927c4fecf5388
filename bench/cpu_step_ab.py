"""CPU decode-step variants side by side in one process: a copy of the stage per variant, each loaded under its own
settings (those read when kernels are built: MESH_CPU_PREFETCH, MESH_CPU_ATTN_PREFETCH, MESH_CPU_INT8...), their
captured decode steps run by the step runner alone (no Python around it), alternating.

    .venv/bin/python bench/cpu_step_ab.py --variant off=MESH_CPU_PREFETCH=0 --variant on= [--width 8] [--prompt 64]
                                          [--rounds 8] [--kernels]

A variant is NAME=KEY=VALUE[;KEY=VALUE...] (an empty list: the defaults). Every copy holds the same --width + 1 slots,
each prefilled with --prompt tokens; each round times, for widths 1 and --width, every variant's captured step
(bench/batch_profile.py `runner_time`, the median of 20 runs), the variants' order reversed every other round. Prints
the medians over the rounds, and with --kernels each kernel kind alone (warm, 10 in a row). Why not
bench/decode_ab.py: that one times `Stage.step` (Python, the argmax and copies included) on one stage whose kernels
are rebuilt per variant; on this 2-core VM the runner alone is the least noisy figure of a step's kernels, and a
copy per variant keeps each one's program and memory as a loaded stage has them.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.batch_profile import CONTEXT, kernel_times, runner_time  # noqa: E402
from common.values import Sampling  # noqa: E402
from engine.gguf_meta import read_model_meta  # noqa: E402
from engine.sources import default_model_path  # noqa: E402
from engine.stage import Column, Stage  # noqa: E402


def variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, settings = text.partition("=")
    pairs = [kv.partition("=") for kv in settings.split(";") if kv]
    if not name or any(not k or not sep for k, sep, _ in pairs):
        raise SystemExit(f"--variant {text!r}: expected NAME=KEY=VALUE[;KEY=VALUE...] or NAME=")
    return name, {k: v for k, _, v in pairs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--variant", action="append", type=variant, required=True)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64, help="tokens each slot holds (serving decodes at ~40-100)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--kernels", action="store_true", help="also each kernel kind alone")
    a = ap.parse_args()
    model, W, P = a.model or default_model_path(), a.width, a.prompt
    if P + 1 > CONTEXT:
        raise SystemExit(f"--prompt {P}: at most {CONTEXT - 1}")
    print(f"model {model.name}, widths 1 and {W}, {P} tokens a slot, cores {os.cpu_count()}, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    stages = {}
    for name, settings in a.variant:
        before = {k: os.environ.get(k) for k in settings}
        os.environ.update(settings)
        try:
            st = Stage.load(model, 0, read_model_meta(model).n_layers, n_slots=W + 1, max_context=CONTEXT)
            st.warmup(decode_batch=W)
            for s in range(W + 1):
                for c in range(0, P, 64):
                    st.step([Column(i, s, i == P - 1, 1 + i + s) for i in range(c, min(c + 64, P))], None, Sampling())
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        stages[name] = st
    runner = {w: {n: [] for n in stages} for w in (1, W)}
    kinds = {w: {n: collections.defaultdict(list) for n in stages} for w in (1, W)}
    for r in range(a.rounds):
        order = list(stages.items()) if r % 2 == 0 else list(stages.items())[::-1]
        for w in (1, W):
            for name, st in order:
                runner[w][name].append(runner_time(st, w, P))
                if a.kernels:
                    for k, (t, _) in kernel_times(st, w, P).items():
                        kinds[w][name][k].append(t)
    first = next(iter(stages))
    for w in (1, W):
        base = statistics.median(runner[w][first])
        print(f"{w} column{'s' if w > 1 else ''}, runner alone (ms, median of {a.rounds} rounds): " + "  ".join(
            f"{n} {statistics.median(v) * 1e3:.3f}" + ("" if n == first else f" ({statistics.median(v) / base:.3f}x)")
            for n, v in runner[w].items()))
        if a.kernels:   # every kind any variant has (a variant may fuse one away: "-")
            every = {k for n in stages for k in kinds[w][n]}
            cost = lambda n, k: statistics.median(kinds[w][n][k]) if kinds[w][n].get(k) else 0.0  # noqa: E731
            for k in sorted(every, key=lambda k: -max(cost(n, k) for n in stages)):
                print(f"  {k:<24s} " + "  ".join(f"{n} {cost(n, k) * 1e3:.3f}" if kinds[w][n].get(k) else f"{n} -"
                                                 for n in stages))
    print(f"load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
