"""The web chat page: `/` and its static files, shipped inside the package (mesh/serve/static, package data).

No build step and nothing from a CDN: three plain files the browser runs as they are, so the page works on a home
network with no internet. The page itself holds no data, so it is served without the API key (PUBLIC); it asks the
user for the key when the API answers 401 and sends it as a Bearer token on every call.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

STATIC = Path(__file__).with_name("static")
PUBLIC = ("/static/", "/")       # "/static/" is a prefix; "/" alone is the page (app.BearerAuth: exact unless it ends
                                  # in "/" and is longer than "/")

# Only this origin's own scripts, styles and API: a page that cannot load or send anything elsewhere.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def routes(service: Any) -> list:
    from starlette.responses import FileResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    async def index(request):
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)

    class Static(StaticFiles):
        async def get_response(self, path, scope):
            response = await super().get_response(path, scope)
            response.headers.update(HEADERS)
            return response

    return [Route("/", index, methods=["GET", "HEAD"]), Mount("/static", app=Static(directory=STATIC), name="static")]
