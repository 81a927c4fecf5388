"""The flat CPU replay (engine/replay.py) and its runner (engine/cpu_runner.py): a captured step's kernels, their
core slices claimed by several threads, give bit-identical results to tinygrad's own TinyJit replay; a step the
replay does not take keeps the jit."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from tinygrad import Device, Tensor, TinyJit

from engine import cpu_runner, stage as stage_mod
from engine.cpu_runner import cpu_threads
from engine.replay import CpuReplay, NotReplayable
from engine.stage import Column, Stage
from tests.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.skipif(not Device.DEFAULT.startswith("CPU"), reason="the replay is for the CPU device")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("replay") / "llama.gguf", arch="llama", n_layers=3, qtype="Q4_1")


def decode(stage: Stage, prompt: list[int], n: int) -> list[np.ndarray]:
    """Logits of a prompt (chunked prefill) and of n greedy decode steps."""
    out = [stage.step_logits([Column(i, 0, True, t) for i, t in enumerate(prompt)]).copy()]
    for i in range(n):
        tok = int(np.argmax(out[-1][-1]))
        out.append(stage.step_logits([Column(len(prompt) + i, 0, True, tok)]).copy())
    return out


class Refused:
    def __init__(self, *args, **kwargs):
        raise NotReplayable("refused by the test")


def test_threads_follow_the_environment(monkeypatch):
    monkeypatch.setenv("MESH_CPU_THREADS", "3")
    assert cpu_threads() == 3
    monkeypatch.delenv("MESH_CPU_THREADS")
    from tinygrad.helpers import NUM_CPU_THREADS
    assert cpu_threads() == NUM_CPU_THREADS.value


def test_threaded_replay_is_bitwise_the_jit_and_refusal_keeps_the_jit(model, monkeypatch):
    monkeypatch.setenv("MESH_CPU_THREADS", "2")  # the matvec kernels split in 2 and the replay runs 2 threads
    replayed = Stage.load(model, 0, 3, n_slots=1, max_context=64)
    want = decode(replayed, [3, 17, 42, 7, 99, 5, 8, 1, 2], 6)
    replays = [r for r in replayed._replays.values() if r is not None]
    assert replays and all(r.threads == 2 for r in replays)
    assert any(c.slices == 2 for r in replays for c in r.calls)  # some kernels were split over the two threads

    monkeypatch.setattr(stage_mod, "CpuReplay", Refused)  # the fallback: every step through TinyJit
    jitted = Stage.load(model, 0, 3, n_slots=1, max_context=64)
    got = decode(jitted, [3, 17, 42, 7, 99, 5, 8, 1, 2], 6)
    assert jitted._replays and all(r is None for r in jitted._replays.values())
    assert jitted._direct.keys() == jitted._replays.keys()  # the captured calls run straight (a GPU's path)
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
    monkeypatch.setenv("MESH_JIT_DIRECT", "0")  # and through TinyJit's own call
    called = Stage.load(model, 0, 3, n_slots=1, max_context=64)
    got = decode(called, [3, 17, 42, 7, 99, 5, 8, 1, 2], 6)
    assert not called._direct and all(np.array_equal(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize("futex", [True, False])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_runner_matches_the_jit_with_more_or_fewer_threads_than_slices(threads, futex, monkeypatch):
    """A small captured step (matmul, elementwise, reduction: kernels with and without core slices) replayed by
    1, 2 and 3 threads (3: one thread more than any kernel has slices), many times: always the jit's bits. Both
    helper pools: the futex one (helpers waiting in C, Linux) and the Python one (elsewhere, MESH_CPU_FUTEX=0)."""
    if futex and cpu_runner._futex_number() is None:
        pytest.skip("no futex pool on this system")
    monkeypatch.setenv("MESH_CPU_FUTEX", "1" if futex else "0")
    monkeypatch.setattr(cpu_runner, "_pool", functools.cache(cpu_runner._pool.__wrapped__))  # this test's own pools
    w = Tensor(np.random.default_rng(0).standard_normal((64, 48), dtype=np.float32)).realize()

    @TinyJit
    def f(x: Tensor) -> Tensor:
        h = (x @ w).relu() * 0.5 + 1
        return (h.softmax(-1) * h).sum(-1, keepdim=True) + h

    x = Tensor.zeros(16, 64).contiguous().realize()
    rng = np.random.default_rng(1)
    f.cnt = 1  # capture on the first call (the stage does the same)
    inputs = [rng.standard_normal((16, 64), dtype=np.float32) for _ in range(20)]
    x.assign(Tensor(inputs[0])).realize()
    f(x)
    replay = CpuReplay(f, [x], threads=threads)
    for a in inputs:
        x.assign(Tensor(a)).realize()
        want = f(x).numpy()
        x.assign(Tensor(a)).realize()
        assert np.array_equal(replay({}).numpy(), want)
    if threads > 1:
        assert isinstance(cpu_runner._pool(threads - 1), cpu_runner._FutexPool if futex else cpu_runner._Pool)


def test_a_step_runs_alone_while_the_helpers_are_busy(model, monkeypatch):
    monkeypatch.setenv("MESH_CPU_THREADS", "2")
    stage = Stage.load(model, 0, 3, n_slots=1, max_context=64)
    want = decode(stage, [4, 5, 6], 3)
    stage.reset()
    pool = cpu_runner._pool(1)
    with pool.lock:  # another step holds the helpers: this one claims every slice itself
        got = decode(stage, [4, 5, 6], 3)
    assert all(np.array_equal(a, b) for a, b in zip(want, got))


def test_uncaptured_jit_is_not_replayable():
    with pytest.raises(NotReplayable):
        CpuReplay(TinyJit(lambda x: x + 1), [Tensor([1.0]).realize()])


def test_raw_step_is_bitwise_the_generic_copies(model, monkeypatch):
    """A replayed shape's later steps write their inputs and read their output with raw host copies (`_Raw`), the
    rope rows looked up per position (computed ROPE_BLOCK at a time): a split model's hidden states and logits
    are the bits of the generic path (MESH_RAW_STEP=0), also across a rope block's edge."""
    def run(raw: bool):
        monkeypatch.setenv("MESH_RAW_STEP", "1" if raw else "0")
        first, last = Stage.load(model, 0, 1, n_slots=2, max_context=128), Stage.load(model, 1, 3, n_slots=2,
                                                                                        max_context=128)
        outs, tok = [], 5
        n = stage_mod.ROPE_BLOCK - 4
        prompt = [Column(i, 0, i == n - 1, (7 * i + 3) % 50) for i in range(n)]
        h = first.step(prompt)
        outs.append(last.step_logits(prompt, h).copy())
        for pos in range(n, n + 8):   # decode steps across a rope block's edge
            col = [Column(pos, 0, True, tok)]
            h = first.step(col)
            outs += [h.copy(), last.step_logits(col, h).copy()]
            tok = int(np.argmax(outs[-1][-1]))
        assert bool(first._raw) == raw and bool(last._raw) == raw
        return outs

    monkeypatch.setenv("MESH_CPU_THREADS", "2")
    raw, generic = run(True), run(False)
    assert len(raw) == len(generic) and all(a.tobytes() == b.tobytes() for a, b in zip(raw, generic))


@pytest.mark.parametrize("threads,lean", [("1", "1"), ("2", "1"), ("2", "0")])
def test_step_bytes_is_bitwise_step(model, monkeypatch, threads, lean):
    """`Stage.step_bytes` (a replayed decode step, bytes in and out: what a peer's stage runs) gives the bits of
    `step` on a split model, first, middle and last stage (its tokens, greedy and seeded), across a rope block's
    edge, through one column's straight-line path (`_step_one`) and the general one (MESH_STEP_LEAN=0); a step it
    does not take (a prompt's run) is None and changes nothing; a column it refuses is refused as `step` refuses
    it, with nothing changed."""
    from common.values import Sampling
    from engine.errors import RangeError
    monkeypatch.setenv("MESH_CPU_THREADS", threads)
    monkeypatch.setenv("MESH_STEP_LEAN", lean)
    cuts = [(0, 1), (1, 2), (2, 3)]
    ref = [Stage.load(model, a, b, n_slots=2, max_context=128) for a, b in cuts]
    lane = [Stage.load(model, a, b, n_slots=2, max_context=128) for a, b in cuts]
    n = stage_mod.ROPE_BLOCK - 4
    prompt = [Column(i, 0, i == n - 1, (5 * i + 1) % 50) for i in range(n)]
    assert lane[0].step_bytes(prompt, None) is None and lane[0]._lengths[0] == 0
    for chain in (ref, lane):
        chain[2].step(prompt, chain[1].step(prompt, chain[0].step(prompt)))

    def step(stage, cols, data, *sampling):
        got = stage.step_bytes(cols, data, *sampling)
        if got is not None:
            return got[2], 1
        hidden = None if data is None else np.frombuffer(data, np.float32).reshape(len(cols), -1)
        return stage.step(cols, hidden, *sampling).tobytes(), 0   # a shape's first replay: the generic path

    tok, taken = 7, 0
    for pos in range(n, n + 8):
        s = Sampling() if pos % 2 else Sampling(temperature=0.8, top_k=20, seed=3)
        cols = [Column(pos, 0, True, tok)]
        h0 = ref[0].step(cols)
        h1 = ref[1].step(cols, h0)
        want = ref[2].step(cols, h1, s)
        g0, t0 = step(lane[0], cols, None)
        g1, t1 = step(lane[1], cols, g0)
        g2, t2 = step(lane[2], cols, g1, s)
        assert (g0, g1, g2) == (h0.tobytes(), h1.tobytes(), want.tobytes())
        taken += t0 + t1 + t2
        tok = int(want[0])
    assert taken >= 3 * 6       # every stage's later steps took the lane
    end = n + 8
    for bad in (Column(end + 1, 0, True, tok), Column(end, 2, True, tok), Column(128, 0, True, tok)):
        for stage, data in ((lane[0], None), (lane[1], g0)):
            with pytest.raises(RangeError) as lean_err:
                stage.step_bytes([bad], data)
            with pytest.raises(RangeError) as ref_err:
                stage.step([bad], None if data is None else np.frombuffer(data, np.float32).reshape(1, -1))
            assert str(lean_err.value) == str(ref_err.value) and stage._lengths[0] == end
    with pytest.raises(RangeError, match="token ids"):
        lane[0].step_bytes([Column(end, 0, True, 10**6)], None)
