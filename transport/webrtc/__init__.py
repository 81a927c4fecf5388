"""WebRTC data channels as trio streams: aiortc on one asyncio loop thread behind one bridge.

    async with open_rtc_bridge() as bridge:                   # one per process: the asyncio loop thread
        offerer = await make_offer(bridge, servers)           # offerer.local_sdp: the complete offer
        ...                                                    # (the far peer: accept_offer(its_bridge, sdp))
        await offerer.finish(answer_sdp)
        stream = await offerer.open_stream()                   # a trio.abc.Stream once the channel is open

Callers bound every step with `trio.fail_after`; nothing here has a timeout parameter.
"""

from .bridge import RtcBridge, open_rtc_bridge
from .channel import DataChannelStream
from .errors import BridgeClosedError, ChannelError, RtcError, SdpError
from .peer import IceServer, RtcPeer, accept_offer, make_offer
from .sdp import check_sdp

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
