from dataclasses import replace

import pytest

from mesh.planner import PlanError, StageReport, chain_order, plan_fleet, plan_split, validate_chain


def report(name, start=0, end=0, *, total=30, mem=0, pinned=False, fp="f" * 64, backend="CPU", kv_bytes=0):
    return StageReport(name, start, end, total, mem, pinned, fp, backend, loaded=end > start, kv_bytes=kv_bytes)


def test_split_equal_shares_when_memory_unknown():
    assert plan_split(0, 30, [0, 0, 0]) == [(0, 10), (10, 20), (20, 30)]
    assert plan_split(0, 10, [0, 8, 8]) == [(0, 4), (4, 7), (7, 10)]  # one unknown: equal shares


def test_split_follows_memory_with_largest_remainder():
    # 30 layers over 1:2:3 -> 5, 10, 15 exactly; 7 layers over 1:1:1 -> 3,2,2 (remainder to the earliest)
    assert plan_split(0, 30, [1000, 2000, 3000]) == [(0, 5), (5, 15), (15, 30)]
    assert plan_split(0, 7, [4, 4, 4]) == [(0, 3), (3, 5), (5, 7)]
    assert plan_split(2, 30, [8000, 8000]) == [(2, 16), (16, 30)]


def test_split_gives_every_stage_a_layer():
    ranges = plan_split(0, 4, [100000, 1, 1, 1])
    assert [b - a for a, b in ranges] == [1, 1, 1, 1]
    with pytest.raises(PlanError, match="cannot give 5 stages"):
        plan_split(0, 4, [1] * 5)


def test_fleet_keeps_pins_and_fills_gaps():
    stages = [report("a", mem=1000), report("b", 10, 20, pinned=True), report("c", mem=1000)]
    assert plan_fleet(0, 30, stages) == [(0, 10), (10, 20), (20, 30)]
    stages = [report("a"), report("b"), report("c", 0, 6, pinned=True)]
    assert plan_fleet(0, 30, stages) == [(6, 18), (18, 30), (0, 6)]
    assert chain_order(plan_fleet(0, 30, stages)) == [2, 0, 1]


def test_fleet_refuses_uncoverable_pins():
    with pytest.raises(PlanError, match="uncovered"):
        plan_fleet(0, 30, [report("a", 0, 10, pinned=True), report("b", 20, 30, pinned=True)])
    with pytest.raises(PlanError, match="overlaps"):
        plan_fleet(0, 30, [report("a", 0, 12, pinned=True), report("b", 10, 30, pinned=True)])
    with pytest.raises(PlanError, match="would hold nothing"):
        plan_fleet(0, 30, [report("a", 0, 30, pinned=True), report("b")])


def test_validate_chain_accepts_a_tiling_and_prints_the_map():
    stages = [report("p1", 0, 10), report("p2", 10, 30, pinned=True)]
    text = validate_chain(0, stages, "f" * 64)
    assert "headless" in text and "p1, layers 0..10" in text and "p2, layers 10..30 on CPU (pinned)" in text


@pytest.mark.parametrize("stages, message", [
    ([report("p1", 0, 10), report("p2", 12, 30)], "gap"),
    ([report("p1", 0, 12), report("p2", 10, 30)], "overlap"),
    ([report("p1", 0, 10), report("p2", 10, 20)], "must own the head"),
    ([report("p1", 0, 10), report("p2", 10, 30, fp="e" * 64)], "different model"),
    ([report("p1", 0, 10), report("p2", 10, 30, total=31)], "31 layers"),
])
def test_validate_chain_names_the_bad_stage(stages, message):
    with pytest.raises(PlanError, match=message):
        validate_chain(0, stages, "f" * 64)


# ---- placement by measured speed ----------------------------------------------------------------------------------
from mesh.planner import LinkSpeed, ModelCost, StageSpeed, plan_by_speed, predict  # noqa: E402

COST = ModelCost(layer_mb=100.0, hidden_bytes=4000)


def fast(name, ms=1.0, *, mem=10_000, rtt=0.0, mbps=0.0, step=0.0, prefill=None, **kw):
    """A measured peer: `ms` per layer of decode, a link of `rtt` ms and `mbps` MB/s (0: not limiting)."""
    return replace(report(name, mem=mem, **kw), speed=StageSpeed(ms, 4 * ms if prefill is None else prefill, step),
                   link=LinkSpeed(rtt, mbps))


def test_speed_plan_leaves_out_a_slow_peer_that_the_fast_one_makes_unneeded():
    plan = plan_by_speed(0, 30, [fast("a"), fast("slow", 4.0), fast("b", 1.2)], COST)
    assert plan.ranges == ((0, 30), None, None)
    assert plan.prediction.decode_ms == pytest.approx(30.0)
    kinds = {n.index: n.kind for n in plan.left_out}
    assert kinds == {1: "too_slow", 2: "too_slow"}
    line = next(n.line for n in plan.left_out if n.index == 1)
    # one line with the figures: its speed, the fastest's, and both predictions (with it: 1 layer at 4 ms + 29 at 1)
    assert "slow would slow the chain: decode 4.00 ms/layer (fastest in the chain 1.00)" in line
    assert f"with it the best plan predicts {1000 / 33:.2f} tok/s, without it {1000 / 30:.2f}" in line


def test_speed_plan_fills_the_fastest_peer_to_its_memory_and_gives_the_rest_to_the_slow_one():
    # the fast peer holds 12 layers (1200 MB at 100 MB each); the slow one must take the other 18
    plan = plan_by_speed(0, 30, [fast("slow", 3.0, mem=5000), fast("quick", 1.0, mem=1250)], COST)
    assert plan.ranges == ((0, 18), (18, 30))
    assert plan.left_out == ()
    assert plan.prediction.decode_ms == pytest.approx(18 * 3.0 + 12 * 1.0)


def test_speed_plan_uses_no_more_peers_than_memory_needs_when_hops_cost():
    peers = [fast(n, 1.0, mem=1500, rtt=2.0) for n in "abc"]   # 15 layers each; every hop costs 1 ms
    plan = plan_by_speed(0, 30, peers, COST)
    assert sum(r is not None for r in plan.ranges) == 2
    assert plan.prediction.decode_ms == pytest.approx(30 + 2 * 1.0)
    assert [n.kind for n in plan.left_out] == ["too_slow"]


def test_speed_plan_counts_bandwidth_and_fixed_step_cost():
    # equal compute; b's link moves 4000 bytes at 1 MB/s (4 ms) and a has a 3 ms fixed step: both hold 15 max
    peers = [fast("a", 1.0, mem=1500, step=3.0), fast("b", 1.0, mem=1500, mbps=1.0), fast("c", 1.0, mem=1500)]
    plan = plan_by_speed(0, 30, peers, COST)
    assert plan.ranges == ((0, 15), None, (15, 30))
    assert plan.prediction.decode_ms == pytest.approx(30 + 3.0)


def test_speed_plan_keeps_pins_and_fills_each_gap():
    peers = [fast("slow", 5.0), fast("pin", 2.0, start=10, end=20, pinned=True), fast("a", 1.0, mem=1000),
             fast("b", 1.0, mem=1000)]
    plan = plan_by_speed(0, 30, peers, COST)
    assert plan.ranges[1] == (10, 20)
    assert {plan.ranges[2], plan.ranges[3]} == {(0, 10), (20, 30)}
    assert plan.ranges[0] is None and plan.left_out[0].kind == "too_slow"


def test_speed_plan_names_memory_and_surplus():
    plan = plan_by_speed(0, 2, [fast("a"), fast("b"), fast("tiny", mem=50)], COST)
    notes = {n.index: n for n in plan.left_out}
    assert notes[2].kind == "memory" and "offers 50 MB, one layer needs 100 MB" in notes[2].line
    with pytest.raises(PlanError, match="cannot hold layers 0..30"):
        plan_by_speed(0, 30, [fast("a", mem=1000), fast("b", mem=1000)], COST)
    with pytest.raises(PlanError, match="no measured speed"):
        plan_by_speed(0, 30, [fast("a"), report("b")], COST)


def test_a_peer_that_keeps_f16_kv_holds_the_layers_its_memory_takes_at_f16():
    # 100 MB a layer at f32, 60 of it KV: 70 MB on a peer that says it keeps f16 values, 100 where it did not say
    cost = ModelCost(layer_mb=100.0, hidden_bytes=4000, kv_mb=60.0)
    cpu, gpu, silent = fast("cpu", mem=1400, kv_bytes=2), fast("gpu", mem=1400, kv_bytes=4), fast("old", mem=1400)
    assert [cost.layer_mb_on(s) for s in (cpu, gpu, silent)] == [70.0, 100.0, 100.0]
    plan = plan_by_speed(0, 30, [cpu, fast("slow", 3.0, mem=10_000)], cost)
    assert plan.ranges == ((0, 20), (20, 30))     # 1400 // 70: the CPU peer takes 20 layers, not 14
    notes = {n.index: n for n in plan_by_speed(0, 2, [fast("a"), fast("b"), fast("tiny", mem=60, kv_bytes=2)],
                                                 cost).left_out}
    assert notes[2].kind == "memory" and "offers 60 MB, one layer needs 70 MB" in notes[2].line


def test_prediction_sums_decode_and_takes_the_slowest_prefill_chunk():
    peers = [fast("a", 1.0, prefill=2.0, rtt=1.0, step=0.5), fast("b", 2.0, prefill=3.0, mbps=2.0)]
    p = predict(peers, [(0, 10), (10, 30)], COST)
    assert p.decode_ms == pytest.approx(10 * 1.0 + 0.5 + 0.5 + 20 * 2.0 + 4000 / 2e3)
    chunk_b = 20 * 3.0 * 64 / 16 + 4000 * 64 / 2e3       # b's chunk is the slower one
    assert p.prefill_tok_s == pytest.approx(64 * 1000 / chunk_b)
    assert p.decode_tok_s == pytest.approx(1000 / p.decode_ms)
