"""The paged KV cache: the block allocator (engine/kv_blocks.py), block tables applied to a stage, and batched
attention (engine/paged_attention.py) giving each sequence of a batch exactly what it gets next to any others."""
from __future__ import annotations

import numpy as np
import pytest

from engine.errors import RangeError
from engine.kv_blocks import BLOCK_SIZE, BlockPool, PoolFull, blocks_for
from engine.stage import Column, Stage
from tests.tiny_gguf import write_tiny_gguf

B = BLOCK_SIZE


# ---- the allocator (pure bookkeeping)

def test_blocks_for():
    assert [blocks_for(n) for n in (0, 1, B, B + 1, 3 * B)] == [0, 1, 1, 2, 3]


def test_pool_hands_out_lowest_blocks_and_takes_them_back():
    p = BlockPool(6)
    assert p.ensure(0, 1) == (0,) and p.ensure(0, B) is None  # one block holds B positions
    assert p.ensure(1, 2 * B + 1) == (1, 2, 3) and p.ensure(0, B + 1) == (0, 4)
    assert p.free_blocks == 1 and p.used_blocks == 5 and p.capacity(1) == 3 * B and p.needed(1, 5 * B) == 2
    assert p.free(1) == 3 and p.free_blocks == 4 and p.table(1) == ()
    assert p.ensure(2, 2 * B) == (1, 2)  # freed blocks come back lowest first
    twin = BlockPool(6)  # the same calls give the same tables: stages driven alike agree without a word
    for slot, n in ((0, 1), (1, 2 * B + 1), (0, B + 1)):
        twin.ensure(slot, n)
    twin.free(1)
    twin.ensure(2, 2 * B)
    assert [twin.table(s) for s in range(3)] == [p.table(s) for s in range(3)]


def test_pool_full_allocates_nothing():
    p = BlockPool(3)
    p.ensure(0, 2 * B)
    with pytest.raises(PoolFull, match="slot 1 needs 2 more blocks.*1 of 3 are free"):
        p.ensure(1, 2 * B)
    assert p.table(1) == () and p.free_blocks == 1
    assert isinstance(PoolFull("x"), RangeError)


def test_assign_refuses_foreign_duplicate_and_outside_blocks():
    p = BlockPool(8)
    p.assign(0, [5, 2])
    assert p.table(0) == (5, 2) and p.free_blocks == 6
    for bad, msg in (([2], "belongs to slot 0"), ([1, 1], "listed twice"), ([8], "outside the pool")):
        with pytest.raises(RangeError, match=msg):
            p.assign(1, bad)
    assert p.table(1) == () and p.free_blocks == 6  # nothing changed
    p.assign(0, [2, 7])  # a slot's new table frees what it no longer lists
    assert p.table(0) == (2, 7) and p.ensure(1, 1) == (0,) and 5 not in p.table(0)
    p.assign(0, [])
    assert p.table(0) == () and p.free_blocks == 7
    p.reset()
    assert p.free_blocks == 8 and p.table(1) == ()


# ---- a stage's paged cache

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("paged") / "tiny.gguf", arch="qwen2", n_layers=2)


def _prompt(n, seed):
    return [(seed * 31 + 7 * i) % 250 + 3 for i in range(n)]


def _prefill(stage, slot, tokens):
    return stage.step_logits([Column(i, slot, i == len(tokens) - 1, t) for i, t in enumerate(tokens)])


def test_tables_sent_from_outside_equal_the_stages_own(model):
    """A stage that gets its tables (scattered blocks, as a coordinator might hand out) computes the same bits as
    one that grows its own: the kernels read every position through the table."""
    own = Stage.load(model, 0, 2, n_slots=2, max_context=128)
    sent = Stage.load(model, 0, 2, n_slots=2, max_context=128)
    sent.block_table(1, [15, 3, 9])
    prompt = _prompt(40, 1)
    a, b = _prefill(own, 1, prompt), _prefill(sent, 1, prompt)
    assert own.slot_blocks(1) == (0, 1, 2) and sent.slot_blocks(1) == (15, 3, 9)
    assert a.tobytes() == b.tobytes()
    step = [Column(40, 1, True, 11)]
    assert own.step_logits(step).tobytes() == sent.step_logits(step).tobytes()
    with pytest.raises(RangeError, match="belongs to slot 1"):
        sent.block_table(0, [3])
    with pytest.raises(RangeError, match="cannot hold the 41 positions"):
        sent.block_table(1, [15, 3])
    with pytest.raises(RangeError, match="exceed max_context"):
        sent.block_table(0, list(range(20, 29)))
    sent.block_table(1, [15, 3, 9, 4])  # growing ahead of a step: the step takes no block of its own
    sent.step([Column(41, 1, True, 5)])
    assert sent.slot_blocks(1) == (15, 3, 9, 4) and sent.free_blocks == sent.kv_blocks - 4


def test_a_batch_gives_each_sequence_what_it_gets_next_to_any_others(model):
    """Batched attention: one decode step over sequences of lengths 5, 23 and 40 gives each one's logits bitwise
    equal to the same step next to other companions, in another order and other slots, and to the sequence alone
    (one column takes the matvec, several the GEMM: both sum in one order, engine/quant_gemm.py)."""
    lengths = {0: 5, 1: 23, 2: 40}
    st = Stage.load(model, 0, 2, n_slots=4, max_context=128)
    for slot, n in lengths.items():
        _prefill(st, slot, _prompt(n, slot))
    cols = [Column(n, slot, True, 17 + slot) for slot, n in lengths.items()]
    together = st.step_logits(cols)

    other = Stage.load(model, 0, 2, n_slots=4, max_context=128)
    _prefill(other, 3, _prompt(40, 2))  # sequence 2 in slot 3
    _prefill(other, 0, _prompt(70, 9))  # two strangers, longer and shorter than every sequence above
    _prefill(other, 1, _prompt(2, 8))
    mixed = other.step_logits([Column(2, 1, True, 4), Column(40, 3, True, 19), Column(70, 0, True, 5)])
    assert mixed[1].tobytes() == together[2].tobytes()

    alone = Stage.load(model, 0, 2, n_slots=1, max_context=128)
    for slot, n in lengths.items():
        alone.reset()
        _prefill(alone, 0, _prompt(n, slot))
        got = alone.step_logits([Column(n, 0, True, 17 + slot)])[0]
        assert got.tobytes() == together[slot].tobytes(), f"sequence {slot} alone"


def test_a_pool_smaller_than_slots_times_context(model):
    """Memory follows lengths: 4 slots of 256 positions share 6 blocks; a full pool refuses with PoolFull, and a
    freed block's stale rows never reach the sequence that gets it next."""
    st = Stage.load(model, 0, 2, n_slots=4, max_context=256, kv_blocks=6)
    fresh = Stage.load(model, 0, 2, n_slots=1, max_context=256)
    assert st.kv_bytes * 17 == fresh.kv_bytes * 7  # 6 blocks + the trash block a layer, against 16 + 1
    _prefill(st, 0, _prompt(3 * B, 4))
    _prefill(st, 1, _prompt(2 * B, 5))
    with pytest.raises(PoolFull, match="slot 2 needs 2 more blocks"):
        _prefill(st, 2, _prompt(B + 1, 6))
    st.zero_slot(0)
    assert st.free_blocks == 4
    want = _prefill(fresh, 0, _prompt(50, 7))
    assert _prefill(st, 2, _prompt(50, 7)).tobytes() == want.tobytes()  # in slot 0's old blocks
    assert st.slot_blocks(2) == (0, 1, 2, 5)
