"""Text from the network, made safe to log and print: escaped, truncated, and repeated lines rate-limited.

Whatever a stranger sends can end up in a log line (an Error's reason, a Join's advertised address, a backend
name). Unescaped, a newline forges a log line ("peer 7 joined") and escape bytes drive the terminal; unbounded, a
64 MiB reason or a connection loop fills the disk. `clean()` is applied where such text becomes an exception
message, and `install()` puts both guards on a log handler, so a line that slipped through is still one line.
"""
from __future__ import annotations

import logging
import time

MAX_TEXT = 500
"""How much of one string from the network reaches a message."""
MAX_LINE = 1000
"""How long one log line may be, after escaping."""
_KEEP = {ord("\t"): " "}


def clean(text: object, limit: int = MAX_TEXT) -> str:
    """`text` with every control or non-printable character escaped (\\n, \\x1b, \\u202e...), cut to `limit`."""
    s = str(text)
    cut = len(s) > limit
    s = s[:limit]
    if not s.isprintable():
        s = "".join(c if c.isprintable() else _escape(c) for c in s)
    return s + "…" if cut else s


def _escape(c: str) -> str:
    return _KEEP.get(ord(c)) or c.encode("unicode_escape").decode("ascii")


class SafeLines(logging.Filter):
    """One log record, one line: the formatted message is escaped and cut to MAX_LINE, and a message template that
    repeats more than `burst` times within `window` seconds is dropped until the window passes; the next line of
    that template then says how many were dropped."""

    def __init__(self, burst: int = 10, window: float = 10.0, clock=time.monotonic) -> None:
        super().__init__()
        self.burst, self.window, self.clock = burst, window, clock
        self._seen: dict[tuple, list] = {}    # (logger, level, template) -> [window start, count, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg)[:200])
        now = self.clock()
        entry = self._seen.get(key)
        if entry is None or now - entry[0] >= self.window:
            dropped = entry[2] if entry else 0
            entry = self._seen[key] = [now, 0, 0]
            if len(self._seen) > 1000:                # a bounded table: forget the oldest templates
                for old in list(self._seen)[:500]:
                    del self._seen[old]
                self._seen[key] = entry
        else:
            dropped = 0
        entry[1] += 1
        if entry[1] > self.burst:
            entry[2] += 1
            return False
        message = clean(record.getMessage(), MAX_LINE)
        if dropped:
            message += f" ({dropped} similar lines suppressed)"
        record.msg, record.args = message, None     # a traceback (exc_info) stays as it is: it is ours
        return True


def install(handler: logging.Handler, **kw) -> SafeLines:
    """Put a SafeLines filter on `handler` (the CLI does this on its stderr handler)."""
    f = SafeLines(**kw)
    handler.addFilter(f)
    return f
