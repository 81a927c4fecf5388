"""CPU matmuls with 8-bit activations: x quantized per block of 32, integer dot products (AVX-512 VNNI or AVX2).

Why (issue 11, "8 streams >= 4x one stream on 2 cores"): the f32 path (engine/quant.py's matvec,
engine/quant_gemm.py's GEMM) multiplies every decoded weight as a float, one 16-lane FMA per value and column. With
several columns a step that is the bound: an 8-column SmolLM2 step cost ~2.35 one-column steps, almost all of it
FMAs (NOTES "Prefill GEMM"). llama.cpp's CPU path does what this module does: x is quantized to int8 per block of 32
values (Q8_0 / Q8_1's scheme) and a block's products are integers, 64 of them per `vpdpbusd` (4 bytes x 16 lanes),
four times the products of an FMA. A standalone C loop of this kernel on this box's Xeon (1536x576 Q4_1, one core):
8 columns 272 -> 57 us, one column 81 -> 34 us (bench/RESULTS.md "Thirteenth session: 8-bit activations on the
CPU").

Numerics (the lead's decision, thirteenth session): x of a block of 32 values becomes q = rint(x / d), d = amax / 127
(llama.cpp's quantize_row_q8_0/q8_1: the same d, the inverse multiplied, ties to even as its SIMD quantizers do; d is
kept in f32, where llama.cpp rounds it to f16). A weight block is one or more units of 32 values, each meeting one
block of x; a row's result is, per unit in order from 0,
    acc = acc + float(isum) * (scale * d_x)          isum = sum of q_w * q_x over the unit, exact in int32
    acc = acc + offset * (d_x * float(sum q_x))      where the type has an offset (Q4_1, Q5_1: m; Q4_K: -dmin * m)
with scale the unit's float scale (d; Q4_K d * its 6-bit sub-scale) and Q4_0's -8, Q5_0's -16 and Q8_0's unsigned
bias folded into isum as integers (isum - 8 sum q_x); a Q6_K unit is two sub-blocks of 16 with int8 scales, its
isum sc_0 (isum_0 - 32 sum_0 q_x) + sc_1 (isum_1 - 32 sum_1 q_x) in int32 (x's quants are summed per 16 for this).
Every integer is exact, so the order inside a unit is free; the float steps are one fixed chain per row and column.
A column's result never depends on its step's other columns (the same kernel for 1 column and for 256): batch
invariance holds. Against f32 activations the results move by the int8 rounding of x (0.5-0.7% of the largest
output for Gaussian x in the kernel tests), as llama.cpp's do; the models' perplexity does not move
(bench/perplexity.py: SmolLM2 67.40 against 67.11, Gemma 3 270M 69.59 against 69.65).

Which weights (`wanted`): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K blocks in rows of 16 (SmolLM2's types, a
Q4_K_M file's), on an x86 CPU whose kernels clang compiles: AVX-512 VNNI (and VBMI) runs `vpdpbusd`; other x86 hosts
with AVX2 run llama.cpp's AVX2 dot (`vpmaddubsw` byte pairs to int16, `vpmaddwd` by 1 to int32; for Q8_0's signed
weights the sign moves onto x, |w| <= 128, so no pair saturates). Both give the same integers, so every x86 host
gives the same bits (tests/test_engine_i8.py runs each ISA the host has against the portable loop). Q5_K, Q2_K and
Q3_K keep the f32 path (not written); ARM (NEON's `sdot` not written) keeps the f32 path by default: the portable
integer loop (the same bits) ran 2x slower than the f32 FMAs in clang's code. MESH_CPU_INT8=1 forces this path on
anywhere, MESH_CPU_INT8=0 keeps f32 everywhere (A/B runs); MESH_CPU_INT8_ISA=generic|avx2|vnni picks the dot
(tests). A stage's numerics follow its host: a fleet of x86 boxes and an ARM Mac is not bitwise one machine (it
never was across CPU and GPU).

The kernels are C inside tinygrad CUSTOM ops (the step runner, engine/cpu_runner.py, still walks them like any
kernel; the core slice is the kernel's GLOBAL axis): tinygrad's renderer has no vector integer ops, and clang 14
does not form `vpdpbusd` from plain C (read in its output: `vpmulld`), so the one instruction is its builtin and the
rest is GCC vector extension code, which clang keeps as written. The resident layout is engine/quant.py's (16 rows
interleaved byte by byte); the byte transpose into the lanes `vpdpbusd` wants (4 values of a row in a 32-bit lane)
is one `vpermb` per 64 bytes (`__builtin_shufflevector`), amortized over the step's columns.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

from gguf import GGMLQuantizationType as Q
from tinygrad import Tensor, UOp, dtypes
from tinygrad.uop.ops import AxisType, KernelInfo

from . import cpu_kernels
from .c_kernels import c_exp2, c_f32, custom, load16f, renders_c
from .cpu_runner import core_index, cpu_threads
from .quant_gemm import MAX_COLUMNS, cpu_flags, slices

F32 = dtypes.float32
BLOCK = 32  # values of x per scale: every type here has blocks of 32
# per type: its name, rest bytes a row's block holds, float16 fields
KINDS = {Q.Q4_0: ("q4_0", 16, 1), Q.Q4_1: ("q4_1", 16, 2), Q.Q8_0: ("q8_0", 32, 1), Q.Q5_0: ("q5_0", 20, 1),
         Q.Q5_1: ("q5_1", 20, 2), Q.Q4_K: ("q4_k", 140, 2), Q.Q6_K: ("q6_k", 208, 1)}
IL = 16  # rows a group: one 16-lane vector of int32 / f32 sums
PREFETCH, PREFETCH_COLUMNS = 4096, 3  # bytes of weights fetched ahead, from this many columns a step on (`_prefetch`)


def vnni() -> bool:
    """Whether this host's clang (-march=native) has the instructions of the fastest kernel: AVX-512 VNNI, and VBMI
    for the byte transpose in one instruction."""
    flags = cpu_flags()
    return "avx512_vnni" in flags and "avx512vbmi" in flags


def isa() -> str | None:
    """The integer dot this host runs fast: "vnni" (vpdpbusd), "avx2" (vpmaddubsw + vpmaddwd, llama.cpp's AVX2
    dot; any x86 of the last decade), or None (ARM and others: the f32 path stays the default there)."""
    if vnni():
        return "vnni"
    return "avx2" if "avx2" in cpu_flags() else None


def wanted(ggml_type: int, il: int, device: str) -> bool:
    """Whether a weight of `ggml_type` interleaved by `il` takes this path on `device` (see the module's docstring)."""
    if not device.startswith("CPU") or ggml_type not in KINDS or il != IL or not renders_c(device):
        return False
    env = os.environ.get("MESH_CPU_INT8")
    return env == "1" if env in ("0", "1") else isa() is not None


def _isa() -> str:
    """The kernels' dot: the host's (`isa`), or MESH_CPU_INT8_ISA=generic|avx2|vnni (tests, A/B: every one gives the
    same bits; avx2 and vnni need the instructions)."""
    env = os.environ.get("MESH_CPU_INT8_ISA")
    if env and env not in ("generic", "avx2", "vnni"):
        raise ValueError(f"MESH_CPU_INT8_ISA={env!r}: expected generic, avx2 or vnni")
    return env or isa() or "generic"


class X8(NamedTuple):
    """x quantized for the 8-bit matmuls (`quantize`): q (N, C) int8, d (N, C/32) float32 scales, s (N, C/16) int32
    sums of q per 16."""
    q: Tensor
    d: Tensor
    s: Tensor


def q8_block(a0: str, a1: str, q: str, d: str, s: str) -> str:
    """C quantizing the 32 floats of the v16f expressions `a0`, `a1` (a block) to int8 at pointer `q`, its scale at
    `d` and the sums of its two halves at `s`, `s` + 1: the one code of every kernel that quantizes x (the same bits
    wherever x is made). Needs the types v16f, v16i and v16c."""
    return f"""{{ const v16f x0_ = {a0}, x1_ = {a1};
        v16f m = __builtin_elementwise_max(__builtin_elementwise_abs(x0_), __builtin_elementwise_abs(x1_));
        m = __builtin_elementwise_max(m, __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
        m = __builtin_elementwise_max(m, __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));
        m = __builtin_elementwise_max(m, __builtin_shufflevector(m, m, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));
        const float amax = m[0] > m[1] ? m[0] : m[1];
        const float d_ = amax / 127.0f, id = d_ != 0.0f ? 1.0f / d_ : 0.0f;
        const v16i q0 = __builtin_convertvector(__builtin_elementwise_roundeven(x0_ * id), v16i);
        const v16i q1 = __builtin_convertvector(__builtin_elementwise_roundeven(x1_ * id), v16i);
        const v16c c0 = __builtin_convertvector(q0, v16c), c1 = __builtin_convertvector(q1, v16c);
        __builtin_memcpy({q}, &c0, 16); __builtin_memcpy({q} + 16, &c1, 16);
        int s0 = 0, s1 = 0;
        for (int l = 0; l < 16; l++) {{ s0 += q0[l]; s1 += q1[l]; }}
        *({d}) = d_; ({s})[0] = s0; ({s})[1] = s1; }}"""


def _quantize_kernel(eps: float | None, glu: bool = False):
    def kernel(out_q: UOp, out_d: UOp, out_s: UOp, x: UOp, *norm_w: UOp) -> UOp:
        N, C = x.shape[0], x.shape[1] // 2 if glu else x.shape[1]
        T = next(t for t in range(min(cpu_threads(), N), 0, -1) if N % t == 0) if N > 1 else 1
        core = UOp.range(T, 0, AxisType.GLOBAL)
        NB, per = C // BLOCK, N // T
        R = next(r for r in (8, 4, 2, 1) if per % r == 0)  # rows whose sums of squares run side by side
        # with a norm, x's values are (x / sqrt(mean(x^2) + eps)) * w, each row's sum of squares one chain in order
        # (engine/cpu_kernels.py's norm, bitwise; R rows' chains side by side, as there), computed again where
        # they are read: no f32 row in memory. The rest is exact whatever the order (max, rint, integer sums), so
        # it runs on 16 lanes.
        value = lambda k: f"v{k}" if eps is None else f"(v{k} / rs * wv{k})"  # noqa: E731
        norm = "" if eps is None else f"""
    float ss[{R}] = {{}};
    for (int j = 0; j < {C}; j++) for (int r = 0; r < {R}; r++) ss[r] = ss[r] + @4[(n0 + r) * {C} + j] * @4[(n0 + r) * {C} + j];"""
        rs = "" if eps is None else f"const float rs = __builtin_sqrtf(ss[r] * {1 / C!r}f + {eps!r}f);"
        wv = "" if eps is None else \
            "v16f wv0, wv1; __builtin_memcpy(&wv0, @5 + b * 32, 64); __builtin_memcpy(&wv1, @5 + b * 32 + 16, 64);"
        load = (f"v16f v0, v1; __builtin_memcpy(&v0, @4 + n * {C} + b * {BLOCK}, 64); "
                f"__builtin_memcpy(&v1, @4 + n * {C} + b * {BLOCK} + 16, 64);")
        if glu:  # x is [gate | up]: silu(gate) * up as engine/cpu_kernels.py's glu kernel renders it, bitwise
            gate = f"@4[n * {2 * C} + b * {BLOCK} + l]"
            load = (f"float gb[{BLOCK}]; for (int l = 0; l < {BLOCK}; l++) {{ const float gv = {gate}; "
                    f"{c_exp2(f'gv * {c_f32(-1 / math.log(2))}')} gb[l] = (gv / (1.0f + e)) * @4[n * {2 * C} + {C} + "
                    f"b * {BLOCK} + l]; }} v16f v0, v1; __builtin_memcpy(&v0, gb, 64); __builtin_memcpy(&v1, gb + 16, 64);")
        code = f"""{{
  typedef float v16f __attribute__((vector_size(64)));
  typedef int v16i __attribute__((vector_size(64)));
  typedef signed char v16c __attribute__((vector_size(16)));
  for (int n0 = (@3) * {per}; n0 < ((@3) + 1) * {per}; n0 += {R}) {{{norm}
  for (int r = 0; r < {R}; r++) {{
    const int n = n0 + r;
    {rs}
    for (int b = 0; b < {NB}; b++) {{
      {load}
      {wv}
      const v16f a0 = {value(0)}, a1 = {value(1)};
      {q8_block("a0", "a1", f"@0 + n * {C} + b * {BLOCK}", f"@1 + n * {NB} + b", f"@2 + n * {2 * NB} + 2 * b")}
    }}
  }} }}
}}"""
        ci = core_index(core, T)
        body = custom(code, ci, [(out_q, (ci * per, 0)), (out_d, (ci * per, 0)), (out_s, (ci * per, 0))],
                       [x, *norm_w])
        return body.end(core).sink(arg=KernelInfo(name=f"q8x_{N}x{C}" + ("" if eps is None else "_norm") + ("_glu" if glu else ""),
                                                  opts_to_apply=()))
    return kernel


def glu_in_quantize() -> bool:
    """Whether silu(gate) * up runs inside the quantize kernel of the matmul it feeds (ffn_down's) rather than as a
    kernel of its own (engine/cpu_kernels.py glu). Why: in an 8-column SmolLM2 step the glu kernel and its meeting
    of the two cores cost ~0.2-0.4 ms (bench/RESULTS.md "Nineteenth session"), its f32 output written only to be read
    back by the quantize kernel next. The same bits either way. MESH_CPU_GLU_QUANT=0: the two kernels (A/B runs)."""
    return os.environ.get("MESH_CPU_GLU_QUANT", "1") != "0"


def quantize(x: Tensor, norm: tuple[Tensor, float] | None = None, glu: bool = False) -> X8:
    """x (N, C) float32 -> (q (N, C) int8, d (N, C/32) float32, sums of q (N, C/16) int32): per block of 32, its
    scale and the sums of its two halves of 16 (Q6_K's sub-blocks have 16 values). With `norm` (weight, eps), x is
    RMS-normalized first, in the same kernel. With `glu`, x is [gate | up] (N, 2C) and the values are silu(gate) * up,
    computed in the same kernel, bitwise engine/cpu_kernels.py's glu (not with a norm)."""
    if glu and norm is not None:
        raise ValueError("quantize: glu and a norm in one kernel are not written")
    N, C = x.shape[0], x.shape[1] // 2 if glu else x.shape[1]
    q = Tensor.empty(N, C, dtype=dtypes.int8, device=x.device)
    d = Tensor.empty(N, C // BLOCK, dtype=F32, device=x.device)
    s = Tensor.empty(N, C // 16, dtype=dtypes.int32, device=x.device)
    w = [] if norm is None else [norm[0].cast(F32).contiguous()]
    q, d, s, *_ = Tensor.custom_kernel(q, d, s, x.cast(F32).contiguous(), *w,
                                       fxn=_quantize_kernel(None if norm is None else float(norm[1]), glu))
    return X8(q, d, s)


def _transpose(k: int) -> str:
    """The shuffle that takes 64 bytes laid out as k byte planes of 16 rows (plane p, row l at 16 p + l) to 16 lanes
    of k bytes (row l's bytes at k l .. k l + k - 1): vpermb on VBMI hosts."""
    return ", ".join(str(p * 16 + lane) for lane in range(16) for p in range(k))


def _load(dst: str, off: int, op: str) -> str:
    """Bytes off .. off + 63 of the block (4 byte planes of 16 rows), transposed to 16 lanes of 4 bytes, into v16i
    `dst` through `op` (a C expression of the bytes `v`)."""
    return (f"{{ v64u v; __builtin_memcpy(&v, r + {off}, 64); v = __builtin_shufflevector(v, v, {_transpose(4)});"
            f" {dst} = (v16i)({op}); }}")


def _dots(pairs: list[tuple[str, str]], out: str, isa: str, signed: bool = False) -> str:
    """`out` = the integer sums of a 32-value unit for one column: the dot of each (weights vector, pointer to its 4
    quants of x), in four independent chains (integer sums: any order is exact). vnni: one vpdpbusd (unsigned
    weight bytes times signed x bytes, 4 products a lane). avx2: vpmaddubsw (byte pairs to int16, which saturates
    past 32767: weights up to 63 only, or with `signed` weights the sign moved onto x as llama.cpp does, |w| <= 128)
    then vpmaddwd by 1 (int16 pairs to int32), on two halves of 8 lanes."""
    lines = [f"v16i {out}4[4] = {{}};"]
    for i, (w, q) in enumerate(pairs):
        acc = f"{out}4[{i % 4}]"
        if isa == "vnni":
            lines.append(f"{{ int xw; __builtin_memcpy(&xw, {q}, 4); "
                         f"{acc} = __builtin_ia32_vpdpbusd512({acc}, {w}, (v16i){{}} + xw); }}")
            continue
        half = lambda k: f"__builtin_shufflevector({w}, {w}, {', '.join(str(8 * k + j) for j in range(8))})"  # noqa
        a, b = [f"(v32c){half(k)}" for k in (0, 1)], ["(v32c)xb", "(v32c)xb"]
        if signed:
            a, b = [f"(v32c)__builtin_elementwise_abs((v32s){x})" for x in a], \
                [f"__builtin_ia32_psignb256((v32c)xb, {x})" for x in a]
        lines.append(f"{{ int xw; __builtin_memcpy(&xw, {q}, 4); const v8i xb = (v8i){{}} + xw; "
                     f"const v8i lo = __builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256({a[0]}, {b[0]}), one16), "
                     f"hi = __builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256({a[1]}, {b[1]}), one16); "
                     f"{acc} += __builtin_shufflevector(lo, hi, {', '.join(str(j) for j in range(16))}); }}")
    lines.append(f"v16i {out} = ({out}4[0] + {out}4[1]) + ({out}4[2] + {out}4[3]);")
    return "\n        ".join(lines)


def _generic_dot(values: str, q: str, out: str) -> str:
    """`out` = the integer sums of a unit for one column, plain loops over values[32][16] (ints) and q (int8)."""
    return (f"v16i {out} = {{}}; for (int j = 0; j < 32; j++) for (int l = 0; l < 16; l++) "
            f"{out}[l] += {values}[j][l] * (int)({q})[j];")


def _unit(acc: str, s: str, scale: str, dx: str, xs: str, offset: str | None) -> str:
    """One unit's float steps, in this order for every kind and both codes (the same bits)."""
    code = f"{acc} = {acc} + __builtin_convertvector({s}, v16f) * ({scale} * {dx});"
    if offset is not None:
        code += f" {acc} = {acc} + {offset} * ({dx} * (float)({xs}));"
    return code


def _halfs(names: list[str]) -> str:
    """Declares the v16f `names` as the block's float16 fields 0, 1, ... (`h`, 16 rows each), one vector conversion
    each: the scalar conversions clang made of a loop took ~38% of the 8-column Q4_1 kernel's time."""
    return " ".join(load16f(n, f"h + {16 * i}", half=True) for i, n in enumerate(names))


def _block_code(kind: str, nh: int, isa: str, C: int, NBX: int) -> str:
    """The C for one block of 16 rows (`r` its bytes, `h` its `nh` float16 fields) into acc[n] of every column n, each
    32-value unit of the block with x block `u`: integer sums, then `_unit`'s float steps, units in order."""
    fast = isa != "generic"
    col = (f"const signed char* q = @4 + n * {C};  const float* xd = @5 + n * {NBX};  "
           f"const int* xs = @6 + n * {2 * NBX};")
    xsum = lambda u: f"xs[2 * ({u})] + xs[2 * ({u}) + 1]"  # noqa: E731 (a unit's sum of x quants: its two halves)
    if kind == "q6_k":  # 8 units of 2 sub-blocks of 16, each with an int8 scale; ggml's order of the 6-bit values
        # (engine/quant.py `_q6_k`): unit u = 4 n + k takes the low 4 bits from nibble k >> 1 of bytes 64 n + 32 (k & 1)
        # + t and the high 2 from bits 2 k of bytes 128 + 32 n + t, t = 0..31; value - 32
        head = f"{_halfs(['d'])} v16i sc[16];\n      " + " ".join(
            f"{{ v16sc t; __builtin_memcpy(&t, r + {(192 + k) * 16}, 16); sc[{k}] = __builtin_convertvector(t, v16i); }}"
            for k in range(16))
        units = []
        for u in range(8):
            n, k = u >> 2, u & 3
            lo, hi = (64 * n + 32 * (k & 1)) * 16, (128 + 32 * n) * 16
            if fast:
                dec = "v16i w[8]; " + " ".join(
                    _load(f"w[{i}]", lo + 64 * i, f"(v >> {4 * (k >> 1)}) & (unsigned char)15") + " " +
                    f"{{ v16i qh; " + _load("qh", hi + 64 * i, f"((v >> {2 * k}) & (unsigned char)3) << 4") +
                    f" w[{i}] |= qh; }}" for i in range(8))
                d0 = _dots([(f"w[{i}]", f"qu + {4 * i}") for i in range(4)], "s0", isa)
                d1 = _dots([(f"w[{4 + i}]", f"qu + {16 + 4 * i}") for i in range(4)], "s1", isa)
            else:
                dec = (f"int wv[32][16]; for (int t = 0; t < 32; t++) for (int l = 0; l < 16; l++) wv[t][l] = "
                       f"((r[{lo} + t * 16 + l] >> {4 * (k >> 1)}) & 15) | "
                       f"(((r[{hi} + t * 16 + l] >> {2 * k}) & 3) << 4);")
                d0 = (f"v16i s0 = {{}}, s1 = {{}}; for (int t = 0; t < 16; t++) for (int l = 0; l < 16; l++) "
                      f"{{ s0[l] += wv[t][l] * (int)qu[t]; s1[l] += wv[16 + t][l] * (int)qu[16 + t]; }}")
                d1 = ""
            units.append(f"""{{ {dec}
      for (int n = 0; n < N_COLS; n++) {{
        {col}
        const signed char* qu = q + (b * 8 + {u}) * 32;
        {d0}
        {d1}
        v16i s = sc[{2 * u}] * (s0 - 32 * xs[2 * (b * 8 + {u})])
               + sc[{2 * u + 1}] * (s1 - 32 * xs[2 * (b * 8 + {u}) + 1]);
        {_unit("acc[n]", "s", "d", f"xd[b * 8 + {u}]", "0", None)}
      }} }}""")
        return head + "\n      " + "\n      ".join(units)
    if kind == "q4_k":  # 8 units: chunk c of 32 bytes (after 12 of scales) holds unit 2c (low nibbles), 2c + 1 (high)
        # the 6-bit scales and mins as ggml packs them in the first 12 bytes, 16 rows a vector
        sc = [f"B[{k}] & 63" if k < 4 else f"(B[{k + 4}] & 15) | ((B[{k - 4}] >> 6) << 4)" for k in range(8)]
        mn = [f"B[{k + 4}] & 63" if k < 4 else f"(B[{k + 4}] >> 4) | ((B[{k}] >> 6) << 4)" for k in range(8)]
        head = f"{_halfs(['d', 'dmin'])} v16f dsc[8], dm[8]; v16i B[12];\n      " + " ".join(
            f"{{ v16u t; __builtin_memcpy(&t, r + {16 * k}, 16); B[{k}] = __builtin_convertvector(t, v16i); }}"
            for k in range(12)) + "\n      " + " ".join(
            f"dsc[{k}] = d * __builtin_convertvector({sc[k]}, v16f); dm[{k}] = -(dmin * __builtin_convertvector("
            f"{mn[k]}, v16f));" for k in range(8))
        chunk = []
        for c in range(4):
            base = (12 + 32 * c) * 16
            if fast:
                dec = "v16i w[16]; " + " ".join(_load(f"w[{i}]", base + 64 * i, "v & (unsigned char)15") + " " +
                                                _load(f"w[{8 + i}]", base + 64 * i, "(v >> 4) & (unsigned char)15")
                                                for i in range(8))
                da = _dots([(f"w[{i}]", f"qa + {4 * i}") for i in range(8)], "sa", isa)
                db = _dots([(f"w[{8 + i}]", f"qa + {32 + 4 * i}") for i in range(8)], "sb", isa)
            else:
                dec = (f"int wa[32][16], wb[32][16]; for (int j = 0; j < 32; j++) for (int l = 0; l < 16; l++) "
                       f"{{ wa[j][l] = r[{base} + j * 16 + l] & 15; wb[j][l] = r[{base} + j * 16 + l] >> 4; }}")
                da, db = _generic_dot("wa", "qa", "sa"), _generic_dot("wb", "qa + 32", "sb")
            ua, ub = f"b * 8 + {2 * c}", f"b * 8 + {2 * c + 1}"
            chunk.append(f"""{{ {dec}
      for (int n = 0; n < N_COLS; n++) {{
        {col}
        const signed char* qa = q + ({ua}) * 32;
        {da}
        {db}
        {_unit("acc[n]", "sa", f"dsc[{2 * c}]", f"xd[{ua}]", xsum(ua), f"dm[{2 * c}]")}
        {_unit("acc[n]", "sb", f"dsc[{2 * c + 1}]", f"xd[{ub}]", xsum(ub), f"dm[{2 * c + 1}]")}
      }} }}""")
        return head + "\n      " + "\n      ".join(chunk)
    # one unit a block: Q4_0 / Q4_1 (16 bytes: values j and 16 + j in byte j's nibbles), Q8_0 (32 signed bytes)
    head = _halfs(['dw', 'mw'] if nh == 2 else ['dw'])
    five = kind in ("q5_0", "q5_1")  # 4 bytes of fifth bits (bit j: value j), then Q4's 16 bytes of nibbles
    if fast and five:  # a lane's 4 bytes of fifth bits are its 32-bit word H; bits 4i..4i+3 go to bit 4 of each byte
        spread = lambda sh: (f"(((H >> {sh}) & 1) << 4) | (((H >> {sh}) & 2) << 11) | (((H >> {sh}) & 4) << 18) | "
                             f"(((H >> {sh}) & 8) << 25)")
        dec = "v16i H, w[8]; " + _load("H", 0, "v") + " " + " ".join(
            _load(f"w[{i}]", 64 + 64 * i, "v & (unsigned char)15") + f" w[{i}] |= {spread(4 * i)}; " +
            _load(f"w[{4 + i}]", 64 + 64 * i, "(v >> 4) & (unsigned char)15") + f" w[{4 + i}] |= {spread(16 + 4 * i)};"
            for i in range(4))
        pairs = [(f"w[{i}]", f"qb + {4 * i}") for i in range(4)] + \
            [(f"w[{4 + i}]", f"qb + {16 + 4 * i}") for i in range(4)]
        dot = _dots(pairs, "s", isa)
        bias = 16 if kind == "q5_0" else 0
    elif five:
        dec = ("int wv[32][16]; for (int l = 0; l < 16; l++) { const unsigned H = r[l] | r[16 + l] << 8 | "
               "r[32 + l] << 16 | (unsigned)r[48 + l] << 24; for (int j = 0; j < 16; j++) { "
               "wv[j][l] = (r[(4 + j) * 16 + l] & 15) | ((H >> j) & 1) << 4; "
               "wv[j + 16][l] = (r[(4 + j) * 16 + l] >> 4) | ((H >> (16 + j)) & 1) << 4; } }")
        dot = _generic_dot("wv", "qb", "s")
        bias = 16 if kind == "q5_0" else 0
    elif fast:
        if kind == "q8_0":  # vnni: signed bytes -> unsigned (+128), taken off again as 128 sum(q_x); avx2: signed
            flip = "v ^ (unsigned char)0x80" if isa == "vnni" else "v"
            dec = "v16i w[8]; " + " ".join(_load(f"w[{i}]", 64 * i, flip) for i in range(8))
            pairs = [(f"w[{i}]", f"qb + {4 * i}") for i in range(8)]
        else:
            dec = "v16i w[8]; " + " ".join(_load(f"w[{i}]", 64 * i, "v & (unsigned char)15") + " " +
                                           _load(f"w[{4 + i}]", 64 * i, "(v >> 4) & (unsigned char)15")
                                           for i in range(4))
            pairs = [(f"w[{i}]", f"qb + {4 * i}") for i in range(4)] + \
                [(f"w[{4 + i}]", f"qb + {16 + 4 * i}") for i in range(4)]
        dot = _dots(pairs, "s", isa, signed=kind == "q8_0" and isa == "avx2")
        bias = {"q8_0": 128 if isa == "vnni" else 0, "q4_0": 8}.get(kind, 0)
    else:
        if kind == "q8_0":
            dec = ("int wv[32][16]; for (int j = 0; j < 32; j++) for (int l = 0; l < 16; l++) "
                   "wv[j][l] = (signed char)r[j * 16 + l];")
        else:
            dec = ("int wv[32][16]; for (int j = 0; j < 16; j++) for (int l = 0; l < 16; l++) "
                   "{ wv[j][l] = r[j * 16 + l] & 15; wv[j + 16][l] = r[j * 16 + l] >> 4; }")
        dot = _generic_dot("wv", "qb", "s")
        bias = {"q4_0": 8}.get(kind, 0)
    if bias:
        dot += f"\n        s = s - {bias} * ({xsum('b')});"
    return f"""{head}
      {dec}
      for (int n = 0; n < N_COLS; n++) {{
        {col}
        const signed char* qb = q + b * 32;
        {dot}
        {_unit("acc[n]", "s", "dw", "xd[b]", xsum("b"), "mw" if nh == 2 else None)}
      }}"""


def _prefetch(rest_bytes: int, half_bytes: int, n: int) -> str:
    """Hints that fetch the weight block PREFETCH bytes ahead of the one being read, in steps of PREFETCH_COLUMNS or
    more columns. Why: at 1-2 columns the kernel is bound by DRAM with or without them, but from ~3
    columns on a block's integer work is long enough that its loads wait on memory between the blocks: SmolLM2's
    8-column step ran 6-13% faster with these (the runner alone, bench/RESULTS.md "Eighteenth session"), 1 and 2
    columns up to ~8% slower. Hints change no result. MESH_CPU_PREFETCH=<bytes> (0: none) for A/B runs."""
    env = os.environ.get("MESH_CPU_PREFETCH", str(PREFETCH))
    if not env.isdigit():
        raise ValueError(f"MESH_CPU_PREFETCH={env!r}: expected a number of bytes (0: no prefetch)")
    ahead = int(env)
    if not ahead or n < PREFETCH_COLUMNS:
        return ""
    lines = [f"__builtin_prefetch(r + {ahead + p});" for p in range(0, rest_bytes, 64)]
    ahead_h = ahead * half_bytes // rest_bytes   # the same blocks' float16 fields
    lines += [f"__builtin_prefetch((const char*)h + {ahead_h + p});" for p in range(0, half_bytes, 64)]
    return "\n      " + " ".join(lines)


def _dot_kernel(ggml_type: int, threads: int, residual: bool, isa: str):
    kind, rb, nh = KINDS[ggml_type]

    def kernel(out: UOp, rest: UOp, halfs: UOp, xq: UOp, xd: UOp, xsum: UOp, *extra: UOp) -> UOp:
        G, NB = rest.shape[0], rest.shape[1]
        N, C, rows = xq.shape[0], xq.shape[1], out.shape[1]
        core = UOp.range(threads, 0, AxisType.GLOBAL)
        per = G // threads
        res = f" + @7[n * {rows} + g * 16 + l]" if residual else ""
        block = _block_code(kind, nh, isa, C, C // BLOCK).replace("N_COLS", str(N))
        code = f"""{{
  typedef int v16i __attribute__((vector_size(64)));
  typedef float v16f __attribute__((vector_size(64)));
  typedef unsigned char v64u __attribute__((vector_size(64)));
  typedef int v8i __attribute__((vector_size(32)));
  typedef short v16s __attribute__((vector_size(32)));
  typedef char v32c __attribute__((vector_size(32)));
  typedef signed char v32s __attribute__((vector_size(32)));
  typedef __fp16 v16h __attribute__((vector_size(32)));
  typedef unsigned char v16u __attribute__((vector_size(16)));
  typedef signed char v16sc __attribute__((vector_size(16)));
  const v16s one16 = (v16s){{}} + 1;
  for (int g = (@1) * {per}; g < ((@1) + 1) * {per}; g++) {{
    v16f acc[{N}];
    for (int n = 0; n < {N}; n++) acc[n] = (v16f){{}};
    for (int b = 0; b < {NB}; b++) {{
      const unsigned char* r = @2 + (g * {NB} + b) * {rb * 16};
      const __fp16* h = @3 + (g * {NB} + b) * {nh * 16};{_prefetch(rb * 16, nh * 32, N)}
      {block}
    }}
    for (int n = 0; n < {N}; n++) for (int l = 0; l < 16; l++) @0[n * {rows} + g * 16 + l] = acc[n][l]{res};
  }}
}}"""
        ci = core_index(core, threads)
        body = custom(code, ci, [(out, (0, ci * (per * 16)))], [rest, halfs, xq, xd, xsum, *extra])
        name = f"i8_{kind}_{G}x16_{NB}_n{N}" + ("" if isa == "vnni" else f"_{isa}")
        return body.end(core).sink(arg=KernelInfo(name=name,
                                                  opts_to_apply=()))
    return kernel


def matmul_t(rest: Tensor, halfs: Tensor, ggml_type: int, rows: int, x: Tensor, *,
             norm: tuple[Tensor, float] | None = None, glu: bool = False, residual: Tensor | None = None,
             x8: X8 | None = None) -> Tensor:
    """x (N, cols) @ W.T -> (N, rows) float32 for W's resident blocks, x quantized to 8 bits per block of 32; the
    options of `QuantWeight.matmul_t`. The norm runs inside the quantize kernel, and so does silu(gate) * up
    (`glu_in_quantize`; else engine/cpu_kernels.py's kernel before it), for one column as for many. `x8`: x already
    quantized by the kernel that made it (`quantize`'s result, bitwise), used as it is (no norm, no glu)."""
    if x8 is not None and (norm is not None or glu):
        raise ValueError("matmul_t: a quantized x8 comes without a norm or glu to apply")
    x = x.cast(F32)
    if glu and (norm is not None or not glu_in_quantize()):
        x, glu = cpu_kernels.glu(x), False
    if x.shape[0] > MAX_COLUMNS:  # the column sums sit on each core thread's stack: bound them
        parts = [matmul_t(rest, halfs, ggml_type, rows, x[i:i + MAX_COLUMNS], norm=norm, glu=glu,  # (x8 dropped)
                          residual=None if residual is None else residual[i:i + MAX_COLUMNS])
                 for i in range(0, x.shape[0], MAX_COLUMNS)]
        return parts[0].cat(*parts[1:], dim=0)
    xq, xd, xs = x8 if x8 is not None else quantize(x, norm, glu)
    out = Tensor.empty(x.shape[0], rows, dtype=F32, device=rest.device)
    extra = [residual.cast(F32).contiguous()] if residual is not None else []
    fxn = _dot_kernel(ggml_type, slices(rest.shape[0], cpu_threads()), residual is not None, _isa())
    return Tensor.custom_kernel(out, rest, halfs, xq, xd, xs, *extra, fxn=fxn)[0]
