"""The tensor-core matvec (engine/matvec_gpu_tc.py) on tinygrad's PYTHON device, which emulates CUDA's mma.sync
m16n8k16 (runtime/ops_python.py: the WMMA op with device "CUDA", fragments lane by lane). The emulator adds an MMA's
products in Python floats, so its sums are closer than the tensor cores' f32 ones: bounds against float64 here check
the decode, the layout and the pieces of x; the device's own error is what bench/matvec_bench.py --tc prints.
MESH_GPU_TEST_DEV=CUDA runs the same checks on a GPU."""
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from tinygrad import Tensor

from engine.matvec_gpu_tc import tc_layout, tc_matmul_t, tc_repack, tc_unpack
from tests.test_engine_quant import blocks_of

DEV = os.environ.get("MESH_GPU_TEST_DEV", "PYTHON")


def _any_quants(qtype: str, rows: int, cols: int, seed: int = 7) -> np.ndarray:
    """Blocks with every quant value possible (random bytes), the scales of real blocks."""
    raw = blocks_of(qtype, rows, cols).copy()
    per = {"Q4_0": 18, "Q8_0": 34}[qtype]
    blocks = raw.reshape(rows, -1, per)
    blocks[:, :, 2:] = np.random.default_rng(seed).integers(0, 256, blocks[:, :, 2:].shape, dtype=np.uint8)
    return raw


def _weight(raw: np.ndarray, qtype: str) -> tuple[Tensor, Tensor]:
    words, scales = tc_repack(raw, Q[qtype])
    return Tensor(words, device=DEV).realize(), Tensor(scales, device=DEV).realize()


def _run(w: tuple[Tensor, Tensor], qtype: str, x: np.ndarray, **kw) -> np.ndarray:
    return tc_matmul_t(*w, Q[qtype], Tensor(x, device=DEV), **kw).numpy()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_the_repack_keeps_the_files_bytes(qtype):
    raw = _any_quants(qtype, 48, 256)
    words, scales = tc_repack(raw, Q[qtype])
    assert words.nbytes + scales.nbytes == raw.nbytes  # regrouped, not widened
    np.testing.assert_array_equal(tc_unpack(words, scales, Q[qtype]), raw)


@pytest.mark.parametrize("qtype,rows,cols,n", [
    ("Q4_0", 32, 256, 1), ("Q8_0", 32, 256, 1),  # S = 8 warps over a row's blocks
    ("Q4_0", 48, 128, 3), ("Q8_0", 16, 704, 2),  # 3 tiles; 22 blocks (S = 2), as the 1.1B ffn_down's 176
    ("Q8_0", 80, 128, 9), ("Q4_0", 64, 64, 16),  # two column tiles (ragged, full)
    ("Q8_0", 32, 128, 37)])  # three groups of columns on the grid (a prefill chunk)
def test_tc_matvec_against_float64(qtype, rows, cols, n):
    raw = _any_quants(qtype, rows, cols)
    x = np.random.default_rng(1).standard_normal((n, cols)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize(raw, Q[qtype]).reshape(rows, cols).astype(np.float64).T
    got = _run(_weight(raw, qtype), qtype, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_sixteen_warps_over_a_row_and_two_tiles_a_warp(monkeypatch):
    """The 8B ffn_down's layout (S = 16 warps over a row's blocks, x split in registers for 2 tiles a warp), forced
    on a small matrix: right against float64, a column's bits alone and in a batch."""
    monkeypatch.setenv("MESH_GPU_TC_SPLIT", "16")
    monkeypatch.setenv("MESH_GPU_TC_WARPS", "1")
    assert tc_layout(4, 16, 9) == (16, 2, False)
    raw = _any_quants("Q8_0", 64, 512)
    w = _weight(raw, "Q8_0")
    x = np.random.default_rng(2).standard_normal((9, 512)).astype(np.float32)
    got = _run(w, "Q8_0", x)
    want = x.astype(np.float64) @ dequantize(raw, Q.Q8_0).reshape(64, 512).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    np.testing.assert_array_equal(_run(w, "Q8_0", x[8:]), got[8:])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_x_keeps_f32s_precision_and_range(qtype):
    """The three bf16 pieces hold x exactly over f32's whole range: with one quant a row, each output is d q x_k,
    right to f32's rounding for x from 1e-30 to 1e30 (f16 pieces would lose the small ones to subnormals and the
    large ones to infinity; one bf16 piece would keep 8 bits of 24)."""
    rows, cols = 16, 256
    raw = blocks_of(qtype, rows, cols).copy()
    per, zero = {"Q4_0": (18, 0x88), "Q8_0": (34, 0)}[qtype]
    blocks = raw.reshape(rows, -1, per)
    blocks[:, :, 2:] = zero  # every quant 0 (Q4_0: nibble 8) ...
    rng = np.random.default_rng(3)
    ks = rng.choice(cols, rows, replace=False)
    for r, k in enumerate(ks):  # ... but one a row
        b, j = divmod(int(k), 32)
        if qtype == "Q8_0":
            blocks[r, b, 2 + j] = 0x80 | 0x35  # -75
        else:
            byte = 2 + (j % 16)
            blocks[r, b, byte] = (blocks[r, b, byte] & (0x0F if j >= 16 else 0xF0)) | ((3 << 4) if j >= 16 else 3)
    x = (rng.standard_normal((2, cols)) * 10.0 ** rng.uniform(-30, 30, (2, cols))).astype(np.float32)
    want = x.astype(np.float64) @ dequantize(raw, Q[qtype]).reshape(rows, cols).astype(np.float64).T
    got = _run(_weight(raw, qtype), qtype, x)
    np.testing.assert_allclose(got, want, rtol=2 ** -21, atol=0)  # a few roundings of f32 (the MMA chain, d)


@pytest.mark.parametrize("qtype,rows,cols,norm", [("Q4_0", 32, 256, False), ("Q8_0", 48, 128, True)])
def test_a_column_alone_and_in_any_batch_has_the_same_bits(qtype, rows, cols, norm):
    """The scheduler's contract: a column's output does not depend on the columns beside it. Batches of 20 (two
    groups of columns on the grid), 16, 9 and 5 (full, ragged column tiles: a padding column repeats the last one)
    against each column alone."""
    raw = _any_quants(qtype, rows, cols)
    w = _weight(raw, qtype)
    x = np.random.default_rng(5).standard_normal((20, cols)).astype(np.float32)
    # with the fused norm: its squares summed in the shared split's loop (under 8 columns) or a loop of their own
    kw = {"norm": (Tensor(np.linspace(-1, 1, cols, dtype=np.float32), device=DEV), 1e-5)} if norm else {}
    alone = np.concatenate([_run(w, qtype, x[i:i + 1], **kw) for i in range(20)])
    for n in (20, 16, 9, 5):
        np.testing.assert_array_equal(_run(w, qtype, x[20 - n:], **kw), alone[20 - n:])


@pytest.mark.parametrize("qtype,rows,cols,n,fused", [("Q4_0", 64, 128, 9, "norm"), ("Q8_0", 64, 128, 20, "res"),
                                                      ("Q4_0", 64, 64, 16, "")])
def test_the_warps_a_grid_keeps_change_no_bits(monkeypatch, qtype, rows, cols, n, fused):
    """At 8+ columns a grid keeps fewer warps with more row tiles each (WIDE_WARPS: x's pieces, split in registers,
    serve more tiles); the tiles a warp takes change no sum, so every output keeps its bits (with the fused norm,
    the residual, and two groups of columns on the grid)."""
    raw = _any_quants(qtype, rows, cols)
    w = _weight(raw, qtype)
    x = np.random.default_rng(6).standard_normal((n, cols)).astype(np.float32)
    kw = {"norm": (Tensor(np.linspace(-1, 1, cols, dtype=np.float32), device=DEV), 1e-5)} if fused == "norm" else \
        {"residual": Tensor(np.arange(n * rows, dtype=np.float32).reshape(n, rows), device=DEV)} if fused else {}
    got = {}
    for warps in ("1", "4096"):  # the most tiles a warp that fit, and one tile a warp
        monkeypatch.setenv("MESH_GPU_TC_WARPS", warps)
        got[warps] = _run(w, qtype, x, **kw)
    assert tc_layout(rows // 16, cols // 32, n, fused == "norm")[1] == 1  # one tile a warp under 4096 warps
    monkeypatch.setenv("MESH_GPU_TC_WARPS", "1")
    assert tc_layout(rows // 16, cols // 32, n, fused == "norm")[1] > 1
    np.testing.assert_array_equal(got["1"], got["4096"])


@pytest.mark.parametrize("qtype,rows,cols,n,fused", [("Q8_0", 32, 256, 16, "norm"), ("Q4_0", 32, 256, 3, "res"),
                                                      ("Q4_0", 32, 128, 1, "")])
def test_blocks_taken_several_a_loop_step_change_no_bits(monkeypatch, qtype, rows, cols, n, fused):
    """MESH_GPU_TC_UNROLL: a warp's blocks taken 2 or 4 a loop step (their loads issued together) are added in the
    same order, so every output keeps its bits, in both ways x reaches the MMAs (shared memory under 8 columns,
    registers at 8+) and with the fused norm and residual."""
    from engine.matvec_gpu_tc import tc_unroll
    raw = _any_quants(qtype, rows, cols)
    w = _weight(raw, qtype)
    x = np.random.default_rng(8).standard_normal((n, cols)).astype(np.float32)
    kw = {"norm": (Tensor(np.linspace(-1, 1, cols, dtype=np.float32), device=DEV), 1e-5)} if fused == "norm" else \
        {"residual": Tensor(np.arange(n * rows, dtype=np.float32).reshape(n, rows), device=DEV)} if fused else {}
    monkeypatch.setenv("MESH_GPU_TC_SPLIT", "2")  # 8 or 4 blocks a row: 4 or 2 a warp
    got = {}
    for u in ("1", "2", "4"):
        monkeypatch.setenv("MESH_GPU_TC_UNROLL", u)
        got[u] = _run(w, qtype, x, **kw)
    assert tc_unroll(cols // 32 // 2) == min(4, cols // 64)
    np.testing.assert_array_equal(got["2"], got["1"])
    np.testing.assert_array_equal(got["4"], got["1"])


def test_the_order_of_sums_is_the_matrixs():
    """S (warps over a row's blocks: the order of the sums) comes from the matrix alone; R (tiles a warp) shrinks
    with the columns and the warps a grid needs, and changes no sum."""
    for tiles, nb in ((1792, 128), (384, 128), (256, 448), (160, 64), (2000, 64), (3, 11)):
        S = {tc_layout(tiles, nb, n)[0] for n in range(1, 17)}
        assert len(S) == 1 and nb % S.pop() == 0
    assert tc_layout(1792, 128, 1) == (8, 4, True)  # 8B gate_up: x split once into shared memory
    assert tc_layout(8016, 128, 1) == (8, 4, True)  # 8B head: R = 8 would leave no room for x's pieces
    assert tc_layout(8016, 128, 16) == (8, 4, False)  # 16 columns: each warp splits its x in registers
    assert tc_layout(384, 128, 1) == (8, 1, True)  # 8B qkv: 3072 warps at one tile a warp
    assert tc_layout(256, 448, 1) == (16, 2, False)  # 8B ffn_down: 14336 columns, too many for shared memory
    assert tc_layout(128, 176, 1) == (8, 1, True)  # 1.1B ffn_down: 5632 columns fit
    assert tc_layout(3, 11, 16) == (1, 1, False) and tc_layout(8016, 448, 16)[0] == 16


def _greedy(stages, seqs: dict[int, list[int]], steps: int) -> dict[int, list[np.ndarray]]:
    """Logits of the greedy path of several sequences run together (slot: prompt): their prompts in one step, then
    `steps` decode steps of one column each, the host's argmax fed back."""
    from engine.stage import Column

    def run(cols):
        h = None
        for st in stages[:-1]:
            h = st.step(cols, h)
        return stages[-1].step_logits(cols, h)
    cols = [Column(i, slot, i == len(p) - 1, t) for slot, p in seqs.items() for i, t in enumerate(p)]
    out = {slot: [row] for slot, row in zip(seqs, run(cols))}
    for k in range(steps):
        rows = run([Column(len(seqs[slot]) + k, slot, True, int(out[slot][-1].argmax())) for slot in seqs])
        for slot, row in zip(seqs, rows):
            out[slot].append(row)
    return out


@pytest.mark.slow
def test_a_serving_stage_takes_the_tensor_cores_and_keeps_each_sequences_tokens(tmp_path, monkeypatch):
    """The kernel is a property of the stage (`tc_stage`): on a device with CUDA's bf16 MMA (here the PYTHON device
    emulating sm_80), a stage of several slots loads its Q4_0/Q8_0 weights in the tensor-core layout and runs them
    there (norm and residual fused), a one-slot stage does not (unless MESH_GPU_MV=tc). A sequence's logits alone
    over a split are the bits of the same sequence unsharded beside another one, prompt and decode step (the
    matvecs' distance to float64: the tests above). ~30 s on the PYTHON device."""
    from engine.stage import Stage
    from tests.tiny_gguf import write_tiny_gguf
    from tinygrad.helpers import Context
    monkeypatch.delenv("MESH_GPU_MV", raising=False)
    monkeypatch.delenv("MESH_GPU_MV_TC", raising=False)
    monkeypatch.setenv("MESH_GPU_TC_X8", "0")  # the bf16 kernel (8-bit x: tests/test_matvec_s8.py)
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=2, dim=64, n_heads=2, n_kv_heads=1, ffn_dim=32,
                        vocab_size=32, qtype="Q4_0")  # few 16-row tiles: the emulator runs a thread block in ~0.2 s
    a, b = [3, 17, 22], [9, 5]
    dev = "PYTHON::sm_80" if DEV == "PYTHON" else DEV
    with Context(DEV=dev):
        def load(lo, hi, slots=2):
            return Stage.load(p, lo, hi, n_slots=slots, max_context=32, jit=False)
        assert not load(0, 2, 1).tensor_cores and not load(0, 2, 4).tensor_cores  # below TC_SLOTS (8): not
        assert load(0, 2, 8).tensor_cores
        monkeypatch.setenv("MESH_GPU_TC_SLOTS", "2")  # two slots are enough to show a sequence alone and beside
        monkeypatch.setenv("MESH_GPU_MV_TC", "0")
        assert not load(0, 2).tensor_cores
        monkeypatch.delenv("MESH_GPU_MV_TC")
        whole, split = [load(0, 2)], [load(0, 1), load(1, 2)]
        assert all(st.tensor_cores for st in whole + split)
        assert {w.quant.layout for blk in whole[0]._blocks for w in blk.w.values() if w.quant is not None} == {"tc"}
        alone = _greedy(split, {0: a}, 1)[0]  # alone and over a split, against beside slot 1 unsharded
        beside = _greedy(whole, {0: a, 1: b}, 1)[0]
    for x, y in zip(alone, beside):
        np.testing.assert_array_equal(x, y)
