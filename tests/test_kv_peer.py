"""Block tables over the wire: a fake coordinator drives a real peer (and its worker) in-process. The peer reports
its KV pool in Info (and the bytes of its KV values), applies BlockTable in order before the step that follows it, and answers a table that names
another slot's block with an Error, staying usable."""
from __future__ import annotations

import os

import pytest
import trio

import transport
from mesh import proto
from mesh.link import RemoteError, open_link
from mesh.peer import Peer, PeerConfig
from tests.mesh_fixtures import write_tiny_chat_model

TOKEN = b"kv-tables"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny.gguf", n_layers=2)


@pytest.mark.slow  # starts a worker process (~20 s on a quiet box)
async def test_block_tables_reach_the_peers_stage(model):
    prompt = [(11 * i + 5) % 200 + 3 for i in range(20)]

    async def ask(link, ev):
        await link.send(ev)
        return await link.receive()

    async def generate(link, slot, group):
        cols = tuple(proto.Column(i, slot, i == len(prompt) - 1, t) for i, t in enumerate(prompt))
        out = [(await ask(link, proto.BatchStep(group, True, cols))).tokens[0]]
        for k in range(3):
            col = (proto.Column(len(prompt) + k, slot, True, out[-1]),)
            out.append((await ask(link, proto.BatchStep(group + 1 + k, False, col))).tokens[0])
        return out

    result: dict = {}
    done = trio.Event()

    async def coordinator(stream):
        try:
            await drive(stream)
        except BaseException as exc:  # noqa: BLE001 (the listener would only log it: the test re-raises it)
            result["error"] = exc
        finally:
            done.set()

    async def drive(stream):
        async with open_link(stream, token=TOKEN, role="server") as control:
            assert isinstance(await control.receive(), proto.Join)
            info = await ask(control, proto.InfoRequest())
            assert (info.kv_blocks, info.kv_block_size) == (0, 0)  # nothing loaded yet
            result["kv_bytes"] = info.kv_bytes  # what its KV values will take: the planner prices layers by it
            ack = await ask(control, proto.Load(0, 2, 2, info.fingerprint))
            assert ack.ok, ack.reason
            info = await ask(control, proto.InfoRequest())
            result["pool"] = (info.kv_blocks, info.kv_block_size)
            result["own"] = await generate(control, 0, 10)  # the stage grows slot 0's table itself
            await control.send(proto.BlockTable(1, (9, 2)))  # slot 1's table from "the scheduler"
            result["sent"] = await generate(control, 1, 20)
            with pytest.raises(RemoteError, match="block 2 belongs to slot 1"):
                await ask(control, proto.BlockTable(2, (2,)))
            await control.send(proto.ZeroSlot(1))  # frees blocks 9 and 2: now slot 2 may have them
            await control.send(proto.BlockTable(2, (2, 9)))
            result["reused"] = await generate(control, 2, 30)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(transport.serve_listener, "127.0.0.1", 0, coordinator)
        peer = Peer(PeerConfig(join=f"127.0.0.1:{port}", token=TOKEN, listen="127.0.0.1:0", model=model,
                               n_slots=4, max_context=64, warmup=0))
        nursery.start_soon(peer.run)
        with trio.fail_after(240):
            await done.wait()
        nursery.cancel_scope.cancel()
    if "error" in result:
        raise result["error"]
    assert result["pool"] == (4 * 64 // 16, 16)
    assert result["kv_bytes"] == (4 if os.environ.get("MESH_KV_DTYPE") == "f32" else 2)  # a CPU stage: f16
    assert result["own"] == result["sent"] == result["reused"]
