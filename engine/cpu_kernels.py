"""Small CPU kernels of a layer written as plain loops, where tinygrad's own kernels leave most of a core unused.

tinygrad renders an elementwise kernel with its last axis upcast by 4 (float4 loads) and every ALU op devectorized
into 4 scalar expressions. For silu(gate) * up that means exp2's polynomial, range reduction and bit tricks, 4 lanes
at a time, in scalar instructions: 148 us for a 16-column SmolLM2 chunk (1536 features), 92-148 us of a layer's
~1.3 ms, on one core. The same expression as a custom kernel whose inner axis is a plain loop is vectorized by
clang's loop vectorizer to the machine's full width (16 lanes with AVX-512): 10.7 us, bitwise the same values (the
same UOps per element: `Tensor.silu` is x * (1 + exp2(-x / ln 2))^-1, lowered by the same decomposition).

Both kernels of a step of several columns are cut into core slices (a GLOBAL axis, `core_index`: the step runner
hands them to both cores, engine/cpu_runner.py). Why: a kernel of one slice runs on one thread while the other spins
at the next kernel's wait; in SmolLM2's 8-column decode step these kernels (30 glu, 61 norms) were ~0.36 ms of one
core with the other idle (the KV write, engine/paged_attention.py, is cut the same way). glu is cut along its
features, the norm along its rows: each value is computed exactly as in one slice, so the bits are the same. A
one-column step keeps one slice (its glu is ~3 us, the norm is fused into the matvec there): a meeting of the two
threads costs about as much as it would save.

CPU only: GPUs keep the Tensor expression (their kernels are already one thread per element).
"""
from __future__ import annotations

import math
import os

from tinygrad import Tensor, UOp, dtypes
from tinygrad.dtype import AddrSpace
from tinygrad.uop.ops import AxisType, KernelInfo

from .cpu_runner import core_index, cpu_threads

F32 = dtypes.float32


def _slices(n: int, rows: int) -> int:
    """Core slices of a kernel over n units (features of 16, or rows) in a step of `rows` columns: the largest
    divisor of n not above the step runner's threads, 1 for one column. MESH_CPU_SPLIT_SMALL=0: one slice (A/B)."""
    if rows < 2 or os.environ.get("MESH_CPU_SPLIT_SMALL", "1") == "0":
        return 1
    return next(t for t in range(min(cpu_threads(), n), 0, -1) if n % t == 0)


def _gated_kernel(out: UOp, gu: UOp, act, name: str) -> UOp:
    N, F = out.shape
    T = _slices(F // 16, N) if F % 16 == 0 else 1   # whole vectors of 16 features a slice
    core = UOp.range(T, 0, AxisType.GLOBAL)
    n, fi = UOp.range(N, 1), UOp.range(F // T, 2)
    f = core_index(core, T) * (F // T) + fi
    g, u = gu[n, f], gu[n, f + F]
    return out[n, f].store(act(g) * u).end(fi, n, core).sink(arg=KernelInfo(name=f"{name}_{N}x{F}", opts_to_apply=()))


def _glu_kernel(out: UOp, gu: UOp) -> UOp:    # Tensor.silu(g) * u, op for op
    return _gated_kernel(out, gu, lambda g: g * (1 + (g * (-1 / math.log(2))).exp2()).reciprocal(), "glu")


def _gelu_glu_kernel(out: UOp, gu: UOp) -> UOp:    # Tensor.gelu(g) * u: the same mixin method on UOps
    return _gated_kernel(out, gu, lambda g: g.gelu(), "gelu_glu")


def glu(gu: Tensor) -> Tensor:
    """silu(gate) * up of gu = [gate | up] (N, 2F) -> (N, F) float32; bitwise what the Tensor expression gives."""
    F = gu.shape[1] // 2
    if not str(gu.device).startswith("CPU"):
        return gu[:, :F].silu() * gu[:, F:]
    out = Tensor.empty(gu.shape[0], F, dtype=F32, device=gu.device)
    return Tensor.custom_kernel(out, gu.cast(F32).contiguous(), fxn=_glu_kernel)[0]


def gelu_glu(gu: Tensor) -> Tensor:
    """gelu(gate) * up of gu = [gate | up] (N, 2F) -> (N, F) float32 (Gemma 3's FFN, tanh GELU); bitwise what the
    Tensor expression gives. Why a kernel of its own: tinygrad's kernel for it ran on one core in scalar code, 90 us
    a layer in an 8-column Gemma 3 270M step (1.6 of 16.2 ms), 9 us at one column. MESH_CPU_GELU=0: tinygrad's
    kernel (A/B runs)."""
    F = gu.shape[1] // 2
    if not str(gu.device).startswith("CPU") or os.environ.get("MESH_CPU_GELU") == "0":
        return gu[:, :F].gelu() * gu[:, F:]
    out = Tensor.empty(gu.shape[0], F, dtype=F32, device=gu.device)
    return Tensor.custom_kernel(out, gu.cast(F32).contiguous(), fxn=_gelu_glu_kernel)[0]



def _rms_norm_kernel(eps: float):
    def kernel(out: UOp, x: UOp, w: UOp) -> UOp:
        N, D = x.shape
        T = _slices(N, N)                   # rows a slice: NT
        NT = N // T
        R = next(r for r in (16, 8, 4, 2, 1) if NT % r == 0)  # rows whose sums run side by side
        core = UOp.range(T, 5, AxisType.GLOBAL)
        first = core_index(core, T) * NT    # the slice's first row
        ro, rl = UOp.range(NT // R, 0), UOp.range(R, 1, AxisType.UPCAST)
        acc = UOp.placeholder((R + 1,), F32, 0, addrspace=AddrSpace.REG)  # indexed from 1 (engine/quant_gemm.py)
        acc = acc.after(ro)[rl + 1].set(0.0)
        j = UOp.range(D, 2, AxisType.REDUCE)
        xr = x[first + ro * R + rl, j]
        acc = acc[rl + 1].set(acc.after(j)[rl + 1] + xr * xr, end=j)  # each row's sum of squares in order
        s = UOp.placeholder((R + 1,), F32, 1, addrspace=AddrSpace.REG)
        s = s.after(acc)[rl + 1].set((acc[rl + 1] * (1 / D) + eps).sqrt(), end=rl)
        r2, j2 = UOp.range(R, 3), UOp.range(D, 4)
        val = x[first + ro * R + r2, j2] / s[r2 + 1] * w[j2]  # (x / sqrt(mean + eps)) * w, as the Tensor expression
        return out[first + ro * R + r2, j2].store(val).end(j2, r2).end(ro, core).sink(
            arg=KernelInfo(name=f"rms_norm_{N}x{D}", opts_to_apply=()))
    return kernel


def rms_norm_rows(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """x * (mean(x^2) + eps)^-1/2 * w over the last axis of x (N, D) -> float32, on the CPU in one kernel (the Tensor
    expression is a reduce kernel summing one row at a time, a chain of dependent adds, and a second kernel); bitwise
    what the Tensor expression gives (each row summed in order, the same operations after)."""
    x = x.cast(F32)
    if not str(x.device).startswith("CPU"):
        return x * (x.square().mean(axis=-1, keepdim=True) + eps).sqrt().reciprocal() * w.cast(F32)
    out = Tensor.empty(*x.shape, dtype=F32, device=x.device)
    return Tensor.custom_kernel(out, x.contiguous(), w.cast(F32).contiguous(), fxn=_rms_norm_kernel(eps))[0]
