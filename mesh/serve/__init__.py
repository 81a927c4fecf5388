"""The coordinator's HTTP service: an OpenAI-compatible API (and the page and status routes added to it).

`app.build_app(service)` is the ASGI application; `service.Service` forms sessions and holds the scheduler;
`http.serve_http` runs the app under hypercorn's trio worker on the coordinator's own trio loop.
"""
