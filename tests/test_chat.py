"""Chat prompts from the GGUF's template, raw mode, the sandbox, and stop markers."""

from __future__ import annotations

import pytest

from engine.chat import ChatError, render_prompt, stop_markers, strip_stop_markers
from engine.errors import EngineError
from engine.sources import default_model_path
from engine.tokenizer import Tokenizer
from tests.test_tokenizer import write_tiny_gguf


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def test_smollm2_template_with_default_system_prompt(smol):
    assert render_prompt(smol, "Hi there") == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )


def test_system_and_history_in_order(smol):
    text = render_prompt(
        smol, "and now?", system="Be brief.", history=[("user", "q1"), {"role": "assistant", "content": "a1"}]
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nq1<|im_end|>\n"
        "<|im_start|>assistant\na1<|im_end|>\n<|im_start|>user\nand now?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_rendered_markers_become_control_ids(smol):
    ids = smol.encode(render_prompt(smol, "Hi"))
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> x3, <|im_end|> x2, as single ids


def test_raw_mode_sends_text_as_is(smol):
    assert render_prompt(smol, "  The capital of France is", mode="raw") == "  The capital of France is"
    with pytest.raises(ChatError, match="raw mode cannot place"):
        render_prompt(smol, "x", mode="raw", system="s")


def test_unknown_mode(smol):
    with pytest.raises(ChatError, match="prompt mode 'chatml' is unknown"):
        render_prompt(smol, "x", mode="chatml")


def test_model_without_template_falls_back_to_raw(tmp_path):
    tok = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "base.gguf"))
    assert tok.chat_template is None
    assert render_prompt(tok, "Once upon a time") == "Once upon a time"
    with pytest.raises(ChatError, match=r"base\.gguf has no chat template"):
        render_prompt(tok, "x", history=[("user", "y")])


def test_bos_and_eos_tokens_reach_the_template(tmp_path):
    ctl = ("<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>")
    template = (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )
    path = write_tiny_gguf(tmp_path / "l3.gguf", pre="llama-bpe", control=ctl, bos=ctl[0], eos=ctl[1],
                           template=template)
    tok = Tokenizer.from_gguf(path)
    text = render_prompt(tok, "hi")
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tok.encode(text).count(tok.bos_id) == 1  # the template's BOS, not a second one
    assert stop_markers(tok) == ("<|eot_id|>", "<|start_header_id|>")


def test_template_string_directly():
    assert render_prompt("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}", "hey") == (
        "[user] hey\n"
    )


def test_template_raise_exception_becomes_chat_error():
    template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}x"
    assert render_prompt(template, "u") == "x"
    with pytest.raises(ChatError, match="refused the conversation: System role not supported") as info:
        render_prompt(template, "u", system="s")
    assert isinstance(info.value, EngineError)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # escaping the sandbox
        "{% set _ = messages.append({'role': 'x'}) %}",  # mutating the caller's data
        "{% for m in messages %}",  # syntax error
    ],
)
def test_hostile_or_broken_templates_are_contained(template):
    with pytest.raises(ChatError, match="chat template of the given chat template failed"):
        render_prompt(template, "u")


def test_bad_history_items():
    with pytest.raises(ChatError, match=r"history\[0\] must be"):
        render_prompt("x", "u", history=["just text"])
    with pytest.raises(ChatError, match=r"history\[1\]: role must be"):
        render_prompt("x", "u", history=[("user", "a"), ("", "b")])


def test_eos_token_is_the_declared_one():
    # <|endoftext|> (id 0) also ends generation, but the template's eos_token is the GGUF's eos_token_id (2)
    tok = Tokenizer.from_gguf(default_model_path())
    tok.chat_template = "{{ bos_token }}|{{ eos_token }}"
    assert render_prompt(tok, "u") == "<|im_start|>|<|im_end|>"
    assert render_prompt("{{ bos_token }}|{{ eos_token }}", "u") == "|"  # a bare template has no vocabulary


def test_smollm2_stop_markers(smol):
    assert stop_markers(smol) == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def test_strip_stop_markers_cuts_at_the_earliest():
    markers = ("<|im_end|>", "<|im_start|>")
    assert strip_stop_markers("Paris.<|im_end|>\n<|im_start|>user", markers) == "Paris."
    assert strip_stop_markers("a<|im_start|>b<|im_end|>", markers) == "a"
    assert strip_stop_markers("no marker here\n", markers) == "no marker here\n"
    assert strip_stop_markers("<|im_end|>", markers) == ""
    assert strip_stop_markers("x<|im_end|>", ()) == "x<|im_end|>"
