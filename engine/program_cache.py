"""A stage's compiled kernels kept on disk, so that a cold start does not lower and render them again.

tinygrad caches a kernel's machine code on disk by its C source (`CACHEDB`), but turning a kernel's AST into that
source (`to_program`: optimization, linearization, rendering) runs in every new process: ~0.3-0.5 s a kernel for
the engine's matvecs, ~25 unique kernels for SmolLM2's decode and prefill shapes, most of a cold warmup once the
layers share one capture (engine/shared_layers.py). Here the programs a stage's jits use (each a PROGRAM UOp with
its source and binary, tinygrad's own `to_program_cache` entries) are pickled to one file per stage configuration
and put back into that cache before the next capture, which then finds them as if compiled in this process.

Trust: a file is used only if its magic, format, tinygrad version and sha256 of the payload all match; an entry
only if it is a (key, PROGRAM with a binary) pair. Anything else is ignored, and the next save rewrites the file.
An entry's key is tinygrad's own: the kernel AST's content hash, the renderer and the codegen settings, so a
changed kernel is a miss, never a wrong hit. Pickles run code when loaded: the directory is the user's own cache,
trusted as tinygrad trusts its `CACHEDB` (which holds pickles too). MESH_PROGRAM_CACHE=0 turns it off;
MESH_CACHE_DIR moves it (default ~/.cache/mesh).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import pickle
import tempfile
from pathlib import Path

from tinygrad.codegen import to_program, to_program_cache, to_program_key
from tinygrad.helpers import ContextVar
from tinygrad.uop.ops import Ops, UOp

__all__ = ["cache_path", "code_identity", "compiled", "load_programs", "read_blob", "save_programs", "trim", "write_blob"]

MAGIC = b"meshprg1"
_VERSION = importlib.metadata.version("tinygrad")


def enabled() -> bool:
    return os.environ.get("MESH_PROGRAM_CACHE", "1") != "0"


def cache_path(*identity) -> Path:
    """The file for one stage configuration: model fingerprint, layer range, slots, context, dtypes, device..."""
    root = Path(os.environ.get("MESH_CACHE_DIR") or Path.home() / ".cache" / "mesh")
    name = hashlib.sha256(repr((_VERSION, *identity)).encode()).hexdigest()[:32]
    return root / "programs" / f"{name}.bin"


# engine modules that build no part of a step's kernels (host-side process plumbing, text, files): an edit to one
# of them keeps every step template. Any other module counts, new ones included, so a forgotten file costs a
# recompile, never a stale template.
_NOT_KERNELS = frozenset({"worker.py", "worker_main.py", "worker_proto.py", "worker_records.py", "arena.py",
                          "tokenizer.py", "tokenizer_spm.py", "chat.py", "sources.py", "gguf_range.py", "sampling.py",
                          "errors.py", "platform.py", "__init__.py"})


@functools.cache
def _engine_source_hash() -> str:
    """A hash of the engine's kernel-building source, read once per process (the code it runs is the code it
    imported)."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        if f.name not in _NOT_KERNELS:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def code_identity() -> tuple:
    """What decides the kernels a step runs besides its shapes: tinygrad's version and settings (every ContextVar:
    BEAM, NOOPT, thread counts...), the engine's own kernel-building source and its MESH_* settings. Part of every
    step-template key (engine/shared_layers.py), so a changed kernel or setting is a miss, never a stale hit. The
    settings are read on every call: a variable changed inside one process (tests do) gets its own templates."""
    return (_VERSION, _engine_source_hash(),
            tuple(sorted((k, repr(v.value)) for k, v in ContextVar._cache.items())),
            tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("MESH_") and k not in _NOT_SETTINGS)))


# variables that place files or switch caches, never kernels
_NOT_SETTINGS = frozenset({"MESH_CACHE_DIR", "MESH_PROGRAM_CACHE", "MESH_HEADER_CACHE", "MESH_CACHE_MAX_MB"})


def write_blob(path: Path, obj) -> bool:
    """Pickle obj to path with the magic and a sha256 of the payload, atomically (a reader sees the old file or
    the new one). False when it cannot be written."""
    body = pickle.dumps({"tinygrad": _VERSION, "payload": obj}, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:  # in three writes: joined, the payload would be copied once more (MBs)
            f.write(MAGIC)
            f.write(hashlib.sha256(body).digest())
            f.write(body)
        os.replace(tmp, path)
    except OSError:
        return False
    trim(path.parent, keep=path)
    return True


def cache_limit() -> int:
    """Bytes a cache folder may hold: MESH_CACHE_MAX_MB (default 1024). Every engine or tinygrad version makes new
    templates and programs under new names, so without a bound the folder only grows (1.4 GB seen on a dev box)."""
    try:
        return int(float(os.environ.get("MESH_CACHE_MAX_MB", "1024")) * 2**20)
    except ValueError:
        return 1024 * 2**20


def trim(folder: Path, *, keep: Path | None = None, limit: int | None = None) -> None:
    """Delete the least recently used files of `folder` (reads touch a file's mtime) until it holds at most `limit`
    bytes; `keep` (the file just written) stays whatever its size. Files that vanish meanwhile (another process
    trimming) are skipped; a reader that has a file open keeps its bytes (unlink)."""
    limit = cache_limit() if limit is None else limit
    files, total = [], 0
    try:
        names = list(folder.iterdir())
    except OSError:
        return
    for f in names:
        try:
            st = f.stat()
        except OSError:
            continue
        total += st.st_size
        if f != keep and not f.name.startswith(".tmp-"):
            files.append((st.st_mtime, st.st_size, f))
    for _, size, f in sorted(files, key=lambda e: e[0]):
        if total <= limit:
            break
        try:
            f.unlink()
            total -= size
        except OSError:
            pass


def read_blob(path: Path):
    """What write_blob wrote, or None for a missing, corrupt (checksum), foreign or stale (tinygrad version) file."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    try:
        os.utime(path)  # used now: trim() deletes the least recently used first
    except OSError:
        pass
    body = memoryview(blob)[len(MAGIC) + 32:]  # not a slice of the bytes: that would copy the payload
    if blob[:len(MAGIC)] != MAGIC or hashlib.sha256(body).digest() != blob[len(MAGIC):len(MAGIC) + 32]:
        return None
    try:
        data = pickle.loads(body)
        return data["payload"] if data.get("tinygrad") == _VERSION else None
    except Exception:  # a payload that checks but does not unpickle: a foreign or future format
        return None


def _valid(key, prg) -> bool:
    return isinstance(key, tuple) and len(key) > 2 and isinstance(key[0], bytes) and isinstance(prg, UOp) and \
        prg.op is Ops.PROGRAM and prg.src[-1].op is Ops.BINARY


def load_programs(path: Path) -> set[tuple]:
    """Put the file's programs into tinygrad's program cache; returns the keys it held. A missing, corrupt or
    stale file is ignored (no keys)."""
    try:
        entries = [(k, v) for k, v in read_blob(path) or () if _valid(k, v)]
    except (TypeError, ValueError):
        return set()
    for key, prg in entries:
        to_program_cache.setdefault(key, prg)
    return {k for k, _ in entries}


def compiled(sink: UOp, renderer) -> UOp:
    """tinygrad's `to_program` with the result also kept on disk, one file per program: for the helper kernels a
    process compiles for itself (engine/cpu_runner.py's step runner, ~0.1-0.2 s each, every start). Keyed by
    tinygrad's own program key (the AST's content hash, the renderer and its target, the codegen settings): a
    changed kernel is a miss."""
    key = to_program_key(sink, renderer)
    if (prg := to_program_cache.get(key)) is not None or not enabled():
        return prg if prg is not None else to_program(sink, renderer)
    path = cache_path("program", repr(key))
    got = read_blob(path)
    if isinstance(got, tuple) and len(got) == 2 and got[0] == key and _valid(*got):
        to_program_cache[key] = got[1]
        return got[1]
    prg = to_program(sink, renderer)
    write_blob(path, (key, prg))
    return prg


def _programs(linear: UOp) -> set[UOp]:
    return {u for u in linear.toposort() if u.op is Ops.PROGRAM}


def save_programs(path: Path, linears: list[UOp], on_disk: set[tuple] = frozenset()) -> set[tuple]:
    """Write the cache entries of every program the given captured call lists run (atomically: a reader sees the
    old file or the new one), unless `on_disk` (the keys the file holds) has them all already. Returns the keys
    the file holds afterwards (`on_disk` when nothing was written or writing failed)."""
    used = set().union(*(_programs(lin) for lin in linears)) if linears else set()
    sinks = {u.src[0] for u in used}
    entries = [(k, v) for k, v in list(to_program_cache.items()) if (v in used or v.src[0] in sinks) and _valid(k, v)]
    if not entries or {k for k, _ in entries} <= on_disk:
        return on_disk
    return {k for k, _ in entries} if write_blob(path, entries) else on_disk
