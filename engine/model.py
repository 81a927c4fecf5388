"""The stage model: a contiguous slice of a llama-family transformer, with a paged KV cache.

A step runs N columns (tokens) through the blocks. Columns come in groups; a group is one slot's run of
consecutive positions (prefill: one group of many columns; batched decode: many groups of one column). The
linear layers see all N columns at once, and so does attention: one set of kernels reads every column's own
sequence from the layer's block pools through the stage's block table (engine/paged_attention.py).

Every block's output is realized on its own, so the kernels of a layer are the same whatever range the layer
sits in: a split model produces bit-identical activations to the unsharded one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from tinygrad import Tensor, UOp
from tinygrad.dtype import DType

from .cpu_kernels import glu
from .loader import Weight, device_zeros, rms_norm, zero_rows
from .paged_attention import Run, paged_attention, paged_attention_x8, rope_write_kv, write_kv
from .quant_gemm import MAX_COLUMNS
from .quant_i8 import X8


@dataclass(frozen=True, slots=True)
class Group:
    """One slot's run of consecutive positions inside a step: columns [col, col + n) at positions [pos, pos + n)."""
    col: int
    n: int
    slot: UOp  # bound variable
    pos: UOp  # bound variable


def fuse_glu(device: str | tuple) -> bool:
    """Whether ffn_down takes [gate | up] and computes silu(gate) * up inside its kernel (MESH_FUSE_GLU=1; off by
    default on every device). Not on the CPU: its matvec would compute silu again for every group of 16 rows (exp2
    is a polynomial there: 3M of them per SmolLM2 token, 2x slower). Not on the H200 either, measured: the fused
    ffn_down kernel of the 8B shape took 30 us against ~20 us, more than the ~3 us the separate kernel and its
    launch cost (NOTES "The GPU matvec"). The CPU's 8-bit path takes [gate | up] whatever this says: its quantize
    kernel computes silu once a value (`Weight.glu_once`)."""
    return os.environ.get("MESH_FUSE_GLU", "0") != "0"


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x (N, heads, R) in half-split layout; cos/sin (N, 1, R/2)
    x1, x2 = x.chunk(2, dim=-1)
    return (x1 * cos - x2 * sin).cat(x2 * cos + x1 * sin, dim=-1)


def rope_tables(positions: np.ndarray, rope_dim: int, theta: float, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin for the given positions, computed on the host in float64 so every stage gets identical bits."""
    inv = 1.0 / theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    ang = (positions.astype(np.float64) * scale)[:, None] * inv[None, :]  # (N, R/2)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope_inputs(meta: ModelMeta, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The step's cos/sin input: one (N, R/2) table per rope base the model uses, side by side on the last axis
    (table 0: the model's base; table 1: the local layers' base, Gemma 3). A block reads its own table
    (`Block.rope_table`), so one input serves layers of every kind."""
    cos, sin = rope_tables(positions, meta.rope_dim, meta.rope_theta, meta.rope_scale)
    if not meta.rope_theta_local:
        return cos, sin
    cos_l, sin_l = rope_tables(positions, meta.rope_dim, meta.rope_theta_local)
    return np.concatenate([cos, cos_l], axis=1), np.concatenate([sin, sin_l], axis=1)


@dataclass(frozen=True)
class KVPages:
    """A stage's paged KV layout, shared by its layers: `n_blocks` blocks of `block_size` positions per layer (plus
    the trash block, index n_blocks) and the int32 block table (n_slots, blocks per sequence) on the device."""
    n_blocks: int
    block_size: int
    table: Tensor
    # GPUs, one rope base: cos/sin (max_context, rope_dim / 2) of every position, read by the kernel that ropes q
    # and k and writes the pools (paged_attention.rope_write_kv), so a step uploads no rope tables
    cos: Tensor | None = None
    sin: Tensor | None = None


def make_block(meta: ModelMeta, layer: int, w: dict[str, Weight], *, n_slots: int, max_context: int,
               kv_dtype: DType, pages: KVPages) -> "Block":
    """The block of absolute layer `layer`: its kind (class, local or global attention) follows from the index
    alone, so any split of the model runs each layer the same way."""
    common = dict(n_heads=meta.n_heads, n_kv_heads=meta.n_kv_heads, head_dim=meta.head_dim, rope_dim=meta.rope_dim,
                  norm_eps=meta.norm_eps, n_slots=n_slots, max_context=max_context, kv_dtype=kv_dtype, pages=pages)
    if meta.arch == "gemma3":
        from .gemma3 import Gemma3Block
        return Gemma3Block(w, meta=meta, layer=layer, **common)
    return Block(w, **common)


class Block:
    ring = 0  # Gemma 3's local layers keep a ring per slot instead of pages (engine/gemma3.py)

    def __init__(self, w: dict[str, Weight], *, n_heads: int, n_kv_heads: int, head_dim: int, rope_dim: int,
                 norm_eps: float, n_slots: int, max_context: int, kv_dtype: DType, pages: KVPages) -> None:
        self.w = w
        self.n_heads, self.n_kv_heads, self.head_dim, self.rope_dim = n_heads, n_kv_heads, head_dim, rope_dim
        self.eps = norm_eps
        self.max_context = max_context
        # zeroed without a kernel to schedule; on the CPU their pages stay untouched until a step writes them
        if self.ring:
            shape = (n_slots, n_kv_heads, self.ring, head_dim)
            self.cache_k, self.cache_v = device_zeros(shape, kv_dtype), device_zeros(shape, kv_dtype)
        else:  # the pools: row = block * block_size + position % block_size, the trash block last
            self.block_size = pages.block_size
            shape = ((pages.n_blocks + 1) * pages.block_size, n_kv_heads * head_dim)
            self.pool_k, self.pool_v = device_zeros(shape, kv_dtype), device_zeros(shape, kv_dtype)
            self.kv_table = pages.table  # the stage's, one tensor for every layer
            if pages.cos is not None and type(self) is Block and rope_dim == head_dim:
                self.rope_cos, self.rope_sin = pages.cos, pages.sin

    @property
    def rope_fused(self) -> bool:
        """Whether this layer ropes q/k and writes its pools in one kernel (GPU, llama-style layers)."""
        return getattr(self, "rope_cos", None) is not None and "attn_qkv.weight" in self.w \
            and "attn_q_norm.weight" not in self.w and os.environ.get("MESH_GPU_ROPE_WRITE") != "0"

    @property
    def kv_nbytes(self) -> int:
        return sum(t.nbytes() for t in ((self.cache_k, self.cache_v) if self.ring else (self.pool_k, self.pool_v)))

    def _lin(self, x: Tensor, name: str, **fused) -> Tensor:
        y = self.w[name + ".weight"].matmul_t(x, **fused)
        bias = self.w.get(name + ".bias")
        return y if bias is None else y + bias.value()

    def _norm(self, name: str) -> tuple[Tensor, float]:
        return self.w[name].value(), self.eps

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.rope_dim == self.head_dim:
            return rope(x, cos, sin)
        return rope(x[..., :self.rope_dim], cos, sin).cat(x[..., self.rope_dim:], dim=-1)

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, groups: list[Group], ctx: UOp) -> Tensor:
        N = x.shape[0]
        H, KvH, Hd = self.n_heads, self.n_kv_heads, self.head_dim
        norm = self._norm("attn_norm.weight")  # applied inside the q/k/v matmul
        if self.rope_fused:  # GPU: rope, the pool writes and attention's q in one kernel
            qkv = self._lin(x, "attn_qkv", norm=norm).float()
            runs = [Run(g.col, g.n, g.slot, g.pos) for g in groups]
            q = rope_write_kv(qkv, self.rope_cos, self.rope_sin, self.pool_k, self.pool_v, self.kv_table, runs,
                              self.block_size, H, KvH, Hd)
            attn = paged_attention(q, self.pool_k, self.pool_v, self.kv_table, runs, ctx, self.max_context,
                                   self.block_size, H, KvH, Hd, 1.0 / Hd ** 0.5)
            return self._ffn(self._lin(attn, "attn_output", residual=x))
        if "attn_qkv.weight" in self.w:
            qkv = self._lin(x, "attn_qkv", norm=norm).contiguous()  # (N, (H + 2 KvH) * Hd), once for q, k and v
            q = qkv[:, :H * Hd].reshape(N, H, Hd)
            k = qkv[:, H * Hd:(H + KvH) * Hd].reshape(N, KvH, Hd)
            v = qkv[:, (H + KvH) * Hd:].reshape(N, KvH, Hd)
        else:
            h = rms_norm(x, *norm)  # (N, D)
            q = self._lin(h, "attn_q").reshape(N, H, Hd)
            k = self._lin(h, "attn_k").reshape(N, KvH, Hd)
            v = self._lin(h, "attn_v").reshape(N, KvH, Hd)
        if "attn_q_norm.weight" in self.w:
            q = rms_norm(q, self.w["attn_q_norm.weight"].value(), self.eps)
            k = rms_norm(k, self.w["attn_k_norm.weight"].value(), self.eps)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        # (N, H*Hd), with the CPU's 8-bit output matmul also quantized for it by the attention kernel
        x8 = self.w["attn_output.weight"].takes_x8 and N <= MAX_COLUMNS
        attn, attn8 = self._attention(q, k, v, groups, ctx, 1.0 / Hd ** 0.5, x8)
        return self._ffn(self._lin(attn, "attn_output", residual=x, x8=attn8))

    def _ffn(self, x: Tensor) -> Tensor:
        norm = self._norm("ffn_norm.weight")
        if "ffn_gate_up.weight" in self.w:  # one matmul for gate and up
            gu = self._lin(x, "ffn_gate_up", norm=norm)
            F = gu.shape[1] // 2
            # silu(gate) * up inside ffn_down's kernels (the CPU's 8-bit path: its quantize kernel): a kernel fewer
            if fuse_glu(gu.device) or self.w["ffn_down.weight"].glu_once:
                ff = self._lin(gu, "ffn_down", glu=True, residual=x)
            else:
                ff = self._lin(glu(gu), "ffn_down", residual=x)  # silu(gate) * up (engine/cpu_kernels.py)
        else:
            h = rms_norm(x, *norm)
            ff = self._lin(self._lin(h, "ffn_gate").silu() * self._lin(h, "ffn_up"), "ffn_down", residual=x)
        return ff.contiguous().realize()

    def _attention(self, q: Tensor, k: Tensor, v: Tensor, groups: list[Group], ctx: UOp, scale: float,
                   x8: bool = False) -> tuple[Tensor, X8 | None]:
        """Write every column's k/v (N, KvH, Hd) into its sequence's blocks, then attend with q (N, H, Hd) over each
        column's own positions so far, all columns in one set of kernels; returns (N, H*Hd), and with `x8` that
        quantized for an 8-bit matmul where the attention kernel can (else None). `ctx` is bound to the step's
        longest run end (engine/paged_attention.py)."""
        N, H, KvH, Hd = q.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        W = KvH * Hd
        # q, roped k and v in one kernel: the write and the scores kernel read their parts of it
        qkv = q.reshape(N, H * Hd).cat(k.reshape(N, W), v.reshape(N, W), dim=1).float().contiguous()
        runs = [Run(g.col, g.n, g.slot, g.pos) for g in groups]
        # every column's keys/values first: a later column of the same step may attend to them
        Tensor.realize(*write_kv(self.pool_k, self.pool_v, qkv, self.kv_table, runs, self.block_size, H * Hd,
                                 H * Hd + W))
        args = (qkv, self.pool_k, self.pool_v, self.kv_table, runs, ctx, self.max_context, self.block_size, H, KvH,
                Hd, scale)
        return paged_attention_x8(*args) if x8 else (paged_attention(*args), None)

    # Clearing writes zeros straight into the cache buffers: no kernel to schedule (a kernel per cache and layer cost
    # ~0.1 s of scheduling each, ~6 s of SmolLM2's warmup, which clears every slot once)
    # A paged layer clears nothing: a freed block's stale rows are never read unmasked (engine/paged_attention.py)
    def zero_slot(self, slot: int | UOp) -> None:
        if not self.ring:
            return
        slot = slot.unbind()[1] if isinstance(slot, UOp) else int(slot)
        for c in (self.cache_k, self.cache_v):
            zero_rows(c, slot, slot + 1)

    def reset(self) -> None:
        if not self.ring:
            return
        for c in (self.cache_k, self.cache_v):
            zero_rows(c, 0, c.shape[0])


class Head:
    """Final norm and output projection of the last stage."""

    def __init__(self, norm: Weight, output: Weight, eps: float) -> None:
        self.norm, self.output, self.eps = norm, output, eps

    def __call__(self, x: Tensor) -> Tensor:  # (M, D) -> (M, vocab) float32
        return self.output.matmul_t(x, norm=(self.norm.value(), self.eps)).float().contiguous().realize()
