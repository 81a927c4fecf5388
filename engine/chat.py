"""Chat prompts from the GGUF's own template, and the markers that end a reply.

The template is the model author's Jinja text (`tokenizer.chat_template`), rendered the way Hugging Face
transformers renders it: a sandboxed, immutable environment with trim_blocks/lstrip_blocks, `messages`,
`add_generation_prompt`, `bos_token`/`eos_token`, and a `raise_exception` the template may call. A template is code
from a downloaded file, hence the sandbox. Raw mode sends the user's text unchanged, for base models and for
callers that format prompts themselves.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable, Mapping
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import EngineError
from engine.tokenizer import EOG_TEXTS, Tokenizer

__all__ = ["ChatError", "describe_prompt_mode", "render_prompt", "stop_markers", "strip_stop_markers", "MODES"]

MODES = ("auto", "raw")

log = logging.getLogger("engine.chat")
_told: set[tuple[str, str]] = set()  # (model, mode) pairs whose prompt mode was logged already

# control tokens that open a new turn: if the model writes one, its reply is over
_TURN_STARTS = frozenset({"<|im_start|>", "<|start_header_id|>", "<start_of_turn>", "<|user|>", "<|assistant|>"})


class ChatError(EngineError):
    """A prompt cannot be rendered: bad mode, bad history, or the template failed (or refused the messages)."""


class _TemplateRaised(Exception):
    """The template called raise_exception(message)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None, **kw: object) -> str:
    # transformers' variant: keeps non-ASCII text readable, which some templates rely on
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)  # type: ignore[arg-type]


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _messages(history: Iterable[object], system: str | None, user_text: str) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    if system is not None:
        out.append({"role": "system", "content": system})
    for n, item in enumerate(history):
        if isinstance(item, Mapping):
            role, content = item.get("role"), item.get("content")
        elif isinstance(item, tuple) and len(item) == 2:
            role, content = item
        else:
            raise ChatError(f"history[{n}] must be a (role, content) pair or a mapping with role and content")
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise ChatError(f"history[{n}]: role must be a non-empty string and content a string, got {item!r}")
        out.append({"role": role, "content": content})
    out.append({"role": "user", "content": user_text})
    return out


def describe_prompt_mode(tokenizer_or_template: Tokenizer | str | None, mode: str = "auto") -> tuple[str, str]:
    """What `render_prompt` does for this model and mode: ("template" or "raw", a sentence saying so and why).

    A GGUF without `tokenizer.chat_template` (base models, many small or converted files: Gemma 3 270M) gets its
    prompt as written under "auto" too; the sentence says so, so that a caller can tell the user why a chat model
    answers like a text completer."""
    if mode not in MODES:
        raise ChatError(f"prompt mode {mode!r} is unknown (use one of {', '.join(MODES)})")
    tok = tokenizer_or_template if isinstance(tokenizer_or_template, Tokenizer) else None
    template = tok.chat_template if tok is not None else tokenizer_or_template
    where = tok.name if tok is not None else "the given model"
    bos = " after the BOS token" if tok is not None and tok.add_bos else ""
    if mode == "raw":
        return "raw", f"prompt template: raw (--template raw): the text is sent as written{bos}"
    if template is None:
        return "raw", (f"prompt template: none: {where} has no chat template (tokenizer.chat_template), so the text is "
                       f"sent as written{bos}, as with --template raw; format the turns yourself if the model needs them")
    return "template", f"prompt template: the chat template of {where} (--template auto)"


def render_prompt(
    tokenizer_or_template: Tokenizer | str | None,
    user_text: str,
    *,
    mode: str = "auto",
    history: Iterable[object] = (),
    system: str | None = None,
) -> str:
    """The text to tokenize for one user turn.

    `mode="auto"` renders the chat template (from a Tokenizer, or a template string) with the generation prompt
    appended; a model without a template gets the text as is, like `mode="raw"`. History and a system prompt need a
    template: raw mode has no roles to put them in, so they are refused rather than silently dropped.
    """
    _, note = describe_prompt_mode(tokenizer_or_template, mode)
    key = (getattr(tokenizer_or_template, "name", "<template>"), mode)
    if key not in _told:  # once per model and mode: the CLI and the coordinator's log say which prompt went out
        _told.add(key)
        log.info("%s", note)
    history = tuple(history)
    if isinstance(tokenizer_or_template, Tokenizer):
        tok = tokenizer_or_template
        template, where = tok.chat_template, tok.name
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
    else:
        template, where, bos, eos = tokenizer_or_template, "the given chat template", "", ""
    if mode == "raw" or template is None:
        if history or system is not None:
            why = "raw mode" if mode == "raw" else f"{where} has no chat template, so"
            raise ChatError(f"{why} cannot place a system prompt or history; send them inside the text")
        return user_text
    try:
        compiled = _compile(template)
        return compiled.render(
            messages=_messages(history, system, user_text),
            add_generation_prompt=True,
            bos_token=bos,
            eos_token=eos,
        )
    except _TemplateRaised as exc:
        raise ChatError(f"chat template of {where} refused the conversation: {exc}") from None
    except jinja2.TemplateError as exc:  # syntax errors, undefined names, sandbox violations
        raise ChatError(f"chat template of {where} failed: {type(exc).__name__}: {exc}") from None


def stop_markers(tokenizer: Tokenizer) -> tuple[str, ...]:
    """Texts that end a reply: the end-of-generation tokens and the control tokens that open a new turn."""
    controls = tokenizer.control_tokens()
    found = {tokenizer.token_text(i): i for i in tokenizer.eos_ids}
    found.update({t: i for t, i in controls.items() if t in EOG_TEXTS or t in _TURN_STARTS})
    return tuple(t for t, _ in sorted(found.items(), key=lambda kv: kv[1]) if t)


def strip_stop_markers(text: str, markers: Iterable[str]) -> str:
    """`text` up to the earliest stop marker (all of it if none occurs)."""
    cut = len(text)
    for marker in markers:
        if marker:
            at = text.find(marker)
            if 0 <= at < cut:
                cut = at
    return text[:cut]
