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

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, is_dataclass

from tinygrad import Tensor, TinyJit, UOp
from tinygrad.dtype import DType
from tinygrad.engine.jit import CapturedJit, _prepare_jit_inputs, _TinyJit, graph_split_rewrite
from tinygrad.engine.realize import get_call_arg_uops, get_call_outs_ins
from tinygrad.helpers import JIT, JIT_BATCH_SIZE, Context, getenv
from tinygrad.tensor import all_tensors
from tinygrad.uop.ops import Ops

from engine.matvec_gpu import magic_word

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
    # the GPU matvec's exponent words (engine/matvec_gpu.magic_word), read by its every kernel: an input of every
    # layer like its weights (as a live tensor read but not an input, the layer would not be shareable)
    for dev in sorted({str(t.device) for t in out if not str(t.device).startswith(("CPU", "DISK"))}):
        if all((m := magic_word(dev)) is not t for t in out):
            out.append(m)
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
    """The BUFFER UOps TinyJit makes its input PARAMs from (`_prepare_jit_inputs` computes the same, ~15 ms a call)."""
    out = []
    for t in tensors:
        u = t.uop.base
        if u.op is not Ops.BUFFER or u.realized is None:
            raise NotShareable(f"a step input is not a realized buffer ({u.op})")
        out.append(u)
    return out


def _base(u: UOp):
    b = u.buffer
    return b._base if getattr(b, "_base", None) is not None else b


SCRATCH = 1 << 20  # PARAM slots from here on stand for a template's own buffers (planned scratch, its output)
VIEWS = 1 << 21  # and from here on for views of an input's buffer made while building the graph (GPU word views)


@dataclass(frozen=True)
class Template:
    """One captured part of a step (a layer kind, or the head) with every buffer a PARAM: slots below n_in are its
    inputs (x, cos, sin, the layer's tensors; the head: x and its tensors), slots SCRATCH + i its own buffers
    (device, size, dtype), of which `out` is the one its result is written to, seen as `out_shape`. Holds no
    buffer and no process state, so it can be pickled and instantiated in another process."""
    linear: UOp
    n_in: int
    scratch: tuple[tuple[str, int, DType], ...]
    out: int
    out_shape: tuple[int, ...]
    views: tuple[tuple[int, int, DType, int], ...] = ()  # PARAM VIEWS + k: (input slot, size, dtype, byte offset)

    def instantiate(self, inputs: list[UOp], scratch: list[UOp] | None = None) -> tuple[list[UOp], list[UOp]]:
        """The calls with inputs[i] for PARAM i and the given scratch buffers (default: freshly allocated ones,
        returned for the next layer of the kind, which shares them)."""
        if len(inputs) != self.n_in:
            raise NotShareable(f"a template of {self.n_in} inputs given {len(inputs)}")
        if scratch is None:
            scratch = [UOp.new_buffer(d, n, dt) for d, n, dt in self.scratch]
            for b in scratch:
                b.buffer.ensure_allocated()
        mapping = {}
        for slot, p in self.params.items():
            if slot >= VIEWS:  # the same view of this layer's buffer (quant._words: its uint8 blocks as words)
                i, size, dtype, offset = self.views[slot - VIEWS]
                if inputs[i].op is not Ops.BUFFER:
                    raise NotShareable(f"a view of input {i}, which is not a buffer")
                mapping[p] = UOp.from_buffer(inputs[i].buffer.view(size, dtype, offset))
            elif slot >= SCRATCH:
                mapping[p] = scratch[slot - SCRATCH]
            else:
                u = inputs[slot]
                if u.op is Ops.BUFFER and (u.dtype, u.buffer.size) != (p.dtype, p.max_numel()):
                    raise NotShareable(f"input {slot} is {u.dtype} x {u.buffer.size}, the template's {p.dtype} x "
                                       f"{p.max_numel()}")
                mapping[p] = u
        return _substitute(self.linear, mapping), scratch

    @functools.cached_property
    def params(self) -> dict[int, UOp]:
        return _params(self.linear)

    def __getstate__(self):  # the cached params are rebuilt, not pickled
        return {k: v for k, v in self.__dict__.items() if k != "params"}

    def __setstate__(self, state):
        self.__dict__.update(state)

    def output(self, scratch: list[UOp]) -> Tensor:
        return Tensor(scratch[self.out]).reshape(self.out_shape)


def _template(linear: UOp, ret: Tensor, n_in: int, own: dict[int, int]) -> Template:
    """A captured call list as a Template: its concrete buffers (the memory plan's arena, the output) become
    PARAMs SCRATCH + i, views of an input's buffer (`own`: id of the base Buffer -> input slot) PARAMs VIEWS + k."""
    bases: dict[UOp, int] = {}
    views: dict[UOp, tuple[int, int, DType, int]] = {}
    for c in linear.src:
        for a in get_call_arg_uops(c):
            for u in a.toposort():
                if u.op is not Ops.BUFFER or u in bases or u in views:
                    continue
                b = u.buffer
                if getattr(b, "_base", None) is not None and id(b._base) in own:
                    views[u] = (own[id(b._base)], b.size, b.dtype, b.offset)
                else:
                    bases[u] = len(bases)
    out = _buffer_uops([ret])[0]
    if out not in bases:
        raise NotShareable("the captured part does not write its output")
    mapping = {u: UOp.param(SCRATCH + i, u.dtype, (u.buffer.size,), u.device) for u, i in bases.items()}
    mapping |= {u: UOp.param(VIEWS + k, u.dtype, (u.buffer.size,), u.device) for k, u in enumerate(views)}
    scratch = tuple((u.device, u.buffer.size, u.dtype) for u in bases)
    return Template(UOp(Ops.LINEAR, src=tuple(_substitute(linear, mapping))), n_in, scratch, bases[out],
                    tuple(ret.shape), tuple(views.values()))


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


def _check(linear: UOp, ret: Tensor, own: dict[int, int], n_fixed: int, chained: bool) -> None:
    """The captured calls read no live tensor but their inputs (PARAMs) and write none of the first n_fixed inputs
    (x, cos, sin: shared by every layer and by the step's caller); a layer (`chained`) reads all of x (PARAM 0)
    before its first write of the output, so x and the output may be one buffer."""
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
                if k in outs and any(s < n_fixed for s in slots):
                    raise NotShareable("a layer writes its input")
                if 0 in slots:
                    last_x_read = i
                continue
            base = _base(a)
            if id(base) in own:  # a view of one of its inputs' buffers: the template takes the same view of each
                if k in outs:
                    raise NotShareable("a layer writes through a view of one of its inputs")
                continue
            if id(base) in live:
                raise NotShareable(f"a layer kernel reads a tensor that is not one of its inputs ({base})")
            if base is out and k in outs and first_out_write is None:
                first_out_write = i
    if chained and (first_out_write is None or last_x_read >= first_out_write):
        raise NotShareable("a layer writes its output before it has read all of its input")


def _substitute(linear: UOp, mapping: dict[UOp, UOp]) -> list[UOp]:
    """The calls with PARAMs (or buffers) in their arguments replaced; the kernels themselves are left alone. A
    plain memoized rebuild of the small argument trees (views of one buffer): `UOp.substitute` runs a graph
    rewrite per argument, ~25 ms a layer."""
    memo = dict(mapping)

    def sub(u: UOp) -> UOp:
        if (r := memo.get(u)) is None:
            src = tuple(sub(x) for x in u.src)
            memo[u] = r = u if all(a is b for a, b in zip(src, u.src)) else u.replace(src=src)
        return r
    return [c.replace(src=(c.src[0], *[s if s.is_bound_var else sub(s) for s in c.src[1:]])) for c in linear.src]


def _capture_template(fn: Callable, inputs: list[Tensor], binds: Sequence[UOp], n_fixed: int,
                      chained: bool) -> Template:
    own = {id(_base(t.uop)): i for i, t in enumerate(inputs) if i >= n_fixed}
    linear, ret = _capture(fn, (*inputs, *binds))
    _check(linear, ret, own, n_fixed, chained)
    return _template(linear, ret, len(inputs), own)


def capture_shared(blocks: Sequence, layer_fn: Callable, head: tuple[object, Callable] | None,
                   inputs: Sequence[Tensor], binds: Sequence[UOp],
                   templates: dict | None = None) -> tuple[_TinyJit, dict]:
    """A jit for the step `x -> head(blocks[-1](...blocks[0](x)))` (no head: the last block's output) whose calls
    come from one template per layer kind. layer_fn(block, x, cos, sin, *binds) and head = (module, fn(x, *binds))
    build the graph of one layer and of the head; inputs are the step's (x, cos, sin). `templates` (from an
    earlier process: {repr(kind) or "head": Template}) are used where they fit, the rest captured (each capture
    runs its part once, with copies of the KV caches it writes, so the caches are untouched). Returns the jit and
    the templates it used, to be kept for the next process."""
    if getenv("HCQ2"):
        raise NotShareable("HCQ2 links its command queues at capture")
    x, cos, sin = inputs
    have = dict(templates or {})
    calls: list[UOp] = []
    cur = x  # the tensor holding the running activations
    step_bufs = _buffer_uops(inputs)
    step_params = {i: UOp.param(i, u.dtype, u.shape, u.device) for i, u in enumerate(step_bufs)}
    scratch: dict[str, list[UOp]] = {}  # per layer kind: its buffers, output included, shared by its layers
    for block in blocks:
        key = repr(block_kind(block))
        tensors = block_tensors(block)
        if key not in have:
            def fn(x_, cos_, sin_, *rest, _block=block, _n=len(tensors)):
                return layer_fn(_block, x_, cos_, sin_, *rest[_n:])
            have[key] = _capture_template(fn, [cur, cos, sin, *tensors], binds, 3, True)
        bufs = _buffer_uops([cur, cos, sin, *tensors])
        ins = [step_params[0] if cur is x else bufs[0], step_params[1], step_params[2], *bufs[3:]]
        layer_calls, scratch[key] = have[key].instantiate(ins, scratch.get(key))
        calls += layer_calls
        cur = have[key].output(scratch[key])
    ret = cur
    if head is not None:
        module, head_fn = head
        tensors = block_tensors(module)
        if "head" not in have:
            def hfn(x_, *rest, _n=len(tensors)):
                return head_fn(x_, *rest[_n:])
            have["head"] = _capture_template(hfn, [cur, *tensors], binds, 1, False)
        head_calls, head_scratch = have["head"].instantiate(_buffer_uops([cur, *tensors]))
        calls += head_calls
        ret = have["head"].output(head_scratch)
    linear = UOp(Ops.LINEAR, src=tuple(calls))
    if JIT.value < 2:  # as TinyJit's own lowering: runs of kernels become graphs where the device has them
        linear = graph_split_rewrite(linear, max_batch_size=JIT_BATCH_SIZE.value)
    _, _, names, info = _prepare_jit_inputs((*inputs, *binds), {})
    captured = CapturedJit(ret, linear, names, info)
    captured.__dict__["_written_uops"] = set()  # checked above: no part writes x, cos or sin (saves ~0.5 s a shape)
    return _TinyJit(None, captured=captured), have
