"""WebRTC signaling: the coordinator relays opaque SDP between peers; each peer's RtcEndpoint owns its connections.

Coordinator side: `open_rtc_hop(offerer_link, answerer_link, sink=..., hop=...)` (or just `relay_webrtc`).
Peer side: `open_rtc_endpoint(ice)` -> `RtcEndpoint`; `answer_signal(endpoint, Signal)` builds the reply;
`endpoint.open_stream(Side.ANSWERER)` on RtcServe, `endpoint.open_stream(Side.OFFERER)` on RtcChain.
`IceConfig.from_flags(--stun, --turn, --turn-user, --turn-pass)`; `climb(hop, direct, rtc)` and `HopError` for the
transport ladder.
"""

from .endpoint import RtcEndpoint, Side, answer_signal, open_rtc_endpoint
from .errors import HopError, IceConfigError, SignalingError
from .ice import IceConfig
from .ladder import climb
from .relay import ControlLink, HopProgress, open_rtc_hop, relay_webrtc

__all__ = [
    "ControlLink",
    "HopError",
    "HopProgress",
    "IceConfig",
    "IceConfigError",
    "RtcEndpoint",
    "Side",
    "SignalingError",
    "answer_signal",
    "climb",
    "open_rtc_endpoint",
    "open_rtc_hop",
    "relay_webrtc",
]
