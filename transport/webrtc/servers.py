"""The STUN/TURN server value, apart from aiortc: flags are parsed (signaling.IceConfig) in processes that may never
open a WebRTC hop, and importing aiortc costs ~0.2-0.4 s of every start."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class IceServer:
    """One STUN or TURN server, as aiortc's RTCIceServer takes it (`stun:host:port`, `turn:host:port?...`)."""

    url: str
    username: str | None = None
    credential: str | None = field(default=None, repr=False)  # kept out of logs
