"""The prefill's shape on the CPU (issue 9, first token): chunks before the last run without the output head, the
small kernels rewritten as plain loops give the bits of the Tensor expressions they replace, and a prompt's
embeddings are read in one batch."""
from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor

from engine.cpu_kernels import gelu_glu, glu, rms_norm_rows
from engine.replay import CpuReplay
from engine.stage import Column, Stage
from tests.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("prefill") / "llama.gguf", arch="llama", n_layers=3, seed=4)


@pytest.mark.parametrize("threads", ["1", "3"])
@pytest.mark.parametrize("n", [1, 5, 16])
def test_glu_and_gelu_glu_are_bitwise_the_tensor_expressions(n, threads, monkeypatch):
    # with 3 threads a step of several rows cuts the 96 features into 3 core slices (every slice is run here, one
    # after another, as tinygrad runs a kernel's core_id axis): the same bits as one slice
    monkeypatch.setenv("MESH_CPU_THREADS", threads)
    rng = np.random.default_rng(n)
    gu = (rng.standard_normal((n, 2 * 96)) * rng.choice([0.01, 1, 30, 200], (n, 2 * 96))).astype(np.float32)
    gu[0, :4] = [0.0, -0.0, 90.0, -105.0]  # zero, and past exp2's range on both sides
    want = (Tensor(gu)[:, :96].silu() * Tensor(gu)[:, 96:]).numpy()
    got = glu(Tensor(gu)).numpy()
    assert got.dtype == np.float32 and np.array_equal(got, want)
    # Gemma 3's tanh GELU, the same way
    want = (Tensor(gu)[:, :96].gelu() * Tensor(gu)[:, 96:]).numpy()
    got = gelu_glu(Tensor(gu)).numpy()
    assert got.dtype == np.float32 and np.array_equal(got, want)


@pytest.mark.parametrize("threads", ["1", "3"])
@pytest.mark.parametrize("n", [1, 3, 16, 24])
def test_rms_norm_is_bitwise_the_tensor_expression(n, threads, monkeypatch):
    monkeypatch.setenv("MESH_CPU_THREADS", threads)     # 3: rows cut into 3 core slices where n allows
    rng = np.random.default_rng(10 + n)
    x = (rng.standard_normal((n, 200)) * rng.choice([1e-3, 1, 50], (n, 1))).astype(np.float32)
    w = rng.standard_normal(200).astype(np.float32)
    xt = Tensor(x)
    want = (xt * (xt.square().mean(axis=-1, keepdim=True) + 1e-6).sqrt().reciprocal() * Tensor(w)).numpy()
    assert np.array_equal(rms_norm_rows(Tensor(x), Tensor(w), 1e-6).numpy(), want)


def _prompt_logits(stage: Stage, tokens: list[int]) -> np.ndarray:
    stage.reset()
    return stage.step_logits([Column(i, 0, i == len(tokens) - 1, t) for i, t in enumerate(tokens)])


def test_chunks_without_logits_skip_the_head_and_change_nothing(model, monkeypatch):
    stage = Stage.load(model, 0, 3, n_slots=1, max_context=128)
    stage.warmup()
    tokens = [(13 * i + 5) % 256 for i in range(40)]  # chunks 16, 16, 8 of 16: the first two want no logits
    ran: list[int] = []
    real = CpuReplay.headless
    monkeypatch.setattr(CpuReplay, "headless", lambda self, v: (ran.append(len(self.body.table) - 1), real(self, v)))
    got = _prompt_logits(stage, tokens)
    (shape,) = [s for s in stage._replays if s[0] == 16]
    replay = stage._replays[shape]
    head = stage._head_calls[shape]
    assert head > 0 and ran == [len(replay.calls) - head] * 2  # two chunks ran every kernel but the head's
    monkeypatch.setattr(CpuReplay, "headless", lambda self, v: self(v))  # the head computed and thrown away
    assert np.array_equal(_prompt_logits(stage, tokens), got)


def test_a_split_with_headless_chunks_matches_the_unsharded_stage(model):
    tokens = [(7 * i + 1) % 256 for i in range(37)]
    whole = Stage.load(model, 0, 3, n_slots=1, max_context=128)
    first, last = Stage.load(model, 0, 1, n_slots=1, max_context=128), Stage.load(model, 1, 3, n_slots=1,
                                                                                   max_context=128)
    cols = [Column(i, 0, i == len(tokens) - 1, t) for i, t in enumerate(tokens)]
    want = whole.step_logits(cols)
    assert np.array_equal(last.step_logits(cols, first.step(cols)), want)
