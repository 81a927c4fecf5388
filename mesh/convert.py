"""Where wire events and engine values meet. Columns and sampling need no conversion any more: the wire decodes
straight into `common.values.Column` / `Sampling`, the types the engine takes. Only activations change form here
(`proto.Activation`, raw bytes with dtype and shape, <-> a numpy array viewing the same bytes)."""
from __future__ import annotations

import numpy as np

from mesh import proto


def to_activation(array: np.ndarray) -> proto.Activation:
    return proto.Activation.from_array(np.ascontiguousarray(array))


def from_activation(act: proto.Activation | None) -> np.ndarray | None:
    return None if act is None else act.to_array()


# The old conversions, kept importable for callers that still use them: each is the identity on the shared types.
def to_engine_columns(columns) -> list:
    return list(columns)


def to_wire_columns(columns) -> tuple:
    return tuple(columns)


def to_engine_sampling(s):
    return proto.Sampling() if s is None else s


def to_wire_sampling(s):
    return s
