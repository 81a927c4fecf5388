"""Small CPU kernels of a layer written as plain loops, where tinygrad's own kernels leave most of a core unused.

tinygrad renders an elementwise kernel with its last axis upcast by 4 (float4 loads) and every ALU op devectorized
into 4 scalar expressions. For silu(gate) * up that means exp2's polynomial, range reduction and bit tricks, 4 lanes
at a time, in scalar instructions: 148 us for a 16-column SmolLM2 chunk (1536 features), 92-148 us of a layer's
~1.3 ms, on one core. The same expression as a custom kernel whose inner axis is a plain loop is vectorized by
clang's loop vectorizer to the machine's full width (16 lanes with AVX-512): 10.7 us, bitwise the same values (the
same UOps per element: `Tensor.silu` is x * (1 + exp2(-x / ln 2))^-1, lowered by the same decomposition).

CPU only: GPUs keep the Tensor expression (their kernels are already one thread per element).
"""
from __future__ import annotations

import math

from tinygrad import Tensor, UOp, dtypes
from tinygrad.dtype import AddrSpace
from tinygrad.uop.ops import AxisType, KernelInfo

F32 = dtypes.float32


def _glu_kernel(out: UOp, gu: UOp) -> UOp:
    N, F = out.shape
    n, f = UOp.range(N, 0), UOp.range(F, 1)
    g, u = gu[n, f], gu[n, f + F]
    val = g * (1 + (g * (-1 / math.log(2))).exp2()).reciprocal() * u  # Tensor.silu(g) * u, op for op
    return out[n, f].store(val).end(f, n).sink(arg=KernelInfo(name=f"glu_{N}x{F}", opts_to_apply=()))


def glu(gu: Tensor) -> Tensor:
    """silu(gate) * up of gu = [gate | up] (N, 2F) -> (N, F) float32; bitwise what the Tensor expression gives."""
    F = gu.shape[1] // 2
    if not str(gu.device).startswith("CPU"):
        return gu[:, :F].silu() * gu[:, F:]
    out = Tensor.empty(gu.shape[0], F, dtype=F32, device=gu.device)
    return Tensor.custom_kernel(out, gu.cast(F32).contiguous(), fxn=_glu_kernel)[0]



def _rms_norm_kernel(eps: float):
    def kernel(out: UOp, x: UOp, w: UOp) -> UOp:
        N, D = x.shape
        R = next(r for r in (16, 8, 4, 2, 1) if N % r == 0)  # rows whose sums run side by side
        ro, rl = UOp.range(N // R, 0), UOp.range(R, 1, AxisType.UPCAST)
        acc = UOp.placeholder((R + 1,), F32, 0, addrspace=AddrSpace.REG)  # indexed from 1 (engine/quant_gemm.py)
        acc = acc.after(ro)[rl + 1].set(0.0)
        j = UOp.range(D, 2, AxisType.REDUCE)
        xr = x[ro * R + rl, j]
        acc = acc[rl + 1].set(acc.after(j)[rl + 1] + xr * xr, end=j)  # each row's sum of squares in order
        s = UOp.placeholder((R + 1,), F32, 1, addrspace=AddrSpace.REG)
        s = s.after(acc)[rl + 1].set((acc[rl + 1] * (1 / D) + eps).sqrt(), end=rl)
        r2, j2 = UOp.range(R, 3), UOp.range(D, 4)
        val = x[ro * R + r2, j2] / s[r2 + 1] * w[j2]  # (x / sqrt(mean + eps)) * w, as the Tensor expression
        return out[ro * R + r2, j2].store(val).end(j2, r2).end(ro).sink(
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
