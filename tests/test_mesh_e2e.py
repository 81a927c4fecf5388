"""Whole meshes on loopback: a coordinator and peers as separate processes, output compared with the unsharded engine.

Slow by nature (every process imports tinygrad and starts a worker), so each test does one thing a user would do and
checks the result bitwise. The tiny chat model loads in well under a second; most of the time is process start-up.
"""
from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.mesh_fixtures import free_port, mesh_cmd, processes, run_coord, unsharded_tokens, write_tiny_chat_model

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox jumps over the lazy dog."
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny-chat.gguf", n_layers=6)


@pytest.fixture(scope="module")
def reference(model) -> list[int]:
    return unsharded_tokens(model, 6, PROMPT, MAX_TOKENS)


def peer(start, port: int, *args: str, token: str | None = None, model: Path | None = None, capture: bool = False,
         warmup: bool = False):
    # compiling the step shapes at load costs a tiny model's worker ~10 s; one test keeps it (the default path)
    cmd = mesh_cmd("peer", "--join", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0", *args,
                   *(() if warmup else ("--warmup", "0")))
    cmd += ["--token", token] if token else ["--insecure-open"]
    if model:
        cmd += ["--model", str(model)]
    # Logs go to a file, not a pipe nobody reads (a full pipe would stall the peer); kept for a failing test's report.
    log = subprocess.PIPE if capture else tempfile.NamedTemporaryFile("w+b", prefix="mesh-peer-", suffix=".log",
                                                                        delete=False)
    return start(cmd, stdout=subprocess.DEVNULL, stderr=log)


def coord_args(*extra: str, token: str | None = None, peers: int = 3) -> list[str]:
    args = ["--min-peers", str(peers), "--settle", "0.3", "--wait", "120", "--prompt", PROMPT, "--template", "raw",
            "--max-tokens", str(MAX_TOKENS), *extra]
    return args + (["--token", token] if token else ["--insecure-open"])


@pytest.mark.parametrize("chain, token, warmup", [("p2p", "s3cret", False), ("hub", None, False),
                                                 ("p2p", None, True), ("hub", "s3cret", False)])
def test_three_peers_equal_the_unsharded_engine(model, reference, chain, token, warmup):
    """With warmup the peers compile their step shapes at load and the reference compiles on first use: the tokens
    are the same all the same."""
    port = free_port()
    with processes() as start:
        for _ in range(3):
            peer(start, port, token=token, model=model, warmup=warmup)
        # peers that warm up measure their speed, and by speed one peer on this box would hold every layer: this
        # case is about the warmup path, so memory keeps three stages (tests/test_placement.py tests placement)
        placement = ("--placement", "memory") if warmup else ()
        code, answer, err = run_coord(start, port, model, *coord_args("--chain", chain, *placement, token=token))
    assert code == 0, err
    assert answer["tokens"] == reference, err
    assert "stage 3: " in err and "layers 4..6" in err  # the topology map went to stderr


def test_pinned_peers_joining_late_in_reverse_order(model, reference):
    """The last range joins first, the first range last, all after the coordinator started: chain order is by layer."""
    port = free_port()
    with processes() as start:
        coord = start(mesh_cmd("coord", "--listen", f"127.0.0.1:{port}", "--model", str(model), "--json",
                               *coord_args(peers=3)))
        for layers in ("4:6", "2:4", "0:2"):
            peer(start, port, "--layers", layers, model=model)
        out, err = coord.communicate(timeout=240)
    err = err.decode()
    assert coord.returncode == 0, err
    import json
    assert json.loads(out.decode().splitlines()[-1])["tokens"] == reference
    assert "auto-split" not in err                     # all pinned: nothing was re-planned
    assert err.index("layers 0..2") < err.index("layers 2..4") < err.index("layers 4..6")


def test_refusals_name_the_peer_and_the_reason(model, tmp_path):
    other = write_tiny_chat_model(tmp_path / "other.gguf", n_layers=6, seed=7)
    port = free_port()
    with processes() as start:   # a peer pinned to a different model of the same shape
        peer(start, port, "--layers", "0:3", model=model)
        peer(start, port, "--layers", "3:6", model=other)
        code, _, err = run_coord(start, port, model, *coord_args(peers=2))
    assert code == 1 and "holds a different model" in err.splitlines()[-1], err

    port = free_port()
    with processes() as start:   # pinned ranges with a gap
        peer(start, port, "--layers", "0:2", model=model)
        peer(start, port, "--layers", "3:6", model=model)
        code, _, err = run_coord(start, port, model, *coord_args(peers=2))
    assert code == 1 and "layers 2..3 uncovered" in err.splitlines()[-1], err

    port = free_port()
    with processes() as start:   # a wrong token: the peer exits with one line, the coordinator refuses and goes on
        coord = start(mesh_cmd("coord", "--listen", f"127.0.0.1:{port}", "--model", str(model), "--json",
                               *coord_args(peers=1, token="right"), "--wait", "30"))
        bad = peer(start, port, token="wrong", model=model, capture=True)
        _, bad_err = bad.communicate(timeout=120)
        good = peer(start, port, token="right", model=model)
        out, err = coord.communicate(timeout=240)
    bad_err = bad_err.decode()
    assert bad.returncode != 0 and f"127.0.0.1:{port}" in bad_err.splitlines()[-1], bad_err
    assert coord.returncode == 0, err.decode()
    assert "refused" in err.decode() or "token" in err.decode()


def test_an_overlapping_pinned_peer_is_left_out_and_told_why_by_name(model, reference, tmp_path):
    """Two peers pinned to the same layers: the one that joined first serves, the other hears why (by name) and
    waits in the pool; the coordinator no longer gives up."""
    port = free_port()
    logs = {name: tmp_path / f"{name}.log" for name in ("left", "right")}
    with processes() as start:
        for name in logs:
            start(mesh_cmd("peer", "--join", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--warmup", "0",
                           "--insecure-open", "--model", str(model), "--layers", "0:6", "--name", name),
                  stdout=subprocess.DEVNULL, stderr=logs[name].open("wb"))
        code, answer, err = run_coord(start, port, model, *coord_args(peers=2))
        assert code == 0, err
        assert answer["tokens"] == reference
        out, kept = ("left", "right") if "left out left (" in err else ("right", "left")
        assert f"stage 1: {kept} (127.0.0.1), layers 0..6" in err, err
        why = (f"{out} (127.0.0.1) is pinned to layers 0..6, which overlap layers 0..6 of {kept} (127.0.0.1), "
               f"pinned first")
        assert f"left out {why}" in err, err
        deadline = time.monotonic() + 30
        while f"left out of this session by the coordinator: {why} (pinned overlap)" not in logs[out].read_text():
            assert time.monotonic() < deadline, logs[out].read_text()
            time.sleep(0.1)
        assert f" {out} mesh.peer: " in logs[out].read_text()     # the peer's own log lines carry its name


def test_peers_rejoin_after_a_coordinator_restart(model, reference):
    port = free_port()
    with processes() as start:
        for _ in range(2):
            peer(start, port, model=model)
        for _ in range(2):  # the same peers serve two coordinators in turn
            code, answer, err = run_coord(start, port, model, *coord_args(peers=2))
            assert code == 0, err
            assert answer["tokens"] == reference


def test_modelless_peers_receive_their_layers(model, reference, tmp_path):
    port = free_port()
    with processes() as start:
        for i in range(2):
            peer(start, port, "--cache-dir", str(tmp_path / f"cache{i}"), token="ship")
        code, answer, err = run_coord(start, port, model, *coord_args(peers=2, token="ship"))
        assert code == 0, err
        assert answer["tokens"] == reference
        shipped = sorted(p.name for p in tmp_path.glob("cache*/*/*.gguf"))
        assert shipped == ["0-3.gguf", "3-6.gguf"], shipped
        code, answer, err = run_coord(start, port, model, *coord_args(peers=2, token="ship"))   # the cache is reused
        assert code == 0 and answer["tokens"] == reference, err
        assert "shipping" not in err


def test_a_peer_that_disappears_mid_answer_is_named_and_the_rest_serve_on(model, reference):
    port = free_port()
    with processes() as start:
        peers = [peer(start, port, model=model) for _ in range(3)]
        coord = start(mesh_cmd("coord", "--listen", f"127.0.0.1:{port}", "--model", str(model), "--json",
                               *coord_args(peers=3), "--max-tokens", "1500"))
        lines = []
        for raw in coord.stderr:                       # wait until tokens flow, then pull a stage away
            lines.append(raw.decode(errors="replace"))
            if "decoding" in lines[-1]:
                break
        peers[1].kill()
        t0 = time.monotonic()
        rest = coord.stderr.read().decode(errors="replace")
        coord.wait(timeout=60)
        assert time.monotonic() - t0 < 30, "a dead stage must be noticed within seconds (heartbeats)"
        assert coord.returncode == 1, "".join(lines) + rest
        last = rest.strip().splitlines()[-1]
        assert last.startswith("mesh-coord: ") and "is gone" in last, rest
        code, answer, err = run_coord(start, port, model, *coord_args(peers=2))   # the survivors serve on
        assert code == 0 and answer["tokens"] == reference, err
