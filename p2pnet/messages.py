"""Wire messages of the peer itself: heartbeats that feed every peer table.

Each body is a frozen dataclass registered with the one codec (`p2pnet.wire`); its invariants
are checked in `__post_init__`, so a decoded body is always a valid one.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pnet.wire import message

HEARTBEAT_TOPIC = "p2pnet/v1/heartbeat"
MAX_ROLES = 16
MAX_ADDRS = 16
ROLE_NAMES = ("relay", "worker", "validator", "trainer")


@dataclass(frozen=True, slots=True)
class Capacity:
    """What a peer advertises it can give: upload bandwidth and free disk."""

    upload_bps: int
    download_bps: int
    free_disk_bytes: int

    def __post_init__(self) -> None:
        for name in ("upload_bps", "download_bps", "free_disk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


@message("heartbeat", max_bytes=4096)
@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A peer is alive, reachable at `addrs` (libp2p) and `data_addr` (host:port, direct TCP).

    `seq` increases with every heartbeat of one run; `started_ms` tells runs apart.
    """

    seq: int
    started_ms: int
    addrs: tuple[str, ...]
    data_addr: str
    roles: tuple[str, ...]
    capacity: Capacity

    def __post_init__(self) -> None:
        if self.seq < 0:
            raise ValueError("seq must be >= 0")
        if len(self.addrs) > MAX_ADDRS or any(len(a) > 256 for a in self.addrs):
            raise ValueError("too many or too long addrs")
        if len(self.roles) > MAX_ROLES or any(len(r) > 32 for r in self.roles):
            raise ValueError("too many or too long roles")
        if len(self.data_addr) > 256:
            raise ValueError("data_addr too long")
