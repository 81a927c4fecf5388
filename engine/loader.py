"""Layer-range loading: read from a GGUF only the tensors a stage holds, one tensor at a time.

Each tensor's bytes are read with one positioned read of exactly that tensor's extent; nothing maps or reads
the rest of the file, so a peer holding 4 of 30 layers never has the other 26 in memory.
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize
from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.device import Buffer, BufferSpec
from tinygrad.dtype import _to_np_dtype
from tinygrad.uop.ops import Ops, shape_to_shape_arg
from tinygrad.llm.gguf import _GGML_NATIVE, _GGML_QUANT, ggml_data_to_tensor

from .errors import EngineError, ModelFormatError, RangeError, UnsupportedModel
from .gguf_meta import GGUFFile, ModelMeta, TensorInfo
from .quant import DOTS, QuantWeight, concat, interleave_for, repack, resident_shapes
from .matvec_gpu_tc import tc_repack, tc_shapes, tc_wanted

WeightMode = Literal["gguf", "f32", "f16", "q8"]
WEIGHT_MODES = ("gguf", "f32", "f16", "q8")
TINYGRAD_TYPES = frozenset(_GGML_NATIVE) | frozenset(_GGML_QUANT)


def check_range(meta: ModelMeta, start: int, end: int) -> None:
    """A stage range must be a non-empty slice of the source model and lie inside a range-only file."""
    if not (isinstance(start, int) and isinstance(end, int)) or not 0 <= start < end <= meta.n_layers:
        raise RangeError(f"{meta.path}: layer range [{start}, {end}) is outside the model's {meta.n_layers} layers")
    if meta.range is not None and not (meta.range[0] <= start and end <= meta.range[1]):
        raise RangeError(f"{meta.path}: layer range [{start}, {end}) is outside the layers this file holds "
                         f"[{meta.range[0]}, {meta.range[1]})")


def block_tensor_names(meta: ModelMeta, layer: int) -> dict[str, str]:
    """Short name -> GGUF name for one transformer block's tensors."""
    names = ["attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
             "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
    if meta.qkv_bias:
        names += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if meta.qk_norm:
        names += ["attn_q_norm.weight", "attn_k_norm.weight"]
    if meta.post_norms:
        names += ["post_attention_norm.weight", "post_ffw_norm.weight"]
    return {n: f"blk.{layer}.{n}" for n in names}


def tensor_info(g: GGUFFile, name: str, shape: tuple[int, ...]) -> TensorInfo:
    info = g.tensors.get(name)
    if info is None:
        raise ModelFormatError(f"{g.path}: tensor {name!r} is missing")
    if info.shape != shape:
        raise ModelFormatError(f"{g.path}: tensor {name!r} has shape {info.shape}, expected {shape}")
    if info.ggml_type not in TINYGRAD_TYPES:
        raise UnsupportedModel(f"{g.path}: tensor {name!r} has type {info.type_name}, which tinygrad cannot dequantize")
    return info


def read_rows(g: GGUFFile, info: TensorInfo, r0: int = 0, r1: int | None = None,
              into: np.ndarray | None = None) -> np.ndarray:
    """The raw bytes of rows [r0, r1) of one tensor (all rows by default), shaped (rows, bytes per row); read
    straight into `into` (a C-contiguous uint8 array of that shape) when given. Inside `reading(g)` the file is
    opened once for the whole load."""
    n_rows = info.shape[0] if len(info.shape) > 1 else 1
    r1 = n_rows if r1 is None else min(r1, n_rows)
    row_bytes = info.nbytes // n_rows
    # a writable buffer: tinygrad's GPU backends refuse to copy from a read-only one (CUDA: "not writable")
    raw = memoryview(into if into is not None else bytearray((r1 - r0) * row_bytes)).cast("B")
    if len(raw) != (r1 - r0) * row_bytes:
        raise ValueError(f"{info.name}: {len(raw)} bytes to read rows [{r0}, {r1}) of {row_bytes} bytes into")
    held = _OPEN.get()
    try:
        if held is not None and held[0] is g:
            got = _pread(held[1], raw, info.offset + r0 * row_bytes)
        else:
            with open(g.path, "rb") as f:
                f.seek(info.offset + r0 * row_bytes)
                got = f.readinto(raw)
    except OSError as e:
        raise ModelFormatError(f"{g.path}: cannot read tensor {info.name!r} ({e.strerror or e})") from None
    if got != len(raw):
        raise ModelFormatError(f"{g.path}: truncated while reading tensor {info.name!r}")
    return into if into is not None else np.frombuffer(raw.obj, dtype=np.uint8).reshape(r1 - r0, row_bytes)


def _pread(fd: int, buf: memoryview, offset: int) -> int:
    """Read into all of buf from offset (a read may return less than asked: Linux caps one at ~2 GiB)."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


_OPEN: ContextVar[tuple[GGUFFile, int] | None] = ContextVar("mesh_open_gguf", default=None)
_SCRATCH: ContextVar[list | None] = ContextVar("mesh_load_scratch", default=None)
# bytes copied to an accelerator between two waits for it during a load: CUDA stages every copy in new pinned host
# memory that it frees (to its allocator's cache, for the next copy of that size) only when the device is
# synchronized, so an 8B range would otherwise hold its whole size in pinned host memory until the load ends
SYNC_EVERY = 256 << 20


@contextmanager
def reading(g: GGUFFile) -> Iterator[None]:
    """One stage's load: the file opened once (a positioned read per tensor or chunk, not an open each) and one
    reused host buffer for the raw rows that are regrouped on their way to the device (`scratch`), dropped at the
    end so that it does not stay resident."""
    try:
        fd = os.open(g.path, os.O_RDONLY)
    except OSError as e:
        raise ModelFormatError(f"{g.path}: cannot open ({e.strerror or e})") from None
    tokens = _OPEN.set((g, fd)), _SCRATCH.set([np.empty(0, np.uint8), 0])
    try:
        yield
    finally:
        _OPEN.reset(tokens[0])
        _SCRATCH.reset(tokens[1])
        os.close(fd)


def scratch(shape: tuple[int, int]) -> np.ndarray:
    """An uninitialized uint8 host array of `shape`, from the load's reused buffer inside `reading` (its pages are
    touched once, not once per tensor), a new one outside it. Valid until the next call."""
    n = shape[0] * shape[1]
    held = _SCRATCH.get()
    if held is None:
        return np.empty(shape, np.uint8)
    if held[0].nbytes < n:
        held[0] = np.empty(n, np.uint8)
    return held[0][:n].reshape(shape)


def _copied(t: Tensor, nbytes: int) -> None:
    """Count bytes a load copied into `t`'s device through the allocator; wait for the device every SYNC_EVERY."""
    held = _SCRATCH.get()
    if held is None:
        return
    held[1] += nbytes
    if held[1] >= SYNC_EVERY:
        Device[t.uop.buffer.device].synchronize()
        held[1] = 0


def unpermute_rope_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the llama converter's q/k row permutation so adjacent-pair rotation becomes half-split rotation.

    Rows are whole quant blocks, so this works on the raw bytes of any type: per head, rows (h, two) -> (two, h).
    """
    return _unpermuted_view(rows, n_heads).reshape(rows.shape).copy()


def _unpermuted_view(rows: np.ndarray, n_heads: int) -> np.ndarray:
    r, b = rows.shape
    return rows.reshape(n_heads, r // n_heads // 2, 2, b).transpose(0, 2, 1, 3)


Q8_BLOCK = 32


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x * (x.square().mean(axis=-1, keepdim=True) + eps).rsqrt() * w


@dataclass(slots=True)
class Weight:
    """A weight as the stage holds it: its GGUF blocks decoded inside the matmul ('gguf', see engine/quant.py),
    dense (f32/f16, or a float type kept as the file has it), or int8 blocks with one f32 scale per 32 values ('q8',
    expanded inside the kernels that use it)."""
    tensor: Tensor | None
    shape: tuple[int, ...]
    scale: Tensor | None = None  # set for q8: (rows, cols // 32, 1)
    quant: QuantWeight | None = None  # set for resident GGUF blocks

    def value(self) -> Tensor:
        if self.quant is not None:
            raise EngineError("a block-quantized weight is only used through matmul_t")
        if self.scale is not None:
            rows, cols = self.shape
            return (self.tensor.reshape(rows, cols // Q8_BLOCK, Q8_BLOCK).cast(dtypes.float32) * self.scale).reshape(rows, cols)
        return self.tensor

    def matmul_t(self, x: Tensor, *, norm: tuple[Tensor, float] | None = None, glu: bool = False,
                 residual: Tensor | None = None, x8=None) -> Tensor:
        """x (N, cols) @ weight.T -> (N, rows), with the ops around a linear layer: RMS norm of x by (weight, eps),
        silu(gate) * up of x = [gate | up], a residual added. Resident blocks do all of it in one kernel. `x8`: x
        quantized already, for resident blocks on the CPU's 8-bit path (`takes_x8`), ignored elsewhere."""
        if self.quant is not None:
            return self.quant.matmul_t(x, norm=norm, glu=glu, residual=residual, x8=x8)
        if norm is not None:
            x = rms_norm(x, *norm)
        if glu:
            x = x[:, :x.shape[1] // 2].silu() * x[:, x.shape[1] // 2:]
        y = x @ self.value().cast(dtypes.float32).T
        return y if residual is None else residual + y

    @property
    def takes_x8(self) -> bool:
        """Whether `matmul_t` uses an x quantized already (QuantWeight.takes_x8)."""
        return self.quant is not None and self.quant.takes_x8

    @property
    def glu_once(self) -> bool:
        """Whether `matmul_t(x, glu=True)` costs no more silu than a glu before it (QuantWeight.glu_once)."""
        return self.quant is not None and self.quant.glu_once

    @property
    def nbytes(self) -> int:
        if self.quant is not None:
            return self.quant.nbytes
        return self.tensor.nbytes() + (self.scale.nbytes() if self.scale is not None else 0)


def concat_rows(parts: list[Weight]) -> Weight | None:
    """One weight holding the rows of `parts` in order (q/k/v fused into one matmul), or None when their storage
    differs (blocks of different GGUF types)."""
    first = parts[0]
    if first.quant is not None:
        if any(p.quant is None for p in parts) or (fused := concat([p.quant for p in parts])) is None:
            return None
        return Weight(None, fused.shape, quant=fused)
    if any((p.quant, p.scale is None, p.tensor.dtype) != (None, first.scale is None, first.tensor.dtype)
           or len(p.shape) != len(first.shape) or p.shape[1:] != first.shape[1:] for p in parts):
        return None
    shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
    tensor = Tensor.cat(*[p.tensor for p in parts], dim=0).contiguous().realize()
    scale = None if first.scale is None else Tensor.cat(*[p.scale for p in parts], dim=0).contiguous().realize()
    return Weight(tensor, shape, scale)


def to_q8(dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per block of 32 (the Q8_0 scheme, f32 scales): exact for Q8_0 sources, within 1/254 of a
    block's largest magnitude otherwise."""
    rows, cols = dense.shape
    blocks = dense.reshape(rows, cols // Q8_BLOCK, Q8_BLOCK)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / 127.0
    scale[scale == 0] = 1.0
    return np.rint(blocks / scale).astype(np.int8).reshape(rows, cols), scale.astype(np.float32)


_FLOAT_TYPES = {GGMLQuantizationType.F32: dtypes.float32, GGMLQuantizationType.F16: dtypes.float16,
                GGMLQuantizationType.BF16: dtypes.bfloat16}


def load_weight(g: GGUFFile, info: TensorInfo, mode: WeightMode, *, rope_heads: int = 0) -> Weight:
    """Read one tensor and materialise it: resident GGUF blocks ('gguf'), dequantized to f32/f16, or q8 blocks.

    'gguf' keeps a 2-D weight's bytes as the file has them (regrouped, see engine/quant.py) when a block decoder
    exists for its type, float types as they are; other types (IQ*, Q2_K, Q3_K) fall back to q8."""
    if mode == "gguf" and len(info.shape) == 2:
        if info.ggml_type in DOTS:
            return _load_blocks(g, info, rope_heads)
        if info.ggml_type in _FLOAT_TYPES:  # kept as they are: the file's bytes copied in, no kernel
            t = device_empty(info.shape, _FLOAT_TYPES[info.ggml_type])
            rows = read_rows(g, info, into=scratch((info.shape[0], info.nbytes // info.shape[0])))
            write_bytes(t, unpermute_rope_rows(rows, rope_heads) if rope_heads else rows)
            _copied(t, rows.nbytes)
            return Weight(t, info.shape)
        mode = "q8"
    if mode == "q8" and len(info.shape) == 2 and info.shape[1] % Q8_BLOCK == 0:
        whole = unpermute_rope_rows(read_rows(g, info), rope_heads) if rope_heads else None
        return _load_q8(g, info, whole)
    if len(info.shape) == 1 and info.ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        # norms and biases, f32 on the device: read (and widened) on the host and copied in, no kernel to schedule
        t = device_empty(info.shape, dtypes.float32)
        view = host_view(t)
        if info.ggml_type == GGMLQuantizationType.F32 and view is not None and not rope_heads:
            read_rows(g, info, into=view.view(np.uint8).reshape(1, -1))  # straight into the device's memory
            return Weight(t, info.shape)
        rows = read_rows(g, info, into=scratch((1, info.nbytes)))
        rows = unpermute_rope_rows(rows.reshape(info.shape[0], -1), rope_heads) if rope_heads else rows
        write_into(t, rows.view(_to_np_dtype(_FLOAT_TYPES[info.ggml_type])).astype(np.float32).reshape(info.shape))
        return Weight(t, info.shape)
    rows = read_rows(g, info)
    if rope_heads:
        rows = unpermute_rope_rows(rows, rope_heads)
    raw = Tensor(rows)
    n = int(np.prod(info.shape))
    dense = ggml_data_to_tensor(raw.flatten(), n, info.ggml_type).reshape(info.shape)
    # norms and biases stay f32: they are tiny and feed every activation
    dtype = dtypes.float16 if mode == "f16" and len(info.shape) > 1 else dtypes.float32
    return Weight(dense.cast(dtype).contiguous().realize(), info.shape)


BLOCK_CHUNK_ROWS = 4096  # rows regrouped at a time: bounds the host copy of a large weight (the 8B head: 128k rows)


def _load_blocks(g: GGUFFile, info: TensorInfo, rope_heads: int, whole: np.ndarray | None = None) -> Weight:
    """Resident GGUF blocks (from `whole`, raw rows already read, when given), regrouped chunk by chunk: on the CPU
    straight into the device buffers' memory, elsewhere through a host array and a raw copy."""
    n_rows, cols = info.shape if whole is None else (whole.shape[0], info.shape[1])
    il = interleave_for(n_rows)
    if whole is None and rope_heads:
        whole = unpermute_rope_rows(read_rows(g, info), rope_heads)
    if tc_wanted(Device.DEFAULT, info.ggml_type, n_rows, cols):
        return _load_tc(g, info, n_rows, cols, whole)
    rest_shape, halfs_shape = resident_shapes(info.ggml_type, n_rows, cols, il)
    rest, halfs = device_empty(rest_shape, dtypes.uint8), device_empty(halfs_shape, dtypes.float16)
    views = host_view(rest), host_view(halfs)
    row_bytes = info.nbytes // info.shape[0]
    step = max(il, BLOCK_CHUNK_ROWS - BLOCK_CHUNK_ROWS % il)
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        part = whole[r0:r1] if whole is not None else read_rows(g, info, r0, r1, into=scratch((r1 - r0, row_bytes)))
        if views[0] is not None and views[1] is not None:
            repack(part, info.ggml_type, il, out=(views[0][r0 // il:r1 // il], views[1][r0 // il:r1 // il]))
            continue
        p_rest, p_halfs = repack(part, info.ggml_type, il)
        write_into(rest, p_rest, r0 // il * p_rest[0].nbytes)
        write_into(halfs, p_halfs, r0 // il * p_halfs[0].nbytes)
        _copied(rest, p_rest.nbytes + p_halfs.nbytes)
    return Weight(None, (n_rows, cols), quant=QuantWeight(rest, halfs, (n_rows, cols), info.ggml_type))


def _load_tc(g: GGUFFile, info: TensorInfo, n_rows: int, cols: int, whole: np.ndarray | None) -> Weight:
    """Resident blocks in the tensor-core kernel's layout (engine/matvec_gpu_tc.py: MESH_GPU_MV=tc on CUDA), the same
    bytes as the file, regrouped chunk by chunk through a host array and a raw copy."""
    shapes = tc_shapes(info.ggml_type, n_rows, cols)
    words, scales = device_empty(shapes[0], dtypes.uint32), device_empty(shapes[1], dtypes.float16)
    row_bytes = info.nbytes // info.shape[0]
    for r0 in range(0, n_rows, BLOCK_CHUNK_ROWS):  # a multiple of 16 rows a chunk
        r1 = min(n_rows, r0 + BLOCK_CHUNK_ROWS)
        part = whole[r0:r1] if whole is not None else read_rows(g, info, r0, r1, into=scratch((r1 - r0, row_bytes)))
        p_words, p_scales = tc_repack(part, info.ggml_type)
        write_into(words, p_words, r0 // 16 * p_words[0].nbytes)
        write_into(scales, p_scales, r0 // 16 * p_scales[0].nbytes)
        _copied(words, p_words.nbytes + p_scales.nbytes)
    return Weight(None, (n_rows, cols), quant=QuantWeight(words, scales, (n_rows, cols), info.ggml_type, "tc"))


def load_fused(g: GGUFFile, parts: list[tuple[TensorInfo, int]], mode: WeightMode) -> Weight | None:
    """One resident weight holding the rows of several tensors (q, k, v; gate, up), their raw rows joined on the
    host before they are regrouped, so no device kernel concatenates them during the load. None when they cannot
    share one layout (not 'gguf', or different block types): the caller loads them apart."""
    first = parts[0][0]
    if mode != "gguf" or any(len(i.shape) != 2 or i.ggml_type != first.ggml_type or i.shape[1] != first.shape[1]
                             for i, _ in parts) or first.ggml_type not in DOTS:
        return None
    # each part read straight into its rows of one array (un-permuted on the way for q/k): one copy fewer
    raw = scratch((sum(i.shape[0] for i, _ in parts), first.nbytes // first.shape[0]))
    r = 0
    for info, h in parts:
        dst = raw[r:r + info.shape[0]]
        if h:
            dst.reshape(h, 2, info.shape[0] // h // 2, -1)[...] = _unpermuted_view(read_rows(g, info), h)
        else:
            read_rows(g, info, into=dst)
        r += info.shape[0]
    return _load_blocks(g, first, 0, whole=raw)


Q8_CHUNK_ROWS = 1024  # rows converted at a time: bounds the f32 intermediates (the tied head is 49152 rows)


def device_empty(shape: tuple[int, ...], dtype) -> Tensor:
    """A realized device tensor with uninitialized contents, to be filled with `write_into`: a buffer allocated
    directly, with no graph to schedule (`Tensor.empty(...).realize()` cost ~2 ms of scheduling each, ~0.2 s of a
    SmolLM2 stage's load)."""
    buf = UOp.new_buffer(Device.DEFAULT, math.prod(shape), dtype)
    buf.buffer.ensure_allocated()
    return Tensor(_shaped(buf, shape))


def _shaped(buf: UOp, shape: tuple[int, ...]) -> UOp:
    """buf.reshape(shape) without the symbolic simplification of the new shape (constant ints need none: the same
    UOp either way, checked in tests), which was ~70 us of a ~150 us tensor, ~100-200 of them a stage."""
    shape = tuple(int(d) for d in shape)
    return buf if shape == buf.shape else UOp(Ops.RESHAPE, src=(buf, _shape_arg(shape)))


@functools.lru_cache(maxsize=256)
def _shape_arg(shape: tuple[int, ...]) -> UOp:  # UOps are hash-consed: the same shape is the same UOp
    return shape_to_shape_arg(shape)


def host_view(t: Tensor) -> np.ndarray | None:
    """A realized CPU tensor's memory as a writable numpy array of its shape, for filling it without a copy through
    another host buffer; None on devices whose memory the host cannot address (or not yet allocated)."""
    buf = t.uop.buffer
    if buf.device.split(":")[0] != "CPU" or not buf.is_allocated():
        return None
    alloc = Device[buf.device].allocator
    if not hasattr(alloc, "_as_buffer"):
        return None
    Device[buf.device].synchronize()  # as the allocator's own copies do: nothing queued may still use the memory
    return np.frombuffer(alloc._as_buffer(buf._buf), _to_np_dtype(t.dtype), math.prod(t.shape)).reshape(t.shape)


# allocators whose BufferSpec(zero=True) memory reads as zeros: CPU maps fresh anonymous pages (kept out of the
# allocator's reuse cache), NV asks the driver for zeroed memory. Elsewhere device_zeros writes the zeros.
_ZEROED_ALLOC = ("CPU", "NV")


def device_zeros(shape: tuple[int, ...], dtype) -> Tensor:
    """A realized zero-filled device tensor (a KV cache). On the CPU its pages stay untouched, so they cost no memory
    until a step writes them: a 4-slot, 2048-position SmolLM2 stage holds 377 MB of KV cache, most of it never used."""
    dev = Device.DEFAULT
    if dev.split(":")[0] not in _ZEROED_ALLOC:
        t = device_empty(shape, dtype)
        zero_rows(t, 0, shape[0])
        return t
    buf = Buffer(dev, math.prod(shape), dtype, options=BufferSpec(zero=True)).ensure_allocated()
    return Tensor(_shaped(UOp.from_buffer(buf), shape))


def write_into(t: Tensor, a: np.ndarray, offset: int = 0) -> None:
    """Copy a host array into a realized device tensor at a byte offset: a raw copy, with no graph to schedule and
    no second full-size host copy (`Tensor(a).realize()` stages the whole array through another buffer)."""
    buf = t.uop.buffer
    alloc = Device[buf.device].allocator
    a = np.ascontiguousarray(a, _to_np_dtype(t.dtype))
    if not a.flags.writeable:       # the allocators' copy-in takes writable memory only (a frame's bytes are not)
        a = a.copy()
    mv = memoryview(a).cast("B")
    if offset + len(mv) > buf.nbytes:
        raise ValueError(f"write of {len(mv)} bytes at {offset} overruns a {buf.nbytes}-byte buffer")
    dest = buf._buf if offset == 0 and len(mv) == buf.nbytes else alloc._offset(buf._buf, len(mv), offset)
    alloc._copyin(dest, mv)


def write_bytes(t: Tensor, a: np.ndarray) -> None:
    """Copy a host array's raw bytes (as many as the tensor holds) into a realized device tensor of any dtype
    (bfloat16 has no numpy type to convert to)."""
    buf = t.uop.buffer
    mv = memoryview(np.ascontiguousarray(a)).cast("B")
    if len(mv) != buf.nbytes:
        raise ValueError(f"{len(mv)} bytes for a {buf.nbytes}-byte buffer")
    Device[buf.device].allocator._copyin(buf._buf, mv)


_ZEROS = np.zeros(1 << 20, np.uint8)  # a MiB of zeros, the source of every zero_rows copy


def zero_rows(t: Tensor, r0: int, r1: int) -> None:
    """Zero rows [r0, r1) of a realized contiguous device tensor (a KV cache's slots) with raw copies, no kernel."""
    row = t.nbytes() // t.shape[0]
    buf = t.uop.buffer
    alloc = Device[buf.device].allocator
    for off in range(r0 * row, r1 * row, len(_ZEROS)):
        n = min(len(_ZEROS), r1 * row - off)
        alloc._copyin(alloc._offset(buf._buf, n, off), memoryview(_ZEROS)[:n])


def _load_q8(g: GGUFFile, info: TensorInfo, whole: np.ndarray | None) -> Weight:
    """Convert a tensor to q8 a chunk of rows at a time, reading each chunk from the file and writing its result
    straight into the device buffers: the load's peak is the weight plus one chunk, not twice the weight (the
    tied 49152-row head would otherwise add ~30 MB to the last stage's peak)."""
    n_rows, cols = info.shape
    q = device_empty((n_rows, cols), dtypes.int8)
    scale = device_empty((n_rows, cols // Q8_BLOCK, 1), dtypes.float32)
    for r0 in range(0, n_rows, Q8_CHUNK_ROWS):
        part = whole[r0:r0 + Q8_CHUNK_ROWS] if whole is not None else read_rows(g, info, r0, r0 + Q8_CHUNK_ROWS)
        dense = ggml_data_to_tensor(Tensor(part).flatten(), part.shape[0] * cols, info.ggml_type)
        q_part, s_part = to_q8(dense.cast(dtypes.float32).numpy().reshape(len(part), cols))
        write_into(q, q_part, r0 * cols)
        write_into(scale, s_part, r0 * (cols // Q8_BLOCK) * 4)
    free_device_cache()
    return Weight(q, info.shape, scale=scale)


def free_device_cache() -> None:
    """Return the device buffers tinygrad's allocator keeps cached for reuse: a load's dequantization scratch would
    otherwise stay resident (~11 MB on a SmolLM2 stage) and add to every later tensor's peak."""
    allocator = Device[Device.DEFAULT].allocator
    if hasattr(allocator, "free_cache"):
        allocator.free_cache()


class EmbeddingTable:
    """Token embedding rows kept as raw GGUF bytes and dequantized on the host per looked-up token.

    Host lookup keeps the first stage's input kernels independent of the prompt length (no one-hot gather over
    the vocabulary) and holds the table at its quantized size. With `shared` (the tied head's resident blocks of
    the same tensor) the rows are read back from those blocks instead of held a second time.
    """

    def __init__(self, g: GGUFFile, info: TensorInfo, shared: QuantWeight | None = None, scale: float = 1.0) -> None:
        self.shared = shared
        # on a CPU device the tied head's blocks lie in host memory: a token's row is gathered from them in place
        # (the lookup runs cold on every first stage's step: 0.5 ms for one SmolLM2 token through group copies)
        self._views = None if shared is None else shared.host_views()
        self.scale = scale  # Gemma multiplies the embeddings by sqrt(dim) (in float32, as llama.cpp)
        self.rows = None if shared is not None else read_rows(g, info)
        self.ggml_type = GGMLQuantizationType(info.ggml_type)
        self.vocab_size, self.dim = info.shape
        try:
            self.lookup(np.zeros(1, dtype=np.int64))
        except NotImplementedError:
            raise UnsupportedModel(f"{g.path}: token_embd type {info.type_name} cannot be dequantized on the host") from None

    def lookup(self, ids: np.ndarray) -> np.ndarray:  # (N,) -> (N, dim) float32
        if self.ggml_type == GGMLQuantizationType.Q8_0 and (self._views is not None or self.shared is None):
            # q * d per block of 32, as gguf's dequantizer computes it (one f32 product), in 3 numpy calls: this runs
            # cold on every step of a first stage, where gguf's general code cost ~0.1 ms
            if self._views is not None:
                rest, halfs = self._views
                g, lane = np.divmod(ids, self.shared.il)
                q, d = rest[g, :, :, lane].view(np.int8), halfs[g, :, 0, lane]
            else:
                blocks = self.rows[ids].reshape(len(ids), -1, 34)
                q, d = blocks[..., 2:].view(np.int8), np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
            rows = (q.astype(np.float32) * d.astype(np.float32)[..., None]).reshape(len(ids), self.dim)
            return rows if self.scale == 1.0 else rows * np.float32(self.scale)
        raw = self.rows[ids] if self.shared is None else self.shared.read_rows(ids, self._views)
        rows = np_dequantize(raw, self.ggml_type).reshape(len(ids), self.dim).astype(np.float32)
        return rows if self.scale == 1.0 else rows * np.float32(self.scale)

    @property
    def nbytes(self) -> int:
        return 0 if self.rows is None else self.rows.nbytes
