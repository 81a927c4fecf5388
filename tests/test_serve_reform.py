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
