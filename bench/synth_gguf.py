"""Write a synthetic llama-architecture GGUF of a real model's shape, for speed measurements (not for text).

    .venv/bin/python bench/synth_gguf.py OUT.gguf --shape 8b --type Q4_0
    .venv/bin/python bench/synth_gguf.py OUT.gguf --shape tiny --type Q8_0 --layers 3

Shapes: `1.1b` (TinyLlama: dim 2048, 22 layers, ffn 5632, 32 heads, 4 kv heads, vocab 32000, context 4096), `8b`
(Llama 3 8B: dim 4096, 32 layers, ffn 14336, 32 heads, 8 kv heads, vocab 128256, context 8192), `tiny` (dim 256,
2 layers: a quick check); any dimension can be overridden. Types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K,
F16, F32 (one type for every matrix, embeddings and the untied output.weight included; norms are F32 near 1).

Quantized matrices are random blocks (no quantizer runs: gguf's numpy quantizer would take hours on 8B weights)
whose float16 fields are overwritten with one small scale per type, chosen so that a decoded weight has a standard
deviation of cols^-0.5 and mean ~0 (the `m`/`dmin` fields offset the unsigned quants). Every tensor is generated
and written in chunks of <= 64 MiB, so memory stays bounded whatever the shape. The vocabulary is a `gpt2` BPE
one (pre-tokenizer `gpt-2`): two control tokens, the 256 byte-level symbols, one merge (llama.cpp refuses a gpt2
vocabulary without merges), the rest filler tokens; token types included. Loads in `engine.stage.Stage.load` and
llama.cpp (llama-bench, llama-cpp-python).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, TokenType

SHAPES = {
    "tiny": dict(dim=256, layers=2, ffn=512, heads=4, kv_heads=2, vocab=512, ctx=512, rope_theta=10000.0),
    "1.1b": dict(dim=2048, layers=22, ffn=5632, heads=32, kv_heads=4, vocab=32000, ctx=4096, rope_theta=10000.0),
    "8b": dict(dim=4096, layers=32, ffn=14336, heads=32, kv_heads=8, vocab=128256, ctx=8192, rope_theta=500000.0),
}
# byte offset of each float16 field in a block and its value relative to d (the first field): d itself, or the
# offset that centers the decoded values (Q4_1 m = -8 d; K-quants subtract dmin * min, E[min] = E[scale] = 31.5)
HALFS: dict[int, tuple[tuple[int, float], ...]] = {
    Q.Q8_0: ((0, 1.0),), Q.Q4_0: ((0, 1.0),), Q.Q5_0: ((0, 1.0),),
    Q.Q4_1: ((0, 1.0), (2, -8.0)), Q.Q5_1: ((0, 1.0), (2, -16.0)),
    Q.Q4_K: ((0, 1.0), (2, 7.5)), Q.Q5_K: ((0, 1.0), (2, 15.5)), Q.Q6_K: ((208, 1.0),),
}
CHUNK = 64 << 20


def _unit_std(qtype: Q) -> float:
    """Standard deviation of a decoded value of random blocks with d = 1 (and the matching offset field)."""
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = np.random.default_rng(1).integers(0, 256, size=(512, size), dtype=np.uint8)
    _set_halfs(blocks, qtype, 1.0)
    return float(gguf.quants.dequantize(blocks, qtype).std())


def _set_halfs(blocks: np.ndarray, qtype: Q, d: float) -> None:
    for off, rel in HALFS[qtype]:
        blocks[:, off:off + 2] = np.frombuffer(np.float16(d * rel).tobytes(), np.uint8)


class _Random:
    """Random bytes fast (SFC64's raw output: ~1.7 GB/s here, 20x `Generator.bytes`)."""

    def __init__(self, seed: int) -> None:
        self.bits = np.random.SFC64(seed)

    def bytes(self, n: int) -> np.ndarray:
        return self.bits.random_raw((n + 7) // 8).view(np.uint8)[:n]

    def normal(self, n: int) -> np.ndarray:
        return np.random.Generator(self.bits).standard_normal(n, dtype=np.float32)


def _matrix_chunks(rng: _Random, qtype: Q, rows: int, cols: int, std: float, unit: dict[int, float]):
    """The tensor's bytes, some rows at a time."""
    if qtype in (Q.F32, Q.F16):
        dt = np.float32 if qtype == Q.F32 else np.float16
        step = max(1, CHUNK // (cols * 4))
        for r in range(0, rows, step):
            n = min(step, rows - r)
            yield (rng.normal(n * cols) * std).astype(dt)
        return
    block, size = GGML_QUANT_SIZES[qtype]
    row_blocks = cols // block
    d = std / unit.setdefault(qtype, _unit_std(qtype))
    step = max(1, CHUNK // (row_blocks * size))
    for r in range(0, rows, step):
        n = min(step, rows - r)
        blocks = rng.bytes(n * row_blocks * size).reshape(n * row_blocks, size)
        _set_halfs(blocks, qtype, d)
        yield blocks


def _tensor_bytes(qtype: Q, rows: int, cols: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return rows * cols // block * size


def write_synthetic(path: str | Path, *, dim: int, layers: int, ffn: int, heads: int, kv_heads: int, vocab: int,
                    ctx: int, rope_theta: float, qtype: str = "Q8_0", seed: int = 0, norm_eps: float = 1e-5,
                    log=print) -> Path:
    path = Path(path)
    qt = Q[qtype]
    head_dim = dim // heads
    block = GGML_QUANT_SIZES[qt][0]
    for name, n in (("dim", dim), ("ffn", ffn)):
        if n % block:
            raise SystemExit(f"{name}={n} is not a multiple of {qtype}'s block of {block}")
    if vocab < 260:
        raise SystemExit("vocab must hold at least 260 tokens (2 control, 256 bytes, one merge)")

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"synthetic-{qtype}")
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(norm_eps)
    w.add_vocab_size(vocab)
    w.add_file_type({"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K": 15,
                     "Q5_K": 17, "Q6_K": 18}[qtype])  # llama_ftype: MOSTLY_<type> (llama-bench prints it)
    # tokenizer: byte-level BPE as GPT-2 writes it (bytes_to_unicode), one merge, filler tokens to vocab_size
    byte_syms = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + [chr(c) for c in range(174, 256)]
    byte_syms += [chr(256 + i) for i in range(256 - len(byte_syms))]
    tokens = ["<|bos|>", "<|eos|>"] + byte_syms + ["\u0120\u0120"]
    tokens += [f"<t{i}>" for i in range(vocab - len(tokens))]
    types = [TokenType.CONTROL] * 2 + [TokenType.NORMAL] * (vocab - 2)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["\u0120 \u0120"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)

    plan: list[tuple[str, str, tuple[int, ...], float]] = []  # name, kind, shape, std
    plan.append(("token_embd.weight", "mat", (vocab, dim), 0.05))
    for i in range(layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", "vec", (dim,), 0.1),
                 (b + "attn_q.weight", "mat", (heads * head_dim, dim), dim ** -0.5),
                 (b + "attn_k.weight", "mat", (kv_heads * head_dim, dim), dim ** -0.5),
                 (b + "attn_v.weight", "mat", (kv_heads * head_dim, dim), dim ** -0.5),
                 (b + "attn_output.weight", "mat", (dim, heads * head_dim), (heads * head_dim) ** -0.5),
                 (b + "ffn_norm.weight", "vec", (dim,), 0.1),
                 (b + "ffn_gate.weight", "mat", (ffn, dim), dim ** -0.5),
                 (b + "ffn_up.weight", "mat", (ffn, dim), dim ** -0.5),
                 (b + "ffn_down.weight", "mat", (dim, ffn), ffn ** -0.5)]
    plan += [("output_norm.weight", "vec", (dim,), 0.1), ("output.weight", "mat", (vocab, dim), dim ** -0.5)]
    for name, kind, shape, _ in plan:
        if kind == "vec":
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        elif qt in (Q.F32, Q.F16):
            dt = np.dtype(np.float32 if qt == Q.F32 else np.float16)
            w.add_tensor_info(name, shape, dt, shape[0] * shape[1] * dt.itemsize)
        else:
            nbytes = _tensor_bytes(qt, *shape)
            w.add_tensor_info(name, (shape[0], nbytes // shape[0]), np.dtype(np.uint8), nbytes, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    rng, unit, total, t0 = _Random(seed), {}, 0, time.perf_counter()
    w.write_padding(fout, fout.tell())
    for name, kind, shape, std in plan:
        if kind == "vec":
            data = [(1.0 + std * rng.normal(shape[0])).astype(np.float32)]
        else:
            data = _matrix_chunks(rng, qt, shape[0], shape[1], std, unit)
        n = 0
        for chunk in data:
            chunk.tofile(fout)
            n += chunk.nbytes
        w.write_padding(fout, n)
        total += n
    w.close()
    log(f"{path}: {qtype}, {layers} layers, dim {dim}, ffn {ffn}, vocab {vocab}: {total / 1e9:.2f} GB of tensors "
        f"in {time.perf_counter() - t0:.1f} s")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--type", default="Q8_0", choices=[t for t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K",
                                                                  "Q5_K", "Q6_K", "F16", "F32")])
    for key in ("dim", "layers", "ffn", "heads", "kv_heads", "vocab", "ctx"):
        ap.add_argument("--" + key.replace("_", "-"), type=int, help=f"override the shape's {key}")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    shape = dict(SHAPES[a.shape])
    shape.update({k: v for k in shape if (v := getattr(a, k, None)) is not None})
    write_synthetic(a.out, qtype=a.type, seed=a.seed, **shape)


if __name__ == "__main__":
    main()
