"""The worker's messages, sans-IO: typed commands in, typed events out. On the wire they are ring records
(engine.worker_records): the per-token pair and the in-band ops in fixed layouts, the rare ones (Initialize, Load,
Ready, Loaded, CommandError, Fatal, Stopped) as one JSON object inside their record, encoded and decoded here.

Commands carry a command id `cid`; every event carries the envelope the seed's events carry (a per-process sequence
number, wall and monotonic clocks in ms, a span id, the pid) plus `reply_to`, the cid it answers (0: none).
Bulk data never travels here: only `RecordRef`s into the shared-memory arena (engine.arena).

`decode_command` and `decode_event` are strict: unknown types, missing or extra fields and wrongly typed values raise
`WireError` naming the message and the field, the only error that escapes this module.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, Union

from common.values import Column
from engine.arena import RecordRef
from engine.errors import EngineError

MAX_LINE = 1 << 22  # a prefill Step of a few thousand columns is well under this; events are far smaller


class WireError(EngineError):
    """A control line that is not a well-formed message of this protocol. For a command that parsed as JSON,
    `command` and `cid` say which one it was (so the worker can answer it), else they are None."""

    def __init__(self, detail: str, *, command: str | None = None, cid: int | None = None) -> None:
        super().__init__(detail)
        self.command = command
        self.cid = cid


WireColumn = Column  # the old name: a Step's columns are the shared type (common.values)


# ---- commands (client -> worker) ----

@dataclass(frozen=True, slots=True)
class Initialize:
    cid: int
    device: str | None


@dataclass(frozen=True, slots=True)
class Load:
    cid: int
    path: str
    start: int
    end: int
    n_slots: int
    max_context: int
    warmup: int  # compile decode steps of 1..warmup sequences and the prefill chunks before Loaded; 0: none
    kv_blocks: int = 0  # the KV pool's blocks per layer (engine/kv_blocks.py); 0: every slot at max_context


@dataclass(frozen=True, slots=True)
class Step:
    cid: int
    step_id: int
    columns: tuple[WireColumn, ...]
    sampling: tuple[dict[str, Any], ...]  # Sampling fields; one for all columns, or one per needs_logits column
    per_column: bool  # whether `sampling` is the per-column form (Stage.step takes either)
    input: RecordRef | None


@dataclass(frozen=True, slots=True)
class ZeroSlot:
    cid: int
    slot: int


@dataclass(frozen=True, slots=True)
class BlockTable:
    """Make `blocks` the slot's KV block table (Stage.block_table)."""
    cid: int
    slot: int
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Reset:
    cid: int


@dataclass(frozen=True, slots=True)
class Rollback:
    cid: int
    slot: int
    pos: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    cid: int


Command = Union[Initialize, Load, Step, ZeroSlot, BlockTable, Reset, Rollback, Shutdown]
COMMANDS: dict[str, type] = {c.__name__: c for c in (Initialize, Load, Step, ZeroSlot, BlockTable, Reset, Rollback,
                                                     Shutdown)}


# ---- events (worker -> client) ----

@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a loaded stage holds; `start`/`end` are the layer range, `total` the model's depth."""
    start: int
    end: int
    total: int
    dim: int
    act_dtype: str
    weight_bytes: int
    kv_bytes: int
    fingerprint: str
    load_ms: float
    warmup_ms: float  # compiling the step shapes after the load (Stage.warmup); 0 when Load asked for none
    warmup_shapes: int
    kv_blocks: int = 0  # the KV pool: blocks of kv_block_size positions per layer (engine/kv_blocks.py)
    kv_block_size: int = 0

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.total


@dataclass(frozen=True, slots=True)
class Ready:
    requested: str | None
    device: str
    compiler: str
    reason: str
    probe: tuple[int, ...]
    probe_ms: float


@dataclass(frozen=True, slots=True)
class Loaded:
    info: WorkerInfo


@dataclass(frozen=True, slots=True)
class StepDone:
    step_id: int
    output: RecordRef
    compute_ms: float


@dataclass(frozen=True, slots=True)
class Done:
    """Acknowledges a command that returns nothing (ZeroSlot, BlockTable, Reset, Rollback)."""
    command: str


@dataclass(frozen=True, slots=True)
class CommandError:
    """The command was refused or failed without harming the worker; it can take the next one."""
    command: str
    reason: str


@dataclass(frozen=True, slots=True)
class Fatal:
    """The worker cannot go on; it exits right after sending this. `kind` names the problem (for a corrupt ring
    record: "record.<field>")."""
    kind: str
    detail: str


@dataclass(frozen=True, slots=True)
class Stopped:
    reason: str


Event = Union[Ready, Loaded, StepDone, Done, CommandError, Fatal, Stopped]
EVENTS: dict[str, type] = {e.__name__: e for e in (Ready, Loaded, StepDone, Done, CommandError, Fatal, Stopped)}


@dataclass(frozen=True, slots=True)
class Envelope:
    """An event as it arrived, with the producer's stamps."""
    seq: int
    wall_ms: float
    mono_ms: float
    span_id: str
    pid: int
    reply_to: int
    event: Event


_ENVELOPE_TYPES = {"seq": int, "wall_ms": float, "mono_ms": float, "span_id": str, "pid": int, "reply_to": int}


def command_name(cmd: Command) -> str:
    return type(cmd).__name__


# ---- encoding ----

def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_to_wire(v) for v in value]
    return value


def encode_command(cmd: Command) -> bytes:
    obj = {"type": type(cmd).__name__, **_to_wire(cmd)}
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def encode_event(event: Event, *, seq: int, wall_ms: float, mono_ms: float, span_id: str, pid: int,
                 reply_to: int) -> bytes:
    obj = {"type": type(event).__name__, "seq": seq, "wall_ms": wall_ms, "mono_ms": mono_ms, "span_id": span_id,
           "pid": pid, "reply_to": reply_to, **_to_wire(event)}
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n"


# ---- strict decoding ----

def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(inner[0], value, where)
        raise WireError(f"{where}: unsupported union")  # pragma: no cover - no such field is declared
    if tp is Any:
        return value
    if tp is bool:
        if type(value) is not bool:
            raise WireError(f"{where}: expected a boolean, got {value!r}")
        return value
    if tp is int:
        if type(value) is not int:
            raise WireError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if type(value) not in (int, float):
            raise WireError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if type(value) is not str:
            raise WireError(f"{where}: expected a string, got {value!r}")
        return value
    if origin is tuple:
        if type(value) is not list:
            raise WireError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return tuple(_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if type(value) is not dict:
            raise WireError(f"{where}: expected an object, got {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if type(value) is not dict:
            raise WireError(f"{where}: expected an object, got {type(value).__name__}")
        return _build(tp, value, where)
    raise WireError(f"{where}: unsupported field type {tp!r}")  # pragma: no cover


_HINTS: dict[type, dict[str, Any]] = {}


def _build(cls: type, obj: dict, where: str, skip: tuple[str, ...] = ()) -> Any:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    extra = set(obj) - set(names) - set(skip)
    if extra:
        raise WireError(f"{where}: unknown field(s) {sorted(extra)}")
    kwargs = {}
    for name in names:
        if name not in obj:
            raise WireError(f"{where}: missing field {name!r}")
        kwargs[name] = _convert(hints[name], obj[name], f"{where}.{name}")
    return cls(**kwargs)


def _parse_line(line: bytes, what: str) -> dict:
    if len(line) > MAX_LINE:
        raise WireError(f"{what} line of {len(line)} bytes exceeds {MAX_LINE}")
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"{what} line is not JSON: {exc}") from None
    if type(obj) is not dict or type(obj.get("type")) is not str:
        raise WireError(f"{what} line is not an object with a string 'type'")
    return obj


def decode_command(line: bytes) -> Command:
    obj = _parse_line(line, "command")
    cid = obj.get("cid") if type(obj.get("cid")) is int else None
    cls = COMMANDS.get(obj["type"])
    if cls is None:
        raise WireError(f"unknown command type {obj['type']!r}", command=obj["type"], cid=cid)
    try:
        return _build(cls, obj, cls.__name__, skip=("type",))
    except WireError as exc:
        raise WireError(str(exc), command=cls.__name__, cid=cid) from None


def decode_event(line: bytes) -> Envelope:
    obj = _parse_line(line, "event")
    cls = EVENTS.get(obj["type"])
    if cls is None:
        raise WireError(f"unknown event type {obj['type']!r}")
    stamps = {}
    for k, tp in _ENVELOPE_TYPES.items():
        if k not in obj:
            raise WireError(f"{cls.__name__}: envelope lacks {k!r}")
        stamps[k] = _convert(tp, obj[k], f"{cls.__name__}.{k}")
    body = {k: v for k, v in obj.items() if k not in _ENVELOPE_TYPES and k != "type"}
    return Envelope(event=_build(cls, body, cls.__name__), **stamps)
