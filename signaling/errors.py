"""The errors of `signaling`: every failure to bring a WebRTC hop up is a `SignalingError` naming what failed."""

from __future__ import annotations


class SignalingError(Exception):
    """An SDP exchange, an ICE configuration or a data channel open failed; the message names the step."""


class IceConfigError(SignalingError, ValueError):
    """A --stun/--turn flag is malformed; the message names the flag and the value."""


class HopError(SignalingError):
    """No rung of the transport ladder could bring hop `hop` up: both failures, with the hop named."""

    def __init__(self, hop: str, direct_error: BaseException | str | None, rtc_error: BaseException | str | None):
        self.hop = hop
        self.direct_error = direct_error
        self.rtc_error = rtc_error
        super().__init__(f"{hop}: direct dial: {_describe(direct_error)}; webrtc: {_describe(rtc_error)}")


def _describe(error: BaseException | str | None) -> str:
    if error is None:
        return "not tried"
    if isinstance(error, str):
        return error
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else f"{type(error).__name__} (no reply in time)"
