"""What a fleet calls "the model": a hash of the file's content, not of its header.

The engine's `fingerprint` reads the header and 4 KiB from each end of every tensor, which is cheap but lets two
files that differ inside their tensors pass as one model (a second GGUF with 64 of 98 MB rewritten had the same
fingerprint, and its shipment poisoned a peer's cache for an honest coordinator). So the fleet names a model by the
SHA-256 of the whole file, computed once per file and remembered by (path, size, mtime, inode): a changed file is
hashed again, an unchanged one costs a stat. A range file made by weight shipping names its source model in its own
metadata; its bytes are checked by the digest the coordinator sends with each Load (`verify_file`).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

_READ = 4 * 1024 * 1024


def file_sha256(path: str | os.PathLike) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_READ):
            h.update(chunk)
    return h.digest()


def _stamp(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino]


def model_identity(path: str | os.PathLike, memo_dir: str | os.PathLike | None = None) -> str:
    """The fleet's name for the model in `path`: the hex SHA-256 of the file, or, for a range file made by weight
    shipping, the source identity it records. Remembered in `memo_dir` by (path, size, mtime, inode)."""
    from engine.gguf_meta import read_model_meta
    path = Path(path)
    meta = read_model_meta(path)
    if meta.range is not None:
        return meta.fingerprint            # a range file: its bytes are checked against the Load's digest instead
    stamp = _stamp(path)
    memo = None
    if memo_dir is not None:
        memo = Path(memo_dir) / (hashlib.sha256(stamp[0].encode()).hexdigest()[:32] + ".json")
        try:
            kept = json.loads(memo.read_text())
            if kept.get("stamp") == stamp and len(kept.get("sha256", "")) == 64:
                return kept["sha256"]
        except (OSError, ValueError, AttributeError):
            pass
    digest = file_sha256(path).hex()
    if memo is not None and _stamp(path) == stamp:        # not changed while we read it
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"stamp": stamp, "sha256": digest}))
            os.replace(tmp, memo)
        except OSError:
            pass                          # a memo saves time only
    return digest


def verify_file(path: str | os.PathLike, sha256: bytes) -> bool:
    """Whether the file's bytes hash to `sha256` (read in full: a flipped bit does not change size or mtime)."""
    return file_sha256(path) == sha256
