"""A CPU kernel written as C text inside a tinygrad CUSTOM op (engine/quant_i8.py, engine/attention_cpu.py), and the C
of tinygrad values such kernels compute as its own kernels do (a float constant, exp2).

tinygrad renders no vector integer ops and bounds every loop by a value it knows when it renders the kernel; where a
kernel needs either, its body is C (GCC vector extensions, clang builtins) in one CUSTOM statement. The step runner
(engine/cpu_runner.py) walks such a kernel like any other: the core slice is its GLOBAL axis.
"""
from __future__ import annotations

import re
import struct

from tinygrad import UOp, dtypes
from tinygrad.uop.ops import Ops


def renders_c(device: str) -> bool:
    """Whether `device` renders C for clang (the kernels written as C text need it): not the LLVM IR or X86
    renderers that a DEV such as CPU:LLVM or CPU:X86 picks (their stages keep tinygrad's own kernels)."""
    from tinygrad import Device
    return type(Device[device].renderer).__name__ == "ClangRenderer"


def c_format(code: str) -> str:
    """C text -> a CUSTOM op's format string: braces doubled, the op's sources @0, @1, ... as {0}, {1}, ..."""
    return re.sub(r"@(\d+)", r"{\1}", code.replace("{", "{{").replace("}", "}}"))


def custom(code: str, core: UOp, writes: list[tuple[UOp, tuple[UOp | int, ...]]], reads: list[UOp],
           values: tuple[UOp, ...] = ()) -> UOp:
    """The C `code` as one CUSTOM statement, its sources @0, @1, ... the pointers of the written buffers, the core
    slice, the pointers of the read buffers, then `values` (bound variables: their names in the C). tinygrad learns
    which buffers a kernel writes and reads from its STOREs and LOADs only (ProgramInfo's outs and ins, which the step
    templates' checks and the jit's input copies use), so the statement comes after a store of 0 to one element of
    each written buffer that this core slice's code overwrites (its first: no other slice writes it), and it takes
    one loaded element of each read buffer."""
    marks = [buf[idx].store(0) for buf, idx in writes]
    loads = [buf[(0,) * len(buf.shape)] for buf in reads]
    srcs = (*[b.base for b, _ in writes], core, *[b.base for b in reads], *values, *marks, *loads)
    return UOp(Ops.CUSTOM, dtypes.void, srcs, arg=c_format(code))


def load16f(dst: str, src: str, half: bool) -> str:
    """C declaring the 16-float vector `dst` (a `v16f`) loaded from the pointer expression `src`: 16 floats, or with
    `half` 16 float16 values (a `v16h`) converted in one vector instruction (vcvtph2ps where the CPU has it; clang
    turns a loop of `(float)h[l]` into 16 scalar conversions and inserts)."""
    if half:
        return f"v16f {dst}; {{ v16h t_; __builtin_memcpy(&t_, {src}, 32); {dst} = __builtin_convertvector(t_, v16f); }}"
    return f"v16f {dst}; __builtin_memcpy(&{dst}, {src}, 64);"


def c_f32(x: float) -> str:
    """x rounded to float32, as a C hex literal: the constant tinygrad renders for x (its f32 value), exactly."""
    return struct.unpack("f", struct.pack("f", x))[0].hex() + "f"


def c_exp2(x: str) -> str:
    """C statements computing `e` = exp2(x) for the float expression `x` as tinygrad's decomposition renders it
    (tinygrad/uop/decompositions.py xexp2: a rounding to an integer, a degree-6 polynomial that clang contracts to
    FMAs, two power-of-two factors), with its guards for inf and NaN."""
    terms = ["0.00015359208919107914f", "0.0013392627006396651f", "0.009618384763598442f", "0.055503472685813904f",
             "0.24022644758224487f", "0.6931471824645996f", "1.0f"]
    expr = f"({terms[0]} * f)"
    for c in terms[1:-1]:
        expr = f"(({expr} + {c}) * f)"
    expr = f"({expr} + {terms[-1]})"
    return (f"const float a = {x}; const _Bool nan = a != a; "
            f"const float z = a != __builtin_inff() ? (nan ? 0.0f : (a != -__builtin_inff() ? a : 0.0f)) : 0.0f; "
            f"const int k = (int)(z + (z < 0.0f ? -0.5f : 0.5f)), k2 = k >> 1; const float f = z - (float)k; "
            f"const float u = !(a < 128.0f) ? __builtin_inff() : ({expr} * __builtin_bit_cast(float, (int)((k2 + 127) "
            f"<< 23)) * __builtin_bit_cast(float, (int)(((k - k2) + 127) << 23))); "
            f"const float e = nan ? __builtin_nanf(\"\") : (a < -150.0f ? 0.0f : u);")
