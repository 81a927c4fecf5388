"""Stage model on tiny random GGUFs: agreement with an independent numpy reference, bit-identical splits,
KV slots (batched decode, rollback, zeroing), sampling, and step validation."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

from engine.errors import EngineError, RangeError
from engine.sampling import pick_token
from engine.stage import PREFILL_BUCKETS, Column, Sampling, Stage, prefill_chunks
from tests.tiny_gguf import write_tiny_gguf

ARCHS = ["llama", "qwen2", "qwen3"]
PROMPT = [3, 17, 42, 7, 99]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return {a: write_tiny_gguf(d / f"{a}.gguf", arch=a, n_layers=4, seed=ARCHS.index(a)) for a in ARCHS}


# ---- an independent reference: gguf's own reader and dequantizer, llama.cpp's rope layouts, plain numpy

def reference_logits(path, tokens: list[int]) -> np.ndarray:
    r = GGUFReader(path)
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    f = lambda k: r.fields[f"{arch}.{k}"].parts[-1][0]
    L, H, KvH, eps, theta = int(f("block_count")), int(f("attention.head_count")), int(f("attention.head_count_kv")), \
        float(f("attention.layer_norm_rms_epsilon")), float(f("rope.freq_base"))
    W = {t.name: dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)]).astype(np.float64)
         for t in r.tensors}
    T = len(tokens)
    x = W["token_embd.weight"][tokens]
    norm = lambda v, w: v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w
    Hd = W["blk.0.attn_q.weight"].shape[0] // H
    inv = 1.0 / theta ** (np.arange(0, Hd, 2) / Hd)
    ang = np.arange(T)[:, None] * inv[None, :]  # (T, Hd/2)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(v):  # (T, heads, Hd)
        if arch == "llama":  # NORM: rotate adjacent pairs
            a, b = v[..., 0::2], v[..., 1::2]
            out = np.empty_like(v)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
            return out
        a, b = v[..., :Hd // 2], v[..., Hd // 2:]  # NEOX: rotate halves
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    for i in range(L):
        p = f"blk.{i}."
        h = norm(x, W[p + "attn_norm.weight"])
        q, k, v = (h @ W[p + n + ".weight"].T + W.get(p + n + ".bias", 0.0) for n in ("attn_q", "attn_k", "attn_v"))
        q, k, v = q.reshape(T, H, Hd), k.reshape(T, KvH, Hd), v.reshape(T, KvH, Hd)
        if p + "attn_q_norm.weight" in W:
            q, k = norm(q, W[p + "attn_q_norm.weight"]), norm(k, W[p + "attn_k_norm.weight"])
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, H // KvH, axis=1), np.repeat(v, H // KvH, axis=1)
        att = np.einsum("thd,shd->hts", q, k) / np.sqrt(Hd) + np.triu(np.full((T, T), -np.inf), 1)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", att, v).reshape(T, H * Hd) @ W[p + "attn_output.weight"].T
        h = norm(x, W[p + "ffn_norm.weight"])
        g = h @ W[p + "ffn_gate.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
    return norm(x, W["output_norm.weight"]) @ W.get("output.weight", W["token_embd.weight"]).T


def prefill_cols(tokens, slot=0, start=0):
    return [Column(start + i, slot, True, t) for i, t in enumerate(tokens)]


def run_chain(stages, cols, sampling=Sampling()):
    hidden = None
    for s in stages[:-1]:
        hidden = s.step(cols, hidden)
    return stages[-1].step(cols, hidden, sampling)


def chain_logits(stages, cols):
    hidden = None
    for s in stages[:-1]:
        hidden = s.step(cols, hidden)
    return stages[-1].step_logits(cols, hidden)


def load_split(path, cuts, **kw):
    bounds = [0, *cuts, 4]
    kw.setdefault("max_context", 64)
    return [Stage.load(path, a, b, **kw) for a, b in zip(bounds, bounds[1:])]


def greedy(stages, prompt, n, slot=0):
    tokens = [int(run_chain(stages, [Column(i, slot, i == len(prompt) - 1, t) for i, t in enumerate(prompt)])[0])]
    for i in range(n - 1):
        tokens.append(int(run_chain(stages, [Column(len(prompt) + i, slot, True, tokens[-1])])[0]))
    return tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_numpy_reference(models, arch):
    (stage,) = load_split(models[arch], [], weights="f32", kv_dtype="f32")
    got = stage.step_logits(prefill_cols(PROMPT))
    want = reference_logits(models[arch], PROMPT)
    assert got.shape == want.shape == (len(PROMPT), 256)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
    # decoding one more token through the cache agrees with a full recompute
    nxt = int(np.argmax(got[-1]))
    step = stage.step_logits([Column(len(PROMPT), 0, True, nxt)])
    np.testing.assert_allclose(step[0], reference_logits(models[arch], PROMPT + [nxt])[-1], rtol=0,
                               atol=2e-3 * np.abs(want).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_splits_are_bitwise_identical(models, arch):
    whole = load_split(models[arch], [])
    want_logits = chain_logits(whole, prefill_cols(PROMPT))
    want_tokens = greedy(whole, PROMPT, 6, slot=1)
    for cuts in ([2], [1, 2, 3]):
        split = load_split(models[arch], cuts)
        assert np.array_equal(chain_logits(split, prefill_cols(PROMPT)), want_logits), cuts
        assert greedy(split, PROMPT, 6, slot=1) == want_tokens, cuts


def test_stage_attributes(models):
    a, b = load_split(models["llama"], [1])
    assert (a.first, a.last, b.first, b.last) == (True, False, False, True)
    assert (a.start, a.end, b.start, b.end, a.dim) == (0, 1, 1, 4, 64)
    assert a.act_dtype == np.float32 and a.meta.n_layers == 4
    assert 0 < a.weight_bytes < b.weight_bytes and b.kv_bytes == 3 * a.kv_bytes
    h = a.step(prefill_cols([1, 2]))
    assert h.shape == (2, 64) and h.dtype == np.float32
    out = b.step([Column(0, 0, False, 0), Column(1, 0, True, 0)], np.zeros((2, 64), np.float32))
    assert out.dtype == np.int32 and out.shape == (1,)


def test_batched_decode_across_slots(models, monkeypatch):
    monkeypatch.setenv("MESH_CPU_INT8", "0")  # the reference is a model of f32 activations (engine/quant_i8.py)
    monkeypatch.setenv("MESH_KV_DTYPE", "f32")  # and of an f32 KV cache (engine/stage.py default_kv_dtype)
    (s,) = load_split(models["qwen2"], [])
    prompts = {0: [5, 6, 7], 2: [9, 8, 7, 6, 5], 3: [1]}
    single = {}
    for slot, p in prompts.items():
        single[slot] = s.step_logits(prefill_cols(p, slot))[-1]
    # one column from each of three sequences in one step, positions differing per slot
    batch_cols = [Column(len(p), slot, True, int(np.argmax(single[slot]))) for slot, p in prompts.items()]
    batched = s.step_logits(batch_cols)
    for j, (slot, p) in enumerate(prompts.items()):
        alone = reference_logits(models["qwen2"], p + [batch_cols[j].token])[-1]
        np.testing.assert_allclose(batched[j], alone, rtol=0, atol=5e-3 * np.abs(alone).max())
    assert [s.slot_length(i) for i in range(4)] == [4, 0, 6, 2]


def test_batched_picks_are_the_logits_picks(models):
    # a replayed step's last stage picks each column's token from the logits where the head wrote them (no copy),
    # greedy columns in one argmax: the same tokens as pick_token on step_logits' rows of the same step
    (s,) = load_split(models["llama"], [])
    for slot, p in enumerate([[5, 6, 7], [9, 8], [1, 2, 3, 4]]):
        s.step(prefill_cols(p, slot))
    cols = [Column(3, 0, True, 11), Column(2, 1, True, 12), Column(4, 2, True, 13)]
    mixed = [Sampling(), Sampling(temperature=0.9, top_p=0.9, seed=5), Sampling()]
    logits = s.step_logits(cols)    # compiles the shape: the steps below take the replay's raw path
    want_greedy = [int(np.argmax(row)) for row in logits]
    want_mixed = [pick_token(logits[j], mixed[j], c.pos) for j, c in enumerate(cols)]
    for sampling, want in [(Sampling(), want_greedy), (mixed, want_mixed), (Sampling(), want_greedy)]:
        for c in cols:
            s.rollback(c.slot, c.pos)
        assert s.step(cols, None, sampling).tolist() == want
    assert len(set(want_greedy)) > 1 and want_mixed != want_greedy   # the rows differ, the draw took another token


def test_rollback_replays_identically(models):
    (s,) = load_split(models["llama"], [])
    first = greedy([s], PROMPT, 6)
    s.rollback(0, len(PROMPT) + 2)  # keep the prompt and two decoded tokens
    again = [int(s.step([Column(len(PROMPT) + 2 + i, 0, True, first[2 + i])])[0]) for i in range(3)]
    assert again == first[3:6]
    with pytest.raises(RangeError, match="skips ahead"):
        s.step([Column(20, 0, True, 1)])
    with pytest.raises(RangeError, match="rollback"):
        s.rollback(0, 50)


def test_zero_slot_and_reset(models):
    (s,) = load_split(models["llama"], [])
    greedy([s], PROMPT, 2, slot=0)
    ref = greedy([s], PROMPT, 4, slot=1)
    s.zero_slot(1)
    assert s.slot_length(1) == 0 and s.slot_length(0) == len(PROMPT) + 1
    # the zeroed slot's KV blocks go back to the pool, its neighbour keeps its own
    assert s.slot_blocks(1) == () and len(s.slot_blocks(0)) == 1 and s.free_blocks == s.kv_blocks - 1
    with pytest.raises(RangeError):
        s.step([Column(3, 1, True, 1)])
    assert greedy([s], PROMPT, 4, slot=1) == ref
    s.reset()
    assert greedy([s], PROMPT, 4, slot=1) == ref


def test_sampling_reproducible_across_splits(models):
    whole, split = load_split(models["qwen3"], []), load_split(models["qwen3"], [2])
    samp = Sampling(temperature=1.5, top_k=40, top_p=0.9, seed=1234)

    def sample(stages, seed_sampling):
        out = [int(run_chain(stages, [Column(i, 0, i == 4, t) for i, t in enumerate(PROMPT)], seed_sampling)[0])]
        for i in range(10):
            out.append(int(run_chain(stages, [Column(5 + i, 0, True, out[-1])], seed_sampling)[0]))
        return out

    a = sample(whole, samp)
    for st in whole + split:
        st.reset()
    assert sample(split, samp) == a
    for st in whole:
        st.reset()
    assert sample(whole, Sampling(temperature=1.5, top_k=40, top_p=0.9, seed=99)) != a
    for st in whole:
        st.reset()
    top1 = sample(whole, Sampling(temperature=0.7, top_k=1, seed=5))
    for st in whole:
        st.reset()
    assert top1 == greedy(whole, PROMPT, 11)


def test_step_validation(models):
    a, b = load_split(models["llama"], [2])
    with pytest.raises(RangeError, match="slot 9"):
        a.step([Column(0, 9, False, 1)])
    with pytest.raises(RangeError, match="token ids"):
        a.step([Column(0, 0, False, 256)])
    with pytest.raises(RangeError, match="position 64"):
        a.step([Column(64, 0, False, 1)])
    with pytest.raises(RangeError, match="two separate runs"):
        a.step([Column(0, 0, False, 1), Column(0, 1, False, 1), Column(1, 0, False, 1)])
    with pytest.raises(EngineError, match="needs hidden"):
        b.step([Column(0, 0, True, 1)])
    with pytest.raises(EngineError, match="shape"):
        b.step([Column(0, 0, True, 1)], np.zeros((2, 64), np.float32))
    with pytest.raises(EngineError, match="not hidden"):
        a.step([Column(0, 0, False, 1)], np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match="top_p"):  # one rule for the wire and the engine (common.values)
        Sampling(top_p=1.5)


def test_weight_and_cache_modes_agree(models):
    (ref,) = load_split(models["qwen2"], [], weights="f32", kv_dtype="f32")
    want = ref.step_logits(prefill_cols(PROMPT))
    for weights, kv in (("gguf", "f32"), ("q8", "f16")):
        (s,) = load_split(models["qwen2"], [], weights=weights, kv_dtype=kv)
        assert s.kv_bytes == ref.kv_bytes // (2 if kv == "f16" else 1)
        np.testing.assert_allclose(s.step_logits(prefill_cols(PROMPT)), want, rtol=0, atol=0.05 * np.abs(want).max())


def test_prefill_chunks_cover_the_run_and_pad_only_at_the_end():
    for buckets in (PREFILL_BUCKETS, (16, 64)):
        sizes = {1, *buckets}
        for slack in (0, 1, 7, 15, 63, 1000):
            for n in range(1, 300):
                plan = prefill_chunks(n, slack, buckets)
                assert sum(k for k, _ in plan) == n, (n, slack)
                assert all(size in sizes and 1 <= k <= size for k, size in plan), (n, slack, plan)
                assert all(k == size for k, size in plan[:-1]), (n, slack, plan)  # only the last chunk pads
                assert plan[-1][1] - plan[-1][0] <= slack, (n, slack, plan)
    assert prefill_chunks(16, 0) == ((16, 16),) and prefill_chunks(5, 100) == ((5, 16),)
    assert prefill_chunks(5, 3) == ((1, 1),) * 5  # no room to pad: the decode step's shape
    assert prefill_chunks(17, 100) == ((16, 16), (1, 1)) and prefill_chunks(20, 100) == ((16, 16), (4, 16))
    assert prefill_chunks(64, 0, (16, 64)) == ((64, 64),)
    assert prefill_chunks(100, 100, (16, 64)) == ((64, 64), (16, 16), (16, 16), (4, 16))


def test_prompts_of_any_length_run_in_the_warmed_shapes(models):
    (s,) = load_split(models["llama"], [])  # 4 slots, context 64
    assert s.warmup(decode_batch=1).shapes == 1 + len(PREFILL_BUCKETS)  # the decode step and the buckets
    shapes = set(s._jits)
    for n in (2, 17, 40, 64):
        s.reset()
        out = s.step([Column(i, 1, i == n - 1, (7 * i) % 256) for i in range(n)])
        assert out.shape == (1,) and s.slot_length(1) == n
        if n < 64:
            s.step([Column(n, 1, True, int(out[0]))])
    s.reset()  # a prompt ending near the context's end: too close to pad, its tail goes in decode steps
    s.step([Column(i, 0, False, 5) for i in range(5)])
    assert s.step([Column(i, 0, i == 62, 5) for i in range(5, 63)]).shape == (1,)
    assert set(s._jits) == shapes


def test_chunked_prefill_agrees_with_the_reference_and_every_stage_keeps_the_kv(models, monkeypatch):
    """A prompt sent in pieces, only the last asking for logits (the coordinator's chunks): the last stage must
    write the KV of a piece without logits too, and a piece's chunks attend to the chunks before them."""
    monkeypatch.setenv("MESH_CPU_INT8", "0")  # the reference is a model of f32 activations (engine/quant_i8.py)
    monkeypatch.setenv("MESH_KV_DTYPE", "f32")  # and of an f32 KV cache (engine/stage.py default_kv_dtype)
    tokens = [(11 * i + 3) % 256 for i in range(60)]
    want = reference_logits(models["qwen3"], tokens)[20:]
    split = load_split(models["qwen3"], [2])
    run_chain(split, [Column(i, 0, False, tokens[i]) for i in range(20)])  # chunks of 16 and 4 (padded)
    got = chain_logits(split, [Column(i, 0, True, tokens[i]) for i in range(20, 60)])  # 16, 16 and 8 (padded)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())


@pytest.mark.parametrize("warm_run", ["0", "1"])
def test_warmup_leaves_no_trace(models, monkeypatch, warm_run):
    # "1": every warmed shape also runs once (what a GPU stage does, for its graphs): that leaves no trace either
    monkeypatch.setenv("MESH_WARM_RUN", warm_run)
    prompt = [(5 * i + 1) % 256 for i in range(21)]
    plain, warm = load_split(models["qwen2"], [2]), load_split(models["qwen2"], [2])
    for st in warm:
        res = st.warmup(decode_batch=1)
        assert res.shapes == 1 + len(PREFILL_BUCKETS) and res.ms > 0
        assert [st.slot_length(i) for i in range(4)] == [0] * 4
        rows = st.kv_blocks * st.kv_block_size  # every block but the trash block, where unowned rows write
        assert not st._blocks[0].pool_k.numpy()[:rows].any() and not st._blocks[0].pool_v.numpy()[:rows].any()
        assert st.free_blocks == st.kv_blocks
        assert st.warmup(decode_batch=1).shapes == 0  # nothing left to compile

    def session(stages):
        cols = [Column(i, 1, i == len(prompt) - 1, t) for i, t in enumerate(prompt)]
        out = [chain_logits(stages, cols)]
        for i in range(4):
            out.append(chain_logits(stages, [Column(len(prompt) + i, 1, True, int(np.argmax(out[-1])))]))
        return out

    assert all(np.array_equal(a, b) for a, b in zip(session(warm), session(plain)))
    with pytest.raises(EngineError, match="warmup"):
        warm[0].warmup()  # slot 1 holds the sequence
    (nojit,) = load_split(models["qwen2"], [], jit=False)
    assert nojit.warmup() == (0.0, 0)


def test_step_results_and_inputs_are_not_shared_between_steps(models):
    """A step's input and output device buffers are reused by the next step of the same shape: what a step returned
    must be the caller's own array, and the caller's input array is read, never kept."""
    a, b = load_split(models["llama"], [2])
    a.step(prefill_cols(PROMPT))
    h1 = a.step([Column(len(PROMPT), 0, False, 11)])
    keep = h1.copy()
    h2 = a.step([Column(len(PROMPT) + 1, 0, False, 12)])
    assert h1.flags.writeable and np.array_equal(h1, keep) and not np.array_equal(h1, h2)

    b.step(prefill_cols(PROMPT), np.zeros((len(PROMPT), 64), np.float32))
    x = h1.copy()
    l1 = b.step_logits([Column(len(PROMPT), 0, True)], x)
    x[:] = 0.0  # overwriting the caller's array after the step changes nothing the stage holds
    b.rollback(0, len(PROMPT))
    assert np.array_equal(b.step_logits([Column(len(PROMPT), 0, True)], h1), l1)


def test_kv_type_is_f16_on_the_cpu_unless_told(tmp_path, monkeypatch):
    from engine.stage import default_kv_dtype
    monkeypatch.delenv("MESH_KV_DTYPE", raising=False)
    assert default_kv_dtype("CPU") == "f16" and default_kv_dtype("CUDA") == "f32"
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=2)
    f16 = Stage.load(p, 0, 2, n_slots=2, max_context=64)
    monkeypatch.setenv("MESH_KV_DTYPE", "f32")
    assert default_kv_dtype("CPU") == "f32"
    f32 = Stage.load(p, 0, 2, n_slots=2, max_context=64)
    assert f16.kv_bytes * 2 == f32.kv_bytes  # the same pools, half the bytes
    monkeypatch.setenv("MESH_KV_DTYPE", "bf16")
    with pytest.raises(EngineError, match="MESH_KV_DTYPE='bf16'"):
        Stage.load(p, 0, 2, n_slots=2, max_context=64)
