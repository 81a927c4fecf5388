"""The transport ladder across real NAT: `mesh-coord --auto-webrtc` with two peers behind separate NAT routers.

The coordinator and a STUN server (coturn) sit on the "public" segment; each peer sits behind its own MASQUERADE
router, so neither can dial the other. Both dial out to the coordinator, which wires the chain: the direct dial of
the peer-to-peer hop fails, the coordinator relays SDP, and the hop comes up over a WebRTC data channel. The answer
must equal the unsharded engine's bitwise.
"""
from __future__ import annotations

import json
import subprocess

import pytest
import trio

from engine.stage import Sampling
from engine.tokenizer import Tokenizer
from engine.worker import open_worker
from mesh.pipeline import LocalPipeline, generate
from tests.mesh_fixtures import ROOT, child_env, mesh_cmd, write_tiny_chat_model
from tests.netns import PUB_IP, STUN_PORT, coturn_unavailable, nat_topology, netns_unavailable

why = netns_unavailable() or coturn_unavailable()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(why is not None, reason=str(why))]
PROMPT = "Two peers behind two routers."
COORD_PORT, HOP_PORT = 7600, 7601


def test_auto_webrtc_brings_up_the_hop_between_two_nated_peers(tmp_path):
    model = write_tiny_chat_model(tmp_path / "tiny.gguf", n_layers=4)
    tok = Tokenizer.from_gguf(model)

    async def reference():
        async with open_worker() as w:
            await w.load(model, 0, 4)
            return (await generate(LocalPipeline(w), tok.encode(PROMPT), max_tokens=8, sampling=Sampling(),
                                   eos_ids=tok.eos_ids)).tokens
    expected = trio.run(reference)

    stun = ["--stun", f"stun:{PUB_IP}:{STUN_PORT}"]
    token = ["--token", "nat-fleet"]
    env = child_env()
    procs: list[subprocess.Popen] = []
    with nat_topology() as net:
        net.start_coturn()
        try:
            coord = subprocess.Popen(net.cmd(net.pub, *mesh_cmd(
                "coord", "--listen", f"{PUB_IP}:{COORD_PORT}", "--model", str(model), "--min-peers", "2",
                "--settle", "0.3", "--wait", "120", "--auto-webrtc", "--prompt", PROMPT, "--template", "raw",
                "--placement", "memory",    # two stages whatever their speed: the hop between them is the subject
                "--max-tokens", "8", "--json", *token, *stun)), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE)
            procs.append(coord)
            net.wait_bound(net.pub, COORD_PORT, "tcp", coord)
            for ns in (net.peer_a, net.peer_b):
                procs.append(subprocess.Popen(net.cmd(ns, *mesh_cmd(
                    "peer", "--join", f"{PUB_IP}:{COORD_PORT}", "--listen", f"0.0.0.0:{HOP_PORT}",
                    "--model", str(model), *token, *stun)), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL))
            out, err = coord.communicate(timeout=240)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
    err = err.decode(errors="replace")
    assert coord.returncode == 0, err
    assert "hop 1" in err and "runs over WebRTC" in err, err     # the direct dial failed and the ladder climbed
    assert json.loads(out.decode().splitlines()[-1])["tokens"] == expected
