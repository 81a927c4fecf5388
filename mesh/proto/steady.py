"""A sequence's next decode step, read from its frame's plaintext without decoding it.

One stream decoding sends every stage the same frame token after token: a one-column BatchStep whose bytes change
only in the group, the column's position and token, and the activation rows. `SteadyStep` is made from a step that
was decoded (and so checked) the usual way; `match` then recognises the next one from its plaintext with a length
check and four byte compares, and `forward` / `events.tokens_reply` write the plaintext of the reply the usual encoder
would write. A peer's reader uses it for a step it computes at once (mesh/peer.py `_steady_step`): on this 2-core
box the decode, the reply event and its encode were ~0.2 ms of cold Python a stage a token (NOTES "The steady
step").

Why a byte compare is as good as a decode: a frame that equals a checked step in every other byte decodes to that
step with another group (any u32 is a group), position and token (any u32 passes the wire; the Stage checks both,
as for any step) and other rows (the rows' bytes are never checked, only their count, which the length fixes).
tests/test_steady_step.py holds `match`, `forward`, `plain_for` and events.tokens_reply to the decoder's and the
encoder's bytes.
"""
from __future__ import annotations

import struct

from .events import BatchStep, Column, MsgType, Sampling, activation_head, encode_payload

# In the plaintext (the inner type byte first) of a one-column BatchStep: group u32 at 1, wide u8 and the column
# count u32 at 5, the column's pos u32 at 10, slot u32 and needs_logits u8 at 14, token u32 at 19, the activation's
# presence byte at 23, then (when present) its dtype code, ndim and shape, the rows, and the samplings.
_VARIABLE = struct.Struct("<I5xI5xI")     # group, pos, token (from offset 1)
_FIELDS = struct.Struct("<I5sI5sI")       # the same with the bytes between them
_PRESENT = 23


class SteadyStep:
    """The frame shape of one sequence's decode steps, learned from one of them (`BatchStep` of one column)."""

    __slots__ = ("size", "rows_at", "rows_end", "_wide", "_slot", "_head", "_tail", "_plain", "column_fields",
                 "sampling", "act")

    def __init__(self, ev: BatchStep) -> None:
        if type(ev) is not BatchStep or len(ev.columns) != 1:
            raise ValueError("a steady step is a BatchStep of one column")
        plain = bytes((MsgType.BATCH_STEP,)) + b"".join(encode_payload(ev))
        h = ev.hidden
        self.rows_at = _PRESENT + (1 if h is None else 3 + 4 * len(h.shape))
        self.rows_end = self.rows_at + (0 if h is None else len(h.data))
        self.size = len(plain)
        self._plain = plain
        self._wide, self._slot = plain[5:10], plain[14:19]
        self._head, self._tail = plain[_PRESENT:self.rows_at], plain[self.rows_end:]
        c = ev.columns[0]
        self.column_fields = (ev.wide, c.slot, c.needs_logits)
        self.sampling = ev.sampling
        self.act = None if h is None else (h.dtype, h.shape)
        """The dtype and shape of the rows a matching step carries (None: none, the first stage's steps)."""

    def fits(self, ev: BatchStep) -> bool:
        """Whether `ev` (a decoded one-column step) has this shape: if not, learn it anew."""
        c, h = ev.columns[0], ev.hidden
        return (ev.wide, c.slot, c.needs_logits) == self.column_fields and ev.sampling == self.sampling \
            and (None if h is None else (h.dtype, h.shape)) == self.act

    def match(self, raw: bytes) -> tuple[int, int, int] | None:
        """(group, pos, token) of a step's plaintext that has this shape, else None."""
        if len(raw) != self.size or raw[5:10] != self._wide or raw[14:19] != self._slot \
                or raw[_PRESENT:self.rows_at] != self._head or raw[self.rows_end:] != self._tail:
            return None
        return _VARIABLE.unpack_from(raw, 1)

    def plain_for(self, group: int, col: Column, sampling: tuple[Sampling, ...]) -> bytes | None:
        """The plaintext of BatchStep(group, False, (col,), None, sampling) without building or encoding it (the
        coordinator's next decode step to the first stage), when it has this shape; else None."""
        if self.act is not None or self.column_fields != (False, col.slot, col.needs_logits) \
                or sampling != self.sampling:
            return None
        try:
            return self._plain[:1] + _FIELDS.pack(group, self._wide, col.pos, self._slot, col.token) \
                + self._plain[_PRESENT:]
        except struct.error:     # a value out of u32: the encoder says which
            return None

    def forward(self, raw: bytes, act_head: bytes, rows: bytes) -> bytes:
        """The plaintext of the step sent on: `raw`'s group, column and samplings, these rows (`act_head`: their
        `activation_head`)."""
        return b"".join((raw[:_PRESENT], act_head, rows, raw[self.rows_end:]))

