"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models, /health.

Requests are checked by hand against OpenAI's parameter names (a dozen fields do not need a schema library):
a known field with a bad value, an unknown field, or a feature we do not have (n > 1, tools, logprobs) is a 400
naming the parameter, as OpenAI's own API answers an unrecognized argument. Fields OpenAI itself treats as hints
(`user`, `metadata`, `store`, `service_tier`, penalties of 0, ...) are accepted and ignored.

One request is one `Generation` of the scheduler. Streamed answers (`stream: true`) are Server-Sent Events, one
`data:` line a chunk and `data: [DONE]` at the end; the scheduler's `async with` is entered inside the response
itself (`_GenerationStream`), so however the response ends (finished, client gone, error) the sequence's slot is
freed at once. A client that disconnects from a non-streamed request is noticed too (`_unless_disconnected`).
"""
from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from engine.chat import ChatError, render_prompt
from common.values import Sampling
from engine.tokenizer import StreamDecoder
from mesh.errors import MeshError, single_errors
from mesh.scheduler import QueueFull, Request as SeqRequest
from mesh.serve.app import ApiError
from mesh.serve.service import NoMesh

MAX_STOPS = 4                  # as OpenAI: up to 4 stop strings
RETRY_AFTER_BUSY = "1"         # seconds a client waits after a full queue
RETRY_AFTER_NO_MESH = "5"      # ... after "no mesh formed" (peers re-join within a few seconds)

# Accepted and ignored: OpenAI treats these as hints or bookkeeping, or they change nothing at their neutral value.
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier",
            "reasoning_effort", "modalities", "verbosity"}
_NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logprobs": (False, None),
            "top_logprobs": (0, None), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none", "auto"),
            "functions": ([],), "function_call": ("none", "auto"), "echo": (False,), "best_of": (1,),
            "suffix": ("",), "response_format": ({"type": "text"},), "prediction": ()}
_SAMPLING = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n"}
_CHAT = _SAMPLING | {"messages", "max_completion_tokens"}
_COMPLETION = _SAMPLING | {"prompt"}


def routes(service) -> list:
    api = _Api(service)
    return [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
    ]


def _bad(param: str | None, message: str, *, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---- parameters ----------------------------------------------------------------------------------------------
async def _json_object(request: Request) -> dict:
    body = await request.body()
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _bad(None, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise _bad(None, f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    return data


def _check_fields(body: dict, known: set[str]) -> None:
    for key, value in body.items():
        if key in known or key in _IGNORED or value is None:
            continue
        if key in _NEUTRAL:
            if any(value == v and type(value) is type(v) for v in _NEUTRAL[key]):
                continue
            if key == "tool_choice" and not body.get("tools"):     # a choice among no tools chooses nothing
                continue
            raise _bad(key, f"{key}={json.dumps(value)[:80]} is not supported by this server (only the default)",
                       code="unsupported_parameter")
        raise _bad(key, f"Unrecognized request argument supplied: {key}", code="unknown_parameter")
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise _bad("n", f"n={json.dumps(n)}: this server returns one choice per request (n must be 1); send "
                        f"several requests instead", code="unsupported_parameter")


def _int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if type(value) is not int or value < lo or (hi is not None and value > hi):
        span = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise _bad(key, f"{key} must be an integer {span}, got {json.dumps(value)[:80]}", code="invalid_value")
    return value


def _num(body: dict, key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not (type(value) in (int, float) and math.isfinite(value) and lo <= value <= hi):
        raise _bad(key, f"{key} must be a number in [{lo:g}, {hi:g}], got {json.dumps(value)[:80]}",
                   code="invalid_value")
    return float(value)


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise _bad("stop", f"stop must be a string or a list of up to {MAX_STOPS} strings", code="invalid_value")
    return tuple(s for s in stops if s)


@dataclass(frozen=True)
class _Common:
    """The parameters both endpoints share, checked."""
    stream: bool
    include_usage: bool
    max_tokens: int | None
    sampling: Sampling
    stops: tuple[str, ...]


def _common(body: dict, *, max_keys: tuple[str, ...]) -> _Common:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if type(stream) is not bool:
        raise _bad("stream", f"stream must be true or false, got {json.dumps(stream)[:80]}", code="invalid_value")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options", "stream_options must be an object", code="invalid_value")
    max_tokens = None
    for key in max_keys:
        max_tokens = _int(body, key, 1) if max_tokens is None else max_tokens
    temperature = _num(body, "temperature", 0.0, 2.0)
    top_p = _num(body, "top_p", 0.0, 1.0)          # 0 keeps only the most likely token (common.values)
    top_k = _int(body, "top_k", 0)
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        raise _bad("seed", f"seed must be an integer, got {json.dumps(seed)[:80]}", code="invalid_value")
    temperature = 1.0 if temperature is None else temperature      # OpenAI's default
    if seed is None:     # without a seed each request draws differently, as OpenAI's do; with one it repeats
        seed = secrets.randbits(63)
    try:
        sampling = Sampling(temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p,
                            seed=seed & ((1 << 64) - 1))
    except ValueError as exc:           # a bound of the wire's value types (common.values), e.g. a huge top_k
        field = next((f for f in ("top_k", "top_p", "temperature", "seed") if f in str(exc)), None)
        raise _bad(field, str(exc), code="invalid_value") from None
    return _Common(stream, bool(options.get("include_usage")), max_tokens, sampling, _stops(body))


def _message_text(n: int, message) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise _bad(f"messages[{n}]", f"messages[{n}] must be an object with role and content", code="invalid_value")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise _bad(f"messages[{n}].role", f"messages[{n}].role must be a non-empty string", code="invalid_value")
    if content is None:
        content = ""
    if isinstance(content, list):       # content parts: text only
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"messages[{n}].content[{k}]", f"messages[{n}].content[{k}]: only text parts are "
                           f"supported, got {json.dumps(kind)[:40]}", code="unsupported_content")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise _bad(f"messages[{n}].content", f"messages[{n}].content must be a string or a list of text parts",
                   code="invalid_value")
    return role, content


# ---- text out ------------------------------------------------------------------------------------------------
class _Text:
    """Token ids in, text out, cut at the first stop string. Text that might be the start of a stop string is held
    back until the next token shows whether it is, so a stop string never reaches the client, even in pieces."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.decoder = StreamDecoder(tokenizer)
        self.stops = stops
        self.held = ""
        self.stopped = False

    def feed(self, tok: int) -> str:
        self.held += self.decoder.feed(tok)
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self.held += self.decoder.flush()
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        # The answer ends where a stop string is first complete (its end, then its start, the smallest): generation
        # stops there, so a longer stop that would have ended later never happened. Read that way the cut does not
        # depend on how the text came in tokens (a stop found one token later is the same cut).
        ends = [(at + len(s), at) for s in self.stops if (at := self.held.find(s)) >= 0]
        if ends:
            out, self.held, self.stopped = self.held[:min(ends)[1]], "", True
            return out
        keep = 0
        if not final:
            for k in range(min(len(self.held), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
                if any(s.startswith(self.held[-k:]) for s in self.stops):
                    keep = k
                    break
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out


def _usage(gen) -> dict:
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


def _error_event(exc: BaseException) -> dict:
    return {"error": {"message": f"the mesh failed while answering: {exc}", "type": "server_error", "param": None,
                      "code": "mesh_failed"}}


class _GenerationStream(StreamingResponse):
    """An SSE response that owns its Generation: the scheduler's `async with` is entered when the response starts
    and left however it ends (done, client gone mid-stream, error), so the slot is freed at once."""

    def __init__(self, gen, events):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        async with self.gen:
            await super().__call__(scope, receive, send)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _unless_disconnected(request: Request, work):
    """Run `work()`; if the client goes away first, cancel it (leaving the generation frees its slot)."""
    result = []

    async def run(nursery) -> None:
        result.append(await work())
        nursery.cancel_scope.cancel()

    async def watch(nursery) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        nursery.cancel_scope.cancel()
    with single_errors():          # an ApiError from `work` reaches Starlette's handler as itself
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, nursery)
            nursery.start_soon(watch, nursery)
    if not result:
        raise ApiError(499, "the client closed the request", code="client_closed")
    return result[0]


async def _encode(tok, text: str) -> list[int]:
    """Tokenize off the loop: a prompt of megabytes takes a while, and other streams must not stall meanwhile."""
    return await trio.to_thread.run_sync(tok.encode, text)


# ---- endpoints -----------------------------------------------------------------------------------------------
class _Api:
    def __init__(self, service):
        self.service = service

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise _bad("model", f"model is required: this server serves {self.service.model_id!r} (GET /v1/models)",
                       code="invalid_value")
        if model not in (self.service.model_id, self.service.model_id + ".gguf"):
            raise ApiError(404, f"The model '{model}' does not exist: this server serves "
                                f"'{self.service.model_id}'", param="model", code="model_not_found",
                           type="invalid_request_error")

    def _open(self, ids: list[int], common: _Common, param: str):
        svc = self.service
        limit = svc.max_context
        if len(ids) >= limit:
            raise _bad(param, f"the prompt has {len(ids)} tokens and the context holds {limit}, with at least one "
                              f"left for the answer: shorten the prompt by {len(ids) - limit + 1} tokens or more",
                       code="context_length_exceeded")
        max_tokens = min(common.max_tokens or limit, limit - len(ids))
        req = SeqRequest(tuple(ids), max_tokens, common.sampling, svc.stop_ids)
        try:
            return svc.open(req)
        except NoMesh as exc:
            raise ApiError(503, str(exc), type="server_error", code="no_mesh",
                           headers={"Retry-After": RETRY_AFTER_NO_MESH}) from None
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy: {exc}; retry shortly", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": RETRY_AFTER_BUSY}) from None
        except ValueError as exc:
            raise _bad(param, str(exc), code="invalid_value") from None
        except MeshError as exc:       # the session ended between the check and the open
            raise ApiError(503, f"the mesh is re-forming: {exc}", type="server_error", code="no_mesh",
                           headers={"Retry-After": RETRY_AFTER_NO_MESH}) from None

    async def chat(self, request: Request):
        body = await _json_object(request)
        _check_fields(body, _CHAT)
        self._check_model(body)
        common = _common(body, max_keys=("max_completion_tokens", "max_tokens"))
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "messages must be a non-empty list of {role, content} objects",
                       code="invalid_value")
        turns = [_message_text(n, m) for n, m in enumerate(messages)]
        if turns[-1][0] != "user":
            raise _bad("messages", f"messages: the last message must be the user's (got role {turns[-1][0]!r})",
                       code="invalid_value")
        tok = self.service.coord.tokenizer
        try:
            text = render_prompt(tok, turns[-1][1], mode=self.service.template,
                                 history=[{"role": r, "content": c} for r, c in turns[:-1]])
        except ChatError as exc:
            raise _bad("messages", str(exc), code="invalid_value") from None
        gen = self._open(await _encode(tok, text), common, "messages")
        return await self._answer(request, gen, common, chat=True)

    async def completions(self, request: Request):
        body = await _json_object(request)
        _check_fields(body, _COMPLETION)
        self._check_model(body)
        common = _common(body, max_keys=("max_tokens",))
        if common.max_tokens is None:
            common = _Common(common.stream, common.include_usage, 16, common.sampling, common.stops)  # OpenAI's default
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        tok = self.service.coord.tokenizer
        if isinstance(prompt, str) and prompt:
            ids = await _encode(tok, prompt)
        elif isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < tok.vocab_size for t in prompt):
            ids = list(prompt)
        else:
            raise _bad("prompt", f"prompt must be a non-empty string, or a list of token ids below {tok.vocab_size} "
                                 f"(one prompt per request)", code="invalid_value")
        gen = self._open(ids, common, "prompt")
        return await self._answer(request, gen, common, chat=False)

    async def _answer(self, request: Request, gen, common: _Common, *, chat: bool):
        svc = self.service
        ident = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        head = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": svc.model_id}

        def choice(text: str, finish: str | None, *, first: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        if common.stream:
            async def events():
                text = _Text(svc.coord.tokenizer, common.stops)
                if chat:
                    yield _sse({**head, "choices": [choice("", None, first=True)]})
                try:
                    async for t in gen:
                        piece = text.feed(t)
                        if piece:
                            yield _sse({**head, "choices": [choice(piece, None)]})
                        if text.stopped:
                            break
                    rest = text.finish()
                except MeshError as exc:
                    yield _sse(_error_event(exc))
                    return
                if rest:
                    yield _sse({**head, "choices": [choice(rest, None)]})
                finish = "stop" if text.stopped else (gen.finish_reason or "stop")
                yield _sse({**head, "choices": [choice("", finish)], "usage": _usage(gen)})
                if common.include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(gen)})
                yield "data: [DONE]\n\n"
            return _GenerationStream(gen, events())

        async def whole():
            text = _Text(svc.coord.tokenizer, common.stops)
            parts = []
            async with gen:
                try:
                    async for t in gen:
                        parts.append(text.feed(t))
                        if text.stopped:
                            break
                except MeshError as exc:
                    raise ApiError(503, f"the mesh failed while answering: {exc}; retry once it has re-formed",
                                   type="server_error", code="mesh_failed",
                                   headers={"Retry-After": RETRY_AFTER_NO_MESH}) from None
            parts.append(text.finish())
            return "".join(parts), "stop" if text.stopped else (gen.finish_reason or "stop")
        content, finish = await _unless_disconnected(request, whole)
        if chat:
            choices = [{"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                        "finish_reason": finish}]
        else:
            choices = [{"index": 0, "text": content, "logprobs": None, "finish_reason": finish}]
        return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                             "usage": _usage(gen)})

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request):
        model_id = request.path_params["model_id"]
        if model_id not in (self.service.model_id, self.service.model_id + ".gguf"):
            raise ApiError(404, f"The model '{model_id}' does not exist: this server serves "
                                f"'{self.service.model_id}'", param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        svc = self.service
        return {"id": svc.model_id, "object": "model", "created": svc.created, "owned_by": "mesh",
                "context_length": svc.max_context}

    async def health(self, request: Request):
        svc = self.service
        sched = svc.scheduler
        body = {"status": "ok" if sched is not None else "no mesh", "state": svc.state, "model": svc.model_id,
                "peers": len(svc.session.members) if svc.session is not None else 0,
                "pooled": len(svc.coord.registry.members)}
        if sched is not None:
            st = sched.stats()
            body.update(active=st.active, queued=st.queued, max_seqs=st.max_seqs)
        return JSONResponse(body, status_code=200 if sched is not None else 503)
