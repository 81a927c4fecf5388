"""What a stranger on the network can and cannot do (issue: encrypted links, an authenticated sink, bounded
pre-auth cost, no oracle, verified caches). In-process, on loopback; nothing sleeps on a clock.
"""
from __future__ import annotations

import io
import logging
import os
import struct

import pytest
import trio

import transport
from engine.gguf_meta import read_model_meta
from engine.gguf_range import plan_range_gguf
from mesh import proto
from mesh.coordinator import _sink_service, _SinkEnded
from mesh.identity import model_identity
from mesh.link import PreAuthGate, open_link
from mesh.logsafe import clean, install
from mesh.proto.codec import HEADER
from mesh.registry import Registry
from mesh.shipping import complete_entry
from tests.tiny_gguf import write_tiny_gguf

TOKEN = b"security-tests-fleet-token-0123"
V = proto.PROTOCOL_VERSION


async def _stranger(port: int, data: bytes, *, read: bool = True) -> bytes:
    """Connect, send `data`, half-read what comes back until the server closes; returns what the server sent."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    got = b""
    try:
        if data:
            await stream.send_all(data)
        while read:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            got += chunk
    except trio.BrokenResourceError:
        pass
    finally:
        await stream.aclose()
    return got


def _hello(auth: bool = True) -> bytes:
    hs = proto.ClientHandshake(TOKEN if auth else None, os.urandom(proto.NONCE_SIZE))
    return proto.Codec().send(hs.start())


# ---------------------------------------------------------------------------------------------------- the sink

async def test_strangers_at_the_sink_never_touch_the_answer():
    """Garbage, one byte, half handshakes and a wrong token, sent to the sink port between an answer's tokens: the
    answer's Done frames arrive whole and in order, and nothing else reaches the session."""
    send, receive = trio.open_memory_channel(64)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_sink_service, TOKEN, "127.0.0.1", send)
        stream = await transport.dial(f"127.0.0.1:{port}")
        async with open_link(stream, token=TOKEN, role="client") as last_stage:
            attacks = [b"\x01", b"\xff" * 64, os.urandom(5000), _hello(), _hello()[:20], _hello(auth=False),
                       b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"]
            for group, attack in enumerate(attacks, start=1):
                await last_stage.send(proto.Done(group, (group * 7,)))
                await _stranger(port, attack)           # returns once the sink dropped it
            wrong = await transport.dial(f"127.0.0.1:{port}")
            with pytest.raises(Exception, match="mismatch"):
                async with open_link(wrong, token=b"a wrong fleet token, long enough", role="client"):
                    pass
            await last_stage.send(proto.Done(99, (1,)))
            got = [await receive.receive() for _ in range(len(attacks) + 1)]
        assert got == [proto.Done(g, (g * 7,)) for g in range(1, len(attacks) + 1)] + [proto.Done(99, (1,))]
        # the authenticated hop closing IS the session's business
        assert isinstance(await receive.receive(), _SinkEnded)
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------------------------- pre-auth cost

def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def test_eight_connections_claiming_64_mib_frames_cost_almost_nothing():
    registry = Registry(TOKEN)
    payload = bytes(1 << 20)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(registry.serve, "127.0.0.1", 0)
        await _stranger(port, HEADER.pack(V, proto.MsgType.HELLO, 0, 1024) + bytes(1024))   # warm the code paths
        before = _rss_kb()

        async def big_frame() -> None:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            try:
                await stream.send_all(HEADER.pack(V, proto.MsgType.HELLO, 0, 64 << 20))
                for _ in range(16):                  # 16 MiB of the announced 64 MiB, or until we are cut off
                    await stream.send_all(payload)
            except trio.BrokenResourceError:
                pass
            finally:
                await stream.aclose()

        async with trio.open_nursery() as attackers:
            for _ in range(8):
                attackers.start_soon(big_frame)
        grown_mb = (_rss_kb() - before) / 1024
        assert registry.members == []
        nursery.cancel_scope.cancel()
    assert grown_mb < 10, f"RSS grew {grown_mb:.1f} MB"


async def test_connections_spamming_errors_write_little_log(caplog):
    """An Error as the first frame is logged escaped, cut short, and rate-limited: a forged log line stays inside
    its own line, and 5 connections looping write under 100 KB."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    install(handler)
    root = logging.getLogger()
    root.addHandler(handler)
    registry = Registry(TOKEN)
    forged = "x" * 700 + "\n12:00:00 mesh.registry: peer 7 (10.0.0.7) joined\x1b[2J"
    frame = proto.Codec().send(proto.Error(proto.ErrorCode.BUSY, forged))
    try:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(registry.serve, "127.0.0.1", 0)

            async def spam() -> None:
                for _ in range(60):
                    await _stranger(port, frame)

            async with trio.open_nursery() as spammers:
                for _ in range(5):
                    spammers.start_soon(spam)
            nursery.cancel_scope.cancel()
    finally:
        root.removeHandler(handler)
    text = out.getvalue()
    assert 0 < len(text.encode()) < 100_000, len(text.encode())
    assert "\x1b" not in text and "\npeer 7" not in text and "\n12:00:00" not in text
    assert "similar lines suppressed" in text or text.count("\n") <= 12


async def test_a_full_gate_closes_further_handshakes_at_once():
    gate = PreAuthGate(limit=3)
    pairs = [trio.testing.memory_stream_pair() for _ in range(5)]
    started = []

    async def serve(stream) -> None:
        try:
            async with open_link(stream, token=TOKEN, role="server", gate=gate):
                pass
        except Exception as exc:
            started.append(type(exc).__name__)

    async with trio.open_nursery() as nursery:
        for _, server_end in pairs:
            nursery.start_soon(serve, server_end)
        await trio.testing.wait_all_tasks_blocked()
        assert gate.pending == 3 and gate.refused == 2 and started == ["GateFull", "GateFull"]
        nursery.cancel_scope.cancel()
    assert gate.pending == 0


def test_network_text_is_escaped_and_cut():
    assert clean("a\nb\x1b[2Jc\u202e") == "a\\nb\\x1b[2Jc\\u202e"
    assert clean("y" * 900).endswith("…") and len(clean("y" * 900)) == 501


# ---------------------------------------------------------------------------------------------------- caches

def _same_fingerprint_pair(tmp_path):
    """Two GGUFs the engine's header fingerprint cannot tell apart: the second has the middle of its big tensors
    rewritten, away from the 4 KiB the fingerprint samples at each end of every tensor."""
    import gguf
    a = write_tiny_gguf(tmp_path / "a.gguf", n_layers=2, ffn_dim=512, vocab_size=64)
    b = tmp_path / "b.gguf"
    data = bytearray(a.read_bytes())
    for t in gguf.GGUFReader(str(a)).tensors:
        if t.n_bytes > 3 * 4096:
            mid = t.data_offset + 4096
            data[mid:mid + t.n_bytes - 2 * 4096] = os.urandom(t.n_bytes - 2 * 4096)
    b.write_bytes(bytes(data))
    return a, b


def test_a_same_fingerprint_model_has_another_identity_and_cannot_poison_the_cache(tmp_path):
    a, b = _same_fingerprint_pair(tmp_path)
    assert read_model_meta(a).fingerprint == read_model_meta(b).fingerprint      # the old identity: one model
    ida, idb = model_identity(a, tmp_path / "memo"), model_identity(b, tmp_path / "memo")
    assert ida != idb
    cache = tmp_path / "cache"
    plan = plan_range_gguf(b, 0, 1, fingerprint=idb)           # the impostor's coordinator ships its range
    (cache / idb).mkdir(parents=True)
    plan.write_to(cache / idb / plan.name)
    assert complete_entry(cache, idb, 0, 1) is not None
    assert complete_entry(cache, ida, 0, 1) is None            # the honest coordinator's Load finds nothing of it
    assert read_model_meta(cache / idb / plan.name).fingerprint == idb


def test_identity_is_remembered_by_path_size_mtime_and_inode(tmp_path):
    a = write_tiny_gguf(tmp_path / "a.gguf", n_layers=2)
    memo = tmp_path / "memo"
    first = model_identity(a, memo)
    assert len(list(memo.iterdir())) == 1 and model_identity(a, memo) == first
    data = bytearray(a.read_bytes())
    data[-1] ^= 1
    st = a.stat()
    a.write_bytes(bytes(data))                                   # same size; a new mtime
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert model_identity(a, memo) != first


@pytest.mark.parametrize("damage", ["flipped byte", "randomized range", "no digest"])
async def test_a_damaged_cached_range_is_reported_and_shipped_again(tmp_path, damage, caplog):
    """A modelless peer's cached range is checked byte for byte against the Load's digest before it loads: one
    flipped bit (size and mtime unchanged) or a randomized range answers NEED_WEIGHTS, and the entry is gone."""
    from mesh.identity import verify_file
    from mesh.peer import Peer, PeerConfig
    src = write_tiny_gguf(tmp_path / "src.gguf", n_layers=2, ffn_dim=512, vocab_size=64)
    identity = model_identity(src)
    plan = plan_range_gguf(src, 0, 1, fingerprint=identity)
    digest = plan.sha256()
    cache = tmp_path / "cache"
    (cache / identity).mkdir(parents=True)
    entry = plan.write_to(cache / identity / plan.name)
    assert verify_file(entry, digest) and complete_entry(cache, identity, 0, 1) == entry
    st = entry.stat()
    data = bytearray(entry.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0x10
    elif damage == "randomized range":
        half = len(data) // 2                                    # the header stays, the weights are noise
        data[half:] = os.urandom(len(data) - half)
    entry.write_bytes(bytes(data))
    os.utime(entry, ns=(st.st_atime_ns, st.st_mtime_ns))       # as bit rot would: same size, same mtime
    assert complete_entry(cache, identity, 0, 1) == entry        # the header still says it is that range
    peer = Peer(PeerConfig(join="127.0.0.1:9", token=TOKEN, cache_dir=cache))
    load = proto.Load(0, 1, 2, identity, b"" if damage == "no digest" else digest)
    with caplog.at_level(logging.WARNING, logger="mesh.peer"):
        code, reason = await peer._handle_load(load)
    assert code == proto.LoadCode.NEED_WEIGHTS
    if damage == "no digest":
        assert entry.exists() and "digest" in reason
    else:
        assert "digest check" in reason and not entry.exists()
        assert "do not match the coordinator's digest" in caplog.text


async def test_a_websocket_link_is_sealed_too():
    secret = b"the prompt travels sealed over WebSocket as well"
    got = []

    async def handler(stream) -> None:
        async with open_link(stream, token=TOKEN, role="server") as link:
            got.append(await link.receive())
            await link.send(proto.Vocab((secret,)))
            await link.receive()

    class Tap(trio.abc.Stream):
        def __init__(self, inner) -> None:
            self.inner, self.seen = inner, bytearray()

        async def send_all(self, data) -> None:
            self.seen += data
            await self.inner.send_all(data)

        async def wait_send_all_might_not_block(self) -> None:
            await self.inner.wait_send_all_might_not_block()

        async def receive_some(self, max_bytes=None):
            data = await self.inner.receive_some(max_bytes)
            self.seen += data
            return data

        async def aclose(self) -> None:
            await self.inner.aclose()

    async with trio.open_nursery() as nursery:
        port = await nursery.start(transport.serve_listener, "127.0.0.1", 0, handler)
        raw = await trio.open_tcp_stream("127.0.0.1", port)
        tap = Tap(raw)
        ws = await transport.ws_connect(tap, f"127.0.0.1:{port}")
        async with open_link(ws, token=TOKEN, role="client") as link:
            await link.send(proto.Vocab((secret,)))
            assert await link.receive() == proto.Vocab((secret,))
        nursery.cancel_scope.cancel()
    assert got == [proto.Vocab((secret,))]
    assert b"HTTP/1.1 101" in tap.seen and secret[:16] not in tap.seen
