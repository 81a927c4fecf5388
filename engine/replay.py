"""A captured CPU step replayed without tinygrad's executor, its kernels' core slices on every core.

tinygrad's TinyJit replays a captured step through its generic executor: for every kernel it resolves the call's
parameters, looks up the runtime, infers launch dimensions and updates statistics, ~38 us of Python per kernel on
this CPU. A SmolLM2 decode step runs ~390 kernels, so that was ~15 ms of a ~45 ms step. On the CPU device (without
HCQ2) every kernel is a function pointer called with buffer addresses and bound variable values, all of which are
fixed per captured shape except the variables (slot, position, picked rows). So the step is resolved once into
(function, argument words, variable words, core slot, slices) and handed to engine/cpu_runner.py, which runs it
with one C call per thread, every kernel's core slices shared by `cpu_threads()` threads. The kernels, their
order, their buffers and each slice's rows are exactly the jit's: results are bit-identical.

Anything this does not recognise (another device, HCQ2, copies, graphs, several devices) raises NotReplayable, and
the stage keeps using the jit as it is.
"""
from __future__ import annotations

from collections.abc import Sequence

from tinygrad import Tensor
from tinygrad.engine.jit import _prepare_jit_inputs
from tinygrad.engine.realize import get_runtime, resolve_params
from tinygrad.runtime.ops_cpu import CPUProgram
from tinygrad.uop.ops import Ops

from .cpu_runner import Call, StepRunner, cpu_threads


class NotReplayable(Exception):
    pass


class CpuReplay:
    """`head` > 0: the step's last `head` calls are the last stage's output head, and `headless(var_vals)` runs the
    step without them (a prefill chunk whose columns want no logits: the same table up to the head, nothing new
    to compile)."""
    def __init__(self, jit, inputs: Sequence[Tensor], threads: int | None = None, head: int = 0) -> None:
        captured = jit.captured
        if captured is None:
            raise NotReplayable("the jit has not captured yet")
        input_uops, _, _, _ = _prepare_jit_inputs(tuple(inputs), {})
        if any(u in captured._written_uops for u in input_uops):
            raise NotReplayable("the step writes one of its inputs")
        self.ret = captured.ret
        self.calls: list[Call] = []
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
            global_size, _ = ast.arg.launch_dims({n: 0 for n in names})
            if not all(isinstance(d, int) for d in global_size):
                raise NotReplayable("symbolic launch size")
            variables = tuple((len(addrs) + i, n) for i, n in enumerate(names) if n != "core_id")
            self.calls.append(Call(rt.addr, tuple(addrs + [0] * len(names)), variables, core,
                                   global_size[0] if core is not None else 1))
        self.threads = cpu_threads() if threads is None else threads
        self.runner = StepRunner(self.calls, self.threads)
        self.body = StepRunner(self.calls[:-head], self.threads) if 0 < head < len(self.calls) else None

    def __call__(self, var_vals: dict[str, int]):
        self.runner.run(var_vals)
        return self.ret

    def headless(self, var_vals: dict[str, int]) -> None:
        (self.body or self.runner).run(var_vals)
