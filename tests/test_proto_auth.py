"""Handshake state machines and flow/liveness arithmetic, sans-IO."""
from __future__ import annotations

import pytest

import mesh.proto as p
from mesh.proto.auth import CLIENT_LABEL, SERVER_LABEL, proof

TOKEN = b"fleet-secret-0123456789abcdef"


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
    assert c.done and s.done and c.version == s.version == 1
    assert TOKEN not in seen and TOKEN[:8] not in seen


def test_open_fleet_needs_no_proofs():
    c, s = p.ClientHandshake(None, nonce("c")), p.ServerHandshake(None, nonce("s"))
    run(c, s)
    assert c.done and s.done


def test_wrong_token_fails_at_the_client_first():
    c, s = p.ClientHandshake(b"other token", nonce("c")), p.ServerHandshake(TOKEN, nonce("s"))
    with pytest.raises(p.AuthError, match="fleet token mismatch") as exc:
        run(c, s)
    assert exc.value.code == p.ErrorCode.AUTH_FAILED


def test_wrong_client_proof_fails_at_the_server():
    s = p.ServerHandshake(TOKEN, nonce("s"))
    s.receive(p.Hello(1, 1, nonce("c"), True))
    with pytest.raises(p.AuthError, match="fleet token mismatch") as exc:
        s.receive(p.AuthProof(proof(b"guess", CLIENT_LABEL, nonce("c"), nonce("s"), 1)))
    assert exc.value.code == p.ErrorCode.AUTH_FAILED and not s.done


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


def test_client_rejects_a_server_that_skips_its_proof():
    c = p.ClientHandshake(TOKEN, nonce("c"))
    c.start()
    with pytest.raises(p.AuthError, match="peer has none"):
        c.receive(p.Welcome(1, nonce("s"), b""))


def test_recorded_client_handshake_replayed_on_a_new_connection_fails():
    c, s = p.ClientHandshake(TOKEN, nonce("c")), p.ServerHandshake(TOKEN, nonce("s"))
    hello = c.start()
    (welcome,) = s.receive(hello)
    (auth_proof,) = c.receive(welcome)
    assert s.receive(auth_proof) == [p.AuthOk()]
    # An eavesdropper replays the client's two messages; the new connection's server picks a fresh nonce.
    s2 = p.ServerHandshake(TOKEN, nonce("t"))
    s2.receive(hello)
    with pytest.raises(p.AuthError, match="mismatch"):
        s2.receive(auth_proof)


def test_recorded_server_welcome_replayed_to_a_new_client_fails():
    c, s = p.ClientHandshake(TOKEN, nonce("c")), p.ServerHandshake(TOKEN, nonce("s"))
    (welcome,) = s.receive(c.start())
    c2 = p.ClientHandshake(TOKEN, nonce("d"))
    c2.start()
    with pytest.raises(p.AuthError, match="mismatch"):
        c2.receive(welcome)


def test_server_proof_cannot_be_reflected_as_client_proof():
    s = p.ServerHandshake(TOKEN, nonce("s"))
    (welcome,) = s.receive(p.Hello(1, 1, nonce("c"), True))
    with pytest.raises(p.AuthError):
        s.receive(p.AuthProof(welcome.proof))
    assert proof(TOKEN, SERVER_LABEL, nonce("c"), nonce("s"), 1) != proof(TOKEN, CLIENT_LABEL, nonce("c"),
                                                                         nonce("s"), 1)


@pytest.mark.parametrize("token", [TOKEN, None])
def test_non_hello_first_message_is_refused(token):
    s = p.ServerHandshake(token, nonce("s"))
    with pytest.raises(p.AuthError, match="first message must be Hello, got Step") as exc:
        s.receive(p.Step(0, 0, 0, (1,)))
    assert exc.value.code == (p.ErrorCode.AUTH_REQUIRED if token else p.ErrorCode.UNEXPECTED)


def test_step_instead_of_auth_proof_is_refused():
    s = p.ServerHandshake(TOKEN, nonce("s"))
    s.receive(p.Hello(1, 1, nonce("c"), True))
    with pytest.raises(p.AuthError) as exc:
        s.receive(p.Step(0, 0, 0, (1,)))
    assert exc.value.code == p.ErrorCode.AUTH_REQUIRED


def test_version_negotiation_picks_highest_common():
    s = p.ServerHandshake(None, nonce("s"), min_version=1, max_version=3)
    (welcome,) = s.receive(p.Hello(2, 5, nonce("c"), False))
    assert welcome.version == 3 and s.version == 3


def test_no_common_version():
    s = p.ServerHandshake(None, nonce("s"), min_version=1, max_version=1)
    with pytest.raises(p.AuthError, match="no common version") as exc:
        s.receive(p.Hello(2, 4, nonce("c"), False))
    assert exc.value.code == p.ErrorCode.UNSUPPORTED_VERSION


def test_short_nonce_refused():
    s = p.ServerHandshake(None, nonce("s"))
    with pytest.raises(p.AuthError, match="nonce"):
        s.receive(p.Hello(1, 1, b"short", False))
    with pytest.raises(ValueError):
        p.ClientHandshake(TOKEN, b"short")


def test_peer_error_during_handshake_is_reported():
    c = p.ClientHandshake(None, nonce("c"))
    c.start()
    with pytest.raises(p.AuthError, match="peer refused the handshake: nope") as exc:
        c.receive(p.Error(p.ErrorCode.AUTH_REQUIRED, "nope"))
    assert exc.value.code == p.ErrorCode.AUTH_REQUIRED


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
