"""The errors that escape `transport.webrtc`: aiortc's and asyncio's own exceptions are mapped to these."""

from __future__ import annotations


class RtcError(Exception):
    """Base of every error raised by the WebRTC transport."""


class BridgeClosedError(RtcError):
    """The asyncio loop thread is gone (the bridge was closed), so no aiortc work can run."""


class SdpError(RtcError):
    """A session description is malformed or unusable; the message names what is wrong with it."""


class ChannelError(RtcError):
    """The peer connection or its data channel failed or closed before it could carry bytes."""
