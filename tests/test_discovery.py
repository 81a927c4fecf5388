"""LAN discovery (mesh.discovery): the datagram formats, the fleet keys, the answer gate, and a responder and a finder
talking over loopback UDP. The namespace test with two fleets on one bridge is tests/test_netns_discovery.py."""
from __future__ import annotations

import socket

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh import discovery as d

KEYS = d.FleetKeys.from_token(b"the-fleet-token-0123456789")
OTHER = d.FleetKeys.from_token(b"another-fleets-token-abcdef")
NONCE = bytes(range(16))
ANSWER = d.Answer(KEYS.fleet_id, NONCE, "10.0.0.5", 9000, "studio")


def test_fleet_keys_are_keyed_hashes_of_the_token_and_tell_fleets_apart():
    assert d.FleetKeys.from_token(b"the-fleet-token-0123456789") == KEYS          # deterministic
    assert KEYS.fleet_id != OTHER.fleet_id and KEYS.mac_key != OTHER.mac_key
    assert len(KEYS.fleet_id) == d.FLEET_ID and len(KEYS.mac_key) == 32
    assert d.FleetKeys.from_token(None) == d.FleetKeys.from_token(b"")          # open fleets share one id
    wire = d.encode_query(d.Query(KEYS.fleet_id, NONCE)) + d.encode_answer(ANSWER, KEYS)
    assert b"fleet-token" not in wire and b"0123456789" not in wire


def test_the_query_format_is_magic_kind_fleet_id_nonce():
    data = d.encode_query(d.Query(KEYS.fleet_id, NONCE))
    assert data == b"MESHd1\x01" + KEYS.fleet_id + NONCE and len(data) == 31
    assert d.decode(data, KEYS) == d.Query(KEYS.fleet_id, NONCE)
    assert d.decode(data, OTHER) is None                      # another fleet's query is not ours to answer
    assert d.decode(data + b"x", KEYS) is None


def test_an_answer_round_trips_and_its_mac_covers_every_byte():
    data = d.encode_answer(ANSWER, KEYS)
    assert data.startswith(b"MESHd1\x02" + KEYS.fleet_id + NONCE + (9000).to_bytes(2, "little") + b"\x0810.0.0.5")
    assert d.decode(data, KEYS) == ANSWER and ANSWER.addr == "10.0.0.5:9000"
    assert d.decode(data, OTHER) is None
    for i in range(len(data)):                                # an address or port swapped in by a stranger fails
        assert d.decode(data[:i] + bytes([data[i] ^ 1]) + data[i + 1:], KEYS) is None, i
    forged = d.encode_answer(d.Answer(KEYS.fleet_id, NONCE, "10.6.6.6", 9000, "evil"), OTHER)
    assert d.decode(KEYS.fleet_id.join([forged[:7], forged[15:]]), KEYS) is None   # right id, wrong key
    assert d.decode(data[:-1], KEYS) is None


def test_an_ipv6_answer_is_bracketed_and_a_non_address_host_is_refused():
    v6 = d.Answer(KEYS.fleet_id, NONCE, "fd00::2", 9100, "")
    assert d.decode(d.encode_answer(v6, KEYS), KEYS).addr == "[fd00::2]:9100"
    assert d.decode(d.encode_answer(d.Answer(KEYS.fleet_id, NONCE, "evil.example", 9, ""), KEYS), KEYS) is None


@settings(deadline=None, max_examples=300)
@given(st.binary(max_size=200), st.integers(0, 120))
def test_decode_never_raises_on_network_input(noise, cut):
    valid = d.encode_answer(ANSWER, KEYS)
    for data in (noise, b"MESHd1\x02" + KEYS.fleet_id + noise, valid[:cut] + noise):
        assert d.decode(data, KEYS) in (None, ANSWER) or isinstance(d.decode(data, KEYS), d.Query)


def test_the_gate_answers_a_nonce_once_and_at_most_rate_a_second():
    gate = d.AnswerGate(rate=3)
    q = [d.Query(KEYS.fleet_id, bytes([i]) * 16) for i in range(6)]
    assert gate.admit(q[0], 10.0) and not gate.admit(q[0], 10.1)       # the multicast and broadcast copies
    assert gate.admit(q[1], 10.2) and gate.admit(q[2], 10.3) and not gate.admit(q[3], 10.4)
    assert gate.admit(q[3], 11.0)


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


async def test_a_peer_finds_the_coordinator_of_its_fleet_and_only_that_one():
    port = _free_udp_port()
    async with trio.open_nursery() as nursery:
        for token, registry_port, name in ((b"fleet-a-token-000000", 9100, "coord-a"),
                                           (b"fleet-b-token-000000", 9200, "coord-b")):
            assert await nursery.start(d.Responder(token, "", registry_port, name, port=port).serve)
        with trio.fail_after(20):
            a = await d.find_coordinator(b"fleet-a-token-000000", within=10, port=port)
            b = await d.find_coordinator(b"fleet-b-token-000000", within=10, port=port)
        assert (a.name, a.port, b.name, b.port) == ("coord-a", 9100, "coord-b", 9200)
        assert a.host in {i.ip for i in d.interfaces()}       # an address of this machine, on the route to us
        with pytest.raises(d.DiscoveryError) as exc:
            await d.find_coordinator(b"fleet-c-token-000000", within=0.5, port=port)
        nursery.cancel_scope.cancel()
    assert "no coordinator of this fleet answered on the local network within 0.5s" in str(exc.value)
    assert "--join HOST:PORT" in str(exc.value)


async def test_a_responder_bound_to_one_address_answers_with_that_address():
    port = _free_udp_port()
    async with trio.open_nursery() as nursery:
        await nursery.start(d.Responder(b"fleet-a-token-000000", "127.0.0.1", 9100, "c", port=port).serve)
        with trio.fail_after(20):
            a = await d.find_coordinator(b"fleet-a-token-000000", within=10, port=port)
        assert a.addr == "127.0.0.1:9100"
        nursery.cancel_scope.cancel()


async def test_a_peer_without_join_that_finds_nobody_says_so_and_suggests_join(caplog):
    import logging

    from mesh.errors import MeshError
    from mesh.peer import Peer, PeerConfig
    caplog.set_level(logging.WARNING, "mesh.peer")
    peer = Peer(PeerConfig(join=None, token=b"nobody-answers-this-token", discover_for=0.3,
                           discovery_port=_free_udp_port(), rejoin_delay=0.05, retry_for=0.5))
    with pytest.raises(MeshError) as exc:
        with trio.fail_after(20):
            await peer._join_loop()
    assert str(exc.value).startswith("a coordinator of this fleet unreachable for ")
    assert "(--retry-for 0.5): no coordinator of this fleet answered on the local network within 0.3s" in str(exc.value)
    assert "give its address with --join HOST:PORT" in str(exc.value)
    assert "next try in" in caplog.text and "--join HOST:PORT" in caplog.text     # said before giving up
