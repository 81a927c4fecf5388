"""Gemma 3's transformer block, after llama.cpp's graph for `gemma3` (src/models/gemma3.cpp, the sliding-window
variant; hyperparameters from src/llama-model.cpp):

    h = x + post_attention_norm(attn_output(attention(rope(k_norm(k)), rope(q_norm(q)) * attn_scale, v)))
    out = h + post_ffw_norm(ffn_down(gelu_tanh(ffn_gate(ffn_norm(h))) * ffn_up(ffn_norm(h))))

with q/k/v from attn_norm(x). Of every 6 layers the first 5 are local: they attend to the last `sliding_window`
positions (the query's own included: llama.cpp masks a key when query_pos - key_pos >= window) with rope base 10000;
the 6th is global, with the GGUF's rope base. The weights are the same resident GGUF blocks as every other
architecture's (Weight.matmul_t, with the input's RMS norm fused into the q/k/v and gate/up matmuls).

A local layer keeps only a ring of positions per slot, so a long context costs memory on the global layers alone.
Position p lives at ring index p % ring. The ring holds `sliding_window + slack` positions, the slack being the
most columns one step writes into a slot (a prefill chunk): a step's keys are written before it attends, and its
first query still needs the `sliding_window - 1` positions before it, which the step's own writes must not
overwrite. Ring index j holds, for a query at position q, the position q - d with d = (q - j) mod ring; the key is
visible when d < sliding_window and d <= q (q - d >= 0: written). Rolled-back positions (speculative decoding)
are never visible as long as the rollback is at most `slack` positions (Stage.rollback checks it).
"""
from __future__ import annotations

from tinygrad import Tensor, UOp
from tinygrad.dtype import DType

from .cpu_kernels import gelu_glu
from .errors import EngineError
from .gguf_meta import ModelMeta
from .loader import Weight, rms_norm
from .model import Block, Group, KVPages
from .quant_gemm import MAX_COLUMNS

# the most columns one step writes into one slot of a local layer: the prefill chunk sizes (engine/stage.py
# PREFILL_BUCKETS) must not exceed it. The ring of a local layer is sliding_window + RING_SLACK positions.
RING_SLACK = 64


class Gemma3Block(Block):
    def __init__(self, w: dict[str, Weight], *, meta: ModelMeta, layer: int, n_heads: int, n_kv_heads: int,
                 head_dim: int, rope_dim: int, norm_eps: float, n_slots: int, max_context: int,
                 kv_dtype: DType, pages: KVPages) -> None:
        # the layer's kind, from its absolute index: plain attributes, so layers of one kind share compiled kernels
        self.sliding_window = meta.sliding_window if meta.is_sliding(layer) else 0
        self.rope_table = 1 if self.sliding_window else 0  # engine/model.py rope_inputs: 1 is the local base
        self.attn_scale = meta.attn_scale
        # a ring when the window is shorter than the context (no ring: the window never hides a position); a
        # context of at most window + slack positions is a ring that never wraps
        self.ring = min(max_context, self.sliding_window + RING_SLACK) if 0 < self.sliding_window < max_context else 0
        self.wraps = 0 < self.ring < max_context  # positions overwrite older ones: steps and rollbacks are bounded
        # a ring keeps its own per-slot layout (the step writes it with a `where` over the ring); a global layer,
        # or a local one whose window covers the context, takes the stage's paged pools like any other model's
        super().__init__(w, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, rope_dim=rope_dim,
                         norm_eps=norm_eps, n_slots=n_slots, max_context=max_context, kv_dtype=kv_dtype, pages=pages)

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, groups: list[Group], ctx: UOp) -> Tensor:
        N = x.shape[0]
        H, KvH, Hd = self.n_heads, self.n_kv_heads, self.head_dim
        half = self.rope_dim // 2
        cos = cos[..., self.rope_table * half:(self.rope_table + 1) * half]
        sin = sin[..., self.rope_table * half:(self.rope_table + 1) * half]
        norm = self._norm("attn_norm.weight")
        if "attn_qkv.weight" in self.w:
            qkv = self._lin(x, "attn_qkv", norm=norm).contiguous()
            q = qkv[:, :H * Hd].reshape(N, H, Hd)
            k = qkv[:, H * Hd:(H + KvH) * Hd].reshape(N, KvH, Hd)
            v = qkv[:, (H + KvH) * Hd:].reshape(N, KvH, Hd)
        else:  # q, k and v stored as different block types cannot share one matmul
            h = rms_norm(x, *norm)
            q = self._lin(h, "attn_q").reshape(N, H, Hd)
            k = self._lin(h, "attn_k").reshape(N, KvH, Hd)
            v = self._lin(h, "attn_v").reshape(N, KvH, Hd)
        q = rms_norm(q, self.w["attn_q_norm.weight"].value(), self.eps)
        k = rms_norm(k, self.w["attn_k_norm.weight"].value(), self.eps)
        # llama.cpp scales the query after rope and then attends with scale 1
        q = self._rope(q, cos, sin) * self.attn_scale
        k = self._rope(k, cos, sin)
        attn8 = None
        if self.ring:
            attn = self._ring_attention(q, k, v, groups)
        else:  # a global layer, or a local one whose window covers the whole context
            x8 = self.w["attn_output.weight"].takes_x8 and N <= MAX_COLUMNS
            attn, attn8 = self._attention(q, k, v, groups, ctx, 1.0, x8)

        # the post-norms sit between each sublayer and its residual add, so the add stays out of the matmul
        a = self._lin(attn, "attn_output", x8=attn8)
        x = (rms_norm(a, self.w["post_attention_norm.weight"].value(), self.eps) + x).contiguous()
        norm = self._norm("ffn_norm.weight")
        if "ffn_gate_up.weight" in self.w:
            gu = self._lin(x, "ffn_gate_up", norm=norm)
            gated = gelu_glu(gu)    # gelu(gate) * up; its own kernel on the CPU (engine/cpu_kernels.py)
        else:
            h = rms_norm(x, *norm)
            gated = self._lin(h, "ffn_gate").gelu() * self._lin(h, "ffn_up")
        ff = self._lin(gated.contiguous(), "ffn_down")
        return (rms_norm(ff, self.w["post_ffw_norm.weight"].value(), self.eps) + x).contiguous().realize()

    def _ring_attention(self, q: Tensor, k: Tensor, v: Tensor, groups: list[Group]) -> Tensor:
        """Attention of a local layer over its ring (see the module docstring); returns (N, H*Hd)."""
        H, KvH, Hd, R, W = self.n_heads, self.n_kv_heads, self.head_dim, self.ring, self.sliding_window
        q = q.contiguous().realize()
        j = Tensor.arange(R)
        writes = []
        for g in groups:
            if self.wraps and g.n > R - W + 1:
                raise EngineError(f"a step of {g.n} columns in one slot exceeds the sliding-window ring's slack "
                                  f"({R - W + 1} columns; engine/gemma3.py RING_SLACK)")
            # ring index j receives column t = (j - pos) mod R of this step when t < n
            t = (j + (R - g.pos % R)) % R  # (R,)
            hit = (t < g.n).reshape(1, 1, R, 1)
            pick = (t.reshape(R, 1) == Tensor.arange(g.n).reshape(1, g.n)).reshape(1, R, g.n, 1)
            for cache, new in ((self.cache_k, k), (self.cache_v, v)):
                rows = new[g.col:g.col + g.n].permute(1, 0, 2).reshape(KvH, 1, g.n, Hd)
                fresh = pick.where(rows, 0.0).sum(2).reshape(1, KvH, R, Hd).cast(cache.dtype)  # exact: one term
                slot = cache[g.slot:g.slot + 1]
                writes.append(slot.assign(hit.where(fresh, slot)))
        Tensor.realize(*writes)

        outs = []
        for g in groups:
            keys = self.cache_k[g.slot:g.slot + 1].reshape(KvH, 1, R, Hd).float()
            vals = self.cache_v[g.slot:g.slot + 1].reshape(KvH, 1, R, Hd).float()
            qg = q[g.col:g.col + g.n].reshape(g.n, KvH, H // KvH, Hd).permute(1, 2, 0, 3)  # (KvH, G, n, Hd)
            att = qg @ keys.transpose(-1, -2)  # (KvH, G, n, R); the query is already scaled
            qpos = (Tensor.arange(g.n) + g.pos).reshape(g.n, 1)
            d = (qpos - j.reshape(1, R) + R) % R  # how far back from the query ring index j's position lies
            visible = (d < W) & (d <= qpos)
            att = visible.where(att, float("-inf"))
            o = att.softmax(-1) @ vals  # (KvH, G, n, Hd)
            outs.append(o.permute(2, 0, 1, 3).reshape(g.n, H * Hd))
        return outs[0] if len(outs) == 1 else outs[0].cat(*outs[1:], dim=0)
