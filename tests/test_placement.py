"""Placement by measured speed, end to end: two peers on loopback, one slowed on purpose (the worker sleeps
MESH_TEST_SLOW_MS_PER_LAYER per layer in every step). The speed plan leaves the slow one out and tells it why; the
same peers then serve the memory-only plan, and the speed plan's measured decode rate beats it, same tokens."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.mesh_fixtures import child_env, free_port, mesh_cmd, processes, run_coord, write_tiny_chat_model

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox jumps over the lazy dog."


def test_a_slowed_peer_is_left_out_and_the_chain_decodes_faster_than_the_memory_plan(tmp_path):
    model = write_tiny_chat_model(tmp_path / "tiny-chat.gguf", n_layers=6)
    port = free_port()
    logs = {}
    with processes() as start:
        for name, slow in (("quick", ""), ("sluggish", "25")):
            logs[name] = open(tmp_path / f"{name}.log", "w+b")
            start(mesh_cmd("peer", "--join", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--insecure-open",
                           "--model", str(model), "--cache-dir", str(tmp_path / name)),
                  env=child_env(MESH_TEST_SLOW_MS_PER_LAYER=slow), stdout=None, stderr=logs[name])
        common = ["--min-peers", "2", "--settle", "0.3", "--wait", "120", "--prompt", PROMPT, "--template", "raw",
                  "--max-tokens", "16", "--insecure-open"]
        # first by speed: nobody has figures yet, so both are measured on a probe layer, then the plan is made
        code, by_speed, err_speed = run_coord(start, port, model, *common, "--placement", "speed")
        assert code == 0, err_speed
        code, by_memory, err_memory = run_coord(start, port, model, *common, "--placement", "memory")
        assert code == 0, err_memory
    sluggish_log = logs["sluggish"].seek(0) or logs["sluggish"].read().decode(errors="replace")
    for f in logs.values():
        f.close()
    assert "measuring" in err_speed and "probe of layer 2" in err_speed
    assert re.search(r"left out .+? \(127\.0\.0\.1\) would slow the chain: decode [\d.]+ ms/layer", err_speed)
    assert "layers 0..6" in err_speed and "stage 2" not in err_speed            # the quick peer holds everything
    assert "placement by speed: predicted" in err_speed and "tok/s measured" in err_speed
    assert "left out of this session" in sluggish_log and "too slow" in sluggish_log   # the peer was told why
    assert "stage 2" in err_memory                                              # memory alone splits them
    assert "placement by memory: predicted" in err_memory
    assert by_speed["tokens"] == by_memory["tokens"]
    assert by_speed["decode_tok_s"] > 1.5 * by_memory["decode_tok_s"], (by_speed, by_memory)
