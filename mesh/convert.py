"""The one place where wire events and engine values meet: columns, sampling, activations."""
from __future__ import annotations

import numpy as np

from engine.stage import Column, Sampling
from mesh import proto


# Activations: the protocol's own numpy conversion (f32/f16, raw bytes, shape) is the one definition.
def to_activation(array: np.ndarray) -> proto.Activation:
    return proto.Activation.from_array(np.ascontiguousarray(array))


def from_activation(act: proto.Activation | None) -> np.ndarray | None:
    return None if act is None else act.to_array()


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
