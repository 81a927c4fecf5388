"""Suite-wide hygiene: each test module starts with tinygrad's in-process compile caches empty, as a fresh process
would.

tinygrad keeps every kernel it lowers for the life of the process (`to_program_cache`: the AST, its linearized
UOps and the rendered program; `runtime_cache`: the loaded binaries; a few functools caches of movement ops). In
one pytest process that runs the whole suite those caches grew to ~6.5 million gc-tracked objects, and each full
(generation 2) collection then held the GIL for 10-33 s on a busy 2-core box: about 4.5 of the suite's minutes,
and long enough to stall a coordinator loop that a test runs on another thread past the peers' 5 s heartbeat.
Dropping the caches when a module ends frees those objects by reference counting (UOp graphs are acyclic) and
keeps the heap near its size after import. Kernels a later module needs again are lowered again or come back
from the program cache on disk (engine/program_cache.py), as in a new process; compiled runners that a live object
still holds keep their programs.

What is left after the first module that used tinygrad is mostly what importing it made (~300 thousand objects:
modules, functions, the ctypes bindings of every runtime), alive until the process ends. One full collection
then, and `gc.freeze()`, moves them out of every later collection's scan, as an application does after its start.
"""
from __future__ import annotations

import gc
import sys

import pytest

_frozen = False


def _drop_compile_caches() -> None:
    global _frozen
    codegen = sys.modules.get("tinygrad.codegen")
    if codegen is None:                      # no module so far imported tinygrad: nothing to drop
        return
    codegen.to_program_cache.clear()
    realize = sys.modules.get("tinygrad.engine.realize")
    if realize is not None:
        realize.runtime_cache.clear()
    indexing = sys.modules.get("tinygrad.schedule.indexing")
    for name in ("apply_movement_op", "_apply_reshape"):
        fn = getattr(indexing, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    if not _frozen:
        gc.collect()                         # this module's garbage goes first: frozen objects are never collected
        gc.freeze()
        _frozen = True


@pytest.fixture(autouse=True, scope="module")
def _compile_caches_per_module():
    yield
    _drop_compile_caches()
