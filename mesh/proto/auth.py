"""The connection handshake: version negotiation and mutual fleet-token authentication, sans-IO.

    client -> server   Hello(min_version, max_version, client_nonce, auth)
    server -> client   Welcome(version, server_nonce, server_proof)        server proves first
    client -> server   AuthProof(client_proof)                             only with a token
    server -> client   AuthOk()                                            only with a token

    proof = HMAC-SHA256(token, label || client_nonce || server_nonce || version)

with a different label per direction, so one side's proof can never be reflected back as the other's. Both nonces
are fresh per connection (the caller passes `secrets.token_bytes(NONCE_SIZE)`), so a recorded handshake replayed on
a new connection fails on whichever side it is replayed to. The token itself never travels. A fleet token should be
high-entropy: a proof is an offline guessing oracle for whoever observes it.
"""
from __future__ import annotations

import hashlib
import hmac

from .codec import MAX_VERSION, MIN_VERSION
from .errors import AuthError, ErrorCode
from .events import NONCE_SIZE, AuthOk, AuthProof, Error, Event, Hello, Welcome

SERVER_LABEL = b"mesh-auth-v1 server\x00"
CLIENT_LABEL = b"mesh-auth-v1 client\x00"


def proof(token: bytes, label: bytes, client_nonce: bytes, server_nonce: bytes, version: int) -> bytes:
    return hmac.new(token, label + client_nonce + server_nonce + bytes([version]), hashlib.sha256).digest()


def _check_token(token: bytes | None) -> bytes | None:
    if token is not None and (not isinstance(token, bytes) or not token):
        raise ValueError("a fleet token must be non-empty bytes, or None for an open fleet")
    return token


def _check_nonce(nonce: bytes, whose: str) -> None:
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_SIZE:
        raise ValueError(f"{whose} nonce must be {NONCE_SIZE} bytes")


def _peer_error(event: Error) -> AuthError:
    return AuthError(event.code, f"peer refused the handshake: {event.reason}")


class ClientHandshake:
    """The dialing side. `start()` gives the Hello; feed each received event to `receive()`, send what it returns,
    until `done`. Raises AuthError (whose code/reason go into an Error to the peer, unless the peer sent Error)."""

    def __init__(self, token: bytes | None, nonce: bytes, *, min_version: int = MIN_VERSION,
                 max_version: int = MAX_VERSION) -> None:
        self.token = _check_token(token)
        _check_nonce(nonce, "client")
        self.nonce = nonce
        self.min_version, self.max_version = min_version, max_version
        self.version: int | None = None
        self.done = False
        self._state = "start"

    def start(self) -> Hello:
        if self._state != "start":
            raise RuntimeError("ClientHandshake.start() called twice")
        self._state = "welcome"
        return Hello(self.min_version, self.max_version, self.nonce, self.token is not None)

    def receive(self, event: Event) -> list[Event]:
        if isinstance(event, Error):
            self._state = "failed"
            raise _peer_error(event)
        if self._state == "welcome" and isinstance(event, Welcome):
            return self._on_welcome(event)
        if self._state == "auth_ok" and isinstance(event, AuthOk):
            self._state, self.done = "done", True
            return []
        raise self._fail(ErrorCode.UNEXPECTED, f"unexpected {type(event).__name__} during the handshake "
                                               f"(waiting for {'Welcome' if self._state == 'welcome' else 'AuthOk'})")

    def _fail(self, code: ErrorCode, reason: str) -> AuthError:
        self._state = "failed"
        return AuthError(code, reason)

    def _on_welcome(self, w: Welcome) -> list[Event]:
        if not self.min_version <= w.version <= self.max_version:
            raise self._fail(ErrorCode.UNSUPPORTED_VERSION,
                             f"server chose version {w.version}, client speaks {self.min_version}..{self.max_version}")
        if len(w.nonce) != NONCE_SIZE:
            raise self._fail(ErrorCode.MALFORMED, f"server nonce is {len(w.nonce)} bytes, want {NONCE_SIZE}")
        self.version = w.version
        if self.token is None:
            if w.proof:
                raise self._fail(ErrorCode.AUTH_REQUIRED, "peer requires a fleet token and none is configured here")
            self._state, self.done = "done", True
            return []
        if not w.proof:
            raise self._fail(ErrorCode.AUTH_FAILED,
                             "a fleet token is configured here but the peer has none (it sent no proof)")
        want = proof(self.token, SERVER_LABEL, self.nonce, w.nonce, w.version)
        if not hmac.compare_digest(want, w.proof):
            raise self._fail(ErrorCode.AUTH_FAILED, "fleet token mismatch (the server's proof does not verify)")
        self._state = "auth_ok"
        return [AuthProof(proof(self.token, CLIENT_LABEL, self.nonce, w.nonce, w.version))]


class ServerHandshake:
    """The accepting side. Feed received events to `receive()`, send what it returns, until `done`."""

    def __init__(self, token: bytes | None, nonce: bytes, *, min_version: int = MIN_VERSION,
                 max_version: int = MAX_VERSION) -> None:
        self.token = _check_token(token)
        _check_nonce(nonce, "server")
        self.nonce = nonce
        self.min_version, self.max_version = min_version, max_version
        self.version: int | None = None
        self.done = False
        self._client_nonce = b""
        self._state = "hello"

    def _fail(self, code: ErrorCode, reason: str) -> AuthError:
        self._state = "failed"
        return AuthError(code, reason)

    def receive(self, event: Event) -> list[Event]:
        if isinstance(event, Error):
            self._state = "failed"
            raise _peer_error(event)
        if self._state == "hello":
            if not isinstance(event, Hello):
                code = ErrorCode.AUTH_REQUIRED if self.token is not None else ErrorCode.UNEXPECTED
                raise self._fail(code, f"the first message must be Hello, got {type(event).__name__}")
            return self._on_hello(event)
        if self._state == "proof" and isinstance(event, AuthProof):
            want = proof(self.token, CLIENT_LABEL, self._client_nonce, self.nonce, self.version)
            if not hmac.compare_digest(want, event.proof):
                raise self._fail(ErrorCode.AUTH_FAILED, "fleet token mismatch (the client's proof does not verify)")
            self._state, self.done = "done", True
            return [AuthOk()]
        raise self._fail(ErrorCode.AUTH_REQUIRED if self._state == "proof" else ErrorCode.UNEXPECTED,
                         f"unexpected {type(event).__name__} during the handshake")

    def _on_hello(self, h: Hello) -> list[Event]:
        low, high = max(h.min_version, self.min_version), min(h.max_version, self.max_version)
        if low > high:
            raise self._fail(ErrorCode.UNSUPPORTED_VERSION,
                             f"no common version: client speaks {h.min_version}..{h.max_version}, "
                             f"server {self.min_version}..{self.max_version}")
        if len(h.nonce) != NONCE_SIZE:
            raise self._fail(ErrorCode.MALFORMED, f"client nonce is {len(h.nonce)} bytes, want {NONCE_SIZE}")
        self.version = high
        self._client_nonce = h.nonce
        if self.token is None:
            if h.auth:
                raise self._fail(ErrorCode.AUTH_FAILED,
                                 "the client has a fleet token but this peer has none configured")
            self._state, self.done = "done", True
            return [Welcome(high, self.nonce, b"")]
        if not h.auth:
            raise self._fail(ErrorCode.AUTH_REQUIRED, "peer requires a fleet token and the client offered none")
        self._state = "proof"
        return [Welcome(high, self.nonce, proof(self.token, SERVER_LABEL, h.nonce, self.nonce, high))]
