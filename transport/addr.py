"""Dial addresses: `host:port`, `[v6]:port`, `tcp://host:port`, `ws://host[:port][/path]`.

A `ws://` string is kept whole through the mesh (it is what a peer advertises), so parsing is strict and
`str(Addr)` gives back a canonical form that parses to the same value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import AddressError

Scheme = Literal["tcp", "ws"]

_WS_DEFAULT_PORT = 80


@dataclass(frozen=True, slots=True)
class Addr:
    scheme: Scheme
    host: str  # bare host: no brackets around an IPv6 literal
    port: int
    path: str  # "" for tcp; starts with "/" for ws

    @property
    def hostport(self) -> str:
        """`host:port` with brackets around an IPv6 literal, as HTTP's Host header and our own parser want it."""
        return f"{format_host(self.host)}:{self.port}"

    def __str__(self) -> str:
        if self.scheme == "ws":
            return f"ws://{self.hostport}{self.path}"
        return self.hostport


def format_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_addr(addr: str) -> Addr:
    """Parse a dial address; any malformed string raises `AddressError` naming the string and the reason."""
    if not isinstance(addr, str):
        raise AddressError(repr(addr), f"expected a str, got {type(addr).__name__}")
    if not addr:
        raise AddressError(addr, "empty address")
    if addr != addr.strip() or any(c.isspace() for c in addr):
        raise AddressError(addr, "contains whitespace")
    scheme: Scheme = "tcp"
    rest = addr
    if "://" in addr:
        given, rest = addr.split("://", 1)
        given = given.lower()
        if given == "ws":
            scheme = "ws"
        elif given == "tcp":
            scheme = "tcp"
        elif given == "wss":
            raise AddressError(addr, "wss:// (WebSocket over TLS) is not supported; use ws://")
        else:
            raise AddressError(addr, f"unknown scheme {given!r}; expected ws:// or host:port")
    path = ""
    if scheme == "ws":
        if "#" in rest:
            raise AddressError(addr, "a fragment ('#') has no meaning in a dial address")
        cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=-1)
        if cut >= 0:
            rest, path = rest[:cut], rest[cut:]
        if not path.startswith("/"):
            path = "/" + path
    elif "/" in rest:
        raise AddressError(addr, "a tcp address takes no path; use ws://host:port/path for a WebSocket")
    host, port = _split_hostport(addr, rest, default_port=_WS_DEFAULT_PORT if scheme == "ws" else None)
    return Addr(scheme, host, port, path)


def _split_hostport(addr: str, hostport: str, *, default_port: int | None) -> tuple[str, int]:
    if hostport.startswith("["):
        close = hostport.find("]")
        if close < 0:
            raise AddressError(addr, "unclosed '[' around an IPv6 address")
        host, after = hostport[1:close], hostport[close + 1 :]
        if not host or ":" not in host:
            raise AddressError(addr, f"{hostport[: close + 1]!r} is not an IPv6 literal")
        if after and not after.startswith(":"):
            raise AddressError(addr, f"unexpected {after!r} after the IPv6 address")
        port_text = after[1:] if after else None
    else:
        if hostport.count(":") > 1:
            raise AddressError(addr, "an IPv6 address needs brackets, like [::1]:7000")
        host, sep, port_text = hostport.partition(":")
        if not sep:
            port_text = None
        if not host:
            raise AddressError(addr, "missing host")
    if port_text is None:
        if default_port is None:
            raise AddressError(addr, "missing port (expected host:port)")
        return host, default_port
    if not port_text.isdigit() or not port_text.isascii():
        raise AddressError(addr, f"port {port_text!r} is not a number")
    port = int(port_text)
    if port > 65535:
        raise AddressError(addr, f"port {port} is out of range 0..65535")
    return host, port
