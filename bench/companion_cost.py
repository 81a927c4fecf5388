"""What batch invariance costs one user. Until 2026-12-02 the scheduler gave a lone decode step a companion column in
a scratch slot, because the one-column matvec and the several-column GEMM summed in different orders; now the CPU
matvec sums in the GEMM's order (NOTES Engine "Prefill GEMM"), so a lone column runs alone. On the real model
(default: the bundled SmolLM2), whole model in one process, this times, alternating:

    old      one decode column through the matvec of git revision --base (llama.cpp's order: not batch invariant)
    alone    one decode column through today's matvec (the GEMM's order: what a lone user of the service gets now)
    paired   the same column with a companion column (a 2-column GEMM step: what a lone user got before)

and checks that the lone column's logits are bitwise those of the same column in the paired step.

    .venv/bin/python bench/companion_cost.py [--model PATH] [--rounds 40] [--base 987f28f]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

os.environ["MESH_PROGRAM_CACHE"] = "0"  # two kernels under one code identity: never share compiled steps on disk
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _old_matvec(base: str):
    src = subprocess.check_output(["git", "-C", str(ROOT), "show", f"{base}:engine/quant.py"], text=True)
    old = types.ModuleType("quant_base")
    sys.modules["quant_base"] = old  # dataclasses look their module up
    exec(compile(src.replace("from .cpu_runner", "from engine.cpu_runner"), "quant_base.py", "exec"), old.__dict__)
    return old._matvec_kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--base", default="987f28f", help="a revision whose matvec summed in llama.cpp's order")
    args = ap.parse_args()
    from engine import quant
    from engine.gguf_meta import read_model_meta
    from engine.sources import default_model_path
    from engine.stage import Column, Sampling, Stage
    model = args.model or default_model_path()
    depth = read_model_meta(model).n_layers
    greedy = Sampling()
    prompt = [Column(i, s, i == 3, 1 + i) for s in (0, 1) for i in range(4)]  # a 4-token prompt in slots 0 and 1
    new_kernel, stages = quant._matvec_kernel, {}
    for tag, kernel in (("old", _old_matvec(args.base)), ("new", new_kernel)):
        quant._matvec_kernel = kernel  # matmul_t looks it up when a step's graph is built (load and warmup)
        st = Stage.load(model, 0, depth, n_slots=2, max_context=512)
        st.warmup(decode_batch=2)
        st.step(prompt, None, greedy)
        stages[tag] = st
    quant._matvec_kernel = new_kernel
    times: dict[str, list[float]] = {"old": [], "alone": [], "paired": []}
    equal, pos = True, 4
    for r in range(args.rounds):
        order = ("old", "alone", "paired") if r % 2 else ("paired", "alone", "old")
        for tag in order:
            st = stages["old" if tag == "old" else "new"]
            cols = [Column(pos, 0, True, 5)] + ([Column(pos, 1, True, 5)] if tag == "paired" else [])
            t = time.perf_counter()
            logits = st.step_logits(cols)
            times[tag].append(time.perf_counter() - t)
            if tag == "alone":
                lone = logits[0]
            elif tag == "paired":
                pair = logits[0]  # both write position pos of slot 0: the same token, the same bits
        equal &= lone.tobytes() == pair.tobytes()
        pos += 1
    m = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{model}: one decode column, medians of {args.rounds} alternating rounds: old matvec ({args.base}) "
          f"{m['old']:.2f} ms, today's matvec {m['alone']:.2f} ms ({m['alone'] / m['old']:.2f}x the old), "
          f"with a companion column {m['paired']:.2f} ms ({m['paired'] / m['alone']:.2f}x alone); lone column "
          f"bitwise equal to the same column in the 2-column step: {equal}")


if __name__ == "__main__":
    main()
