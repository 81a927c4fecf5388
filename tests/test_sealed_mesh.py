"""A whole 3-peer run seen by an eavesdropper: every byte of every link (control, hops, sink, a weight shipment)
goes through a recording proxy, and the recording holds no prompt, no answer, no vocabulary, no token ids, no
weights.

Coordinator and peers run in this process (each peer's stage in its worker process). Every server binds 127.0.0.2
and a proxy on 127.0.0.1 at the same port forwards to it, so what the peers dial (the registry, the advertised hop
addresses, the sink, which the last peer finds as "the coordinator's address as seen on my control link" + port)
all crosses the recorder.
"""
from __future__ import annotations

import functools
import struct
from contextlib import AsyncExitStack

import pytest
import trio

import mesh.coordinator as coordinator
from engine.stage import Sampling
from mesh import proto
from mesh.coordinator import CoordConfig, Coordinator
from mesh.peer import Peer, PeerConfig
from tests.mesh_fixtures import free_port, write_tiny_chat_model

TOKEN = b"sealed-mesh-test-fleet-token-012"
PROMPT = "My PIN is 4711 and my password is hunter2-correct-horse"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny.gguf", n_layers=3)


def _loopback2_usable() -> bool:
    import socket
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
        return True
    except OSError:
        return False


async def _pump(src: trio.SocketStream, dst: trio.SocketStream, record: list[bytes]) -> None:
    try:
        while data := await src.receive_some(65536):
            record.append(data)
            await dst.send_all(data)
        await dst.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def proxy(port: int, record: list[bytes], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """127.0.0.1:port -> 127.0.0.2:port, remembering every byte in both directions."""
    async def handle(client: trio.SocketStream) -> None:
        try:
            server = await trio.open_tcp_stream("127.0.0.2", port)
        except OSError:
            return
        async with server, trio.open_nursery() as n:
            n.start_soon(_pump, client, server, record)
            n.start_soon(_pump, server, client, record)
    await trio.serve_tcp(handle, port, host="127.0.0.1", task_status=task_status)


@pytest.mark.slow       # three workers compile their kernels: 35-90 s on 2 loaded cores
@pytest.mark.skipif(not _loopback2_usable(), reason="127.0.0.2 cannot be bound here")
async def test_an_eavesdropper_on_every_link_learns_nothing(model, tmp_path, monkeypatch):
    record: list[bytes] = []
    real_sink = coordinator._sink_service

    async def recorded_sink(token, host, send, *, task_status=trio.TASK_STATUS_IGNORED, **kw):
        async with trio.open_nursery() as n:
            port = await n.start(functools.partial(real_sink, **kw), token, host, send)
            await n.start(proxy, port, record)
            task_status.started(port)
    monkeypatch.setattr(coordinator, "_sink_service", recorded_sink)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))

    reg = free_port()
    cfg = CoordConfig(model=model, listen=f"127.0.0.2:{reg}", token=TOKEN, min_peers=3, settle=0.3)
    coord = Coordinator(cfg)
    hops = [free_port() for _ in range(3)]
    peers = [Peer(PeerConfig(join=f"127.0.0.1:{reg}", token=TOKEN, listen=f"127.0.0.2:{port}",
                             advertise=f"127.0.0.1:{port}", warmup=0, cache_dir=tmp_path / f"cache{k}",
                             model=model if k else None))     # peer 0 has no model: its layers are shipped
             for k, port in enumerate(hops)]
    with trio.fail_after(400):
        async with trio.open_nursery() as nursery:
            await coord.serve_registry(nursery)
            for port in (reg, *hops):
                await nursery.start(proxy, port, record)
            for p in peers:
                nursery.start_soon(p.run)
            async with AsyncExitStack() as stack:
                fleet, pipe = await coord.form(nursery, stack)
                ids = coord.encode(PROMPT, template="raw")
                out = await coord.answer(pipe, ids, max_tokens=8, sampling=Sampling())
            nursery.cancel_scope.cancel()
    seen = b"".join(record)
    assert len(seen) > 50_000 and len(out) == 8        # the whole run crossed the recorder, weights included
    tok = coord.tokenizer
    vocab_blob = b"".join(tok.token_bytes(i) for i in range(tok.vocab_size))
    needles = {
        "the prompt": PROMPT.encode()[:12],
        "the PIN": b"PIN is 4711",
        "the password": b"hunter2",
        "the vocabulary": vocab_blob[:64],
        "a control token": b"<|im_start|>",
        "the prompt's token ids": struct.pack(f"<{min(len(ids), 6)}I", *ids[:6]),
        "the answer's token ids": struct.pack(f"<{6}I", *out[:6]),
        "a prompt column": struct.pack("<IIBI", 3, 0, 0, ids[3]),
        "a weight block": model.read_bytes()[-4096:-4096 + 64],
    }
    answer = tok.decode(out).encode()
    if len(answer) >= 8:
        needles["the answer"] = answer[:8]
    found = [name for name, needle in needles.items() if needle in seen]
    assert found == [], f"in the clear: {found}"
    # and the search would have found them in frames that were not sealed
    clear = proto.Codec().send(proto.Vocab(tuple(tok.token_bytes(i) for i in range(tok.vocab_size))))
    assert needles["the vocabulary"] in clear and needles["a control token"] in clear
