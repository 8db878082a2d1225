"""The errors relay raises, named by who is at fault (subclasses of p2pnet's few errors).

- `ManifestRejected`: the publisher's (or forwarder's) fault: an unknown or bad signer, a
  malformed or inconsistent manifest, a conflicting manifest for a version we already hold.
- `ChunkCorrupt`: the sending peer's fault: the bytes do not hash to the digest asked for.
- `VersionUnloadable`: the publisher's fault: a version whose every chunk verified, but whose
  files do not load (safetensors refuses them, or their tensors do not fit the model).
- `NotSafetensors`: the user's fault: a file given to publish is not a safetensors file.
- `StoreFull`: ours: the disk budget or the disk itself is exhausted.
- `ChunkMissing`: ours: a chunk is not (or no longer) held; a chunk found rotten is deleted.
- `VersionUnknown` / `VersionIncomplete`: ours: asked for a version we do not hold in full.
- `AddressUnknown`: nobody's yet: a source's heartbeat (its data address) has not reached us.

This module must not import anything but p2pnet.errors.
"""

from __future__ import annotations

from p2pnet.errors import ConfigError, LocalStateError, MessageRejected, PeerUnavailable


class ManifestRejected(MessageRejected):
    """A manifest frame we will not believe; `reason` is a short stable code."""


class ChunkCorrupt(MessageRejected):
    """A chunk's bytes do not hash to its digest; `sender`, when known, is the peer at fault."""

    def __init__(self, digest: bytes, detail: str = "", sender: str | None = None) -> None:
        super().__init__("chunk_corrupt", detail or f"chunk {digest.hex()[:16]} does not match its digest", sender)
        self.digest = digest


class VersionUnloadable(MessageRejected):
    """A complete, verified version that does not load; `sender` is its publisher."""

    def __init__(self, version: int, detail: str, sender: str | None = None) -> None:
        super().__init__("unloadable", f"checkpoint version {version}: {detail}", sender)
        self.version = version


class NotSafetensors(ConfigError):
    """A file given to publish is not a well-formed safetensors file."""

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(str(path), f"not a safetensors file: {problem}")


class StoreFull(LocalStateError):
    """Writing would exceed the store's byte budget, or the disk is full; nothing was written."""


class ChunkMissing(LocalStateError, LookupError):
    """The store does not hold this chunk (or held a rotten copy, now deleted)."""


class VersionUnknown(LocalStateError, LookupError):
    """No manifest for this checkpoint version is held."""


class VersionIncomplete(LocalStateError):
    """The manifest of this version is held but some of its chunks are not yet."""


class AddressUnknown(PeerUnavailable):
    """No data address is known for a source we heard of (a `Holding`, the manifest's
    publisher) before its heartbeat reached our peer table, not even after waiting for it: nobody
    is at fault yet (heartbeats come up to the peer table's `max_interval_s` apart, and more
    while busy). The transfer core is told `no_address` and asks again soon."""
