"""mesh.speed: what a peer measures of its stage and how it keeps the figure (a fake worker on a fake clock)."""
import numpy as np
import pytest

from mesh.planner import StageSpeed
from mesh.speed import SLOW_ENV, SpeedCache, measure_stage


class FakeWorker:
    """Costs 0.5 ms a call plus 2 ms per layer per decode column, 1.5 ms per layer per prefill column."""

    def __init__(self, layers: int, last: bool):
        self.layers, self.last, self.now, self.calls = layers, last, 0.0, []

    def clock(self) -> float:
        return self.now

    async def step(self, cols, hidden, sampling):
        self.calls.append(("step", len(cols), None if hidden is None else hidden.shape, cols[-1].needs_logits))
        per_col = 2.0 if len(cols) == 1 else 1.5
        self.now += (0.5 + self.layers * per_col * len(cols)) / 1000

    async def rollback(self, slot, pos):
        self.calls.append(("rollback", slot, pos))
        self.now += 0.5 / 1000

    async def reset(self):
        self.calls.append(("reset",))


async def test_measure_splits_the_fixed_step_cost_from_the_per_layer_cost():
    w = FakeWorker(layers=4, last=True)
    speed = await measure_stage(w, start=10, end=14, dim=8, act_dtype=np.float32, clock=w.clock)
    assert speed.step_ms == pytest.approx(0.5)
    assert speed.decode_ms_per_layer == pytest.approx(2.0)
    assert speed.prefill_ms_per_layer == pytest.approx(1.5 * 16)      # per layer, per 16-column chunk
    steps = [c for c in w.calls if c[0] == "step"]
    assert steps[0] == ("step", 1, (1, 8), True) and ("step", 16, (16, 8), True) in steps
    assert w.calls[-1] == ("reset",)                                  # the stage is left as a load leaves it


async def test_the_first_stage_steps_on_tokens_and_a_failure_still_resets():
    w = FakeWorker(layers=2, last=False)
    await measure_stage(w, start=0, end=2, dim=8, act_dtype=np.float32, clock=w.clock)
    assert all(c[2] is None and c[3] is False for c in w.calls if c[0] == "step")

    async def broken(*a):
        raise OSError("gone")
    w.step = broken
    with pytest.raises(OSError):
        await measure_stage(w, start=0, end=2, dim=8, act_dtype=np.float32, clock=w.clock)
    assert w.calls[-1] == ("reset",)


def test_cache_keeps_one_figure_per_model_and_device(tmp_path, monkeypatch):
    monkeypatch.delenv(SLOW_ENV, raising=False)
    cache = SpeedCache(tmp_path)
    fp = "ab" * 32
    assert cache.get(fp, "CPU") is None
    cache.put(fp, "CPU", StageSpeed(1.5, 20.0, 0.4), (14, 15))
    assert cache.get(fp, "CPU") == StageSpeed(1.5, 20.0, 0.4)
    assert cache.get(fp, "METAL") is None and cache.get("cd" * 32, "CPU") is None
    monkeypatch.setenv(SLOW_ENV, "30")                       # a slowed test peer has figures of its own
    assert cache.get(fp, "CPU") is None
    monkeypatch.delenv(SLOW_ENV)
    next(cache.dir.iterdir()).write_text('{"decode_ms_per_layer": NaN}')
    assert cache.get(fp, "CPU") is None                      # unreadable or absurd: measured again


async def test_a_stage_lost_in_the_round_trip_noise_still_has_a_figure():
    w = FakeWorker(layers=1, last=False)

    async def noise_step(cols, hidden, sampling):       # compute faster than the empty round trip
        w.now += 0.3 / 1000
    w.step = noise_step
    speed = await measure_stage(w, start=2, end=3, dim=8, act_dtype=np.float32, clock=w.clock)
    assert speed.decode_ms_per_layer == pytest.approx(0.003) and speed.prefill_ms_per_layer == pytest.approx(0.003)
