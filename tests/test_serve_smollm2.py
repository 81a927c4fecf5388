"""The real SmolLM2 model served through a 2-peer chain of separate processes, as a user starts it: `mesh-coord`
(serving HTTP) and two `mesh-peer`s; the official openai client's greedy answer is the unsharded engine's, bitwise."""
from __future__ import annotations

import subprocess
import time

import httpx2 as httpx
import openai
import pytest

from engine.chat import render_prompt
from engine.sources import default_model_path
from engine.tokenizer import Tokenizer
from tests.mesh_fixtures import free_port, mesh_cmd, processes, unsharded_tokens

pytestmark = pytest.mark.slow
KEY = "sk-smollm2-serve-test-0123456789"
QUESTION = "Name three primary colors."  # answered alike by llama.cpp and every engine path (test_engine_smollm2)
MAX_TOKENS = 24


def test_smollm2_over_two_peers_answers_like_one_machine():
    model = default_model_path()
    tok = Tokenizer.from_gguf(model)
    reference = unsharded_tokens(model, 30, render_prompt(tok, QUESTION), MAX_TOKENS)
    from tests.test_serve_api import text_of
    expected = text_of(model, reference)
    reg, http = free_port(), free_port()
    with processes() as start:
        # --max-seqs 1: the requests come one at a time, and the stages compile fewer decode widths at load.
        # --placement memory: two stages whatever their speed (by speed, two peers on one box are one stage: a hop
        # costs more than it saves), since the chain is the subject
        coord = start(mesh_cmd("coord", "--listen", f"127.0.0.1:{reg}", "--http", f"127.0.0.1:{http}", "--min-peers",
                               "2", "--settle", "0.3", "--insecure-open", "--api-key", KEY, "--max-seqs", "1",
                               "--placement", "memory"),
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(2):
            start(mesh_cmd("peer", "--join", f"127.0.0.1:{reg}", "--listen", "127.0.0.1:0", "--model", str(model),
                           "--insecure-open"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 240
        while True:                                  # /health is 503 until the mesh has formed
            assert coord.poll() is None and time.monotonic() < deadline, "the mesh did not form"
            try:
                r = httpx.get(f"http://127.0.0.1:{http}/health", headers={"Authorization": f"Bearer {KEY}"})
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert r.json()["peers"] == 2
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key=KEY, max_retries=0, timeout=240) as c:
            model_id = c.models.list().data[0].id
            answer = c.chat.completions.create(model=model_id, messages=[{"role": "user", "content": QUESTION}],
                                               max_tokens=MAX_TOKENS, temperature=0)
            streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS,
                temperature=0, stream=True) if ch.choices)
    assert model_id == "SmolLM2-135M-Instruct.Q4_1"
    assert answer.choices[0].message.content == expected == streamed
    assert all(c in expected for c in ("Red", "Blue", "Yellow")), expected
