"""The status view of a live mesh: a real coordinator and two real peers in this process (workers are processes),
the tiny model. The stages report their own counters (proto Stats on the control link); the view shows each peer's
device, layers and memory, the transport of every hop, and per-stage ms per step and tok/s once tokens flowed."""
from __future__ import annotations

from contextlib import AsyncExitStack
from types import SimpleNamespace

import pytest
import trio

from engine.stage import Sampling
from mesh.coordinator import CoordConfig, Coordinator
from mesh.peer import Peer, PeerConfig
from mesh.pipeline import generate
from mesh.serve.status import StageHistory, format_status, snapshot
from tests.mesh_fixtures import write_tiny_chat_model

pytestmark = pytest.mark.slow       # peers start worker processes
TOKEN = b"status-view-token-0123"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny.gguf", n_layers=4)


async def run_mesh(model, chain: str, between=None, webrtc_hops=()) -> tuple[dict, dict, list[int]]:
    """Form a 2-peer mesh, take a status snapshot, generate 24 tokens (`between` runs alongside, e.g. more
    snapshots), take another. Returns both snapshots and the tokens."""
    cfg = CoordConfig(model=model, listen="127.0.0.1:0", token=TOKEN, min_peers=2, settle=0.2, warmup=0, chain=chain,
                      webrtc_hops=webrtc_hops)
    coord = Coordinator(cfg)
    with trio.fail_after(240):            # worker processes compile their steps; a loaded box is slow
        async with trio.open_nursery() as nursery:
            port = await coord.serve_registry(nursery)
            for memory_mb in (3000, 1000):
                peer = Peer(PeerConfig(join=f"127.0.0.1:{port}", token=TOKEN, listen="127.0.0.1:0", model=model,
                                       memory_mb=memory_mb, warmup=0))
                nursery.start_soon(peer.run)
            async with AsyncExitStack() as stack:
                fleet, pipe = await coord.form(nursery, stack)
                service = SimpleNamespace(coord=coord, session=SimpleNamespace(fleet=fleet), scheduler=None,
                                          model_id="tiny", state="serving")
                # keep every reading: the rate after the answer is over the whole answer, which on a loaded box
                # (cold step shapes: warmup=0) outlasts the view's default 15 s window and left the rate None
                history = StageHistory(min_gap=0.0, keep=float("inf"))
                before = await snapshot(service, history, timeout=60)
                ids = coord.encode("hello there", template="auto")
                async with trio.open_nursery() as side:
                    if between is not None:
                        side.start_soon(between, service, history)
                    result = await generate(pipe, ids, max_tokens=24, sampling=Sampling(), eos_ids=frozenset())
                    side.cancel_scope.cancel()
                await trio.sleep(0.05)                    # a rate needs the clock to move between two readings
                after = await snapshot(service, history, timeout=60)
            nursery.cancel_scope.cancel()
    return before, after, result.tokens


async def test_a_live_mesh_reports_its_stages_and_hops(model):
    before, after, _ = await run_mesh(model, "p2p")
    assert before["state"] == "serving" and before["chain"] == "p2p" and before["model"] == "tiny"
    stages = after["stages"]
    assert sorted((s["memory_mb"], s["layers"][1] - s["layers"][0]) for s in stages) == [(1000, 1), (3000, 3)]
    assert [s["layers"][0] for s in stages] == [0, stages[0]["layers"][1]]     # chain order, tiling 0..4
    assert all(s["device"] for s in stages) and all(s["host"] == "127.0.0.1" for s in stages)
    assert [h["transport"] for h in after["hops"]] == ["tcp", "tcp", "tcp"]
    assert after["hops"][-1]["to"] == "coordinator (sink)"
    for s in stages:
        assert s["steps"] >= 1 + 23, s            # the prompt's chunk and the decode steps, at least
        assert s["ms_per_step"] > 0 and s["tok_per_s"] > 0 and 0 < s["busy"] <= 1, (s, before)
    assert before["stages"][0]["steps"] == 0 and before["stages"][0]["ms_per_step"] is None
    text = format_status(after)
    assert f"{stages[0]['layers'][0]}..{stages[0]['layers'][1]}" in text and "coordinator (sink) tcp" in text


async def test_status_requests_while_a_hub_chain_answers_leave_its_answer_alone(model):
    """In hub mode the control links carry the steps: the status view must not read them (a stolen Hidden would
    fail the answer). Snapshots taken all through the answer; the tokens equal a p2p chain's, whose middle hop is
    forced onto WebRTC (so the view names that transport too)."""
    taken = []

    async def keep_looking(service, history):
        while True:
            taken.append(await snapshot(service, history, timeout=60))
            await trio.sleep(0)

    _, hub, hub_tokens = await run_mesh(model, "hub", keep_looking)
    _, rtc, p2p_tokens = await run_mesh(model, "p2p", webrtc_hops=(1,))
    assert hub_tokens == p2p_tokens and len(taken) > 3
    assert [h["transport"] for h in rtc["hops"]] == ["tcp", "webrtc", "tcp"]
    assert hub["chain"] == "hub"
    assert [(h["from"], h["transport"]) for h in hub["hops"]] == [("coordinator", "tcp"), ("coordinator", "tcp")]
    assert all(s["ms_per_step"] is None for s in hub["stages"])     # no scheduler here to time them
