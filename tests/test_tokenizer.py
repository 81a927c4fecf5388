"""Tokenizer: GGUF metadata reading, llama.cpp's pre-tokenizers, special tokens, bytes, streaming decode.

Equality with llama.cpp's ids on SmolLM2 is in test_tokenizer_golden.py; here tiny synthetic GGUFs pin down each
pre-tokenizer's splitting rule, and the real SmolLM2 file checks the properties that need a real vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFWriter
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import EngineError, ModelFormatError, UnsupportedModel
from engine.sources import default_model_path
from engine.tokenizer import StreamDecoder, Tokenizer, TokenizerError, UnsupportedTokenizer, read_tokenizer_metadata
from tests.tiny_gguf import byte_chars

SMOLLM2 = default_model_path()


def write_tiny_gguf(
    path: Path,
    *,
    pre: str | None = "qwen2",
    model: str = "gpt2",
    merges: tuple[str, ...] = ("h i",),
    extra: tuple[str, ...] = ("hi",),
    control: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    user_defined: tuple[str, ...] = (),
    bos: str | None = None,
    eos: str | None = "<|im_end|>",
    add_bos: bool | None = None,
    template: str | None = None,
) -> Path:
    """A metadata-only GGUF: all 256 byte tokens, the merged tokens `extra`, then control and user tokens."""
    tokens = byte_chars() + list(extra) + list(control) + list(user_defined)
    types = [1] * (256 + len(extra)) + [3] * len(control) + [4] * len(user_defined)
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(merges))
    if bos is not None:
        w.add_bos_token_id(tokens.index(bos))
    if eos is not None:
        w.add_eos_token_id(tokens.index(eos))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


DIGITS = dict(merges=("Ġ 1", "1 2", "12 3", "4 5"), extra=("Ġ1", "12", "123", "45"))


def pieces(tok: Tokenizer, text: str) -> list[bytes]:
    return [tok.token_bytes(i) for i in tok.encode(text)]


# --- pre-tokenizers, one rule each ------------------------------------------------------------------------------

def test_smollm_splits_every_digit(tmp_path):
    tok = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "t.gguf", pre="smollm", **DIGITS))
    assert pieces(tok, "12345") == [b"1", b"2", b"3", b"4", b"5"]


def test_llama_bpe_groups_digits_by_three(tmp_path):
    tok = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "t.gguf", pre="llama-bpe", **DIGITS))
    assert pieces(tok, "12345") == [b"123", b"45"]


def test_qwen2_splits_every_digit_but_keeps_the_space_apart(tmp_path):
    tok = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "t.gguf", pre="qwen2", **DIGITS))
    assert pieces(tok, " 12") == [b" ", b"1", b"2"]


def test_gpt2_keeps_a_digit_run_with_its_leading_space(tmp_path):
    tok = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "t.gguf", pre="gpt-2", **DIGITS))
    assert pieces(tok, " 12345") == [b" 1", b"2", b"3", b"45"]


def test_llama_bpe_takes_whole_words_from_the_vocabulary(tmp_path):
    # llama3 ignores merges for a word that is itself a token; the others build it from merges only
    kw = dict(merges=("a b",), extra=("ab", "abc"))
    llama = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "l.gguf", pre="llama-bpe", **kw))
    qwen = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "q.gguf", pre="qwen2", **kw))
    assert pieces(llama, "abc") == [b"abc"]
    assert pieces(qwen, "abc") == [b"ab", b"c"]


def test_contractions_split_like_llama_cpp(tmp_path):
    kw = dict(merges=("t '", "' S"), extra=("t'", "'S"))
    llama = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "l.gguf", pre="llama-bpe", **kw))
    gpt2 = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "g.gguf", pre="gpt-2", **kw))
    # the apostrophe never merges backwards into the word; llama3's rule knows upper-case 'S, GPT-2's does not
    assert pieces(llama, "it'S") == [b"i", b"t", b"'S"]
    assert pieces(gpt2, "it'S") == [b"i", b"t", b"'", b"S"]


# --- special tokens, BOS -----------------------------------------------------------------------------------------

def test_control_and_user_defined_tokens_are_single_ids(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", user_defined=("<tool>",))
    tok = Tokenizer.from_gguf(path)
    ids = tok.encode("<|im_start|>hi<tool><|im_end|>")
    assert tok.decode(ids) == "<|im_start|>hi<tool><|im_end|>"
    assert [tok.token_text(ids[0]), tok.token_text(ids[-2]), tok.token_text(ids[-1])] == [
        "<|im_start|>", "<tool>", "<|im_end|>"
    ]
    assert tok.is_control(ids[0]) and not tok.is_control(ids[-2])


def test_eos_ids_are_declared_eos_plus_end_of_generation_controls(tmp_path):
    tok = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "t.gguf"))
    controls = tok.control_tokens()
    assert tok.eos_ids == frozenset({controls["<|im_end|>"], controls["<|endoftext|>"]})


def test_bos_added_only_when_asked_and_never_twice(tmp_path):
    ctl = ("<|begin_of_text|>", "<|eot_id|>")
    yes = Tokenizer.from_gguf(
        write_tiny_gguf(tmp_path / "y.gguf", pre="llama-bpe", control=ctl, bos=ctl[0], eos=ctl[1])
    )
    bos = yes.bos_id
    assert yes.add_bos  # llama.cpp's default for llama-bpe when the GGUF does not say
    assert yes.encode("a")[0] == bos and len(yes.encode("a")) == 2
    assert yes.encode("<|begin_of_text|>a").count(bos) == 1
    no = Tokenizer.from_gguf(
        write_tiny_gguf(tmp_path / "n.gguf", pre="llama-bpe", control=ctl, bos=ctl[0], eos=ctl[1], add_bos=False)
    )
    assert no.encode("a") == [ord("a")]  # byte tokens come first, in byte order


# --- refusals and malformed files ----------------------------------------------------------------------------------

def test_unigram_model_is_refused_naming_file_and_tokenizer(tmp_path):
    # SentencePiece's BPE ('llama') is supported (tests/test_tokenizer_spm.py); its unigram model ('t5') is not
    path = write_tiny_gguf(tmp_path / "ugm.gguf", model="t5")
    with pytest.raises(UnsupportedTokenizer, match=r"ugm\.gguf: tokenizer model 't5'"):
        Tokenizer.from_gguf(path)


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "ds.gguf", pre="deepseek-coder")
    with pytest.raises(UnsupportedTokenizer, match=r"ds\.gguf: pre-tokenizer 'deepseek-coder'") as info:
        Tokenizer.from_gguf(path)
    assert isinstance(info.value, UnsupportedModel) and isinstance(info.value, EngineError)


def test_missing_pre_means_llama_cpp_default_which_is_refused(tmp_path):
    with pytest.raises(UnsupportedTokenizer, match="'default'"):
        Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "t.gguf", pre=None))


def test_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelFormatError, match=r"x\.gguf: not a GGUF file"):
        Tokenizer.from_gguf(tmp_path / "x.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelFormatError, match=r"empty\.gguf"):
        Tokenizer.from_gguf(tmp_path / "empty.gguf")


def test_truncated_metadata_is_a_format_error(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match="truncated"):
        read_tokenizer_metadata(path)


def test_token_id_out_of_range(tmp_path):
    tok = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "t.gguf"))
    with pytest.raises(TokenizerError, match=f"token id {tok.vocab_size} is outside the vocabulary"):
        tok.token_bytes(tok.vocab_size)
    with pytest.raises(TokenizerError):
        tok.decode([-1])


# --- the real SmolLM2 vocabulary -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(SMOLLM2)




def test_smollm2_metadata(smol):
    assert smol.vocab_size == 49152 and smol.pre == "smollm"
    assert smol.bos_id == 1 and not smol.add_bos
    assert smol.eos_ids == frozenset({0, 2})  # <|endoftext|>, <|im_end|>
    assert smol.chat_template is not None and "<|im_start|>" in smol.chat_template


ROUNDTRIP = [
    "Hello, world!", "  leading and trailing  ", "tabs\tand\nnewlines\r\n\n", "numbers 1234567890 3.14159",
    "I'm sure they'll've done it", "naïve café, Straße, Ελληνικά, русский", "日本語のテキスト 中文 한국어",
    "emoji 🙂👍🏽🇫🇷 family 👨‍👩‍👧", "<|im_start|>user\nhi<|im_end|>\n", "\u200b zero width \ufeff bom",
]


@pytest.mark.parametrize("text", ROUNDTRIP)
def test_smollm2_decode_inverts_encode(smol, text):
    assert smol.decode(smol.encode(text)) == text


def test_token_bytes_are_raw_bytes(smol):
    space_the = smol.encode(" the")
    assert len(space_the) == 1 and smol.token_bytes(space_the[0]) == b" the"
    assert smol.token_bytes(2) == b"<|im_end|>"


# --- streaming decode ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["🙂👍🏽 ok", "日本語 漢字", "a€b𝄞c", "mixed ascii 🇫🇷 and CJK 中"])
def test_stream_decoder_never_splits_a_character(smol, text):
    ids = smol.encode(text)
    split = [i for i in ids if not _is_utf8(smol.token_bytes(i))]
    assert split, "corpus must contain tokens that hold part of a character"
    dec = StreamDecoder(smol)
    parts = [dec.feed(i) for i in ids]
    assert "".join(parts) + dec.flush() == text
    assert all("\ufffd" not in p for p in parts)
    assert "" in parts  # some token completed no character and produced nothing


def test_stream_decoder_flushes_an_unfinished_character(smol):
    ids = smol.encode("🙂")
    assert len(ids) > 1
    dec = StreamDecoder(smol)
    assert dec.feed(ids[0]) == ""
    assert dec.flush() == "\ufffd"
    assert "".join(dec.feed(i) for i in ids) == "🙂"  # usable again after flush


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), max_size=40))
def test_stream_decoder_agrees_with_decode_on_any_ids(smol, ids):
    # valid or not, streamed text equals decoding all at once (U+FFFD in the same places)
    dec = StreamDecoder(smol)
    assert "".join(dec.feed(i) for i in ids) + dec.flush() == smol.decode(ids)
