"""CPU matmuls with 8-bit activations: x quantized per block of 32, integer dot products (AVX-512 VNNI).

Why (issue 11, "8 streams >= 4x one stream on 2 cores"): the f32 path (engine/quant.py's matvec, engine/quant_gemm.py's
GEMM) multiplies every decoded weight as a float, one 16-lane FMA per value and column. With several columns a step
that is the bound: an 8-column SmolLM2 step cost ~2.35 one-column steps, almost all of it FMAs (NOTES "Prefill
GEMM"). llama.cpp's CPU path does what this module does: x is quantized to int8 per block of 32 values (Q8_0 /
Q8_1's scheme) and a block's products are integers, 64 of them per `vpdpbusd` (4 bytes x 16 lanes), four times the
products of an FMA. A standalone C loop of this kernel on this box's Xeon (1536x576 Q4_1, one core): 8 columns 272 ->
57 us, one column 81 -> 34 us (bench/RESULTS.md "Twelfth session: 8-bit activations").

Numerics (the lead's decision, thirteenth session): x of a block of 32 values becomes q = rint(x / d), d = amax / 127
(llama.cpp's quantize_row_q8_0/q8_1: the same d, the inverse multiplied, ties to even as its SIMD quantizers do;
d is kept in f32, where llama.cpp rounds it to f16). A row's result is, per block in order from 0,
    acc = acc + float(isum) * (d_w * d_x)            isum = sum of q_w * q_x over the block, exact in int32
    acc = acc + m_w * (d_x * float(sum q_x))         Q4_1 only (its offset m times the block's x)
with Q4_0's -8 and Q8_0's unsigned bias folded into isum as integers (isum - 8 sum q_x). Every integer is exact, so
the order inside a block is free; the float steps are one fixed chain per row and column. A column's result never
depends on its step's other columns (the same kernel for 1 column and for 256): batch invariance holds. Against f32
activations the results move by the int8 rounding of x (relative ~1e-3 of a row's sum), as llama.cpp's do.

Which weights (`wanted`): Q4_0, Q4_1 and Q8_0 blocks in rows of 16 (SmolLM2's types), on a CPU with AVX-512 VNNI.
Other types keep the f32 path. Elsewhere (AVX2, NEON) the f32 path stays the default: a portable integer loop
(`generic`, the same bits: every sum is an integer) ran 2x slower than the f32 FMAs in clang's code there;
MESH_CPU_INT8=1 forces this path on (the tests do, to check that the portable code gives the VNNI code's bits),
MESH_CPU_INT8=0 keeps f32 everywhere (A/B runs). A stage's numerics follow its host's instructions: a fleet of an
AVX-512 VNNI box and a NEON Mac is not bitwise one machine (it never was across CPU and GPU).

The kernels are C inside tinygrad CUSTOM ops (the step runner, engine/cpu_runner.py, still walks them like any
kernel; the core slice is the kernel's GLOBAL axis): tinygrad's renderer has no vector integer ops, and clang 14
does not form `vpdpbusd` from plain C (read in its output: `vpmulld`), so the one instruction is its builtin and the
rest is GCC vector extension code, which clang keeps as written. The resident layout is engine/quant.py's (16 rows
interleaved byte by byte); the byte transpose into the lanes `vpdpbusd` wants (4 values of a row in a 32-bit lane) is
one `vpermb` per 64 bytes (`__builtin_shufflevector`), amortized over the step's columns.
"""
from __future__ import annotations

import os
import re

from gguf import GGMLQuantizationType as Q
from tinygrad import Tensor, UOp, dtypes
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

from . import cpu_kernels
from .cpu_runner import core_index, cpu_threads
from .quant_gemm import MAX_COLUMNS, _cpu_flags, slices

F32 = dtypes.float32
BLOCK = 32  # values of x per scale: every type here has blocks of 32
# per type: rest bytes a row's block holds, float16 fields, the integer subtracted per unit of sum(q_x)
KINDS = {Q.Q4_0: ("q4_0", 16, 1, 8), Q.Q4_1: ("q4_1", 16, 2, 0), Q.Q8_0: ("q8_0", 32, 1, 0)}
IL = 16  # rows a group: one 16-lane vector of int32 / f32 sums


def vnni() -> bool:
    """Whether this host's clang (-march=native) has the instructions of the fast kernel: AVX-512 VNNI, and VBMI
    for the byte transpose in one instruction."""
    flags = _cpu_flags()
    return "avx512_vnni" in flags and "avx512vbmi" in flags


def wanted(ggml_type: int, il: int, device: str) -> bool:
    """Whether a weight of `ggml_type` interleaved by `il` takes this path on `device` (see the module's docstring)."""
    if not device.startswith("CPU") or ggml_type not in KINDS or il != IL or not _clang(device):
        return False
    env = os.environ.get("MESH_CPU_INT8")
    return env == "1" if env in ("0", "1") else vnni()


def _clang(device: str) -> bool:
    """Whether `device` renders C for clang (the kernels here are C text): not the LLVM IR or X86 renderers that a
    DEV such as CPU:LLVM or CPU:X86 picks (where they take the f32 path)."""
    from tinygrad import Device
    return type(Device[device].renderer).__name__ == "ClangRenderer"


def _fast() -> bool:  # the VNNI code, unless MESH_CPU_INT8_GENERIC=1 asks for the portable loops (tests, A/B)
    return vnni() and os.environ.get("MESH_CPU_INT8_GENERIC", "0") != "1"


def _c(code: str) -> str:
    """C text -> a CUSTOM op's format string: braces doubled, the op's sources @0, @1, ... as {0}, {1}, ..."""
    return re.sub(r"@(\d)", r"{\1}", code.replace("{", "{{").replace("}", "}}"))


def _custom(code: str, core: UOp, writes: list[tuple[UOp, tuple[UOp | int, ...]]], reads: list[UOp]) -> UOp:
    """The C `code` as one CUSTOM statement, its sources @0, @1, ... the pointers of the written buffers, the core
    slice, then the pointers of the read buffers. tinygrad learns which buffers a kernel writes and reads from its STOREs and
    LOADs only (ProgramInfo's outs and ins, which the step templates' checks and the jit's input copies use), so
    the statement comes after a store of 0 to one element of each written buffer that this core slice's code
    overwrites (its first: no other slice writes it), and it takes one loaded element of each read buffer."""
    marks = [buf[idx].store(0) for buf, idx in writes]
    loads = [buf[(0,) * len(buf.shape)] for buf in reads]
    srcs = (*[b.base for b, _ in writes], core, *[b.base for b in reads], *marks, *loads)
    return UOp(Ops.CUSTOM, dtypes.void, srcs, arg=_c(code))


def _quantize_kernel(out_q: UOp, out_d: UOp, out_s: UOp, x: UOp) -> UOp:
    N, C = x.shape
    T = next(t for t in range(min(cpu_threads(), N), 0, -1) if N % t == 0) if N > 1 else 1
    core = UOp.range(T, 0, AxisType.GLOBAL)
    NB, per = C // BLOCK, N // T
    code = f"""{{
  for (int n = (@3) * {per}; n < ((@3) + 1) * {per}; n++) for (int b = 0; b < {NB}; b++) {{
    const float* v = @4 + n * {C} + b * {BLOCK};
    float amax = 0.0f;
    for (int j = 0; j < {BLOCK}; j++) {{ const float a = __builtin_fabsf(v[j]); amax = a > amax ? a : amax; }}
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int s = 0;
    for (int j = 0; j < {BLOCK}; j++) {{
      const int q = (int)__builtin_rintf(v[j] * id);
      @0[n * {C} + b * {BLOCK} + j] = (signed char)q;
      s += q;
    }}
    @1[n * {NB} + b] = d;
    @2[n * {NB} + b] = s;
  }}
}}"""
    ci = core_index(core, T)
    body = _custom(code, ci, [(out_q, (ci * per, 0)), (out_d, (ci * per, 0)), (out_s, (ci * per, 0))], [x])
    return body.end(core).sink(arg=KernelInfo(name=f"q8x_{N}x{C}", opts_to_apply=()))


def quantize(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x (N, C) float32 -> (q (N, C) int8, d (N, C/32) float32, sum of q (N, C/32) int32), per block of 32."""
    N, C = x.shape
    q = Tensor.empty(N, C, dtype=dtypes.int8, device=x.device)
    d = Tensor.empty(N, C // BLOCK, dtype=F32, device=x.device)
    s = Tensor.empty(N, C // BLOCK, dtype=dtypes.int32, device=x.device)
    q, d, s, _ = Tensor.custom_kernel(q, d, s, x.cast(F32).contiguous(), fxn=_quantize_kernel)
    return q, d, s


def _transpose(k: int) -> str:
    """The shuffle that takes 64 bytes laid out as k byte planes of 16 rows (plane p, row l at 16 p + l) to 16 lanes
    of k bytes (row l's bytes at k l .. k l + k - 1): vpermb on VBMI hosts."""
    return ", ".join(str(p * 16 + lane) for lane in range(16) for p in range(k))


def _dot_code(kind: str, rb: int, fast: bool) -> tuple[str, str]:
    """(decode of one block of 16 rows from `r`, the block's integer sums `s` for one column's quants `q`)."""
    if fast:
        words = rb // 4  # 64-byte loads a block: 4 byte planes each
        if kind == "q8_0":  # signed bytes -> unsigned (+128), taken off again as 128 sum(q_x) below
            dec = "".join(f"""
      {{ v64u v; __builtin_memcpy(&v, r + {c * 64}, 64); v = __builtin_shufflevector(v, v, {_transpose(4)});
        w[{c}] = (v16i)(v ^ (unsigned char)0x80); }}""" for c in range(words))
            pairs = [(c, 4 * c) for c in range(words)]
        else:  # low nibbles are values 0..15, high nibbles 16..31
            dec = "".join(f"""
      {{ v64u v; __builtin_memcpy(&v, r + {c * 64}, 64); v = __builtin_shufflevector(v, v, {_transpose(4)});
        w[{c}] = (v16i)(v & (unsigned char)15); w[{c + words}] = (v16i)((v >> 4) & (unsigned char)15); }}"""
                for c in range(words))
            pairs = [(c, 4 * c) for c in range(words)] + [(c + words, 16 + 4 * c) for c in range(words)]
        dec = f"v16i w[{len(pairs)}];" + dec
        # four independent chains (integer sums: any order is exact), one 32-bit broadcast of 4 quants each
        dot = "v16i s4[4] = {};" + "".join(
            f"""
        {{ int xw; __builtin_memcpy(&xw, q + {off}, 4);
          s4[{i % 4}] = __builtin_ia32_vpdpbusd512(s4[{i % 4}], w[{wi}], (v16i){{}} + xw); }}"""
            for i, (wi, off) in enumerate(pairs)) + "\n        v16i s = (s4[0] + s4[1]) + (s4[2] + s4[3]);"
        bias = 128 if kind == "q8_0" else (8 if kind == "q4_0" else 0)
    else:  # portable: every value as an int, then plain loops (the same integers)
        if kind == "q8_0":
            dec = f"""int wv[32][16];
      for (int j = 0; j < 32; j++) for (int l = 0; l < 16; l++) wv[j][l] = (signed char)r[j * 16 + l];"""
        else:
            dec = f"""int wv[32][16];
      for (int j = 0; j < 16; j++) for (int l = 0; l < 16; l++) {{
        wv[j][l] = r[j * 16 + l] & 15; wv[j + 16][l] = r[j * 16 + l] >> 4; }}"""
        dot = """v16i s = {};
        for (int j = 0; j < 32; j++) for (int l = 0; l < 16; l++) s[l] += wv[j][l] * (int)q[j];"""
        bias = 8 if kind == "q4_0" else 0
    if bias:
        dot += f"\n        s = s - {bias} * xs;"
    return dec, dot


def _dot_kernel(ggml_type: int, threads: int, residual: bool, fast: bool):
    kind, rb, nh, _ = KINDS[ggml_type]

    def kernel(out: UOp, rest: UOp, halfs: UOp, xq: UOp, xd: UOp, xsum: UOp, *extra: UOp) -> UOp:
        G, NB = rest.shape[0], rest.shape[1]
        N, C, rows = xq.shape[0], xq.shape[1], out.shape[1]
        core = UOp.range(threads, 0, AxisType.GLOBAL)
        per = G // threads
        dec, dot = _dot_code(kind, rb, fast)
        offset = "\n        acc[n] = acc[n] + mw * (dx * (float)xs);" if nh == 2 else ""
        res = f" + @7[n * {rows} + g * 16 + l]" if residual else ""
        code = f"""{{
  typedef int v16i __attribute__((vector_size(64)));
  typedef float v16f __attribute__((vector_size(64)));
  typedef unsigned char v64u __attribute__((vector_size(64)));
  for (int g = (@1) * {per}; g < ((@1) + 1) * {per}; g++) {{
    v16f acc[{N}];
    for (int n = 0; n < {N}; n++) acc[n] = (v16f){{}};
    for (int b = 0; b < {NB}; b++) {{
      const unsigned char* r = @2 + (g * {NB} + b) * {rb * 16};
      const __fp16* h = @3 + (g * {NB} + b) * {nh * 16};
      v16f dw, mw;
      for (int l = 0; l < 16; l++) {{ dw[l] = (float)h[l]; mw[l] = {"(float)h[16 + l]" if nh == 2 else "0.0f"}; }}
      {dec}
      for (int n = 0; n < {N}; n++) {{
        const signed char* q = @4 + n * {C} + b * {BLOCK};
        const int xs = @6[n * {NB} + b];
        const float dx = @5[n * {NB} + b];
        {dot}
        acc[n] = acc[n] + __builtin_convertvector(s, v16f) * (dw * dx);{offset}
      }}
    }}
    for (int n = 0; n < {N}; n++) for (int l = 0; l < 16; l++) @0[n * {rows} + g * 16 + l] = acc[n][l]{res};
  }}
}}"""
        ci = core_index(core, threads)
        body = _custom(code, ci, [(out, (0, ci * (per * 16)))], [rest, halfs, xq, xd, xsum, *extra])
        return body.end(core).sink(arg=KernelInfo(name=f"i8_{kind}_{G}x16_{NB}_n{N}" + ("" if fast else "_generic"),
                                                  opts_to_apply=()))
    return kernel


def matmul_t(rest: Tensor, halfs: Tensor, ggml_type: int, rows: int, x: Tensor, *,
             norm: tuple[Tensor, float] | None = None, glu: bool = False, residual: Tensor | None = None) -> Tensor:
    """x (N, cols) @ W.T -> (N, rows) float32 for W's resident blocks, x quantized to 8 bits per block of 32; the
    options of `QuantWeight.matmul_t`. The norm and silu(gate) * up run first as engine/cpu_kernels.py's kernels
    (the GEMM's, bitwise the matvec's inline ones), for one column as for many."""
    x = x.cast(F32)
    if glu:
        x = cpu_kernels.glu(x)
    if norm is not None:
        x = cpu_kernels.rms_norm_rows(x, norm[0], norm[1])
    if x.shape[0] > MAX_COLUMNS:  # the column sums sit on each core thread's stack: bound them
        parts = [matmul_t(rest, halfs, ggml_type, rows, x[i:i + MAX_COLUMNS],
                          residual=None if residual is None else residual[i:i + MAX_COLUMNS])
                 for i in range(0, x.shape[0], MAX_COLUMNS)]
        return parts[0].cat(*parts[1:], dim=0)
    xq, xd, xs = quantize(x)
    out = Tensor.empty(x.shape[0], rows, dtype=F32, device=rest.device)
    extra = [residual.cast(F32).contiguous()] if residual is not None else []
    fxn = _dot_kernel(ggml_type, slices(rest.shape[0], cpu_threads()), residual is not None, _fast())
    return Tensor.custom_kernel(out, rest, halfs, xq, xd, xs, *extra, fxn=fxn)[0]
