"""Compiling a stage's step shapes: one captured layer reused for every layer (engine/shared_layers.py) against the
whole-step capture, bit for bit; what the reuse refuses; clearing slots without kernels."""
from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor

from engine.shared_layers import NotShareable, block_kind, block_tensors, capture_shared
from engine.stage import Column, Stage
from tests.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("warm") / "tiny.gguf", arch="qwen3", n_layers=4, seed=3)


def chain(stages, cols):
    h = None
    for s in stages:
        h = s.step_logits(cols, h) if s.last else s.step(cols, h)
    return h


def session(path, cuts, share):
    stages = [Stage.load(path, a, b, n_slots=2, max_context=64) for a, b in zip(cuts, cuts[1:])]
    for s in stages:
        s.share_layers = share
    out = [chain(stages, [Column(i, 0, True, t) for i, t in enumerate([3, 17, 42, 7, 99])]),  # a chunk of 16
           chain(stages, [Column(5, 0, True, 11)]),  # decode
           chain(stages, [Column(0, 1, True, 12), Column(6, 0, True, 13)]),  # two sequences
           chain(stages, [Column(i, 1, i == 19, 9) for i in range(1, 20)])]  # 16 + 3 of 16, one logits row
    return out, stages


@pytest.mark.parametrize("cuts", [[0, 4], [0, 1, 3, 4]])
def test_shared_layers_equal_the_whole_capture_bitwise(model, cuts):
    whole, ws = session(model, [0, 4], share=False)
    shared, ss = session(model, cuts, share=True)
    assert all(j.fxn is not None for j in ws[0]._jits.values())  # the whole step captured by TinyJit
    assert all(j.fxn is None for s in ss for j in s._jits.values())  # assembled from one layer per shape
    for a, b in zip(whole, shared):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_block_kind_tells_layers_apart(model):
    s = Stage.load(model, 0, 4, n_slots=1, max_context=32)
    b = s._blocks
    assert len({block_kind(x) for x in b}) == 1
    names = [t.shape for t in block_tensors(b[0])]
    # the KV pools ((blocks + trash) x block_size rows of kv_heads * head_dim) are inputs of the captured layer:
    # every layer writes its own; the stage's block table (slots x blocks per sequence) is an input of each too
    assert names.count((3 * 16, 2 * 16)) == 2 and (1, 2) in names
    assert block_tensors(b[0])[names.index((1, 2))] is block_tensors(b[1])[names.index((1, 2))]
    b[1].sliding_window = 8  # an attribute a layer kind could add
    assert block_kind(b[1]) != block_kind(b[0])


def test_a_layer_reading_a_tensor_it_does_not_hold_is_not_shared():
    class Layer:
        def __init__(self):
            self.w = Tensor.ones(8).contiguous().realize()

    hidden = Tensor.full((8,), 2.0).contiguous().realize()  # held outside the layer: would stay layer 0's
    x, cos, sin = (Tensor.zeros(n).contiguous().realize() for n in (8, 2, 2))
    with pytest.raises(NotShareable, match="not one of its inputs"):
        capture_shared([Layer(), Layer()], lambda blk, x_, c, s_: (x_ + blk.w * hidden).contiguous(), None,
                       (x, cos, sin), [])

    def layer(blk, x_, c, s_):  # two kernels: the one writing the output reads no x (as a transformer block's)
        return ((x_ + blk.w).contiguous().realize() * 2).contiguous()
    ok, _ = capture_shared([Layer(), Layer()], layer, None, (x, cos, sin), [])
    x.assign(Tensor.full((8,), 1.0)).realize()
    assert ok(x, cos, sin).tolist() == [10.0] * 8  # (1 + 1) * 2, then (4 + 1) * 2: chained through the output


def test_a_layer_overwriting_its_input_early_is_not_shared():
    class Layer:
        def __init__(self):
            self.w = Tensor.ones(8).contiguous().realize()

    x, cos, sin = (Tensor.zeros(n).contiguous().realize() for n in (8, 2, 2))

    def layer(blk, x_, c, s_):  # reads x after its output is written: x and the output cannot be one buffer
        y = (x_ * 2).contiguous().realize()
        return (y + x_ + blk.w).contiguous()
    with pytest.raises(NotShareable):
        capture_shared([Layer(), Layer()], layer, None, (x, cos, sin), [])


def test_zero_slot_frees_only_that_slots_blocks(model):
    s = Stage.load(model, 0, 4, n_slots=2, max_context=32)
    s.step([Column(i, slot, False, 5) for slot in (0,) for i in range(3)])
    s.step([Column(i, 1, False, 6) for i in range(3)])
    c = s._blocks[2].pool_k
    b0, b1 = s.slot_blocks(0), s.slot_blocks(1)
    assert len(b0) == len(b1) == 1 and b0 != b1
    rows = lambda b: c.numpy()[b[0] * s.kv_block_size:b[0] * s.kv_block_size + 3]
    assert np.abs(rows(b0)).sum() > 0 and np.abs(rows(b1)).sum() > 0
    s.zero_slot(0)  # bookkeeping only: a freed block's rows are never read unmasked
    assert s.slot_blocks(0) == () and s.slot_blocks(1) == b1 and s.free_blocks == s.kv_blocks - 1
    s.reset()
    assert s.slot_blocks(1) == () and s.free_blocks == s.kv_blocks and s.slot_length(1) == 0


# ---- compiled programs on disk (engine/program_cache.py)

def test_programs_come_back_from_disk_and_a_corrupt_file_is_ignored(model, tmp_path, monkeypatch):
    from tinygrad.codegen import to_program_cache

    from engine import program_cache
    monkeypatch.setenv("MESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MESH_SHARED_LAYERS", "0")  # whole-step captures: the step templates would skip compiling
    first = Stage.load(model, 0, 4, n_slots=1, max_context=32)
    path = first._program_file
    assert path is not None and str(path).startswith(str(tmp_path))
    want = first.step_logits([Column(0, 0, True, 7)])
    saved = program_cache.load_programs(path)
    assert saved and saved == first._programs_on_disk
    removed = {k: to_program_cache.pop(k) for k in saved}  # as in a fresh process: nothing compiled yet
    again = Stage.load(model, 0, 4, n_slots=1, max_context=32)  # loads them back at its first capture
    n = len(to_program_cache)
    assert np.array_equal(again.step_logits([Column(0, 0, True, 7)]), want)
    assert all(k in to_program_cache for k in removed)
    assert len(to_program_cache) == n + len(removed)  # the capture compiled nothing new

    blob = bytearray(path.read_bytes())
    blob[-10] ^= 0xFF  # a flipped bit: the checksum fails, the file is not unpickled
    path.write_bytes(bytes(blob))
    assert program_cache.load_programs(path) == set()
    path.write_bytes(b"garbage")
    assert program_cache.load_programs(path) == set()
    for k in removed:
        to_program_cache.pop(k, None)
    third = Stage.load(model, 0, 4, n_slots=1, max_context=32)
    assert np.array_equal(third.step_logits([Column(0, 0, True, 7)]), want)  # compiled again, same bits
    assert program_cache.load_programs(path) == third._programs_on_disk != set()  # and the file rewritten


def test_helper_programs_are_compiled_once_per_machine(tmp_path, monkeypatch):
    """engine/cpu_runner.py's step runner is compiled by tinygrad in every process; `compiled` keeps it on disk."""
    from dataclasses import replace

    from tinygrad import Device, UOp
    from tinygrad.codegen import to_program_cache
    from tinygrad.renderer.cstyle import ClangRenderer
    from tinygrad.uop.ops import KernelInfo

    from engine import program_cache
    monkeypatch.setenv("MESH_CACHE_DIR", str(tmp_path))
    clang = ClangRenderer(replace(Device["CPU"].renderer.target, renderer="CLANG"))  # as cpu_runner compiles
    sink = UOp.sink(arg=KernelInfo("mesh_test_noop"), tag=1)
    key = program_cache.to_program_key(sink, clang)
    to_program_cache.pop(key, None)
    first = program_cache.compiled(sink, clang)
    assert to_program_cache.pop(key) is first and len(list((tmp_path / "programs").iterdir())) == 1
    monkeypatch.setattr(program_cache, "to_program", lambda *a: pytest.fail("compiled again"))
    again = program_cache.compiled(sink, clang)  # as in a fresh process: from the disk
    assert again.src[-1].arg == first.src[-1].arg and to_program_cache[key] is again
    to_program_cache.pop(key)


def test_the_template_key_follows_settings_changed_inside_a_process(monkeypatch):
    from engine.program_cache import code_identity
    before = code_identity()
    monkeypatch.setenv("MESH_TEST_KERNEL_SETTING", "1")  # any MESH_* variable may steer a kernel
    assert code_identity() != before
    monkeypatch.delenv("MESH_TEST_KERNEL_SETTING")
    monkeypatch.setenv("MESH_CACHE_DIR", "/elsewhere")  # where files go is not how kernels are made
    assert code_identity() == before


# ---- step templates on disk (engine/shared_layers.py Template, kept by Stage._capture)

@pytest.fixture
def counted_layers(monkeypatch):
    """How many times a layer's graph was built (a capture); 0 when every shape came from its template."""
    calls, orig = [], Stage._layer

    def counted(self, *a):
        calls.append(1)
        return orig(self, *a)
    monkeypatch.setattr(Stage, "_layer", counted)
    return calls


def test_a_cold_start_from_step_templates_schedules_nothing_and_gives_the_same_bits(model, tmp_path, monkeypatch,
                                                                                     counted_layers):
    monkeypatch.setenv("MESH_CACHE_DIR", str(tmp_path))
    cols = [[Column(i, 0, i == 4, t) for i, t in enumerate([3, 17, 42, 7, 99])], [Column(5, 0, True, 11)]]

    def run():
        stage = Stage.load(model, 0, 4, n_slots=1, max_context=32)
        return [stage.step_logits(c) for c in cols]
    want = run()
    assert counted_layers  # captured: one layer per shape
    counted_layers.clear()
    assert all(np.array_equal(a, b) for a, b in zip(want, run()))
    assert not counted_layers  # every shape from its template: no layer graph built, nothing scheduled

    for f in (tmp_path / "programs").glob("*.bin"):  # damaged files: ignored, captured anew, rewritten
        f.write_bytes(f.read_bytes()[:-100])
    assert all(np.array_equal(a, b) for a, b in zip(want, run()))
    assert counted_layers
    counted_layers.clear()
    run()
    assert not counted_layers


def test_a_template_that_does_not_fit_the_stage_is_not_used(model, tmp_path, monkeypatch, counted_layers):
    from engine.program_cache import read_blob, write_blob
    monkeypatch.setenv("MESH_CACHE_DIR", str(tmp_path))
    decode = (1, ((0, 1),), -1)  # one column, its logits: "every row"
    mine = Stage.load(model, 0, 4, n_slots=1, max_context=32)
    want = mine.step_logits([Column(0, 0, True, 9)])
    other = Stage.load(model, 0, 4, n_slots=2, max_context=48)  # other cache shapes, so other templates
    other.step_logits([Column(0, 0, True, 9)])
    assert mine._template_file(decode).exists() and other._template_file(decode).exists()
    write_blob(mine._template_file(decode), read_blob(other._template_file(decode)))  # under this one's name
    counted_layers.clear()
    again = Stage.load(model, 0, 4, n_slots=1, max_context=32)
    assert np.array_equal(again.step_logits([Column(0, 0, True, 9)]), want)
    assert counted_layers  # refused (its KV cache inputs have another size) and captured anew


def test_a_view_of_a_layer_buffer_made_while_building_the_graph_follows_each_layer():
    """The GPU matvec reads its uint8 blocks as uint32 words through a view Buffer made while the graph is built
    (quant._words), which is not the jit's PARAM: the template takes the same view of every layer's buffer."""
    from tinygrad import UOp, dtypes

    class Layer:
        def __init__(self, v):
            self.w = Tensor([v] * 8, dtype=dtypes.int32).contiguous().realize()

    def words(t):  # int32 -> float32 bits, as a view Buffer like quant._words
        b = t.uop.buffer
        return Tensor(UOp.from_buffer(b.view(b.size, dtypes.float32, 0)))
    x, cos, sin = (Tensor.zeros(n).contiguous().realize() for n in (8, 2, 2))
    layers = [Layer(0x3F800000), Layer(0x40000000)]  # the bits of 1.0 and 2.0

    def layer(blk, x_, c, s_):
        return ((x_ + words(blk.w)).contiguous().realize() * 1.5).contiguous()
    jit, templates = capture_shared(layers, layer, None, (x, cos, sin), [])
    assert any(t.views for t in templates.values())
    assert jit(x, cos, sin).tolist() == [((0 + 1.0) * 1.5 + 2.0) * 1.5] * 8  # layer 1 added its own 2.0
