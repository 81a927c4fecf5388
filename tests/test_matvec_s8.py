"""The tensor-core matvec with 8-bit x (engine/matvec_gpu_s8.py) on tinygrad's PYTHON device, which emulates CUDA's
mma.sync m16n8k32 in integers (runtime/ops_python.py: the WMMA op with device "CUDA"), so the integer sums are the
tensor cores' exactly. References: the quantization scheme in numpy (x rounded per block of 32, then float64), and
a column alone against the same column in batches. MESH_GPU_TEST_DEV=CUDA runs the same checks on a GPU (the s8
form of mma.sync rendered by `s8_renderer`)."""
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from tinygrad import Tensor

from engine.matvec_gpu_s8 import quantize, s8_layout, s8_matmul_t, s8_renderer
from engine.matvec_gpu_tc import tc_repack
from tests.test_matvec_tc import _any_quants

DEV = os.environ.get("MESH_GPU_TEST_DEV", "PYTHON")


def _weight(raw: np.ndarray, qtype: str) -> tuple[Tensor, Tensor]:
    assert s8_renderer(DEV)
    words, scales = tc_repack(raw, Q[qtype])
    return Tensor(words, device=DEV).realize(), Tensor(scales, device=DEV).realize()


def _run(w, qtype: str, x: np.ndarray, **kw) -> np.ndarray:
    return s8_matmul_t(*w, Q[qtype], Tensor(x, device=DEV), **kw).numpy()


def _scheme(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy's quantization of v (N, C) f32 per block of 32: (q (N, C/32, 32) int, d (N, C/32) f32)."""
    vb = v.reshape(v.shape[0], -1, 32)
    d = np.abs(vb).max(-1) * np.float32(1 / 127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
    return np.rint(vb * inv[..., None]), d


def _want(raw: np.ndarray, qtype: str, v: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    rows, cols = raw.shape[0], v.shape[1]
    q, d = _scheme(v)
    xr = (q * d[..., None]).reshape(v.shape).astype(np.float64)
    if scale is not None:
        xr = xr * scale[:, None]
    return xr @ dequantize(raw, Q[qtype]).reshape(rows, cols).astype(np.float64).T


@pytest.mark.parametrize("qtype,rows,cols,n", [
    ("Q4_0", 32, 256, 1), ("Q8_0", 32, 256, 1),  # S = 8 warps over a row's blocks
    ("Q4_0", 48, 128, 3), ("Q8_0", 16, 704, 2),  # 3 tiles; 22 blocks (S = 2)
    ("Q8_0", 80, 128, 9), ("Q4_0", 64, 64, 16),  # two column tiles (ragged, full)
    ("Q8_0", 32, 128, 37)])  # three groups of columns on the grid (a prefill chunk)
def test_s8_matvec_is_the_schemes(qtype, rows, cols, n):
    """Against numpy's rounding of x and float64 sums: only the float steps' f32 roundings differ (the emulator's
    integers are exact, as the tensor cores' are)."""
    raw = _any_quants(qtype, rows, cols)
    x = np.random.default_rng(1).standard_normal((n, cols)).astype(np.float32)
    want = _want(raw, qtype, x)
    got = _run(_weight(raw, qtype), qtype, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    full = x.astype(np.float64) @ dequantize(raw, Q[qtype]).reshape(rows, cols).astype(np.float64).T
    assert np.abs(got - full).max() < 0.02 * np.abs(full).max()  # x's 8 bits: ~1% of the largest output


def test_the_quantize_kernel_is_llamas_q8_scheme():
    """d = amax / 127 (as amax times 1/127), q = rint(v / d) (ties to even; v times the inverse), the block's sum
    of q: every value of numpy's, including zero blocks and exact ties."""
    x = np.random.default_rng(2).standard_normal((3, 128)).astype(np.float32) * 3
    x[1, 32:64] = 0.0  # a zero block: d = 0, q = 0
    x[2, :32] = np.arange(32) - 15.5  # amax 16.5: ties at the halves of 127 / 16.5
    q, d, s = (t.numpy() for t in quantize(Tensor(x, device=DEV)))
    want_q, want_d = _scheme(x)
    got_q = q.view(np.int8).reshape(3, 4, 32)
    np.testing.assert_array_equal(d.T, want_d)
    np.testing.assert_array_equal(got_q, want_q)
    np.testing.assert_array_equal(s.T, want_q.sum(-1))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_the_norm_glu_and_residual_fused(qtype):
    """A fused RMS norm quantizes x * w and scales by 1 / rms; silu(gate) * up is made in the quantize kernel; the
    residual is added to the output."""
    rows, cols, n = 32, 128, 4
    raw = _any_quants(qtype, rows, cols)
    w = _weight(raw, qtype)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    nw = np.linspace(-1, 1, cols, dtype=np.float32)
    rs = 1 / np.sqrt((x.astype(np.float64) ** 2).mean(-1) + 1e-5)
    got = _run(w, qtype, x, norm=(Tensor(nw, device=DEV), 1e-5))
    want = _want(raw, qtype, x * nw, rs)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    gu = rng.standard_normal((n, 2 * cols)).astype(np.float32)
    g64 = gu[:, :cols].astype(np.float64)
    v = (g64 / (1 + np.exp(-g64)) * gu[:, cols:]).astype(np.float32)
    got = _run(w, qtype, gu, glu=True)
    want = _want(raw, qtype, v)
    # silu's exp2 differs from numpy's exp in the last bits: a value on a rounding edge may take the next quant
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
    r = rng.standard_normal((n, rows)).astype(np.float32)
    plain = _run(w, qtype, x)
    np.testing.assert_array_equal(_run(w, qtype, x, residual=Tensor(r, device=DEV)), plain + r)


@pytest.mark.parametrize("qtype,rows,cols,fused", [("Q4_0", 32, 256, "norm"), ("Q8_0", 48, 128, "glu"),
                                                   ("Q8_0", 32, 128, "res")])
def test_a_column_alone_and_in_any_batch_has_the_same_bits(qtype, rows, cols, fused):
    """The scheduler's contract: a column's output does not depend on the columns beside it. Batches of 20 (two
    groups of columns on the grid), 16, 9 and 5 (full and ragged column tiles) against each column alone."""
    raw = _any_quants(qtype, rows, cols)
    w = _weight(raw, qtype)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((20, 2 * cols if fused == "glu" else cols)).astype(np.float32)
    r = rng.standard_normal((20, rows)).astype(np.float32)

    def run(lo: int, hi: int) -> np.ndarray:
        kw = {"norm": (Tensor(np.linspace(-1, 1, cols, dtype=np.float32), device=DEV), 1e-5)} if fused == "norm" \
            else {"glu": True} if fused == "glu" else {"residual": Tensor(r[lo:hi], device=DEV)}
        return _run(w, qtype, x[lo:hi], **kw)
    alone = np.concatenate([run(i, i + 1) for i in range(20)])
    for n in (20, 16, 9, 5):
        np.testing.assert_array_equal(run(20 - n, 20), alone[20 - n:])


@pytest.mark.parametrize("qtype,n", [("Q8_0", 16), ("Q4_0", 3)])
def test_tiles_a_warp_and_blocks_a_loop_step_change_no_bits(monkeypatch, qtype, n):
    """R (row tiles a warp) and U (blocks a warp takes a loop step) change no sum: the same bits."""
    rows, cols = 64, 256
    raw = _any_quants(qtype, rows, cols)
    w = _weight(raw, qtype)
    x = np.random.default_rng(6).standard_normal((n, cols)).astype(np.float32)
    monkeypatch.setenv("MESH_GPU_TC_SPLIT", "2")
    got = {}
    for warps, u in (("1", "1"), ("4096", "1"), ("1", "4")):
        monkeypatch.setenv("MESH_GPU_TC_WARPS", warps)
        monkeypatch.setenv("MESH_GPU_TC_UNROLL", u)
        got[warps, u] = _run(w, qtype, x)
    monkeypatch.setenv("MESH_GPU_TC_WARPS", "1")
    assert s8_layout(rows // 16, cols // 32, n)[1] > 1
    monkeypatch.setenv("MESH_GPU_TC_WARPS", "4096")
    assert s8_layout(rows // 16, cols // 32, n)[1] == 1
    for k in got:
        np.testing.assert_array_equal(got[k], got["1", "1"])


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_a_serving_stage_keeps_each_sequences_bits(tmp_path, monkeypatch, qtype):
    """By default a tensor-core stage's matmuls quantize x (the norm and silu(gate) * up in the quantize kernel). A
    sequence's logits alone over a split are the bits of the same sequence unsharded beside another one, prompt and
    decode step; and they are near the bf16 kernel's (MESH_GPU_TC_X8=0; x's 8 bits).
    On CUDA (MESH_GPU_TEST_DEV=CUDA) this failed until the seventeenth session: tinygrad's C renderer wrote the
    kernel's float isum * (d_w * d_x) as isum * d_w * d_x where d_w * d_x had one use (bench/s8_bisect.py named the
    down matmul; S8CUDARenderer keeps the grouping). The emulator runs the UOps as grouped, so it gave equal bits."""
    from engine.stage import Stage
    from tests.test_matvec_tc import _greedy
    from tests.tiny_gguf import write_tiny_gguf
    from tinygrad.helpers import Context
    monkeypatch.delenv("MESH_GPU_MV", raising=False)
    monkeypatch.setenv("MESH_GPU_TC_X8", "0")
    monkeypatch.setenv("MESH_GPU_TC_SLOTS", "2")
    p = write_tiny_gguf(tmp_path / "m.gguf", n_layers=2, dim=64, n_heads=2, n_kv_heads=1, ffn_dim=32,
                        vocab_size=32, qtype=qtype)
    a, b = [3, 17, 22], [9, 5]
    dev = "PYTHON::sm_80" if DEV == "PYTHON" else DEV
    with Context(DEV=dev):
        def load(lo, hi):
            return Stage.load(p, lo, hi, n_slots=2, max_context=32, jit=False)
        bf16 = _greedy([load(0, 2)], {0: a}, 1)[0]
        monkeypatch.delenv("MESH_GPU_TC_X8")  # the default
        whole, split = [load(0, 2)], [load(0, 1), load(1, 2)]
        assert all(st.tensor_cores for st in whole + split)
        alone = _greedy(split, {0: a}, 1)[0]
        whole_alone = _greedy(whole, {0: a}, 1)[0]
        beside = _greedy(whole, {0: a, 1: b}, 1)[0]
    assert not np.array_equal(alone[0], bf16[0])  # the 8-bit path ran
    for k, (x, w, y, z) in enumerate(zip(alone, whole_alone, beside, bf16)):
        step = "prompt" if k == 0 else f"decode step {k}"
        # two contracts apart, so that a failure names which: a split, then a batch
        np.testing.assert_array_equal(x, w, err_msg=f"{step}: over a split against unsharded, alone")
        np.testing.assert_array_equal(w, y, err_msg=f"{step}: alone against beside another sequence, unsharded")
        assert np.abs(x - z).max() < 0.05 * np.abs(z).max()


def test_float_sums_and_products_keep_their_grouping_in_c():
    """tinygrad 0.14's C renderers drop the parentheses around any source of the same associative op, so a float
    a * (b * c) becomes a * b * c, which C computes as (a * b) * c: other bits, and which form a kernel gets can
    depend on how many uses a value has (a column alone or in a batch). The rule S8CUDARenderer renders ALU ops
    with (`ALU_IN_ORDER`) keeps the grouping of float sources after the first; here ahead of tinygrad's Clang rules,
    rendered only (no compiler, no device), on the kernel tinygrad makes of a * (b * c) + (a + (b + c))."""
    import re
    from types import SimpleNamespace
    from tinygrad.codegen import to_program
    from tinygrad.helpers import Target
    from tinygrad.renderer.cstyle import ClangRenderer
    from tinygrad.uop.ops import Ops
    from engine.matvec_gpu_s8 import ALU_IN_ORDER, S8CUDARenderer
    assert S8CUDARenderer.string_rewrite.patterns[0] == ALU_IN_ORDER.patterns[0]
    a, b, c = (Tensor(np.arange(8, dtype=np.float32) + k, device="PYTHON").realize() for k in range(3))
    out = a * (b * c) + (a + (b + c))
    lin, _ = out.linear_with_vars()
    ast = next(u for u in lin.toposort() if u.op is Ops.SINK and u.arg is not None)
    ordered = type("Ordered", (ClangRenderer,), {"string_rewrite": ALU_IN_ORDER + ClangRenderer.string_rewrite})
    ren = ordered(Target.parse("CPU::x86_64,native"))  # any arch: nothing is compiled
    ren.compiler = SimpleNamespace(compile_cached=lambda src: b"")  # rendered only: no C compiler, no CPU device
    src = next(s.arg for s in to_program(ast, ren).src if s.op is Ops.SOURCE)
    v = r"[\w\[\].]+"
    assert re.search(rf"\*\({v}\*{v}\)", src) and re.search(rf"\+\({v}\+{v}\)\)", src), src
