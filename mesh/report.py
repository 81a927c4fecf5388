"""The donor's self-report: what this peer has been doing for the fleet, one line every few seconds.

Every stage sees the token ids of the columns it computes (they ride in each step), so with the display vocabulary
the coordinator ships once, even a middle stage can show the text it is serving.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class DonorReport:
    layers: tuple[int, int] | None = None
    steps: int = 0
    columns: int = 0
    busy_s: float = 0.0                 # seconds computing, over the stage's life (mesh.proto Stats)
    window: deque = field(default_factory=lambda: deque(maxlen=256))   # (monotonic time, columns, busy seconds)
    recent: bytearray = field(default_factory=bytearray)
    show_text: bool = True        # False (--no-show-text): the line leaves out the conversation being served
    _printed_steps: int = -1

    def record(self, columns, busy_s: float, vocab: tuple[bytes, ...]) -> None:
        self.steps += 1
        self.columns += len(columns)
        self.busy_s += busy_s
        self.window.append((time.monotonic(), len(columns), busy_s))
        if not self.show_text:
            return
        # Prefill columns are the prompt; a decode step's column is the token generated one step before.
        for tok in (c.token for c in columns):
            if 0 <= tok < len(vocab):
                self.recent += vocab[tok]
        del self.recent[:-240]

    def rate(self, horizon_s: float = 10.0) -> float:
        """Columns per second of wall time over the last `horizon_s` seconds while active."""
        now = time.monotonic()
        recent = [(t, n) for t, n, _ in self.window if now - t <= horizon_s]
        if len(recent) < 2:
            return 0.0
        span = recent[-1][0] - recent[0][0]
        return (sum(n for _, n in recent) - recent[0][1]) / span if span > 0 else 0.0

    def line(self) -> str | None:
        """The report line, or None when nothing happened since the last one."""
        if self.steps == self._printed_steps:
            return None
        self._printed_steps = self.steps
        layers = f"layers {self.layers[0]}..{self.layers[1]}" if self.layers else "no layers"
        head = f"[donor] {layers} | {self.steps} steps | {self.rate():.1f} tok/s"
        if not self.show_text:
            return head
        text = self.recent.decode("utf-8", "replace").replace("\n", " ")[-60:]
        return f"{head} | serving: {text!r}"
