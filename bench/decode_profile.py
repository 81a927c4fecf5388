"""Where a decode step's time goes, on a GPU: the jitted step taken apart, then each kernel's GPU time.

    DEV=CUDA python3 bench/decode_profile.py --model m.gguf [--pos 16] [--kernels] [--batch B]

1. The jitted decode step as `Stage.step` runs it (median of --steps), and its parts timed one after another:
   host inputs (embedding row, rope tables, three raw copies in), the jit call until it returns (graph parameter
   updates and launches: host time), the wait for the GPU, the logits copied out, the token picked. Then the jit
   called back to back without waiting: per call that is max(host launch time, GPU time), so if it is close to
   the call's own host time the step is bound by the host, not the GPU.
2. With --ncu (under `ncu --profile-from-start off --metrics gpu__time_duration.sum --csv`): only --steps jitted
   decode steps are profiled (cuProfilerStart/Stop around them); `--summarize CSV` then sums ncu's kernel durations
   per kernel kind and step: true GPU times, no launch latency, so the sum against the back-to-back time is the
   cost of the gaps between kernels.
3. With --kernels: one step without the jit under tinygrad's DEBUG=2 (each kernel timed on the device,
   synchronized), summed per kernel kind, with GB/s of the matvecs' weight bytes. Every kernel's time there
   includes ~10-20 us of launch latency: read the ranking and the count, not the sum.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
LINE = re.compile(r"\*\*\*\s+\S+\s+\d+\s+(\S+).*?tm\s+([\d.]+)(us|ms|s)/")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def kind(name: str) -> tuple[str, int]:
    """(kind, weight bytes): a matvec's kind is its type and shape (mv_<type>_<G>x<il>_<blocks>_...)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
    m = re.match(r"mv_([a-z0-9]+_[a-z0-9]+|[a-z0-9]+)_(\d+)x(\d+)_(\d+)", name)
    if not m or m.group(1).upper() not in Q.__members__:
        return re.sub(r"\d+", "#", name)[:40], 0
    rows, nb = int(m.group(2)) * int(m.group(3)), int(m.group(4))
    return f"mv_{m.group(1)} {rows}x{nb}b", rows * nb * GGML_QUANT_SIZES[Q[m.group(1).upper()]][1]


def jit_parts(stage, pos: int, steps: int) -> None:
    """The decode step's parts, each timed (ms, medians over `steps`)."""
    import numpy as np
    from tinygrad import Device
    from engine.loader import write_into
    from engine.model import rope_inputs
    from engine.sampling import Sampling, pick_token
    from engine.stage import Column, _copy_out
    dev = Device[Device.DEFAULT]
    walls = []
    for i in range(steps):
        t = time.perf_counter()
        stage.step([Column(pos + i, 0, True, 7 + i)])
        walls.append(time.perf_counter() - t)
    pos += steps
    shape = next(k for k in stage._jits if k[0] == 1 and len(k[1]) == 1)
    fn, inputs = stage._jits[shape], stage._inputs[shape]
    from tinygrad.uop.ops import Ops
    calls = fn.captured.linear.src
    graphs = sum(c.src[0].op is Ops.CUSTOM_FUNCTION and c.src[0].arg == "graph" for c in calls)
    parts = defaultdict(list)
    for i in range(steps):
        p = pos + i
        binds = [stage._vslot[0].bind(0), stage._vpos[0].bind(p), stage._vctx.bind(p + 1)]  # as Stage._run binds
        if shape[2] != -1:
            from tinygrad import UOp
            binds.append(UOp.variable("pick0", 0, 0).bind(0))
        t0 = time.perf_counter()
        x = stage._embed.lookup(np.array([5 + i]))
        cos, sin = rope_inputs(stage.meta, np.array([p]))
        for t, a in zip(inputs, (x, cos, sin)):
            write_into(t, a)
        t1 = time.perf_counter()
        result = fn(*inputs, *binds)
        t2 = time.perf_counter()
        dev.synchronize()
        t3 = time.perf_counter()
        out = _copy_out(result)
        t4 = time.perf_counter()
        pick_token(out[0], Sampling(), p)
        t5 = time.perf_counter()
        for k, v in (("inputs", t1 - t0), ("jit call returns", t2 - t1), ("wait for the GPU", t3 - t2),
                     ("logits out", t4 - t3), ("pick", t5 - t4), ("sum", t5 - t0)):
            parts[k].append(v * 1e3)
    binds = [stage._vslot[0].bind(0), stage._vpos[0].bind(pos), stage._vctx.bind(pos + 1)]
    if shape[2] != -1:
        from tinygrad import UOp
        binds.append(UOp.variable("pick0", 0, 0).bind(0))
    dev.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fn(*inputs, *binds)
    dev.synchronize()
    b2b = (time.perf_counter() - t) / steps * 1e3
    print(f"jitted decode step at position {pos}: Stage.step median {statistics.median(walls) * 1e3:.3f} ms "
          f"({1 / statistics.median(walls):.1f} tok/s), {len(calls)} calls of which {graphs} graphs; "
          f"the parts, medians of {steps}:")
    for k, v in parts.items():
        print(f"  {k:18s} {statistics.median(v):8.3f} ms")
    print(f"  jit back to back   {b2b:8.3f} ms a call (max of host launch and GPU time)")


def wide_parts(stage, step, p: int, steps: int, cprofile: bool) -> None:
    """A B-column step split into the wait for its output (engine.stage._copy_out: the GPU's time not hidden behind
    the host's launch, plus the copy) and the rest (the host's Python and the jit call's launches), medians of
    `steps`; then the same steps under cProfile (where the host's part goes), top functions by own time."""
    import engine.stage as st
    orig, waits = st._copy_out, []

    def timed(t):
        t0 = time.perf_counter()
        try:
            return orig(t)
        finally:
            waits.append(time.perf_counter() - t0)
    st._copy_out = timed
    walls = []
    try:
        for i in range(steps):
            t0, n = time.perf_counter(), len(waits)
            step(p + i)
            walls.append(time.perf_counter() - t0)
            if len(waits) == n:     # a step that copied nothing out this way (the CPU's raw replay)
                waits.append(0.0)
    finally:
        st._copy_out = orig
    wall, wait = statistics.median(walls) * 1e3, statistics.median(waits) * 1e3
    host = statistics.median(w - x for w, x in zip(walls, waits)) * 1e3
    print(f"  step {wall:.3f} ms: host before the output's wait {host:.3f} ms, the wait (GPU left + copy) {wait:.3f} ms")
    if cprofile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for i in range(steps):
            step(p + steps + i)
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
        print(f"  cProfile of {steps} steps (times are totals over them):")
        print("\n".join(ln for ln in out.getvalue().splitlines() if ln.strip())[:6000])


def kernels(stage, pos: int) -> None:
    from tinygrad import Device
    from tinygrad.helpers import Context
    from engine.stage import Column
    stage._use_jit = False
    stage._jits.clear()  # else the captured step runs
    stage._replays.clear()
    stage._direct.clear()
    stage.step([Column(pos, 0, True, 7)])  # compiles the unjitted step's kernels
    Device[Device.DEFAULT].synchronize()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), Context(DEBUG=2):
        stage.step([Column(pos + 1, 0, True, 9)])
    per, count, nbytes = defaultdict(float), defaultdict(int), {}
    for line in ANSI.sub("", buf.getvalue()).splitlines():
        if (m := LINE.search(line)):
            k, nbytes[k] = kind(m.group(1))
            per[k] += float(m.group(2)) * UNITS[m.group(3)]
            count[k] += 1
    total = sum(per.values())
    print(f"one decode step at position {pos + 1}, no jit: {sum(count.values())} kernels, {total * 1e3:.3f} ms of GPU time")
    for k, s in sorted(per.items(), key=lambda kv: -kv[1]):
        bw = f"{nbytes[k] * count[k] / s / 1e9:6.0f} GB/s" if nbytes[k] else ""
        print(f"  {k:44s} x{count[k]:4d} {s * 1e3:8.3f} ms {100 * s / total:5.1f}%  "
              f"{s / count[k] * 1e6:8.1f} us each {bw}")


def summarize(csv_path: str, steps: int) -> None:
    """ncu's CSV (one gpu__time_duration row per kernel) summed per kernel kind, per decode step."""
    import csv
    per, count, nbytes = defaultdict(float), defaultdict(int), {}
    scale = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3, "second": 1.0, "s": 1.0}
    with open(csv_path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        k, nbytes[k] = kind(row["Kernel Name"].split("(")[0].strip())
        per[k] += float(row["Metric Value"].replace(",", "")) * scale[row["Metric Unit"]]
        count[k] += 1
    total = sum(per.values()) / steps
    print(f"ncu: {sum(count.values()) / steps:.0f} kernels a decode step, {total * 1e3:.3f} ms of kernel time a step")
    for k, s in sorted(per.items(), key=lambda kv: -kv[1]):
        bw = f"{nbytes[k] * count[k] / s / 1e9:6.0f} GB/s" if nbytes[k] else ""
        print(f"  {k:44s} x{count[k] / steps:5.0f} {s / steps * 1e3:8.3f} ms {100 * s / steps / total:5.1f}%  "
              f"{s / count[k] * 1e6:8.2f} us each {bw}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--pos", type=int, default=16, help="tokens in the cache before the profiled steps")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kernels", action="store_true", help="also each kernel's GPU time, one step without the jit")
    ap.add_argument("--ncu", action="store_true", help="profile only --steps decode steps (cuProfilerStart/Stop)")
    ap.add_argument("--summarize", metavar="CSV", help="sum an ncu CSV of --ncu per kernel kind, then exit")
    ap.add_argument("--batch", type=int, default=1, help="columns a decode step (a slot each); over 1 only --ncu "
                    "and --kernels run")
    ap.add_argument("--spread", type=int, default=0, help="batch > 1: slot s holds pos + s * spread tokens (streams "
                    "of different lengths, as serving has them) instead of pos each")
    ap.add_argument("--ctx", type=int, default=0, help="the stage's max_context (default: what the steps need, 256 "
                    "at least; serve_bench's stage has 512)")
    ap.add_argument("--cprofile", action="store_true", help="batch > 1: cProfile of the timed steps (the host's "
                    "Python of Stage.step, the GPU wait inside _copy_out), top functions")
    a = ap.parse_args()
    if a.summarize:
        return summarize(a.summarize, a.steps)
    from tinygrad import Device
    from engine.gguf_meta import read_gguf
    from engine.stage import Column, Stage
    g = read_gguf(a.model)
    layers = next(int(v) for k, v in g.kv.items() if k.endswith(".block_count"))
    t0 = time.perf_counter()
    B = a.batch
    lens = [a.pos + s * a.spread for s in range(B)]  # each slot's prompt
    stage = Stage.load(a.model, 0, layers, n_slots=B, max_context=a.ctx or max(256, max(lens) + 3 * a.steps + 8))
    print(f"{Device.DEFAULT}: load {time.perf_counter() - t0:.1f} s", flush=True)
    stage.warmup()
    for s in range(B):
        stage.step([Column(i, s, i == lens[s] - 1, 1 + i + s) for i in range(lens[s])])
    def step(p: int) -> None:  # one decode step of B columns, a slot each (slot s at lens[s] - pos + p)
        stage.step([Column(lens[s] - a.pos + p, s, True, 7 + s) for s in range(B)])
    if a.ncu:
        import ctypes
        cu = ctypes.CDLL("libcuda.so.1")
        for i in range(3):
            step(a.pos + i)
        Device[Device.DEFAULT].synchronize()
        cu.cuProfilerStart()
        for i in range(a.steps):
            step(a.pos + 3 + i)
        Device[Device.DEFAULT].synchronize()
        cu.cuProfilerStop()
        return
    if B == 1:
        jit_parts(stage, a.pos, a.steps)
    else:
        for i in range(3):
            step(a.pos + i)
        Device[Device.DEFAULT].synchronize()
        t = time.perf_counter()
        for i in range(a.steps):
            step(a.pos + 3 + i)
        dt = (time.perf_counter() - t) / a.steps
        print(f"jitted decode step of {B} columns at position {a.pos + 3}"
              f"{f' (spread {a.spread}: up to {lens[-1] + 3})' if a.spread else ''}: {dt * 1e3:.3f} ms "
              f"({B / dt:.1f} tok/s in all)")
        wide_parts(stage, step, a.pos + 3 + a.steps, a.steps, a.cprofile)
    if a.kernels and B == 1:
        kernels(stage, stage.slot_length(0))


if __name__ == "__main__":
    main()
