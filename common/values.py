"""The values a step is made of, defined once for every package: `Column` and `Sampling`.

The wire (mesh.proto) decodes straight into these, the coordinator and the scheduler build them, the worker's ring
records carry them and `engine.stage.Stage.step` takes them: one type from the Link to the Stage, one set of rules.
This module imports the standard library only (the headless coordinator must not load tinygrad or numpy for it), and
no package's errors: a value that breaks a rule is a `ValueError` naming the field, which each side turns into its
own error (the codec into `ProtocolError(MALFORMED)`, the worker into a refused command, the API into a 400).

Ranges are the wire's: positions, slots and tokens are u32, top_k u32, seed u64, so anything that validates here can
be sent and nothing is cut on the way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

__all__ = ["Column", "Sampling", "SamplingArg", "U32_MAX", "U64_MAX", "samplings_for"]

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Column:
    """One token's place in a step: its position in the sequence, the KV slot of that sequence, and, on the first
    stage, the token id. The last stage picks a next token for every column with `needs_logits`.

    Not validated on construction (a 64-column prefill builds 64 of them per step): the wire encoder refuses a
    value outside u32 naming the field, and the Stage refuses positions and slots it does not hold."""
    pos: int
    slot: int
    needs_logits: bool = False
    token: int = 0


def _real(name: str, v: object) -> float:
    if type(v) is bool or not isinstance(v, (int, float)):
        raise ValueError(f"Sampling.{name} must be a number, got {v!r}")
    return float(v)


def _int(name: str, v: object, hi: int) -> int:
    if type(v) is bool or not isinstance(v, int) or not 0 <= v <= hi:
        raise ValueError(f"Sampling.{name} must be an integer in [0, {hi}], got {v!r}")
    return int(v)


@dataclass(frozen=True, slots=True)
class Sampling:
    """How the last stage picks a column's next token. temperature 0 = greedy (the other fields are then unused);
    top_k 0 = no cut; top_p 1.0 = no nucleus cut, 0.0 = keep only the most likely token; `seed` keys the column's
    reproducible draw together with its position (engine.sampling), so a sequence samples the same tokens however
    the model is split and whatever else shares the step.

    Floats are kept as Python floats (an int temperature becomes 1.0): both ends of the wire, which carries f64,
    then sample with bit-identical parameters."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        t = _real("temperature", self.temperature)
        if not (t >= 0.0 and math.isfinite(t)):
            raise ValueError(f"Sampling.temperature must be finite and >= 0, got {self.temperature!r}")
        p = _real("top_p", self.top_p)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Sampling.top_p must be in [0, 1], got {self.top_p!r}")
        k = _int("top_k", self.top_k, U32_MAX)
        s = _int("seed", self.seed, U64_MAX)
        if type(self.temperature) is not float or type(self.top_p) is not float or type(self.top_k) is not int \
                or type(self.seed) is not int:  # numpy scalars, int subclasses: plain Python numbers from here on
            object.__setattr__(self, "temperature", t)
            object.__setattr__(self, "top_p", p)
            object.__setattr__(self, "top_k", k)
            object.__setattr__(self, "seed", s)


GREEDY = Sampling()

SamplingArg = Union[Sampling, Sequence[Sampling]]
"""What a step takes: one Sampling for every column that needs logits, or one per such column, in column order."""


def samplings_for(sampling: SamplingArg, columns: Sequence[Column]) -> tuple[Sampling, ...]:
    """The one-for-all or per-column form as a tuple, checked against `columns`: one entry (for all), or exactly one
    per column with needs_logits. Raises ValueError saying which count was expected."""
    if isinstance(sampling, Sampling):
        return (sampling,)
    out = tuple(sampling)
    for s in out:
        if not isinstance(s, Sampling):
            raise ValueError(f"sampling entries must be Sampling values, got {type(s).__name__}")
    if len(out) == 1:
        return out
    wanted = sum(1 for c in columns if c.needs_logits)
    if len(out) != wanted:
        raise ValueError(f"{len(out)} Sampling entries for {wanted} columns that need logits (give one for all, "
                         f"or one per such column)")
    return out
