"""SentencePiece vocabularies (`tokenizer.ggml.model = "llama"`) rebuilt on HF `tokenizers`, with llama.cpp's ids.

llama.cpp tokenizes such a vocabulary (Llama 2, Mistral, TinyLlama, Gemma) with SentencePiece's BPE rule: the text
(spaces written as U+2581 "▁") starts as single characters, and the adjacent pair whose joined text is a token with
the highest score is merged, again and again (equal scores: the leftmost pair); a piece that is no token at the end
is written as its UTF-8 bytes (`<0xXX>` tokens). HF's BPE model does the same when its merge list holds every pair
(a, b) whose join a+b is a token, ranked by the score of a+b, and `byte_fallback` is on. Control and user-defined
tokens are cut out of the text first (llama.cpp's special-token partition; HF's added tokens), and with
`add_space_prefix` every piece of text that starts the input or follows such a token gets a leading space, which is
what HF's Prepend normalizer does per piece.

Only where two different pairs join into the same token at two places at once could the two disagree (llama.cpp
takes the leftmost, HF the pair listed first); the golden file and the live comparison in the tests watch for it.
"""
from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers

SPACE = "\u2581"  # SentencePiece's visible space


def spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best merged score first (HF's BPE applies lower ranks first)."""
    vocab = {}
    for i, t in enumerate(tokens):
        vocab[t] = i  # as llama.cpp's text -> id map: a repeated text means its last id
    found: list[tuple[float, int, int, str, str]] = []
    for merged, i in vocab.items():
        score = float(scores[i])
        for at in range(1, len(merged)):
            left, right = merged[:at], merged[at:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[left], vocab[right], left, right))
    found.sort(key=lambda m: m[:3])  # ties in score: the pair of lower ids first, as HF's own converter does
    return [(left, right) for *_, left, right in found]


def build_spm(tokens: Sequence[str], scores: Sequence[float], *, add_space_prefix: bool, unk_id: int | None,
              special: Sequence[int], user_defined: Sequence[int]) -> HFTokenizer:
    """The HF tokenizer for a SentencePiece vocabulary: `special` (control, unknown) and `user_defined` token ids
    are matched in the raw text before the BPE model sees it."""
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores), byte_fallback=True, fuse_unk=False,
                     unk_token=tokens[unk_id] if unk_id is not None else None, ignore_merges=False)
    hf = HFTokenizer(bpe)
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    hf.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined])
    return hf


def spm_piece_bytes(token: str, is_byte: bool) -> bytes:
    """The bytes a SentencePiece token stands for: `<0xXX>` byte tokens their byte, other text with ▁ as a space."""
    if is_byte and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace(SPACE, " ").encode("utf-8")
