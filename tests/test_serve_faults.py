"""Faults under load: a peer killed (SIGKILL) or frozen (SIGSTOP) while four HTTP streams are being answered. Every
stream completes with exactly the text of an undisturbed run (greedy and seeded), once: the service replays each
sequence (prompt + the tokens it already sent) onto the chain re-formed from the survivor.

The coordinator (registry, Service, hypercorn) runs in this process (tests/serve_fixtures.py); the two peers are
`mesh-peer` processes, so they can be killed and frozen for real. The failure is placed by a gate in the scheduler,
not by the clock: the answer of the step at which all four sequences have sent 3 tokens or more is held until the
peer is gone.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import openai
import pytest
import trio

from tests.mesh_fixtures import mesh_cmd, processes, write_tiny_chat_model
from tests.serve_fixtures import TOKEN, LiveServer
from tests.test_serve_api import MODEL_ID

pytestmark = pytest.mark.slow       # two peer processes, a re-form; 20-35 s a case on 2 loaded cores
N_LAYERS = 2
STREAMS = [   # (endpoint, prompt, max_tokens, sampling): different lengths, greedy and seeded
    ("chat", "Hello there, how are you today?", 40, {"temperature": 0}),
    ("completions", "Once upon a time", 48, {"temperature": 0.9, "seed": 6}),  # to its max_tokens on 8 and 32 bits
    ("completions", "The quick brown fox jumps over the lazy dog.", 30, {"temperature": 0}),
    ("chat", "Tell me a story about a robot", 44, {"temperature": 0.7, "top_p": 0.9, "seed": 5}),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / f"{MODEL_ID}.gguf", n_layers=N_LAYERS)


def gate_all_streams(monkeypatch, service_mod, n: int, tokens: int) -> dict:
    """Once armed, the service's scheduler waits for `n` requests before its first answer, and holds the answer of
    the step at which all `n` sequences have sent `tokens` tokens or more until the test sets `open`."""
    gate = {"armed": False, "missed": False, "all_in": trio.Event(), "reached": trio.Event(), "open": trio.Event()}

    class Gated(service_mod.Scheduler):
        def __init__(self, pipe, **kw):
            super().__init__(pipe, **kw)
            collect = pipe.collect

            async def gated(group):
                if gate["armed"]:
                    await gate["all_in"].wait()
                    active = self._core.active
                    if len(active) < n:         # one ended first: the fault would not hit every stream
                        gate["armed"], gate["missed"] = False, (len(active), len(self._core.queue), [s.emitted for s in active])
                        gate["reached"].set()
                    elif all(s.emitted >= tokens for s in active):
                        gate["armed"] = False
                        gate["reached"].set()
                        await gate["open"].wait()
                return await collect(group)
            pipe.collect = gated

        def open(self, req, **kw):
            g = super().open(req, **kw)
            if gate["armed"] and len(self._core.active) + len(self._core.queue) >= n:
                gate["all_in"].set()
            return g
    monkeypatch.setattr(service_mod, "Scheduler", Gated)
    return gate


def stream(srv: LiveServer, k: int) -> tuple[str, str, int]:
    """Stream k of STREAMS through the official client: (text, finish_reason, completion tokens)."""
    kind, prompt, max_tokens, sampling = STREAMS[k]
    text, finish, used = [], None, None
    with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        if kind == "chat":
            chunks = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens, stream=True, **sampling)
        else:
            chunks = c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, stream=True,
                                          **sampling)
        for ch in chunks:
            if ch.usage is not None:
                used = ch.usage.completion_tokens
            for choice in ch.choices:
                part = choice.delta.content if kind == "chat" else choice.text
                text.append(part or "")
                finish = choice.finish_reason or finish
    return "".join(text), finish, used


def all_streams(srv: LiveServer) -> list[tuple[str, str, int]]:
    out: list = [None] * len(STREAMS)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            out[k] = stream(srv, k)
        except BaseException as exc:          # shown by the test
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(STREAMS))]
    for t in threads:
        t.start()
    return threads, out, errors


def finish(threads, out, errors) -> list:
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a stream never finished"
    assert not errors, errors
    return out


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_every_stream_survives_a_peer_lost_mid_answer(model, monkeypatch, fault):
    import mesh.serve.service as service_mod

    gate = gate_all_streams(monkeypatch, service_mod, len(STREAMS), 3)
    with processes() as start, LiveServer(model, peers=(), min_peers=2, max_seqs=4, max_queue=4,
                                          wait_formed=False) as srv:
        peers = [start(mesh_cmd("peer", "--join", f"127.0.0.1:{srv.reg}", "--listen", "127.0.0.1:0", "--model",
                                str(model), "--warmup", "0", "--token", TOKEN.decode(), "--name", f"p{i}"),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(2)]

        async def serving(sessions: int) -> int:
            with trio.fail_after(120):
                await srv.service.wait_state(lambda s: s.sessions >= sessions and s.state == "serving")
            return len(srv.service.session.members)
        assert srv.run(serving, 1) == 2
        undisturbed = finish(*all_streams(srv))
        # each is still going at the fault: a stream that ends early races past the others' third token (seed 2 made
        # the story stop after 16 tokens on 8-bit activations, engine/quant_i8.py, and the gate missed under load)
        assert all(used >= 20 for _, _, used in undisturbed), [(f, u) for _, f, u in undisturbed]

        srv.call(gate.__setitem__, "armed", True)
        running = all_streams(srv)

        async def reached() -> None:
            with trio.fail_after(120):
                await gate["reached"].wait()
        srv.run(reached)
        assert not gate["missed"], f"a stream ended before every stream had sent 3 tokens: {gate['missed']}"
        victim = peers[1]
        os.kill(victim.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        srv.call(gate["open"].set)
        got = finish(*running)
        assert srv.run(serving, 2) == 1                       # re-formed on the survivor
        assert srv.service.repeated == len(STREAMS)           # every sequence replayed, once
        assert srv.service.sessions == 2
        if fault == "freeze":
            victim.kill()                                     # SIGKILL ends a stopped process too
    for k, (want, have) in enumerate(zip(undisturbed, got)):
        assert have == want, f"stream {k} ({STREAMS[k][0]}, {STREAMS[k][3]})"
