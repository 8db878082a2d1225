"""The relay's control-plane wire messages (gossip over libp2p); bulk bytes never travel here.

- `ManifestAnnounce` (topic `relay/v1/manifests`): carries a manifest frame exactly as the
  trainer signed it. Receivers believe it only after `relay.manifest.open_manifest` checks the
  signature against their trusted publishers; the gossip sender is not trusted for anything.
- `Holding` (topic `relay/v1/holding`): "I hold every chunk of these versions", sent once a
  peer has verified all of a version (never earlier) and repeated every `announce_interval_s`,
  so restarted and late peers learn where complete copies live.
- `HaveChunks` (direct, to swarm neighbours; the "swarm" layout only): which chunks of a version
  the sender holds so far, as a bitmap.

Chunk bytes go over the data plane (`relay.role`, channel `relay/chunks`), whose request and
response headers are the small fixed structs at the bottom of this module (not wire messages:
the data plane needs no signatures, every chunk is hashed against the signed manifest).

Each body is a frozen dataclass registered with the one codec (`p2pnet.wire`); invariants are
checked in `__post_init__`, so a decoded body is always a valid one.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from p2pnet.wire import MAX_FRAME_BYTES, message
from relay.manifest import DIGEST_BYTES, MAX_MANIFEST_BYTES

MANIFEST_TOPIC = "relay/v1/manifests"
HOLDING_TOPIC = "relay/v1/holding"
MAX_HELD_VERSIONS = 16
MAX_ANNOUNCED_FRAME_BYTES = min(MAX_MANIFEST_BYTES, MAX_FRAME_BYTES - 1024)  # room for the envelope


@message("relay/announce", max_bytes=MAX_FRAME_BYTES)
@dataclass(frozen=True, slots=True)
class ManifestAnnounce:
    """A signed manifest frame, forwarded verbatim. Checked by the receiver, never trusted."""

    frame: bytes

    def __post_init__(self) -> None:
        if not 0 < len(self.frame) <= MAX_ANNOUNCED_FRAME_BYTES:
            raise ValueError(f"manifest frame must have 1 to {MAX_ANNOUNCED_FRAME_BYTES} bytes")


@dataclass(frozen=True, slots=True)
class HeldVersion:
    """One complete version: its number and the blake3 id of its manifest frame."""

    version: int
    manifest_id: bytes

    def __post_init__(self) -> None:
        if self.version < 0:
            raise ValueError("version must be >= 0")
        if len(self.manifest_id) != DIGEST_BYTES:
            raise ValueError(f"manifest_id must have {DIGEST_BYTES} bytes")


@message("relay/holding", max_bytes=4096)
@dataclass(frozen=True, slots=True)
class Holding:
    """The sender holds, verified, every chunk of each listed version (at most 16, no repeats)."""

    versions: tuple[HeldVersion, ...]

    def __post_init__(self) -> None:
        if not 0 < len(self.versions) <= MAX_HELD_VERSIONS:
            raise ValueError(f"list 1 to {MAX_HELD_VERSIONS} versions")
        if len({v.version for v in self.versions}) != len(self.versions):
            raise ValueError("a version is listed twice")


MAX_HAVE_BITMAP_BYTES = 16 * 1024  # 131,072 chunks: more than a 4 MiB manifest can list


@message("relay/have", max_bytes=2 * MAX_HAVE_BITMAP_BYTES)
@dataclass(frozen=True, slots=True)
class HaveChunks:
    """The sender holds, verified, the chunks of `version` whose bits are set in `bitmap` (chunk
    i is bit i % 8 of byte i // 8). Sent directly to the sender's swarm neighbours (layout
    "swarm" only, see `relay.swarm`), whole each time, so a lost or late one is made good by the
    next. A claim to hold a chunk is never trusted further than a request: chunks are hashed."""

    version: int
    manifest_id: bytes
    bitmap: bytes

    def __post_init__(self) -> None:
        if self.version < 0:
            raise ValueError("version must be >= 0")
        if len(self.manifest_id) != DIGEST_BYTES:
            raise ValueError(f"manifest_id must have {DIGEST_BYTES} bytes")
        if len(self.bitmap) > MAX_HAVE_BITMAP_BYTES:
            raise ValueError(f"bitmap of more than {MAX_HAVE_BITMAP_BYTES} bytes")


# -- data plane headers (channel relay/chunks) ----------------------------------------------
#
# Client -> server, one frame per request (pipelined, any number outstanding):
#     REQUEST = op u8 | request id u32 | version u64 | index u32 | digest 32 bytes
# Server -> client, per request, in any order (responses are never interleaved):
#     frame(RESPONSE = request id u32 | status u8 | length u64 | queued us u32) then, when
#     status is OK, exactly `length` raw bytes (no frame: the length is in the header).
#     `queued us`: microseconds the request waited for an upload slot after the server held the
#     chunk (its queue, not the long poll); the requester adds it to the time the bytes took,
#     so a server with more requesters than its upload can feed is timed as slow as it is.
# OP_MANIFEST asks for the signed manifest frame of `version` (digest is ignored, zeros).

OP_CHUNK = 1
OP_MANIFEST = 2
STATUS_OK = 0
STATUS_UNAVAILABLE = 1  # not held, and did not arrive within the server's wait limit
STATUS_BUSY = 2  # the server is shutting down or refusing this request

REQUEST = struct.Struct(">BIQI32s")
RESPONSE = struct.Struct(">IBQI")
MAX_QUEUED_US = 2**32 - 1


@dataclass(frozen=True, slots=True)
class ChunkRequest:
    op: int
    request_id: int
    version: int
    index: int
    digest: bytes

    def pack(self) -> bytes:
        return REQUEST.pack(self.op, self.request_id, self.version, self.index, self.digest)

    @classmethod
    def unpack(cls, data: bytes) -> ChunkRequest:
        """Parse a request frame; raises ValueError for anything malformed."""
        if len(data) != REQUEST.size:
            raise ValueError(f"request of {len(data)} bytes, want {REQUEST.size}")
        op, request_id, version, index, digest = REQUEST.unpack(data)
        if op not in (OP_CHUNK, OP_MANIFEST):
            raise ValueError(f"unknown op {op}")
        return cls(op, request_id, version, index, digest)


@dataclass(frozen=True, slots=True)
class ChunkResponse:
    request_id: int
    status: int
    length: int
    queued_us: int = 0

    @property
    def queued_s(self) -> float:
        return self.queued_us / 1e6

    def pack(self) -> bytes:
        return RESPONSE.pack(self.request_id, self.status, self.length, self.queued_us)

    @classmethod
    def unpack(cls, data: bytes) -> ChunkResponse:
        if len(data) != RESPONSE.size:
            raise ValueError(f"response header of {len(data)} bytes, want {RESPONSE.size}")
        return cls(*RESPONSE.unpack(data))
