"""A captured CPU step replayed as a flat list of C calls.

tinygrad's TinyJit replays a captured step through its generic executor: for every kernel it resolves the call's
parameters, looks up the runtime, infers launch dimensions and updates statistics, ~38 us of Python per kernel on
this CPU. A SmolLM2 decode step runs ~390 kernels, so that was ~15 ms of a ~45 ms step. On the CPU device (without
HCQ2) every kernel is a function pointer called through ctypes with buffer addresses and bound variable values,
all of which are fixed per captured shape except the variables (slot, position, picked rows). So the step is
resolved once into (function, argument list, variable slots) and replayed with one ctypes call per kernel and
core, ~3 us each. The kernels, their order and their buffers are exactly the jit's: results are bit-identical.

Anything this does not recognise (another device, HCQ2, copies, graphs, several devices) raises NotReplayable, and
the stage keeps using the jit as it is.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

from tinygrad import Tensor
from tinygrad.engine.jit import _prepare_jit_inputs
from tinygrad.engine.realize import get_runtime, resolve_params
from tinygrad.runtime.ops_cpu import CPUProgram
from tinygrad.uop.ops import Ops


class NotReplayable(Exception):
    pass


class CpuReplay:
    def __init__(self, jit, inputs: Sequence[Tensor]) -> None:
        captured = jit.captured
        if captured is None:
            raise NotReplayable("the jit has not captured yet")
        input_uops, _, _, _ = _prepare_jit_inputs(tuple(inputs), {})
        if any(u in captured._written_uops for u in input_uops):
            raise NotReplayable("the step writes one of its inputs")
        self.ret = captured.ret
        self.calls: list[tuple[object, list[int], list[tuple[int, str]], int | None, int]] = []
        for call in captured.linear.src:
            ast = call.src[0]
            device = call.src[1].device
            if ast.op is not Ops.PROGRAM or not isinstance(device, str) or not device.startswith("CPU"):
                raise NotReplayable(f"call {ast.op} on {device}")
            rt = get_runtime(device, ast)
            if not isinstance(rt, CPUProgram) or rt.lvp:
                raise NotReplayable(f"runtime {type(rt).__name__}")
            resolved = resolve_params(call, tuple(input_uops))
            addrs = [int(resolved[i].buffer.ensure_allocated()._buf.va_addr) for i in ast.arg.globals]
            names = [v.expr for v in ast.arg.vars]
            core = rt.runtimevars.get("core_id")
            variables = [(len(addrs) + i, n) for i, n in enumerate(names) if n != "core_id"]
            global_size, _ = ast.arg.launch_dims({n: 0 for n in names})
            if not all(isinstance(d, int) for d in global_size):
                raise NotReplayable("symbolic launch size")
            args = addrs + [0] * len(names)
            self.calls.append((rt.fxn, args, variables, core, global_size[0] if core is not None else 1))

    def __call__(self, var_vals: dict[str, int]):
        u64 = ctypes.c_uint64
        for fxn, args, variables, core, threads in self.calls:
            for slot, name in variables:
                args[slot] = var_vals[name]
            for tid in range(threads):
                if core is not None:
                    args[core] = tid
                fxn(*[u64(a) for a in args])
        return self.ret
