"""Letting a process this one just woke run first (standard library only).

A decode step's hops are writes that wake a waiting process: the next peer's Link reader, the coordinator's sink
(mesh/link.py `send_nowait`, `send_plain_nowait`). Linux often queues the woken task on the waker's CPU
(wake-affine), and it then waits for whatever the writer does next: its bookkeeping and its way back to its own
wait, ~150-250 us of cold Python on a 2-core VM whose processes idle between steps. `sched_yield` right after
such a write lets a task queued on this CPU run first; with nothing else runnable it returns at once (~1 us).
Figures: bench/RESULTS.md "Twentieth session"; bench/hop_bench.py measures one hop with and without it.
"""
from __future__ import annotations

import os

ENV = "MESH_WRITE_YIELD"
"""0 turns the yield off (A/B runs); anything else, or unset, leaves it on where the platform has sched_yield."""


def enabled(env=os.environ) -> bool:
    return env.get(ENV, "1") != "0" and hasattr(os, "sched_yield")


YIELD = enabled()
"""Read when the module loads; a process may set it later (bench/mesh_bench.py does for its coordinator)."""


def after_wake() -> None:
    """Call right after a write that woke another process on a decode step's path."""
    if YIELD:
        os.sched_yield()
