"""The gemma3 architecture on tiny synthetic GGUFs: logits equal an independent numpy forward pass (local layers'
window, rope bases, post-norms, GELU, embedding scale), the sliding layers' KV ring wraps without changing a logit,
any split is bitwise the unsharded run, batched decode of several slots over the ring, bounded rollback."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

import engine.gemma3 as gemma3_mod
from engine.errors import RangeError
from engine.gguf_meta import read_gguf, read_model_meta
from engine.stage import Column, Stage
from tests.tiny_gguf import write_tiny_gguf

N_LAYERS, DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, WINDOW = 7, 64, 4, 2, 32, 128, 256, 8


@pytest.fixture(scope="module", autouse=True)
def _f32_activations():
    """The numpy forward pass below is a model of f32 activations: keep the CPU's 8-bit-activation path
    (engine/quant_i8.py, tests/test_engine_i8.py) off for this module's stages (shared across its tests)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MESH_CPU_INT8", "0")
        mp.setenv("MESH_KV_DTYPE", "f32")  # the reference keeps its KV in f32
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # layers 0-4 and 6 local, 5 global; head_dim 32 != dim / heads, as Gemma's 256 != 640 / 4
    return write_tiny_gguf(tmp_path_factory.mktemp("g3") / "gemma3.gguf", arch="gemma3", n_layers=N_LAYERS, dim=DIM,
                           n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, ffn_dim=FFN, vocab_size=VOCAB,
                           context_length=1024, rope_theta=1e6, norm_eps=1e-6, sliding_window=WINDOW, seed=3)


# --- an independent forward pass in numpy (float64), from the GGUF's dequantized tensors --------------------------

def _tensors(path) -> dict[str, np.ndarray]:
    g = read_gguf(path)
    out = {}
    with open(path, "rb") as f:
        for name, t in g.tensors.items():
            f.seek(t.offset)
            raw = np.frombuffer(f.read(t.nbytes), np.uint8)
            if t.ggml_type == GGMLQuantizationType.F32:
                out[name] = raw.view(np.float32).reshape(t.shape).astype(np.float64)
            else:
                out[name] = dequantize(raw.reshape(t.shape[0], -1), GGMLQuantizationType(t.ggml_type)).astype(np.float64)
    return out


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope_neox(x, pos, theta):  # x (T, heads, d): rotate the halves (llama.cpp's NEOX rope)
    d = x.shape[-1]
    ang = pos[:, None] * (1.0 / theta ** (np.arange(0, d, 2) / d))[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def reference_logits(w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """Logits of every position, written from llama.cpp's gemma3 graph independently of engine/gemma3.py."""
    T = len(tokens)
    pos = np.arange(T, dtype=np.float64)
    x = w["token_embd.weight"][tokens] * np.sqrt(DIM)
    causal = pos[None, :] <= pos[:, None]
    for il in range(N_LAYERS):
        b = f"blk.{il}."
        local = il % 6 < 5
        mask = causal & (pos[:, None] - pos[None, :] < WINDOW) if local else causal
        h = _rms(x, w[b + "attn_norm.weight"])
        q = (h @ w[b + "attn_q.weight"].T).reshape(T, HEADS, HEAD_DIM)
        k = (h @ w[b + "attn_k.weight"].T).reshape(T, KV_HEADS, HEAD_DIM)
        v = (h @ w[b + "attn_v.weight"].T).reshape(T, KV_HEADS, HEAD_DIM)
        q, k = _rms(q, w[b + "attn_q_norm.weight"]), _rms(k, w[b + "attn_k_norm.weight"])
        theta = 10000.0 if local else 1e6
        q, k = _rope_neox(q, pos, theta) / np.sqrt(HEAD_DIM), _rope_neox(k, pos, theta)
        k, v = np.repeat(k, HEADS // KV_HEADS, 1), np.repeat(v, HEADS // KV_HEADS, 1)
        att = np.einsum("thd,shd->hts", q, k)
        att = np.where(mask[None], att, -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", att, v).reshape(T, HEADS * HEAD_DIM)
        x = x + _rms(o @ w[b + "attn_output.weight"].T, w[b + "post_attention_norm.weight"])
        h = _rms(x, w[b + "ffn_norm.weight"])
        f = _gelu_tanh(h @ w[b + "ffn_gate.weight"].T) * (h @ w[b + "ffn_up.weight"].T)
        x = x + _rms(f @ w[b + "ffn_down.weight"].T, w[b + "post_ffw_norm.weight"])
    return _rms(x, w["output_norm.weight"]) @ w["token_embd.weight"].T


def greedy(stages: list[Stage], prompt: list[int], n: int, slot: int = 0) -> tuple[list[int], list[np.ndarray]]:
    tokens, logits = list(prompt), []
    cols = [Column(i, slot, i == len(prompt) - 1, t) for i, t in enumerate(prompt)]
    for _ in range(n):
        hidden = None
        for s in stages[:-1]:
            hidden = s.step(cols, hidden)
        row = stages[-1].step_logits(cols, hidden)[0]
        logits.append(row)
        tokens.append(int(np.argmax(row)))
        cols = [Column(len(tokens) - 1, slot, True, tokens[-1])]
    return tokens, logits


PROMPT = [5, 17, 200, 3, 99, 42, 7, 180, 64, 11, 250, 33, 8, 120, 77, 2, 19, 140, 66, 5, 230, 41]
CTX = 512  # window 8: the local layers keep a ring of 8 + RING_SLACK positions, which the tests go past


@pytest.fixture(scope="module")
def whole(tiny):
    """The unsharded model, shared by the tests (each compiled step shape is kept); each test starts from reset."""
    st = Stage.load(tiny, 0, N_LAYERS, n_slots=2, max_context=CTX)
    yield st
    st.reset()


def test_meta_describes_gemma3(tiny):
    m = read_model_meta(tiny)
    assert (m.arch, m.sliding_window, m.rope_theta_local, m.ffn_act, m.post_norms) == ("gemma3", WINDOW, 1e4, "gelu", True)
    assert [m.is_sliding(i) for i in range(N_LAYERS)] == [True] * 5 + [False, True]
    assert m.embed_scale == pytest.approx(8.0) and m.attn_scale == pytest.approx(HEAD_DIM ** -0.5)


def test_logits_equal_numpy_reference_while_the_ring_wraps(tiny, whole):
    # the 22-token prompt (two prefill chunks) and 60 decode steps go past the ring's length
    st = whole
    st.reset()
    ring = {b.ring for b in st._blocks if b.sliding_window}
    assert ring == {WINDOW + gemma3_mod.RING_SLACK} and len(PROMPT) + 60 > WINDOW + gemma3_mod.RING_SLACK
    tokens, logits = greedy([st], PROMPT, 60)
    ref = reference_logits(_tensors(tiny), tokens[:-1])
    for i, row in enumerate(logits):
        np.testing.assert_allclose(row, ref[len(PROMPT) - 1 + i], rtol=0, atol=2e-4, err_msg=f"step {i}")


def test_any_split_is_bitwise_the_unsharded_run(tiny, whole):
    whole.reset()
    expected, expected_logits = greedy([whole], PROMPT, 12)
    cuts = (0, 5, 6, N_LAYERS)  # three stages, the global layer 5 alone in the middle one
    stages = [Stage.load(tiny, a, b, n_slots=2, max_context=CTX) for a, b in zip(cuts, cuts[1:])]
    tokens, logits = greedy(stages, PROMPT, 12)
    assert tokens == expected
    for a, b in zip(logits, expected_logits):
        assert np.array_equal(a, b)


def test_batched_decode_of_slots_at_different_places_in_the_ring(whole):
    st = whole
    st.reset()
    # slot 0 alone past the ring's first wrap, slot 1 alone from a shorter prompt
    alone0, _ = greedy([st], PROMPT * 4, 10, slot=0)
    alone1, _ = greedy([st], PROMPT[:5], 10, slot=1)
    st.reset()
    # both again, decoding in the same steps
    seqs = [list(PROMPT * 4), list(PROMPT[:5])]
    for slot, seq in enumerate(seqs):
        first = st.step([Column(i, slot, i == len(seq) - 1, t) for i, t in enumerate(seq)])
        seq.append(int(first[0]))
    for _ in range(9):
        cols = [Column(len(s) - 1, slot, True, s[-1]) for slot, s in enumerate(seqs)]
        for s, t in zip(seqs, st.step(cols)):
            s.append(int(t))
    assert seqs == [alone0, alone1]


def test_rollback_within_the_ring_slack_and_refused_beyond(whole):
    st = whole
    st.reset()
    seq, _ = greedy([st], PROMPT * 5, 8)  # 110 prompt positions: the ring has wrapped
    n = len(seq) - 1  # positions the slot holds
    with pytest.raises(RangeError, match="sliding-window"):
        st.rollback(0, n - gemma3_mod.RING_SLACK - 1)
    st.rollback(0, n - 4)  # forget 4 positions, then run them again: the same tokens come back
    redo = [Column(i, 0, i == n - 1, seq[i]) for i in range(n - 4, n)]
    assert int(st.step(redo)[0]) == seq[n]


def test_local_layers_hold_only_their_ring(tiny):
    st = Stage.load(tiny, 0, N_LAYERS, n_slots=2, max_context=1024)
    per_pos = 2 * 2 * KV_HEADS * HEAD_DIM * 4  # k and v, 2 slots, f32
    ring = WINDOW + gemma3_mod.RING_SLACK
    # the global layer pages: 2 slots x 1024 positions of blocks, plus the trash block (engine/paged_attention.py)
    assert st.kv_bytes == per_pos * (6 * ring) + per_pos // 2 * (2 * 1024 + st.kv_block_size)


def test_prefill_chunks_fit_the_ring_slack():
    # a step writes its keys into the ring before attending: a chunk may hold at most RING_SLACK + 1 columns
    from engine.stage import PREFILL_BUCKETS
    assert max(PREFILL_BUCKETS) <= gemma3_mod.RING_SLACK + 1
