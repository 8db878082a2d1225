"""The transfer core's bookkeeping per version and per source: plain records, no decisions.

`_Version` is what `relay.transfer.TransferCore` knows of one version: the signed manifest, which
chunks we hold, the plan and our chain of sources per stripe, where each stripe's next request
starts and which chunks wait to be asked for again, the requests in flight and their load per
(source, stripe) link, the chunks' failed sources, holders of the whole version, and counters for
`progress`, and per (source, stripe) link when it last made progress, the latest ask it answered, the
"unavailable" answers since its last chunk, until when a source is passed over in one stripe alone, a
stand-in's delivery there, and the forwarders taken in place of the origin that failed us. `_Source`
is one source's outstanding requests and when it last made progress (the stall check). `_Feed` is
what the origin sent us of our own stripe. `_requeue` puts a chunk back on its stripe's retry queue.

Used by the core and the mixins it is built from (`relay.requests`, `relay.sources`, `relay.judging`,
`relay.failures`, `relay.announce`, `relay.manifest_asks`, `relay.swarm_transfer`); it imports none
of them, so they import it (and `_requeue`) without importing the core.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from relay.manifest import SignedManifest
from relay.planner import StripePlan
from relay.swarm import SwarmVersion


@dataclass(slots=True)
class _Source:
    outstanding: int = 0
    since: float = 0.0  # last completion, or when outstanding went from 0 to 1


@dataclass(slots=True)
class _Feed:
    """The chunks the origin sent us of the stripes where it is our planned parent (`key`: the
    plan's stripe count and those stripes, a root's own; a plan with others starts afresh): when
    the first came, the time and size of the latest few, and all their bytes (`relay.judging`,
    `_sent_us_bps`)."""
    key: tuple[int, tuple[int, ...]]
    first_at: float
    latest: deque[tuple[float, int]]
    sent: int = 0  # bytes, since the first


@dataclass(slots=True)
class _Version:
    signed: SignedManifest
    count: int
    have: bytearray
    have_count: int
    known_at: float
    digests: tuple[bytes, ...] = ()
    chunk_bytes: int = 0  # every chunk's size but the last one's
    last_bytes: int = 0
    is_origin: bool = False
    plan: StripePlan | None = None
    chains: list[list[str]] = field(default_factory=list)
    next_pos: list[int] = field(default_factory=list)
    retry: list[deque[int] | None] = field(default_factory=list)  # per stripe: chunks to ask for again
    parked: list[int] = field(default_factory=list)
    in_flight: dict[int, tuple[str, int, float]] = field(default_factory=dict)  # index -> peer, stripe, t
    link_load: dict[tuple[str, int], int] = field(default_factory=dict)
    # (source, stripe) -> last completion on that link, or when its load went from 0 to 1: a stall per link
    link_since: dict[tuple[str, int], float] = field(default_factory=dict)
    # (source, stripe) -> the latest time a request answered on that link was asked at, while the link has
    # requests out: an older one still out was passed by a later one (`relay.failures`, `_check_withheld`)
    link_done: dict[tuple[str, int], float] = field(default_factory=dict)
    # (source, stripe) -> "unavailable" answers from our source there since it last delivered us a chunk
    # there (`relay.failures`, `_unavailable_too_often`)
    unavailable: dict[tuple[str, int], int] = field(default_factory=dict)
    # (source, stripe) -> until when we pass the source over in that stripe alone (`relay.failures`, `_pass_over`)
    passed: dict[tuple[str, int], float] = field(default_factory=dict)
    # (source, stripe) -> its delivery (EWMA, bytes/s) and chunks timed there, where it is not our parent
    # in the stripe's chain nor the origin (a stand-in: `relay.judging`, `_short_as_stand_in`)
    link_rates: dict[tuple[str, int], tuple[float, int]] = field(default_factory=dict)
    # (source, stripe): forwarders we took in place of the origin there (`relay.sources`, `_leave_origin`)
    # that then failed us (dropped, or passed over in the stripe): not taken in its place again in this plan
    forsaken: set[tuple[str, int]] = field(default_factory=set)
    # (source, stripe) -> whether it delivered us a chunk there since we last took it in place of the origin
    # (`relay.sources`, `_leave_origin`): a stall or a reset of it is then excused (`relay.failures`, `_forsake`)
    borrowed: dict[tuple[str, int], bool] = field(default_factory=dict)
    tried: dict[int, set[str]] = field(default_factory=dict)
    reasked: dict[int, int] = field(default_factory=dict)  # index -> our parent answered "unavailable" this often
    spare: dict[int, tuple[str | None, float]] = field(default_factory=dict)  # stripe -> whom to ask instead of the origin, until
    sources: dict[str, _Source] = field(default_factory=dict)
    holders: set[str] = field(default_factory=set)
    fetched_chunks: int = 0
    fetched_bytes: int = 0
    feed: _Feed | None = None  # what the origin sent us where it is our planned parent (`relay.judging`)
    completed_at: float | None = None
    starved: bool = False  # the in-flight budget, not a window, stopped the last pump
    forwards: int = -1  # the stripe in which we have children (our home stripe), or -1
    swarm: SwarmVersion | None = None  # the swarm layout's bookkeeping (no plan then)
    hold_until: float = -math.inf  # no new requests for this version before this (its files' writes fail)
    # while members' dial-backs are pending (`relay.requests`, `_await_dial_backs`): per chunk, whether the
    # plan with them dialable gives it us from the origin (None: no wait); those of them not yet asked or
    # held, in order (the wait lasts while any is left); the chunks kept from the origin meanwhile; and when
    # the first of them hoped for has been pending too long to hope for it still (`PENDING_HOPE_S`)
    origin_only: bytearray | None = None
    own_left: deque[int] = field(default_factory=deque)
    kept: list[int] = field(default_factory=list)
    hope_until: float = math.inf

    @property
    def version(self) -> int:
        return self.signed.manifest.version

    @property
    def complete(self) -> bool:
        return self.have_count == self.count

    def size(self, index: int) -> int:
        return self.last_bytes if index == self.count - 1 else self.chunk_bytes


def _requeue(v: _Version, index: int) -> None:
    """Put chunk `index` back on its stripe's retry queue (the swarm layout has none: a chunk
    neither held nor asked for is wanted anyway)."""
    if v.plan is None:
        return
    stripe = v.plan.stripe_of_chunk[index]
    queue = v.retry[stripe]
    if queue is None:
        queue = v.retry[stripe] = deque()
    queue.append(index)
