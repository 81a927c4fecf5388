"""The shared-memory arena, its record codec and every header check; the worker protocol codec; device choice."""
import dataclasses
import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from engine.arena import (EGRESS, INGRESS, RECORD_ALIGN, RECORD_FIELDS, RECORD_HEADER_LEN, Arena, ArenaError,
                          PayloadKind, RecordError, RecordHeader, RecordRef, RingFull, RingReader, RingWriter)
from engine.device import DeviceError, choose_device, is_clang, quick_default
from engine.worker_proto import (BlockTable, CommandError, Done, Fatal, Initialize, Load, Loaded, Ready, Reset,
                                 Rollback, Shutdown, Step, StepDone, Stopped, WireColumn, WireError, WorkerInfo,
                                 ZeroSlot, decode_command, decode_event, encode_command, encode_event)


@pytest.fixture
def arena():
    a = Arena.create(1 << 16)
    yield a
    a.close()


def _pair(arena, ring=INGRESS):
    # the reader maps the arena a second time from the fd, as the other process does
    other = Arena.attach(arena.fd, arena.size)
    return RingWriter(arena, ring), RingReader(other, ring), other


def test_round_trip_each_payload_kind(arena):
    w, r, other = _pair(arena)
    payloads = [np.arange(12, dtype=np.float32).reshape(3, 4) / 7, np.array([5, -1, 70000], dtype=np.int32),
                np.linspace(-2, 2, 10).astype(np.float16), np.zeros(0, dtype=np.float32)]
    for i, p in enumerate(payloads):
        ref = w.write(100 + i, p)
        assert ref.sequence == i and ref.object_id == 100 + i and ref.extent == p.nbytes
        assert ref.position % RECORD_ALIGN == 0
        got = r.take(ref)
        assert got.dtype == p.dtype and np.array_equal(got, p.reshape(-1))
    assert r.next_sequence == len(payloads)
    other.close()


def test_records_skip_the_tail_instead_of_wrapping(arena):
    w, r, other = _pair(arena, EGRESS)
    cap = arena.capacity
    third = np.ones((cap // 3) // 4, dtype=np.float32)  # a record of a third of the ring, plus its header
    first, second = w.write(0, third), w.write(1, third * 2)
    assert np.array_equal(r.take(first), third)
    wrapped = w.write(2, third * 3)  # does not fit behind `second`: goes to the start, where `first` was
    assert (first.position % cap, second.position % cap, wrapped.position % cap) == (0, second.position, 0)
    assert wrapped.position > second.position and wrapped.position % RECORD_ALIGN == 0
    assert np.array_equal(r.take(second), third * 2) and np.array_equal(r.take(wrapped), third * 3)
    other.close()


def test_an_empty_ring_starts_over_at_offset_zero(arena):
    w, r, other = _pair(arena, EGRESS)
    for i in range(5):
        ref = w.write(i, np.full(100, i, dtype=np.float32))
        assert ref.position % arena.capacity == 0 and ref.sequence == i
        assert np.array_equal(r.take(ref), np.full(100, i, dtype=np.float32))
    other.close()


def test_ring_full_when_reader_lags_or_record_too_big(arena):
    w, r, other = _pair(arena)
    with pytest.raises(RingFull, match="exceeds the ring"):
        w.write(0, np.zeros(arena.capacity, dtype=np.float32))
    chunk = np.zeros((arena.capacity // 3) // 4, dtype=np.float32)
    refs = [w.write(0, chunk), w.write(1, chunk)]
    with pytest.raises(RingFull, match="has not released"):
        w.write(2, chunk)
    r.take(refs[0])
    w.write(2, chunk)  # the released space is reused
    other.close()


def test_attach_checks_size_and_header(arena):
    with pytest.raises(ArenaError, match="expected"):
        Arena.attach(arena.fd, arena.size + 4096)
    arena.buffer[0:4] = b"XXXX"
    with pytest.raises(ArenaError, match="bad header"):
        Arena.attach(arena.fd, arena.size)


def _write_one(arena):
    w, r, other = _pair(arena)
    ref = w.write(7, np.arange(8, dtype=np.float32))
    return ref, r, other, arena.data_base(INGRESS) + ref.position % arena.capacity


# (field, how to spoil the record at header offset `off` / the ref): every header check has its own case
_CORRUPTIONS = {
    "magic": lambda buf, off, ref: (buf.__setitem__(slice(off, off + 4), b"MRXX"), ref)[1],
    "version": lambda buf, off, ref: (struct.pack_into("<H", buf, off + 4, 2), ref)[1],
    "header_length": lambda buf, off, ref: (struct.pack_into("<H", buf, off + 6, 48), ref)[1],
    "object_id": lambda buf, off, ref: dataclasses.replace(ref, object_id=8),
    "sequence": lambda buf, off, ref: (struct.pack_into("<Q", buf, off + 16, 1), dataclasses.replace(ref, sequence=1))[1],
    "extent": lambda buf, off, ref: (struct.pack_into("<Q", buf, off + 24, 64), ref)[1],
    "flags": lambda buf, off, ref: (struct.pack_into("<I", buf, off + 32, 0x102), ref)[1],
    "reserved": lambda buf, off, ref: (struct.pack_into("<I", buf, off + 36, 1), ref)[1],
    "alignment": lambda buf, off, ref: dataclasses.replace(ref, position=ref.position + 8),
}


@pytest.mark.parametrize("field", sorted(_CORRUPTIONS))
def test_each_header_violation_names_its_field(arena, field):
    ref, r, other, off = _write_one(arena)
    bad = _CORRUPTIONS[field](arena.buffer, off, ref)
    with pytest.raises(RecordError) as info:
        r.view(bad)
    assert info.value.field == field and field in str(info.value)
    other.close()


def test_every_checked_field_has_a_case():
    assert set(_CORRUPTIONS) == set(RECORD_FIELDS)


def test_extent_must_be_whole_items_and_sequence_must_not_skip_or_replay(arena):
    w, r, other = _pair(arena)
    ref = w.write(1, np.arange(4, dtype=np.float32))
    off = arena.data_base(INGRESS) + ref.position % arena.capacity
    struct.pack_into("<Q", arena.buffer, off + 24, 6)  # 6 bytes of float32: not whole items
    with pytest.raises(RecordError) as info:
        r.view(dataclasses.replace(ref, extent=6))
    assert info.value.field == "alignment"
    struct.pack_into("<Q", arena.buffer, off + 24, 16)
    r.take(ref)
    with pytest.raises(RecordError) as info:
        r.view(ref)  # replayed: already consumed
    assert info.value.field == "sequence"
    w.write(2, np.zeros(1, dtype=np.float32))  # sequence 1, never read
    skipped = w.write(3, np.zeros(1, dtype=np.float32))
    with pytest.raises(RecordError) as info:
        r.view(skipped)
    assert info.value.field == "sequence" and "expected 1" in str(info.value)
    other.close()


def test_header_codec_round_trip():
    h = RecordHeader(b"MR01", 1, RECORD_HEADER_LEN, 2**64 - 1, 5, 1 << 40, int(PayloadKind.ACT_F16), 0)
    assert len(h.pack()) == RECORD_HEADER_LEN == 40
    assert RecordHeader.unpack(h.pack()) == h


def test_unsupported_dtype_is_refused(arena):
    with pytest.raises(ArenaError, match="float64"):
        RingWriter(arena, INGRESS).write(0, np.zeros(3))


# ---- the control protocol codec ----

_ref = RecordRef(INGRESS, 128, 3, 2, 16)
_COMMANDS = [Initialize(1, None), Initialize(2, "CPU:X86"), Load(3, "/m.gguf", 0, 4, 2, 64, 1),
             Step(4, 9, (WireColumn(0, 1, False, 5), WireColumn(1, 1, True, 6)), ({"temperature": 0.5, "seed": 3},),
                  False, _ref),
             Step(5, 10, (WireColumn(2, 0, True, 0),), (), True, None), ZeroSlot(6, 1), Reset(7), Rollback(8, 1, 3),
             Shutdown(9), BlockTable(10, 2, (5, 0, 9)), BlockTable(11, 0, ()), Load(12, "/m.gguf", 0, 4, 2, 64, 1, 40)]
_EVENTS = [Ready("CPU", "CPU", "default", "", (2, 4, 6), 1.5),
           Loaded(WorkerInfo(0, 2, 4, 64, "float32", 10, 20, "ab12", 3.0, 1250.5, 3)), StepDone(9, _ref, 0.25), Done("Reset"),
           Loaded(WorkerInfo(0, 2, 4, 64, "float32", 10, 20, "ab12", 3.0, 1250.5, 3, 512, 16)),
           CommandError("Step", "no model"), Fatal("record.magic", "bad"), Stopped("shutdown")]


@pytest.mark.parametrize("cmd", _COMMANDS, ids=lambda c: type(c).__name__)
def test_command_round_trip(cmd):
    line = encode_command(cmd)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_command(line) == cmd


@pytest.mark.parametrize("event", _EVENTS, ids=lambda e: type(e).__name__)
def test_event_round_trip_keeps_the_envelope(event):
    env = decode_event(encode_event(event, seq=4, wall_ms=1.7e12, mono_ms=12.5, span_id="worker-1/4", pid=11,
                                    reply_to=3))
    assert env.event == event
    assert (env.seq, env.wall_ms, env.mono_ms, env.span_id, env.pid, env.reply_to) == (4, 1.7e12, 12.5, "worker-1/4",
                                                                                        11, 3)


@pytest.mark.parametrize("line, match, command", [
    (b"not json", "not JSON", None),
    (b"[1]", "string 'type'", None),
    (b'{"type":"Explode","cid":1}', "unknown command type 'Explode'", "Explode"),
    (b'{"type":"Reset"}', "missing field 'cid'", "Reset"),
    (b'{"type":"Reset","cid":1,"force":true}', r"unknown field\(s\) \['force'\]", "Reset"),
    (b'{"type":"Load","cid":1,"path":"p","start":"0","end":2,"n_slots":1,"max_context":8,"warmup":1}', "Load.start",
     "Load"),
    (b'{"type":"Load","cid":1,"path":"p","start":0,"end":2,"n_slots":1,"max_context":8}', "missing field 'warmup'",
     "Load"),
    (b'{"type":"Load","cid":1,"path":"p","start":0,"end":2,"n_slots":1,"max_context":8,"warmup":true}',
     "Load.warmup: expected an integer", "Load"),
    (b'{"type":"ZeroSlot","cid":1,"slot":true}', "ZeroSlot.slot: expected an integer", "ZeroSlot"),
])
def test_bad_command_lines_raise_wire_error_naming_the_problem(line, match, command):
    with pytest.raises(WireError, match=match) as info:
        decode_command(line)
    assert info.value.command == command


def test_event_without_envelope_is_refused():
    with pytest.raises(WireError, match="envelope lacks 'seq'"):
        decode_event(b'{"type":"Stopped","reason":"x"}')


# ---- device choice ----

def _which(present):
    return lambda name: f"/usr/bin/{name}" if name in present else None


@pytest.mark.parametrize("requested, present, clang, selected, compiler", [
    ("CPU", {"clang"}, True, "CPU", "default"),
    ("CPU", set(), True, "CPU:X86", "x86"),
    ("CPU", {"clang"}, False, "CPU:X86", "x86"),  # a "clang" (or $CC) that is really gcc
    ("CUDA", {"nvcc"}, True, "CUDA", "default"),
    ("CUDA", set(), True, "CUDA:PTX", "ptx"),
    ("CPU:LLVM", set(), True, "CPU:LLVM", "default"),  # a named renderer is taken as given
])
def test_device_fallbacks(monkeypatch, requested, present, clang, selected, compiler):
    monkeypatch.delenv("CC", raising=False)
    choice = choose_device(requested, default=lambda: "CPU", which=_which(present), is_clang=lambda cc: clang)
    assert (choice.selected, choice.compiler) == (selected, compiler)
    assert (choice.reason != "") == (compiler != "default")


def test_device_cpu_compiler_is_cc_when_set(monkeypatch):
    monkeypatch.setenv("CC", "gcc")
    choice = choose_device("CPU", default=lambda: "CPU", which=_which({"clang"}), is_clang=lambda cc: True)
    assert choice.selected == "CPU:X86" and "gcc not found" in choice.reason


def test_device_default_comes_from_env_then_tinygrad(monkeypatch):
    monkeypatch.delenv("DEV", raising=False)
    assert choose_device(None, default=lambda: "CUDA", which=_which({"nvcc"})).selected == "CUDA"
    monkeypatch.setenv("DEV", "CPU")
    assert choose_device(None, default=lambda: "CUDA", which=_which(set())).selected == "CPU:X86"
    assert is_clang("/nonexistent/cc") is False
    with pytest.raises(DeviceError, match="whitespace"):
        choose_device("CP U", default=lambda: "CPU")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3000)), max_size=60))
def test_fifo_integrity_under_any_interleaving(ops):
    """Writes of any size and reads in order: every record reads back intact and in sequence; a write is refused
    only while earlier records are unread, and never when the ring is empty."""
    a = Arena.create(1 << 14)
    try:
        w, r = RingWriter(a, INGRESS), RingReader(a, INGRESS)
        pending = []
        for i, (read_first, n) in enumerate(ops):
            if read_first and pending:
                ref, data = pending.pop(0)
                assert np.array_equal(r.take(ref), data)
            data = np.arange(n, dtype=np.int32) + i
            try:
                pending.append((w.write(i, data), data))
            except RingFull:
                assert pending or n * 4 + RECORD_HEADER_LEN > a.capacity
        for ref, data in pending:
            assert np.array_equal(r.take(ref), data)
    finally:
        a.close()


def test_quick_default_skips_tinygrads_probe_only_where_no_accelerator_leaves_a_trace():
    asked = []

    def ask() -> str:
        asked.append(1)
        return "CUDA"

    assert quick_default(platform="linux", exists=lambda p: False, ask=ask) == "CPU" and not asked
    assert quick_default(platform="linux", exists=lambda p: p == "/dev/nvidiactl", ask=ask) == "CUDA"
    assert quick_default(platform="linux", exists=lambda p: p == "/dev/dri", ask=ask) == "CUDA"
    assert quick_default(platform="darwin", exists=lambda p: False, ask=ask) == "CPU"   # a Mac without Metal
    assert quick_default(platform="darwin", exists=lambda p: p.endswith("Metal.framework"), ask=ask) == "METAL"
    assert quick_default(platform="win32", exists=lambda p: False, ask=ask) == "CUDA"   # tinygrad decides
    assert len(asked) == 3
