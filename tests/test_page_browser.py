"""The web chat page in a real headless browser: Debian's chromium driven by Playwright's Python client (no browser
download: `executable_path`). One real server (tests/serve_fixtures.py LiveServer: registry, an in-process peer with
the tiny chat model, the Service, hypercorn) with an API key, so the page must ask for it.

The page loads, asks for the key, shows the model and the status panel, streams an answer token by token, and Stop
aborts the fetch: the server notices the client left and frees the slot (GET /v1/mesh: no active sequence)."""
from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from tests.mesh_fixtures import write_tiny_chat_model

pytestmark = pytest.mark.slow          # a worker process and a browser
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
KEY = "sk-page-test-key-0123456789"
MODEL_ID = "tiny-page"

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:                    # pragma: no cover - setup.sh installs it with the test extras
    sync_playwright = None

if sync_playwright is None or not os.path.exists(CHROMIUM):
    pytest.skip("the browser test needs Debian's chromium (apt-get install chromium; scripts/setup.sh does) and the "
                "playwright package (pip install playwright; no `playwright install`)", allow_module_level=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / f"{MODEL_ID}.gguf", n_layers=2)


@pytest.fixture(scope="module")
def server(model):
    from tests.serve_fixtures import LiveServer
    with LiveServer(model, api_key=KEY, max_seqs=2, max_queue=2, max_context=2048) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM)
        yield b
        b.close()


def get(server, path: str, key: str | None = KEY) -> tuple[int, dict, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}",
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=30) as r:
            body = r.read()
            return r.status, dict(r.headers), json.loads(body) if "json" in r.headers.get("content-type", "") else {}
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"{}")


def wait_until(fn, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_the_page_is_public_and_the_status_is_not(server):
    status, headers, _ = get(server, "/", key=None)
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in headers["content-security-policy"]
    for asset in ("/static/app.js", "/static/style.css"):
        assert get(server, asset, key=None)[0] == 200
    assert get(server, "/v1/mesh", key=None)[0] == 401
    status, _, st = get(server, "/v1/mesh")
    assert status == 200 and st["object"] == "mesh.status" and st["state"] == "serving"
    assert st["stages"][0]["layers"] == [0, 2] and st["hops"][0]["transport"] == "tcp"
    assert st["scheduler"]["active"] == 0 and st["scheduler"]["max_seqs"] == 2


def test_stream_stop_and_new_chat_in_a_browser(server, browser):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"http://127.0.0.1:{server.port}/")

    # The API answers 401: the page asks for the key, keeps it, and goes on.
    expect(page.locator("#key-dialog")).to_be_visible()
    page.fill("#key-input", KEY)
    page.click("#key-save")
    expect(page.locator("#model")).to_have_text(MODEL_ID)

    # The status panel: one stage holding both layers, the hops, no active sequence.
    expect(page.locator("#stages tbody tr")).to_have_count(1)
    expect(page.locator("#stages tbody tr").first).to_contain_text("0..2")
    expect(page.locator("#hops")).to_contain_text("tcp")
    expect(page.locator("#status-summary")).to_contain_text("0 active of 2")

    # A long answer streams in: the text grows while the bubble is still streaming.
    page.click(".settings summary")                                # the settings fold open
    page.fill("#max-tokens", "1800")
    page.fill("#input", "Tell me a very long story about the sea.")
    page.press("#input", "Enter")
    expect(page.locator(".msg.user")).to_have_text("Tell me a very long story about the sea.")
    answer = page.locator(".msg.assistant")
    # (polled from here: the page's CSP forbids the string evaluation wait_for_function would do)
    seen = len(wait_until(lambda: answer.text_content() if len(answer.text_content()) >= 4 else "", what="text"))
    wait_until(lambda: len(answer.text_content()) > seen, what="more streamed text")
    expect(answer).to_have_class("msg assistant streaming")          # still streaming: not finished yet
    assert get(server, "/v1/mesh")[2]["scheduler"]["active"] == 1
    expect(page.locator("#stop")).to_be_visible()

    # Stop aborts the fetch; the server frees the sequence's slot.
    page.click("#stop")
    expect(answer.locator(".note")).to_have_text("(stopped)")
    expect(page.locator("#send")).to_be_visible()
    wait_until(lambda: get(server, "/v1/mesh")[2]["scheduler"]["active"] == 0, what="the slot to be freed")
    expect(page.locator("#status-summary")).to_contain_text("0 active of 2", timeout=10_000)
    kept = page.evaluate("state.messages")
    assert [m["role"] for m in kept] == ["user", "assistant"] and kept[1]["content"]   # the stopped answer stays

    # New chat forgets the conversation.
    page.click("#new-chat")
    expect(page.locator(".msg")).to_have_count(0)
    assert page.evaluate("state.messages") == []
    assert errors == []
    page.close()


def test_mesh_coord_status_prints_the_same_in_a_terminal(server):
    from tests.mesh_fixtures import ROOT, child_env, mesh_cmd
    import subprocess
    cmd = mesh_cmd("coord", "status", "--http", f"127.0.0.1:{server.port}")
    out = subprocess.run(cmd + ["--api-key", KEY], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"model {MODEL_ID}  state serving  chain p2p")
    assert "active / 2 slots" in lines[1]
    row = next(line for line in lines if line.startswith("1 "))
    assert "0..2" in row and "CPU" in row
    assert lines[-1].startswith("hops: coordinator -> peer 1 (127.0.0.1) tcp")
    watched = subprocess.Popen(cmd + ["--api-key", KEY, "--watch", "0.2", "--json"], cwd=ROOT, env=child_env(),
                               stdout=subprocess.PIPE, text=True)
    try:
        first = json.loads(watched.stdout.readline())            # with --watch, --json is one object a line
        again = json.loads(watched.stdout.readline())
    finally:
        watched.kill()
        watched.communicate()
    assert first["object"] == "mesh.status"
    assert again["object"] == "mesh.status" and again["stages"][0]["layers"] == [0, 2]
    refused = subprocess.run(cmd, cwd=ROOT, env=child_env(MESH_API_KEY=""), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.startswith(f"mesh-coord status: http://127.0.0.1:{server.port}/v1/mesh: 401 no API key")
    assert "(pass --api-key or set $MESH_API_KEY)" in refused.stderr
