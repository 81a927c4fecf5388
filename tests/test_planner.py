import pytest

from mesh.planner import PlanError, StageReport, chain_order, plan_fleet, plan_split, validate_chain


def report(name, start=0, end=0, *, total=30, mem=0, pinned=False, fp="f" * 64, backend="CPU"):
    return StageReport(name, start, end, total, mem, pinned, fp, backend, loaded=end > start)


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
