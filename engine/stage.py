"""A pipeline stage: layers [start, end) of a GGUF model, its KV slots, and the step that runs columns through it."""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from tinygrad import Device, Tensor, TinyJit, UOp, dtypes
from tinygrad.dtype import _to_np_dtype

from .errors import EngineError, RangeError
from .gguf_meta import ModelMeta, meta_from_gguf, read_gguf
from .loader import (EmbeddingTable, WeightMode, block_tensor_names, check_range, concat_rows, load_weight,
                     free_device_cache, tensor_info, write_into)
from .model import Block, Group, Head, rope_tables
from .sampling import Sampling, pick_token

__all__ = ["Column", "Sampling", "Stage"]


@dataclass(frozen=True, slots=True)
class Column:
    """One token's place in a step: its position in the sequence, the KV slot of that sequence, and, on the
    first stage, the token id. The last stage picks a next token for every column with needs_logits."""
    pos: int
    slot: int
    needs_logits: bool = False
    token: int = 0


def _release_freed_memory() -> None:
    """Hand the load's freed intermediates back to the OS. tinygrad's allocator keeps freed device buffers in an
    LRU cache for reuse (the load's scratch and the q/k/v parts fused into one weight: ~10 MB on a SmolLM2 stage),
    and glibc keeps freed heap pages after the first large free raises its mmap threshold."""
    free_device_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _copy_out(t: Tensor) -> np.ndarray:
    """A realized device tensor's contents as a new host array, without `.numpy()`'s realize and copy schedule."""
    buf = t.uop.buffer
    out = np.empty(t.shape, _to_np_dtype(t.dtype))
    Device[buf.device].allocator._copyout(memoryview(out).cast("B"), buf._buf)
    return out


PREFILL_MIN = 8  # smallest padded prefill: shorter prompts share one set of kernels
_KV_DTYPES = {"f16": dtypes.float16, "f32": dtypes.float32}


class Stage:
    act_dtype = np.dtype(np.float32)

    def __init__(self, meta: ModelMeta, start: int, end: int, blocks: list[Block], embed: EmbeddingTable | None,
                 head: Head | None, *, n_slots: int, max_context: int, weight_bytes: int,
                 use_jit: bool = True) -> None:
        self.meta, self.start, self.end = meta, start, end
        self.first, self.last = embed is not None, head is not None
        self.dim = meta.dim
        self.n_slots, self.max_context = n_slots, max_context
        self.weight_bytes = weight_bytes
        self.kv_bytes = sum(b.cache_k.nbytes() + b.cache_v.nbytes() for b in blocks)
        self._blocks, self._embed, self._head = blocks, embed, head
        self._lengths = [0] * n_slots  # positions each slot holds
        self._vslot = [UOp.variable(f"slot{i}", 0, n_slots - 1) for i in range(n_slots)]
        self._vpos = [UOp.variable(f"pos{i}", 0, max_context - 1) for i in range(n_slots)]
        self._use_jit = use_jit
        self._jits: dict[tuple, TinyJit] = {}
        self._inputs: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}  # per jit shape: x, cos, sin, written in place

    @classmethod
    def load(cls, path: str | Path, start: int, end: int, *, n_slots: int = 4, max_context: int = 2048,
             weights: WeightMode = "q8", kv_dtype: str = "f32", jit: bool = True) -> "Stage":
        """Load layers [start, end) of the GGUF at `path`; the first stage also holds the embeddings, the last
        the final norm and output head (the embeddings again when the output is tied)."""
        g = read_gguf(path)
        meta = meta_from_gguf(g)
        check_range(meta, start, end)
        if n_slots < 1:
            raise RangeError(f"{path}: n_slots must be at least 1, got {n_slots}")
        if max_context < 1:
            raise RangeError(f"{path}: max_context must be at least 1, got {max_context}")
        max_context = min(max_context, meta.context_length)  # the model was not trained past its context
        if kv_dtype not in _KV_DTYPES or weights not in ("f32", "f16", "q8", "quant"):
            raise EngineError(f"unknown weights={weights!r} or kv_dtype={kv_dtype!r}")
        first, last = start == 0, end == meta.n_layers
        D, H, KvH, Hd = meta.dim, meta.n_heads, meta.n_kv_heads, meta.head_dim
        shapes = {
            "attn_norm.weight": (D,), "ffn_norm.weight": (D,),
            "attn_q.weight": (H * Hd, D), "attn_k.weight": (KvH * Hd, D), "attn_v.weight": (KvH * Hd, D),
            "attn_output.weight": (D, H * Hd),
            "ffn_gate.weight": (meta.ffn_dim, D), "ffn_up.weight": (meta.ffn_dim, D), "ffn_down.weight": (D, meta.ffn_dim),
            "attn_q.bias": (H * Hd,), "attn_k.bias": (KvH * Hd,), "attn_v.bias": (KvH * Hd,),
            "attn_q_norm.weight": (Hd,), "attn_k_norm.weight": (Hd,),
        }
        # llama GGUFs store q/k rows permuted for adjacent-pair rope; undo it so one half-split rope serves all
        rope_heads = {} if meta.rope_neox else {"attn_q.weight": H, "attn_k.weight": KvH, "attn_q.bias": H, "attn_k.bias": KvH}
        weight_bytes = 0
        blocks = []
        for layer in range(start, end):
            ws = {}
            for short, full in block_tensor_names(meta, layer).items():
                info = tensor_info(g, full, shapes[short])
                ws[short] = load_weight(g, info, weights, rope_heads=rope_heads.get(short, 0))
                weight_bytes += ws[short].nbytes
            for kind in ("weight", "bias"):  # one matmul for q, k and v: fewer kernels per layer
                names = [f"attn_{x}.{kind}" for x in "qkv"]
                if all(n in ws for n in names) and (fused := concat_rows([ws[n] for n in names])) is not None:
                    for n in names:
                        del ws[n]
                    ws[f"attn_qkv.{kind}"] = fused
            blocks.append(Block(ws, n_heads=H, n_kv_heads=KvH, head_dim=Hd, rope_dim=meta.rope_dim,
                                norm_eps=meta.norm_eps, n_slots=n_slots, max_context=max_context,
                                kv_dtype=_KV_DTYPES[kv_dtype]))
        embed = head = None
        if first:
            embed = EmbeddingTable(g, tensor_info(g, "token_embd.weight", (meta.vocab_size, D)))
            weight_bytes += embed.nbytes
        if last:
            out_name = "token_embd.weight" if meta.tied_output else "output.weight"
            norm = load_weight(g, tensor_info(g, "output_norm.weight", (D,)), weights)
            out = load_weight(g, tensor_info(g, out_name, (meta.vocab_size, D)), weights)
            weight_bytes += norm.nbytes + out.nbytes
            head = Head(norm, out, meta.norm_eps)
        _release_freed_memory()
        return cls(meta, start, end, blocks, embed, head, n_slots=n_slots, max_context=max_context,
                   weight_bytes=weight_bytes, use_jit=jit)

    # ---- KV slots

    def _check_slot(self, slot: int) -> None:
        if not (isinstance(slot, (int, np.integer)) and 0 <= slot < self.n_slots):
            raise RangeError(f"slot {slot} is outside [0, {self.n_slots})")

    def zero_slot(self, slot: int) -> None:
        """Forget everything slot `slot` holds and clear its cache."""
        self._check_slot(slot)
        for b in self._blocks:
            b.zero_slot(self._vslot[0].bind(int(slot)))
        self._lengths[slot] = 0

    def reset(self) -> None:
        """Forget every slot."""
        for b in self._blocks:
            b.reset()
        self._lengths = [0] * self.n_slots

    def rollback(self, slot: int, pos: int) -> None:
        """Forget positions >= pos of `slot` (rejected speculative tokens). Forgotten cache rows are never read
        again before a later step rewrites them: attention only reads positions below the step's own end."""
        self._check_slot(slot)
        if not 0 <= pos <= self._lengths[slot]:
            raise RangeError(f"rollback of slot {slot} to {pos}: the slot holds positions [0, {self._lengths[slot]})")
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
            if not 0 <= c.pos < self.max_context:
                raise RangeError(f"column {i}: position {c.pos} is outside [0, {self.max_context})")
            if runs and runs[-1][2] == c.slot and runs[-1][3] + runs[-1][1] == c.pos:
                runs[-1][1] += 1
            else:
                runs.append([i, 1, c.slot, c.pos])
        seen: set[int] = set()
        for col, n, slot, pos in runs:
            if slot in seen:
                raise RangeError(f"slot {slot} appears in two separate runs of one step")
            seen.add(slot)
            if pos > self._lengths[slot]:
                raise RangeError(f"column {col}: position {pos} skips ahead of slot {slot}, which holds "
                                 f"[0, {self._lengths[slot]})")
        return [tuple(r) for r in runs]  # type: ignore[misc]

    def step(self, cols: Sequence[Column], hidden: np.ndarray | None = None,
             sampling: Sampling | Sequence[Sampling] = Sampling()) -> np.ndarray:
        """Run the columns through this stage's layers.

        First stage: tokens come from the columns (`hidden` must be None). Other stages: `hidden` is the previous
        stage's (len(cols), dim) output. Returns (len(cols), dim) activations in act_dtype, or on the last stage
        int32 token ids, one per column with needs_logits (sampling may be one Sampling or one per such column).
        """
        picks = [i for i, c in enumerate(cols) if c.needs_logits]
        if self.last and not isinstance(sampling, Sampling) and len(sampling) != len(picks):
            raise EngineError(f"{len(sampling)} Sampling entries for {len(picks)} columns that need logits")
        out = self._forward(cols, hidden)
        if not self.last:
            return out
        samplings = [sampling] * len(picks) if isinstance(sampling, Sampling) else list(sampling)
        return np.array([pick_token(out[j], samplings[j], cols[i].pos) for j, i in enumerate(picks)], dtype=np.int32)

    def step_logits(self, cols: Sequence[Column], hidden: np.ndarray | None = None) -> np.ndarray:
        """Like step on the last stage, but return the (M, vocab) float32 logits of the needs_logits columns."""
        if not self.last:
            raise EngineError(f"stage [{self.start}, {self.end}) is not the last stage and has no logits")
        return self._forward(cols, hidden)

    def _forward(self, cols: Sequence[Column], hidden: np.ndarray | None) -> np.ndarray:
        runs = self._groups(cols)
        N = len(cols)
        if self.first:
            if hidden is not None:
                raise EngineError("the first stage takes tokens from the columns, not hidden activations")
            ids = np.array([c.token for c in cols], dtype=np.int64)
            if ids.min() < 0 or ids.max() >= self.meta.vocab_size:
                raise RangeError(f"token ids must lie in [0, {self.meta.vocab_size}), got {ids.min()}..{ids.max()}")
            x_np = self._embed.lookup(ids)
        else:
            if hidden is None:
                raise EngineError(f"stage [{self.start}, {self.end}) needs hidden activations from the previous stage")
            x_np = np.ascontiguousarray(hidden, dtype=self.act_dtype)
            if x_np.shape != (N, self.dim):
                raise EngineError(f"hidden has shape {hidden.shape}, expected ({N}, {self.dim})")

        picks = tuple(i for i, c in enumerate(cols) if c.needs_logits) if self.last else ()
        if self.last and not picks:
            out = np.zeros((0, self.meta.vocab_size), dtype=np.float32)
        else:
            positions = np.array([c.pos for c in cols], dtype=np.int64)
            jit_runs = runs
            if len(runs) == 1 and N > 1:
                # a prefill run is padded to a power of two so prompts of similar length share compiled kernels;
                # pad rows write cache positions past the run, which nothing reads before a later step rewrites them
                _, _, slot, pos = runs[0]
                size = max(PREFILL_MIN, 1 << (N - 1).bit_length())
                if pos + size <= self.max_context:
                    x_np = np.concatenate([x_np, np.zeros((size - N, self.dim), self.act_dtype)])
                    positions = np.arange(pos, pos + size, dtype=np.int64)
                    jit_runs = [(0, size, slot, pos)]
            cos_np, sin_np = rope_tables(positions, self.meta.rope_dim, self.meta.rope_theta)
            n_rows = len(x_np)
            # which rows reach the head is a runtime value (bound variables), so a prompt's length inside its padded
            # size does not make a new jit; only "every row" is a shape of its own
            every_row = picks == tuple(range(n_rows))
            shape = (n_rows, tuple((col, n) for col, n, _, _ in jit_runs), -1 if every_row else len(picks))
            fn = self._jits.get(shape)
            if new_shape := fn is None:
                fn = partial(self._graph, shape)
                if self._use_jit:
                    fn = self._jits[shape] = TinyJit(fn)
                    # capture on the first call: all inputs and weights are realized before it, so there are no
                    # one-time kernels to leave out, and scheduling 30 layers twice would double the first token
                    fn.cnt = 1
            binds = [v.bind(int(r[2])) for v, r in zip(self._vslot, runs)] + \
                    [v.bind(int(r[3])) for v, r in zip(self._vpos, runs)]
            if not every_row:
                binds += [UOp.variable(f"pick{j}", 0, n_rows - 1).bind(i) for j, i in enumerate(picks)]
            inputs = self._inputs.get(shape)
            if inputs is None:
                inputs = self._inputs[shape] = tuple(Tensor.zeros(*a.shape, dtype=dtypes.float32).contiguous().realize()
                                                     for a in (x_np, cos_np, sin_np))
            for t, a in zip(inputs, (x_np, cos_np, sin_np)):
                write_into(t, a)
            out = _copy_out(fn(*inputs, *binds))
            if new_shape:       # the capture's scratch buffers now sit in the allocator's cache; the jit keeps its own
                _release_freed_memory()
            if not self.last:
                out = out[:N]
        for col, n, slot, pos in runs:
            self._lengths[slot] = pos + n
        return out

    def _graph(self, shape, x: Tensor, cos: Tensor, sin: Tensor, *binds: UOp) -> Tensor:
        """The step's computation for one shape of columns; TinyJit replays it with new inputs and bindings."""
        N, runs, n_picks = shape
        k = len(runs)
        groups = [Group(col, n, binds[i], binds[k + i]) for i, (col, n) in enumerate(runs)]
        cos, sin = cos.reshape(N, 1, -1), sin.reshape(N, 1, -1)
        for b in self._blocks:
            x = b(x, cos, sin, groups)
        if not self.last:
            return x
        if n_picks == -1:
            rows = x
        else:
            picks = binds[2 * k:]
            rows = x[picks[0]:picks[0] + 1] if n_picks == 1 else Tensor.cat(*[x[v:v + 1] for v in picks])
        return self._head(rows)  # (M, vocab) float32
