"""WebRTC signaling: the coordinator relays opaque SDP between peers; each peer's RtcEndpoint owns its connections.

Coordinator side: `open_rtc_hop(offerer_link, answerer_link, sink=..., hop=...)` (or just `relay_webrtc`).
Peer side: `open_rtc_endpoint(ice)` -> `RtcEndpoint`; `answer_signal(endpoint, Signal)` builds the reply;
`endpoint.open_stream(Side.ANSWERER)` on RtcServe, `endpoint.open_stream(Side.OFFERER)` on RtcChain.
`IceConfig.from_flags(--stun, --turn, --turn-user, --turn-pass)`; `climb(hop, direct, rtc)` and `HopError` for the
transport ladder.
"""

from common.lazy import lazy_getattr

from .errors import HopError, IceConfigError, SignalingError
from .ice import IceConfig

_LAZY = {**dict.fromkeys(("RtcEndpoint", "Side", "answer_signal", "open_rtc_endpoint"), ".endpoint"),
         "climb": ".ladder",
         **dict.fromkeys(("ControlLink", "HopProgress", "open_rtc_hop", "relay_webrtc"), ".relay")}

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

# the submodules behind most names import aiortc: loaded on first use
__getattr__ = lazy_getattr(__name__, _LAZY, globals())
