"""Our token ids equal llama.cpp's: against the stored golden file always, against live llama.cpp when installed.

The golden file is written by bench/make_tokenizer_golden.py with llama-cpp-python. Its cases cover SmolLM2's own
pre-tokenizer and, with the same vocabulary, the other pre-tokenizers we support.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from engine.sources import default_model_path
from engine.tokenizer import Tokenizer, read_tokenizer_metadata

GOLDEN = Path(__file__).parent / "data" / "smollm2_tokenizer_golden.json"
SMOLLM2 = default_model_path()


@pytest.fixture(scope="module")
def golden() -> dict:
    data = json.loads(GOLDEN.read_text(encoding="utf-8"))
    h = hashlib.sha256()
    with open(SMOLLM2, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    assert h.hexdigest() == data["model_sha256"], (
        f"{GOLDEN.name} was made for another {data['model']}; rerun bench/make_tokenizer_golden.py"
    )
    return data


def tokenizer_with_pre(pre: str) -> Tokenizer:
    kv = read_tokenizer_metadata(SMOLLM2)
    return Tokenizer(
        tokens=kv["tokenizer.ggml.tokens"], token_types=kv["tokenizer.ggml.token_type"],
        merges=kv["tokenizer.ggml.merges"], pre=pre, bos_id=None, eos_ids=frozenset(), add_bos=False,
        chat_template=None, name=f"SmolLM2 vocabulary as {pre}",
    )


def test_golden_corpus_is_varied(golden):
    texts = [c["text"] for c in golden["cases"]["smollm"]]
    assert len(texts) >= 40
    joined = "".join(texts)
    assert any(ord(ch) > 0xFFFF for ch in joined)  # astral plane (emoji)
    assert "  " in joined and "\r\n" in joined and "\t" in joined
    assert "1234567890" in joined and "'ll" in joined and "<|im_start|>" in joined


def test_smollm2_ids_equal_llama_cpp_golden(golden):
    tok = Tokenizer.from_gguf(SMOLLM2)
    for case in golden["cases"]["smollm"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_other_pre_tokenizers_equal_llama_cpp_golden(golden, pre):
    tok = tokenizer_with_pre(pre)
    for case in golden["cases"][pre]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]


# --- live llama.cpp (optional) ------------------------------------------------------------------------------------

def random_corpus(n: int, seed: int) -> list[str]:
    """Strings mixing the character classes the split rules treat differently."""
    rng = random.Random(seed)
    pools = [
        "abcxyzABCXYZ", "0123456789", " ", "  \t", "\n\r", ".,;:!?-_'\"()[]{}<>/\\@#$%^&*+=|~`",
        "éüßçñåøæ", "αβγδЖЗИЙ", "日本語中文한국", "🙂👍🏽🇫🇷✨", "٣٤٥½¾²", "\u200b\u00a0\u3000",
        "'s'S'll'LL'd'm've're't",
    ]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            pool = rng.choice(pools)
            parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 5))))
        if rng.random() < 0.2:
            parts.insert(rng.randint(0, len(parts)), rng.choice(["<|im_start|>", "<|im_end|>", "<|endoftext|>"]))
        out.append("".join(parts))
    return out


def test_smollm2_ids_equal_live_llama_cpp_on_random_text(golden):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (golden file still ran)")
    llm = llama_cpp.Llama(model_path=str(SMOLLM2), vocab_only=True, verbose=False)
    tok = Tokenizer.from_gguf(SMOLLM2)
    texts = [c["text"] for c in golden["cases"]["smollm"]] + random_corpus(300, seed=7)
    for text in texts:
        assert tok.encode(text) == llm.tokenize(text.encode("utf-8"), add_bos=False, special=True), repr(text)
