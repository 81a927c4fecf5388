"""The range planner on the real SmolLM2 file: three ranges parse with gguf's own reader and hold the source bytes."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from engine.gguf_meta import read_model_meta  # noqa: E402
from engine.gguf_range import plan_range_gguf  # noqa: E402
from engine.sources import default_model_path  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def source():
    try:
        path = default_model_path()
    except Exception as exc:  # the bundled model is an optional package
        pytest.skip(f"SmolLM2 is not installed: {exc}")
    return path, gguf.GGUFReader(str(path))


def test_three_ranges_cover_the_model_byte_for_byte(source, tmp_path):
    path, reader = source
    src = {t.name: t for t in reader.tensors}
    meta = read_model_meta(path)
    seen: set[str] = set()
    for start, end in [(0, 10), (10, 20), (20, 30)]:
        plan = plan_range_gguf(path, start, end)
        out_path = plan.write_to(tmp_path / plan.name)
        out = gguf.GGUFReader(str(out_path))
        for t in out.tensors:
            assert t.tensor_type == src[t.name].tensor_type
            assert np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(src[t.name].data).view(np.uint8))
        seen |= {t.name for t in out.tensors}
        got = read_model_meta(out_path)
        assert (got.fingerprint, got.n_layers, tuple(got.range)) == (meta.fingerprint, 30, (start, end))
        assert got.tied_output and got.vocab_size == meta.vocab_size
    assert seen == set(src)  # output_norm and the tied token_embd included, nothing left behind
