"""mesh.proto codec: round trips, split input, fuzzing, bounds. Pure, no I/O."""
from __future__ import annotations

import ast
import math
import pathlib
import struct
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mesh.proto as p
from mesh.proto.codec import HEADER

ACT = p.Activation("f16", (2, 3), bytes(range(12)))
SAMPLES: list[p.Event] = [
    p.Hello(2, 2, b"n" * 32, b"k" * 32, True),
    p.Welcome(2, b"s" * 32, b"p" * 32),
    p.AuthProof(b"q" * 32),
    p.AuthOk(b"q" * 32),
    p.Ping(2**64 - 1),
    p.Pong(7),
    p.WindowUpdate(1 << 20),
    p.Error(p.ErrorCode.BUSY, "someone else is shipping layers 0..4 — wait"),
    p.Shutdown(),
    p.Join(7000, "10.0.0.5:7000", 8192, 0, 12),
    p.Join(7001, "", 4096),
    p.Join(7002, "", 0, -1, -1, "studio-mac"),
    p.LeftOut(p.LeftOutCode.PINNED_OVERLAP, "pinned to layers 0..12, which overlap 10..20 of pi (10.0.0.9)"),
    p.InfoRequest(),
    p.Info(0, 15, 30, 8192, True, "ab" * 16, "CUDA", True),
    p.Info(0, 15, 30, 8192, True, "ab" * 16, "CUDA", True, 512, 16),
    p.Info(0, 15, 30, 8192, False, "", "METAL", False, 0, 0, 1.25, 3.5, 0.4, True, bytes(100)),
    p.Info(0, 15, 30, 8192, False, "", "CPU", True, 256, 16, kv_bytes=2),
    p.InfoRequest("ab" * 16, b"\0" * 64),
    p.Load(15, 30, 30, "ab" * 16),
    p.Load(0, 10, 30, "ab" * 16, bytes(32), 9, 512, 3),
    p.Ack(p.MsgType.LOAD, p.LoadCode.NEED_WEIGHTS, "no cached range"),
    p.Ack(p.MsgType.SHIP_END),
    p.Vocab((b"<s>", b"", b"\xff\xfe", "é".encode() * 200)),
    p.Chain(":7001", True),
    p.Chain(""),
    p.StatsRequest(),
    p.Stats(2**40, 7, 123456789),
    p.Step(3, 1, 17, (1, 2, 3), None, p.SamplingParams(0.7, 40, 0.95, 2**64 - 1)),
    p.Step(3, 1, 17, (), p.Activation("f32", (1, 4), bytes(16))),
    p.BatchStep(9, False, (p.Column(4, 0, True, 11), p.Column(5, 1)), ACT),
    p.BatchStep(9, True, (), None),
    p.BatchInit(16),
    p.BlockTable(2, (5, 6, 7)),
    p.ZeroSlot(3),
    p.Rollback(3, 40),
    p.Reset(),
    p.Draft(1, 50, 123, 4),
    p.DraftBatch(4, ((1, 2, 3), (4, 5, 6))),
    p.DraftSeed(1, 2),
    p.Hidden(5, p.Activation("bf16", (3, 2), bytes(12))),
    p.Tokens(5, (1, 2**32 - 1)),
    p.Done(5, (42,)),
    p.ShipBegin("ab" * 16, 0, 15, 123456789012, b"h" * 32, "0-15.gguf"),
    p.ShipResume(4096),
    p.ShipChunk(4096, b"\x00" * 1000),
    p.ShipEnd(b"h" * 32),
    p.Signal(p.SignalKind.OFFER),
    p.Signal(p.SignalKind.ANSWER, "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\n"),
    p.RtcServe(),
    p.RtcChain(True),
]


def encode_all(events) -> bytes:
    c = p.Codec()
    return b"".join(c.send(e) for e in events)


def drain(codec: p.Codec) -> list:
    out = []
    while (ev := codec.next_event()) is not p.NEED_DATA and ev is not p.EOF:
        out.append(ev)
    return out


def test_every_event_type_has_a_sample():
    assert {type(e) for e in SAMPLES} == set(p.ALL_EVENTS)
    assert {cls.TYPE for cls in p.ALL_EVENTS} == set(p.MsgType) - {p.MsgType.SEALED}   # SEALED only wraps


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip(event):
    codec = p.Codec()
    data = codec.send(event)
    version, type_byte, flags, length = HEADER.unpack_from(data)
    assert (version, type_byte, flags, length) == (p.PROTOCOL_VERSION, event.TYPE, 0, len(data) - 8)
    codec.receive_data(data)
    got = codec.next_event()
    assert got == event and type(got) is type(event)
    assert codec.last_size == len(data)
    assert codec.next_event() is p.NEED_DATA
    codec.receive_data(b"")
    assert codec.next_event() is p.EOF


def test_first_byte_is_never_websocket_g():
    assert encode_all([p.Hello(2, 2, bytes(32), bytes(32), False)])[0] == p.PROTOCOL_VERSION != ord("G")


def test_byte_at_a_time_parses_the_same():
    data = encode_all(SAMPLES)
    codec = p.Codec()
    got = []
    for i in range(len(data)):
        codec.receive_data(data[i:i + 1])
        got.extend(drain(codec))
        assert codec.buffered() <= max(len(codec.send(e)) for e in SAMPLES)
    assert got == SAMPLES


@settings(deadline=None)  # the machine is shared: wall time per example is not what is under test
@given(st.lists(st.integers(min_value=1, max_value=97), min_size=1, max_size=50))
def test_any_split_parses_the_same(cuts):
    data = encode_all(SAMPLES)
    codec = p.Codec()
    got, at, i = [], 0, 0
    while at < len(data):
        n = cuts[i % len(cuts)]
        codec.receive_data(data[at:at + n])
        got.extend(drain(codec))
        at, i = at + n, i + 1
    assert got == SAMPLES


def test_ship_chunk_data_is_a_read_only_view_not_a_copy():
    data = bytes(range(256)) * 1024
    codec = p.Codec()
    frame = codec.send(p.ShipChunk(7, data))
    codec.receive_data(frame[:100])  # split mid-payload: the frame is joined once, when whole
    codec.receive_data(frame[100:] + encode_all([p.Ping(1)]))
    ev = codec.next_event()
    assert isinstance(ev.data, memoryview) and ev.data.readonly and ev == p.ShipChunk(7, data)
    assert codec.next_event() == p.Ping(1) and codec.buffered() == 0
    small = p.Codec()
    small.receive_data(small.send(p.ShipChunk(0, b"abc")))  # a frame inside one chunk is a view of that chunk
    assert small.next_event().data == b"abc"
    # Decoding from mutable memory copies, so a view can never change under its holder.
    payload = bytearray(frame[8:])
    ev = p.events.decode_payload(p.MsgType.SHIP_CHUNK, memoryview(payload))
    payload[20] ^= 0xFF
    assert type(ev.data) is bytes and ev.data == data


def test_send_parts_leaves_a_bulk_payload_uncopied():
    codec = p.Codec()
    data = bytes(p.codec.BULK)
    parts = codec.send_parts(p.ShipChunk(3, data))
    assert len(parts) == 2 and parts[1] is data and b"".join(parts) == codec.send(p.ShipChunk(3, data))
    assert codec.send_parts(p.ShipChunk(3, b"xy")) == [codec.send(p.ShipChunk(3, b"xy"))]


def test_activation_bytes_are_carried_bitwise():
    np = pytest.importorskip("numpy")
    arr = np.array([[1.5, -0.0, np.nan, np.inf]], dtype=np.float16)
    codec = p.Codec()
    codec.receive_data(codec.send(p.Hidden(1, p.Activation.from_array(arr))))
    back = codec.next_event().activation.to_array()
    assert back.dtype == np.float16 and back.tobytes() == arr.tobytes()


def test_oversized_length_rejected_from_the_header_alone():
    codec = p.Codec(max_frame=1024)
    header = HEADER.pack(p.PROTOCOL_VERSION, p.MsgType.SHIP_CHUNK, 0, 1025)
    with pytest.raises(p.ProtocolError) as exc:
        codec.receive_data(header)  # no payload byte has arrived yet
    assert exc.value.code == p.ErrorCode.FRAME_TOO_LARGE and "1025" in exc.value.reason
    assert codec.buffered() == 0
    with pytest.raises(p.ProtocolError):  # the codec stays dead
        codec.next_event()


def test_default_max_frame_rejects_4gib_announcement():
    codec = p.Codec()
    with pytest.raises(p.ProtocolError) as exc:
        codec.receive_data(HEADER.pack(p.PROTOCOL_VERSION, p.MsgType.STEP, 0, 0xFFFFFFFF))
    assert exc.value.code == p.ErrorCode.FRAME_TOO_LARGE


def test_send_refuses_frames_over_max():
    with pytest.raises(ValueError, match="exceeds max_frame"):
        p.Codec(max_frame=100).send(p.ShipChunk(0, bytes(200)))


@pytest.mark.parametrize("header, code", [
    (HEADER.pack(1, p.MsgType.PING, 0, 8), p.ErrorCode.UNSUPPORTED_VERSION),
    (HEADER.pack(p.PROTOCOL_VERSION, p.MsgType.SEALED, 0, 40), p.ErrorCode.UNEXPECTED),
    (HEADER.pack(p.PROTOCOL_VERSION, 200, 0, 0), p.ErrorCode.UNKNOWN_TYPE),
    (HEADER.pack(p.PROTOCOL_VERSION, p.MsgType.PING, 1, 8), p.ErrorCode.MALFORMED),
    (b"GET / HTTP/1.1\r\n", p.ErrorCode.UNSUPPORTED_VERSION),
])
def test_bad_headers(header, code):
    codec = p.Codec()
    with pytest.raises(p.ProtocolError) as exc:
        codec.receive_data(header)
        codec.next_event()
    assert exc.value.code == code


@pytest.mark.parametrize("msg_type, payload, words", [
    (p.MsgType.PING, b"\x00" * 7, "needs 8 bytes"),
    (p.MsgType.PING, b"\x00" * 9, "trailing"),
    (p.MsgType.CHAIN, struct.pack("<I", 2) + b"\xff\xfe" + b"\x00", "UTF-8"),
    (p.MsgType.CHAIN, struct.pack("<I", 0) + b"\x02", "bool"),
    (p.MsgType.SIGNAL, b"\x09" + struct.pack("<I", 0), "SignalKind"),
    (p.MsgType.ERROR, struct.pack("<HI", 999, 0), "ErrorCode"),
    (p.MsgType.LEFT_OUT, b"\x63" + struct.pack("<I", 0), "LeftOutCode"),
    (p.MsgType.JOIN, struct.pack("<HIQii", 1, 0, 1, -1, -1), "needs 4 bytes"),   # a Join without its name
    (p.MsgType.ACK, struct.pack("<BHI", 250, 0, 0), "MsgType"),
    (p.MsgType.TOKENS, struct.pack("<II", 1, 1_000_000), "needs 4000000 bytes"),
    (p.MsgType.HIDDEN, struct.pack("<IBB", 0, 7, 1) + struct.pack("<I", 1), "dtype code"),
    (p.MsgType.HIDDEN, struct.pack("<IBB", 0, 0, 2) + struct.pack("<II", 65536, 65536), "data"),
    (p.MsgType.HIDDEN, struct.pack("<IBB", 0, 0, 9), "dimensions"),
    (p.MsgType.LOAD, struct.pack("<IIIIIIII", 5, 3, 30, 0, 0, 4, 64, 0), "Load range"),
    (p.MsgType.STEP, struct.pack("<IIIIB", 0, 0, 0, 0, 0) + struct.pack("<dIdQ", -1.0, 0, 1.0, 0), "temperature"),
    (p.MsgType.SHIP_END, struct.pack("<I", 3) + b"abc", "32 bytes"),
    (p.MsgType.VOCAB, struct.pack("<IHH", 2, 5, 5) + b"abc", "token bytes"),
])
def test_malformed_payloads_name_the_problem(msg_type, payload, words):
    codec = p.Codec()
    codec.receive_data(HEADER.pack(p.PROTOCOL_VERSION, msg_type, 0, len(payload)) + payload)
    with pytest.raises(p.ProtocolError) as exc:
        codec.next_event()
    assert exc.value.code == p.ErrorCode.MALFORMED
    assert words in exc.value.reason and msg_type.name.replace("_", "").lower() in \
        exc.value.reason.replace("_", "").lower()


def test_eof_mid_frame_is_truncated():
    data = encode_all([p.Ping(1)])
    codec = p.Codec()
    codec.receive_data(data[:-1])
    codec.receive_data(b"")
    with pytest.raises(p.ProtocolError) as exc:
        codec.next_event()
    assert exc.value.code == p.ErrorCode.TRUNCATED


def test_encoding_a_value_that_does_not_fit_names_the_field():
    with pytest.raises(ValueError, match=r"ZeroSlot.slot"):
        p.Codec().send(p.ZeroSlot(-1))
    with pytest.raises(ValueError, match=r"Activation f16\[2\] needs 4 bytes"):
        p.Activation("f16", (2,), b"abc")
    with pytest.raises(ValueError, match="pinned"):
        p.Join(1, "", 1, 5, 2)
    with pytest.raises(ValueError, match=r"Info.decode_ms_layer must be a finite number >= 0"):
        p.Info(0, 1, 2, 0, False, "", "CPU", True, decode_ms_layer=float("nan"))
    with pytest.raises(ValueError, match=r"Info.step_ms"):
        p.Info(0, 1, 2, 0, False, "", "CPU", True, decode_ms_layer=1.0, step_ms=-0.5)
    with pytest.raises(ValueError, match=r"Info.kv_bytes must be 0, 2 or 4, got 3"):
        p.Info(0, 1, 2, 0, False, "", "CPU", True, kv_bytes=3)


def test_events_are_frozen_and_hashable():
    e = p.Step(1, 2, 3, [4, 5])
    assert e.tokens == (4, 5)
    with pytest.raises(AttributeError):
        e.slot = 9  # type: ignore[misc]
    assert hash(e) == hash(p.Step(1, 2, 3, (4, 5)))


MAX_FRAME = 4096
VALID = encode_all(SAMPLES)


def feed_bounded(chunks) -> None:
    """Feed chunks like a link does (drain after each); only ProtocolError may escape; memory stays bounded."""
    codec = p.Codec(max_frame=MAX_FRAME)
    try:
        for chunk in chunks:
            codec.receive_data(chunk)
            assert codec.buffered() <= 8 + MAX_FRAME + len(chunk)
            while (ev := codec.next_event()) is not p.NEED_DATA:
                if ev is p.EOF:
                    return
                assert isinstance(ev, p.Event)
                codec.send(ev)  # whatever decodes also re-encodes
            assert codec.buffered() <= 8 + MAX_FRAME
        codec.receive_data(b"")
        codec.next_event()
    except p.ProtocolError as exc:
        assert isinstance(exc.code, p.ErrorCode) and exc.reason
        assert codec.buffered() == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=300), max_size=20))
def test_fuzz_random_bytes(chunks):
    feed_bounded([b"\x01" + c for c in chunks])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(1, 64), st.integers(0, len(VALID)))
def test_fuzz_mutated_frames(mutations, chunk, cut):
    data = bytearray(VALID[:cut] if cut else VALID)
    for at, value in mutations:
        if at < len(data):
            data[at] = value
    feed_bounded([bytes(data[i:i + chunk]) for i in range(0, len(data), chunk)])


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(p.ALL_EVENTS), st.binary(max_size=200))
def test_fuzz_payloads_per_type(cls, payload):
    feed_bounded([HEADER.pack(p.PROTOCOL_VERSION, cls.TYPE, 0, len(payload)) + payload])


def test_proto_never_imports_trio():
    root = pathlib.Path(p.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in {"trio", "socket", "time", "asyncio"} for n in names), path
    code = "import sys, mesh.proto; print(sorted(m for m in ('trio', 'socket', 'asyncio') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _generic_batch_step(payload):
    """BatchStep decoded by the table's walk alone (what `decode_payload` did before its fast path)."""
    from mesh.proto import events, wire
    cls, layout = events._CODECS[p.MsgType.BATCH_STEP]
    r = wire.Reader(memoryview(payload), cls.__name__)
    try:
        values = [codec.get(r, name) for name, codec in layout]
        r.finish()
        return cls(*values)
    except (ValueError, TypeError) as exc:
        raise p.ProtocolError(p.ErrorCode.MALFORMED, f"{cls.__name__}: {exc}") from None


def _outcome(fn, *args):
    try:
        return fn(*args)
    except p.ProtocolError as exc:
        return ("error", exc.code)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(group=st.integers(0, 2**32 - 1), wide=st.booleans(),
       cols=st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.booleans(),
                               st.integers(0, 2**32 - 1)), max_size=4),
       hidden=st.none() | st.tuples(st.sampled_from(["f32", "f16", "bf16"]), st.lists(st.integers(0, 3), max_size=3)),
       temps=st.lists(st.floats(0, 4), min_size=1, max_size=3), cut=st.integers(0, 200),
       flip=st.tuples(st.integers(0, 300), st.integers(1, 255)))
def test_batch_step_fast_path_gives_the_tables_bytes_events_and_errors(group, wide, cols, hidden, temps, cut, flip):
    """BatchStep's own encoder and decoder (mesh.proto.events, the hot path's frames) write the bytes the field
    table writes, and read every payload, cut short or with a byte changed, to the table's event or error."""
    from mesh.proto import events
    columns = tuple(p.Column(*c) for c in cols)
    act = None if hidden is None else p.Activation(hidden[0], tuple(hidden[1]),
                                                   bytes((4 if hidden[0] == "f32" else 2) * math.prod(hidden[1])))
    picks = sum(c.needs_logits for c in columns)
    samplings = tuple(p.SamplingParams(t, 3, 0.5, 9) for t in temps[:max(picks, 1)]) if picks != 1 else \
        (p.SamplingParams(temps[0]),)
    try:
        ev = p.BatchStep(group, wide, columns, act, samplings)
    except ValueError:
        return
    fast = b"".join(events._encode_batch_step(ev))
    table = []
    for name, codec in events._CODECS[p.MsgType.BATCH_STEP][1]:
        codec.put(table, getattr(ev, name))
    assert fast == b"".join(table)
    assert events._decode_batch_step(memoryview(fast)) == ev        # the fast path itself, not the fallback
    assert events.decode_payload(p.MsgType.BATCH_STEP, memoryview(fast)) == ev
    for payload in (fast[:cut], fast[:flip[0]] + bytes([fast[flip[0]] ^ flip[1]]) + fast[flip[0] + 1:]
                    if flip[0] < len(fast) else fast + b"\0"):
        assert _outcome(events.decode_payload, p.MsgType.BATCH_STEP, memoryview(payload)) == \
            _outcome(_generic_batch_step, payload)


def test_batch_step_fast_encoder_leaves_bad_values_to_the_table():
    from mesh.proto import events
    for bad in (p.BatchStep(True, False, ()), p.BatchStep(2**32, False, ()),
                p.BatchStep(1, False, (p.Column(-1, 0),))):
        assert events._encode_batch_step(bad) is None
        with pytest.raises(ValueError, match="BatchStep"):
            events.encode_payload(bad)
