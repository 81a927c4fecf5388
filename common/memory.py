"""Giving freed heap memory back to the OS after a burst (a session's end, a reload).

glibc keeps memory that Python, numpy and the C libraries freed: the main heap is trimmed only from its top, and the
heaps of thread arenas (trio.to_thread workers, which parse GGUF headers and hash range files during a re-form) keep
their high-water marks. A long-lived coordinator then steps up by a few MB at each re-form of a new kind while the
objects it holds stay the same (bench/reform_memory.py; NOTES "Faults"). `malloc_trim(0)` walks every arena and
returns its free pages (MADV_DONTNEED on whole free pages inside a heap, not only at its top): a few ms, ~50 ms
right after ~100 MB were freed in fragments. Elsewhere (macOS, musl) there is nothing to call and nothing happens.
`status_kb` reads this process's memory figures (VmRSS, VmHWM...) for the benchmarks that report them.
"""
from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim      # the process's own C library, no search
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Return the C heap's free pages to the OS; True where the C library can (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def status_kb(field: str = "VmRSS") -> int:
    """A /proc/self/status figure in kB (0 where there is none: not Linux, or no such field). For a peak, VmHWM,
    not ru_maxrss: Linux carries ru_maxrss over fork+exec, so a child would report its parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
