"""bench/perplexity.py's pure parts: the negative log-likelihood of targets under logits, and the windows (BOS-led
where the tokenizer adds one)."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

# bench/ is a folder of scripts, not a package: load the file as a module
_spec = importlib.util.spec_from_file_location("perplexity", Path(__file__).resolve().parents[1] / "bench" /
                                               "perplexity.py")
ppl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ppl)


def test_nll_is_minus_the_log_softmax_of_the_target():
    logits = np.array([[0.0, 0.0, math.log(2.0)], [5.0, 5.0, 5.0]], np.float32)
    got = ppl.nll(logits, [2, 0])
    assert got == pytest.approx([-math.log(0.5), math.log(3.0)], abs=1e-6)


def test_windows_are_cut_whole_and_led_by_bos_where_the_model_wants_one():
    ids = list(range(10, 30))
    assert ppl.windows(ids, 5, 3, None) == [ids[0:5], ids[5:10], ids[10:15]]
    assert ppl.windows(ids, 5, 2, 1) == [[1, *ids[0:4]], [1, *ids[4:8]]]
    with pytest.raises(SystemExit, match="4 windows of 5 tokens, 5 asked"):
        ppl.windows(ids, 5, 5, None)
