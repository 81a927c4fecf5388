"""Interactive chat (`mesh-coord --chat`) as a user runs it, in separate processes on loopback."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import trio

from engine.stage import Sampling
from engine.tokenizer import StreamDecoder, Tokenizer
from engine.worker import open_worker
from mesh.pipeline import LocalPipeline, generate
from tests.mesh_fixtures import free_port, mesh_cmd, processes, write_tiny_chat_model

TOKEN = "chat-fleet-token-0123456789"

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox jumps over the lazy dog."
MAX_TOKENS = 600


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny-chat.gguf", n_layers=6)


def unsharded_text(model: Path) -> str:
    """What the chat must print for PROMPT: the unsharded engine's greedy tokens, streamed through the same decoder."""
    async def main():
        tok = Tokenizer.from_gguf(model)
        async with open_worker() as w:
            await w.load(model, 0, 6, warmup=0)
            tokens = (await generate(LocalPipeline(w), tok.encode(PROMPT), max_tokens=MAX_TOKENS, sampling=Sampling(),
                                     eos_ids=tok.eos_ids)).tokens
        decoder = StreamDecoder(tok)
        return "".join(decoder.feed(t) for t in tokens if t not in tok.eos_ids) + decoder.flush()
    return trio.run(main)


def test_chat_survives_a_peer_that_disappears_mid_answer(model):
    """The user asks, a stage dies while the answer streams, the mesh re-forms from the two peers left and the
    answer goes on where it stopped: the screen shows exactly the unsharded engine's answer, once."""
    expected = unsharded_text(model)
    port = free_port()
    with processes() as start:
        peers = [start(mesh_cmd("peer", "--join", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--model", str(model),
                                "--warmup", "0", "--token", TOKEN),  # compiling at load costs a tiny worker ~10 s; not tested here
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(3)]
        coord = start(mesh_cmd("coord", "--listen", f"127.0.0.1:{port}", "--model", str(model), "--min-peers", "3",
                               "--settle", "0.5", "--wait", "120", "--template", "raw", "--max-tokens", str(MAX_TOKENS),
                               "--token", TOKEN, "--chat"),
                      stdin=subprocess.PIPE)
        coord.stdin.write(PROMPT.encode() + b"\n")
        coord.stdin.flush()
        shown = b""
        while len(shown.partition(b"> ")[2]) < 8:      # wait until the answer streams, then pull a stage away
            c = os.read(coord.stdout.fileno(), 1)      # unbuffered: communicate() below reads the same pipe
            assert c, shown
            shown += c
        peers[1].kill()
        # The loss is named and the answer resumes on a new fleet; the empty line waits in stdin until it is done,
        # then ends the chat. (Log lines wait while an answer streams: they cannot be the trigger any more.)
        out, err = coord.communicate(b"\n", timeout=120)
        out = shown + out
        log = err.decode(errors="replace")
        assert coord.returncode == 0, log
        assert "is gone" in log and "re-forming the mesh from the peers that are left (attempt 1 of 3)" in log, log
        assert "attempt 2" not in log, log                 # the re-formed mesh answered at the first try...
        assert "layers 0..6 over 2 peers" in log, log      # ...with both survivors, the layers planned anew
        assert out.decode() == "> " + expected + "\n> ", log
