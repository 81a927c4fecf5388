"""Message types and their frozen events; each event knows its payload layout.

One table (`_message(...)` on each class) says which `MsgType` an event travels as and which field codec
(`mesh.proto.wire`) writes each dataclass field, in declaration order. `encode_payload` and `decode_payload` walk
that table; nothing else in the package knows a payload layout.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Any, ClassVar

from common.values import Column, Sampling, samplings_for

from . import wire
from .errors import ErrorCode, ProtocolError
from .wire import BOOL, BYTES, F64, I32, STR, U16, U32, U32S, U64, U8, VIEW, Reader


class MsgType(IntEnum):
    """The frame header's type byte. Values are wire-stable; gaps leave room per group."""

    # handshake
    HELLO = 1
    WELCOME = 2
    AUTH_PROOF = 3
    AUTH_OK = 4
    # liveness, flow control, teardown
    PING = 8
    PONG = 9
    WINDOW_UPDATE = 10
    ERROR = 11
    SHUTDOWN = 12
    # fleet control
    JOIN = 16
    INFO_REQUEST = 17
    INFO = 18
    LOAD = 19
    ACK = 20
    VOCAB = 21
    CHAIN = 22
    STATS_REQUEST = 23
    STATS = 24
    LEFT_OUT = 25
    # compute
    STEP = 32
    BATCH_STEP = 33
    BATCH_INIT = 34
    BLOCK_TABLE = 35
    ZERO_SLOT = 36
    ROLLBACK = 37
    RESET = 38
    DRAFT = 39
    DRAFT_BATCH = 40
    DRAFT_SEED = 41
    # replies
    HIDDEN = 48
    TOKENS = 49
    DONE = 50
    # weight shipping
    SHIP_BEGIN = 64
    SHIP_RESUME = 65
    SHIP_CHUNK = 66
    SHIP_END = 67
    # webrtc
    SIGNAL = 80
    RTC_SERVE = 81
    RTC_CHAIN = 82
    # the outer type of every frame after the handshake; the real type is sealed inside (mesh/proto/seal.py)
    SEALED = 127


class LoadCode(IntEnum):
    """`Ack.code` values answering a `Load`."""

    OK = 0
    FAIL = 1
    NEED_WEIGHTS = 2
    WRONG_CHECKPOINT = 3


class LeftOutCode(IntEnum):
    """Why the coordinator leaves a joined peer out of a session (`LeftOut.code`)."""

    OTHER = 0
    PINNED_OVERLAP = 1   # its --layers overlap a range another peer was pinned to first
    MEMORY = 2           # it offers less memory than one layer of the model needs
    TOO_SLOW = 3         # the planner predicts a faster chain without it
    SURPLUS = 4          # more peers than layers to give them


class SignalKind(IntEnum):
    OFFER = 0    # make an offer; the answer carries this peer's full SDP
    ANSWER = 1   # here is the remote offer; answer with this peer's SDP
    FINISH = 2   # here is the remote answer; apply it


# Per-frame header and handshake constants live here so both the codec and auth can share them.
NONCE_SIZE = 32
PROOF_SIZE = 32
MAX_NDIM = 8

# dtype name -> (wire code, bytes per element). Activations keep the engine's inter-layer dtype on the wire.
DTYPES: dict[str, tuple[int, int]] = {"f32": (0, 4), "f16": (1, 2), "bf16": (2, 2)}
_DTYPE_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}


def _tuple(obj: Any, name: str) -> None:
    """Normalize a sequence field to a tuple so events stay immutable and hashable."""
    value = getattr(obj, name)
    if not isinstance(value, tuple):
        object.__setattr__(obj, name, tuple(value))


# --------------------------------------------------------------------------------------------------- value types


@dataclass(frozen=True, slots=True)
class Activation:
    """Hidden states as raw bytes: dtype name, shape, and exactly prod(shape) * itemsize bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"Activation dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        _tuple(self, "shape")
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"Activation has {len(self.shape)} dimensions, at most {MAX_NDIM} allowed")
        if any(type(d) is not int or d < 0 for d in self.shape):
            raise ValueError(f"Activation shape {self.shape} must be non-negative ints")
        if not isinstance(self.data, bytes):
            object.__setattr__(self, "data", bytes(self.data))
        want = math.prod(self.shape) * DTYPES[self.dtype][1]
        if len(self.data) != want:
            raise ValueError(f"Activation {self.dtype}{list(self.shape)} needs {want} bytes, got {len(self.data)}")

    @classmethod
    def from_array(cls, arr: Any) -> "Activation":
        """From a numpy float32/float16 array (C order)."""
        import numpy as np

        names = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}
        if arr.dtype not in names:
            raise ValueError(f"no wire dtype for numpy {arr.dtype}; use float32 or float16")
        return cls(names[arr.dtype], tuple(int(d) for d in arr.shape), np.ascontiguousarray(arr).tobytes())

    def to_array(self) -> Any:
        """As a read-only numpy array over the bytes (no copy). numpy has no bfloat16, so bf16 is refused."""
        import numpy as np

        if self.dtype == "bf16":
            raise ValueError("numpy has no bfloat16; read Activation.data directly")
        np_dtype = np.float32 if self.dtype == "f32" else np.float16
        return np.frombuffer(self.data, dtype=np_dtype).reshape(self.shape)


# Column and Sampling are defined once for every package (common.values); the decoder builds them directly, so a
# step's values reach the Stage without another conversion. `SamplingParams` is the old name, kept for callers.
SamplingParams = Sampling


_COUNT = struct.Struct("<I")


class _ActivationField(wire.Field):
    __slots__ = ()
    label = "activation"
    head = struct.Struct("<BB")

    def put(self, out: list, value: Activation) -> None:
        out.append(self.head.pack(DTYPES[value.dtype][0], len(value.shape)))
        out.append(struct.pack(f"<{len(value.shape)}I", *value.shape))
        out.append(value.data)

    def get(self, r: Reader, field: str) -> Activation:
        code, ndim = r.unpack(self.head, field, "header")
        if code not in _DTYPE_BY_CODE:
            raise r.fail(f"{field} has unknown dtype code {code}")
        if ndim > MAX_NDIM:
            raise r.fail(f"{field} has {ndim} dimensions, at most {MAX_NDIM} allowed")
        shape = struct.unpack(f"<{ndim}I", r.take(4 * ndim, field, "shape"))
        dtype = _DTYPE_BY_CODE[code]
        # The size is implied by dtype and shape and checked against the payload before any copy.
        n = math.prod(shape) * DTYPES[dtype][1]
        return Activation(dtype, shape, bytes(r.take(n, field, "data")))


class _SamplingField(wire.Field):
    __slots__ = ()
    label = "sampling"
    st = struct.Struct("<dIdQ")

    def put(self, out: list, v: Sampling) -> None:
        out.append(self.st.pack(v.temperature, v.top_k, v.top_p, v.seed))

    def get(self, r: Reader, field: str) -> Sampling:
        return Sampling(*r.unpack(self.st, field))


class _SamplingsField(wire.Field):
    """A u32 count, then that many `samp` records: one for every column that needs logits, or one per such column
    (each sequence of a batched step samples with its own parameters and seed)."""

    __slots__ = ()
    label = "samplings"
    st = _SamplingField.st

    def put(self, out: list, v: tuple[Sampling, ...]) -> None:
        out.append(_COUNT.pack(len(v)))
        out.extend(self.st.pack(s.temperature, s.top_k, s.top_p, s.seed) for s in v)

    def get(self, r: Reader, field: str) -> tuple[Sampling, ...]:
        (n,) = r.unpack(_COUNT, field, "count")
        raw = r.take(n * self.st.size, field, "records")
        return tuple(Sampling(*rec) for rec in self.st.iter_unpack(raw))


class _ColumnsField(wire.Field):
    __slots__ = ()
    label = "columns"
    rec = struct.Struct("<IIBI")

    def put(self, out: list, cols: tuple[Column, ...]) -> None:
        out.append(struct.pack("<I", len(cols)))
        out.extend(self.rec.pack(c.pos, c.slot, 1 if c.needs_logits else 0, c.token) for c in cols)

    def get(self, r: Reader, field: str) -> tuple[Column, ...]:
        (n,) = r.unpack(_COUNT, field, "count")
        raw = r.take(n * self.rec.size, field, "columns")
        out = []
        for pos, slot, flag, token in self.rec.iter_unpack(raw):
            if flag > 1:
                raise r.fail(f"{field}: needs_logits must be 0 or 1, got {flag}")
            out.append(Column(pos, slot, flag == 1, token))
        return tuple(out)


class _VocabField(wire.Field):
    """Display vocab: a u32 count, then u16 byte lengths, then the token bytes back to back."""

    __slots__ = ()
    label = "vocab"

    def put(self, out: list, tokens: tuple[bytes, ...]) -> None:
        out.append(struct.pack(f"<I{len(tokens)}H", len(tokens), *(len(t) for t in tokens)))
        out.append(b"".join(tokens))

    def get(self, r: Reader, field: str) -> tuple[bytes, ...]:
        (n,) = r.unpack(_COUNT, field, "count")
        lengths = struct.unpack(f"<{n}H", r.take(2 * n, field, "lengths"))
        blob = r.take(sum(lengths), field, "token bytes")
        out, at = [], 0
        for length in lengths:
            out.append(bytes(blob[at:at + length]))
            at += length
        return tuple(out)


ACTIVATION = _ActivationField()
OPT_ACTIVATION = wire.Optional(ACTIVATION)
SAMPLING = _SamplingField()
SAMPLINGS = _SamplingsField()
COLUMNS = _ColumnsField()
VOCAB = _VocabField()
TRIPLES = wire.Array("III", "(slot, token, pos)")


# --------------------------------------------------------------------------------------------------- the table


class Event:
    """Base of every message event. `TYPE` is the message type it travels as."""

    __slots__ = ()
    TYPE: ClassVar[MsgType]


_CODECS: dict[MsgType, tuple[type, tuple[tuple[str, wire.Field], ...]]] = {}


def _message(msg_type: MsgType, *codecs: wire.Field):
    def register(cls: type) -> type:
        names = [f.name for f in fields(cls)]
        if len(names) != len(codecs):
            raise TypeError(f"{cls.__name__}: {len(names)} fields but {len(codecs)} wire codecs")
        if msg_type in _CODECS:
            raise TypeError(f"{msg_type!r} registered twice")
        cls.TYPE = msg_type
        _CODECS[msg_type] = (cls, tuple(zip(names, codecs)))
        return cls

    return register


def encode_payload(event: Event) -> list:
    """The payload of `event` as a list of byte chunks. Raises ValueError naming the field that does not fit."""
    if type(event) is BatchStep and (chunks := _encode_batch_step(event)) is not None:
        return chunks
    try:
        cls, layout = _CODECS[event.TYPE]
    except (AttributeError, KeyError):
        raise TypeError(f"{type(event).__name__} is not a protocol event") from None
    if type(event) is not cls:
        raise TypeError(f"{type(event).__name__} is not a protocol event")
    out: list = []
    for name, codec in layout:
        value = getattr(event, name)
        try:
            codec.put(out, value)
        except (struct.error, TypeError, ValueError, OverflowError, KeyError, AttributeError) as exc:
            raise ValueError(f"{cls.__name__}.{name}: cannot encode {value!r:.80} as {codec.label}: {exc}") from None
    return out


def decode_payload(msg_type: MsgType, payload: memoryview) -> Event:
    """Decode one payload. Only ProtocolError escapes."""
    if msg_type == MsgType.BATCH_STEP and (event := _decode_batch_step(payload)) is not None:
        return event
    if msg_type in _GROUP_TOKENS and len(payload) >= 8:     # a step's answer: (group, token ids), every token
        group, n = _GROUP_COUNT.unpack_from(payload)
        if len(payload) == 8 + 4 * n:
            return _GROUP_TOKENS[msg_type](group, struct.unpack_from(f"<{n}I", payload, 8))
    cls, layout = _CODECS[msg_type]
    r = Reader(payload, cls.__name__)
    try:
        values = [codec.get(r, name) for name, codec in layout]
        r.finish()
        return cls(*values)
    except (ValueError, TypeError) as exc:  # a value type's own validation (e.g. Sampling.top_p)
        raise ProtocolError(ErrorCode.MALFORMED, f"{cls.__name__}: {exc}") from None


# BatchStep, written and read in one place: a decode step's frame is encoded and decoded on every stage of every
# token, and the table's walk (a Reader, a call per field and per check) was ~110 Python calls a decode and ~90 an
# encode, ~0.2 and ~0.14 ms cold on a stage's hot path (NOTES "The hot path on 2 cores"). Same layout as the table's
# (U32, BOOL, COLUMNS, OPT_ACTIVATION, SAMPLINGS) and the same values' own checks; anything the fast path does not
# accept (a malformed payload, a value out of range) goes the table's way, which raises its own error naming the
# field. tests/test_proto.py checks both ways give the same bytes and the same events or errors.
_BS_HEAD = struct.Struct("<IBI")          # group, wide, number of columns
_BS_COL = _ColumnsField.rec               # pos, slot, needs_logits, token
_BS_ACT = struct.Struct("<BB")            # dtype code, ndim
_BS_SAMP = _SamplingField.st
# A sequence's steps carry the same samplings step after step: their decoded (immutable, checked) values by their
# bytes, so a decode step builds and checks no Sampling (a handful of entries; a value that fails its checks is
# never kept)
_BS_SAMPLINGS: dict[bytes, tuple] = {}


def activation_head(dtype: str, shape: tuple[int, ...]) -> bytes:
    """A present activation's bytes before its rows in a BatchStep (presence, dtype code, ndim, shape)."""
    return b"\x01" + _BS_ACT.pack(DTYPES[dtype][0], len(shape)) + struct.pack(f"<{len(shape)}I", *shape)


def _encode_batch_step(ev: "BatchStep") -> list | None:
    try:
        out = [_BS_HEAD.pack(ev.group, 1 if ev.wide else 0, len(ev.columns)),
               *[_BS_COL.pack(c.pos, c.slot, 1 if c.needs_logits else 0, c.token) for c in ev.columns]]
        h = ev.hidden
        if h is None:
            out.append(b"\x00")
        else:
            out += [activation_head(h.dtype, h.shape), h.data]
        out.append(_COUNT.pack(len(ev.sampling)))
        out += [_BS_SAMP.pack(x.temperature, x.top_k, x.top_p, x.seed) for x in ev.sampling]
        if type(ev.group) is not int:      # the table's U32 refuses a bool or a float: let it say so
            return None
        return out
    except (struct.error, TypeError, ValueError, OverflowError, KeyError, AttributeError):
        return None


def _decode_batch_step(view: memoryview) -> "BatchStep | None":
    try:
        group, wide, n = _BS_HEAD.unpack_from(view, 0)
        at = _BS_HEAD.size + n * _BS_COL.size
        if wide > 1 or at >= len(view):
            return None
        cols = []
        for pos, slot, flag, token in _BS_COL.iter_unpack(view[_BS_HEAD.size:at]):
            if flag > 1:
                return None
            cols.append(Column(pos, slot, flag == 1, token))
        present, at = view[at], at + 1
        hidden = None
        if present == 1:
            code, ndim = _BS_ACT.unpack_from(view, at)
            at += _BS_ACT.size
            if code not in _DTYPE_BY_CODE or ndim > MAX_NDIM:
                return None
            shape = struct.unpack_from(f"<{ndim}I", view, at)
            at += 4 * ndim
            dtype = _DTYPE_BY_CODE[code]
            end = at + math.prod(shape) * DTYPES[dtype][1]
            if end > len(view):
                return None
            # Activation's own checks hold by construction here (a known dtype code, at most MAX_NDIM unsigned
            # dims, exactly their bytes): built without running them again (cold Python on every stage)
            hidden = object.__new__(Activation)
            object.__setattr__(hidden, "dtype", dtype)
            object.__setattr__(hidden, "shape", shape)
            object.__setattr__(hidden, "data", bytes(view[at:end]))
            at = end
        elif present != 0:
            return None
        (m,) = _COUNT.unpack_from(view, at)
        at += _COUNT.size
        if at + m * _BS_SAMP.size != len(view):
            return None
        raw = bytes(view[at:])
        sampling = _BS_SAMPLINGS.get(raw)
        if sampling is None:
            sampling = tuple(Sampling(*rec) for rec in _BS_SAMP.iter_unpack(raw))
            if len(_BS_SAMPLINGS) >= 64:
                _BS_SAMPLINGS.clear()
            _BS_SAMPLINGS[raw] = sampling
        return BatchStep(group, wide == 1, tuple(cols), hidden, sampling)
    except (struct.error, ValueError, TypeError, IndexError):
        return None


_GROUP_COUNT = struct.Struct("<II")     # Tokens and Done: group, then the count of u32 token ids


def tokens_reply(msg_type: MsgType, group: int, tokens: tuple[int, ...]) -> bytes:
    """The plaintext (type byte, payload) of a Tokens or Done event, as the table encodes it, without building the
    event (a peer's steady decode step, mesh/proto/steady.py). struct.error for a value out of u32."""
    return bytes((msg_type,)) + _GROUP_COUNT.pack(group, len(tokens)) + struct.pack(f"<{len(tokens)}I", *tokens)


def is_known(type_byte: int) -> bool:
    return type_byte in _CODECS


# --------------------------------------------------------------------------------------------------- handshake


@_message(MsgType.HELLO, U8, U8, BYTES, BYTES, BOOL)
@dataclass(frozen=True, slots=True)
class Hello(Event):
    """Client -> server, the first frame of every connection: versions, a fresh nonce, an ephemeral X25519 public
    key. `auth`: the client holds a fleet token."""

    min_version: int
    max_version: int
    nonce: bytes
    public_key: bytes
    auth: bool


@_message(MsgType.WELCOME, U8, BYTES, BYTES)
@dataclass(frozen=True, slots=True)
class Welcome(Event):
    """Server -> client: the chosen version, the server nonce, its ephemeral X25519 public key. No proof: the
    client proves first (`AuthProof`), the server answers with its own in `AuthOk`."""

    version: int
    nonce: bytes
    public_key: bytes


@_message(MsgType.AUTH_PROOF, BYTES)
@dataclass(frozen=True, slots=True)
class AuthProof(Event):
    proof: bytes


@_message(MsgType.AUTH_OK, BYTES)
@dataclass(frozen=True, slots=True)
class AuthOk(Event):
    """Server -> client after the client's proof verified: the server's own proof."""

    proof: bytes


# --------------------------------------------------------------------------------------------------- liveness, flow


@_message(MsgType.PING, U64)
@dataclass(frozen=True, slots=True)
class Ping(Event):
    nonce: int


@_message(MsgType.PONG, U64)
@dataclass(frozen=True, slots=True)
class Pong(Event):
    nonce: int


@_message(MsgType.WINDOW_UPDATE, U64)
@dataclass(frozen=True, slots=True)
class WindowUpdate(Event):
    """The receiver grants `credit` more bytes of flow-controlled frames (see `frame_cost`)."""

    credit: int


@_message(MsgType.ERROR, wire.Enum(ErrorCode, "H"), STR)
@dataclass(frozen=True, slots=True)
class Error(Event):
    """The sender is closing this connection because of `code`; `reason` is for humans."""

    code: ErrorCode
    reason: str


@_message(MsgType.SHUTDOWN)
@dataclass(frozen=True, slots=True)
class Shutdown(Event):
    """A clean goodbye: the sender closes this link after it."""


# --------------------------------------------------------------------------------------------------- fleet


@_message(MsgType.JOIN, U16, STR, U64, I32, I32, STR)
@dataclass(frozen=True, slots=True)
class Join(Event):
    """Peer -> coordinator registration. advertise "" = derive from source address. pinned -1/-1 = unpinned.
    `name`: what the peer calls itself (`--name`, default the hostname); the registry checks it (NAME_RULE)."""

    listen_port: int
    advertise: str
    memory_mb: int
    pinned_start: int = -1
    pinned_end: int = -1
    name: str = ""

    def __post_init__(self) -> None:
        unpinned = self.pinned_start == -1 and self.pinned_end == -1
        if not unpinned and not 0 <= self.pinned_start < self.pinned_end:
            raise ValueError(f"Join pinned range [{self.pinned_start}, {self.pinned_end}) must be -1/-1 or "
                             f"0 <= start < end")

    @property
    def pinned(self) -> tuple[int, int] | None:
        return None if self.pinned_start == -1 else (self.pinned_start, self.pinned_end)


@_message(MsgType.INFO_REQUEST, STR, BYTES)
@dataclass(frozen=True, slots=True)
class InfoRequest(Event):
    """Ask a peer for its `Info`. `fingerprint`: the model whose speed figures the peer should report ("" = none).
    `pad`: filler the peer echoes back in `Info.pad`, so the coordinator can time the link's bandwidth with the same
    round trip it times empty (the planner's link figures)."""

    fingerprint: str = ""
    pad: bytes = b""


@_message(MsgType.INFO, U32, U32, U32, U64, BOOL, STR, STR, BOOL, U32, U32, F64, F64, F64, BOOL, BYTES, U8)
@dataclass(frozen=True, slots=True)
class Info(Event):
    """A stage's self-description. With loaded False, start/end are the pinned range (if pinned) or 0/0.
    kv_blocks / kv_block_size: the loaded stage's KV pool (blocks of kv_block_size positions; 0/0 not loaded): the
    scheduler sizes its block allocator to the smallest pool of the chain (engine/kv_blocks.py).
    The speed figures are the peer's own measurement of this model on its device (mesh.speed; 0 = not measured):
    ms per layer of a one-column decode step and of a 16-column prefill chunk, and the fixed ms of a step.
    `measures`: the peer measures its stage when it loads (it warms up), so a probe load would give figures.
    `pad` echoes the request's filler (zeros of the same length). `kv_bytes`: the bytes of one KV value the peer's
    stage keeps or would keep (2: f16, 4: f32; 0: not known), so the planner prices its KV cache as it is held
    (protocol version 4)."""

    start: int
    end: int
    total_layers: int
    memory_mb: int
    pinned: bool
    fingerprint: str
    backend: str
    loaded: bool
    kv_blocks: int = 0
    kv_block_size: int = 0
    decode_ms_layer: float = 0.0
    prefill_ms_layer: float = 0.0
    step_ms: float = 0.0
    measures: bool = False
    pad: bytes = b""
    kv_bytes: int = 0

    def __post_init__(self) -> None:
        if self.kv_bytes not in (0, 2, 4):
            raise ValueError(f"Info.kv_bytes must be 0, 2 or 4, got {self.kv_bytes!r}")
        for name in ("decode_ms_layer", "prefill_ms_layer", "step_ms"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"Info.{name} must be a finite number >= 0, got {v!r}")


@_message(MsgType.LOAD, U32, U32, U32, STR, BYTES, U32, U32, U32)
@dataclass(frozen=True, slots=True)
class Load(Event):
    """Load (or reload) layers [start, end) of the model with this fingerprint; answered by Ack(of=LOAD).
    `sha256`: the digest of the range file the coordinator would ship for this range; a peer loading from its cache
    checks the file against it (b"": none given, the peer asks for the weights instead of trusting its cache).
    `n_slots`, `max_context`: the session's KV slots and context, the same on every stage (the scheduler's sequences
    live in those slots; a prompt's chunks depend on the context left, so stages must agree for bitwise splits).
    `warmup`: decode widths the session wants compiled before the answer (Stage.warmup). 0 in any of the three: the
    peer's own setting."""

    start: int
    end: int
    total_layers: int
    fingerprint: str
    sha256: bytes = b""
    n_slots: int = 0
    max_context: int = 0
    warmup: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.total_layers:
            raise ValueError(f"Load range [{self.start}, {self.end}) not within 0..{self.total_layers}")


@_message(MsgType.ACK, wire.Enum(MsgType, "B"), U16, STR)
@dataclass(frozen=True, slots=True)
class Ack(Event):
    """Generic answer to Load, Chain, BatchInit, ShipEnd, RtcServe, RtcChain, Signal(FINISH). code 0 = ok."""

    of: MsgType
    code: int = 0
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.code == 0


@_message(MsgType.LEFT_OUT, wire.Enum(LeftOutCode, "B"), STR)
@dataclass(frozen=True, slots=True)
class LeftOut(Event):
    """Coordinator -> peer on its control link: this session goes on without you, and why (one line, with the
    figures). The coordinator then releases the peer, which re-joins and waits in the pool for a later session."""

    code: LeftOutCode
    reason: str


@_message(MsgType.VOCAB, VOCAB)
@dataclass(frozen=True, slots=True)
class Vocab(Event):
    """Display-only vocabulary: token id i renders as tokens[i]."""

    tokens: tuple[bytes, ...]

    def __post_init__(self) -> None:
        _tuple(self, "tokens")


@_message(MsgType.CHAIN, STR, BOOL)
@dataclass(frozen=True, slots=True)
class Chain(Event):
    """Forward this stage's output to `addr` ("" = clear; ":port" = this connection's peer IP). sink: next hop is
    the coordinator's return sink. Answered by Ack(of=CHAIN)."""

    addr: str
    sink: bool = False


@_message(MsgType.STATS_REQUEST)
@dataclass(frozen=True, slots=True)
class StatsRequest(Event):
    """Coordinator -> stage on the control link: how much have you computed? Answered by Stats."""


@_message(MsgType.STATS, U64, U64, U64)
@dataclass(frozen=True, slots=True)
class Stats(Event):
    """A stage's cumulative work since it loaded its layers: steps, columns (tokens) computed, and microseconds spent
    computing them. The coordinator turns two readings into ms per step, tok/s and busy time (mesh/serve/status.py)."""

    steps: int
    columns: int
    busy_us: int


# --------------------------------------------------------------------------------------------------- compute


@_message(MsgType.STEP, U32, U32, U32, U32S, OPT_ACTIVATION, SAMPLING)
@dataclass(frozen=True, slots=True)
class Step(Event):
    """One sequence step: the first stage embeds `tokens`, later stages take `hidden`."""

    group: int
    slot: int
    pos: int
    tokens: tuple[int, ...] = ()
    hidden: Activation | None = None
    sampling: Sampling = field(default_factory=Sampling)

    def __post_init__(self) -> None:
        _tuple(self, "tokens")


@_message(MsgType.BATCH_STEP, U32, BOOL, COLUMNS, OPT_ACTIVATION, SAMPLINGS)
@dataclass(frozen=True, slots=True)
class BatchStep(Event):
    """A batched step over columns; `wide` selects the prefill plan. `sampling`: one Sampling for every column that
    needs logits, or one per such column in column order (a single Sampling given here becomes a 1-tuple)."""

    group: int
    wide: bool
    columns: tuple[Column, ...]
    hidden: Activation | None = None
    sampling: tuple[Sampling, ...] = (Sampling(),)

    def __post_init__(self) -> None:
        _tuple(self, "columns")
        object.__setattr__(self, "sampling", samplings_for(self.sampling, self.columns))


@_message(MsgType.BATCH_INIT, U32)
@dataclass(frozen=True, slots=True)
class BatchInit(Event):
    n_columns: int


@_message(MsgType.BLOCK_TABLE, U32, U32S)
@dataclass(frozen=True, slots=True)
class BlockTable(Event):
    """In-band, ahead of the step that needs it: the KV block table of slot `row` (its positions
    [i * kv_block_size, (i + 1) * kv_block_size) live in blocks[i]); every stage applies it (Stage.block_table)."""

    row: int
    blocks: tuple[int, ...]

    def __post_init__(self) -> None:
        _tuple(self, "blocks")


@_message(MsgType.ZERO_SLOT, U32)
@dataclass(frozen=True, slots=True)
class ZeroSlot(Event):
    slot: int


@_message(MsgType.ROLLBACK, U32, U32)
@dataclass(frozen=True, slots=True)
class Rollback(Event):
    """Truncate the slot's cache so that its next position is `pos`."""

    slot: int
    pos: int


@_message(MsgType.RESET)
@dataclass(frozen=True, slots=True)
class Reset(Event):
    pass


@_message(MsgType.DRAFT, U32, U32, U32, U32)
@dataclass(frozen=True, slots=True)
class Draft(Event):
    """Draft k tokens on the last stage starting from `token` at `pos`; answered by Tokens."""

    slot: int
    pos: int
    token: int
    k: int


@_message(MsgType.DRAFT_BATCH, U32, TRIPLES)
@dataclass(frozen=True, slots=True)
class DraftBatch(Event):
    """Draft k tokens for each (slot, token, pos); answered by Tokens with len(items) * k ids."""

    k: int
    items: tuple[tuple[int, int, int], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.items, tuple) or any(not isinstance(i, tuple) for i in self.items):
            object.__setattr__(self, "items", tuple(tuple(i) for i in self.items))


@_message(MsgType.DRAFT_SEED, U32, U32)
@dataclass(frozen=True, slots=True)
class DraftSeed(Event):
    slot: int
    col: int


# --------------------------------------------------------------------------------------------------- replies


@_message(MsgType.HIDDEN, U32, ACTIVATION)
@dataclass(frozen=True, slots=True)
class Hidden(Event):
    group: int
    activation: Activation


@_message(MsgType.TOKENS, U32, U32S)
@dataclass(frozen=True, slots=True)
class Tokens(Event):
    group: int
    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        _tuple(self, "tokens")


@_message(MsgType.DONE, U32, U32S)
@dataclass(frozen=True, slots=True)
class Done(Event):
    """Last stage -> coordinator sink in chain mode."""

    group: int
    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        _tuple(self, "tokens")


# --------------------------------------------------------------------------------------------------- shipping


@_message(MsgType.SHIP_BEGIN, STR, U32, U32, U64, BYTES, STR)
@dataclass(frozen=True, slots=True)
class ShipBegin(Event):
    fingerprint: str
    start: int
    end: int
    total_bytes: int
    sha256: bytes
    name: str

    def __post_init__(self) -> None:
        if len(self.sha256) != 32:
            raise ValueError(f"ShipBegin.sha256 must be 32 bytes, got {len(self.sha256)}")


@_message(MsgType.SHIP_RESUME, U64)
@dataclass(frozen=True, slots=True)
class ShipResume(Event):
    """Receiver -> sender: bytes of the file it already holds (verified), so shipping resumes there."""

    offset: int


@_message(MsgType.SHIP_CHUNK, U64, VIEW)
@dataclass(frozen=True, slots=True)
class ShipChunk(Event):
    """`data` decodes as a read-only memoryview of the received frame (no copy); it compares equal to bytes."""

    offset: int
    data: bytes | memoryview


@_message(MsgType.SHIP_END, BYTES)
@dataclass(frozen=True, slots=True)
class ShipEnd(Event):
    sha256: bytes

    def __post_init__(self) -> None:
        if len(self.sha256) != 32:
            raise ValueError(f"ShipEnd.sha256 must be 32 bytes, got {len(self.sha256)}")


# --------------------------------------------------------------------------------------------------- webrtc


@_message(MsgType.SIGNAL, wire.Enum(SignalKind, "B"), STR)
@dataclass(frozen=True, slots=True)
class Signal(Event):
    """SDP relay; the coordinator never parses `sdp`."""

    kind: SignalKind
    sdp: str = ""


@_message(MsgType.RTC_SERVE)
@dataclass(frozen=True, slots=True)
class RtcServe(Event):
    pass


@_message(MsgType.RTC_CHAIN, BOOL)
@dataclass(frozen=True, slots=True)
class RtcChain(Event):
    sink: bool = False


ALL_EVENTS: tuple[type, ...] = tuple(cls for cls, _ in _CODECS.values())


# Tokens and Done (U32, U32S), decoded without the table's walk: the sink reads one every token
_GROUP_TOKENS = {MsgType.TOKENS: Tokens, MsgType.DONE: Done}
