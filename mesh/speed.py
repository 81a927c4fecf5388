"""A peer measures its own stage: ms per layer of a decode step and of a prefill chunk, on its real device.

Measured right after a load that warmed up (the step shapes are compiled, so the steps time compute, not
tinygrad's compiler), on scratch data in slot 0, which is cleared again afterwards (`reset`): the session sees the
stage exactly as a load leaves it. One figure per device and model, kept on disk (`SpeedCache`): a peer measures a
model once, and later sessions plan from the file before anything is loaded. The coordinator asks a peer that has no
figure yet to load a one-layer probe range first (mesh/coordinator.py), which this then measures.

The figures (planner.StageSpeed):
- step_ms: the worker's round trip for a command that computes nothing (a Rollback): what a step costs whatever
  its layers;
- decode_ms_per_layer: (median one-column decode step - step_ms) / layers (at least 1% of the step: never 0,
  which on the wire means "not measured");
- prefill_ms_per_layer: (a 16-column prefill chunk - step_ms) / layers (the engine's prefill chunk, PREFILL_BUCKETS).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import time
from pathlib import Path

import numpy as np

from engine.stage import Column, Sampling
from mesh.planner import StageSpeed

DECODE_REPEATS = 3
PREFILL_COLUMNS = 16
# test-only: the worker sleeps this many ms per layer in every step (engine/worker_main.py), a peer slowed on purpose
SLOW_ENV = "MESH_TEST_SLOW_MS_PER_LAYER"


async def measure_stage(worker, *, start: int, end: int, dim: int, act_dtype, clock=time.perf_counter) -> StageSpeed:
    """Time the loaded stage of `worker` (an engine.worker.Worker right after a warmed-up load), then reset it."""
    first, last, layers = start == 0, worker.last, end - start

    def hidden(n: int) -> np.ndarray | None:
        return None if first else np.zeros((n, dim), dtype=act_dtype)

    async def timed(call) -> float:
        t0 = clock()
        await call()
        return (clock() - t0) * 1000

    sampling = Sampling()
    decode_cols = [Column(0, 0, last, 0)]
    prefill_cols = [Column(p, 0, last and p == PREFILL_COLUMNS - 1, 0) for p in range(PREFILL_COLUMNS)]
    try:
        await worker.step(decode_cols, hidden(1), sampling)          # the first run of a shape may pay one-time costs
        step_ms = statistics.median([await timed(lambda: worker.rollback(0, 0)) for _ in range(5)])
        decode = statistics.median([await timed(lambda: worker.step(decode_cols, hidden(1), sampling))
                                    for _ in range(DECODE_REPEATS)])
        await worker.step(prefill_cols, hidden(PREFILL_COLUMNS), sampling)
        prefill = await timed(lambda: worker.step(prefill_cols, hidden(PREFILL_COLUMNS), sampling))
    finally:
        await worker.reset()
    # A stage whose compute hides in the round trip's noise (a tiny model) still gets a figure above zero: 0 means
    # "not measured" on the wire.
    return StageSpeed(max(decode - step_ms, 0.01 * decode) / layers, max(prefill - step_ms, 0.01 * prefill) / layers,
                      step_ms)


def _key_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:48] or "_"


class SpeedCache:
    """Figures per (model identity, device) in `<cache>/speed/`, one small JSON file each."""

    def __init__(self, root: Path):
        self.dir = Path(root) / "speed"

    def _path(self, identity: str, device: str) -> Path:
        slow = os.environ.get(SLOW_ENV)
        tag = f"-slow{_key_part(slow)}" if slow else ""     # a test's slowed peer never reads a normal figure
        return self.dir / f"{_key_part(identity[:32])}-{_key_part(device)}{tag}.json"

    def get(self, identity: str, device: str) -> StageSpeed | None:
        try:
            d = json.loads(self._path(identity, device).read_text())
            speed = StageSpeed(float(d["decode_ms_per_layer"]), float(d["prefill_ms_per_layer"]), float(d["step_ms"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None          # none yet, or unreadable: measured again at the next warmed-up load
        if not all(v >= 0 and v == v and v != float("inf") for v in (speed.decode_ms_per_layer,
                                                                       speed.prefill_ms_per_layer, speed.step_ms)):
            return None
        return speed

    def put(self, identity: str, device: str, speed: StageSpeed, layers: tuple[int, int]) -> None:
        path = self._path(identity, device)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"decode_ms_per_layer": speed.decode_ms_per_layer,
                                   "prefill_ms_per_layer": speed.prefill_ms_per_layer, "step_ms": speed.step_ms,
                                   "measured_on_layers": list(layers), "when": time.time()}))
        os.replace(tmp, path)
