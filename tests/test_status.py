"""The status view (mesh/serve/status.py) as pure functions: no HTTP, no peers, no clock."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from mesh import proto
from mesh.scheduler import SchedulerStats
from mesh.serve.status import (StageCounters, StageHistory, build_status, fleet_hops, fleet_stages, format_status,
                               scheduler_dict, stage_figures, transport_of_addr, transport_of_stream)


def Stats(active: int, queued: int, max_seqs: int, steps: int, tokens_out: int, **rest) -> SchedulerStats:
    """The scheduler's own stats, with the fields a test leaves out at an idle scheduler's values."""
    idle = dict(prompt_tokens=0, in_flight=0, micro_batches=1, step_ms=None)
    return SchedulerStats(active, queued, max_seqs, steps, tokens_out, **{**idle, **rest})


def member(n: int, host: str, memory_mb: int = 0):
    return SimpleNamespace(name=f"peer {n} ({host})", host=host, number=n,
                           join=proto.Join(7000 + n, "", memory_mb))


def test_rates_come_from_two_readings():
    a = StageCounters(at=10.0, steps=100, columns=400, busy_s=3.0)
    b = StageCounters(at=12.0, steps=150, columns=450, busy_s=4.0)
    f = stage_figures(a, b)
    assert f.ms_per_step == pytest.approx(20.0)        # 1 s of compute over 50 steps
    assert f.tok_per_s == pytest.approx(25.0)          # 50 columns in 2 s
    assert f.busy == pytest.approx(0.5)
    assert f.steps == 150


def test_one_reading_gives_the_lifetime_mean_and_no_rate():
    f = stage_figures(None, StageCounters(5.0, 40, 100, 2.0))
    assert (f.ms_per_step, f.tok_per_s, f.busy) == (pytest.approx(50.0), None, None)
    assert stage_figures(None, StageCounters(5.0, 0, 0, 0.0)).ms_per_step is None   # never stepped
    assert stage_figures(None, None) is None


def test_an_idle_stage_shows_its_last_speed_and_zero_rate():
    a = StageCounters(10.0, 40, 100, 2.0)
    f = stage_figures(a, StageCounters(13.0, 40, 100, 2.0))
    assert (f.ms_per_step, f.tok_per_s, f.busy) == (pytest.approx(50.0), 0.0, 0.0)


def test_a_stage_that_was_reset_is_not_a_negative_rate():
    f = stage_figures(StageCounters(10.0, 400, 900, 9.0), StageCounters(11.0, 3, 3, 0.3))
    assert f.tok_per_s is None and f.ms_per_step == pytest.approx(100.0)


def test_history_uses_a_recent_reading_at_least_min_gap_old():
    h = StageHistory(keep=15.0, min_gap=0.5)
    assert h.figures("s", StageCounters(0.0, 0, 0, 0.0)).tok_per_s is None
    assert h.figures("s", StageCounters(0.2, 10, 10, 0.1)).tok_per_s is None        # too close to the first
    f = h.figures("s", StageCounters(1.0, 30, 30, 0.3))
    assert f.tok_per_s == pytest.approx(25.0)          # against t=0.2, the newest reading at least 0.5 s older
    f = h.figures("s", StageCounters(100.0, 60, 60, 0.6))
    assert f.tok_per_s is None                                                         # older readings expired
    h.forget_except(["other"])
    assert h.figures("s", StageCounters(101.0, 70, 70, 0.7)).tok_per_s is None


def test_transport_names():
    assert transport_of_addr("10.0.0.5:7001") == "tcp"
    assert transport_of_addr("ws://10.0.0.5:7001/mesh") == "ws"
    assert transport_of_addr("WSS://host:443") == "ws"
    assert transport_of_stream(object()) is None


async def test_transport_of_real_streams():
    a, _ = trio.testing.memory_stream_pair()
    assert transport_of_stream(a) is None
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as n:
        n.start_soon(listeners[0].accept)
        s = await trio.open_tcp_stream("127.0.0.1", port)
        assert transport_of_stream(s) == "tcp"
        assert transport_of_stream(SimpleNamespace(transport_stream=s)) == "tcp"     # a wrapper of ours
        await s.aclose()
        n.cancel_scope.cancel()
    await listeners[0].aclose()


def test_websocket_stream_is_ws():
    from transport.websocket import WebSocketStream
    ws = WebSocketStream.__new__(WebSocketStream)
    assert transport_of_stream(ws) == "ws"


def test_fleet_stages_and_hops_p2p():
    members = [member(1, "10.0.0.5", 8192), member(2, "10.0.0.6")]
    infos = [proto.Info(0, 20, 30, 8192, False, "ab", "CPU", True), proto.Info(20, 30, 30, 0, True, "ab", "CUDA", True)]
    stages = fleet_stages(members, infos)
    assert [s["layers"] for s in stages] == [[0, 20], [20, 30]]
    assert [s["device"] for s in stages] == ["CPU", "CUDA"]
    assert [s["memory_mb"] for s in stages] == [8192, 0]
    hops = fleet_hops("p2p", [m.name for m in members], ["tcp", "webrtc", "tcp"])
    assert [(h["from"], h["to"], h["transport"]) for h in hops] == [
        ("coordinator", "peer 1 (10.0.0.5)", "tcp"), ("peer 1 (10.0.0.5)", "peer 2 (10.0.0.6)", "webrtc"),
        ("peer 2 (10.0.0.6)", "coordinator (sink)", "tcp")]
    hub = fleet_hops("hub", [m.name for m in members], ["ws", "tcp"])
    assert [(h["to"], h["transport"]) for h in hub] == [("peer 1 (10.0.0.5)", "ws"), ("peer 2 (10.0.0.6)", "tcp")]


def test_a_local_first_stage_comes_first():
    stages = fleet_stages([member(1, "h")], [proto.Info(4, 30, 30, 0, False, "ab", "CPU", True)], local=(0, 4),
                          local_device="CUDA")
    assert [(s["name"], s["layers"], s["local"]) for s in stages] == [("coordinator", [0, 4], True),
                                                                      ("peer 1 (h)", [4, 30], False)]


def test_build_status_is_json_and_complete():
    members = [member(1, "10.0.0.5", 4096), member(2, "10.0.0.6", 2048)]
    infos = [proto.Info(0, 15, 30, 4096, False, "ab", "CPU", True, 256, 16),
             proto.Info(15, 30, 30, 2048, False, "ab", "METAL", True)]
    st = build_status(
        model="smollm2", state="serving", chain="p2p", pool=1,
        stages=fleet_stages(members, infos),
        hops=fleet_hops("p2p", [m.name for m in members], ["tcp", "ws", "tcp"]),
        figures=[stage_figures(StageCounters(0, 0, 0, 0), StageCounters(2, 100, 120, 1.5)), None],
        scheduler=Stats(active=3, queued=2, max_seqs=8, steps=100, tokens_out=97),
        placement=SimpleNamespace(policy="speed", predicted_decode_tok_s=41.23, predicted_prefill_tok_s=812.4,
                                  measured_decode_tok_s=None, note="",
                                  left_out=("peer 3 (10.0.0.7) is left out: 120 ms a layer",)))
    assert json.loads(json.dumps(st)) == st
    assert st["scheduler"] == {"active": 3, "queued": 2, "max_seqs": 8, "steps": 100, "tokens_out": 97,
                               "prompt_tokens": 0, "in_flight": 0, "micro_batches": 1, "ms_per_step": None}
    s1, s2 = st["stages"]
    assert (s1["ms_per_step"], s1["tok_per_s"], s1["busy"]) == (15.0, 60.0, 0.75)
    assert (s2["ms_per_step"], s2["tok_per_s"]) == (None, None)
    assert st["predicted_tok_per_s"] == 41.2
    assert [h["transport"] for h in st["hops"]] == ["tcp", "ws", "tcp"]
    text = format_status(st)
    assert "3 active / 8 slots, 2 queued" in text
    assert "peer 1 (10.0.0.5)" in text and "0..15" in text and "15.0" in text and "75%" in text
    assert "METAL" in text and "2048 MB" in text
    assert (s1["kv_blocks"], s1["kv_block_size"], s2["kv_blocks"]) == (256, 16, None)
    header, row1 = next((line, text.splitlines()[k + 1]) for k, line in enumerate(text.splitlines())
                        if line.startswith("#"))
    assert "KV pos" in header and "  4096  " in row1           # the first stage's KV pool: 256 blocks of 16
    assert "peer 1 (10.0.0.5) -> peer 2 (10.0.0.6) ws" in text
    assert "placement speed, predicts 41.2 tok/s decode, 812 tok/s prefill" in text
    assert "left out: peer 3 (10.0.0.7) is left out: 120 ms a layer" in text
    assert st["placement"]["left_out"] == ["peer 3 (10.0.0.7) is left out: 120 ms a layer"]


def test_status_before_a_mesh_forms():
    st = build_status(model="m", state="forming", detail="waiting for 2 peers", pool=1)
    assert st["stages"] == [] and st["hops"] == [] and st["scheduler"] is None and st["chain"] is None
    assert st["placement"] is None and st["predicted_tok_per_s"] is None
    text = format_status(st)
    assert text.splitlines() == ["model m  state forming (waiting for 2 peers)  pool 1"]


def test_an_unknown_transport_is_a_bug_not_a_label():
    with pytest.raises(ValueError, match="unknown transport 'udp'"):
        build_status(model="m", state="serving", hops=[{"from": "a", "to": "b", "transport": "udp"}])


def test_scheduler_stats_may_grow_and_may_be_a_mapping():
    assert scheduler_dict(None) is None
    d = scheduler_dict({"active": 1, "queued": 0, "max_seqs": 4, "step_ms": 12.345})
    assert d == {"active": 1, "queued": 0, "max_seqs": 4, "steps": None, "tokens_out": None, "prompt_tokens": None,
                 "in_flight": None, "micro_batches": None, "ms_per_step": 12.35}


def test_the_schedulers_stage_times_stand_in_where_stages_did_not_report():
    stages = fleet_stages([member(1, "a"), member(2, "b")], [proto.Info(2, 3, 4, 0, False, "", "CPU", True),
                                                            proto.Info(3, 4, 4, 0, False, "", "CPU", True)],
                          local=(0, 2))
    st = build_status(model="m", state="serving", chain="hub", stages=stages,
                      figures=[None, None, stage_figures(None, StageCounters(1.0, 10, 10, 0.5))],
                      scheduler=Stats(1, 0, 4, 10, 9, step_ms=31.0, stage_ms=(7.5, 9.0)))
    assert [s["ms_per_step"] for s in st["stages"]] == [None, 7.5, 50.0]     # the stage's own report wins
    assert st["scheduler"]["ms_per_step"] == 31.0
    assert "31.0 ms a step" in format_status(st)


def test_status_command_names_an_unreachable_server(capsys):
    from mesh.cli import coord_main
    from tests.mesh_fixtures import free_port
    port = free_port()
    with pytest.raises(SystemExit) as exc:
        coord_main(["status", "--http", f"127.0.0.1:{port}", "--timeout", "5"])
    assert exc.value.code == (f"mesh-coord status: cannot reach http://127.0.0.1:{port}/v1/mesh: [Errno 111] "
                              f"Connection refused (is mesh-coord serving there? see --http)")
