"""bench/synth_gguf.py: a synthetic model of a named shape loads in the engine and decodes like llama.cpp."""
import numpy as np
import pytest

from bench.synth_gguf import SHAPES, write_synthetic
from engine.gguf_meta import read_gguf, read_model_meta
from engine.stage import Column, Stage


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_synthetic_model_loads_and_decodes_as_llama_cpp_does(tmp_path, qtype):
    p = write_synthetic(tmp_path / "m.gguf", qtype=qtype, **SHAPES["tiny"], log=lambda *_: None)
    meta = read_model_meta(p)
    assert (meta.dim, meta.n_layers, meta.vocab_size, meta.tied_output) == (256, 2, 512, False)
    g = read_gguf(p)
    assert g.tensors["blk.1.ffn_down.weight"].shape == (256, 512)
    s = Stage.load(p, 0, 2, n_slots=1, max_context=64)
    prompt = [5 + i for i in range(8)]
    toks = [int(s.step([Column(i, 0, i == 7, t) for i, t in enumerate(prompt)])[0])]
    for i in range(4):
        toks.append(int(s.step([Column(8 + i, 0, True, toks[-1])])[0]))
    logits = s.step_logits([Column(12, 0, True, toks[-1])])
    assert np.isfinite(logits).all() and 0.3 < logits.std() < 3  # scales are sane: no blow-up, no collapse
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(p), n_ctx=64, n_threads=2, verbose=False)
    want = []
    for t in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        want.append(int(t))
        if len(want) == len(toks):
            break
    assert toks == want
