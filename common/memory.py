"""Giving freed heap memory back to the OS after a burst (a session's end, a reload).

glibc keeps memory that Python, numpy and the C libraries freed: the main heap is trimmed only from its top, and the
heaps of thread arenas (trio.to_thread workers, which parse GGUF headers and hash range files during a re-form) keep
their high-water marks. A long-lived coordinator then steps up by a few MB at each re-form of a new kind while the
objects it holds stay the same (bench/reform_memory.py; NOTES "Faults"). `malloc_trim(0)` walks every arena and
returns its free pages (MADV_DONTNEED on whole free pages inside a heap, not only at its top): a few ms, ~50 ms
right after ~100 MB were freed in fragments. Elsewhere (macOS, musl) there is nothing to call and nothing happens.
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
