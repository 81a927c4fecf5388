"""A peer's inbound hops belong to the session in which they were accepted.

When a session ends, a predecessor from that session may still be computing and forwarding; if its hop outlived the
session, its stale steps would reach the next session's stage (seen: a re-formed single-stage fleet refused a hidden
state sent by the old first stage). Here a fake coordinator drives a real peer in-process.
"""
from __future__ import annotations

import pytest
import trio

import transport
from mesh import proto
from mesh.link import LinkError, open_link
from mesh.peer import Peer, PeerConfig
from tests.mesh_fixtures import write_tiny_chat_model

TOKEN = b"sessions"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny.gguf", n_layers=2)


async def test_a_hop_accepted_in_one_session_closes_when_that_session_ends(model):
    joins: trio.MemorySendChannel
    joins, joined = trio.open_memory_channel(4)

    async def coordinator(stream):
        async with open_link(stream, token=TOKEN, role="server") as control:
            join = await control.receive()
            assert isinstance(join, proto.Join)
            done = trio.Event()
            await joins.send((control, join, done))
            await done.wait()          # the session lasts until the test ends it

    async with trio.open_nursery() as nursery:
        port = await nursery.start(transport.serve_listener, "127.0.0.1", 0, coordinator)
        peer = Peer(PeerConfig(join=f"127.0.0.1:{port}", token=TOKEN, listen="127.0.0.1:0", model=model))
        nursery.start_soon(peer.run)
        with trio.fail_after(60):
            _, join, end_session = await joined.receive()
            hop_stream = await transport.dial(f"127.0.0.1:{join.listen_port}")
            async with open_link(hop_stream, token=TOKEN, role="client") as hop:
                await hop.send(proto.InfoRequest())
                assert isinstance(await hop.receive(), proto.Info)      # served while its session lasts
                end_session.set()
                _, join2, end2 = await joined.receive()                 # the peer re-joins: a new session
                with pytest.raises(LinkError):                          # the old session's hop is gone with it
                    await hop.send(proto.InfoRequest())
                    await hop.receive()
            new_stream = await transport.dial(f"127.0.0.1:{join2.listen_port}")
            async with open_link(new_stream, token=TOKEN, role="client") as hop2:
                await hop2.send(proto.InfoRequest())
                assert isinstance(await hop2.receive(), proto.Info)     # a hop of the new session is served
            end2.set()
        nursery.cancel_scope.cancel()
