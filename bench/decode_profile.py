"""Where a decode step's GPU time goes: one step of a whole model run without the jit under tinygrad's DEBUG=2 (each
kernel timed on the device, synchronized), summed per kernel kind, with GB/s of the matvecs' weight bytes.

    DEV=CUDA python3 bench/decode_profile.py --model m.gguf [--pos 16]

The sum is GPU time alone: a jitted step adds its launch gaps on top (compare with engine_bench's step time).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--pos", type=int, default=16, help="tokens in the cache before the profiled step")
    a = ap.parse_args()
    from tinygrad import Device
    from tinygrad.helpers import Context
    from engine.gguf_meta import read_gguf
    from engine.stage import Column, Stage
    g = read_gguf(a.model)
    layers = next(int(v) for k, v in g.kv.items() if k.endswith(".block_count"))
    t0 = time.perf_counter()
    stage = Stage.load(a.model, 0, layers, n_slots=1, max_context=max(64, a.pos + 8), jit=False)
    print(f"load {time.perf_counter() - t0:.1f} s", flush=True)
    stage.step([Column(i, 0, i == a.pos - 1, 1 + i) for i in range(a.pos)])
    stage.step([Column(a.pos, 0, True, 7)])  # compiles the decode step's kernels
    Device[Device.DEFAULT].synchronize()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), Context(DEBUG=2):
        stage.step([Column(a.pos + 1, 0, True, 9)])
    per, count, nbytes = defaultdict(float), defaultdict(int), {}
    for line in ANSI.sub("", buf.getvalue()).splitlines():
        if (m := LINE.search(line)):
            k, nbytes[k] = kind(m.group(1))
            per[k] += float(m.group(2)) * UNITS[m.group(3)]
            count[k] += 1
    total = sum(per.values())
    print(f"one decode step at position {a.pos + 1}: {sum(count.values())} kernels, {total * 1e3:.3f} ms of GPU time")
    for k, s in sorted(per.items(), key=lambda kv: -kv[1]):
        bw = f"{nbytes[k] * count[k] / s / 1e9:6.0f} GB/s" if nbytes[k] else ""
        print(f"  {k:44s} x{count[k]:4d} {s * 1e3:8.3f} ms {100 * s / total:5.1f}%  "
              f"{s / count[k] * 1e6:8.1f} us each {bw}")


if __name__ == "__main__":
    main()
