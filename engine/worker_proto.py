"""The worker's control protocol, sans-IO: typed commands in, typed events out, one message per line: a JSON object,
or for the per-token pair Step/StepDone a compact canonical text form (see the end of this module).

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
    if type(cmd) is Step:
        line = _compact_step(cmd)
        if line is not None:
            return line
    obj = {"type": type(cmd).__name__, **_to_wire(cmd)}
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def encode_event(event: Event, *, seq: int, wall_ms: float, mono_ms: float, span_id: str, pid: int,
                 reply_to: int) -> bytes:
    if type(event) is StepDone:
        line = _compact_step_done(event, seq, wall_ms, mono_ms, span_id, pid, reply_to)
        if line is not None:
            return line
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
    if line.startswith(_STEP_TAG):
        return _decode_compact_step(line)
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
    if line.startswith(_STEP_DONE_TAG):
        return _decode_compact_step_done(line)
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


# ---- the compact form of the per-token pair, Step and StepDone ----
#
# A decode step is the hot path: JSON and the field-by-field strict decoding above cost ~75 us per round trip with
# warm caches, several times that right after a stage's compute has flushed them. So Step and StepDone also have a
# compact text form: the type name, then space-separated numbers in a fixed order (a JSON line starts with "{").
#   Step <cid> <step_id> <per_column> <n> (<pos> <slot> <needs_logits> <token>)*n <m>
#        (<temperature> <top_k> <top_p> <seed>)*m (- | <ring> <position> <object_id> <sequence> <extent>)
#   StepDone <seq> <wall_ms> <mono_ms> <span_id> <pid> <reply_to> <step_id> <ring> <position> <object_id>
#        <sequence> <extent> <compute_ms>
# Booleans are 0/1, floats are Python's shortest round-trip repr. The form is canonical: the decoder re-encodes what
# it parsed and refuses a line that differs, so it accepts exactly what the encoder writes ("+1", "1_0", "-0", "1E5",
# a double space: all refused). What the compact form cannot carry exactly (sampling dicts with other keys or types,
# NaN, a span id with blanks) goes as JSON; decoding either form gives the same message.

_STEP_TAG = b"Step "
_STEP_DONE_TAG = b"StepDone "
SAMPLING_FIELDS: tuple[tuple[str, type], ...] = (("temperature", float), ("top_k", int), ("top_p", float),
                                                 ("seed", int))
_SAMPLING_NAMES = frozenset(name for name, _ in SAMPLING_FIELDS)


def _num(v: Any, tp: type) -> str | None:
    """The canonical text of one number of exact type `tp`, or None when it has no compact form."""
    if type(v) is not tp:
        return None
    if tp is float:
        return repr(v) if v - v == 0.0 else None  # NaN and the infinities: x - x is not 0
    return str(v)


def compact_sampling(s: Any) -> bool:
    """Whether a Step's sampling dict has the compact form: exactly SAMPLING_FIELDS, exact types, finite."""
    return type(s) is dict and len(s) == len(SAMPLING_FIELDS) and s.keys() == _SAMPLING_NAMES and \
        all(_num(s[name], tp) is not None for name, tp in SAMPLING_FIELDS)


def _compact_step(cmd: Step) -> bytes | None:
    parts = ["Step", str(cmd.cid), str(cmd.step_id), "1" if cmd.per_column else "0", str(len(cmd.columns))]
    if type(cmd.cid) is not int or type(cmd.step_id) is not int or type(cmd.per_column) is not bool:
        return None
    for c in cmd.columns:
        if type(c) is not WireColumn or type(c.pos) is not int or type(c.slot) is not int \
                or type(c.needs_logits) is not bool or type(c.token) is not int:
            return None
        parts += (str(c.pos), str(c.slot), "1" if c.needs_logits else "0", str(c.token))
    parts.append(str(len(cmd.sampling)))
    for s in cmd.sampling:
        if type(s) is not dict or len(s) != len(SAMPLING_FIELDS) or s.keys() != _SAMPLING_NAMES:
            return None
        for name, tp in SAMPLING_FIELDS:
            text = _num(s[name], tp)
            if text is None:
                return None
            parts.append(text)
    ref = cmd.input
    if ref is None:
        parts.append("-")
    else:
        if type(ref) is not RecordRef:
            return None
        for v in (ref.ring, ref.position, ref.object_id, ref.sequence, ref.extent):
            if type(v) is not int:
                return None
            parts.append(str(v))
    return " ".join(parts).encode() + b"\n"


def _compact_step_done(ev: StepDone, seq: int, wall_ms: float, mono_ms: float, span_id: str, pid: int,
                       reply_to: int) -> bytes | None:
    if type(span_id) is not str or not span_id or not span_id.isascii() or not span_id.isprintable() \
            or " " in span_id or type(ev.output) is not RecordRef:
        return None
    ref = ev.output
    ints = (seq, pid, reply_to, ev.step_id, ref.ring, ref.position, ref.object_id, ref.sequence, ref.extent)
    if any(type(v) is not int for v in ints):
        return None
    floats = [_num(float(v) if type(v) is int else v, float) for v in (wall_ms, mono_ms, ev.compute_ms)]
    if None in floats:
        return None
    return " ".join(["StepDone", str(seq), floats[0], floats[1], span_id, *map(str, ints[1:]),
                     floats[2]]).encode() + b"\n"


class _Fields:
    """Reads the blank-separated fields of a compact line in order; any misfit is a WireError naming `what`."""

    def __init__(self, line: bytes, what: str, skip: int) -> None:
        if len(line) > MAX_LINE:
            raise WireError(f"{what} line of {len(line)} bytes exceeds {MAX_LINE}")
        self.what = what
        self.fields = line.removesuffix(b"\n").split(b" ")
        self.i = skip

    def take(self, name: str) -> bytes:
        if self.i >= len(self.fields):
            raise WireError(f"{self.what}: line ends before {name}")
        self.i += 1
        return self.fields[self.i - 1]

    def int(self, name: str) -> int:
        try:
            return int(self.take(name))
        except ValueError:
            raise WireError(f"{self.what}.{name}: expected an integer, got {self.fields[self.i - 1]!r}") from None

    def float(self, name: str) -> float:
        try:
            return float(self.take(name))
        except ValueError:
            raise WireError(f"{self.what}.{name}: expected a number, got {self.fields[self.i - 1]!r}") from None

    def bool(self, name: str) -> bool:
        v = self.take(name)
        if v not in (b"0", b"1"):
            raise WireError(f"{self.what}.{name}: expected 0 or 1, got {v!r}")
        return v == b"1"

    def end(self) -> None:
        if self.i != len(self.fields):
            raise WireError(f"{self.what}: {len(self.fields) - self.i} field(s) after the last one")


def _decode_compact_step(line: bytes) -> Step:
    if len(line) > MAX_LINE:
        raise WireError(f"Step line of {len(line)} bytes exceeds {MAX_LINE}", command="Step")
    v = line.removesuffix(b"\n").split(b" ")
    try:  # the fast path: plain indexing; the canonical check below catches whatever it lets through
        cid, step_id, n = int(v[1]), int(v[2]), int(v[4])
        k = 5 + 4 * n
        cols = tuple(WireColumn(int(v[j]), int(v[j + 1]), v[j + 2] == b"1", int(v[j + 3])) for j in range(5, k, 4))
        m = int(v[k])
        sampling = tuple({"temperature": float(v[j]), "top_k": int(v[j + 1]), "top_p": float(v[j + 2]),
                          "seed": int(v[j + 3])} for j in range(k + 1, k + 1 + 4 * m, 4))
        k += 1 + 4 * m
        ref = None if v[k] == b"-" and len(v) == k + 1 else \
            RecordRef(int(v[k]), int(v[k + 1]), int(v[k + 2]), int(v[k + 3]), int(v[k + 4]))
        cmd = Step(cid, step_id, cols, sampling, v[3] == b"1", ref)
        again = _compact_step(cmd)
    except (ValueError, IndexError):
        again = None
    if again is None or again.removesuffix(b"\n") != line.removesuffix(b"\n"):
        _slow_decode_step(line)  # names the field that is wrong
        raise WireError(f"Step line is not in canonical compact form: {line[:200]!r}", command="Step",
                        cid=_int_or_none(v[1]) if len(v) > 1 else None)
    return cmd


def _int_or_none(b: bytes) -> int | None:
    try:
        return int(b)
    except ValueError:
        return None


def _slow_decode_step(line: bytes) -> None:
    """Walks a compact Step field by field to raise a WireError naming the first one that is wrong."""
    f = _Fields(line, "Step", 1)
    cid = None
    try:
        cid = f.int("cid")
        f.int("step_id"), f.bool("per_column")
        for i in range(max(f.int("columns"), 0)):
            f.int(f"columns[{i}].pos"), f.int(f"columns[{i}].slot"), f.bool(f"columns[{i}].needs_logits")
            f.int(f"columns[{i}].token")
        for i in range(max(f.int("sampling"), 0)):
            for name, tp in SAMPLING_FIELDS:
                (f.float if tp is float else f.int)(f"sampling[{i}].{name}")
        if f.fields[f.i:f.i + 1] == [b"-"]:
            f.i += 1
        else:
            for name in ("ring", "position", "object_id", "sequence", "extent"):
                f.int(f"input.{name}")
        f.end()
    except WireError as exc:
        raise WireError(str(exc), command="Step", cid=cid) from None


def _decode_compact_step_done(line: bytes) -> Envelope:
    if len(line) > MAX_LINE:
        raise WireError(f"StepDone line of {len(line)} bytes exceeds {MAX_LINE}")
    v = line.removesuffix(b"\n").split(b" ")
    try:
        if len(v) != 14:
            raise ValueError
        seq, wall_ms, mono_ms, span_id = int(v[1]), float(v[2]), float(v[3]), v[4].decode("ascii")
        pid, reply_to, step_id = int(v[5]), int(v[6]), int(v[7])
        ev = StepDone(step_id, RecordRef(int(v[8]), int(v[9]), int(v[10]), int(v[11]), int(v[12])), float(v[13]))
        again = _compact_step_done(ev, seq, wall_ms, mono_ms, span_id, pid, reply_to)
    except (ValueError, UnicodeDecodeError):
        again = None
    if again is None or again.removesuffix(b"\n") != line.removesuffix(b"\n"):
        f = _Fields(line, "StepDone", 1)
        f.int("seq"), f.float("wall_ms"), f.float("mono_ms"), f.take("span_id")
        for name in ("pid", "reply_to", "step_id", "output.ring", "output.position", "output.object_id",
                     "output.sequence", "output.extent"):
            f.int(name)
        f.float("compute_ms")
        f.end()
        raise WireError(f"StepDone line is not in canonical compact form: {line[:200]!r}")
    return Envelope(seq, wall_ms, mono_ms, span_id, pid, reply_to, ev)
