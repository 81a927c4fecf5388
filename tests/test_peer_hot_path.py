"""A peer rings its worker from the Link reader (Peer._take_step) when a step arrives on an idle stage, and from the
op loop otherwise. Either way the tokens are those of the stage run in-process, in-band ops keep their place ahead of
the steps behind them, and a link that ends with a rung step pending leaves the peer usable. A fake coordinator
drives a real peer in-process over its control link (hub mode: replies come back on the same link)."""
from __future__ import annotations

import numpy as np
import pytest
import trio

import transport
from engine.stage import Stage
from mesh import proto
from mesh.link import Link, RemoteError
from mesh.peer import Peer, PeerConfig
from tests.mesh_fixtures import link_handler, write_tiny_chat_model

pytestmark = pytest.mark.slow  # starts a worker process (a few seconds: tiny model, no warmup)

TOKEN = b"hot-path-tests"
PROMPT = [5, 9, 17, 33, 2, 60]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny.gguf", n_layers=2)


def reference(model, n: int) -> list[int]:
    """Greedy tokens of the stage run in-process: the prompt, then n - 1 decode steps."""
    stage = Stage.load(model, 0, 2, n_slots=2, max_context=64)
    cols = [proto.Column(i, 0, i == len(PROMPT) - 1, t) for i, t in enumerate(PROMPT)]
    toks = [int(stage.step(cols)[0])]
    for pos in range(len(PROMPT), len(PROMPT) + n - 1):
        toks.append(int(stage.step([proto.Column(pos, 0, True, toks[-1])])[0]))
    return toks


@pytest.mark.parametrize("mode", ["worker", "in-peer", "in-peer-write-deferred"])
async def test_steps_rung_from_the_reader_equal_the_stage_and_keep_inband_order(model, monkeypatch, mode):
    """Worker: steps are rung into the worker from the reader (opt-in, MESH_RING_FROM_READER=1). Stage in the peer
    (the CPU default): a step of a compiled shape is computed in the reader and its output written from there; when
    that write cannot happen at once (deferred: here forced), the op loop sends the output held for it."""
    monkeypatch.setenv("MESH_RING_FROM_READER", "1")     # opt-in (off by default: not shown to pay on 2 cores)
    monkeypatch.setenv("MESH_STAGE_IN_PEER", "0" if mode == "worker" else "1")
    if mode == "in-peer-write-deferred":
        monkeypatch.setattr(Link, "send_nowait", lambda self, ev: False)
    want = reference(model, 6)
    sessions = trio.open_memory_channel(4)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(transport.serve_listener, "127.0.0.1", 0,
                                   link_handler(TOKEN, sessions[0], proto.Join))
        peer = Peer(PeerConfig(join=f"127.0.0.1:{port}", token=TOKEN, listen="127.0.0.1:0", model=model, warmup=0))
        nursery.start_soon(peer.run)
        with trio.fail_after(120):
            control, end = await sessions[1].receive()
            await control.send(proto.Load(0, 2, 2, peer.identity, n_slots=2, max_context=64))
            ack = await control.receive()
            assert isinstance(ack, proto.Ack) and ack.code == 0, ack

            async def step(group, cols) -> int:
                await control.send(proto.BatchStep(group, False, tuple(cols)))
                got = await control.receive()
                assert isinstance(got, proto.Tokens) and got.group == group, got
                return got.tokens[0]

            before = (peer.reader_rings, peer.reader_steps, peer.reader_held)
            toks = [await step(1, [proto.Column(i, 0, i == len(PROMPT) - 1, t) for i, t in enumerate(PROMPT)])]
            for k, pos in enumerate(range(len(PROMPT), len(PROMPT) + 5)):
                toks.append(await step(2 + k, [proto.Column(pos, 0, True, toks[-1])]))
            counts = tuple(a - b for a, b in zip((peer.reader_rings, peer.reader_steps, peer.reader_held), before))
            # each arrived on an idle stage: rung by the reader (worker); in the peer, loaded without warmup, each
            # shape's first step compiles in a thread (the op loop's), the other 4 run in the reader
            assert counts == {"worker": (6, 0, 0), "in-peer": (0, 4, 0), "in-peer-write-deferred": (0, 0, 4)}[mode]
            assert toks == want
            # A ZeroSlot and the step behind it in one write (one read on the peer's side): the step is queued
            # behind the ZeroSlot, so it is not rung from the reader and runs after it: on the emptied slot,
            # position 6 is refused (rung ahead of the ZeroSlot, it would have given a token, or hung the op loop)
            async with control._send_lock:
                await control.stream.send_all(b"".join(b"".join(control._codec.frame(control._codec.prepare(ev)))
                                                       for ev in (proto.ZeroSlot(0), proto.BatchStep(
                                                           9, False, (proto.Column(len(PROMPT), 0, True, toks[0]),)))))
            with pytest.raises(RemoteError, match="skips ahead of slot 0"):
                await control.receive()
            assert await step(10, [proto.Column(i, 0, i == len(PROMPT) - 1, t) for i, t in enumerate(PROMPT)]) \
                == want[0]
            end.set()

            # The next session: a step rung, then its link gone before the reply is read. The peer stays usable.
            control, end = await sessions[1].receive()
            await control.send(proto.BatchStep(1, False, tuple(
                proto.Column(i, 1, i == len(PROMPT) - 1, t) for i, t in enumerate(PROMPT))))
            await control.aclose()
            control, end = await sessions[1].receive()      # the peer re-joins once the session ended
            await control.send(proto.BatchStep(2, False, tuple(
                proto.Column(i, 1, i == len(PROMPT) - 1, t) for i, t in enumerate(PROMPT))))
            got = await control.receive()
            assert isinstance(got, proto.Tokens) and got.tokens[0] == want[0]
            assert np.all(np.array(got.tokens) >= 0)
            end.set()
        nursery.cancel_scope.cancel()
