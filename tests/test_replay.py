"""Replay: an answer whose chain failed goes on from its prompt and the tokens it already generated, fed onto the
next chain as that chain would have computed them, and continues bitwise as if nothing had failed (greedy and
seeded). Tiny model, one Stage in this process; the service's side (many HTTP streams, a peer killed or frozen) is
tests/test_serve_faults.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import trio

from common.values import Sampling
from engine.stage import Stage
from mesh.pipeline import LocalPipeline
from mesh.scheduler import QueueFull, Request, Scheduler, _Core, _Seq
from tests.mesh_fixtures import write_tiny_chat_model
from tests.test_scheduler import CONTEXT, N_LAYERS, N_SLOTS, InProcess, sampled, streams


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny.gguf", n_layers=N_LAYERS)


@pytest.fixture(scope="module")
def stage(model):
    return Stage.load(model, 0, N_LAYERS, n_slots=N_SLOTS, max_context=CONTEXT)


@pytest.fixture
def local(stage):
    stage.reset()
    return InProcess(stage)


def cuts(n_prompt: int, n_out: int) -> list[int]:
    """Where to cut a stream's answer for its replay: after the first token, in the middle, before the last, and
    where prompt + replay ends one past a prefill chunk (the replay's lone last column)."""
    ks = {1, n_out // 2, n_out - 1} | {k for k in range(1, n_out) if (n_prompt + k) % 16 == 1}
    return sorted(k for k in ks if 1 <= k < n_out)


def replayed(req: Request, out: list[int], k: int) -> Request:
    return Request(req.prompt_ids, req.max_tokens, req.sampling, req.stop_ids, replay=tuple(out[:k]))


def _rows(pool: np.ndarray, rows: list[int], B: int, keys: bool) -> np.ndarray:
    """Pool rows as (len(rows), width): the CPU keeps each key block transposed, [block][value][position]
    (engine/paged_attention.py `_k_at`)."""
    if not keys:
        return pool[rows]
    W = pool.shape[-1]
    blocks = pool.reshape(-1, W, B)                 # the same memory, each block [value][position]
    return np.stack([blocks[r // B, :, r % B] for r in rows]) if rows else pool[:0]


class Recording(InProcess):
    """The stage of InProcess, keeping each slot's KV rows (every layer, k and v) as they are when it is zeroed."""

    def __init__(self, stage: Stage):
        super().__init__(stage)
        self.kv: dict[int, list[np.ndarray]] = {}

    async def zero_slot(self, slot):
        st = self.stage
        table = st._pool.table(slot)
        rows = [table[p // st.kv_block_size] * st.kv_block_size + p % st.kv_block_size
                for p in range(st._lengths[slot])]
        self.kv[slot] = [_rows(t.numpy(), rows, st.kv_block_size, keys=t is b.pool_k)
                         for b in st._blocks for t in (b.pool_k, b.pool_v)]
        await super().zero_slot(slot)


async def run_all(rec: Recording, reqs: list[Request], *, resumed: bool = False):
    """All requests at once through one scheduler: each one's tokens and its slot's KV rows when it ended."""
    rec.stage.reset()
    rec.kv.clear()
    sched = Scheduler(LocalPipeline(rec), n_slots=N_SLOTS, max_context=CONTEXT)
    outs: list[list[int]] = [[] for _ in reqs]
    slots = [-1] * len(reqs)

    async def consume(i: int) -> None:
        async with sched.open(reqs[i], resumed=resumed) as g:
            outs[i] = [t async for t in g]
            slots[i] = g._seq.slot
        assert g.finish_reason == "length" and g.completion_tokens == reqs[i].max_tokens
        assert g.prompt_tokens == len(reqs[i].prompt_ids)

    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        async with trio.open_nursery() as clients:
            for i in range(len(reqs)):
                clients.start_soon(consume, i)
        with trio.fail_after(30):
            await sched.wait_idle()        # every slot zeroed, so every KV recorded
        nursery.cancel_scope.cancel()
    return outs, [rec.kv[s] for s in slots]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
async def test_replayed_streams_go_on_bitwise_as_if_nothing_failed(stage, seeded):
    """8 streams (prompts of 1..64 tokens, 16k + 1 among them) run together; then every stream is replayed from
    several cuts of its answer, the replays of 8 cuts together in one scheduler: each gives exactly the rest of its
    answer, and its KV rows (all positions, every layer) are bitwise those of the run that did not fail."""
    rec = Recording(stage)
    reqs = sampled(streams()) if seeded else streams()
    outs, kv = await run_all(rec, reqs)
    plans = [(i, k) for i, (r, o) in enumerate(zip(reqs, outs)) for k in cuts(len(r.prompt_ids), len(o))]
    for at in range(0, len(plans), 8):
        batch = plans[at:at + 8]
        got, got_kv = await run_all(rec, [replayed(reqs[i], outs[i], k) for i, k in batch], resumed=True)
        for (i, k), toks, rows in zip(batch, got, got_kv):
            assert toks == outs[i][k:], f"stream {i} replayed after {k} tokens"
            assert all(np.array_equal(a, b) for a, b in zip(rows, kv[i])), f"stream {i} after {k}: KV differs"


async def test_a_replay_in_one_slot_equals_the_answer(local):
    """One slot: every decode column was a step alone; the replay's whole chunks are steps of 16 and its rest
    steps alone, the same bits (the engine's columns do not depend on a step's width)."""
    pipe = LocalPipeline(local)
    req = streams()[1]
    sched_kw = dict(n_slots=1, max_context=CONTEXT)

    async def run(r: Request) -> list[int]:
        local.stage.reset()
        sched = Scheduler(pipe, **sched_kw)
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run)
            async with sched.open(r) as g:
                out = [t async for t in g]
            nursery.cancel_scope.cancel()
        return out
    full = await run(req)
    for k in (1, 5, len(full) - 1):
        assert await run(replayed(req, full, k)) == full[k:], k


def test_replay_chunks_and_the_queue():
    """The core's cut of a replay (the prompt's chunks as alone, whole chunks of 16 replayed columns, the rest as
    decode columns, their picks dropped) and a resumed request's place: ahead of new ones, past the queue's
    bound."""
    core = _Core(slots=range(2), max_queue=0, depth=1, prefill_chunk=16)
    replay = tuple(range(30, 49))                              # 19 tokens: one chunk of 16, then 3 decode columns
    seq = _Seq(None, Request(tuple(range(3, 20)), 40, Sampling(seed=9, temperature=0.5), replay=replay), 40)
    core.enqueue(seq)
    assert core.admit() == [seq]
    steps = []
    while seq.emitted == len(replay):
        b = core.form()
        steps.append((b.kind, [(c.pos, c.slot, c.needs_logits, c.token) for c in b.cols]))
        core.apply(b, [7] * sum(c.needs_logits for c in b.cols))
    assert [(kind, len(cols)) for kind, cols in steps] == [("prefill", 16), ("prefill", 1), ("prefill", 16),
                                                           ("decode", 1), ("decode", 1), ("decode", 1)]
    assert not any(logits for _, cols in steps[:3] for *_, logits, _ in cols)
    assert [cols[0] for _, cols in steps[3:]] == [(33, 0, True, 46), (34, 0, True, 47), (35, 0, True, 48)]
    assert seq.emitted == 20 and seq.pos == 36 and seq.next_tok == 7  # only the last pick is the answer's
    waiting = [_Seq(None, Request((3,), 4), 4) for _ in range(3)]
    core.enqueue(waiting[0])                                   # slot 1 is free: this one may wait
    with pytest.raises(QueueFull):
        core.enqueue(waiting[1])
    resumed = _Seq(None, Request((3,), 4, replay=(5,)), 4, resumed=True)
    core.enqueue(resumed)
    assert list(core.queue) == [resumed, waiting[0]]


def test_a_replay_as_long_as_the_answer_is_refused():
    sched = Scheduler(LocalPipeline(None), n_slots=3, max_context=64)
    with pytest.raises(ValueError, match="replay has 4 tokens"):
        sched.open(Request((3, 4), 4, replay=(5, 6, 7, 8)))
