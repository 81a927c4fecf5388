"""Decode-step variants side by side in one process, on one loaded stage: settings read when a step's kernels are
built (MESH_GPU_MV, MESH_GPU_MV_SMALL, MESH_FUSE_GLU, JIT_BATCH_SIZE...) compared without reloading the weights
(the 8B shape takes 10-60 s to load) and without the drift of a changing machine (rounds interleave the variants).

    DEV=CUDA python3 bench/decode_ab.py --model m.gguf --variant base= --variant small512=MESH_GPU_MV_SMALL=8,512 \
        --variant jb8=JIT_BATCH_SIZE=8 [--rounds 3 --steps 20]

A variant is NAME=KEY=VALUE[;KEY=VALUE...] (an empty setting list: the defaults). Each variant's decode step is
captured once (its own jit, input buffers and kernels) after a 16-token prompt; then each round times --steps
`Stage.step` calls of every variant in turn, continuing the same sequence (the KV cache is shared, so every
variant attends over the same, growing context). Prints each variant's median step per round and overall, its
tokens/s, and the largest difference of its logits to the first variant's at one more position, which each variant
computes in turn (layouts change float sums, so a small difference is expected, a large one is a bug).
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
    t0 = time.perf_counter()
    stage = Stage.load(a.model, 0, layers, n_slots=1, max_context=64 + len(variants) * (a.rounds * a.steps + 2) + 16)
    print(f"{Device.DEFAULT}: load {time.perf_counter() - t0:.1f} s", flush=True)
    stage.step([Column(i, 0, i == 15, 1 + i) for i in range(16)])
    pos, state, logits = 16, {}, {}
    for name, settings in variants.items():  # each variant's decode shape captured (and run once)
        apply(settings, defaults)
        stage._jits, stage._inputs, stage._replays = {}, {}, {}
        t = time.perf_counter()
        stage.step_logits([Column(pos, 0, True, 7)])
        pos += 1
        print(f"variant {name} {settings or '(defaults)'}: captured in {time.perf_counter() - t:.1f} s", flush=True)
        state[name] = (stage._jits, stage._inputs, stage._replays)
    times: dict[str, list[list[float]]] = {n: [] for n in variants}
    for r in range(a.rounds):
        for name in variants:
            stage._jits, stage._inputs, stage._replays = state[name]
            ts = []
            for i in range(a.steps):
                t = time.perf_counter()
                stage.step_logits([Column(pos, 0, True, 7 + i)])
                ts.append(time.perf_counter() - t)
                pos += 1
            times[name].append(ts)
        Device[Device.DEFAULT].synchronize()
    for name in variants:  # the same position and token for every variant (each rewrites it)
        stage._jits, stage._inputs, stage._replays = state[name]
        logits[name] = stage.step_logits([Column(pos, 0, True, 5)])
    first = next(iter(variants))
    for name, rounds in times.items():
        meds = [statistics.median(ts) * 1e3 for ts in rounds]
        allm = statistics.median([x for ts in rounds for x in ts]) * 1e3
        diff = float(np.abs(logits[name] - logits[first]).max()) if name != first else 0.0
        print(f"{name:12s} median step {allm:7.3f} ms ({1e3 / allm:6.1f} tok/s); rounds "
              + " ".join(f"{m:.3f}" for m in meds) + f"; logits vs {first}: max |diff| {diff:.3g}")


if __name__ == "__main__":
    main()
