"""One captured layer per step shape, its kernels reused by every layer of the same kind.

A stage's layers are identical in structure: the same ops on tensors of the same shapes, only the buffers differ
(weights, KV cache). Capturing a whole step with TinyJit schedules, renders and plans every layer's ~13 kernels
again: ~0.4 s of Python a layer and shape for SmolLM2, 30 layers, so 10-20 s per step shape at load. Here one layer
of each kind is captured with its tensors as the jit's inputs (PARAM slots), and the step's call list is assembled
from that one capture: for layer i every PARAM is replaced in the call arguments by layer i's buffer, the layer's
input x by the previous layer's output. The kernels (the same compiled programs), their order and their arguments
are what a whole-step capture gives, so results are bit-identical; the assembled list is an ordinary `CapturedJit`
(graph-batched for GPUs as TinyJit would), which the stage runs through TinyJit and `CpuReplay` unchanged.

Consecutive layers of one kind share one output buffer: layer i + 1 reads what layer i wrote there and writes its
own result into it. That is safe only when every kernel that reads the layer's input runs before the first that
writes its output, which is checked on the capture. Anything this cannot prove raises `NotShareable` and the stage
captures the whole step as before: a layer kernel reading a live tensor that is not among the layer's inputs (a
buffer view made while building the graph would silently stay layer 0's), HCQ2's linked command queues, a layer
that writes its input.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields, is_dataclass

from tinygrad import Tensor, TinyJit, UOp
from tinygrad.engine.jit import CapturedJit, _prepare_jit_inputs, _TinyJit, graph_split_rewrite
from tinygrad.engine.realize import get_call_arg_uops, get_call_outs_ins
from tinygrad.helpers import JIT, JIT_BATCH_SIZE, Context, getenv
from tinygrad.tensor import all_tensors
from tinygrad.uop.ops import Ops

__all__ = ["NotShareable", "block_kind", "block_tensors", "capture_shared"]


class NotShareable(Exception):
    pass


def _walk(obj, out: list[Tensor], seen: set[int]) -> None:
    if isinstance(obj, Tensor):
        if id(obj) not in seen:
            seen.add(id(obj))
            out.append(obj)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            _walk(obj[k], out, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk(v, out, seen)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            _walk(getattr(obj, f.name), out, seen)


def _attrs(block) -> dict:
    return {k: getattr(block, k) for k in (getattr(block, "__dict__", None) or {})}


def block_tensors(block) -> list[Tensor]:
    """Every tensor a layer holds (weights, norms, KV caches), in a fixed order: attributes by name, dicts by key,
    dataclass fields (Weight, QuantWeight) in declaration order."""
    out: list[Tensor] = []
    _walk([v for _, v in sorted(_attrs(block).items())], out, set())
    return out


def _plain(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or \
        (isinstance(v, tuple) and all(_plain(x) for x in v))


def block_kind(block) -> tuple:
    """What makes two layers run the same kernels: the class, every plain attribute (head counts, eps, a sliding
    window...) and each tensor's shape, dtype and device. Layers of one kind share one capture."""
    plain = tuple((k, v) for k, v in sorted(_attrs(block).items()) if _plain(v))
    return (type(block).__qualname__, plain,
            tuple((t.shape, t.dtype, str(t.device)) for t in block_tensors(block)))


def _buffer_uops(tensors: Sequence[Tensor]) -> list[UOp]:
    return _prepare_jit_inputs(tuple(tensors), {})[0]


def _base(u: UOp):
    b = u.buffer
    return b._base if getattr(b, "_base", None) is not None else b


def _capture(fn: Callable, args: tuple) -> tuple[UOp, Tensor]:
    """TinyJit's capture of fn(*args) without graph batching (JIT=2): its planned, compiled call list and result."""
    jit = TinyJit(fn)
    jit.cnt = 1
    with Context(JIT=2):
        ret = jit(*args)
    if not isinstance(ret, Tensor):
        raise NotShareable("a layer returns something other than one tensor")
    return jit.captured.linear, ret


def _params(linear: UOp) -> dict[int, UOp]:
    return {u.arg.slot: u for c in linear.src for a in get_call_arg_uops(c) for u in a.toposort() if u.op is Ops.PARAM}


def _check_layer(linear: UOp, ret: Tensor, own: set[int]) -> None:
    """The layer's calls read no live tensor but its inputs (PARAMs) and write its input x (PARAM 0) nowhere, and
    every read of x comes before the first write of the output, so x and the output may be one buffer."""
    out = _base(ret.uop)
    live = set()
    for ref in list(all_tensors):
        if (t := ref()) is not None and t is not ret and t.uop.is_realized:
            try:
                live.add(id(_base(t.uop)))
            except RuntimeError:  # a non-contiguous view: its base is some other tensor's
                pass
    live.discard(id(out))
    last_x_read, first_out_write = -1, None
    for i, c in enumerate(linear.src):
        if c.src[0].op is not Ops.PROGRAM:
            raise NotShareable(f"call {c.src[0].op} in a layer")
        args = get_call_arg_uops(c)
        outs, ins = get_call_outs_ins(c)
        for k, a in enumerate(args):
            slots = {u.arg.slot for u in a.toposort() if u.op is Ops.PARAM}
            if slots:
                if 0 in slots and k in outs:
                    raise NotShareable("a layer writes its input")
                if 0 in slots:
                    last_x_read = i
                continue
            base = _base(a)
            if id(base) in live or id(base) in own:
                raise NotShareable(f"a layer kernel reads a tensor that is not one of its inputs ({base})")
            if base is out and k in outs and first_out_write is None:
                first_out_write = i
    if first_out_write is None or last_x_read >= first_out_write:
        raise NotShareable("a layer writes its output before it has read all of its input")


def _substitute(linear: UOp, mapping: dict[UOp, UOp]) -> list[UOp]:
    """The calls with PARAMs in their arguments replaced; the kernels themselves are left alone."""
    return [c.replace(src=(c.src[0], *[s if s.is_bound_var else s.substitute(mapping) for s in c.src[1:]]))
            for c in linear.src]


def capture_shared(blocks: Sequence, layer_fn: Callable, head_fn: Callable | None, inputs: Sequence[Tensor],
                   binds: Sequence[UOp]) -> _TinyJit:
    """A jit for the step `x -> head(blocks[-1](...blocks[0](x)))` (no head: the last block's output) whose calls
    come from one capture per layer kind. layer_fn(block, x, cos, sin, *binds) and head_fn(x, *binds) build the
    graph of one layer and of the head; inputs are the step's (x, cos, sin). Runs the captured parts once each (a
    layer's capture with copies of the KV caches it writes, so the caches are untouched)."""
    if getenv("HCQ2"):
        raise NotShareable("HCQ2 links its command queues at capture")
    x, cos, sin = inputs
    captured: dict[tuple, tuple[UOp, Tensor, dict[int, UOp]]] = {}
    calls: list[UOp] = []
    cur = x  # the tensor holding the running activations
    step_params = _params_of_step(inputs)
    for block in blocks:
        kind = block_kind(block)
        tensors = block_tensors(block)
        if kind not in captured:
            own = {id(_base(t.uop)) for t in tensors}

            def fn(x_, cos_, sin_, *rest, _block=block, _n=len(tensors)):
                return layer_fn(_block, x_, cos_, sin_, *rest[_n:])
            linear, ret = _capture(fn, (cur, cos, sin, *tensors, *binds))
            _check_layer(linear, ret, own)
            captured[kind] = (linear, ret, _params(linear))
        linear, ret, params = captured[kind]
        bufs = _buffer_uops([cur, cos, sin, *tensors])
        mapping = {p: (step_params[slot] if cur is x or slot in (1, 2) else bufs[slot]) if slot < 3 else bufs[slot]
                   for slot, p in params.items()}
        calls += _substitute(linear, mapping)
        cur = ret
    ret = cur
    if head_fn is not None:
        linear, ret = _capture(head_fn, (cur, *binds))
        calls += _substitute(linear, {p: _buffer_uops([cur])[0] for slot, p in _params(linear).items() if slot == 0})
        if any(slot != 0 for slot in _params(linear)):
            raise NotShareable("the head takes inputs other than the layers' output")
    linear = UOp(Ops.LINEAR, src=tuple(calls))
    if JIT.value < 2:  # as TinyJit's own lowering: runs of kernels become graphs where the device has them
        linear = graph_split_rewrite(linear, max_batch_size=JIT_BATCH_SIZE.value)
    _, _, names, info = _prepare_jit_inputs((*inputs, *binds), {})
    return _TinyJit(None, captured=CapturedJit(ret, linear, names, info))


def _params_of_step(inputs: Sequence[Tensor]) -> dict[int, UOp]:
    """The PARAM UOps a jit over (x, cos, sin) uses for its inputs, as TinyJit's lowering makes them."""
    return {i: UOp.param(i, u.dtype, u.shape, u.device) for i, u in enumerate(_buffer_uops(inputs))}
