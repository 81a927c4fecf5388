"""Who takes part in a session (mesh.admission), peers' names in the registry, LeftOut reaching a peer, backoff."""
from __future__ import annotations

import logging
from contextlib import AsyncExitStack

import pytest
import trio

import transport
from mesh import proto
from mesh.admission import layer_mb, leave_out
from mesh.errors import leaf_errors
from mesh.link import RemoteError, open_link
from mesh.peer import Peer, PeerConfig, backoff
from mesh.planner import StageReport
from mesh.registry import Registry, name_problem
from mesh.report import DonorReport
from tests.mesh_fixtures import write_tiny_chat_model

TOKEN = b"admission-tests"
LC = proto.LeftOutCode


def stage(name, start=0, end=0, *, pinned=False, memory=1000):
    return StageReport(name, start, end, 12, memory, pinned, "")


def codes(out):
    return [(e.index, e.code) for e in out]


def test_a_pinned_range_that_overlaps_an_earlier_one_is_left_out_with_both_ranges_named():
    out = leave_out(0, 12, [stage("a", 0, 6, pinned=True), stage("b", 4, 8, pinned=True),
                            stage("c", 6, 12, pinned=True)], 10)
    assert codes(out) == [(1, LC.PINNED_OVERLAP)]
    assert out[0].reason == "b is pinned to layers 4..8, which overlap layers 0..6 of a, pinned first"


def test_pins_over_the_coordinators_own_layers_or_beyond_the_model_are_left_out():
    out = leave_out(3, 12, [stage("a", 0, 6, pinned=True), stage("b", 6, 14, pinned=True), stage("c")], 10)
    assert codes(out) == [(0, LC.PINNED_OVERLAP), (1, LC.OTHER)]
    assert "coordinator's own layers 0..3" in out[0].reason and "model has 12 layers" in out[1].reason


def test_a_peer_with_less_memory_than_one_layer_is_left_out_and_unknown_memory_is_kept():
    out = leave_out(0, 12, [stage("big", memory=4000), stage("tiny", memory=5), stage("unknown", memory=0)], 37.6)
    assert codes(out) == [(1, LC.MEMORY)]
    assert out[0].reason == "tiny offers 5 MB; one layer of this model needs 38 MB"


def test_surplus_peers_are_the_latest_joined():
    out = leave_out(0, 12, [stage("p", 0, 10, pinned=True)] + [stage(f"u{i}") for i in range(4)], 1)
    assert codes(out) == [(3, LC.SURPLUS), (4, LC.SURPLUS)]
    assert out[0].reason == "u2 is not needed: 4 unpinned peers for 2 free layers"
    full = leave_out(0, 12, [stage("p", 0, 12, pinned=True), stage("u")], 1)
    assert codes(full) == [(1, LC.SURPLUS)] and "pinned peers hold every layer" in full[0].reason


def test_nobody_is_left_out_of_a_fleet_that_fits():
    assert leave_out(0, 12, [stage("a", 0, 6, pinned=True), stage("b"), stage("c")], 1) == []


def test_layer_mb_is_the_largest_blocks_weights(tmp_path):
    model = write_tiny_chat_model(tmp_path / "m.gguf", n_layers=2)
    from engine.gguf_meta import read_gguf
    blk0 = sum(t.nbytes for n, t in read_gguf(model).tensors.items() if n.startswith("blk.0."))
    assert layer_mb(model) == pytest.approx(blk0 / 2**20)


@pytest.mark.parametrize("name, ok", [("studio-mac", True), ("pi.local", True), ("x" * 64, True), ("x" * 65, False),
                                      ("two words", False), ("bell\x07", False), ("", True)])
def test_name_rule(name, ok):
    assert (name_problem(name) is None) is ok


async def _join(stack, port, name):
    link = await stack.enter_async_context(open_link(await transport.dial(f"127.0.0.1:{port}"), token=TOKEN,
                                                     role="client"))
    await link.send(proto.Join(1, "", 100, -1, -1, name))
    return link


async def test_the_registry_names_peers_by_their_own_names_and_tells_apart_two_of_one_name():
    reg = Registry(TOKEN)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(reg.serve, "127.0.0.1", 0)
        async with AsyncExitStack() as stack:
            for n, name in enumerate(("studio", "studio", ""), 1):
                await _join(stack, port, name)
                with trio.fail_after(10):
                    while len(reg.members) < n:
                        await reg._changed.wait()
            assert [m.name for m in reg.members] == ["studio (127.0.0.1)", "studio#2 (127.0.0.1)",
                                                     "peer 3 (127.0.0.1)"]
            link = await _join(stack, port, "has space")
            with pytest.raises(RemoteError, match="Join.name 'has space' must be printable, without spaces"):
                with trio.fail_after(10):
                    await link.receive()
        nursery.cancel_scope.cancel()


async def test_a_left_out_peer_hears_why_and_rejoins_the_pool(tmp_path, caplog):
    model = write_tiny_chat_model(tmp_path / "tiny.gguf", n_layers=2)
    joins, joined = trio.open_memory_channel(4)

    async def coordinator(stream):
        async with open_link(stream, token=TOKEN, role="server") as control:
            await joins.send(await control.receive())
            await control.send(proto.LeftOut(LC.PINNED_OVERLAP, "studio is pinned to layers 0..2, which overlap"))
            await trio.sleep_forever()

    caplog.set_level(logging.INFO, "mesh.peer")
    async with trio.open_nursery() as nursery:
        port = await nursery.start(transport.serve_listener, "127.0.0.1", 0, coordinator)
        peer = Peer(PeerConfig(join=f"127.0.0.1:{port}", token=TOKEN, name="studio", listen="127.0.0.1:0",
                               model=model))
        nursery.start_soon(peer.run)
        with trio.fail_after(60):
            first = await joined.receive()
            again = await joined.receive()         # told why, it comes back to wait for a later session
        assert first.name == again.name == "studio"
        nursery.cancel_scope.cancel()
    assert "left out of this session by the coordinator: studio is pinned to layers 0..2, which overlap " \
           "(pinned overlap)" in caplog.text


async def test_a_peer_that_lost_its_coordinator_backs_off_and_says_how_long_it_has_waited(caplog):
    caplog.set_level(logging.WARNING, "mesh.peer")
    with trio.socket.socket() as s:         # a port nobody listens on: every dial is refused at once
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        peer = Peer(PeerConfig(join=f"127.0.0.1:{port}", token=TOKEN, rejoin_delay=0.01, rejoin_max_delay=0.04,
                               retry_for=0.3))
        with pytest.raises(Exception, match=r"unreachable for 0s \(--retry-for 0.3\)"):
            await peer._join_loop()
    lines = [r.getMessage() for r in caplog.records if "next try in" in r.getMessage()]
    assert len(lines) >= 4 and all(f"coordinator 127.0.0.1:{port} unreachable for " in x for x in lines)
    delays = [float(x.rsplit("next try in ", 1)[1].rstrip("s")) for x in lines]
    assert delays[0] == pytest.approx(0.01, abs=0.005) and max(delays) <= 0.04


def test_backoff_doubles_up_to_its_cap_with_a_little_jitter():
    d, seen = 0.25, []
    for _ in range(10):
        d = backoff(d, 15.0)
        seen.append(d)
    assert 0.45 <= seen[0] <= 0.5 and all(13.5 <= x <= 15.0 for x in seen[-3:])


def test_no_show_text_keeps_the_conversation_out_of_the_donor_line():
    cols = [proto.Column(0, 0, False, 0), proto.Column(1, 0, True, 1)]
    shown, hidden = DonorReport(layers=(0, 2)), DonorReport(layers=(0, 2), show_text=False)
    for r in (shown, hidden):
        r.record(cols, 0.01, (b"secret ", b"plans"))
    assert "secret plans" in shown.line()
    line = hidden.line()
    assert line.startswith("[donor] layers 0..2 | 1 steps") and "serving" not in line and "secret" not in line
    assert hidden.recent == bytearray()


async def test_a_peer_whose_join_is_refused_hears_why_and_stops(tmp_path):
    from mesh.peer import PeerRefused
    model = write_tiny_chat_model(tmp_path / "tiny.gguf", n_layers=2)
    reg = Registry(TOKEN)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(reg.serve, "127.0.0.1", 0)
        peer = Peer(PeerConfig(join=f"127.0.0.1:{port}", token=TOKEN, name="two words", listen="127.0.0.1:0",
                               model=model))
        with pytest.raises(BaseException) as exc:           # the CLI makes it one line (mesh.cli._exit_on)
            with trio.fail_after(60):
                await peer.run()
        (leaf,) = leaf_errors(exc.value)
        assert isinstance(leaf, PeerRefused)
        assert str(leaf) == "the coordinator refused this peer: Join.name 'two words' must be printable, without spaces"
        nursery.cancel_scope.cancel()
