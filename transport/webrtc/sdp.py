"""Checks on a remote session description before aiortc sees it, so bad input fails fast with a named reason.

aiortc accepts a lot of nonsense silently (an SDP without candidates simply never connects, which a caller would
only learn from its timeout). We parse with aiortc's own parser and demand what a non-trickle data-channel-only
description must carry.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiortc.sdp import SessionDescription

from .errors import SdpError

# Bounded before parsing, like any buffer fed from the network: a real non-trickle SDP is a few KB.
MAX_SDP_BYTES = 64 * 1024
# RFC 8841: a peer that does not announce max-message-size accepts at least 64 KiB.
DEFAULT_MAX_MESSAGE = 65536


@dataclass(frozen=True, slots=True)
class SdpSummary:
    """What we need from a remote description after it passed the checks."""

    candidates: int
    max_message_size: int  # 0 = the peer accepts any size


def check_sdp(sdp: object, kind: str) -> SdpSummary:
    """Validate a remote offer or answer (`kind`) for one data channel; raise `SdpError` naming the problem."""
    if not isinstance(sdp, str):
        raise SdpError(f"{kind} SDP must be text, got {type(sdp).__name__}")
    if not sdp.strip():
        raise SdpError(f"{kind} SDP is empty")
    if len(sdp) > MAX_SDP_BYTES:
        raise SdpError(f"{kind} SDP is {len(sdp)} bytes, over the {MAX_SDP_BYTES}-byte limit")
    if not sdp.lstrip().startswith("v=0"):
        raise SdpError(f"{kind} SDP does not start with 'v=0': {sdp[:40]!r}")
    try:
        parsed = SessionDescription.parse(sdp)
    except Exception as exc:  # aiortc's parser raises whatever its string handling hits
        raise SdpError(f"{kind} SDP does not parse: {type(exc).__name__}: {exc}") from exc
    apps = [m for m in parsed.media if m.kind == "application"]
    others = [m.kind for m in parsed.media if m.kind != "application"]
    if others:
        raise SdpError(f"{kind} SDP carries media sections {others}; only one data channel section is expected")
    if len(apps) != 1:
        raise SdpError(f"{kind} SDP has {len(apps)} data channel (m=application) sections, expected 1")
    media = apps[0]
    if "SCTP" not in media.profile:
        raise SdpError(f"{kind} SDP data section uses profile {media.profile!r}, not DTLS/SCTP")
    if media.ice is None or not media.ice.usernameFragment or not media.ice.password:
        raise SdpError(f"{kind} SDP lacks ICE credentials (a=ice-ufrag / a=ice-pwd)")
    if media.dtls is None or not media.dtls.fingerprints:
        raise SdpError(f"{kind} SDP lacks a DTLS fingerprint (a=fingerprint)")
    if not media.ice_candidates:
        raise SdpError(f"{kind} SDP has no ICE candidates; signaling is non-trickle, so they must be included")
    size = DEFAULT_MAX_MESSAGE
    if media.sctpCapabilities is not None:
        size = media.sctpCapabilities.maxMessageSize
    return SdpSummary(candidates=len(media.ice_candidates), max_message_size=size)
