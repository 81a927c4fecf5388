"""Write tiny random GGUF models (llama, qwen2, qwen3, gemma3) for tests: a few layers, small dims, any quant type.

    write_tiny_gguf(tmp_path / "m.gguf", arch="qwen2", n_layers=3, qtype="Q4_1") -> Path

Weights are random but scaled so greedy decoding wanders over the vocabulary instead of sticking to one token.
Types `gguf.quants.quantize` cannot produce (the K-quants) are written as random blocks with small scales:
still valid data for a loader to dequantize.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

# byte offsets of the float16 scale fields in K-quant blocks, so random blocks stay finite and small
_K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value, in byte order."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def _encode(x: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype == Q.F32:
        return x.astype(np.float32)
    if qtype == Q.F16:
        return x.astype(np.float16)
    if qtype in _K_SCALES:
        block, size = GGML_QUANT_SIZES[qtype]
        rows = x.reshape(-1, x.shape[-1])
        blocks = rng.integers(0, 256, size=(rows.shape[0], rows.shape[1] // block, size), dtype=np.uint8)
        scale = np.full(1, 2.0 / block, dtype=np.float16).view(np.uint8)
        for off in _K_SCALES[qtype]:
            blocks[:, :, off:off + 2] = scale
        return blocks.reshape(*x.shape[:-1], -1)
    return gguf.quants.quantize(x.astype(np.float32), qtype)


def write_tiny_gguf(
    path: str | Path,
    arch: str = "llama",
    n_layers: int = 4,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn_dim: int = 128,
    vocab_size: int = 256,
    head_dim: int | None = None,
    context_length: int = 512,
    qtype: str = "Q8_0",
    embed_qtype: str | None = None,
    tied_output: bool = True,
    rope_theta: float = 10000.0,
    norm_eps: float = 1e-5,
    seed: int = 0,
    extra_kv: dict[str, Any] | None = None,
    sliding_window: int = 8,
) -> Path:
    """Write a random `arch` model to `path` and return the path. qwen2 gets q/k/v biases, qwen3 q/k norms, gemma3
    q/k norms, post-norms and `sliding_window` (its local layers: 5 of every 6)."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    head_dim = head_dim or dim // n_heads
    wq, we = Q[qtype], Q[embed_qtype or qtype]
    for name, row in (("dim", dim), ("ffn_dim", ffn_dim), ("n_heads*head_dim", n_heads * head_dim)):
        block = GGML_QUANT_SIZES[wq][0]
        if row % block:
            raise ValueError(f"{name}={row} is not a multiple of {qtype}'s block size {block}")

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn_dim)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(norm_eps)
    if arch == "gemma3":
        w.add_sliding_window(sliding_window)
    w.add_vocab_size(vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(vocab_size)])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for key, value in (extra_kv or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, float(value))

    def mat(name: str, rows: int, cols: int, qt: Q, scale: float) -> None:
        data = _encode(rng.standard_normal((rows, cols), dtype=np.float32) * scale, qt, rng)
        w.add_tensor(name, data, raw_dtype=qt)

    def vec(name: str, n: int, center: float, spread: float) -> None:
        w.add_tensor(name, (center + spread * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", vocab_size, dim, we, 0.05)
    for i in range(n_layers):
        b = f"blk.{i}."
        vec(b + "attn_norm.weight", dim, 1.0, 0.1)
        mat(b + "attn_q.weight", n_heads * head_dim, dim, wq, dim ** -0.5)
        mat(b + "attn_k.weight", n_kv_heads * head_dim, dim, wq, dim ** -0.5)
        mat(b + "attn_v.weight", n_kv_heads * head_dim, dim, wq, dim ** -0.5)
        mat(b + "attn_output.weight", dim, n_heads * head_dim, wq, (n_heads * head_dim) ** -0.5)
        if arch == "qwen2":
            vec(b + "attn_q.bias", n_heads * head_dim, 0.0, 0.1)
            vec(b + "attn_k.bias", n_kv_heads * head_dim, 0.0, 0.1)
            vec(b + "attn_v.bias", n_kv_heads * head_dim, 0.0, 0.1)
        if arch in ("qwen3", "gemma3"):
            vec(b + "attn_q_norm.weight", head_dim, 1.0, 0.1)
            vec(b + "attn_k_norm.weight", head_dim, 1.0, 0.1)
        vec(b + "ffn_norm.weight", dim, 1.0, 0.1)
        mat(b + "ffn_gate.weight", ffn_dim, dim, wq, dim ** -0.5)
        mat(b + "ffn_up.weight", ffn_dim, dim, wq, dim ** -0.5)
        mat(b + "ffn_down.weight", dim, ffn_dim, wq, ffn_dim ** -0.5)
        if arch == "gemma3":  # stored as 1 + w, as llama.cpp's converter writes Gemma's norms
            vec(b + "post_attention_norm.weight", dim, 1.0, 0.1)
            vec(b + "post_ffw_norm.weight", dim, 1.0, 0.1)
    vec("output_norm.weight", dim, 1.0, 0.1)
    if not tied_output:
        mat("output.weight", vocab_size, dim, we, dim ** -0.5)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
