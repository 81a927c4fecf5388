"""The transport package's errors: one base, and each subclass names the thing and the reason.

Foreign exceptions (OSError, socket.gaierror, h11/wsproto protocol errors) are mapped to these at the boundary,
httpcore-style, so callers catch `TransportError` and never a library's exception type.

Once a stream is open, trio's own stream contract still holds: a dead peer is `trio.BrokenResourceError`, use after
our own close is `trio.ClosedResourceError`. `WebSocketError` is a `BrokenResourceError` too, so code written
against `trio.abc.Stream` handles it without knowing about WebSocket, while its message says what went wrong.
"""

from __future__ import annotations

import trio


class TransportError(Exception):
    """Base of every error this package raises on its own account."""


class DialError(TransportError):
    """Could not open a stream to `addr` (unreachable, refused, unresolvable, or the upgrade failed)."""

    def __init__(self, addr: str, reason: str) -> None:
        super().__init__(f"cannot dial {addr}: {reason}")
        self.addr = addr
        self.reason = reason


class AddressError(DialError, ValueError):
    """An address string that is not `host:port` or `ws://host:port[/path]`.

    A `DialError` too, so `except DialError` around `dial` also covers a malformed address.
    """

    def __init__(self, addr: str, reason: str) -> None:
        ValueError.__init__(self, f"bad address {addr!r}: {reason}")
        self.addr = addr
        self.reason = reason


class ListenError(TransportError):
    """Could not bind the listening socket."""

    def __init__(self, host: str | None, port: int, reason: str) -> None:
        super().__init__(f"cannot listen on {host or '*'}:{port}: {reason}")
        self.host = host
        self.port = port
        self.reason = reason


class HandshakeError(TransportError):
    """The WebSocket opening handshake failed (garbage request, refused upgrade, peer vanished mid-handshake)."""

    def __init__(self, reason: str, *, peer: str | None = None) -> None:
        where = f" with {peer}" if peer else ""
        super().__init__(f"WebSocket handshake{where} failed: {reason}")
        self.reason = reason
        self.peer = peer


class WebSocketError(TransportError, trio.BrokenResourceError):
    """An open WebSocket broke for a protocol reason (bad frame, text message, message over the size limit)."""

    def __init__(self, reason: str, *, code: int | None = None) -> None:
        suffix = f" (close code {code})" if code is not None else ""
        super().__init__(f"WebSocket broken: {reason}{suffix}")
        self.reason = reason
        self.code = code
