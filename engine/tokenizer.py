"""Text to token ids and back, equal to llama.cpp's ids for the same GGUF.

The GGUF carries a byte-level BPE vocabulary, its merges, and the name of the pre-tokenizer (`tokenizer.ggml.pre`)
that llama.cpp selects by that name. We rebuild the same pipeline with the `tokenizers` library: llama.cpp's split
regexes for that name, byte-level mapping, the GGUF's merges, and the control tokens registered as special so that
`<|im_start|>` in the text becomes one id. Only the metadata is read, never the tensors, so this is fast even for a
model of many gigabytes.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from gguf import TokenType
from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as _models
from tokenizers import pre_tokenizers as _pre

from engine.errors import EngineError, ModelFormatError, UnsupportedModel
from engine.gguf_meta import read_metadata
from engine.tokenizer_spm import build_spm, spm_piece_bytes

__all__ = ["Tokenizer", "StreamDecoder", "TokenizerError", "UnsupportedTokenizer", "read_tokenizer_metadata"]


class TokenizerError(EngineError):
    """A token id or a tokenizer setting is invalid."""


class UnsupportedTokenizer(TokenizerError, UnsupportedModel):
    """The GGUF's tokenizer model or pre-tokenizer is one this engine does not reproduce."""


# --- GGUF metadata, tokenizer keys only -------------------------------------------------------------------------


def read_tokenizer_metadata(path: str | Path) -> dict[str, object]:
    """The GGUF's `tokenizer.*` key/value pairs, reading the metadata section only (no tensor table, no weights).

    Arrays come back as Python lists (strings decoded); the other keys' big arrays are skipped by length.
    """
    kv = read_metadata(path, expand=("tokenizer.",))
    return {k: v for k, v in kv.items() if k.startswith("tokenizer.")}


# --- llama.cpp's pre-tokenizers, by the name in tokenizer.ggml.pre ---------------------------------------------

# llama.cpp (src/llama-vocab.cpp) rewrites HF's `(?i:'s|...)` into explicit case classes; same meaning.
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split(pattern: str) -> _pre.PreTokenizer:
    return _pre.Split(Regex(pattern), behavior="isolated", invert=False)


def _byte_level(use_regex: bool) -> _pre.PreTokenizer:
    # use_regex=True applies GPT-2's own split (the regex llama.cpp uses for gpt2/smollm) before the byte mapping
    return _pre.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=use_regex)


@dataclass(frozen=True, slots=True)
class _PreConfig:
    steps: tuple  # builders of the pre-tokenizer sequence
    ignore_merges: bool  # a word already in the vocabulary is one token (llama3 only)
    add_bos_default: bool  # llama.cpp's default when the GGUF lacks add_bos_token


_SMOLLM = _PreConfig((lambda: _split(r"\p{N}"), lambda: _byte_level(True)), False, False)
_LLAMA3 = _PreConfig((lambda: _split(_LLAMA3_SPLIT), lambda: _byte_level(False)), True, True)
_QWEN2 = _PreConfig((lambda: _split(_QWEN2_SPLIT), lambda: _byte_level(False)), False, False)
_GPT2 = _PreConfig((lambda: _byte_level(True),), False, False)

# tokenizer.ggml.pre names, grouped as llama.cpp groups them (same split rule, same merge and BOS defaults)
_PRE: dict[str, _PreConfig] = {
    # every digit alone, then GPT-2's split
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva-7b"), _SMOLLM),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _QWEN2),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "roberta-bpe"), _GPT2),
}


# llama.cpp's list of end-of-generation token texts; any control token with one of these texts ends generation.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>", "<|eom_id|>", "<end_of_turn>",
    "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>", "<|return|>", "<|call|>",
})

# token_type values in tokenizer.ggml.token_type, as plain ints (they are compared once per token)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = (
    int(TokenType.NORMAL), int(TokenType.UNKNOWN), int(TokenType.CONTROL), int(TokenType.USER_DEFINED),
    int(TokenType.UNUSED), int(TokenType.BYTE),
)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-character map, inverted: character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


# tokenizer.ggml.model values: byte-level BPE, and SentencePiece's BPE (engine/tokenizer_spm.py)
MODELS = ("gpt2", "llama")


class Tokenizer:
    """A GGUF's tokenizer (byte-level BPE or SentencePiece), producing llama.cpp's ids."""

    def __init__(
        self,
        *,
        tokens: list[str],
        token_types: list[int],
        merges: list[str] | None = None,
        pre: str = "default",
        bos_id: int | None,
        eos_ids: frozenset[int],
        eos_id: int | None = None,
        add_bos: bool,
        chat_template: str | None,
        name: str = "<memory>",
        model: str = "gpt2",
        scores: list[float] | None = None,
        add_space_prefix: bool = False,
        unk_id: int | None = None,
    ) -> None:
        if model not in MODELS:
            raise UnsupportedTokenizer(f"{name}: tokenizer model {model!r} is not supported (supported: "
                                       f"{', '.join(MODELS)})")
        if model == "gpt2" and pre not in _PRE:
            raise UnsupportedTokenizer(
                f"{name}: pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_PRE))})"
            )
        if len(token_types) != len(tokens):
            raise ModelFormatError(f"{name}: {len(tokens)} tokens but {len(token_types)} token types")
        self.name = name
        self.model = model
        self.pre = pre
        self.vocab_size = len(tokens)
        self.bos_id = bos_id
        self.eos_ids = eos_ids  # every id that ends generation
        self.eos_id = eos_id  # the one the GGUF declares (a chat template's eos_token)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._tokens = tokens
        self._types = token_types
        # llama.cpp cuts these out of the text before tokenizing it: control and unknown tokens as special,
        # user-defined tokens too (they are matched even when special parsing is off)
        special = [i for i, t in enumerate(token_types) if t in (_CONTROL, _UNKNOWN)]
        user = [i for i, t in enumerate(token_types) if t == _USER_DEFINED]
        if model == "llama":
            if scores is None or len(scores) != len(tokens):
                raise ModelFormatError(f"{name}: a SentencePiece vocabulary needs one score per token")
            self._hf = build_spm(tokens, scores, add_space_prefix=add_space_prefix, unk_id=unk_id,
                                 special=special, user_defined=user)
            self._bytes = [tok.encode("utf-8") if t in (_CONTROL, _UNKNOWN) else spm_piece_bytes(tok, t == _BYTE)
                           for tok, t in zip(tokens, token_types)]
            return
        if merges is None:
            raise ModelFormatError(f"{name}: a byte-level BPE vocabulary needs its merges")
        cfg = _PRE[pre]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        pairs = []
        for m in merges:
            at = m.find(" ", 1)  # as llama.cpp: the first token may itself begin with a space
            if at < 0:
                raise ModelFormatError(f"{name}: merge {m!r} is not two tokens separated by a space")
            pairs.append((m[:at], m[at + 1 :]))
        bpe = _models.BPE(vocab=vocab, merges=pairs, ignore_merges=cfg.ignore_merges, fuse_unk=False)
        hf = _HFTokenizer(bpe)
        steps = [make() for make in cfg.steps]
        hf.pre_tokenizer = steps[0] if len(steps) == 1 else _pre.Sequence(steps)
        hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
        hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
        self._hf = hf

        to_byte = _byte_decoder()
        table: list[bytes] = []
        for tok, t in zip(tokens, token_types):
            if t in (_NORMAL, _UNUSED, _BYTE):
                try:
                    table.append(bytes(to_byte[c] for c in tok))
                    continue
                except KeyError:
                    pass  # not byte-level text (a token added verbatim): show it as written
            table.append(tok.encode("utf-8"))
        self._bytes = table

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """Build the tokenizer from a GGUF's metadata; refuses tokenizers llama.cpp would run differently."""
        path = Path(path)
        kv = read_tokenizer_metadata(path)
        model = kv.get("tokenizer.ggml.model")
        if model is None:
            raise ModelFormatError(f"{path}: GGUF has no tokenizer (tokenizer.ggml.model missing)")
        if model not in MODELS:
            raise UnsupportedTokenizer(f"{path}: tokenizer model {model!r} is not supported (supported: "
                                       f"{', '.join(MODELS)}: byte-level BPE and SentencePiece)")
        pre = kv.get("tokenizer.ggml.pre", "default")
        if model == "gpt2" and pre not in _PRE:
            raise UnsupportedTokenizer(
                f"{path}: pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_PRE))})"
            )
        needed = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges" if model == "gpt2" else "tokenizer.ggml.scores")
        for key in needed:
            if not isinstance(kv.get(key), list):
                raise ModelFormatError(f"{path}: GGUF lacks {key}")
        tokens: list[str] = kv["tokenizer.ggml.tokens"]  # type: ignore[assignment]
        types = kv.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)

        def token_id(key: str) -> int | None:
            v = kv.get(key)
            if v is None:
                return None
            if not isinstance(v, int) or not 0 <= v < len(tokens):
                raise ModelFormatError(f"{path}: {key} = {v!r} is not a token id below {len(tokens)}")
            return v

        spm = model == "llama"
        bos = token_id("tokenizer.ggml.bos_token_id")
        declared_eos = token_id("tokenizer.ggml.eos_token_id")
        if spm:  # llama.cpp's defaults for a SentencePiece vocabulary that does not name them
            bos = 1 if bos is None and len(tokens) > 1 else bos
            declared_eos = 2 if declared_eos is None and len(tokens) > 2 else declared_eos
        # end of generation: the declared eos/eot/eom ids plus every control token llama.cpp treats as one
        eos = {i for k in ("eos", "eot", "eom") if (i := token_id(f"tokenizer.ggml.{k}_token_id")) is not None}
        eos |= {i for i, (tok, t) in enumerate(zip(tokens, types)) if t == _CONTROL and tok in EOG_TEXTS}
        if declared_eos is not None:
            eos.add(declared_eos)
        add_bos = kv.get("tokenizer.ggml.add_bos_token", True if spm else _PRE[pre].add_bos_default)
        template = kv.get("tokenizer.chat_template")
        return cls(
            tokens=tokens,
            token_types=list(types),  # type: ignore[arg-type]
            merges=kv.get("tokenizer.ggml.merges"),  # type: ignore[arg-type]
            pre=pre,  # type: ignore[arg-type]
            model=model,  # type: ignore[arg-type]
            scores=kv.get("tokenizer.ggml.scores"),  # type: ignore[arg-type]
            # llama.cpp: a SentencePiece vocabulary writes a space before the text unless the GGUF says not to
            add_space_prefix=bool(kv.get("tokenizer.ggml.add_space_prefix", True)) if spm else False,
            unk_id=token_id("tokenizer.ggml.unknown_token_id") if spm else None,
            bos_id=bos,
            eos_ids=frozenset(eos),
            eos_id=declared_eos,
            add_bos=bool(add_bos) and bos is not None,
            chat_template=template if isinstance(template, str) else None,
            name=str(path),
        )

    def encode(self, text: str) -> list[int]:
        """Token ids for `text`; special-token text is parsed as special; BOS only if the GGUF asks for it."""
        ids = self._hf.encode(text, add_special_tokens=False).ids
        # a chat template that writes the BOS text itself must not end up with two
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (control tokens: their text); may be part of a UTF-8 character."""
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"{self.name}: token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return self._bytes[token_id]

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as written in the GGUF (byte-level characters for ordinary tokens)."""
        self.token_bytes(token_id)  # range check
        return self._tokens[token_id]

    def is_control(self, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size and self._types[token_id] == _CONTROL

    def control_tokens(self) -> dict[str, int]:
        """Text -> id of every control token."""
        return {tok: i for i, (tok, t) in enumerate(zip(self._tokens, self._types)) if t == _CONTROL}

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, control tokens written out; bytes that are not valid UTF-8 become U+FFFD."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, pre={self.pre!r}, vocab_size={self.vocab_size})"


class StreamDecoder:
    """Turns a stream of token ids into text without ever splitting a UTF-8 character.

    Byte-level tokens can end in the middle of a multi-byte character (an emoji is often 2-4 tokens); the incomplete
    tail waits for the next token. Invalid sequences become U+FFFD, as in `Tokenizer.decode`.
    """

    __slots__ = ("_tok", "_utf8")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """The text completed by this token (possibly empty)."""
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is pending at the end of the stream (an unfinished character becomes U+FFFD); then reset."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out
