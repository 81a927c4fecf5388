"""Handshake state machines, sealed frames, and flow/liveness arithmetic, sans-IO."""
from __future__ import annotations

import pytest

import mesh.proto as p
from mesh.proto.auth import CLIENT_LABEL, SERVER_LABEL
from mesh.proto.codec import HEADER
from mesh.proto.seal import prove

TOKEN = b"fleet-secret-0123456789abcdef"
V = p.PROTOCOL_VERSION


def nonce(ch: str) -> bytes:
    return ch.encode() * p.NONCE_SIZE


def wire(events):
    """Through a real codec, so what the machines exchange is what travels."""
    codec = p.Codec()
    out = []
    if not events:
        return out, b""
    codec.receive_data(b"".join(codec.send(e) for e in events))
    while (ev := codec.next_event()) is not p.NEED_DATA:
        out.append(ev)
    return out, b"".join(p.Codec().send(e) for e in events)


def run(client: p.ClientHandshake, server: p.ServerHandshake) -> bytes:
    """Drive both machines to completion; return every byte that crossed the wire."""
    seen = b""
    to_server, raw = wire([client.start()])
    seen += raw
    while not (client.done and server.done):
        to_client = [out for ev in to_server for out in server.receive(ev)]
        to_client, raw = wire(to_client)
        seen += raw
        to_server = [out for ev in to_client for out in client.receive(ev)]
        to_server, raw = wire(to_server)
        seen += raw
    return seen


def test_mutual_auth_succeeds_and_token_never_travels():
    c, s = p.ClientHandshake(TOKEN, nonce("c")), p.ServerHandshake(TOKEN, nonce("s"))
    seen = run(c, s)
    assert c.done and s.done and c.version == s.version == V
    assert TOKEN not in seen and TOKEN[:8] not in seen
    # one key per direction, the same on both ends
    assert c.keys.send == s.keys.receive and c.keys.receive == s.keys.send and c.keys.send != c.keys.receive


def test_open_fleet_needs_no_proofs_but_still_derives_keys():
    c, s = p.ClientHandshake(None, nonce("c")), p.ServerHandshake(None, nonce("s"))
    run(c, s)
    assert c.done and s.done and c.keys.send == s.keys.receive


def test_the_server_proves_nothing_before_the_client_did():
    """A stranger that dials in gets a nonce and a public key: nothing to test token guesses against."""
    s = p.ServerHandshake(TOKEN, nonce("s"))
    (welcome,) = s.receive(p.Hello(V, V, nonce("c"), bytes(range(32)), True))
    assert set(type(welcome).__dataclass_fields__) == {"version", "nonce", "public_key"}
    with pytest.raises(p.AuthError, match="fleet token mismatch") as exc:
        s.receive(p.AuthProof(bytes(32)))
    assert exc.value.code == p.ErrorCode.AUTH_FAILED and not s.done


def test_wrong_token_fails_at_the_server_first():
    c, s = p.ClientHandshake(b"other token", nonce("c")), p.ServerHandshake(TOKEN, nonce("s"))
    with pytest.raises(p.AuthError, match="client's proof does not verify") as exc:
        run(c, s)
    assert exc.value.code == p.ErrorCode.AUTH_FAILED


def test_missing_token_on_client():
    c, s = p.ClientHandshake(None, nonce("c")), p.ServerHandshake(TOKEN, nonce("s"))
    with pytest.raises(p.AuthError, match="requires a fleet token") as exc:
        run(c, s)
    assert exc.value.code == p.ErrorCode.AUTH_REQUIRED


def test_missing_token_on_server():
    c, s = p.ClientHandshake(TOKEN, nonce("c")), p.ServerHandshake(None, nonce("s"))
    with pytest.raises(p.AuthError, match="this peer has none") as exc:
        run(c, s)
    assert exc.value.code == p.ErrorCode.AUTH_FAILED


def test_client_rejects_a_forged_server_proof():
    c, s = p.ClientHandshake(TOKEN, nonce("c")), p.ServerHandshake(TOKEN, nonce("s"))
    (welcome,) = s.receive(c.start())
    c.receive(welcome)
    with pytest.raises(p.AuthError, match="server's proof does not verify"):
        c.receive(p.AuthOk(bytes(32)))


def test_recorded_client_handshake_replayed_on_a_new_connection_fails():
    c, s = p.ClientHandshake(TOKEN, nonce("c")), p.ServerHandshake(TOKEN, nonce("s"))
    hello = c.start()
    (welcome,) = s.receive(hello)
    (auth_proof,) = c.receive(welcome)
    assert isinstance(s.receive(auth_proof)[0], p.AuthOk)
    # An eavesdropper replays the client's two messages; the new server picks a fresh nonce and key.
    s2 = p.ServerHandshake(TOKEN, nonce("t"))
    s2.receive(hello)
    with pytest.raises(p.AuthError, match="mismatch"):
        s2.receive(auth_proof)


def test_a_proof_cannot_be_reflected():
    c, s = p.ClientHandshake(TOKEN, nonce("c")), p.ServerHandshake(TOKEN, nonce("s"))
    (welcome,) = s.receive(c.start())
    (auth_proof,) = c.receive(welcome)
    (ok,) = s.receive(auth_proof)
    assert ok.proof != auth_proof.proof
    c2, s2 = p.ClientHandshake(TOKEN, nonce("c")), p.ServerHandshake(TOKEN, nonce("s"))
    (welcome2,) = s2.receive(c2.start())
    c2.receive(welcome2)
    with pytest.raises(p.AuthError):           # the client's own proof sent back as the server's
        c2.receive(p.AuthOk(prove(c2.keys.client_proof, CLIENT_LABEL)))
    assert prove(c2.keys.server_proof, SERVER_LABEL) != prove(c2.keys.client_proof, CLIENT_LABEL)


def test_a_low_order_public_key_is_refused():
    s = p.ServerHandshake(TOKEN, nonce("s"))
    with pytest.raises(p.AuthError, match="X25519") as exc:
        s.receive(p.Hello(V, V, nonce("c"), bytes(32), True))   # the all-zero point: a shared secret of zeros
    assert exc.value.code == p.ErrorCode.MALFORMED


@pytest.mark.parametrize("token", [TOKEN, None])
def test_non_hello_first_message_is_refused(token):
    s = p.ServerHandshake(token, nonce("s"))
    with pytest.raises(p.AuthError, match="first message must be Hello, got Step") as exc:
        s.receive(p.Step(0, 0, 0, (1,)))
    assert exc.value.code == (p.ErrorCode.AUTH_REQUIRED if token else p.ErrorCode.UNEXPECTED)


def test_step_instead_of_auth_proof_is_refused():
    s = p.ServerHandshake(TOKEN, nonce("s"))
    s.receive(p.Hello(V, V, nonce("c"), p.ClientHandshake(TOKEN, nonce("c")).public, True))
    with pytest.raises(p.AuthError) as exc:
        s.receive(p.Step(0, 0, 0, (1,)))
    assert exc.value.code == p.ErrorCode.AUTH_REQUIRED


def test_version_negotiation_picks_highest_common():
    s = p.ServerHandshake(None, nonce("s"), min_version=1, max_version=3)
    (welcome,) = s.receive(p.Hello(2, 5, nonce("c"), p.ClientHandshake(None, nonce("c")).public, False))
    assert welcome.version == 3 and s.version == 3


def test_no_common_version():
    s = p.ServerHandshake(None, nonce("s"), min_version=1, max_version=1)
    with pytest.raises(p.AuthError, match="no common version") as exc:
        s.receive(p.Hello(2, 4, nonce("c"), bytes(32), False))
    assert exc.value.code == p.ErrorCode.UNSUPPORTED_VERSION


def test_short_nonce_and_key_refused():
    s = p.ServerHandshake(None, nonce("s"))
    with pytest.raises(p.AuthError, match="nonce"):
        s.receive(p.Hello(V, V, b"short", bytes(32), False))
    with pytest.raises(p.AuthError, match="key is 3 bytes"):
        p.ServerHandshake(None, nonce("s")).receive(p.Hello(V, V, nonce("c"), b"key", False))
    with pytest.raises(ValueError):
        p.ClientHandshake(TOKEN, b"short")


def test_peer_error_during_handshake_is_reported():
    c = p.ClientHandshake(None, nonce("c"))
    c.start()
    with pytest.raises(p.AuthError, match="peer refused the handshake: nope") as exc:
        c.receive(p.Error(p.ErrorCode.AUTH_REQUIRED, "nope"))
    assert exc.value.code == p.ErrorCode.AUTH_REQUIRED


# ------------------------------------------------------------------------------------------ sealed frames


def sealed_pair():
    c, s = p.ClientHandshake(TOKEN, nonce("c")), p.ServerHandshake(TOKEN, nonce("s"))
    run(c, s)
    tx, rx = p.Codec(), p.Codec()
    tx.seal(c.keys.send, c.keys.receive)
    rx.seal(s.keys.send, s.keys.receive)
    return tx, rx


def frames(data: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(data):
        n = HEADER.size + HEADER.unpack_from(data, at)[3]
        out.append(data[at:at + n])
        at += n
    return out


def test_sealed_frames_hide_type_and_payload_and_round_trip():
    tx, rx = sealed_pair()
    events = [p.Tokens(7, (101, 202, 303)), p.ShipChunk(0, bytes(range(256)) * 512), p.Error(p.ErrorCode.BUSY, "x")]
    data = b"".join(tx.send(e) for e in events)
    assert all(f[1] == p.MsgType.SEALED for f in frames(data))
    assert bytes(range(256)) not in data and (101).to_bytes(4, "little") + (202).to_bytes(4, "little") not in data
    rx.receive_data(data)
    got = [rx.next_event() for _ in events]
    assert got == events and rx.next_event() is p.NEED_DATA


@pytest.mark.parametrize("attack", ["flip", "replay", "reorder", "drop", "clear"])
def test_an_altered_replayed_reordered_or_dropped_frame_fails_the_link(attack):
    tx, rx = sealed_pair()
    f = [tx.send(p.Tokens(i, (i,))) for i in range(3)]
    if attack == "flip":
        f[1] = f[1][:-3] + bytes([f[1][-3] ^ 1]) + f[1][-2:]
    elif attack == "replay":
        f[1] = f[0]
    elif attack == "reorder":
        f[0], f[1] = f[1], f[0]
    elif attack == "drop":
        del f[0]
    else:
        f[1] = p.Codec().send(p.Tokens(1, (1,)))     # a frame in the clear, injected after the handshake
    rx.receive_data(b"".join(f))
    events = []
    with pytest.raises(p.ProtocolError) as exc:
        while True:
            events.append(rx.next_event())
    assert exc.value.code == p.ErrorCode.AUTH_FAILED
    assert events == ([] if attack in ("reorder", "drop") else [p.Tokens(0, (0,))])


def test_a_frame_sealed_with_another_token_does_not_open():
    tx, _ = sealed_pair()
    _, rx = sealed_pair()           # the same nonces and labels, but fresh X25519 keys: other link keys
    rx.receive_data(tx.send(p.Reset()))
    with pytest.raises(p.ProtocolError, match="does not open"):
        rx.next_event()


def test_the_handshake_frame_limit_refuses_a_big_frame_at_its_header():
    codec = p.Codec(max_frame=p.HANDSHAKE_MAX_FRAME)
    with pytest.raises(p.ProtocolError) as exc:
        codec.receive_data(HEADER.pack(V, p.MsgType.HELLO, 0, 64 << 20) + bytes(100))
    assert exc.value.code == p.ErrorCode.FRAME_TOO_LARGE and codec.buffered() == 0


# ------------------------------------------------------------------------------------------ flow and liveness


def test_flow_window_sender_may_overshoot_by_one_frame_only():
    fw = p.FlowWindow(1000, max_frame=4096)
    assert not fw.can_send()
    fw.on_window_update(p.WindowUpdate(1000))
    fw.on_sent(900)
    assert fw.can_send()
    fw.on_sent(4000)  # credit 100 > 0: the frame may go, and credit goes negative
    assert not fw.can_send()
    with pytest.raises(RuntimeError):
        fw.on_sent(64)
    fw.on_window_update(p.WindowUpdate(3901))
    assert fw.can_send()


def test_flow_window_receiver_returns_credit_in_half_windows():
    fw = p.FlowWindow(1000, max_frame=4096)
    assert fw.initial_update() == p.WindowUpdate(1000)
    fw.on_received(400)
    fw.on_received(400)
    assert fw.buffered() == 800
    assert fw.on_consumed(400) is None
    assert fw.on_consumed(400) == p.WindowUpdate(800)
    assert fw.buffered() == 0


def test_flow_window_receiver_catches_an_overrun():
    fw = p.FlowWindow(1000, max_frame=4096)
    fw.initial_update()
    fw.on_received(999)
    fw.on_received(p.frame_cost(4096 + 8))  # the one allowed overshoot
    with pytest.raises(p.ProtocolError) as exc:
        fw.on_received(64)
    assert exc.value.code == p.ErrorCode.FLOW_CONTROL


def test_frame_cost_has_a_floor():
    assert p.frame_cost(8) == p.MIN_FRAME_COST and p.frame_cost(10_000) == 10_000
    assert not p.flow_controlled(p.MsgType.PING) and p.flow_controlled(p.MsgType.STEP)


def test_liveness_pings_and_declares_death():
    lv = p.Liveness(100.0, ping_interval=1.0, dead_after=5.0)
    assert lv.ping_due(100.0) == p.Ping(1)
    assert lv.ping_due(100.5) is None
    lv.on_pong(1, 100.25)
    assert lv.rtt == pytest.approx(0.25)
    assert lv.ping_due(101.0) == p.Ping(2)
    lv.on_receive(102.0)
    assert not lv.is_dead(106.9) and lv.is_dead(107.0) and lv.dead_at() == 107.0
