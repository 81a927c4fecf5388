"""The one place where wire events and engine values meet: columns, sampling, activations."""
from __future__ import annotations

import numpy as np

from engine.stage import Column, Sampling
from mesh import proto

_DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2")}
_NAMES = {v: k for k, v in _DTYPES.items()}


def to_activation(array: np.ndarray) -> proto.Activation:
    dtype = np.dtype(array.dtype).newbyteorder("<")
    if dtype not in _NAMES:
        raise ValueError(f"activation dtype {array.dtype} has no wire name")
    return proto.Activation(_NAMES[dtype], tuple(int(d) for d in array.shape), np.ascontiguousarray(array, dtype).tobytes())


def from_activation(act: proto.Activation | None) -> np.ndarray | None:
    if act is None:
        return None
    if act.dtype not in _DTYPES:
        raise ValueError(f"activation dtype {act.dtype!r} is not supported by this engine")
    return np.frombuffer(act.data, _DTYPES[act.dtype]).reshape(act.shape)


def to_engine_columns(columns) -> list[Column]:
    return [Column(c.pos, c.slot, bool(c.needs_logits), c.token) for c in columns]


def to_wire_columns(columns: list[Column]) -> tuple:
    return tuple(proto.Column(c.pos, c.slot, c.needs_logits, c.token) for c in columns)


def to_engine_sampling(s) -> Sampling:
    if s is None:
        return Sampling()
    return Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)


def to_wire_sampling(s: Sampling) -> proto.SamplingParams:
    return proto.SamplingParams(s.temperature, s.top_k, s.top_p, s.seed)
