"""ICE server configuration from command-line flags. No server is used unless one is configured.

Flag shapes (one STUN and one TURN server at most: aioice uses only the first of each, so more is an error
rather than a silent drop):
    --stun stun:HOST[:PORT]                       (PORT defaults to 3478; a bare HOST[:PORT] is accepted too)
    --turn turn:HOST[:PORT][?transport=udp|tcp]   with --turn-user USER --turn-pass PASS (long-term credentials)
    --turn turns:HOST[:PORT][?transport=tcp]      TURN over TLS (PORT defaults to 5349)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from transport.webrtc import IceServer

from .errors import IceConfigError

_HOST = r"(?P<host>[A-Za-z0-9._-]+)"  # aiortc's URL grammar has no bracketed IPv6 literals
_PORT = r"(?::(?P<port>[0-9]{1,5}))?"
_STUN = re.compile(rf"(?:stun:)?{_HOST}{_PORT}")
_TURN = re.compile(rf"(?P<scheme>turns?):{_HOST}{_PORT}(?:\?transport=(?P<transport>udp|tcp))?")


@dataclass(frozen=True, slots=True)
class IceConfig:
    """The STUN/TURN servers every RTCPeerConnection of this process gets. Empty: host candidates only."""

    servers: tuple[IceServer, ...] = ()

    @classmethod
    def from_flags(
        cls, stun: Sequence[str] = (), turn: Sequence[str] = (), turn_user: str = "", turn_pass: str = ""
    ) -> IceConfig:
        if len(stun) > 1:
            raise IceConfigError(f"--stun given {len(stun)} times ({', '.join(stun)}); WebRTC here uses one STUN server")
        if len(turn) > 1:
            raise IceConfigError(f"--turn given {len(turn)} times ({', '.join(turn)}); WebRTC here uses one TURN server")
        servers = [IceServer(_stun_url(url)) for url in stun]
        if turn:
            if not turn_user or not turn_pass:
                raise IceConfigError(f"--turn {turn[0]} needs both --turn-user and --turn-pass")
            servers.append(IceServer(_turn_url(turn[0]), turn_user, turn_pass))
        elif turn_user or turn_pass:
            raise IceConfigError("--turn-user/--turn-pass given without --turn")
        return cls(tuple(servers))

    def describe(self) -> str:
        """For logs: the server URLs, never the credentials."""
        return ", ".join(s.url for s in self.servers) or "no STUN/TURN (host candidates only)"


def _check_port(flag: str, url: str, port: str | None) -> None:
    if port is not None and not 1 <= int(port) <= 65535:
        raise IceConfigError(f"{flag} {url}: port {port} is not in 1..65535")


def _stun_url(url: str) -> str:
    match = _STUN.fullmatch(url.strip())
    if not match:
        raise IceConfigError(f"--stun {url!r}: expected stun:HOST[:PORT]")
    _check_port("--stun", url, match["port"])
    return f"stun:{match['host']}" + (f":{match['port']}" if match["port"] else "")


def _turn_url(url: str) -> str:
    match = _TURN.fullmatch(url.strip())
    if not match:
        raise IceConfigError(f"--turn {url!r}: expected turn:HOST[:PORT][?transport=udp|tcp] or turns:HOST[:PORT]")
    _check_port("--turn", url, match["port"])
    if match["scheme"] == "turns" and match["transport"] == "udp":
        raise IceConfigError(f"--turn {url!r}: turns (TLS) runs over tcp only")
    return url.strip()
