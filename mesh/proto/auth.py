"""The connection handshake: version negotiation, an ephemeral key exchange and fleet-token authentication, sans-IO.

    client -> server   Hello(min_version, max_version, client_nonce, client_pub, auth)      in the clear
    server -> client   Welcome(version, server_nonce, server_pub)                           in the clear
    client -> server   AuthProof(client_proof)          sealed; only with a token           the client proves first
    server -> client   AuthOk(server_proof)             sealed; only with a token

Both sides derive the connection's keys from the X25519 exchange, the token and the transcript (`seal.derive_keys`);
every frame after Welcome is sealed with them. A proof is an HMAC under a key derived from that secret, one key per
direction, so a proof cannot be reflected, and a recorded handshake replayed on a new connection meets fresh nonces
and a fresh key exchange. The token itself never travels.

The party that connects proves first, and the server sends nothing sealed before the client's proof verified: a
stranger that dials in gets a nonce and a public key, nothing it could test token guesses against. Someone who only
watches the wire cannot compute the exchanged secret, so a captured handshake is no oracle either. What remains is
the party being dialed: whoever answers a peer's dial learns the peer's proof; peers dial only the coordinator the
user named and the addresses that authenticated coordinator hands out.
"""
from __future__ import annotations

import os

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from .codec import MAX_VERSION, MIN_VERSION
from .errors import AuthError, ErrorCode, ProtocolError
from .events import NONCE_SIZE, AuthOk, AuthProof, Error, Event, Hello, Welcome
from .seal import KEY_SIZE, LinkKeys, derive_keys, prove, public_bytes, verify

CLIENT_LABEL = b"mesh-auth-v2 client proof"
SERVER_LABEL = b"mesh-auth-v2 server proof"
PUBLIC_KEY_SIZE = 32


def _check_token(token: bytes | None) -> bytes | None:
    if token is not None and (not isinstance(token, bytes) or not token):
        raise ValueError("a fleet token must be non-empty bytes, or None for an open fleet")
    return token


def _check_nonce(nonce: bytes, whose: str) -> None:
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_SIZE:
        raise ValueError(f"{whose} nonce must be {NONCE_SIZE} bytes")


def _private(secret: bytes | None) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(secret if secret is not None else os.urandom(KEY_SIZE))


def _peer_error(event: Error) -> AuthError:
    return AuthError(event.code, f"peer refused the handshake: {event.reason}")


def _derive(**kw) -> LinkKeys:
    try:
        return derive_keys(**kw)
    except ProtocolError as exc:
        raise AuthError(exc.code, exc.reason) from None


class ClientHandshake:
    """The dialing side. `start()` gives the Hello; feed each received event to `receive()`, send what it returns,
    until `done`. `keys` is set once Welcome arrived: from then on both directions are sealed. Raises AuthError
    (whose code/reason go into an Error to the peer, unless the peer sent Error)."""

    def __init__(self, token: bytes | None, nonce: bytes, *, secret: bytes | None = None,
                 min_version: int = MIN_VERSION, max_version: int = MAX_VERSION) -> None:
        self.token = _check_token(token)
        _check_nonce(nonce, "client")
        self.nonce = nonce
        self._private = _private(secret)
        self.public = public_bytes(self._private)
        self.min_version, self.max_version = min_version, max_version
        self.version: int | None = None
        self.keys: LinkKeys | None = None
        self.done = False
        self._state = "start"

    def start(self) -> Hello:
        if self._state != "start":
            raise RuntimeError("ClientHandshake.start() called twice")
        self._state = "welcome"
        return Hello(self.min_version, self.max_version, self.nonce, self.public, self.token is not None)

    def receive(self, event: Event) -> list[Event]:
        if isinstance(event, Error):
            self._state = "failed"
            raise _peer_error(event)
        if self._state == "welcome" and isinstance(event, Welcome):
            return self._on_welcome(event)
        if self._state == "auth_ok" and isinstance(event, AuthOk):
            assert self.keys is not None
            if not verify(self.keys.server_proof, SERVER_LABEL, event.proof):
                raise self._fail(ErrorCode.AUTH_FAILED, "fleet token mismatch (the server's proof does not verify)")
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
        if len(w.public_key) != PUBLIC_KEY_SIZE:
            raise self._fail(ErrorCode.MALFORMED, f"server key is {len(w.public_key)} bytes, want {PUBLIC_KEY_SIZE}")
        self.version = w.version
        self.keys = _derive(client=True, private=self._private, peer_public=w.public_key, token=self.token,
                            version=w.version, client_nonce=self.nonce, server_nonce=w.nonce, client_pub=self.public,
                            server_pub=w.public_key)
        if self.token is None:
            self._state, self.done = "done", True
            return []
        self._state = "auth_ok"
        return [AuthProof(prove(self.keys.client_proof, CLIENT_LABEL))]


class ServerHandshake:
    """The accepting side. Feed received events to `receive()`, send what it returns, until `done`. `keys` is set
    once the Welcome is made: the Welcome itself goes out in the clear, everything after it sealed."""

    def __init__(self, token: bytes | None, nonce: bytes, *, secret: bytes | None = None,
                 min_version: int = MIN_VERSION, max_version: int = MAX_VERSION) -> None:
        self.token = _check_token(token)
        _check_nonce(nonce, "server")
        self.nonce = nonce
        self._private = _private(secret)
        self.public = public_bytes(self._private)
        self.min_version, self.max_version = min_version, max_version
        self.version: int | None = None
        self.keys: LinkKeys | None = None
        self.done = False
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
            assert self.keys is not None
            if not verify(self.keys.client_proof, CLIENT_LABEL, event.proof):
                raise self._fail(ErrorCode.AUTH_FAILED, "fleet token mismatch (the client's proof does not verify)")
            self._state, self.done = "done", True
            return [AuthOk(prove(self.keys.server_proof, SERVER_LABEL))]
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
        if len(h.public_key) != PUBLIC_KEY_SIZE:
            raise self._fail(ErrorCode.MALFORMED, f"client key is {len(h.public_key)} bytes, want {PUBLIC_KEY_SIZE}")
        if self.token is None and h.auth:
            raise self._fail(ErrorCode.AUTH_FAILED, "the client has a fleet token but this peer has none configured")
        if self.token is not None and not h.auth:
            raise self._fail(ErrorCode.AUTH_REQUIRED, "peer requires a fleet token and the client offered none")
        self.version = high
        self.keys = _derive(client=False, private=self._private, peer_public=h.public_key, token=self.token,
                            version=high, client_nonce=h.nonce, server_nonce=self.nonce, client_pub=h.public_key,
                            server_pub=self.public)
        if self.token is None:
            self._state, self.done = "done", True
        else:
            self._state = "proof"
        return [Welcome(high, self.nonce, self.public)]
