"""SentencePiece vocabularies: our ids equal llama.cpp's, against the stored golden file (Gemma 3's 262k vocabulary,
as is and with the Llama 2 / Mistral space-prefix rule), against live llama.cpp when installed, and on a tiny
vocabulary whose merges can be followed by hand."""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from engine.tokenizer import StreamDecoder, Tokenizer, read_tokenizer_metadata
from tests.gemma_model import gemma3_path, gemma3_tokenizer

GOLDEN = Path(__file__).parent / "data" / "gemma3_tokenizer_golden.json"

# token types as GGUF writes them
NORMAL, UNKNOWN, CONTROL, USER, BYTE = 1, 2, 3, 4, 6


def tiny(add_space_prefix: bool = False) -> Tokenizer:
    """A hand-made vocabulary: bytes, a few pieces with scores, a control and a user-defined token."""
    pieces = {"▁": -5.0, "a": -1.0, "b": -2.0, "c": -3.0, "ab": -10.0, "bc": -4.0, "▁a": -6.0}
    tokens = ["<unk>", "<s>", "</s>", "<ctl>", "<ud>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    types = [UNKNOWN, CONTROL, CONTROL, CONTROL, USER] + [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = [0.0] * (5 + 256) + list(pieces.values())
    return Tokenizer(tokens=tokens, token_types=types, model="llama", scores=scores, bos_id=1, eos_ids=frozenset({2}),
                     add_bos=True, chat_template=None, add_space_prefix=add_space_prefix, unk_id=0, name="tiny")


def ids_of(tok: Tokenizer, *texts: str) -> list[int]:
    return [tok.encode(t)[1:] for t in texts] if len(texts) > 1 else tok.encode(texts[0])[1:]


def test_tiny_merges_follow_scores_and_fall_back_to_bytes():
    tok = tiny()
    v = {tok.token_text(i): i for i in range(tok.vocab_size)}
    # "abc": "bc" (-4) beats "ab" (-10); then "a"+"bc" is no token, so a, bc
    assert ids_of(tok, "abc") == [v["a"], v["bc"]]
    assert ids_of(tok, "ab") == [v["ab"]]
    # a space is the piece ▁ and merges with a following a (-6); no space prefix for this vocabulary
    assert ids_of(tok, " a") == [v["▁a"]]
    assert ids_of(tok, "a") == [v["a"]]
    # é is not in the vocabulary: its two UTF-8 bytes
    assert ids_of(tok, "é") == [v["<0xC3>"], v["<0xA9>"]]
    # control and user-defined tokens are cut out of the text first
    assert ids_of(tok, "a<ctl>b<ud>c") == [v["a"], v["<ctl>"], v["b"], v["<ud>"], v["c"]]
    assert tok.encode("") == [1]  # BOS alone, as llama.cpp
    assert tok.encode("<s>a") == [1, v["a"]]  # a BOS written by a template is not doubled


def test_tiny_space_prefix_after_every_special_token():
    tok = tiny(add_space_prefix=True)
    v = {tok.token_text(i): i for i in range(tok.vocab_size)}
    assert ids_of(tok, "a") == [v["▁a"]]
    assert ids_of(tok, "a<ctl>a") == [v["▁a"], v["<ctl>"], v["▁a"]]


def test_tiny_decode_writes_spaces_and_bytes():
    tok = tiny()
    ids = ids_of(tok, " abc é")
    assert tok.decode(ids) == " abc é"
    dec = StreamDecoder(tok)
    assert "".join(dec.feed(i) for i in ids) + dec.flush() == " abc é"


def test_sentencepiece_needs_scores():
    with pytest.raises(Exception, match="score"):
        Tokenizer(tokens=["a"], token_types=[NORMAL], model="llama", bos_id=None, eos_ids=frozenset(),
                  add_bos=False, chat_template=None)


# --- Gemma 3's vocabulary against llama.cpp ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma():
    path = gemma3_path()
    data = json.loads(GOLDEN.read_text(encoding="utf-8"))
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    assert h.hexdigest() == data["model_sha256"], f"{GOLDEN.name} was made for another file; rerun " \
                                                  "bench/make_tokenizer_golden.py --gemma"
    return path, data, gemma3_tokenizer()


def test_golden_corpus_is_varied(gemma):
    _, data, _ = gemma
    joined = "".join(c["text"] for c in data["cases"]["spm"])
    assert len(data["cases"]["spm"]) >= 50
    assert any(ord(ch) > 0xFFFF for ch in joined) and "  " in joined and "\r\n" in joined and "\t" in joined
    assert "1234567890" in joined and "<start_of_turn>" in joined and "def f(x)" in joined


def test_gemma3_ids_equal_llama_cpp_golden(gemma):
    path, data, tok = gemma
    assert tok.model == "llama" and tok.add_bos and tok.bos_id == 2
    for case in data["cases"]["spm"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]


def test_space_prefix_rule_equals_llama_cpp_golden(gemma):
    path, data, _ = gemma
    kv = read_tokenizer_metadata(path)
    tok = Tokenizer(tokens=kv["tokenizer.ggml.tokens"], token_types=kv["tokenizer.ggml.token_type"], model="llama",
                    scores=kv["tokenizer.ggml.scores"], bos_id=2, eos_ids=frozenset({1}), add_bos=True,
                    chat_template=None, add_space_prefix=True, unk_id=3, name="Gemma 3 vocabulary, space prefix")
    for case in data["cases"]["spm-space-prefix"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]


def test_gemma3_metadata(gemma):
    _, _, tok = gemma
    assert tok.chat_template is None  # this GGUF carries none: prompts go raw (engine/chat.py says so)
    assert tok.token_text(1) == "<eos>" and {1, 106} <= tok.eos_ids  # <end_of_turn> ends generation too
    assert tok.decode(tok.encode("Hello  world\n\nx")) == "<bos>Hello  world\n\nx"


def random_corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pools = ["abcxyzABC", "0123456789", " ", "  \t", "\n\r", ".,;:!?-_'\"()[]{}<>/\\@#$%^&*+=|~`", "éüßçñ",
             "αβγЖЗИ", "日本語中文한국", "🙂👍🏽🇫🇷✨", "\u200b\u00a0\u3000▁"]
    out = []
    for _ in range(n):
        parts = ["".join(rng.choice(p) for _ in range(rng.randint(1, 6))) for p in rng.choices(pools, k=8)]
        if rng.random() < 0.3:
            parts.insert(rng.randint(0, len(parts)), rng.choice(["<start_of_turn>", "<end_of_turn>", "<eos>", "\n\n"]))
        out.append("".join(parts))
    return out


def test_gemma3_ids_equal_live_llama_cpp_on_random_text(gemma):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (golden file still ran)")
    path, _, tok = gemma
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in random_corpus(300, seed=11):
        assert tok.encode(text) == llm.tokenize(text.encode("utf-8"), add_bos=True, special=True), repr(text)


def test_mistral_style_gguf_uses_llama_cpp_defaults(tmp_path):
    """A llama-architecture GGUF with a SentencePiece vocabulary (Llama 2, Mistral, TinyLlama) that names neither
    add_bos_token nor add_space_prefix: llama.cpp's defaults for such a vocabulary, BOS and a space prefix."""
    from gguf import GGUFWriter

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "h", "i", "hi", "▁hi"]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * 5
    w = GGUFWriter(str(tmp_path / "mistral.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_gguf(tmp_path / "mistral.gguf")
    assert tok.model == "llama" and tok.add_bos and tok.eos_ids == frozenset({2})
    assert tok.encode("hi") == [1, tokens.index("▁hi")]
    assert tok.encode("hi</s>hi") == [1, tokens.index("▁hi"), 2, tokens.index("▁hi")]
