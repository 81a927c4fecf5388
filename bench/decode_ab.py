"""Decode-step variants side by side in one process, on one loaded stage: settings read when a step's kernels are
built (MESH_GPU_MV, MESH_GPU_MV_SMALL, MESH_FUSE_GLU, JIT_BATCH_SIZE...) compared without reloading the weights
(the 8B shape takes 10-60 s to load) and without the drift of a changing machine (rounds interleave the variants).

    DEV=CUDA python3 bench/decode_ab.py --model m.gguf --variant base= --variant small512=MESH_GPU_MV_SMALL=8,512 \
        --variant jb8=JIT_BATCH_SIZE=8 [--rounds 3 --steps 20] [--batch 16]

A variant is NAME=KEY=VALUE[;KEY=VALUE...] (an empty setting list: the defaults). Slot i holds a context of
--positions[i] tokens; each variant's decode step is captured once (its own jit, input buffers and kernels); then
each round times --steps decode steps of every variant in turn at each context length, every step rewriting the
same position (a step may start below a slot's length), so every variant is timed on the same contexts. Prints
each variant's median step per context length (overall and per round), its tokens/s, and the largest difference
of its logits to the first variant's at one position (layouts change float sums, so a small difference is
expected, a large one is a bug; with --greedy the step's token ids instead, from the shape already captured). With --batch B a step is B columns, one per slot, all at the same context length
(B slots a context length): the batched decode step a serving scheduler runs, and the first column's logits.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def apply(settings: dict[str, str], defaults: dict[str, tuple]) -> None:
    """The variant's settings, everything else as the process started (tinygrad's ContextVars too)."""
    from tinygrad.helpers import ContextVar
    for k, (env, var) in defaults.items():
        if env is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = env
        if k in ContextVar._cache:
            ContextVar._cache[k].value = var
    for k, v in settings.items():
        os.environ[k] = v
        if k in ContextVar._cache:
            ContextVar._cache[k].value = type(ContextVar._cache[k].value)(v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--positions", default="32,512", help="context lengths the steps are timed at (a slot each)")
    ap.add_argument("--batch", type=int, default=1, help="columns a step (B slots per context length)")
    ap.add_argument("--greedy", action="store_true", help="time Stage.step (a greedy token out, picked on the device "
                    "where MESH_DEVICE_ARGMAX allows) instead of step_logits (the logits out)")
    a = ap.parse_args()
    os.environ["MESH_PROGRAM_CACHE"] = "0"  # step templates on disk are keyed once per process: build each anew
    import numpy as np
    from tinygrad import Device
    from engine.gguf_meta import read_gguf
    from engine.stage import Column, Stage
    variants = {}
    for spec in a.variant:
        name, _, rest = spec.partition("=")
        variants[name] = dict(kv.split("=", 1) for kv in rest.split(";") if kv)
    keys = {k for s in variants.values() for k in s}
    from tinygrad.helpers import ContextVar
    defaults = {k: (os.environ.get(k), ContextVar._cache[k].value if k in ContextVar._cache else None) for k in keys}
    g = read_gguf(a.model)
    layers = next(int(v) for k, v in g.kv.items() if k.endswith(".block_count"))
    positions = [int(p) for p in a.positions.split(",")]
    t0 = time.perf_counter()
    B = a.batch
    stage = Stage.load(a.model, 0, layers, n_slots=len(positions) * B, max_context=max(positions) + 16)
    print(f"{Device.DEFAULT}: load {time.perf_counter() - t0:.1f} s", flush=True)
    for slot in range(len(positions) * B):  # slots i B .. i B + B - 1 hold a context of positions[i] tokens
        p = positions[slot // B]
        stage.step([Column(i, slot, i == p - 1, 1 + (i + slot) % 1000) for i in range(p)])
    cols = lambda k, p, tok: [Column(p, k * B + b, True, tok + b) for b in range(B)]  # a step at context k
    state, logits, on_device = {}, {}, {}
    run = stage.step if a.greedy else stage.step_logits
    for name, settings in variants.items():  # each variant's decode shape captured (and run once)
        apply(settings, defaults)
        stage._jits, stage._inputs, stage._replays, stage._direct = {}, {}, {}, {}
        on_device[name] = Device.DEFAULT != "CPU" and os.environ.get("MESH_DEVICE_ARGMAX", "1") != "0"
        stage.greedy_on_device = on_device[name]
        t = time.perf_counter()
        run(cols(0, positions[0], 7))
        print(f"variant {name} {settings or '(defaults)'}: captured in {time.perf_counter() - t:.1f} s", flush=True)
        state[name] = (stage._jits, stage._inputs, stage._replays, stage._direct)
    # every step rewrites the same position of its slot (a step may start below a slot's length), so each variant
    # is timed at the same context lengths
    times: dict[tuple[str, int], list[float]] = {(n, p): [] for n in variants for p in positions}
    for r in range(a.rounds):
        for name in variants:
            stage._jits, stage._inputs, stage._replays, stage._direct = state[name]
            stage.greedy_on_device = on_device[name]
            apply(variants[name], defaults)  # settings read per step (MESH_GPU_ROPE_WRITE)
            for slot, p in enumerate(positions):
                for i in range(a.steps):
                    t = time.perf_counter()
                    run(cols(slot, p, 7 + i))
                    times[(name, p)].append(time.perf_counter() - t)
        Device[Device.DEFAULT].synchronize()
    for name in variants:  # the same position and token for every variant
        stage._jits, stage._inputs, stage._replays, stage._direct = state[name]
        apply(variants[name], defaults)
        # greedy: the step's ids through the shape already captured (a logits shape would be one more capture per
        # variant); else the first column's logits
        logits[name] = np.asarray(run(cols(0, positions[0], 5)), np.float64) if a.greedy else \
            stage.step_logits(cols(0, positions[0], 5))[:1]
    first = next(iter(variants))
    for name in variants:
        diff = float(np.abs(logits[name] - logits[first]).max()) if name != first else 0.0
        cells = []
        for p in positions:
            ts = times[(name, p)]
            m = statistics.median(ts) * 1e3
            per_round = [statistics.median(ts[r * a.steps:(r + 1) * a.steps]) * 1e3 for r in range(a.rounds)]
            cells.append(f"at {p}: {m:7.3f} ms ({B * 1e3 / m:6.1f} tok/s; rounds " + " ".join(f"{x:.3f}" for x in per_round) + ")")
        print(f"{name:10s} " + "; ".join(cells) + f"; {'ids' if a.greedy else 'logits'} vs {first}: max |diff| {diff:.3g}")


if __name__ == "__main__":
    main()
