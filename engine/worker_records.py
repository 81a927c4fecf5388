"""The worker's messages as fixed-layout ring records, and the doorbell that says where one lies. Sans-IO.

Every command and every event is one record in a ring of the arena (engine.arena; payload kind MESSAGE): commands in
the ingress ring, events in the egress ring. The pipes carry only doorbells: after a record is published, its
writer writes the record's `RecordRef` (40 bytes, `DOORBELL`) to the pipe the other side blocks on (the child on its
stdin, the client in `trio.lowlevel.wait_readable` on the child's stdout). One write and one wake-up per message and
direction; a pipe because it works the same on Linux and macOS (an eventfd is Linux-only, a futex needs a thread to
wait in, outside trio's loop), and because the child's death closes it: the waiting client sees EOF at once.
A doorbell is shorter than PIPE_BUF, so it is written and read whole.

Layouts (little endian). A message starts with a 16-byte prefix: type u16, aux u16, count u32, id u64 (a command's
cid; an event's reply_to). Commands then carry:
    STEP       step_id u64 | n_samp u32 | per_column u8 | act kind u8 | pad u16 | dim u32 | pad u32
               then count x column (pos u32, slot u32, needs_logits u32, token u32), n_samp x sampling
               (temperature f64, top_k u64, top_p f64, seed u64), zero bytes up to a multiple of 64 from the record's
               payload start, then count x dim activations of `act kind` (none when the kind is 0)
    ZERO_SLOT  slot u32          ROLLBACK  slot u32 | pos u32          RESET, SHUTDOWN  nothing
    BLOCK_TABLE  slot u32, then count x block u32
    JSON       the rest of the record is one JSON command of engine.worker_proto (Initialize, Load: rare, with paths)
Events carry after the prefix: seq u64 | pid u32 | pad u32 | wall_ms f64 | mono_ms f64 (the envelope), then:
    STEP_DONE  step_id u64 | compute_ms f64 | out kind u8 | pad u8 x 3 | rows u32 | cols u32 | pad u32, zero bytes
               up to 64, then rows x cols values (tokens: cols = 1)
    DONE       aux = the command type it answers (ZERO_SLOT, RESET, ROLLBACK, BLOCK_TABLE)
    JSON       the rest is one JSON event line of engine.worker_proto (Ready, Loaded, CommandError, Fatal, Stopped)
The decoder checks every count against the bytes present before it builds anything, and every flag and value against
the shared rules (common.values); a violation is `WireError` naming the message and field, as for the JSON lines.
"""
from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Sequence

from common.values import Column, Sampling
from engine.arena import RecordRef
from engine.worker_proto import (BlockTable, Command, CommandError, Done, Envelope, Event, Reset, Rollback, Shutdown, Step,
                                 StepDone, WireError, ZeroSlot, command_name, decode_command, decode_event,
                                 encode_command, encode_event)

DOORBELL = struct.Struct("<QQQQQ")  # RecordRef: ring, position, object_id, sequence, extent



def doorbell(ref: RecordRef) -> bytes:
    return DOORBELL.pack(ref.ring, ref.position, ref.object_id, ref.sequence, ref.extent)


PREFIX = struct.Struct("<HHIQ")
_STEP = struct.Struct("<QIBBHII")
_COLUMN = struct.Struct("<IIII")
_SAMPLING = struct.Struct("<dQdQ")
_ENVELOPE = struct.Struct("<QIIdd")
_STEP_DONE = struct.Struct("<QdB3xIII")
_SLOT = struct.Struct("<I")
_SLOT_POS = struct.Struct("<II")
ALIGN = 64

# message types (the prefix's first field)
M_STEP, M_ZERO_SLOT, M_RESET, M_ROLLBACK, M_SHUTDOWN, M_BLOCK_TABLE, M_JSON = 1, 2, 3, 4, 5, 6, 15
E_STEP_DONE, E_DONE, E_JSON = 1, 2, 15
_DONE_NAMES = {M_ZERO_SLOT: "ZeroSlot", M_RESET: "Reset", M_ROLLBACK: "Rollback", M_BLOCK_TABLE: "BlockTable"}
_DONE_CODES = {v: k for k, v in _DONE_NAMES.items()}

# activation / output kinds: engine.arena.PayloadKind values (TOKENS_I32 1, ACT_F16 2, ACT_F32 3); 0 = none
ITEMSIZE = {1: 4, 2: 2, 3: 4}
DTYPE_NAME = {1: "<i4", 2: "<f2", 3: "<f4"}
KIND_BY_DTYPE = {"int32": 1, "float16": 2, "float32": 3}


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ---- commands -------------------------------------------------------------------------------------------------

def step_head(cid: int, step_id: int, columns: Sequence[Column], sampling: tuple[Sampling, ...], per_column: bool,
              act_kind: int, dim: int) -> bytes:
    """Everything of a Step record before its activations (zero-padded to 64 bytes); the activations follow."""
    parts = [PREFIX.pack(M_STEP, 0, len(columns), cid),
             _STEP.pack(step_id, len(sampling), per_column, act_kind, 0, dim, 0)]
    parts += [_COLUMN.pack(c.pos, c.slot, 1 if c.needs_logits else 0, c.token) for c in columns]
    parts += [_SAMPLING.pack(s.temperature, s.top_k, s.top_p, s.seed) for s in sampling]
    head = b"".join(parts)
    return head + bytes(_aligned(len(head)) - len(head))


@dataclass(frozen=True, slots=True)
class StepRecord:
    """A decoded Step record: the command and where its activations lie in the record's payload."""
    cmd: Step
    act_kind: int
    dim: int
    act_offset: int
    act_bytes: int


def encode_small(cmd: Command) -> bytes:
    """A command other than Step, as a record payload."""
    t = type(cmd)
    if t is ZeroSlot:
        return PREFIX.pack(M_ZERO_SLOT, 0, 0, cmd.cid) + _SLOT.pack(cmd.slot)
    if t is Rollback:
        return PREFIX.pack(M_ROLLBACK, 0, 0, cmd.cid) + _SLOT_POS.pack(cmd.slot, cmd.pos)
    if t is Reset:
        return PREFIX.pack(M_RESET, 0, 0, cmd.cid)
    if t is Shutdown:
        return PREFIX.pack(M_SHUTDOWN, 0, 0, cmd.cid)
    if t is BlockTable:
        return PREFIX.pack(M_BLOCK_TABLE, 0, len(cmd.blocks), cmd.cid) + struct.pack(f"<I{len(cmd.blocks)}I", cmd.slot,
                                                                                      *cmd.blocks)
    return PREFIX.pack(M_JSON, 0, 0, cmd.cid) + encode_command(cmd)


def decode_command_record(payload: memoryview) -> Command | StepRecord:
    """A command record's payload -> the command (a Step as a StepRecord). Raises WireError naming the field; for a
    message whose prefix parsed, the WireError carries the command name and cid so the worker can refuse it."""
    if len(payload) < PREFIX.size:
        raise WireError(f"command record of {len(payload)} bytes is shorter than its {PREFIX.size}-byte prefix")
    mtype, aux, count, cid = PREFIX.unpack_from(payload, 0)
    body = len(payload) - PREFIX.size
    if mtype == M_STEP:
        return _decode_step(payload, count, cid)
    if mtype == M_JSON:
        return decode_command(bytes(payload[PREFIX.size:]))
    if mtype == M_BLOCK_TABLE:
        if aux or body != 4 * (1 + count):
            raise WireError(f"BlockTable record: {body} body bytes for {count} blocks, aux {aux}",
                            command="BlockTable", cid=cid)
        slot, *blocks = struct.unpack_from(f"<I{count}I", payload, PREFIX.size)
        return BlockTable(cid, slot, tuple(blocks))
    name = {M_ZERO_SLOT: "ZeroSlot", M_ROLLBACK: "Rollback", M_RESET: "Reset", M_SHUTDOWN: "Shutdown"}.get(mtype)
    if name is None:
        raise WireError(f"unknown command record type {mtype}")
    want = {M_ZERO_SLOT: _SLOT.size, M_ROLLBACK: _SLOT_POS.size}.get(mtype, 0)
    if body != want or aux or count:
        raise WireError(f"{name} record: {body} body bytes (want {want}), aux {aux}, count {count}",
                        command=name, cid=cid)
    if mtype == M_ZERO_SLOT:
        return ZeroSlot(cid, *_SLOT.unpack_from(payload, PREFIX.size))
    if mtype == M_ROLLBACK:
        return Rollback(cid, *_SLOT_POS.unpack_from(payload, PREFIX.size))
    return Reset(cid) if mtype == M_RESET else Shutdown(cid)


# A sequence's Sampling comes in every step it decodes (one per column when a batch's differ): the validated value is
# kept by its 32 record bytes, so a step of 16 sampled columns builds none after their first steps. Immutable, so
# sharing it changes nothing; bounded, so a stream of fresh seeds cannot grow it.
_SAMPLINGS: dict[bytes, Sampling] = {}
_SAMPLINGS_MAX = 4096


def _decode_step(payload: memoryview, n: int, cid: int) -> StepRecord:
    def bad(detail: str) -> WireError:
        return WireError(f"Step.{detail}", command="Step", cid=cid)

    at = PREFIX.size
    if len(payload) < at + _STEP.size:
        raise bad("header: record too short")
    step_id, m, per_column, kind, pad, dim, pad2 = _STEP.unpack_from(payload, at)
    at += _STEP.size
    if per_column > 1 or pad or pad2:
        raise bad(f"flags: per_column {per_column}, padding {pad}/{pad2}")
    if kind and kind not in (2, 3):
        raise bad(f"act_kind: {kind} is no activation kind")
    head = at + n * _COLUMN.size + m * _SAMPLING.size
    if head > len(payload):
        raise bad(f"columns: {n} columns and {m} samplings need {head} bytes, the record holds {len(payload)}")
    v = struct.unpack_from(f"<{4 * n}I", payload, at)      # the columns' fields in one call, then one map
    flags = v[2::4]
    if n and max(flags) > 1:
        i = next(i for i, f in enumerate(flags) if f > 1)
        raise bad(f"columns[{i}].needs_logits: {flags[i]} is not 0 or 1")
    cols = list(map(Column, v[0::4], v[1::4], map(bool, flags), v[3::4]))
    at += n * _COLUMN.size
    samp = []
    for k in range(at, head, _SAMPLING.size):
        raw = bytes(payload[k:k + _SAMPLING.size])
        s = _SAMPLINGS.get(raw)
        if s is None:
            try:
                s = Sampling(*_SAMPLING.unpack(raw))
            except ValueError as exc:
                raise bad(f"sampling: {exc}") from None
            if len(_SAMPLINGS) >= _SAMPLINGS_MAX:
                _SAMPLINGS.clear()
            _SAMPLINGS[raw] = s
        samp.append(s)
    samp = tuple(samp)
    off = _aligned(head)
    size = n * dim * ITEMSIZE[kind] if kind else 0
    if len(payload) != off + size:
        raise bad(f"activations: the record holds {len(payload)} bytes, the header says {off} + {size}")
    return StepRecord(Step(cid, step_id, tuple(cols), samp, bool(per_column), None), kind, dim, off, size)


# ---- events ---------------------------------------------------------------------------------------------------

def event_head(mtype: int, aux: int, reply_to: int, seq: int, pid: int) -> bytes:
    return PREFIX.pack(mtype, aux, 0, reply_to) + _ENVELOPE.pack(seq, pid, 0, time.time_ns() / 1e6,
                                                                 time.monotonic_ns() / 1e6)


def step_done_head(reply_to: int, seq: int, pid: int, step_id: int, compute_ms: float, kind: int, rows: int,
                   cols: int) -> bytes:
    head = event_head(E_STEP_DONE, 0, reply_to, seq, pid) + _STEP_DONE.pack(step_id, compute_ms, kind, rows, cols, 0)
    return head + bytes(_aligned(len(head)) - len(head))


def encode_event_record(event: Event, reply_to: int, seq: int, pid: int) -> bytes:
    """An event other than StepDone, as a record payload."""
    if type(event) is Done and event.command in _DONE_CODES:
        return event_head(E_DONE, _DONE_CODES[event.command], reply_to, seq, pid)
    line = encode_event(event, seq=seq, wall_ms=time.time_ns() / 1e6, mono_ms=time.monotonic_ns() / 1e6,
                        span_id=f"worker-{pid}/{seq}/{type(event).__name__}", pid=pid, reply_to=reply_to)
    return PREFIX.pack(E_JSON, 0, 0, reply_to) + line


@dataclass(frozen=True, slots=True)
class StepOutput:
    """Where a StepDone record's output lies in its payload."""
    kind: int
    rows: int
    cols: int
    offset: int
    nbytes: int


def decode_event_record(payload: memoryview, ref: RecordRef) -> tuple[Envelope, StepOutput | None]:
    """An event record's payload -> its envelope (and, for StepDone, where the output lies: in the same record,
    `ref`). Raises WireError."""
    if len(payload) < PREFIX.size:
        raise WireError(f"event record of {len(payload)} bytes is shorter than its prefix")
    mtype, aux, count, reply_to = PREFIX.unpack_from(payload, 0)
    if mtype == E_JSON:
        return decode_event(bytes(payload[PREFIX.size:])), None
    at = PREFIX.size + _ENVELOPE.size
    if mtype not in (E_STEP_DONE, E_DONE) or len(payload) < at or count:
        raise WireError(f"event record type {mtype} of {len(payload)} bytes is not a known event")
    seq, pid, pad, wall_ms, mono_ms = _ENVELOPE.unpack_from(payload, PREFIX.size)
    if mtype == E_DONE:
        if aux not in _DONE_NAMES or len(payload) != at or pad:
            raise WireError(f"Done record: answers {aux}, {len(payload)} bytes")
        name = _DONE_NAMES[aux]
        return Envelope(seq, wall_ms, mono_ms, f"worker-{pid}/{seq}/Done", pid, reply_to, Done(name)), None
    if len(payload) < at + _STEP_DONE.size or aux or pad:
        raise WireError(f"StepDone record of {len(payload)} bytes is too short or has flags set")
    step_id, compute_ms, kind, rows, cols, pad2 = _STEP_DONE.unpack_from(payload, at)
    off = _aligned(at + _STEP_DONE.size)
    if kind not in ITEMSIZE or pad2:
        raise WireError(f"StepDone.kind: {kind} is no output kind")
    nbytes = rows * cols * ITEMSIZE[kind]
    if len(payload) != off + nbytes:
        raise WireError(f"StepDone.output: the record holds {len(payload)} bytes, the header says {off} + {nbytes}")
    ev = StepDone(step_id, ref, compute_ms)
    env = Envelope(seq, wall_ms, mono_ms, f"worker-{pid}/{seq}/StepDone", pid, reply_to, ev)
    return env, StepOutput(kind, rows, cols, off, nbytes)


__all__ = ["DOORBELL", "doorbell", "StepRecord", "StepOutput", "step_head", "encode_small", "decode_command_record",
           "event_head", "step_done_head", "encode_event_record", "decode_event_record", "CommandError",
           "command_name", "KIND_BY_DTYPE", "DTYPE_NAME", "ITEMSIZE"]
