"""The sans-IO WebSocket framing, checked against wsproto's independent implementation in both directions."""

import re
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto.frame_protocol import FrameProtocol

from transport import wsframe
from transport.wsframe import Close, CloseCode, Data, FrameDecoder, FrameError, Ping, Pong


def drain(decoder, wire, cuts):
    """Feed `wire` cut at `cuts`, collecting events after every piece."""
    events = []
    start = 0
    for cut in sorted(set(cuts)) + [len(wire)]:
        decoder.receive_data(wire[start:cut])
        start = cut
        while (event := decoder.next_event()) is not None:
            events.append(event)
    return events


def messages_from(events):
    out, current = [], bytearray()
    for event in events:
        if isinstance(event, Data):
            current += event.payload
            if event.message_end:
                out.append(bytes(current))
                current = bytearray()
    return out


@settings(max_examples=60, deadline=None)
@given(
    messages=st.lists(st.binary(max_size=3000), min_size=1, max_size=4),
    fragment=st.integers(1, 700),
    cuts=st.lists(st.integers(0, 20000), max_size=12),
    client_side=st.booleans(),
)
def test_decodes_wsproto_frames_in_any_cuts(messages, fragment, cuts, client_side):
    # wsproto frames as the peer: a client peer masks, a server peer does not
    peer = FrameProtocol(client=not client_side, extensions=[])
    wire = bytearray()
    for message in messages:
        pieces = [message[i : i + fragment] for i in range(0, len(message), fragment)] or [b""]
        for i, piece in enumerate(pieces):
            wire += peer.send_data(piece, fin=i == len(pieces) - 1)
        wire += peer.ping(b"pp")
    wire += peer.close(1000, "bye")
    events = drain(FrameDecoder(client=client_side, max_message=10_000), bytes(wire), [c % (len(wire) + 1) for c in cuts])
    assert messages_from(events) == messages
    assert [e for e in events if isinstance(e, Ping)] == [Ping(b"pp")] * len(messages)
    assert events[-1] == Close(1000, "bye")


@settings(max_examples=60, deadline=None)
@given(payload=st.binary(max_size=5000), masked=st.booleans())
def test_wsproto_decodes_our_frames(payload, masked):
    ours = b"".join(bytes(b) for b in wsframe.encode_frame(payload, opcode=wsframe.Opcode.BINARY, fin=True, masked=masked))
    peer = FrameProtocol(client=not masked, extensions=[])
    peer.receive_bytes(ours)
    frames = list(peer.received_frames())
    assert b"".join(f.payload for f in frames) == payload
    assert frames[-1].message_finished


def test_large_unmasked_frame_is_written_without_copying_the_payload():
    payload = memoryview(bytes(100_000))
    header, body = wsframe.encode_frame(payload, opcode=wsframe.Opcode.BINARY, masked=False)
    assert body is payload
    assert header == b"\x82\x7f" + struct.pack("!Q", 100_000)


def test_mask_handles_odd_lengths_and_key_rotation_across_reads():
    peer = FrameProtocol(client=True, extensions=[])
    payload = bytes(range(251)) * 7  # odd length, not a multiple of 4
    wire = bytes(peer.send_data(payload, fin=True))
    decoder = FrameDecoder(client=False, max_message=10_000)
    got = bytearray()
    for i in range(0, len(wire), 7):  # every read splits the payload at a new key offset
        decoder.receive_data(wire[i : i + 7])
        while (event := decoder.next_event()) is not None:
            got += event.payload
    assert got == payload


def test_pong_and_empty_close_round_trip():
    decoder = FrameDecoder(client=True, max_message=100)
    decoder.receive_data(wsframe.encode_pong(b"x", masked=False) + wsframe.encode_close(CloseCode.NO_STATUS, masked=False))
    assert decoder.next_event() == Pong(b"x")
    assert decoder.next_event() == Close(CloseCode.NO_STATUS, "")
    decoder.receive_data(b"\x82\x01z")  # nothing after a Close is read
    assert decoder.next_event() is None


def server_frame(first: int, second: int, rest: bytes = b"") -> bytes:
    return bytes([first, second]) + rest


@pytest.mark.parametrize(
    ("wire", "code", "reason"),
    [
        (server_frame(0xC2, 0x00), 1002, "reserved bits"),
        (server_frame(0x83, 0x00), 1002, "unknown opcode"),
        (server_frame(0x82, 0x80, b"\0\0\0\0"), 1002, "must not mask"),
        (server_frame(0x09, 0x00), 1002, "fragmented or over 125"),
        (server_frame(0x89, 0x7E, b"\x00\x7e" + b"p" * 126), 1002, "fragmented or over 125"),
        (server_frame(0x82, 0x7E, b"\x00\x05" + b"abcde"), 1002, "shortest form"),
        (server_frame(0x82, 0x7F, struct.pack("!Q", 1000)), 1002, "shortest form"),
        (server_frame(0x82, 0x7F, struct.pack("!Q", 1 << 63)), 1002, "over 2**63"),
        (server_frame(0x80, 0x01, b"x"), 1002, "continuation frame outside"),
        (server_frame(0x02, 0x01, b"a") + server_frame(0x82, 0x01, b"b"), 1002, "new message began"),
        (server_frame(0x81, 0x02, b"hi"), 1003, "text"),
        (server_frame(0x82, 0x7E, struct.pack("!H", 200)), 1009, "limit of 100 bytes"),
        (server_frame(0x02, 0x3C, b"a" * 60) + server_frame(0x80, 0x3C), 1009, "limit of 100 bytes"),
        (server_frame(0x88, 0x01, b"\x03"), 1002, "one byte"),
        (server_frame(0x88, 0x02, struct.pack("!H", 1005)), 1002, "invalid close code 1005"),
        (server_frame(0x88, 0x02, struct.pack("!H", 2000)), 1002, "invalid close code 2000"),
        (server_frame(0x88, 0x04, struct.pack("!H", 1000) + b"\xff\xfe"), 1007, "not UTF-8"),
    ],
)
def test_violations_raise_frame_error_with_close_code(wire, code, reason):
    decoder = FrameDecoder(client=True, max_message=100)
    decoder.receive_data(wire)
    with pytest.raises(FrameError, match=re.escape(reason)) as info:
        while decoder.next_event() is not None:
            pass
    assert info.value.code == code


def test_client_frames_must_be_masked():
    decoder = FrameDecoder(client=False, max_message=100)
    decoder.receive_data(server_frame(0x82, 0x01, b"x"))
    with pytest.raises(FrameError, match="must mask"):
        decoder.next_event()


def test_oversize_message_refused_at_the_header_before_its_payload():
    decoder = FrameDecoder(client=True, max_message=1000)
    decoder.receive_data(b"\x82\x7f" + struct.pack("!Q", 1 << 40))  # no payload sent at all
    with pytest.raises(FrameError) as info:
        decoder.next_event()
    assert info.value.code == CloseCode.MESSAGE_TOO_BIG


def test_control_frames_may_interleave_a_fragmented_message():
    peer = FrameProtocol(client=False, extensions=[])
    wire = peer.send_data(b"ab", fin=False) + peer.ping(b"1") + peer.send_data(b"cd", fin=True)
    events = drain(FrameDecoder(client=True, max_message=100), bytes(wire), [])
    assert messages_from(events) == [b"abcd"]
    assert events.index(Ping(b"1")) == 1  # between the two halves


def test_payload_is_handed_out_before_the_frame_is_complete():
    decoder = FrameDecoder(client=True, max_message=1 << 20)
    decoder.receive_data(b"\x82\x7f" + struct.pack("!Q", 100_000) + b"a" * 1000)
    assert decoder.next_event() == Data(b"a" * 1000, False)
    assert decoder.next_event() is None
    decoder.receive_data(b"b" * 99_000)
    assert decoder.next_event() == Data(b"b" * 99_000, True)
