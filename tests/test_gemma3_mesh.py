"""The real Gemma 3 270M Q4_K_M file (K-quants, SentencePiece, gemma3) through whole meshes on loopback: greedy tokens
of 2 and 3 peers are bitwise the unsharded engine's, a GGUF without a chat template is prompted raw with a note, and
modelless peers receive their Gemma layer ranges shipped by the coordinator.

Slow: every process compiles Gemma's kernels on first use (the step shapes of a few greedy tokens). Skips when the
model package is not installed (scripts/setup.sh installs it).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.gemma_model import gemma3_path
from tests.mesh_fixtures import free_port, processes, run_coord, unsharded_tokens
from tests.test_mesh_e2e import peer

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
MAX_TOKENS = 6
TIMEOUT = 900.0  # a loaded CI box compiles each process's Gemma kernels in tens of seconds


@pytest.fixture(scope="module")
def model() -> Path:
    return gemma3_path()


@pytest.fixture(scope="module")
def reference(model) -> list[int]:
    return unsharded_tokens(model, 18, PROMPT, MAX_TOKENS)


def coord_args(peers: int, token: str) -> list[str]:
    # --template auto: this GGUF has no chat template, so the prompt goes raw and the log says why
    return ["--min-peers", str(peers), "--settle", "0.3", "--wait", "300", "--prompt", PROMPT, "--template", "auto",
            "--max-tokens", str(MAX_TOKENS), "--token", token]


def test_three_peers_equal_the_unsharded_engine(model, reference):
    port = free_port()
    with processes() as start:
        for _ in range(3):
            peer(start, port, token="g3", model=model)
        code, answer, err = run_coord(start, port, model, *coord_args(3, "g3"), timeout=TIMEOUT)
    assert code == 0, err
    assert answer["tokens"] == reference, err
    assert "has no chat template" in err and "sent as written" in err
    assert "layers 12..18" in err  # three stages of 6 layers: layer 5 and 11 (global) end stages 1 and 2


def test_two_modelless_peers_receive_gemma_ranges(model, reference, tmp_path):
    port = free_port()
    with processes() as start:
        for i in range(2):
            peer(start, port, "--cache-dir", str(tmp_path / f"cache{i}"), token="ship")
        code, answer, err = run_coord(start, port, model, *coord_args(2, "ship"), timeout=TIMEOUT)
    assert code == 0, err
    assert answer["tokens"] == reference, err
    shipped = sorted(p.name for p in tmp_path.glob("cache*/*/*.gguf"))
    assert shipped == ["0-9.gguf", "9-18.gguf"], shipped
