"""engine.local_stage: which peers run their stage in their own process, and the worker client's API over a Stage
held by the caller (steps equal to the Stage's own, refusals as WorkerCommandError, new shapes off the event loop)."""
from __future__ import annotations

import numpy as np
import pytest
import trio

from common.values import Column, Sampling
from engine.arena import PayloadKind
from engine.local_stage import LocalStage, _shape_key, open_stage_host, stage_in_process
from engine.stage import Stage
from engine.worker import WorkerCommandError
from tests.mesh_fixtures import write_tiny_chat_model

PROMPT = [5, 9, 17, 33, 2, 60]


def test_every_device_runs_in_the_peer_unless_told_otherwise():
    for device in ("CPU", "CPU:X86", "CUDA", "METAL", "AMD", None):
        assert stage_in_process(device, {}) and stage_in_process(device, {"DEV": "CUDA"})
    assert not stage_in_process("CPU", {"MESH_STAGE_IN_PEER": "0"}) and not stage_in_process("CUDA", {"MESH_STAGE_IN_PEER": "0"})
    assert stage_in_process("CUDA", {"MESH_STAGE_IN_PEER": "1"})
    # a Peer embedded in another process defaults to a worker (PeerConfig.stage_in_peer "0"); mesh-peer says "auto"
    assert not stage_in_process("CPU", {}, default="0") and stage_in_process("CPU", {"MESH_STAGE_IN_PEER": "1"}, "0")
    with pytest.raises(ValueError, match="MESH_STAGE_IN_PEER='yes'"):
        stage_in_process("CPU", {"MESH_STAGE_IN_PEER": "yes"})


def test_shape_keys_follow_runs_and_logits():
    decode2 = [Column(7, 0, True, 1), Column(3, 1, True, 2)]
    prefill = [Column(i, 0, i == 3, 1) for i in range(4)]
    assert _shape_key(decode2) == ((1, 1), (True, True), True)
    assert _shape_key(prefill) == ((4,), (False, False, False, True), True)
    assert _shape_key(prefill) != _shape_key([Column(i, 0, True, 1) for i in range(4)])
    # sampled, not greedy: the last stage computes logits instead of picking on the device (another shape)
    assert _shape_key(decode2, Sampling(temperature=0.7)) == ((1, 1), (True, True), False)
    assert _shape_key(decode2, (Sampling(), Sampling(temperature=0.7)))[2] is False


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny.gguf", n_layers=2)


@pytest.mark.slow      # compiles a tiny model's step shapes in this process (~30 s at load 9)
async def test_local_stages_chained_equal_the_whole_stage_bitwise(model, monkeypatch):
    monkeypatch.setenv("MESH_STAGE_IN_PEER", "1")
    ref = Stage.load(model, 0, 2, n_slots=2, max_context=64)
    cols = [Column(i, 0, i == len(PROMPT) - 1, t) for i, t in enumerate(PROMPT)]
    want = [int(ref.step(cols)[0])]
    for pos in range(len(PROMPT), len(PROMPT) + 3):
        want.append(int(ref.step([Column(pos, 0, True, want[-1])])[0]))
    async with open_stage_host(device="CPU") as a, open_stage_host(device="CPU") as b:
        assert isinstance(a, LocalStage) and a.ready.device.startswith("CPU")
        await a.load(model, 0, 1, n_slots=2, max_context=64, warmup=0)
        await b.load(model, 1, 2, n_slots=2, max_context=64, warmup=0)
        assert a.first and not a.last and b.last
        got = []
        for step_cols in [cols] + [None] * 3:
            step_cols = step_cols or [Column(len(PROMPT) + len(got) - 1, 0, True, got[-1])]
            inline = a.runs_inline(step_cols)
            h = await a.step_raw(step_cols, None, 0, 0, Sampling())
            assert h.kind in (PayloadKind.ACT_F16, PayloadKind.ACT_F32) and h.rows == len(step_cols)
            assert a.runs_inline(step_cols)          # seen once: inline from now on
            out = await b.step_raw(step_cols, h.data, h.kind, h.cols, Sampling())
            assert out.kind == PayloadKind.TOKENS_I32
            got.append(int(np.frombuffer(out.data, np.int32)[0]))
            assert inline == (len(got) > 2)          # the prompt's shape, then the first decode step, were new
        assert got == want
        with pytest.raises(WorkerCommandError, match="skips ahead"):
            await a.step_raw([Column(40, 0, True, 1)], None, 0, 0, Sampling())
        await a.rollback(0, 0)
        await b.rollback(0, 0)
        again = await a.step_raw(cols, None, 0, 0, Sampling())
        out = await b.step_raw(cols, again.data, again.kind, again.cols, Sampling())
        assert int(np.frombuffer(out.data, np.int32)[0]) == want[0]
        with pytest.raises(trio.WouldBlock):
            a.post_step_nowait(cols, None, 0, 0, Sampling())    # a split step wins nothing here: declined
