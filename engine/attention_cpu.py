"""Attention over the paged KV cache on the CPU in one C kernel a layer, each column's loops bounded by its own position.

engine/paged_attention.py's CPU kernels (scores, softmax, values: tinygrad UOps) run every column's loops to the
step's longest sequence (`ctx`) with the positions past a column's own masked, read every key once per query head
of a GQA group, and meet the other core at two extra kernel boundaries a layer. In SmolLM2's 8-column decode step at
position 64 they cost ~1.6-2.2 ms of a ~10 ms step (bench/batch_profile.py --knockout), more than the q/k/v matmul.
tinygrad cannot end a loop at a value loaded per column (its linearizer asserted on that, tenth session), so this
kernel is C (engine/c_kernels.py), one per layer, its work split over the cores by (column, KV head) pairs:

    scores  s[h, t] = scale * sum_d q[h, d] k[t, d]     the group's G heads side by side, 16 positions a vector
    softmax p[h, t] = exp2((s - max_t s) * log2 e), l[h] = 1 / sum_t p[h, t]     t <= pos
    values  o[h, d] = l[h] * sum_t p[h, t] v[t, d]      64 values of d at a time, the G heads side by side

for t <= pos only. Every value is bitwise what the three tinygrad kernels give: the same sums in the same order (a
score's over d in order as one FMA chain, the softmax's sum over t in order, a value's over t in order with the
product rounded before the add: the tinygrad kernel's mask stood between them, so clang did not contract them), the
same exp2 (tinygrad's decomposition, written out as it renders it), and the positions it skips contributed exact
zeros there (tests/test_attention_cpu.py checks the bits against those kernels, ragged steps included). So a
column's attention stays batch invariant and every earlier result stands.

Taken where the CPU device renders clang C, the pool's blocks hold 16 positions (the keys' transposed blocks load
as one vector) and head_dim is a multiple of 16; MESH_CPU_ATTN=0 keeps the tinygrad kernels (A/B runs).
"""
from __future__ import annotations

import os
import re
from collections.abc import Sequence

from tinygrad import Tensor, UOp, dtypes
from tinygrad.uop.ops import AxisType, KernelInfo

from .c_kernels import c_exp2, c_f32, custom, load16f, renders_c
from .cpu_runner import core_index, cpu_threads
from .quant_i8 import X8, q8_block

F32 = dtypes.float32
LOG2E = 1.4426950408889634
VEC = 16  # positions of a key block loaded as one vector (the pool's block size), values of d a vector
PREFETCH_BLOCKS = 2  # key blocks fetched ahead; values 8 positions ahead for each (`_prefetches`)


def wanted(device: str, block_size: int, head_dim: int) -> bool:
    """Whether attention on `device` takes this kernel (see the module docstring)."""
    return device.startswith("CPU") and block_size == VEC and head_dim % VEC == 0 and \
        os.environ.get("MESH_CPU_ATTN") != "0" and renders_c(device)


def _prefetches(blk: str, W: int, Hd: int, DC: int, es: int) -> tuple[str, str, str, str]:
    """C hints that fetch the keys PREFETCH_BLOCKS blocks ahead of the scores loop and the values PREFETCH_BLOCKS * 8
    positions ahead of the values loop (each first part before its loop, the rest in it). Why: a sequence's blocks lie
    anywhere in the pool, a head's keys of a block are 2 KB, and the KV comes from DRAM (every step streams the
    weights through the caches): without hints, each block's loads wait on memory. An 8-column SmolLM2 step
    at position 400 ran ~10% faster with them, at position 64 and at one column no slower (bench/RESULTS.md
    "Eighteenth session"). Hints change no result. MESH_CPU_ATTN_PREFETCH=0: none (A/B runs)."""
    if os.environ.get("MESH_CPU_ATTN_PREFETCH") == "0":
        return "", "", "", ""
    ka, va = PREFETCH_BLOCKS, PREFETCH_BLOCKS * 8
    key = lambda t: (f"{{ const char* pf_ = (const char*)(@4 + {blk.format(t=t)} * {VEC * W} + g * {Hd * VEC}); "  # noqa: E731
                     f"for (int l_ = 0; l_ < {Hd * VEC * es}; l_ += 64) __builtin_prefetch(pf_ + l_); }}")
    val = lambda t: (f"{{ const char* pf_ = (const char*)(@5 + ({blk.format(t=f'({t}) >> 4')} * 16 + (({t}) & 15)) * "  # noqa: E731
                     f"{W} + g * {Hd} + dc); for (int l_ = 0; l_ < {DC * es}; l_ += 64) __builtin_prefetch(pf_ + l_); }}")
    return (f"for (int tb = 0; tb < {ka} && tb * 16 < n; tb++) {key('tb')}",
            f"if ((tb + {ka}) * 16 < n) {key(f'tb + {ka}')}",
            f"for (int t = 0; t < {va} && t < n; t++) {val('t')}",
            f"if (t + {va} < n) {val(f't + {va}')}")


def _dc(Hd: int) -> int:
    """Values of d a pass of the values loop: up to 4 vectors."""
    return VEC * next(k for k in (4, 3, 2, 1) if (Hd // VEC) % k == 0)


def _kernel(runs: Sequence, H: int, KvH: int, Hd: int, scale: float, L: int, tag: str, x8: bool = False):
    G, W = H // KvH, KvH * Hd
    DC = _dc(Hd)

    def kernel(o: UOp, p: UOp, *rest: UOp) -> UOp:
        xq, xd, xs, q, pk, pv, table = rest if x8 else (None, None, None, *rest)
        N, QS, MC = q.shape[0], q.shape[1], p.shape[2]
        TB, NBLK = table.shape[1], pk.shape[0] // (W * VEC)
        half = pk.dtype == dtypes.float16
        KT = "__fp16" if half else "float"
        P = N * KvH
        T = min(cpu_threads(), P)  # slices of pairs, not necessarily even: one column's 3 pairs on 2 cores
        core = UOp.range(T, 0, AxisType.GLOBAL)
        ci = core_index(core, T)
        first = ci * P // T
        c0, g0 = first // KvH, first % KvH
        # sources: @0 o, @1 p, @2 core, @3 q, @4 pk, @5 pv, @6 table, then each run's slot and position
        chain = ""
        for r, run in enumerate(runs):
            take = f"{{ slot = @{7 + 2 * r}; pos = @{8 + 2 * r} + (c - {run.col}); }}"
            chain += take if r == len(runs) - 1 else f"if (c < {run.col + run.n}) {take} else "
        blk = f"(tab[{{t}}] < 0 ? 0 : tab[{{t}}] > {NBLK - 1} ? {NBLK - 1} : tab[{{t}}])"
        kpf0, kpf, vpf0, vpf = _prefetches(blk, W, Hd, DC, 2 if half else 4)
        at = f"c * {H * Hd} + (g * {G} + h) * {Hd} + dc + j * {VEC}"    # the element of o a vector starts at
        out = f"""for (int h = 0; h < {G}; h++) for (int j = 0; j < {DC // VEC}; j++) {{
        const v16f r = acc[h][j] * tot[h];
        __builtin_memcpy(@0 + {at}, &r, 64);
      }}"""
        # with x8, each block of 32 values is also quantized for the output matmul (engine/quant_i8.py `q8_block`,
        # the quantize kernel's code: the same bits), from the values written to o (@2 q, @3 d, @4 sums)
        out_x8 = f"""for (int h = 0; h < {G}; h++) for (int j = 0; j < {DC // VEC}; j += 2) {{
        const v16f r = acc[h][j] * tot[h], r1 = acc[h][j + 1] * tot[h];
        __builtin_memcpy(@0 + {at}, &r, 64); __builtin_memcpy(@0 + {at} + {VEC}, &r1, 64);
        {q8_block("r", "r1", f"@2 + {at}", f"@3 + ({at}) / 32", f"@4 + ({at}) / 16")}
      }}"""
        code = f"""{{
  typedef float v16f __attribute__((vector_size(64)));
  typedef __fp16 v16h __attribute__((vector_size(32)));
  typedef int v16i __attribute__((vector_size(64)));
  typedef signed char v16c __attribute__((vector_size(16)));
  const int p0 = (@2) * {P} / {T}, p1 = ((@2) + 1) * {P} / {T};
  for (int pr = p0; pr < p1; pr++) {{
    const int c = pr / {KvH}, g = pr % {KvH};
    int slot, pos;
    {chain}
    const int n = (pos < {L - 1} ? pos : {L - 1}) + 1;  /* a padded chunk's pad columns may sit past the context */
    const float* qc = @3 + c * {QS} + g * {G * Hd};
    float* pc = @1 + (c * {H} + g * {G}) * {MC};
    const int* tab = @6 + slot * {TB};
    float mx[{G}], tot[{G}];
    for (int h = 0; h < {G}; h++) {{ mx[h] = -__builtin_inff(); tot[h] = 0.0f; }}
    {kpf0}
    for (int tb = 0; tb * 16 < n; tb++) {{
      const int b = {blk.format(t="tb")};
      {kpf}
      const {KT}* kb = @4 + b * {VEC * W} + g * {Hd * VEC};
      v16f acc[{G}];
      for (int h = 0; h < {G}; h++) acc[h] = (v16f){{}};
      for (int d = 0; d < {Hd}; d++) {{
        {load16f("k", f"kb + d * {VEC}", half)}
        for (int h = 0; h < {G}; h++) acc[h] = acc[h] + qc[h * {Hd} + d] * k;
      }}
      const int m = n - tb * 16 < 16 ? n - tb * 16 : 16;
      for (int h = 0; h < {G}; h++) {{
        const v16f s = acc[h] * {c_f32(scale)};
        for (int i = 0; i < m; i++) {{ pc[h * {MC} + tb * 16 + i] = s[i]; mx[h] = mx[h] < s[i] ? s[i] : mx[h]; }}
      }}
    }}
    for (int h = 0; h < {G}; h++) {{
      float* ph = pc + h * {MC};
      const float mh = mx[h];
      for (int t = 0; t < n; t++) {{ {c_exp2(f"(ph[t] - mh) * {c_f32(LOG2E)}")} ph[t] = e; }}
    }}
    for (int t = 0; t < n; t++) for (int h = 0; h < {G}; h++) tot[h] = tot[h] + pc[h * {MC} + t];
    for (int h = 0; h < {G}; h++) tot[h] = 1.0f / tot[h];
    for (int dc = 0; dc < {Hd}; dc += {DC}) {{
      v16f acc[{G}][{DC // VEC}];
      for (int h = 0; h < {G}; h++) for (int j = 0; j < {DC // VEC}; j++) acc[h][j] = (v16f){{}};
      {vpf0}
      for (int t = 0; t < n; t++) {{
        const {KT}* vr = @5 + ({blk.format(t="t >> 4")} * 16 + (t & 15)) * {W} + g * {Hd} + dc;
        {vpf}
        for (int j = 0; j < {DC // VEC}; j++) {{
          {load16f("v", f"vr + j * {VEC}", half)}
          for (int h = 0; h < {G}; h++) {{ const v16f pv_ = pc[h * {MC} + t] * v; acc[h][j] = acc[h][j] + pv_; }}
        }}
      }}
      {{out}}
    }}
  }}
}}"""
        values = tuple(v for run in runs for v in (run.slot, run.pos))
        writes = [(o, (c0, g0 * (G * Hd))), (p, (c0, g0 * G, 0))]
        if x8:  # sources after o and p: @2 xq, @3 xd, @4 xs, then the rest moved by 3
            code = re.sub(r"@(\d+)", lambda m: f"@{int(m[1]) + 3 if int(m[1]) >= 2 else m[1]}", code)
            code = code.replace("{out}", out_x8)
            writes += [(xq, (c0, g0 * (G * Hd))), (xd, (c0, g0 * (G * Hd) // 32)), (xs, (c0, g0 * (G * Hd) // 16))]
        else:
            code = code.replace("{out}", out)
        body = custom(code, ci, writes, [q, pk, pv, table], values)
        return body.end(core).sink(arg=KernelInfo(name=f"attn_c_{tag}" + ("_x8" if x8 else ""), opts_to_apply=()))
    return kernel


def attention(q: Tensor, pool_k: Tensor, pool_v: Tensor, table: Tensor, runs: Sequence, max_context: int,
              n_heads: int, n_kv_heads: int, head_dim: int, scale: float) -> Tensor:
    """paged_attention's result on the CPU (runs: kernel variables, engine/paged_attention.py `_kruns`): q (N, H Hd
    and more) float32 contiguous -> (N, H Hd) float32."""
    return _attention(q, pool_k, pool_v, table, runs, max_context, n_heads, n_kv_heads, head_dim, scale, False)[0]


def attention_x8(q: Tensor, pool_k: Tensor, pool_v: Tensor, table: Tensor, runs: Sequence, max_context: int,
                 n_heads: int, n_kv_heads: int, head_dim: int, scale: float) -> tuple[Tensor, X8 | None]:
    """`attention` and its result quantized for an 8-bit matmul (engine/quant_i8.py `quantize`, the same bits) by
    the same kernel, where a pass of its values loop holds whole blocks of 32 (else None: quantize it apart). Why:
    the output matmul's own quantize kernel is a meeting of the cores a layer more (MESH_CPU_ATTN_X8=0: that way)."""
    ok = _dc(head_dim) % 32 == 0 and os.environ.get("MESH_CPU_ATTN_X8", "1") != "0"
    return _attention(q, pool_k, pool_v, table, runs, max_context, n_heads, n_kv_heads, head_dim, scale, ok)


def _attention(q: Tensor, pool_k: Tensor, pool_v: Tensor, table: Tensor, runs: Sequence, max_context: int,
               n_heads: int, n_kv_heads: int, head_dim: int, scale: float, x8: bool) -> tuple[Tensor, X8 | None]:
    N, H, Hd = q.shape[0], n_heads, head_dim
    tag = f"{N}x{H}x{Hd}_r{len(runs)}"
    o = Tensor.empty(N, H * Hd, dtype=F32, device=q.device)
    p = Tensor.empty(N, H, -(-max_context // VEC) * VEC, dtype=F32, device=q.device)  # whole vectors a row
    outs = [o, p]
    if x8:
        outs += [Tensor.empty(N, H * Hd, dtype=dtypes.int8, device=q.device),
                 Tensor.empty(N, H * Hd // 32, dtype=F32, device=q.device),
                 Tensor.empty(N, H * Hd // 16, dtype=dtypes.int32, device=q.device)]
    got = Tensor.custom_kernel(*outs, q, pool_k.reshape(-1), pool_v.reshape(-1), table,
                               fxn=_kernel(runs, H, n_kv_heads, Hd, scale, max_context, tag, x8))
    return got[0], X8(*got[2:5]) if x8 else None
