"""WebRTC data channels as trio streams: aiortc on one asyncio loop thread behind one bridge.

    async with open_rtc_bridge() as bridge:                   # one per process: the asyncio loop thread
        offerer = await make_offer(bridge, servers)           # offerer.local_sdp: the complete offer
        ...                                                    # (the far peer: accept_offer(its_bridge, sdp))
        await offerer.finish(answer_sdp)
        stream = await offerer.open_stream()                   # a trio.abc.Stream once the channel is open

Callers bound every step with `trio.fail_after`; nothing here has a timeout parameter.
"""

import importlib

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


def __getattr__(name: str):
    """Names are imported on first use (PEP 562): the submodules behind most of them import aiortc, which a process
    that never opens a WebRTC hop should not pay for at start."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
