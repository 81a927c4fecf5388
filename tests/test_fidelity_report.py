"""The pure comparison logic of bench/fidelity.py: prefix agreement, per-pair summaries, the acceptance rule."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# bench/ is a folder of scripts, not a package: load the file as a module (it imports nothing heavy at top level)
_spec = importlib.util.spec_from_file_location("fidelity", Path(__file__).resolve().parents[1] / "bench" / "fidelity.py")
fid = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fid)


@pytest.mark.parametrize("a, b, n", [
    ([1, 2, 3], [1, 2, 3], 3),
    ([1, 2, 3], [1, 9, 3], 1),  # agreement after a difference does not count
    ([5, 2, 3], [1, 2, 3], 0),
    ([1, 2], [1, 2, 3], 2),  # a shorter sequence agrees over its length
    ([], [1], 0),
])
def test_prefix_agreement(a, b, n):
    assert fid.prefix_agreement(a, b) == n == fid.prefix_agreement(b, a)


def test_pair_prefixes_in_path_order():
    tokens = {"q8": [[1, 2, 3], [4, 5, 6]], "f32": [[1, 2, 3], [4, 0, 6]], "llama.cpp": [[1, 7, 3], [4, 5, 6]]}
    assert fid.pair_prefixes(tokens) == {("q8", "f32"): [3, 1], ("q8", "llama.cpp"): [1, 3],
                                         ("f32", "llama.cpp"): [1, 1]}


def test_summarize():
    assert fid.summarize([32, 4, 32, 0], 32) == (2, 17.0)
    assert fid.summarize([], 32) == (0, 0.0)


def test_acceptance_rule_needs_both_figures():
    assert fid.at_least_as_good([32, 4], [32, 4], 32)  # equal is enough
    assert fid.at_least_as_good([32, 10], [32, 4], 32)
    assert not fid.at_least_as_good([32, 2], [32, 4], 32)  # same full count, shorter mean
    assert not fid.at_least_as_good([31, 31], [32, 0], 32)  # longer mean, fewer full agreements


def test_margin():
    top = {7: 3.5, 9: 3.25, 1: 0.0}
    assert fid.margin(top, 7, 9) == 0.25
    assert fid.margin(top, 7, 42) is None
    assert fid.format_margin("q8", top, 7, 9) == "q8 margin 0.250"
    assert fid.format_margin("q8", top, 7, 42) == "q8 margin > 3.50"


def test_prompts_are_varied_enough():
    names = [n for n, _, _ in fid.PROMPTS]
    assert len(names) >= 8 and len(set(names)) == len(names)
    assert any(not chat for _, chat, _ in fid.PROMPTS) and sum(chat for _, chat, _ in fid.PROMPTS) > len(names) // 2


def _decode(ids):
    return "".join(chr(97 + i) for i in ids)


def test_report_lines_and_acceptance():
    tokens = {"q8": [[0, 1, 2], [3, 4, 5]], "f32": [[0, 1, 2], [3, 4, 6]], "llama.cpp": [[0, 1, 9], [3, 4, 6]]}
    tops = {"q8": [[{0: 5.0}, {1: 5.0}, {2: 5.0, 9: 4.5}], [{3: 1.0}, {4: 1.0}, {5: 2.0, 6: 1.9, 7: 0.0}]],
            "f32": [[{0: 5.0}, {1: 5.0}, {2: 5.0, 9: 4.0}], [{3: 1.0}, {4: 1.0}, {6: 2.0, 7: 1.0}]]}
    lines = fid.report([("fact", True, 10), ("raw-code", False, 7)], tokens, tops, 3, _decode)
    assert lines[0].startswith(" 1 fact     chat  10+3  q8|f32  3  q8|llama.cpp  2  f32|llama.cpp  2  q8: 'abc'")
    # the pair that agrees fully has no detail line; the others name both picks and each engine's margin
    assert lines[1] == "   q8|llama.cpp first differ at token 2: 'c' vs 'j' (q8 margin 0.500)"
    assert lines[2] == "   f32|llama.cpp first differ at token 2: 'c' vs 'j' (f32 margin 1.000)"
    assert lines[3].startswith(" 2 raw-code raw    7+3  q8|f32  2")
    assert lines[4] == "   q8|f32 first differ at token 2: 'f' vs 'g' (q8 margin 0.100, f32 margin > 1.00)"
    assert "q8|f32: 1 of 2 prompts agree over all 3 tokens, mean prefix 2.5" in lines
    assert "f32|llama.cpp: 1 of 2 prompts agree over all 3 tokens, mean prefix 2.5" in lines
    assert lines[-1] == ("q8 agrees with llama.cpp at least as well as f32 does: NO "
                         "(fully agreeing prompts 0 vs 1, mean prefix 2.0 vs 2.5)")


def test_report_without_llama_cpp_skips_the_rule():
    tokens = {"q8": [[0, 1]], "f32": [[0, 1]]}
    tops = {m: [[{0: 1.0}, {1: 1.0}]] for m in tokens}
    lines = fid.report([("fact", True, 4)], tokens, tops, 2, _decode)
    assert "q8|f32: 1 of 1 prompts agree over all 2 tokens, mean prefix 2.0" in lines
    assert lines[-1].startswith("acceptance rule not checked")
