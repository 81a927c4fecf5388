"""Sealed frames: the key schedule of a connection and the AEAD that wraps every frame after the handshake.

After Hello and Welcome (which travel in the clear and carry each side's nonce and X25519 public key), every frame
in both directions is sealed with ChaCha20-Poly1305:

    header   = version:u8  SEALED:u8  flags=0:u16  length:u32        (length = 1 + payload + 16)
    sealed   = AEAD(key of this direction, nonce = frame counter, aad = header, type:u8 || payload) || tag:16

The counter starts at 0 in each direction and goes up by one per frame, so a reordered, replayed, dropped or
altered frame fails to open and the link ends. The inner type byte is inside the ciphertext: an observer sees only
frame lengths and timing, not which messages cross.

Key schedule (all HKDF-SHA256 from `cryptography`):

    transcript = "mesh-link-v2" || version || client_nonce || server_nonce || client_pub || server_pub
    secret     = HKDF(ikm = X25519(own, peer) || token, salt = SHA-256(transcript), info = "mesh-link-v2 keys")
               -> client proof key, server proof key, client->server key, server->client key (32 bytes each)

The fleet token authenticates; the ephemeral X25519 secret makes the keys unknowable to whoever only watches the
wire (so a captured run is no offline oracle for the token, and a token learned later decrypts no old capture),
and gives an open fleet (no token) encryption against passive observers. NOTES.md "Wire protocol" says why.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import ErrorCode, ProtocolError

KEY_SIZE = 32
TAG_SIZE = 16
SEAL_OVERHEAD = 1 + TAG_SIZE
"""Bytes a sealed frame's payload carries beyond the plain payload: the inner type byte and the tag."""
_LABEL = b"mesh-link-v2"
_NONCE = struct.Struct("<4xQ")   # 96-bit AEAD nonce: four zero bytes, then the 64-bit frame counter


@dataclass(frozen=True, slots=True)
class LinkKeys:
    """What one handshake derives. `send`/`receive` are this side's direction keys."""

    client_proof: bytes
    server_proof: bytes
    send: bytes
    receive: bytes


def public_bytes(private: X25519PrivateKey) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    return private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def derive_keys(*, client: bool, private: X25519PrivateKey, peer_public: bytes, token: bytes | None, version: int,
                client_nonce: bytes, server_nonce: bytes, client_pub: bytes, server_pub: bytes) -> LinkKeys:
    """The four keys of one connection. Raises ProtocolError(MALFORMED) for an unusable peer key."""
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:  # a wrong-sized key, or a low-order point (the all-zero shared secret)
        raise ProtocolError(ErrorCode.MALFORMED, f"the peer's X25519 key is unusable: {exc}") from None
    transcript = _LABEL + bytes([version]) + client_nonce + server_nonce + client_pub + server_pub
    okm = HKDF(algorithm=hashes.SHA256(), length=4 * KEY_SIZE, salt=hashlib.sha256(transcript).digest(),
               info=_LABEL + b" keys").derive(shared + (token or b""))
    cp, sp, c2s, s2c = (okm[i:i + KEY_SIZE] for i in range(0, 4 * KEY_SIZE, KEY_SIZE))
    return LinkKeys(cp, sp, c2s if client else s2c, s2c if client else c2s)


def prove(key: bytes, label: bytes) -> bytes:
    return hmac.new(key, label, hashlib.sha256).digest()


def verify(key: bytes, label: bytes, proof: bytes) -> bool:
    return hmac.compare_digest(prove(key, label), proof)


class Sealer:
    """One direction's AEAD state: the key and the next frame counter. Used by the Codec, one per direction."""

    __slots__ = ("_aead", "counter")

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_SIZE:
            raise ValueError(f"a link key is {KEY_SIZE} bytes, got {len(key)}")
        self._aead = ChaCha20Poly1305(key)
        self.counter = 0

    def seal(self, header: bytes, plain: bytes) -> bytes:
        nonce = _NONCE.pack(self.counter)
        self.counter += 1
        return self._aead.encrypt(nonce, plain, header)

    def open(self, header: bytes | memoryview, sealed: memoryview) -> bytes:
        """The plaintext of the next frame. ProtocolError(AUTH_FAILED) if it is not the next frame the peer sealed
        with this key (altered, replayed, reordered, or sealed with another token's key)."""
        nonce = _NONCE.pack(self.counter)
        try:
            plain = self._aead.decrypt(nonce, sealed, header)
        except InvalidTag:
            raise ProtocolError(ErrorCode.AUTH_FAILED,
                                f"sealed frame {self.counter} does not open: altered, replayed or reordered, "
                                f"or sealed with another fleet token") from None
        self.counter += 1
        return plain
