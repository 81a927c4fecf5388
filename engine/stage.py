"""A pipeline stage: layers [start, end) of a GGUF model, its KV slots, and the step that runs columns through it."""
from __future__ import annotations

import ctypes
import math
import os
import time
from collections.abc import Sequence
from functools import lru_cache, partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tinygrad import Device, Tensor, TinyJit, UOp, dtypes
from tinygrad.dtype import _to_np_dtype
from tinygrad.engine.jit import _prepare_jit_inputs

from . import cuda_graph
from .errors import EngineError, RangeError
from .gguf_meta import ModelMeta, meta_from_gguf, read_gguf
from .loader import (WEIGHT_MODES, EmbeddingTable, WeightMode, block_tensor_names, check_range, concat_rows,
                     device_empty, free_device_cache, load_fused, load_weight, reading, tensor_info, write_into)
from .kv_blocks import BLOCK_SIZE, BlockPool, blocks_for, kv_type_for
from .paged_attention import CH, gpu_split_ok
from .matvec_gpu_tc import tc_loading, tc_stage
from .model import Block, Group, Head, KVPages, make_block, rope_inputs
from .program_cache import cache_path, code_identity, load_programs, read_blob, save_programs, write_blob
from .program_cache import enabled as program_cache_enabled
from .replay import CpuReplay, NotReplayable
from .shared_layers import NotShareable, capture_shared
from common.values import Column, samplings_for

from .sampling import Sampling, pick_token

__all__ = ["Column", "Sampling", "Stage", "WarmupResult", "prefill_chunks"]


def _release_freed_memory() -> None:
    """Hand the load's freed intermediates back to the OS. tinygrad's allocator keeps freed device buffers in an
    LRU cache for reuse (the load's scratch and the q/k/v parts fused into one weight: ~10 MB on a SmolLM2 stage),
    and glibc keeps freed heap pages after the first large free raises its mmap threshold."""
    free_device_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _Raw(NamedTuple):
    """A replayed CPU shape's host addresses (engine/replay.py): its inputs are written and its output read with
    plain memory copies. The buffers are host memory at fixed addresses (the replay's command table holds them
    too) and the replay runs to its end on the calling thread, so no tinygrad call is needed on the way; one
    device synchronize per step still waits for anything tinygrad itself queued before (a load's or an op's copy).
    What this saves is Python: the generic copy-in/out path's buffer lookups and four synchronizes a step were
    ~0.4 ms of a decode step's ~0.6 ms outside the kernels on 2 busy cores, paid once per stage (issue 10)."""
    dev: object
    x: int          # address of the step's input rows (float32, `size` x dim)
    cos: int        # rope inputs' addresses (written unless the layers rope from resident tables)
    sin: int
    out: int        # the replay's output buffer
    out_shape: tuple
    out_dtype: np.dtype
    replay: CpuReplay


def _raw_for(replay: CpuReplay, inputs) -> _Raw:
    addr = lambda t: int(t.uop.buffer.ensure_allocated()._buf.va_addr)  # noqa: E731
    ret = replay.ret
    return _Raw(Device[inputs[0].device], *(addr(t) for t in inputs), addr(ret), tuple(ret.shape),
                np.dtype(_to_np_dtype(ret.dtype)), replay)


def _buffer_view(addr: int, dtype: np.dtype, shape: tuple) -> np.ndarray:
    """A numpy view of host memory at `addr` (a replayed step's output buffer): no copy."""
    n = dtype.itemsize * math.prod(shape)
    return np.frombuffer((ctypes.c_char * n).from_address(addr), dtype).reshape(shape)


def _pick_rows(logits: np.ndarray, samplings: list, cols: Sequence[Column], picks: Sequence[int]) -> np.ndarray:
    """The token of each logits row (row j: column picks[j]), as `pick_token` picks it. All greedy: one argmax over
    the rows (numpy's first largest value of each row, as pick_token's argmax of the row) instead of a Python call
    per column."""
    if len(samplings) != len(picks):
        samplings = samplings * len(picks)  # one for all
    if all(s.temperature == 0.0 for s in samplings):
        return logits.argmax(axis=1).astype(np.int32)
    return np.array([pick_token(logits[j], samplings[j], cols[i].pos) for j, i in enumerate(picks)], dtype=np.int32)


def _copy_out(t: Tensor) -> np.ndarray:
    """A realized device tensor's contents as a new host array, without `.numpy()`'s realize and copy schedule."""
    buf = t.uop.buffer
    out = np.empty(t.shape, _to_np_dtype(t.dtype))
    Device[buf.device].allocator._copyout(memoryview(out).cast("B"), buf._buf)
    return out


# A prompt's run of columns goes through the layers in chunks of these sizes (a chunk's columns padded up to its
# size), so a new prompt length never makes a new compiled shape; `warmup` compiles them all at load, each size one
# compile per stage (~10-15 s for SmolLM2's 30 layers on the CPU). One size: on the CPU a prefill step costs its rows
# (each column is its own matvec pass; SmolLM2 ~40 ms a row at 16 and at 64 rows), so a 64-token prompt took 2.7 s as
# four chunks of 16 and 2.5-2.8 s as one of 64, while the 64 shape added 13 s to the warmup. 16 bounds a prompt
# tail's padding to 15 rows. Add a larger size when a step of more rows gets cheaper per row (a GEMM path, a GPU).
PREFILL_BUCKETS = (16,)
# Positions whose rope rows a decode step's raw path computes at once (`Stage._rope_row`), then looks up.
ROPE_BLOCK = 64
# What a chunk costs beyond its rows, in rows, when choosing a prompt's chunks: a small preference for fewer steps.
CHUNK_COST = 4


def prefill_chunks(n: int, slack: int, buckets: tuple[int, ...] | None = None) -> tuple[tuple[int, int], ...]:
    """How a run of `n` columns is cut into chunks: (columns, padded size) in order, the padded one (if any) last.

    `slack` is how many positions the context has after the run's end: a chunk's pad rows write cache positions
    past its columns, so only the last chunk may pad, by at most `slack`. Size 1 is the decode step's shape, always
    there, so every run has a plan. Minimizes padded rows + CHUNK_COST per chunk; ties go to fewer chunks, then to
    larger chunks first. A function of (n, slack) alone: every stage of a chain cuts a step the same way, so a
    layer sees the same kernels whatever range holds it.
    """
    buckets = PREFILL_BUCKETS if buckets is None else tuple(buckets)
    return _chunks(n, min(slack, max(buckets)), buckets)


@lru_cache(maxsize=1024)
def _chunks(n: int, slack: int, buckets: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    sizes = sorted({1, *buckets}, reverse=True)
    inf = (float("inf"), 0)
    best: list[tuple[float, int]] = [(0, 0)]  # per remaining count r: (cost, chunks)
    choice: list[tuple[int, int]] = [(0, 0)]  # per r: (columns, size) of the first chunk
    for r in range(1, n + 1):
        top, pick = inf, (0, 0)
        for b in sizes:  # the whole rest in one chunk, padded from r up to b
            if r <= b <= r + slack and (cand := (b + CHUNK_COST, 1)) < top:
                top, pick = cand, (r, b)
        for b in sizes:  # a full chunk of b, then the best plan for the rest
            if b < r:
                c, k = best[r - b]
                if (cand := (b + CHUNK_COST + c, k + 1)) < top:
                    top, pick = cand, (b, b)
        best.append(top)
        choice.append(pick)
    out, r = [], n
    while r:
        out.append(choice[r])
        r -= choice[r][0]
    return tuple(out)


def _rope_tables_on_device(meta: ModelMeta, max_context: int) -> tuple[Tensor | None, Tensor | None]:
    """GPUs: the cos/sin of every position, resident, for the kernel that ropes and writes k/v (model.Block
    rope_fused); (None, None) on the CPU (its step keeps the per-step tables: outputs stay as they are), for two
    rope bases (Gemma 3), or with MESH_GPU_ROPE_WRITE=0. The same float64 computation as the per-step tables."""
    if str(Device.DEFAULT).startswith("CPU") or meta.rope_theta_local or os.environ.get("MESH_GPU_ROPE_WRITE") == "0":
        return None, None
    out = []
    for a in rope_inputs(meta, np.arange(max_context)):
        t = device_empty(a.shape, dtypes.float32)
        write_into(t, a)
        out.append(t)
    return out[0], out[1]


class WarmupResult(NamedTuple):
    ms: float  # wall time of the warmup
    shapes: int  # compiled shapes it added


_KV_DTYPES = {"f16": dtypes.float16, "f32": dtypes.float32}


def default_kv_dtype(device: str | None = None) -> str:
    """The KV pools' type where Stage.load is not told one: `kv_blocks.kv_type_for` of `device` (default: tinygrad's
    default device)."""
    return kv_type_for(str(device or Device.DEFAULT))


def _tree_max(x: Tensor, pad: float, fan: int = 16) -> Tensor:
    """max over the last axis of (M, L) as a tree of kernels, each reducing `fan` values a thread: every level but
    the last has > 2048 outputs or few inputs each, so no kernel walks a long row on a few threads."""
    M = x.shape[0]
    while x.shape[1] > 2 * fan:
        L = -(-x.shape[1] // fan) * fan
        x = x.pad(((0, 0), (0, L - x.shape[1])), value=pad).reshape(M, L // fan, fan).max(axis=2).contiguous()
    return x.max(axis=1)


def greedy_ids(logits: Tensor) -> Tensor:
    """(M, vocab) logits -> (M,) int32 ids of the first largest logit of each row: np.argmax's answer. On a GPU in
    reductions spread over its SMs: Tensor.argmax's two reductions (the max, then the first index holding it) each
    ran as one kernel that tinygrad split into only 256 partials, 2 thread blocks of 32 threads each reading ~2000
    logits in a row: 63-64 us each on the H200, 10% of a 1.1B decode step, 4% of an 8B one (bench/RESULTS.md,
    seventh session). Max is exact in any order, so the ids are argmax's. The CPU keeps Tensor.argmax (its two
    kernels are threaded by the runner; more small kernels would only add calls)."""
    if str(logits.device).startswith("CPU"):  # as the rest of the engine tells the CPU apart
        return logits.argmax(axis=1).cast(dtypes.int32)
    M, V = logits.shape
    top = _tree_max(logits, float("-inf")).reshape(M, 1)
    countdown = Tensor.arange(V, 0, -1).to(logits.device).reshape(1, V)  # the first index holds the largest count
    return (V - _tree_max(logits.eq(top).where(countdown, 0), 0)).cast(dtypes.int32)


class Stage:
    act_dtype = np.dtype(np.float32)
    tensor_cores = False  # its Q4_0/Q8_0 matmuls on tensor cores (engine/matvec_gpu_tc.py), decided at load

    def __init__(self, meta: ModelMeta, start: int, end: int, blocks: list[Block], embed: EmbeddingTable | None,
                 head: Head | None, *, n_slots: int, max_context: int, weight_bytes: int, pages: KVPages,
                 use_jit: bool = True) -> None:
        self.meta, self.start, self.end = meta, start, end
        self.first, self.last = embed is not None, head is not None
        self.dim = meta.dim
        self.n_slots, self.max_context = n_slots, max_context
        self.weight_bytes = weight_bytes
        self.kv_bytes = sum(b.kv_nbytes for b in blocks)
        # the paged KV cache (engine/kv_blocks.py): which slot owns which block, and the table the kernels read
        self.kv_block_size, self.kv_blocks = pages.block_size, pages.n_blocks
        self._pool = BlockPool(pages.n_blocks, pages.block_size)
        self._table = pages.table
        self._table_np = np.full(pages.table.shape, pages.n_blocks, np.int32)  # unowned entries: the trash block
        self._blocks, self._embed, self._head = blocks, embed, head
        self._rope_layers = bool(blocks) and all(getattr(b, "rope_fused", False) for b in blocks)
        self._lengths = [0] * n_slots  # positions each slot holds
        self._dirty: set[int] = set()  # slots a step has written since they were last cleared
        self._vslot = [UOp.variable(f"slot{i}", 0, n_slots - 1) for i in range(n_slots)]
        self._vpos = [UOp.variable(f"pos{i}", 0, max_context - 1) for i in range(n_slots)]
        # the step's longest run end: attention's loop bound. Declared from 0: CUDA graphs size launches with every
        # variable at 0, and a GPU kernel's launch axis of ctx.maximum(1) would be simplified to ctx from 1
        self._vctx = UOp.variable("ctx", 0, max_context)
        self._use_jit = use_jit
        cuda_graph.install(str(Device.DEFAULT))  # CUDA: graphs that re-send only the nodes a step changed
        # The GPU's split attention reads ctx only as its chunk count (paged_attention `_chunks`), so ctx rounded up to
        # a whole chunk runs the very same launches and loops, and a graph's attention nodes change once every CH
        # steps instead of every step (engine/cuda_graph.py re-sends only changed nodes). 1 elsewhere: the CPU's and
        # the three-kernel path's loops follow ctx itself
        self._ctx_round = CH if not str(Device.DEFAULT).startswith("CPU") and pages.block_size and \
            gpu_split_ok(meta.head_dim, pages.block_size) else 1
        # greedy columns get their token picked on the device (one int back instead of the vocab's logits); not on
        # the CPU, where the logits are already in host memory. MESH_DEVICE_ARGMAX=0 turns it off (A/B runs)
        self.greedy_on_device = not str(Device.DEFAULT).startswith("CPU") and \
            os.environ.get("MESH_DEVICE_ARGMAX", "1") != "0"
        self._jits: dict[tuple, TinyJit] = {}
        self._inputs: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}  # per jit shape: x, cos, sin, written in place
        self._replays: dict[tuple, CpuReplay | None] = {}  # per captured shape: its flat CPU replay, or None
        self._direct: dict[tuple, list] = {}  # per captured shape without a replay: its jit's input buffers
        # per replayed CPU shape: its buffers' addresses (`_Raw`); MESH_RAW_STEP=0 keeps the generic copies (A/B)
        self._raw: dict[tuple, _Raw] = {}
        self._raw_on = os.environ.get("MESH_RAW_STEP", "1") != "0"
        self._rope_rows: dict[int, tuple[bytes, bytes]] = {}   # one position's cos/sin rows (decode), float32 bytes
        self._var_names = None      # the bound variables' names (`_key`)
        self._plans: dict[bool, tuple] = {}     # one column's step: its shape and variable names (`_step_one`)
        self._lean_on = os.environ.get("MESH_STEP_LEAN", "1") != "0"
        self._synced = False    # nothing queued on the device since the last synchronize (the raw path's own steps
                                # queue nothing: host copies and a replay that returns when its kernels are done)
        self._head_calls: dict[tuple, int] = {}  # per shape assembled from templates: the head's number of kernels
        # capture one layer per shape and reuse its kernels (engine/shared_layers.py); MESH_SHARED_LAYERS=0: whole
        self.share_layers = os.environ.get("MESH_SHARED_LAYERS", "1") != "0"
        self._program_file: Path | None = None  # engine/program_cache.py: set by load when the cache is on
        self._programs_on_disk: set[tuple] = set()
        self._programs_loaded = False

    @classmethod
    def load(cls, path: str | Path, start: int, end: int, *, n_slots: int = 4, max_context: int = 2048,
             weights: WeightMode = "gguf", kv_dtype: str | None = None, jit: bool = True,
             kv_blocks: int | None = None) -> "Stage":
        """Load layers [start, end) of the GGUF at `path`; the first stage also holds the embeddings, the last
        the final norm and output head (the embeddings again when the output is tied). `kv_blocks`: the KV pool's
        blocks of BLOCK_SIZE positions per layer (default: enough for every slot at max_context). `kv_dtype`: the
        KV pools' type, "f32" or "f16" (default: `default_kv_dtype()`)."""
        kv_dtype = kv_dtype or default_kv_dtype()
        g = read_gguf(path)
        meta = meta_from_gguf(g)
        check_range(meta, start, end)
        if n_slots < 1:
            raise RangeError(f"{path}: n_slots must be at least 1, got {n_slots}")
        if max_context < 1:
            raise RangeError(f"{path}: max_context must be at least 1, got {max_context}")
        max_context = min(max_context, meta.context_length)  # the model was not trained past its context
        if kv_dtype not in _KV_DTYPES or weights not in WEIGHT_MODES:
            raise EngineError(f"unknown weights={weights!r} or kv_dtype={kv_dtype!r}")
        per_seq = blocks_for(max_context, BLOCK_SIZE)
        kv_blocks = n_slots * per_seq if kv_blocks is None else kv_blocks
        if kv_blocks < 1:
            raise RangeError(f"{path}: kv_blocks must be at least 1, got {kv_blocks}")
        table = device_empty((n_slots, per_seq), dtypes.int32)
        write_into(table, np.full((n_slots, per_seq), kv_blocks, np.int32))
        pages = KVPages(kv_blocks, BLOCK_SIZE, table, *_rope_tables_on_device(meta, max_context))
        first, last = start == 0, end == meta.n_layers
        D, H, KvH, Hd = meta.dim, meta.n_heads, meta.n_kv_heads, meta.head_dim
        shapes = {
            "attn_norm.weight": (D,), "ffn_norm.weight": (D,),
            "attn_q.weight": (H * Hd, D), "attn_k.weight": (KvH * Hd, D), "attn_v.weight": (KvH * Hd, D),
            "attn_output.weight": (D, H * Hd),
            "ffn_gate.weight": (meta.ffn_dim, D), "ffn_up.weight": (meta.ffn_dim, D), "ffn_down.weight": (D, meta.ffn_dim),
            "attn_q.bias": (H * Hd,), "attn_k.bias": (KvH * Hd,), "attn_v.bias": (KvH * Hd,),
            "attn_q_norm.weight": (Hd,), "attn_k_norm.weight": (Hd,),
            "post_attention_norm.weight": (D,), "post_ffw_norm.weight": (D,),
        }
        # llama GGUFs store q/k rows permuted for adjacent-pair rope; undo it so one half-split rope serves all
        rope_heads = {} if meta.rope_neox else {"attn_q.weight": H, "attn_k.weight": KvH, "attn_q.bias": H, "attn_k.bias": KvH}
        # the kernel is a property of the stage: with several slots on a GPU with bf16 tensor cores, the tensor-core
        # matvec for every weight it takes, at every batch size (engine/matvec_gpu_tc.py `tc_stage`)
        tensor_cores = tc_stage(Device.DEFAULT, n_slots)
        with reading(g), tc_loading(tensor_cores):  # one open file and one reused host buffer for the whole range
            weight_bytes = 0
            blocks = []
            # one matmul for q, k and v, and one for gate and up: fewer kernels per layer
            groups = [("attn_qkv.weight", ["attn_q.weight", "attn_k.weight", "attn_v.weight"]),
                      ("attn_qkv.bias", ["attn_q.bias", "attn_k.bias", "attn_v.bias"]),
                      ("ffn_gate_up.weight", ["ffn_gate.weight", "ffn_up.weight"])]
            for layer in range(start, end):
                names = block_tensor_names(meta, layer)
                ws = {}
                for fused_name, members in groups:
                    if not all(m in names for m in members):
                        continue
                    parts = [(tensor_info(g, names[m], shapes[m]), rope_heads.get(m, 0)) for m in members]
                    # apart, then joined on the device if they can be
                    if (fused := load_fused(g, parts, weights)) is None:
                        loaded = [load_weight(g, info, weights, rope_heads=h) for info, h in parts]
                        fused = concat_rows(loaded)
                        if fused is None:
                            ws.update(zip(members, loaded))
                            weight_bytes += sum(w.nbytes for w in loaded)
                            continue
                    ws[fused_name] = fused
                    weight_bytes += fused.nbytes
                for short, full in names.items():
                    if short not in ws and not any(short in members and fused_name in ws
                                                   for fused_name, members in groups):
                        info = tensor_info(g, full, shapes[short])
                        ws[short] = load_weight(g, info, weights, rope_heads=rope_heads.get(short, 0))
                        weight_bytes += ws[short].nbytes
                blocks.append(make_block(meta, layer, ws, n_slots=n_slots, max_context=max_context,
                                         kv_dtype=_KV_DTYPES[kv_dtype], pages=pages))
            embed = head = out = None
            if last:
                out_name = "token_embd.weight" if meta.tied_output else "output.weight"
                norm = load_weight(g, tensor_info(g, "output_norm.weight", (D,)), weights)
                out = load_weight(g, tensor_info(g, out_name, (meta.vocab_size, D)), weights)
                weight_bytes += norm.nbytes + out.nbytes
                head = Head(norm, out, meta.norm_eps)
            if first:
                # a stage holding both ends of a tied model looks its embeddings up in the head's resident blocks: the
                # tensor is held once, as in the file
                shared = out.quant if out is not None and meta.tied_output else None
                embed = EmbeddingTable(g, tensor_info(g, "token_embd.weight", (meta.vocab_size, D)), shared=shared,
                                       scale=meta.embed_scale)
                weight_bytes += embed.nbytes
        _release_freed_memory()
        stage = cls(meta, start, end, blocks, embed, head, n_slots=n_slots, max_context=max_context,
                    weight_bytes=weight_bytes, pages=pages, use_jit=jit)
        stage.tensor_cores = tensor_cores
        if jit and program_cache_enabled():  # step templates and kernels of earlier processes, read when needed
            stage._program_file = cache_path(meta.fingerprint, start, end, n_slots, max_context, weights, kv_dtype,
                                             Device.DEFAULT, kv_blocks)
        return stage

    # ---- KV slots

    def _check_slot(self, slot: int) -> None:
        if not (isinstance(slot, (int, np.integer)) and 0 <= slot < self.n_slots):
            raise RangeError(f"slot {slot} is outside [0, {self.n_slots})")

    def _check_position(self, col: int, pos: int) -> None:
        if not 0 <= pos < self.max_context:
            raise RangeError(f"column {col}: position {pos} is outside [0, {self.max_context})")

    def _check_start(self, col: int, slot: int, pos: int) -> None:
        """A run of a slot starts at most at the slot's length (no gap in its cache)."""
        if pos > self._lengths[slot]:
            raise RangeError(f"column {col}: position {pos} skips ahead of slot {slot}, which holds "
                             f"[0, {self._lengths[slot]})")

    def _check_tokens(self, lo: int, hi: int) -> None:
        """The first stage's token ids, by their least and greatest."""
        if lo < 0 or hi >= self.meta.vocab_size:
            raise RangeError(f"token ids must lie in [0, {self.meta.vocab_size}), got {lo}..{hi}")

    def zero_slot(self, slot: int) -> None:
        """Forget everything slot `slot` holds and give its KV blocks back (a sliding-window ring is cleared too,
        if a step wrote it since it was last clear: untouched cache pages stay unmapped)."""
        self._check_slot(slot)
        if slot in self._dirty:
            for b in self._blocks:
                b.zero_slot(int(slot))
            self._dirty.discard(slot)
        self._lengths[slot] = 0
        if self._pool.free(int(slot)):
            self._set_table_row(int(slot))

    def reset(self) -> None:
        """Forget every slot."""
        for slot in sorted(self._dirty):
            for b in self._blocks:
                b.zero_slot(slot)
        self._dirty.clear()
        self._lengths = [0] * self.n_slots
        self._pool.reset()
        self._table_np[:] = self.kv_blocks
        write_into(self._table, self._table_np)

    # ---- the paged KV cache's block tables (engine/kv_blocks.py)

    def block_table(self, slot: int, blocks: Sequence[int]) -> None:
        """Make `blocks` slot `slot`'s block table (BlockTable from whoever allocates for the chain): its
        positions [i * kv_block_size, (i + 1) * kv_block_size) live in blocks[i]. A block outside the pool or held
        by another slot, a table longer than max_context needs, or one too short for what the slot holds is
        refused (nothing changes). Blocks the slot held and no longer lists are freed."""
        self._check_slot(slot)
        slot, blocks = int(slot), [int(b) for b in blocks]
        if len(blocks) > self._table_np.shape[1]:
            raise RangeError(f"block table of slot {slot}: {len(blocks)} blocks of {self.kv_block_size} positions "
                             f"exceed max_context {self.max_context}")
        if len(blocks) * self.kv_block_size < self._lengths[slot]:
            raise RangeError(f"block table of slot {slot}: {len(blocks)} blocks cannot hold the "
                             f"{self._lengths[slot]} positions it holds")
        self._pool.assign(slot, blocks)
        self._set_table_row(slot)

    def slot_blocks(self, slot: int) -> tuple[int, ...]:
        self._check_slot(slot)
        return self._pool.table(int(slot))

    @property
    def free_blocks(self) -> int:
        return self._pool.free_blocks

    def _set_table_row(self, slot: int) -> None:
        blocks = self._pool.table(slot)
        row = self._table_np[slot]
        row[:] = self.kv_blocks
        row[:len(blocks)] = blocks
        write_into(self._table, row, slot * row.nbytes)

    def rollback(self, slot: int, pos: int) -> None:
        """Forget positions >= pos of `slot` (rejected speculative tokens). Forgotten cache rows are never read
        again before a later step rewrites them: attention only reads positions below the step's own end."""
        self._check_slot(slot)
        if not 0 <= pos <= self._lengths[slot]:
            raise RangeError(f"rollback of slot {slot} to {pos}: the slot holds positions [0, {self._lengths[slot]})")
        # a sliding-window layer's ring still holds the positions a rollback of at most its slack uncovers
        rings = [b.ring - b.sliding_window for b in self._blocks if getattr(b, "wraps", False)]
        if rings and self._lengths[slot] - pos > min(rings):
            raise RangeError(f"rollback of slot {slot} by {self._lengths[slot] - pos} positions: the sliding-window "
                             f"layers keep only {min(rings)} positions beyond their window")
        self._lengths[slot] = pos

    def slot_length(self, slot: int) -> int:
        self._check_slot(slot)
        return self._lengths[slot]

    # ---- the step

    def _groups(self, cols: Sequence[Column]) -> list[tuple[int, int, int, int]]:
        """Split columns into (first column, count, slot, start position) runs and check them against the slots."""
        if not cols:
            raise EngineError("a step needs at least one column")
        runs: list[list[int]] = []
        for i, c in enumerate(cols):
            self._check_slot(c.slot)
            self._check_position(i, c.pos)
            if runs and runs[-1][2] == c.slot and runs[-1][3] + runs[-1][1] == c.pos:
                runs[-1][1] += 1
            else:
                runs.append([i, 1, c.slot, c.pos])
        seen: set[int] = set()
        for col, n, slot, pos in runs:
            if slot in seen:
                raise RangeError(f"slot {slot} appears in two separate runs of one step")
            seen.add(slot)
            self._check_start(col, slot, pos)
        return [tuple(r) for r in runs]  # type: ignore[misc]

    def step(self, cols: Sequence[Column], hidden: np.ndarray | None = None,
             sampling: Sampling | Sequence[Sampling] = Sampling()) -> np.ndarray:
        """Run the columns through this stage's layers.

        First stage: tokens come from the columns (`hidden` must be None). Other stages: `hidden` is the previous
        stage's (len(cols), dim) output. Returns (len(cols), dim) activations in act_dtype, or on the last stage
        int32 token ids, one per column with needs_logits (sampling may be one Sampling or one per such column).
        """
        picks = [i for i, c in enumerate(cols) if c.needs_logits]
        try:
            samplings = samplings_for(sampling, cols)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        greedy = self.last and self.greedy_on_device and all(s.temperature == 0.0 for s in samplings)
        # the last stage picks its tokens at once, so a replayed step's logits are read where the head wrote them
        out = self._forward(cols, hidden, greedy, view=self.last and not greedy)
        if not self.last:
            return out
        if greedy:  # the ids, picked on the device
            return out
        return _pick_rows(out, samplings, cols, picks)

    def step_logits(self, cols: Sequence[Column], hidden: np.ndarray | None = None) -> np.ndarray:
        """Like step on the last stage, but return the (M, vocab) float32 logits of the needs_logits columns."""
        if not self.last:
            raise EngineError(f"stage [{self.start}, {self.end}) is not the last stage and has no logits")
        return self._forward(cols, hidden)

    def _forward(self, cols: Sequence[Column], hidden: np.ndarray | None, greedy: bool = False,
                 view: bool = False) -> np.ndarray:
        """view: a replayed step's output may be a view of its output buffer, valid until this stage's next step."""
        runs = self._groups(cols)
        N = len(cols)
        if self.first:
            if hidden is not None:
                raise EngineError("the first stage takes tokens from the columns, not hidden activations")
            ids = np.array([c.token for c in cols], dtype=np.int64)
            self._check_tokens(ids.min(), ids.max())
            x_np = self._embed.lookup(ids)
        else:
            if hidden is None:
                raise EngineError(f"stage [{self.start}, {self.end}) needs hidden activations from the previous stage")
            x_np = np.ascontiguousarray(hidden, dtype=self.act_dtype)
            if x_np.shape != (N, self.dim):
                raise EngineError(f"hidden has shape {hidden.shape}, expected ({N}, {self.dim})")

        for _, n, slot, pos in runs:  # a stage driven without BlockTables grows its tables itself
            if self._pool.ensure(slot, pos + n) is not None:
                self._set_table_row(slot)
        picks = [i for i, c in enumerate(cols) if c.needs_logits] if self.last else []
        if len(runs) == 1 and N > 1:
            # a prompt's run goes in chunks of the bucket sizes (prefill_chunks), so prompts of any length share the
            # compiled shapes; a chunk's pad rows write cache positions past its columns, which nothing reads before
            # the next chunk or a later step rewrites them
            _, _, slot, pos = runs[0]
            outs, off = [], 0
            for n, size in prefill_chunks(N, self.max_context - pos - N):
                chunk_picks = tuple(i - off for i in picks if off <= i < off + n)
                outs.append(self._run(x_np[off:off + n], [(0, n, slot, pos + off)], size, chunk_picks, greedy=greedy))
                off += n
            out = outs[0] if len(outs) == 1 else np.concatenate(outs)
        else:
            out = self._run(x_np, runs, N, tuple(picks), greedy=greedy, view=view)
        for col, n, slot, pos in runs:
            self._lengths[slot] = pos + n
        return out

    @property
    def _rope_resident(self) -> bool:
        """Every layer ropes on the device from the resident tables: no rope tables computed and sent per step
        (MESH_GPU_ROPE_WRITE is read per step: bench/decode_ab.py switches it between captured variants)."""
        return self._rope_layers and os.environ.get("MESH_GPU_ROPE_WRITE") != "0"

    def _run(self, x_np: np.ndarray, runs: Sequence[tuple[int, int, int, int]], size: int,
             picks: tuple[int, ...], execute: bool = True, greedy: bool = False,
             view: bool = False) -> np.ndarray | None:
        """One compiled step over the rows of x_np in `runs` (col, n, slot, pos), zero rows appended up to `size`
        (one run only). Returns the (rows, dim) activations, or on the last stage the logits rows of `picks` (greedy:
        their argmax ids, int32, taken on the device). execute=False (warmup): only compile the shape, when that
        needs no run (None returned)."""
        n_real = len(x_np)
        jit_runs = tuple((col, n) for col, n, _, _ in runs)
        if size > n_real:
            x_np = np.concatenate([x_np, np.zeros((size - n_real, self.dim), self.act_dtype)])
            jit_runs = ((0, size),)
        # the last stage runs its layers for columns without logits too (their KV is needed), through the shape of
        # one logits row: one compiled shape fewer. The CPU replay skips that shape's head kernels (the table's
        # tail: `CpuReplay.headless`), so a prompt's chunks before the last cost no head at all; the jit path (GPUs)
        # computes the row and throws it away
        wanted = bool(picks)
        shape, var_vals, picks, every_row, ctx = self._key(runs, jit_runs, size, picks, greedy)
        resident = self._rope_resident
        if (raw := self._raw.get(shape)) is not None:
            return self._run_raw(raw, x_np, runs, size, n_real, var_vals, wanted, greedy, resident, view=view)
        self._synced = False
        positions = self._positions(runs, size, n_real)
        if resident:  # the step's cos/sin inputs stay as they are: no layer reads them
            cos_np = sin_np = np.zeros((len(positions), self.meta.rope_dim // 2), np.float32)
        else:
            cos_np, sin_np = rope_inputs(self.meta, positions)

        def bound() -> list[UOp]:
            binds = [v.bind(int(r[2])) for v, r in zip(self._vslot, runs)] + \
                    [v.bind(int(r[3])) for v, r in zip(self._vpos, runs)] + [self._vctx.bind(ctx)]
            if not every_row:
                binds += [UOp.variable(f"pick{j}", 0, size - 1).bind(i) for j, i in enumerate(picks)]
            return binds
        inputs = self._inputs.get(shape)
        if inputs is None:
            inputs = self._inputs[shape] = tuple(device_empty(a.shape, dtypes.float32) for a in (x_np, cos_np, sin_np))
        for t, a in zip(inputs, (x_np,) if resident else (x_np, cos_np, sin_np)):
            write_into(t, a)
        fn = self._jits.get(shape)
        if new_shape := fn is None:
            fn = TinyJit(partial(self._graph, shape))  # jit=False: captured for this one step, then dropped
            fn.cnt = 1  # (the attention kernels read bound variables, which only a jit's call hands them)
            if self._use_jit:
                fn = self._jits[shape] = self._capture(shape, inputs, bound())
        if not execute and self._use_jit and fn.captured is not None:  # compiled without running (warmup)
            self._replay_for(shape, fn, inputs)
            self._after_new_shape()
            return None
        self._dirty.update(int(r[2]) for r in runs)  # the step writes these slots' caches
        replay = self._replays.get(shape)
        if replay is not None and self.last and not wanted:  # a chunk without logits: its layers only, no head
            replay.headless(var_vals)
            result = None
        elif replay is not None:
            result = replay(var_vals)
            if self._raw_on:        # the next step of this shape takes the raw path
                self._raw[shape] = _raw_for(replay, inputs)
        elif (bufs := self._direct.get(shape)) is not None:
            result = fn.captured(bufs, var_vals)
        else:
            result = fn(*inputs, *bound())
            if self._use_jit and fn.captured is not None:
                self._replay_for(shape, fn, inputs)
        if not self.last:
            out = _copy_out(result)[:n_real]
        elif wanted:
            out = _copy_out(result)
        else:
            out = np.zeros(0, np.int32) if greedy else np.zeros((0, self.meta.vocab_size), dtype=np.float32)
        if new_shape:
            self._after_new_shape()
        return out

    def _key(self, runs, jit_runs, size: int, picks: tuple[int, ...], greedy: bool):
        """A step's compiled shape and its bound variables' values by name (what a replayed step takes): (shape,
        var_vals, picks, every_row, ctx). The last stage runs a step without logits columns through the shape of one
        logits row (picks (0,))."""
        if self.last and not picks:
            picks = (0,)
        # which rows reach the head is a runtime value (bound variables), so a prompt's length inside its padded
        # size does not make a new jit; only "every row" is a shape of its own
        every_row = self.last and picks == tuple(range(size))
        shape = (size, jit_runs, -1 if every_row else len(picks)) + (("greedy",) if greedy else ())
        ctx = max(int(r[3]) + n for (_, n), r in zip(jit_runs, runs))
        if (k := self._ctx_round) > 1:
            ctx = min(-(-ctx // k) * k, self.max_context)
        # the bound UOps themselves are built only where a capture or a jit call needs them (each bind is a UOp
        # built through tinygrad's cache); their names are read once
        if (names := self._var_names) is None:
            names = self._var_names = (self._vctx.expr, [(v.expr, w.expr) for v, w in zip(self._vslot, self._vpos)])
        var_vals = {names[0]: ctx}
        for (slot_name, pos_name), r in zip(names[1], runs):
            var_vals[slot_name], var_vals[pos_name] = int(r[2]), int(r[3])
        if not every_row:
            var_vals.update((f"pick{j}", i) for j, i in enumerate(picks))
        return shape, var_vals, picks, every_row, ctx

    def step_bytes(self, cols: Sequence[Column], data: bytes | None,
                   sampling: Sampling | Sequence[Sampling] = Sampling()) -> tuple[np.dtype, tuple, bytes] | None:
        """`step` for a decode step whose shape this stage replayed before on the CPU (`_Raw`), its input rows as
        float32 bytes (None on the first stage), its output (activations, or the last stage's greedy token ids) as
        (dtype, shape, bytes): the frame's bytes are copied into the step's input buffer and the output buffer's bytes come
        back, without the numpy arrays of `step` between (issue 10: this Python runs cold on every stage of every
        token). The same checks, cache bookkeeping, inputs and replay as `step`, so the same bits. None: not such a
        step (nothing was done; `step` takes it)."""
        if not self._raw or (data is not None if self.first else type(data) is not bytes):
            return None
        N = len(cols)
        if N == 1 and self._lean_on:
            return self._step_one(cols[0], data, sampling)
        greedy = False
        if self.last:
            try:
                samplings = samplings_for(sampling, cols)
            except ValueError as exc:
                raise EngineError(str(exc)) from None
            greedy = self.greedy_on_device and all(s.temperature == 0.0 for s in samplings)
        if not self.first and (self.act_dtype != np.float32 or len(data) != N * self.dim * 4):
            return None
        runs = self._groups(cols)
        if len(runs) == 1 and N > 1:        # a prompt's run: chunks (`_forward`)
            return None
        picks = tuple(i for i, c in enumerate(cols) if c.needs_logits) if self.last else ()
        shape, var_vals, _, _, _ = self._key(runs, tuple((col, n) for col, n, _, _ in runs), N, picks, greedy)
        raw = self._raw.get(shape)
        if raw is None or (self.last and not picks):
            return None
        x = data
        if self.first:      # (Python's min and max: numpy's run Python wrappers, cold)
            toks = [c.token for c in cols]
            self._check_tokens(min(toks), max(toks))
            x = np.ascontiguousarray(self._embed.lookup(np.array(toks, dtype=np.int64)), np.float32).tobytes()
        for _, n, slot, pos in runs:
            if self._pool.ensure(slot, pos + n) is not None:
                self._set_table_row(slot)
        out = self._run_raw(raw, x, runs, N, N, var_vals, True, greedy, self._rope_resident,
                            as_bytes=not self.last or greedy, view=self.last and not greedy)
        for _, n, slot, pos in runs:
            self._lengths[slot] = pos + n
        if self.last and not greedy:      # the logits' rows: tokens picked here, as `step` picks them
            ids = _pick_rows(out, samplings, cols, picks)
            return ids.dtype, ids.shape, ids.tobytes()
        return raw.out_dtype, (raw.out_shape if self.last else (N, *raw.out_shape[1:])), out

    def _step_one(self, c: Column, data: bytes | None, sampling) -> tuple[np.dtype, tuple, bytes] | None:
        """`step_bytes` of one column (a single stream's decode step: every stage of every token), the same checks,
        bookkeeping, inputs and replay in straight-line code: `_groups`, `_key` and `_run_raw` build runs, tuples,
        generators and a dict of names for the general case, ~30 Python calls that run cold (the other stages
        stream their weights through the caches between two tokens). The shape's key and variable names are built
        by `_key` once (per greedy or not) and kept (`_plans`); MESH_STEP_LEAN=0 takes the general way (A/B)."""
        last, slot, pos = self.last, c.slot, c.pos
        greedy = False
        if last:
            try:
                samplings = samplings_for(sampling, (c,))
            except ValueError as exc:
                raise EngineError(str(exc)) from None
            greedy = self.greedy_on_device and samplings[0].temperature == 0.0
            if not c.needs_logits:
                return None
        if not self.first and (self.act_dtype != np.float32 or len(data) != self.dim * 4):
            return None
        self._check_slot(slot)          # `_groups`' checks, for one column
        self._check_position(0, pos)
        self._check_start(0, slot, pos)
        plan = self._plans.get(greedy)
        if plan is None:
            shape, var_vals, _, _, _ = self._key([(0, 1, slot, pos)], ((0, 1),), 1, (0,) if last else (), greedy)
            names = self._var_names
            # every name `_key` binds for one run: ctx (pos + 1), the first run's slot and position (the last
            # stage's one row is "every row": no pick variables)
            if set(var_vals) != {names[0], *names[1][0]}:
                return None
            plan = self._plans[greedy] = (shape, names[0], *names[1][0])
        shape, ctx_name, slot_name, pos_name = plan
        raw = self._raw.get(shape)
        if raw is None:
            return None
        if self.first:
            self._check_tokens(c.token, c.token)
            data = np.ascontiguousarray(self._embed.lookup(np.array([c.token], dtype=np.int64)), np.float32).tobytes()
        if self._pool.ensure(slot, pos + 1) is not None:
            self._set_table_row(slot)
        if not self._synced:   # (`_run_raw`)
            raw.dev.synchronize()
            self._synced = True
        ctypes.memmove(raw.x, data, len(data))
        if not self._rope_resident:
            rows = self._rope_rows.get(pos)
            if rows is None:
                rows = self._rope_row(pos)
            ctypes.memmove(raw.cos, rows[0], len(rows[0]))
            ctypes.memmove(raw.sin, rows[1], len(rows[1]))
        self._dirty.add(int(slot))
        raw.replay({ctx_name: pos + 1, slot_name: int(slot), pos_name: int(pos)})
        self._lengths[slot] = pos + 1
        if last and not greedy:      # the logits' row: the token picked here, as `step` picks it
            out = np.empty(raw.out_shape, raw.out_dtype)
            ctypes.memmove(out.ctypes.data, raw.out, out.nbytes)
            ids = np.array([pick_token(out[0], samplings[0], pos)], np.int32)
            return ids.dtype, ids.shape, ids.tobytes()
        out_shape = raw.out_shape if last else (1, *raw.out_shape[1:])
        return raw.out_dtype, out_shape, ctypes.string_at(raw.out, raw.out_dtype.itemsize * math.prod(out_shape))

    @staticmethod
    def _positions(runs, size: int, n_real: int) -> np.ndarray:
        if size > n_real:   # one run, padded: the pad rows take the positions after it
            return np.arange(runs[0][3], runs[0][3] + size, dtype=np.int64)
        return np.concatenate([np.arange(pos, pos + n, dtype=np.int64) for _, n, _, pos in runs])

    def _run_raw(self, raw: _Raw, x_np: np.ndarray | bytes, runs, size: int, n_real: int, var_vals: dict,
                 wanted: bool, greedy: bool, resident: bool, as_bytes: bool = False,
                 view: bool = False) -> np.ndarray | bytes:
        """`_run` of a shape replayed before (`_Raw`): the same inputs written, the same replay, the same output
        rows, through raw host copies. A decode step's rope rows are computed once per position, by the same call
        as `_run`'s (one position), so the bits are the same. `x_np` may be the rows' float32 bytes already, and
        `as_bytes` returns the output rows' bytes (`step_bytes`); `view` a view of the output buffer itself (valid until
        this stage's next step: the last stage's picks read the logits where the head wrote them, no copy; 8 columns
        are 1.5 MB of SmolLM2 logits, ~0.1 ms a step to copy). Decode columns of several slots (one position each)
        take their rope rows from the per-position cache (`_rope_row`: the same bits as `rope_inputs` of the step's
        positions)."""
        if not self._synced:   # what this stage's tinygrad calls queued before (a step through the jit)
            raw.dev.synchronize()
            self._synced = True
        if type(x_np) is not bytes:
            x_np = np.ascontiguousarray(x_np, np.float32).tobytes()
        ctypes.memmove(raw.x, x_np, len(x_np))
        if not resident:
            if size == 1:
                rows = self._rope_rows.get(pos := int(runs[0][3]))
                if rows is None:
                    rows = self._rope_row(pos)
            elif size == n_real and all(n == 1 for _, n, _, _ in runs):  # decode columns: cached rows, joined
                got = [self._rope_rows.get(int(r[3])) or self._rope_row(int(r[3])) for r in runs]
                rows = [b"".join(g[0] for g in got), b"".join(g[1] for g in got)]
            else:
                rows = [np.ascontiguousarray(a, np.float32).tobytes()
                        for a in rope_inputs(self.meta, self._positions(runs, size, n_real))]
            ctypes.memmove(raw.cos, rows[0], len(rows[0]))
            ctypes.memmove(raw.sin, rows[1], len(rows[1]))
        self._dirty.update(int(r[2]) for r in runs)
        if self.last and not wanted:
            raw.replay.headless(var_vals)
            return np.zeros(0, np.int32) if greedy else np.zeros((0, self.meta.vocab_size), dtype=np.float32)
        raw.replay(var_vals)
        shape = raw.out_shape if self.last else (n_real, *raw.out_shape[1:])
        if as_bytes:
            return ctypes.string_at(raw.out, raw.out_dtype.itemsize * math.prod(shape))
        if view:
            return _buffer_view(raw.out, raw.out_dtype, shape)
        out = np.empty(shape, raw.out_dtype)
        ctypes.memmove(out.ctypes.data, raw.out, out.nbytes)
        return out

    def _rope_row(self, pos: int) -> tuple[bytes, bytes]:
        """Position `pos`'s cos/sin rows, computed with the ROPE_BLOCK positions around it in one `rope_inputs` call
        (each a (1, R/2) row). Elementwise float64 math and numpy's cos/sin give a row the same bits in a block as
        alone (checked for positions 0..8191 on numpy 2.4, x86); a decode step then costs a dict lookup, not
        ~10 numpy calls on cold caches."""
        p0 = pos - pos % ROPE_BLOCK
        cos, sin = rope_inputs(self.meta, np.arange(p0, min(p0 + ROPE_BLOCK, self.max_context), dtype=np.int64))
        for i in range(len(cos)):   # as the step's input bytes (float32)
            self._rope_rows[p0 + i] = (np.ascontiguousarray(cos[i:i + 1], np.float32).tobytes(),
                                       np.ascontiguousarray(sin[i:i + 1], np.float32).tobytes())
        return self._rope_rows[pos]

    def _replay_for(self, shape, fn, inputs) -> None:
        if shape not in self._replays:
            try:
                self._replays[shape] = CpuReplay(fn, inputs, head=self._head_calls.get(shape, 0))
            except NotReplayable:
                self._replays[shape] = None
                # a GPU's step: its captured calls run straight from the input buffers (fixed per shape) and the
                # variables' values, without TinyJit's per-call input preparation (a graph rewrite of every input,
                # then the same checks each step); MESH_JIT_DIRECT=0 keeps the jit call
                if os.environ.get("MESH_JIT_DIRECT", "1") != "0":
                    self._direct[shape] = _prepare_jit_inputs(tuple(inputs), {})[0]

    def _after_new_shape(self) -> None:
        # the capture's scratch buffers now sit in the allocator's cache (the jit keeps its own); its programs go
        # to disk for the next process
        _release_freed_memory()
        if self._program_file is not None and self._use_jit:
            self._programs_on_disk = save_programs(
                self._program_file, [j.captured.linear for j in self._jits.values() if j.captured is not None],
                self._programs_on_disk)

    def warmup(self, decode_batch: int | None = None) -> WarmupResult:
        """Compile every step shape a session goes through, so that no step waits for tinygrad to schedule and
        compile: decode steps of 1..decode_batch sequences (default n_slots; each one column in its own slot) and a
        chunk of each prefill bucket that fits the context. A shape assembled from layer templates is only built
        (no step runs); one captured whole runs once on scratch data in the slots; on a GPU every shape then runs
        once (`_warm_runs`: its graphs are built at its first run). Then clears the slots (`reset`): it belongs
        right after `load`, and refuses when a slot holds positions. Leaves no trace a
        later step could see: the same kernels run whether a shape was compiled here or by the step that needs it.
        A no-op for a stage loaded with jit=False (nothing is kept between steps)."""
        if any(self._lengths):
            raise EngineError("warmup overwrites the KV slots: run it before any step, or after reset()")
        if not self._use_jit:
            return WarmupResult(0.0, 0)
        widths = self.n_slots if decode_batch is None else decode_batch
        if not 1 <= widths <= self.n_slots:
            raise RangeError(f"decode_batch {decode_batch} is outside [1, {self.n_slots}]")
        t0, before = time.perf_counter(), len(self._jits)

        def rows(n: int) -> np.ndarray:
            if self.first:
                return self._embed.lookup(np.zeros(n, dtype=np.int64))
            return np.zeros((n, self.dim), self.act_dtype)

        # on a GPU the last stage has a shape that picks greedy tokens on the device, besides the logits one
        shapes = []
        for greedy in (False, True) if self.last and self.greedy_on_device else (False,):
            for k in range(1, widths + 1):  # batched decode: slot i at position 0, every column with logits
                shapes.append(([(i, 1, i, 0) for i in range(k)], k, tuple(range(k)) if self.last else (), greedy))
            for b in PREFILL_BUCKETS:  # a prompt's chunk; the logits (if any) on one row, which is a bound variable
                if b <= self.max_context:
                    shapes.append(([(0, b, 0, 0)], b, (b - 1,) if self.last else (), greedy))
        for runs, size, picks, greedy in shapes:
            self._run(rows(size), runs, size, picks, execute=False, greedy=greedy)
        if self._warm_runs():
            # each shape also runs once: tinygrad builds a step's CUDA graphs at its first run (get_graph_runtime:
            # ~0.1-0.2 s of Python a shape on the H200), which otherwise lands on the first step of each width a
            # service forms; 16 streams paid it inside serving, on the first all-16 step (bench/RESULTS.md, ninth
            # session). The runs write the trash block (the slots own no blocks yet) and mark the slots dirty,
            # which reset() below clears
            for runs, size, picks, greedy in shapes:
                self._run(rows(size), runs, size, picks, greedy=greedy)
        self.zero_slot(0)  # compiles the session start's slot clearing too
        self.reset()
        return WarmupResult((time.perf_counter() - t0) * 1000, len(self._jits) - before)

    def _warm_runs(self) -> bool:
        """Whether warmup runs every shape once after compiling it: where steps run as captured jits (a GPU: no
        CPU replay, `_replays` holds None), whose first run builds the device graphs; the CPU's replay has no such
        first-run cost. MESH_WARM_RUN=1 forces it (tests check the runs leave no trace), 0 turns it off (A/B)."""
        flag = os.environ.get("MESH_WARM_RUN", "")
        return flag == "1" or (flag != "0" and any(r is None for r in self._replays.values()))

    def _capture(self, shape, inputs: tuple[Tensor, Tensor, Tensor], binds: list[UOp]) -> TinyJit:
        """The jit of a new step shape. One layer of each kind is captured and its kernels serve every layer
        (engine/shared_layers.py: the warmup of a shape schedules 1 layer instead of 30, same kernels and bits); a
        step it cannot share is captured whole. The whole capture happens on the jit's first call (`cnt = 1`): the
        inputs and weights are realized before it, so there are no one-time kernels to leave out."""
        if self.share_layers:
            head = (self._head, partial(self._head_rows, shape)) if self.last else None
            path = self._template_file(shape)
            stored = read_blob(path) if path is not None else None
            if isinstance(stored, dict):  # templates from an earlier process: no scheduling at all
                try:
                    fn, used = capture_shared(self._blocks, partial(self._layer, shape), head, inputs, binds, stored)
                except Exception:  # noqa: BLE001 (a stale or damaged template is never trusted: captured anew)
                    _release_freed_memory()
                else:
                    return self._note_head(shape, fn, used)
            self._load_programs()
            try:
                fn, used = capture_shared(self._blocks, partial(self._layer, shape), head, inputs, binds)
            except NotShareable:
                _release_freed_memory()
            else:
                if path is not None:
                    write_blob(path, used)
                return self._note_head(shape, fn, used)
        self._load_programs()
        fn = TinyJit(partial(self._graph, shape))
        fn.cnt = 1
        return fn

    def _note_head(self, shape, fn: TinyJit, used: dict) -> TinyJit:
        """Remember how many kernels the head adds at the end of an assembled step (its template's calls), so a
        prefill chunk without logits can run the step without them (`CpuReplay.headless`)."""
        if self.last and "head" in used:
            self._head_calls[shape] = len(used["head"].linear.src)
        return fn

    def _load_programs(self) -> None:
        """Before something compiles: the kernels earlier processes compiled for this configuration (read once)."""
        if self._program_file is not None and not self._programs_loaded:
            self._programs_loaded = True
            self._programs_on_disk = load_programs(self._program_file)

    def _template_file(self, shape) -> Path | None:
        """Where the step templates of a shape are kept (with the stage's programs; None: the cache is off)."""
        if self._program_file is None:
            return None
        return self._program_file.with_name(cache_path(self._program_file.stem, "step", shape, code_identity()).name)

    def _layer(self, shape, block: Block, x: Tensor, cos: Tensor, sin: Tensor, *binds: UOp) -> Tensor:
        """One layer of the step for one shape of columns."""
        N, runs = shape[:2]
        k = len(runs)
        groups = [Group(col, n, binds[i], binds[k + i]) for i, (col, n) in enumerate(runs)]
        return block(x, cos.reshape(N, 1, -1), sin.reshape(N, 1, -1), groups, binds[2 * k])

    def _head_rows(self, shape, x: Tensor, *binds: UOp) -> Tensor:
        """The last stage's head over the rows that want logits: every row, or the rows bound to pick<j>."""
        _, runs, n_picks = shape[:3]
        if n_picks == -1:
            rows = x
        else:
            picks = binds[2 * len(runs) + 1:]
            rows = x[picks[0]:picks[0] + 1] if n_picks == 1 else Tensor.cat(*[x[v:v + 1] for v in picks])
        logits = self._head(rows)  # (M, vocab) float32
        if shape[3:] == ("greedy",):  # the first largest logit's id, as np.argmax: 4 bytes back instead of 4 * vocab
            return greedy_ids(logits).contiguous().realize()
        return logits

    def _graph(self, shape, x: Tensor, cos: Tensor, sin: Tensor, *binds: UOp) -> Tensor:
        """The step's computation for one shape of columns; TinyJit replays it with new inputs and bindings."""
        for b in self._blocks:
            x = self._layer(shape, b, x, cos, sin, *binds)
        return self._head_rows(shape, x, *binds) if self.last else x
