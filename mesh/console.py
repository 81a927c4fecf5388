"""What people see on stderr: progress bars (tqdm), log lines printed through them, and chat answers kept whole.

- `bar(...)`: a tqdm bar. On a terminal it redraws in place; anywhere else (a pipe, a log file, CI) it prints plain
  lines, at most one every PLAIN_EVERY seconds plus the final one, never a carriage return.
- `activity(desc)`: an async context manager for a wait whose size nobody reports (a worker loading and compiling):
  the bar shows the seconds spent, so a long wait is never silent.
- `install_log_stream()`: the CLI's log handler writes through `tqdm.write`, which lifts the bars, prints the record
  and redraws them: a log line never tears a bar, a bar never overwrites a log line.
- `answering()`: while an answer streams to stdout in the chat, log records wait and are printed after it, so a
  line such as "first token after 0.4s" no longer lands in the middle of the answer's text.

Why tqdm: well kept, already installed (a dependency of the tokenizer stack), and it does the rate, ETA, units and
terminal handling the hand-drawn shipping board did; rich would bring a second console model to reconcile with
logging for no gain here.
"""
from __future__ import annotations

import logging
import sys
import threading
from contextlib import asynccontextmanager, contextmanager
from typing import TextIO

import trio
from tqdm import tqdm

PLAIN_EVERY = 5.0        # seconds between two plain lines of one bar off a terminal
TTY_EVERY = 0.1


def is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _Lines:
    """A file for tqdm off a terminal: each redraw becomes one plain line; a repeat of the last line is dropped (tqdm
    redraws the final state on close)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.last = stream, ""

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip("\n").rstrip()
        if line.strip() and line != self.last:
            self.last = line
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def bar(desc: str, *, total: float | None = None, unit: str = "B", stream: TextIO | None = None,
        tty: bool | None = None, delay: float = 0.0, leave: bool = True, **kw) -> tqdm:
    """A progress bar on `stream` (stderr). Bytes are shown in MB/GB; `delay` hides a bar (and its lines) that ends
    sooner; `leave=False` erases it from a terminal when it closes."""
    stream = stream if stream is not None else sys.stderr
    tty = is_tty(stream) if tty is None else tty
    kw = dict(desc=desc, total=total, unit=unit, unit_scale=unit == "B", delay=delay, leave=leave, **kw)
    if tty:
        return tqdm(file=stream, mininterval=TTY_EVERY, dynamic_ncols=True, **kw)
    return tqdm(file=_Lines(stream), mininterval=PLAIN_EVERY, maxinterval=PLAIN_EVERY * 2, ncols=100, ascii=True,
                **kw)


@asynccontextmanager
async def activity(desc: str, *, total: float | None = None, unit: str = "s", stream: TextIO | None = None,
                   tty: bool | None = None, delay: float = 1.0, leave: bool = True):
    """A bar for as long as the body runs, redrawn while nothing reports progress, shown only when the body takes
    over `delay` seconds. Without a `total` it shows the seconds spent; with one the body updates the yielded bar."""
    stream = stream if stream is not None else sys.stderr
    tty = is_tty(stream) if tty is None else tty
    fmt = {"bar_format": "{desc}: {elapsed}"} if total is None else {}
    b = bar(desc, total=total, unit=unit, stream=stream, tty=tty, delay=delay, leave=leave, **fmt)
    every = TTY_EVERY * 5 if tty else PLAIN_EVERY / 2
    try:
        async with trio.open_nursery() as nursery:
            async def tick() -> None:
                while True:
                    await trio.sleep(every)
                    b.update(0)          # redraws when `delay` and the bar's interval have passed
            nursery.start_soon(tick)
            try:
                yield b
            finally:
                nursery.cancel_scope.cancel()
    finally:
        b.close()


# ------------------------------------------------------------------------------------------------------ logging
class _Gate:
    """Log output that can be held back while an answer streams, and goes through tqdm.write otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.held: list[str] | None = None
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            if self.held is not None:
                self.held.append(text)
                return
        tqdm.write(text, file=self.stream, end="")

    def flush(self) -> None:
        self.stream.flush()

    def release(self) -> None:
        with self.lock:
            held, self.held = self.held or [], None
        for text in held:
            tqdm.write(text, file=self.stream, end="")
        self.stream.flush()


_gate: _Gate | None = None


def install_log_stream(handler: logging.StreamHandler) -> None:
    """Route `handler`'s records through the gate (tqdm.write; held while an answer streams)."""
    global _gate
    _gate = _Gate(handler.stream)
    handler.setStream(_gate)


@contextmanager
def answering():
    """Hold log records back while the body streams an answer; print them after it, in order."""
    gate = _gate
    if gate is None:
        yield
        return
    with gate.lock:
        gate.held = [] if gate.held is None else gate.held
    try:
        yield
    finally:
        gate.release()
