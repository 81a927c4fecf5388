"""Zero-config join on one LAN segment: two fleets with different tokens, each a coordinator and its peers, all on
one bridge. No peer is told an address: each finds the coordinator of its own fleet (and only that one) by LAN
discovery, and both meshes answer: the same tokens from a 2-peer and a 1-peer split of one model (that each split
equals the unsharded engine bitwise is tests/test_mesh_e2e.py's; computing the reference here would double the time)."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.mesh_fixtures import ROOT, child_env, mesh_cmd, write_tiny_chat_model
from tests.netns import lan_topology, netns_unavailable

why = netns_unavailable()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(why is not None, reason=str(why))]
PROMPT = "Two fleets, one LAN."
FLEETS = {"a": ("fleet-a-token-1111111111", ("p1", "p2")), "b": ("fleet-b-token-2222222222", ("p3",))}


def test_each_peer_finds_the_coordinator_of_its_own_fleet_and_both_meshes_answer(tmp_path):
    model = write_tiny_chat_model(tmp_path / "tiny.gguf", n_layers=4)
    env = child_env()
    logs = {}
    with lan_topology("ca", "cb", "p1", "p2", "p3") as net:
        coords = {}
        for fleet, (token, peers) in FLEETS.items():
            coords[fleet] = net.spawn(net.ns[f"c{fleet}"], mesh_cmd(
                "coord", "--model", str(model), "--min-peers", str(len(peers)), "--settle", "0.5", "--wait", "120",
                "--prompt", PROMPT, "--template", "raw", "--max-tokens", "8", "--json", "--token", token),
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # No wait for the coordinators to come up: a peer that hears nothing keeps asking (with backoff).
        for fleet, (token, peers) in FLEETS.items():
            for name in peers:
                logs[name] = tmp_path / f"{name}.log"
                net.spawn(net.ns[name], mesh_cmd("peer", "--token", token, "--name", name, "--model", str(model),
                                                 "--warmup", "0"),
                          cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=logs[name].open("wb"))
        results = {fleet: p.communicate(timeout=240) for fleet, p in coords.items()}
        ips = dict(net.ip)
    answers = []
    for fleet, (token, peers) in FLEETS.items():
        out, err = results[fleet]
        err = err.decode(errors="replace")
        assert coords[fleet].returncode == 0, err
        answers.append(json.loads(out.decode().splitlines()[-1])["tokens"])
        others = [n for f, (_, ps) in FLEETS.items() if f != fleet for n in ps]
        for name in peers:                       # the topology map names exactly this fleet's peers
            assert f": {name} ({ips[name]}), layers" in err, err
            log = logs[name].read_text()
            assert f"found coordinator " in log and f" at {ips['c' + fleet]}:9000 on the local network" in log, log
            assert "refused us" not in log, log         # no coordinator of the other fleet was ever dialed
            # (after the answer the peer looks again and may find its coordinator exiting: "connection refused")
        assert not any(f": {n} (" in err for n in others), err
        assert "refused" not in err, err          # no peer of the other fleet ever dialed this one
    assert answers[0] == answers[1] and len(answers[0]) == 8
