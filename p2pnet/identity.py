"""Peer identity: one Ed25519 key per peer, kept in the data directory, and the peer id.

The key file `identity.key` holds the 32-byte Ed25519 seed, mode 0600, written atomically on
first start and reused afterwards. The peer id is derived exactly as libp2p derives it for
Ed25519 keys (identity multihash of the protobuf-encoded public key, base58btc), so the same
key is both the libp2p host identity and the signer of every p2pnet message.

This module must not do any network I/O.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import base58
import nacl.exceptions
import nacl.signing

from p2pnet.errors import LocalStateError, MessageRejected
from p2pnet.files import atomic_write_bytes

KEY_FILE = "identity.key"
SEED_BYTES = 32
# identity multihash (0x00, length 36) of protobuf PublicKey{type: Ed25519 (1), data: 32 bytes}
_PEER_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
PEER_ID_BYTES = len(_PEER_ID_PREFIX) + 32


def peer_id_bytes_from_public_key(public_key: bytes) -> bytes:
    if len(public_key) != 32:
        raise ValueError(f"an Ed25519 public key has 32 bytes, got {len(public_key)}")
    return _PEER_ID_PREFIX + public_key


PEER_TEXT_CACHED = 4096  # peer ids whose base58 text is remembered (far more than a table holds)


def peer_id_to_str(peer_id: bytes) -> str:
    """The base58 text of a peer id, the same for bytes, bytearray and memoryview.

    Every gossiped frame names its sender, and the frame is checked before GossipSub forwards
    it and decoded after: each step wants the sender as text, for every copy. Base58 of a
    38-byte id is a big-number loop in Python (about 2.5% of an idle peer's interpreter time,
    measured with py-spy), so the text of the last `PEER_TEXT_CACHED` ids is remembered."""
    return _base58_text(bytes(peer_id))


@functools.lru_cache(maxsize=PEER_TEXT_CACHED)
def _base58_text(peer_id: bytes) -> str:
    return base58.b58encode(peer_id).decode("ascii")


def peer_id_from_str(text: str) -> bytes:
    """Parse a base58 peer id; raises ValueError when it is not an Ed25519 peer id."""
    try:
        raw = base58.b58decode(text)
    except ValueError as exc:
        raise ValueError(f"not a base58 peer id: {text!r}") from exc
    public_key_from_peer_id(raw)
    return raw


def public_key_from_peer_id(peer_id: bytes) -> bytes:
    """The Ed25519 public key inlined in an Ed25519 peer id; ValueError for anything else."""
    if len(peer_id) != PEER_ID_BYTES or not peer_id.startswith(_PEER_ID_PREFIX):
        raise ValueError("not an Ed25519 identity peer id")
    return peer_id[len(_PEER_ID_PREFIX):]


class SignatureChecker:
    """Verifies Ed25519 signatures by peer id, caching the parsed public keys.

    It also remembers the last `max_recent` checks that passed, as (peer id, SHA-256 of the
    payload, signature): a gossiped frame is checked once before GossipSub forwards it and again
    when it is decoded, and the second check of the same bytes is then a hash and a lookup
    instead of an Ed25519 verification. Only exact repeats of a passed check pass this way.
    Not thread-safe (the memory's eviction): each instance is used from one trio thread."""

    def __init__(self, max_cached: int = 100_000, max_recent: int = 256) -> None:
        self._keys: dict[bytes, nacl.signing.VerifyKey] = {}
        self._max_cached = max_cached
        self._recent: dict[tuple[bytes, bytes, bytes], None] = {}
        self._max_recent = max_recent

    def verify(self, peer_id: bytes, payload: bytes, signature: bytes) -> None:
        """Raise MessageRejected('bad_signature') unless `signature` is peer_id's over payload."""
        seen = (peer_id, hashlib.sha256(payload).digest(), bytes(signature))
        if seen in self._recent:
            return
        self._check(peer_id, payload, signature)
        if len(self._recent) >= self._max_recent:
            del self._recent[next(iter(self._recent))]  # the oldest
        self._recent[seen] = None

    def _check(self, peer_id: bytes, payload: bytes, signature: bytes) -> None:
        key = self._keys.get(peer_id)
        if key is None:
            try:
                key = nacl.signing.VerifyKey(public_key_from_peer_id(peer_id))
            except (ValueError, nacl.exceptions.CryptoError) as exc:
                raise MessageRejected("bad_sender", str(exc)) from exc
            if len(self._keys) >= self._max_cached:
                self._keys.clear()
            self._keys[peer_id] = key
        try:
            key.verify(payload, signature)
        except (nacl.exceptions.BadSignatureError, ValueError) as exc:
            raise MessageRejected("bad_signature", "signature does not match sender") from exc


@dataclass(frozen=True)
class Identity:
    """A peer's signing key and the peer id derived from it."""

    seed: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.seed) != SEED_BYTES:
            raise ValueError(f"an Ed25519 seed has {SEED_BYTES} bytes, got {len(self.seed)}")
        signing = nacl.signing.SigningKey(self.seed)
        object.__setattr__(self, "_signing", signing)
        object.__setattr__(self, "public_key", bytes(signing.verify_key))
        object.__setattr__(self, "_peer_id_bytes", peer_id_bytes_from_public_key(self.public_key))  # type: ignore[attr-defined]
        object.__setattr__(self, "_peer_id", peer_id_to_str(self._peer_id_bytes))  # type: ignore[attr-defined]

    @classmethod
    def generate(cls) -> Identity:
        return cls(os.urandom(SEED_BYTES))

    @classmethod
    def from_seed_text(cls, text: str) -> Identity:
        """A deterministic identity from any text (tests and simulations only)."""
        import blake3

        return cls(blake3.blake3(text.encode()).digest()[:SEED_BYTES])

    @property
    def peer_id_bytes(self) -> bytes:
        return self._peer_id_bytes  # type: ignore[attr-defined]

    @property
    def peer_id(self) -> str:
        """Derived once, when the identity is made: the node reads it for every frame it takes in."""
        return self._peer_id  # type: ignore[attr-defined]

    def sign(self, payload: bytes) -> bytes:
        return self._signing.sign(payload).signature  # type: ignore[attr-defined]

    def libp2p_key_pair(self):  # -> libp2p.crypto.keys.KeyPair
        """The same key as a libp2p KeyPair, for the host (imported lazily: libp2p is heavy)."""
        from libp2p.crypto.ed25519 import Ed25519PrivateKey
        from libp2p.crypto.keys import KeyPair

        private = Ed25519PrivateKey.from_bytes(self.seed)
        return KeyPair(private, private.get_public_key())


def ensure_data_dir(data_dir: Path) -> None:
    """Create `data_dir` (and its parents) if missing; LocalStateError, naming it, when it cannot
    be created, is not a directory, or is not writable by us."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise LocalStateError(f"data directory {data_dir} is not a directory; choose another --data-dir") from None
    except OSError as exc:
        raise LocalStateError(f"cannot create data directory {data_dir}: {exc.strerror or exc}") from exc
    if not data_dir.is_dir():
        raise LocalStateError(f"data directory {data_dir} is not a directory; choose another --data-dir")
    if not os.access(data_dir, os.W_OK | os.X_OK):
        raise LocalStateError(f"data directory {data_dir} is not writable by this user; fix its permissions "
                              "or choose another --data-dir")


def load_or_create_identity(data_dir: Path) -> Identity:
    """The peer's identity from `data_dir/identity.key`, created (mode 0600) when missing."""
    ensure_data_dir(data_dir)
    path = data_dir / KEY_FILE
    if path.exists() or path.is_symlink():
        try:
            seed = path.read_bytes()
        except OSError as exc:
            raise LocalStateError(f"cannot read the identity key {path}: {exc.strerror or exc}; fix its "
                                  "permissions, or restore it from a backup") from exc
        if len(seed) != SEED_BYTES:
            raise LocalStateError(
                f"{path} holds {len(seed)} bytes, not a {SEED_BYTES}-byte Ed25519 seed; "
                "restore it from a backup or remove it to create a new identity"
            )
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
        return Identity(seed)
    identity = Identity.generate()
    try:
        atomic_write_bytes(path, identity.seed, mode=0o600)
    except OSError as exc:
        raise LocalStateError(f"cannot write the identity key {path}: {exc.strerror or exc}") from exc
    return identity
