"""The worker's fixed-layout records (engine.worker_records): what the client writes, the child reads back exactly,
and every field that does not fit the layout or the shared value rules is a WireError naming it."""
import re
import struct

import numpy as np
import pytest

from common.values import Column, Sampling
from engine.arena import EGRESS, Arena, PayloadKind, RecordRef, RingReader, RingWriter
from engine.worker_proto import BlockTable, CommandError, Done, Initialize, Load, Reset, Rollback, Shutdown, StepDone, WireError, \
    ZeroSlot
from engine.worker_records import (DOORBELL, StepRecord, decode_command_record, decode_event_record, doorbell,
                                   encode_event_record, encode_small, step_done_head, step_head)

COLS = (Column(100, 2, True, 42), Column(7, 0, False, 3))
SAMP = (Sampling(0.7, 40, 0.9, 2 ** 64 - 1),)


def step_payload(act: np.ndarray | None, cols=COLS, samp=SAMP, per_column=False) -> bytes:
    kind = {np.dtype(np.float32): 3, np.dtype(np.float16): 2}[act.dtype] if act is not None else 0
    head = step_head(5, 9, cols, samp, per_column, kind, act.shape[-1] if act is not None else 0)
    return head + (act.tobytes() if act is not None else b"")


def test_a_step_record_round_trips_and_points_at_its_activations():
    act = np.arange(2 * 6, dtype=np.float16).reshape(2, 6)
    payload = step_payload(act)
    rec = decode_command_record(memoryview(payload))
    assert isinstance(rec, StepRecord) and rec.cmd.cid == 5 and rec.cmd.step_id == 9
    assert rec.cmd.columns == COLS and rec.cmd.sampling == SAMP and not rec.cmd.per_column
    assert type(rec.cmd.columns[0]) is Column and type(rec.cmd.sampling[0]) is Sampling
    assert rec.act_offset % 64 == 0 and (rec.act_kind, rec.dim, rec.act_bytes) == (2, 6, act.nbytes)
    got = np.frombuffer(payload, np.float16, 12, rec.act_offset).reshape(2, 6)
    assert np.array_equal(got, act)
    first = decode_command_record(memoryview(step_payload(None)))
    assert first.act_kind == 0 and first.act_bytes == 0


@pytest.mark.parametrize("cmd", [ZeroSlot(3, 1), Rollback(4, 2, 17), Reset(5), Shutdown(6), BlockTable(9, 2, (4, 0, 7)),
                                 BlockTable(10, 0, ()),
                                 Initialize(7, "CPU"), Load(8, "/m.gguf", 0, 4, 2, 64, 1)],
                         ids=lambda c: type(c).__name__)
def test_small_commands_round_trip(cmd):
    assert decode_command_record(memoryview(encode_small(cmd))) == cmd


def _patch(payload: bytes, offset: int, fmt: str, value) -> bytes:
    b = bytearray(payload)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


@pytest.mark.parametrize("patch, field", [
    (lambda p: _patch(p, 28, "<B", 2), "flags"),                      # per_column not 0/1
    (lambda p: _patch(p, 29, "<B", 7), "act_kind"),                   # no such activation kind
    (lambda p: _patch(p, 40 + 8, "<I", 2), "columns[0].needs_logits"),  # prefix 16 + step 24
    (lambda p: _patch(p, 4, "<I", 1000), "columns"),                  # more columns than the record holds
    (lambda p: _patch(p, 40 + 32 + 16, "<d", 1.5), "sampling"),       # top_p outside [0, 1]: the shared rule
    (lambda p: p[:-2], "activations"),                                # the data does not match the header
])
def test_a_bad_step_record_names_the_field_and_the_command(patch, field):
    payload = patch(step_payload(np.zeros((2, 6), np.float32)))
    with pytest.raises(WireError, match=re.escape(f"Step.{field}")) as info:
        decode_command_record(memoryview(payload))
    assert info.value.command == "Step" and info.value.cid == 5


def test_per_column_samplings_are_kept_by_their_bytes_and_checked_once():
    cols = tuple(Column(50 + i, i, True, 9) for i in range(3))
    samp = tuple(Sampling(1.0, 0, 0.95, 1000 + i) for i in range(3))
    one = decode_command_record(memoryview(step_head(1, 1, cols, samp, True, 0, 0))).cmd
    two = decode_command_record(memoryview(step_head(2, 2, cols, samp, True, 0, 0))).cmd
    assert one.sampling == two.sampling == samp and one.columns == two.columns == cols
    assert all(a is b for a, b in zip(one.sampling, two.sampling))     # the same values, not built again
    other = decode_command_record(memoryview(step_head(3, 3, cols, (*samp[:2], Sampling(1.0, 0, 0.95, 7)), True,
                                                       0, 0))).cmd
    assert other.sampling[2].seed == 7 and other.sampling[:2] == samp[:2]
    bad = bytearray(step_head(4, 4, cols, samp, True, 0, 0))
    struct.pack_into("<d", bad, 40 + 3 * 16 + 32 + 16, 1.5)              # the second sampling's top_p
    with pytest.raises(WireError, match=re.escape("Step.sampling")):
        decode_command_record(memoryview(bytes(bad)))
    flag = bytearray(step_head(5, 5, cols, samp, True, 0, 0))
    struct.pack_into("<I", flag, 40 + 16 + 8, 3)                          # the second column's needs_logits
    with pytest.raises(WireError, match=re.escape("Step.columns[1].needs_logits: 3")):
        decode_command_record(memoryview(bytes(flag)))


def test_unknown_and_short_command_records_are_wire_errors():
    with pytest.raises(WireError, match="shorter than"):
        decode_command_record(memoryview(b"\x01\x00"))
    with pytest.raises(WireError, match="unknown command record type 99"):
        decode_command_record(memoryview(struct.pack("<HHIQ", 99, 0, 0, 1)))
    with pytest.raises(WireError, match="ZeroSlot record") as info:
        decode_command_record(memoryview(encode_small(ZeroSlot(3, 1)) + b"x"))
    assert info.value.cid == 3


def test_events_round_trip_through_the_egress_ring_with_their_envelope():
    arena = Arena.create(1 << 16)
    w, r = RingWriter(arena, EGRESS), RingReader(arena, EGRESS)
    out = np.array([11, 12, 13], np.int32)
    for i, parts in enumerate([[step_done_head(7, 1, 99, 9, 1.25, 1, 3, 1), out],
                               [encode_event_record(Done("BlockTable"), 8, 2, 99)],
                               [encode_event_record(CommandError("Step", "no model"), 9, 3, 99)]]):
        ref = w.write_parts(7 + i, PayloadKind.MESSAGE, parts)
        assert RecordRef(*DOORBELL.unpack(doorbell(ref))) == ref
        view = r.payload(ref)
        env, where = decode_event_record(view, ref)
        assert (env.seq, env.pid, env.reply_to) == (1 + i, 99, 7 + i) and env.mono_ms > 0
        if i == 0:
            assert env.event == StepDone(9, ref, 1.25) and (where.kind, where.rows, where.cols) == (1, 3, 1)
            assert np.array_equal(np.frombuffer(view[where.offset:where.offset + where.nbytes], np.int32), out)
        else:
            assert where is None and env.event == (Done("BlockTable"), CommandError("Step", "no model"))[i - 1]
        view.release()
        r.release(ref)
    arena.close()
