"""The service keeps serving while peers come and go: a new peer is taken in when the service is idle, a peer that
leaves makes it re-form from the rest, and the answers stay bitwise the unsharded engine's throughout."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest
import trio

from tests.serve_fixtures import LiveServer
from tests.mesh_fixtures import write_tiny_chat_model
from tests.test_serve_api import MODEL_ID, chat_reference

pytestmark = pytest.mark.slow       # in-process peers re-form several times, each loading its worker: 25-40 s a test on 2 loaded cores
N_LAYERS = 2


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / f"{MODEL_ID}.gguf", n_layers=N_LAYERS)


def _answer(srv: LiveServer) -> str:
    with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        r = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hello there"}],
                                      max_tokens=12, temperature=0)
    return r.choices[0].message.content


def _wait_session(srv: LiveServer, number: int) -> int:
    async def wait() -> int:
        with trio.fail_after(120):
            await srv.service.wait_state(lambda s: s.sessions >= number and s.state == "serving")
        return len(srv.service.session.members)
    return srv.run(wait)


def gate_step(monkeypatch, service_mod, *, armed: bool, at: int) -> dict:
    """Make the service's scheduler hold the answer of its `at`-th step once armed: `reached` is set there, and the
    answer is collected only after the test sets `open`. Returns the gate (a dict the test arms and reads)."""
    gate = {"armed": armed, "left": at, "reached": trio.Event(), "open": trio.Event()}

    class Gated(service_mod.Scheduler):
        def __init__(self, pipe, **kw):
            super().__init__(pipe, **kw)
            collect = pipe.collect

            async def gated(group):
                if gate["armed"]:
                    gate["left"] -= 1
                    if gate["left"] == 0:
                        gate["armed"] = False
                        gate["reached"].set()
                        await gate["open"].wait()
                return await collect(group)
            pipe.collect = gated
    monkeypatch.setattr(service_mod, "Scheduler", Gated)
    return gate


def test_peers_come_and_go_and_the_answers_stay_the_same(model):
    expected, _ = chat_reference(model, "Hello there", 12)
    with LiveServer(model) as srv:
        assert _wait_session(srv, 1) == 1 and _answer(srv) == expected
        srv.call(srv.add_peer)                  # a second machine joins: taken in while nothing runs
        assert _wait_session(srv, 2) == 2
        assert [r[1:] for r in srv.service.session.ranges] == [(0, 1), (1, 2)]
        assert _answer(srv) == expected
        srv.call(srv.stop_peer, 0)              # one leaves: the survivor takes every layer
        assert _wait_session(srv, 3) == 1
        assert _answer(srv) == expected


def test_an_answer_survives_a_peer_that_leaves_mid_stream(model, monkeypatch):
    """A stage leaves while an answer streams: the service re-forms on the survivor, repeats the request there and
    sends only what the client has not seen; the client gets exactly the unsharded engine's text, once."""
    import threading

    import mesh.serve.service as service_mod
    from tests.mesh_fixtures import unsharded_tokens
    from tests.test_serve_api import text_of

    expected = text_of(model, unsharded_tokens(model, N_LAYERS, "Once upon a time", 60))
    # the 8th step's answer of the armed request waits until the test has taken a peer away, so the failure lands
    # mid-answer whatever the machine's speed
    gate = gate_step(monkeypatch, service_mod, armed=False, at=8)
    with LiveServer(model, peers=((0, None), (0, None))) as srv:
        assert len(srv.service.session.members) == 2
        srv.call(gate.__setitem__, "armed", True)
        got: list[str] = []

        def client() -> None:
            with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120) as c:
                for ch in c.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=60,
                                               temperature=0, stream=True):
                    got.append(ch.choices[0].text)
        reader = threading.Thread(target=client)
        reader.start()

        async def wait_reached() -> None:
            with trio.fail_after(120):
                await gate["reached"].wait()
        srv.run(wait_reached)
        srv.call(srv.stop_peer, 1)
        srv.call(gate["open"].set)
        reader.join(180)
        assert not reader.is_alive()
        assert srv.service.repeated == 1 and srv.service.sessions == 2
        assert len(srv.service.session.members) == 1
    assert "".join(got) == expected


def test_a_client_gone_from_a_non_streamed_request_frees_its_sequence(model, monkeypatch):
    """A non-streamed answer is held at its 5th step while its client closes the connection: the service notices the
    disconnect, leaves the sequence, and the scheduler is idle again long before max_tokens would have been made."""
    import json
    import socket

    import mesh.serve.service as service_mod

    gate = gate_step(monkeypatch, service_mod, armed=True, at=5)
    with LiveServer(model) as srv:
        body = json.dumps({"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0})
        with socket.create_connection(("127.0.0.1", srv.port)) as s:       # a client that will vanish
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}".encode())

            async def wait_reached() -> None:
                with trio.fail_after(120):
                    await gate["reached"].wait()
            srv.run(wait_reached)
        # the socket is closed here, mid-answer

        async def release_and_wait_idle() -> int:
            gate["open"].set()
            with trio.fail_after(60):
                while (st := srv.service.scheduler.stats()).active or st.queued:
                    await trio.sleep(0.02)
            return st.tokens_out
        assert srv.run(release_and_wait_idle) < 100
        assert _answer(srv)              # and the next request is served
