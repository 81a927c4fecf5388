"""The protocol's error codes and the one error type that escapes the codec."""
from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Codes carried by the `Error` message; values are wire-stable."""

    MALFORMED = 1            # a payload that does not decode (lengths, enums, utf-8, dtype/shape)
    UNKNOWN_TYPE = 2         # a message type this version does not define
    FRAME_TOO_LARGE = 3      # a header announcing more than the receiver's max frame
    UNSUPPORTED_VERSION = 4  # no common protocol version
    AUTH_REQUIRED = 5        # the fleet has a token and the peer offered none
    AUTH_FAILED = 6          # a proof did not verify, or only one side has a token
    UNEXPECTED = 7           # a valid message that is not allowed in the current state
    FLOW_CONTROL = 8         # the peer sent beyond the credit it was granted
    TRUNCATED = 9            # the connection ended in the middle of a frame
    BUSY = 10                # the resource is held by someone else (e.g. a second weight shipper)
    BAD_REQUEST = 11         # well-formed but semantically invalid (e.g. a layer range out of bounds)
    INTERNAL = 12            # the peer failed on its side; the reason says how
    TIMEOUT = 13             # the peer gave up waiting for something
    SHUTTING_DOWN = 14       # the peer is going away and refuses new work


class ProtoError(Exception):
    """Base of every error raised by `mesh.proto`."""


class ProtocolError(ProtoError):
    """The peer's bytes or messages broke the protocol. The only error the codec lets escape.

    `code` and `reason` are what the connection should send back in an `Error` message before closing.
    """

    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(f"{code.name}: {reason}")
        self.code = ErrorCode(code)
        self.reason = reason


class AuthError(ProtocolError):
    """The connection handshake failed: version negotiation or fleet-token authentication."""
