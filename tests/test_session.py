"""A session is a scope: what it started (the sink listener, watchers, tasks) ends with it, its members are released
and re-join, and the error that ended it leaves as itself."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import trio

import mesh.coordinator as coordinator
from engine.stage import Sampling
from mesh.coordinator import CoordConfig, Coordinator
from mesh.errors import SessionError
from mesh.peer import Peer, PeerConfig
from mesh.session import open_session
from tests.mesh_fixtures import free_port, write_tiny_chat_model

TOKEN = b"session-scope-test-token-0123456789"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny.gguf", n_layers=2)


async def test_a_session_closes_its_sink_and_releases_its_members(model, monkeypatch):
    sinks: list[int] = []
    real_sink = coordinator._sink_service

    async def recorded_sink(token, host, send, *, task_status=trio.TASK_STATUS_IGNORED, **kw):
        async with trio.open_nursery() as n:
            port = await n.start(functools.partial(real_sink, **kw), token, host, send)
            sinks.append(port)
            task_status.started(port)
    monkeypatch.setattr(coordinator, "_sink_service", recorded_sink)
    reg = free_port()
    coord = Coordinator(CoordConfig(model=model, listen=f"127.0.0.1:{reg}", token=TOKEN, settle=0.1))
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            await coord.serve_registry(nursery)
            nursery.start_soon(Peer(PeerConfig(join=f"127.0.0.1:{reg}", token=TOKEN, listen="127.0.0.1:0",
                                               model=model, warmup=0, rejoin_max_delay=0.25)).run)
            for k in range(2):       # a chat re-forms like this; before, every old sink listener stayed open
                async with open_session(coord) as s:
                    members = list(s.members)
                    ids = coord.encode("hello", template="raw")
                    out = await coord.answer(s.pipe, ids, max_tokens=3, sampling=Sampling())
                    assert len(out) >= 1
                with pytest.raises(OSError):
                    await trio.open_tcp_stream("127.0.0.1", sinks[-1])
                await coord.registry.wait_rejoined(members, 1)       # released: the peer re-joins as a new member
            assert len(set(sinks)) == 2

            with pytest.raises(SessionError, match="on purpose"):   # the error leaves as itself, not in a group
                async with open_session(coord) as s:
                    async def fail(*, task_status=trio.TASK_STATUS_IGNORED):
                        task_status.started()
                        raise SessionError("failed on purpose")
                    await s.start(fail)
                    await trio.sleep_forever()
            nursery.cancel_scope.cancel()

