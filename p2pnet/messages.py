"""Wire messages of the peer itself: heartbeats that feed every peer table.

Each body is a frozen dataclass registered with the one codec (`p2pnet.wire`); its invariants
are checked in `__post_init__`, so a decoded body is always a valid one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from p2pnet.wire import message

HEARTBEAT_TOPIC = "p2pnet/v1/heartbeat"
MAX_ROLES = 16
MAX_ADDRS = 16
MAX_NAME_CHARS = 64
MAX_HEARTBEAT_INTERVAL_MS = 86_400_000  # a day: the longest spacing a heartbeat may declare
ROLE_NAMES = ("relay", "worker", "validator", "trainer", "diloco")


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

    `seq` increases with every heartbeat of one run; `started_ms` tells runs apart. `name` is
    an optional display name the operator chose (at most `MAX_NAME_CHARS` printable characters),
    shown beside the peer id and never counted for anything.
    `interval_ms` is the sender's promise: its next heartbeat comes within this many ms unless it
    stops (0: not declared; at most `MAX_HEARTBEAT_INTERVAL_MS`). Receivers derive from it how
    long it may stay silent before they forget it, clamped by their own cap
    (`p2pnet.peertable`).
    `reachable` is what dial-back checks by other peers found (`p2pnet.reachability`): True
    when others can dial both its data plane and its libp2p address, False when one of them
    cannot be dialled (behind NAT, a firewall), None while unknown. Only reachable peers are
    ever asked to serve others.
    """

    seq: int
    started_ms: int
    addrs: tuple[str, ...]
    data_addr: str
    roles: tuple[str, ...]
    capacity: Capacity
    reachable: bool | None = None
    name: str = ""
    interval_ms: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.interval_ms <= MAX_HEARTBEAT_INTERVAL_MS:
            raise ValueError(f"interval_ms must be in 0..{MAX_HEARTBEAT_INTERVAL_MS}")
        if len(self.name) > MAX_NAME_CHARS or not self.name.isprintable():
            raise ValueError(f"name must be at most {MAX_NAME_CHARS} printable characters")
        if self.seq < 0:
            raise ValueError("seq must be >= 0")
        if len(self.addrs) > MAX_ADDRS or any(len(a) > 256 for a in self.addrs):
            raise ValueError("too many or too long addrs")
        if len(self.roles) > MAX_ROLES or any(len(r) > 32 for r in self.roles):
            raise ValueError("too many or too long roles")
        if len(self.data_addr) > 256:
            raise ValueError("data_addr too long")


class DialResult(IntEnum):
    """The outcome of one dial-back attempt, as the dialling peer reports it."""

    OK = 0  # dialled and answered: reachable from there
    FAILED = 1  # the address matches where the asker connects from, but the dial failed
    REFUSED = 2  # no asked address is at the IP the asker connects from (NAT): not dialled at all
    BUSY = 3  # asked again too soon; no information


NONCE_BYTES = 16


@message("dialback/ask", max_bytes=4096)
@dataclass(frozen=True, slots=True)
class DialBackAsk:
    """Please dial me back at these addresses and tell me if it worked.

    The answering peer dials only addresses at the IP this request's connection comes from
    (so nobody can aim its dials at a third party), and proves a data-plane dial by the
    data plane echoing `nonce`."""

    nonce: bytes
    data_addr: str
    addrs: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.nonce) != NONCE_BYTES:
            raise ValueError(f"nonce must be {NONCE_BYTES} bytes")
        if len(self.data_addr) > 256 or len(self.addrs) > MAX_ADDRS or any(len(a) > 256 for a in self.addrs):
            raise ValueError("too many or too long addresses")


@message("dialback/answer", max_bytes=1024)
@dataclass(frozen=True, slots=True)
class DialBackAnswer:
    nonce: bytes
    data: int  # a DialResult
    libp2p: int  # a DialResult

    def __post_init__(self) -> None:
        if len(self.nonce) != NONCE_BYTES:
            raise ValueError(f"nonce must be {NONCE_BYTES} bytes")
        for value in (self.data, self.libp2p):
            if value not in DialResult._value2member_map_:
                raise ValueError(f"unknown dial result {value}")
