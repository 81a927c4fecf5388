"""Plain TCP: connect with errors mapped to `DialError`, and the peer's IP seen through any of our wrappers."""

from __future__ import annotations

import socket

import trio

from .errors import DialError


async def open_tcp(host: str, port: int, *, addr: str | None = None) -> trio.SocketStream:
    """Connect to `host:port` with TCP_NODELAY on; any failure raises `DialError` naming `addr` (or host:port)."""
    name = addr if addr is not None else f"{host}:{port}"
    try:
        stream = await trio.open_tcp_stream(host, port)
    except socket.gaierror as exc:
        raise DialError(name, f"cannot resolve host {host!r}: {exc.strerror or exc}") from None
    except OSError as exc:
        raise DialError(name, _connect_reason(exc)) from None
    # trio already sets it; said again because the latency of every hop depends on it
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
    return stream


def _connect_reason(exc: OSError) -> str:
    """trio folds every attempt's error into an ExceptionGroup under a generic OSError; name the real causes."""
    leaves: list[BaseException] = []
    group = exc.__cause__
    if isinstance(group, BaseExceptionGroup):
        leaves = list(group.exceptions)
    reasons: list[str] = []
    for leaf in leaves or [exc]:
        text = leaf.strerror if isinstance(leaf, OSError) and leaf.strerror else str(leaf)
        if text not in reasons:
            reasons.append(text)
    return "; ".join(reasons) or type(exc).__name__


def remote_host(stream: trio.abc.Stream) -> str | None:
    """The peer's IP address under `stream`, unwrapping our wrappers (`transport_stream`), or None if no socket.

    An IPv4 peer seen through a dual-stack socket (`::ffff:a.b.c.d`) is reported as plain `a.b.c.d`.
    """
    seen = 0
    while not isinstance(stream, trio.SocketStream):
        inner = getattr(stream, "transport_stream", None)
        seen += 1
        if inner is None or seen > 16:
            return None
        stream = inner
    try:
        peer = stream.socket.getpeername()
    except OSError:
        return None  # closed, or the peer already left
    if not isinstance(peer, tuple):
        return None  # a unix socket has no host
    host = str(peer[0])
    if host.startswith("::ffff:") and "." in host:
        host = host[len("::ffff:") :]
    return host
