"""WebRTC data channels as trio streams: aiortc on one asyncio loop thread behind one bridge.

    async with open_rtc_bridge() as bridge:                   # one per process: the asyncio loop thread
        offerer = await make_offer(bridge, servers)           # offerer.local_sdp: the complete offer
        ...                                                    # (the far peer: accept_offer(its_bridge, sdp))
        await offerer.finish(answer_sdp)
        stream = await offerer.open_stream()                   # a trio.abc.Stream once the channel is open

Callers bound every step with `trio.fail_after`; nothing here has a timeout parameter.
"""

from common.lazy import lazy_getattr

from .errors import BridgeClosedError, ChannelError, RtcError, SdpError
from .servers import IceServer

_LAZY = {**dict.fromkeys(("RtcBridge", "open_rtc_bridge"), ".bridge"), "DataChannelStream": ".channel",
         "check_sdp": ".sdp",
         **dict.fromkeys(("RtcPeer", "accept_offer", "make_offer"), ".peer")}

__all__ = [
    "BridgeClosedError",
    "ChannelError",
    "DataChannelStream",
    "IceServer",
    "RtcBridge",
    "RtcError",
    "RtcPeer",
    "SdpError",
    "accept_offer",
    "check_sdp",
    "make_offer",
    "open_rtc_bridge",
]

# the submodules behind most names import aiortc: loaded on first use
__getattr__ = lazy_getattr(__name__, _LAZY, globals())
