"""A peer in chain mode computes a sequence's decode steps from their frames' plaintext (Peer._steady_step,
mesh/proto/steady.py) once it has run one the usual way: the first, a middle-less last and a lone stage send on
exactly what the usual path sends (tokens and hidden rows bitwise those of the Stage run in-process), and a step of
another shape (a new sequence's sampling, another slot) goes the usual way again. A fake coordinator drives a real
peer in-process over its control link; the peer forwards to a sink this test listens on."""
from __future__ import annotations

import numpy as np
import pytest
import trio

import transport
from engine.stage import Stage
from mesh import proto
from mesh.peer import Peer, PeerConfig
from tests.mesh_fixtures import link_handler, write_tiny_chat_model

pytestmark = pytest.mark.slow  # a peer loading a tiny model, each step shape compiled once (a few seconds)

TOKEN = b"steady-step-tests"
PROMPT = [5, 9, 17, 33, 2, 60]
DECODES = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny.gguf", n_layers=2)


def reference(model, start: int, end: int, inputs: list) -> list:
    """Each step's output of the stage run in-process (token ids of the last stage, hidden rows otherwise)."""
    stage = Stage.load(model, start, end, n_slots=2, max_context=64)
    return [np.asarray(stage.step(cols, hidden, sampling)) for cols, hidden, sampling in inputs]


def steps(model, sampling=proto.Sampling()) -> list:
    """The prompt and DECODES decode steps of slot 0 (tokens of the whole model, greedy), with the rows a stage
    starting at layer 1 receives."""
    whole = Stage.load(model, 0, 2, n_slots=2, max_context=64)
    first = Stage.load(model, 0, 1, n_slots=2, max_context=64)
    cols = [proto.Column(i, 0, i == len(PROMPT) - 1, t) for i, t in enumerate(PROMPT)]
    out = []
    for k in range(DECODES + 1):
        tok = int(whole.step(cols, None, sampling)[0])
        out.append((cols, np.asarray(first.step(cols)), sampling))
        cols = [proto.Column(len(PROMPT) + k, 0, True, tok)]
    return out


@pytest.mark.parametrize("steady", ["1", "0"])
@pytest.mark.parametrize("span", [(0, 2), (0, 1), (1, 2)])
async def test_steady_steps_send_what_the_usual_path_sends(model, monkeypatch, span, steady):
    monkeypatch.setenv("MESH_STEADY", steady)
    monkeypatch.setenv("MESH_STAGE_IN_PEER", "1")
    start, end = span
    inputs = steps(model)
    want = reference(model, start, end, [(c, None if start == 0 else h, s) for c, h, s in inputs])
    sessions = trio.open_memory_channel(4)
    sinks = trio.open_memory_channel(4)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(transport.serve_listener, "127.0.0.1", 0,
                                   link_handler(TOKEN, sessions[0], proto.Join))
        sink_port = await nursery.start(transport.serve_listener, "127.0.0.1", 0, link_handler(TOKEN, sinks[0]))
        peer = Peer(PeerConfig(join=f"127.0.0.1:{port}", token=TOKEN, listen="127.0.0.1:0", model=model, warmup=0))
        nursery.start_soon(peer.run)
        with trio.fail_after(120):
            control, end_session = await sessions[1].receive()
            await control.send(proto.Load(start, end, 2, peer.identity, n_slots=2, max_context=64))
            ack = await control.receive()
            assert isinstance(ack, proto.Ack) and ack.code == 0, ack
            await control.send(proto.Chain(f"127.0.0.1:{sink_port}", sink=True))
            ack = await control.receive()
            assert isinstance(ack, proto.Ack) and ack.code == 0, ack
            out, end_sink = await sinks[1].receive()

            async def run(group, cols, hidden, sampling):
                act = None if start == 0 else proto.Activation("f32", hidden.shape, hidden.astype(np.float32).tobytes())
                await control.send(proto.BatchStep(group, False, tuple(cols), act, (sampling,)))
                got = await out.receive()
                assert got.group == group, got
                if end == 2:
                    assert isinstance(got, proto.Done), got
                    return np.array(got.tokens)
                assert isinstance(got, proto.BatchStep) and got.columns == tuple(cols), got
                assert got.sampling == (sampling,)
                return np.frombuffer(got.hidden.data, np.float32).reshape(got.hidden.shape)

            before = peer.steady_steps
            got = [await run(g, *step) for g, step in enumerate(inputs)]
            for a, b in zip(got, want):
                assert a.shape == b.shape and a.tobytes() == b.astype(a.dtype).tobytes()
            # loaded without warmup: the prompt's and the first decode's shapes compile in the op loop's thread,
            # the second decode runs in the reader the usual way (learned), the other DECODES - 2 are steady
            assert peer.steady_steps - before == (DECODES - 2 if steady == "1" else 0)
            # another slot (its own prompt first) is another shape: the usual way, then steady again
            before = peer.steady_steps
            other = [([proto.Column(c.pos, 1, c.needs_logits, c.token) for c in cols], h, s)
                     for cols, h, s in inputs[:4]]
            got = [await run(100 + g, *step) for g, step in enumerate(other)]
            for a, b in zip(got, want[:4]):
                assert a.tobytes() == b.astype(a.dtype).tobytes()
            assert peer.steady_steps - before == (2 if steady == "1" else 0)
            end_sink.set()
            end_session.set()
        nursery.cancel_scope.cancel()
