"""The ASGI application the coordinator serves: routes, API-key check, and errors in OpenAI's shape.

Starlette gives routing, requests, JSON and streaming responses; hypercorn (mesh/serve/http.py) speaks HTTP. Neither
is written here: this module only decides what the service answers.

Routes come from modules, each with `routes(service) -> list[starlette.routing.BaseRoute]` and, optionally,
`PUBLIC: tuple[str, ...]`, path prefixes served without the API key (a static page that holds no data; it must ask
for the key itself before calling the API). The list below is the one place a module is added:
    mesh.serve.openai_api   /v1/chat/completions, /v1/completions, /v1/models[/{id}], /health  (api)
    mesh.serve.status       /v1/mesh: the mesh's status as JSON                              (page)
    mesh.serve.page         / and /static/*: the web chat page (public: it asks for the key)  (page)
Later modules cannot shadow earlier paths: Starlette matches routes in order.

What a route module may use of `service` (mesh/serve/service.py, `Service`):
    service.model_id: str                 the id /v1/models lists and requests must name
    service.api_key: str | None           None: no key asked (loopback only; the CLI refuses it elsewhere)
    service.coord                         the Coordinator: .tokenizer, .cfg (CoordConfig), .registry (the pool)
    service.session                       the formed mesh.session.Session or None: .fleet.members (chain order,
                                          each a registry Member: .name, .host, .join), .pipe, .ranges
    service.scheduler                     the Scheduler serving now, or None: .stats() -> SchedulerStats
    service.state: str                    "forming" | "serving" | "re-forming" | "stopped", for a status view
"""
from __future__ import annotations

import hmac
import importlib
import logging

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse

log = logging.getLogger("mesh.serve")

ROUTE_MODULES: list[str] = ["mesh.serve.openai_api", "mesh.serve.status", "mesh.serve.page"]
MAX_BODY = 8 << 20         # a request body past 8 MiB is refused (413) before it is read whole


class ApiError(Exception):
    """A request the service refuses: answered as OpenAI's error JSON with this status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}


def error_response(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


_HTTP_TYPES = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed"),
               413: ("invalid_request_error", "request_too_large")}


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code,
                          headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route, wrong method, body too large) in the same shape."""
    type_, code = _HTTP_TYPES.get(exc.status_code, ("invalid_request_error", None))
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(exc.status_code, message, type=type_, code=code, headers=dict(exc.headers or {}))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """A bug, not the client's fault: the traceback goes to the log, the client gets one line and a 500."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"internal error ({type(exc).__name__}); the coordinator's log has the details",
                          type="server_error", code="internal_error")


class BearerAuth:
    """Every request must carry `Authorization: Bearer <key>` unless its path is public. Pure ASGI, so it also
    guards streaming responses; the key is compared in constant time."""

    def __init__(self, app, *, key: str | None, public: tuple[str, ...] = ()):
        self.app, self.key, self.public = app, key.encode() if key else None, public

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.key is None or self._public(scope["path"]):
            return await self.app(scope, receive, send)
        scheme, _, given = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.key):
            return await self.app(scope, receive, send)
        why = "no API key given" if not given else "wrong API key"
        response = error_response(401, f"{why}: send the key mesh-coord was started with (--api-key or "
                                       f"$MESH_API_KEY) as 'Authorization: Bearer KEY'",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _public(self, path: str) -> bool:
        """A public entry is an exact path, or a prefix when it ends in "/" ("/" itself is only the root page)."""
        return any(path == p or (p.endswith("/") and p != "/" and path.startswith(p)) for p in self.public)


def build_app(service) -> Starlette:
    routes, public = [], []
    for name in ROUTE_MODULES:
        module = importlib.import_module(name)
        routes += module.routes(service)
        public += getattr(module, "PUBLIC", ())
    return Starlette(
        routes=routes,
        middleware=[Middleware(BearerAuth, key=service.api_key, public=tuple(public))],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _unexpected},
        max_body_size=MAX_BODY,
    )
