"""A model without a chat template gets its prompt raw under --template auto, and the log says so; the mode in use
is described either way (engine/chat.py describe_prompt_mode)."""
from __future__ import annotations

import logging

import pytest

from engine.chat import ChatError, describe_prompt_mode, render_prompt
from engine.tokenizer import Tokenizer
from tests.gemma_model import gemma3_tokenizer


def tok(template: str | None, name: str) -> Tokenizer:
    tokens = ["<unk>", "<s>", "</s>", "▁", "h", "i", "▁h"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3, 1, 1, 1, 1] + [6] * 256
    return Tokenizer(tokens=tokens, token_types=types, model="llama", scores=[0.0] * len(tokens), bos_id=1,
                     eos_ids=frozenset({2}), add_bos=True, chat_template=template, name=name)


def test_no_template_means_raw_with_a_note_in_the_log(caplog):
    t = tok(None, "base.gguf")
    used, note = describe_prompt_mode(t, "auto")
    assert used == "raw" and "base.gguf has no chat template" in note and "BOS" in note
    with caplog.at_level(logging.INFO, logger="engine.chat"):
        assert render_prompt(t, "hi there") == "hi there"
        render_prompt(t, "again")
    notes = [r.getMessage() for r in caplog.records if r.name == "engine.chat"]
    assert notes == [note]  # said once per model and mode
    with pytest.raises(ChatError, match="no chat template"):
        render_prompt(t, "hi", system="be brief")


def test_template_and_raw_modes_are_described():
    t = tok("{% for m in messages %}<s>{{ m['content'] }}{% endfor %}", "chat.gguf")
    assert describe_prompt_mode(t, "auto") == ("template", "prompt template: the chat template of chat.gguf "
                                                           "(--template auto)")
    used, note = describe_prompt_mode(t, "raw")
    assert used == "raw" and "--template raw" in note
    assert render_prompt(t, "hi", mode="raw") == "hi"
    with pytest.raises(ChatError, match="unknown"):
        describe_prompt_mode(t, "jinja")


def test_gemma3_270m_has_no_template_and_goes_raw_after_bos():
    g = gemma3_tokenizer()
    assert describe_prompt_mode(g, "auto")[0] == "raw"
    ids = g.encode(render_prompt(g, "The capital of France is"))
    assert ids[0] == g.bos_id == 2 and g.decode(ids[1:]) == "The capital of France is"
