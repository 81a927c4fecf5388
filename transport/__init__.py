"""Byte pipes, each a `trio.abc.Stream`: TCP, WebSocket (wsproto), one listener for both, and `dial`."""

from .addr import Addr, parse_addr
from .dial import dial
from .errors import (
    AddressError,
    DialError,
    HandshakeError,
    ListenError,
    TransportError,
    WebSocketError,
)
from .listener import serve_listener
from .prefix import PrefixStream
from .tcp import open_tcp, remote_host
from .websocket import DEFAULT_MAX_MESSAGE, WebSocketStream, ws_accept, ws_connect

__all__ = [
    "DEFAULT_MAX_MESSAGE",
    "Addr",
    "AddressError",
    "DialError",
    "HandshakeError",
    "ListenError",
    "PrefixStream",
    "TransportError",
    "WebSocketError",
    "WebSocketStream",
    "dial",
    "open_tcp",
    "parse_addr",
    "remote_host",
    "serve_listener",
    "ws_accept",
    "ws_connect",
]
