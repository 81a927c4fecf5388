"""The OpenAI-compatible API of a serving coordinator, driven with the official `openai` client over loopback.

One real server for the module: registry, one in-process peer holding the tiny chat model (its stage in a worker
process), the Service and hypercorn. The answers are checked against the unsharded engine's tokens (greedy), and
every refusal against OpenAI's error shape and status.
"""
from __future__ import annotations

import asyncio
import gc
import json
import subprocess
from pathlib import Path

import httpx2 as httpx     # the HTTP client the openai package itself uses
import openai
import pytest
import trio

from engine.chat import render_prompt
from engine.stage import Sampling
from engine.tokenizer import StreamDecoder, Tokenizer
from mesh.scheduler import Generation, Request as SeqRequest, _Seq
from tests.mesh_fixtures import ROOT, child_env, mesh_cmd, unsharded_tokens, write_tiny_chat_model
from tests.serve_fixtures import LiveServer

KEY = "sk-mesh-test-key-0123456789"
N_LAYERS = 2
MODEL_ID = "tiny-chat"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / f"{MODEL_ID}.gguf", n_layers=N_LAYERS)


@pytest.fixture(scope="module")
def server(model):
    with LiveServer(model, api_key=KEY, max_seqs=2, max_queue=2) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def text_of(model: Path, tokens: list[int]) -> str:
    """What the API must answer for these tokens: decoded up to the first end-of-turn token."""
    from mesh.serve.service import stop_ids
    tok = Tokenizer.from_gguf(model)
    stops = stop_ids(tok)
    out = []
    for t in tokens:
        if t in stops:
            break
        out.append(t)
    dec = StreamDecoder(tok)
    return "".join(dec.feed(t) for t in out) + dec.flush()


_references: dict = {}


def reference(model: Path, prompt: str, max_tokens: int) -> str:
    """The unsharded engine's greedy answer to a raw prompt (remembered: each costs a worker process)."""
    key = (model, prompt, max_tokens)
    if key not in _references:
        _references[key] = text_of(model, unsharded_tokens(model, N_LAYERS, prompt, max_tokens))
    return _references[key]


def chat_reference(model: Path, user: str, max_tokens: int) -> tuple[str, int]:
    """The unsharded engine's greedy answer to one user message rendered with the model's chat template."""
    tok = Tokenizer.from_gguf(model)
    rendered = render_prompt(tok, user)
    return reference(model, rendered, max_tokens), len(tok.encode(rendered))


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in body["error"]["message"]
    return body["error"]


# ---- answers ---------------------------------------------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    r = httpx.get(f"http://127.0.0.1:{server.port}/health", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["peers"] == 1


def test_chat_greedy_equals_the_unsharded_engine(model, client):
    expected, n_prompt = chat_reference(model, "Hello there", 12)
    r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hello there"}],
                                       max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL_ID
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == n_prompt and r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 12


def test_streamed_chat_is_the_same_answer_in_chunks(model, client):
    expected, n_prompt = chat_reference(model, "Hello there", 12)
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hello there"}],
                                                 max_completion_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("length", "stop")
    assert finals[0].usage.prompt_tokens == n_prompt
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == n_prompt   # include_usage: its own chunk


def test_the_async_client_streams_and_answers_several_at_once(model, server):
    expected, _ = chat_reference(model, "Hello there", 12)

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120) as c:
            async def one():
                r = await c.chat.completions.create(model=MODEL_ID, max_tokens=12, temperature=0,
                                                    messages=[{"role": "user", "content": "Hello there"}])
                return r.choices[0].message.content

            async def streamed():
                parts = []
                async for ch in await c.chat.completions.create(
                        model=MODEL_ID, max_tokens=12, temperature=0, stream=True,
                        messages=[{"role": "user", "content": "Hello there"}]):
                    parts += [ch.choices[0].delta.content or ""] if ch.choices else []
                return "".join(parts)
            return await asyncio.gather(one(), streamed(), one(), streamed())
    assert asyncio.run(main()) == [expected] * 4


def test_completions_raw_prompt_streamed_and_not(model, client):
    tok = Tokenizer.from_gguf(model)
    expected = reference(model, "The quick brown fox", 10)
    r = client.completions.create(model=MODEL_ID, prompt="The quick brown fox", max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == expected
    assert r.usage.prompt_tokens == len(tok.encode("The quick brown fox"))
    chunks = list(client.completions.create(model=MODEL_ID, prompt="The quick brown fox", max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("length", "stop") and chunks[-1].usage is not None
    ids = tok.encode("The quick brown fox")
    assert client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=10, temperature=0).choices[0].text \
        == expected


def test_default_completion_length_and_finish_reason_length(client):
    r = client.completions.create(model=MODEL_ID, prompt="x", temperature=0)        # OpenAI's default: 16 tokens
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 16
    r = client.completions.create(model=MODEL_ID, prompt="x", temperature=0.8, seed=3, max_tokens=5)
    assert r.usage.completion_tokens <= 5


def test_a_seed_repeats_a_sampled_answer(client):
    def ask(seed):
        return client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=24, temperature=1.0,
                                         top_p=0.95, seed=seed, extra_body={"top_k": 40}).choices[0].text
    assert ask(11) == ask(11)
    assert len({ask(s) for s in (1, 2, 3)}) > 1          # and different seeds draw differently


def test_stop_strings_cut_the_answer_and_never_leak(client):
    def ask(**kw):
        return client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=40, temperature=1.0,
                                         seed=5, **kw)
    full = ask().choices[0].text
    k = next(k for k in range(1, len(full) - 2) if full.find(full[k:k + 2]) == k)   # a first occurrence, not at 0
    stop = full[k:k + 2]
    r = ask(stop=[stop, "never-in-the-text"])
    assert r.choices[0].text == full[:k] and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=40,
                                              temperature=1.0, seed=5, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == full[:k]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_ignored_parameters_are_ignored(client):
    r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       temperature=0, user="someone", presence_penalty=0, frequency_penalty=0.0,
                                       n=1, logprobs=False, metadata={"a": "b"}, store=False)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_messages_with_system_and_content_parts(client):
    r = client.chat.completions.create(model=MODEL_ID, max_tokens=3, temperature=0, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again"}])
    assert r.usage.prompt_tokens > 10


# ---- refusals --------------------------------------------------------------------------------------------------
def test_a_wrong_or_missing_api_key_is_401_on_every_endpoint(server):
    with openai.OpenAI(base_url=server.base_url, api_key="sk-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as e:
            bad.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}])
        assert error_of(e.value)["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    for path in ("/health", "/v1/models", "/v1/completions", "/nothing-here"):
        r = httpx.post(f"http://127.0.0.1:{server.port}{path}", json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    err = error_of(e.value)
    assert err["code"] == "model_not_found" and MODEL_ID in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


@pytest.mark.parametrize("body, param", [
    ({"temperature": 5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2 ** 40}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 1.5}, "max_completion_tokens"),
    ({"seed": "x"}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 7}, "stop"),
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"model": None}, "model"),
])
def test_bad_parameters_are_400_naming_the_parameter(server, body, param):
    full = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    r = httpx.post(f"{server.base_url}/chat/completions", json=full, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and param.split("[")[0] in err["message"]


def test_malformed_json_and_non_objects_are_400(server):
    for content in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
        r = httpx.post(f"{server.base_url}/chat/completions", content=content,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


def test_unknown_routes_and_methods_answer_in_the_same_shape(server):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(f"{server.base_url}/engines", headers=h)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{server.base_url}/chat/completions", headers=h)
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"]


def test_a_prompt_longer_than_the_context_is_400_with_the_counts(server, client):
    long = "word " * 400                 # > 256 tokens, the server's context
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_ID, prompt=long, max_tokens=4)
    err = error_of(e.value)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    n = len(Tokenizer.from_gguf(server.model).encode(long))
    assert f"{n} tokens" in err["message"] and "256" in err["message"]


def test_a_full_queue_is_429_with_retry_after(server, client):
    """max_seqs 2 + max_queue 2: with four sequences open, a fifth request is refused at once, and served again
    once they are gone."""
    held = []

    async def hold(n: int) -> None:
        sched = server.service.scheduler
        for _ in range(n):
            gen = sched.open(SeqRequest((5, 6, 7), 200, Sampling(), frozenset()))
            await gen.__aenter__()
            held.append(gen)

    async def release() -> None:
        for gen in held:
            await gen.__aexit__(None, None, None)
    server.run(hold, 4)
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL_ID, prompt="x", max_tokens=2)
        assert error_of(e.value)["code"] == "queue_full"
        assert int(e.value.response.headers["retry-after"]) >= 1
    finally:
        server.run(release)
    assert client.completions.create(model=MODEL_ID, prompt="x", max_tokens=2, temperature=0).usage.completion_tokens >= 1


def test_no_mesh_formed_is_503_with_retry_after(model):
    with LiveServer(model, peers=(), wait_formed=False) as srv:
        with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as e:
                c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 503 and error_of(e.value)["code"] == "no_mesh"
        assert e.value.response.headers["retry-after"]
        r = httpx.get(f"http://127.0.0.1:{srv.port}/health")
        assert r.status_code == 503 and r.json()["status"] == "no mesh"


def test_binding_beyond_loopback_without_a_key_is_refused_at_parsing(model):
    env = child_env()
    env.pop("MESH_API_KEY", None)
    p = subprocess.run(mesh_cmd("coord", "--model", str(model), "--http", "0.0.0.0:8080", "--insecure-open"),
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--api-key" in p.stderr and "MESH_API_KEY" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_an_http_port_in_use_is_one_line(model):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = subprocess.run(mesh_cmd("coord", "--model", str(model), "--listen", "127.0.0.1:0", "--http",
                                    f"127.0.0.1:{port}", "--insecure-open"),
                           cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(f"mesh-coord: cannot serve HTTP on 127.0.0.1:{port}: ")


# ---- load ------------------------------------------------------------------------------------------------------
async def _wait_idle(service) -> None:
    with trio.fail_after(60):
        while True:
            st = service.scheduler.stats()
            if st.active == 0 and st.queued == 0:
                return
            await trio.sleep(0.02)


def _connection_tasks() -> int:
    """hypercorn's tasks on the calling trio loop that serve a connection (not its lifespan or listener)."""
    def walk(task) -> int:
        mine = task.name.startswith("hypercorn.") and task.name not in ("hypercorn.utils.raise_shutdown",
                                                                        "hypercorn.trio.lifespan.Lifespan.handle_lifespan")
        return mine + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)
    return walk(trio.lowlevel.current_root_task())


async def _settle(tasks: int) -> None:
    """Until hypercorn has seen every hang-up and ended those connections' tasks (`tasks`: as many as before)."""
    with trio.fail_after(60):
        while _connection_tasks() > tasks:
            await trio.sleep(0.02)


def test_clients_that_disconnect_mid_stream_leave_no_slot_held(model, server, client):
    """100 clients each read the first streamed token, then hang up; afterwards nothing is active or queued, no
    sequence or generation object of theirs is alive (what a held client would keep: its scheduler sequence, its
    generation), and the server still answers exactly as before. KV slots and blocks live in the peer's worker:
    tests/test_scheduler.py checks them zeroed and freed. (A tracemalloc bound on the heap was tried here: tracing
    every allocation of this process, which also runs the coordinator's loop, stalled that loop past the peers'
    5 s heartbeat in a full suite run, and the peer left the session; so did a full gc.collect() while the suite's
    heap was millions of objects: tests/conftest.py.)"""
    before, _ = chat_reference(model, "Hello there", 12)
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 200,
            "temperature": 0, "stream": True}

    async def one(http: httpx.AsyncClient) -> bool:
        async with http.stream("POST", "/chat/completions", json=body) as r:
            if r.status_code == 429:
                return False
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    return True            # a real token arrived mid-stream: hang up here
        raise AssertionError("the stream ended before its first token")

    async def main(rounds: int) -> int:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=120, limits=limits) as http:
            served = 0
            for _ in range(rounds):                      # 4 at a time: the server's 2 slots + 2 queued
                served += sum(await asyncio.gather(*(one(http) for _ in range(4))))
                server.run(_wait_idle, server.service)   # every hang-up freed its place
            return served
    # objects alive before (other tests' leftovers) are not this test's: only new ones count
    baseline = {id(o) for o in gc.get_objects() if isinstance(o, (Generation, _Seq))}
    tasks = server.call(_connection_tasks)               # connections other tests' clients still keep alive
    assert asyncio.run(main(25)) == 100
    server.run(_settle, tasks)
    gc.collect()      # cheap: tests/conftest.py keeps the suite's heap small (a full collection holds the GIL)
    st = server.call(server.service.scheduler.stats)
    assert st.active == 0 and st.queued == 0
    assert not [o for o in gc.get_objects() if isinstance(o, (Generation, _Seq)) and id(o) not in baseline]
    r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hello there"}],
                                       max_tokens=12, temperature=0)
    assert r.choices[0].message.content == before


def test_sse_lines_are_openai_events(server):
    r = httpx.post(f"{server.base_url}/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL_ID, "prompt": "x", "max_tokens": 3, "stream": True}, timeout=60)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])
