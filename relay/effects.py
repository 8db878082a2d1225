"""What the relay transfer core asks of the world that runs it, and what it tells the application.

Effects (beside p2pnet's Publish/Send/SetTimer/Emit) that the relay shell (`relay.role`) or the
simulator (`simulations.dataplane`) carries out: `Fetch` a chunk over the data plane,
`FetchManifest` from a holder, `DropSource` (close a stalled connection), `Penalise` a peer that
served bytes that do not verify. Events (inside `Emit`): `ManifestAccepted`, `VersionComplete`,
`SourceDropped`, and `SourcePassedOver` (not a drop: the source is passed over in one stripe of a
version alone and stays in use for the others, its connection open). Plain frozen data; no
behaviour.

And the two vocabularies of a source's failures: `FetchFailure`, how a `Fetch` failed (what the
shell or the simulator tells the core with `fetch_failed`), and `DropReason`, why the core
stopped fetching from a source (what `SourceDropped` says). Both are `StrEnum`s whose values are
the words the reports print (`relay.failures` says what the core does about each).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from relay.manifest import SignedManifest


# -- how a fetch fails, and why a source is dropped ------------------------------------------


class FetchFailure(enum.StrEnum):
    """How a `Fetch` failed, by who is at fault: that decides what the core does
    (`relay.failures.FailureHandling.fetch_failed`). Nothing outside the peer sends one: the shell
    and the simulator name it from what they saw."""

    CORRUPT = "corrupt"
    """The source: it served bytes that do not hash to the digest, or broke the chunk protocol.
    It is banned and penalised; the chunk is fetched elsewhere."""
    UNREACHABLE = "unreachable"
    """The network or the source: the connection failed, was reset, or ended inside a chunk (a
    killed peer). The source is excluded for a while; the chunk is fetched elsewhere."""
    NOT_ADMITTED = "not_admitted"
    """Nobody yet: the source closed the connection after our hello, as it has not heard our
    heartbeat (the shell sends it ours directly). Excluded briefly, then asked again; unreachable
    after a few refusals in a row."""
    NO_ADDRESS = "no_address"
    """Nobody yet: the source's heartbeat, which carries its data address, has not reached our
    peer table within the shell's wait (we heard of it first from a `Holding`, or as the
    manifest's publisher; heartbeats come up to the peer table's `max_interval_s` apart, and
    more while busy). Excluded briefly, then asked again: it is no evidence that the source is
    gone, and it stays a holder; unreachable once it has had no address for
    `relay.failures.NO_ADDRESS_GRACE_S`."""
    UNAVAILABLE = "unavailable"
    """The source, mildly: it answered that it does not hold the chunk (after its wait limit).
    It stays usable for other chunks; the chunk is asked of the next candidate."""
    STORE_FULL = "store_full"
    """Us: the chunk arrived but our store had no room. Nobody is blamed; it is fetched again."""
    STORE_FAILED = "store_failed"
    """Us: the chunk arrived but our disk failed to keep it. Nobody is blamed; it is fetched again."""


class DropReason(enum.StrEnum):
    """Why the transfer core stopped fetching from a source: for a while (excluded) or for good
    (banned, `CORRUPT`). Said in `SourceDropped`, and counted by reason in the simulator's reports;
    `STALLED` and `SLOW` also say why a source is passed over in one stripe (`SourcePassedOver`)."""

    CORRUPT = "corrupt"
    """The source: it served a chunk that does not verify (`FetchFailure.CORRUPT`). Banned."""
    UNREACHABLE = "unreachable"
    """The network or the source: a failed connection, or a source that kept refusing us.
    Excluded for `exclude_s`, with substitutes for the stripes it fed us."""
    NOT_ADMITTED = "not_admitted"
    """Nobody yet: the source has not heard our heartbeat. Excluded for `not_admitted_s` only,
    without substitutes."""
    NO_ADDRESS = "no_address"
    """Nobody yet: we have not heard the source's heartbeat, so we have no data address for it.
    Excluded for `not_admitted_s` only, without substitutes, and kept as a holder."""
    STALLED = "stalled"
    """The source or the network, silently: requests outstanding and nothing completed for
    `stall_timeout_s` (a hung peer, a partition). Excluded, its connection closed, without
    substitutes (its ancestors feed us)."""
    UNAVAILABLE = "unavailable"
    """The source: it named a version in full in its `Holding` and then answered our manifest ask
    that it does not hold it (`relay.manifest_answers`). Excluded for `exclude_s`, with substitutes.
    Or, passed over in one stripe (`SourcePassedOver`): our parent there answered "unavailable" to
    a window's chunks in a row, each asked as often as a parent is, and delivered nothing
    (`relay.failures`, `_unavailable_too_often`)."""
    SLOW = "slow"
    """The source: as our parent it delivered too little (`relay.transfer`'s `fetched`). Excluded,
    with substitutes; alive, so asked before the origin where a stand-in is wanted (`relay.sources`)."""


# -- effects the relay shell (or the simulator) carries out ---------------------------------


@dataclass(frozen=True, slots=True)
class Fetch:
    """Fetch chunk `index` of `version` from `peer`, check it hashes to `digest`, store it, and
    report with `fetched` or `fetch_failed`. The source may hold the request until it has it."""

    peer: str
    version: int
    index: int
    digest: bytes
    size: int
    urgent: bool = False  # we forward this stripe: serve us before peers that only keep it


@dataclass(frozen=True, slots=True)
class FetchManifest:
    """Ask `peer` (who announced holding it) for the manifest frame of `version`; report with
    `manifest_frame`, or a failure with `manifest_failed` and `asked_at`: the core's time of this
    ask, which tells a late report of an earlier ask of the same holder from this one's."""

    peer: str
    version: int
    asked_at: float = field(default=0.0, compare=False)


@dataclass(frozen=True, slots=True)
class DropSource:
    """Abandon every outstanding request to `peer` (it stalled): close the connection."""

    peer: str


@dataclass(frozen=True, slots=True)
class ServeAtOnce:
    """Set our upload slots to `slots` (0, or fewer than configured: the configured upload slots).
    Asked for where we forward in a plan whose fan-outs are all small
    (`relay.planner.StripePlan.small_fanouts`), with as many slots as we have children in our
    home stripe (the most over the versions we hold): there each hop costs a whole chunk at the
    stripe's rate, and a child beyond our upload slots would get every chunk a whole transfer
    after the others (the seed-1 MWW bench, N = 1,023 equal uploads, 256 chunks: fan-outs 13-18
    against 16 slots, 1.37x the optimum; serving every child at once, 1.29x). What it is for is
    our children; it reserves nothing for them: any queued requester may take the extra slots
    (urgent first, then round robin, `per_peer` unchanged), and the bytes are paced by the same
    upload budget."""

    slots: int


@dataclass(frozen=True, slots=True)
class Penalise:
    """Lower `peer`'s score in the peer table by `amount`: it served bytes that do not verify."""

    peer: str
    amount: float
    reason: str


RelayEffect = Fetch | FetchManifest | DropSource | Penalise


# -- events for the local application (Emit) -------------------------------------------------


@dataclass(frozen=True)
class ManifestAccepted:
    signed: SignedManifest


@dataclass(frozen=True)
class VersionComplete:
    version: int
    manifest_id: bytes
    fetched_chunks: int
    seconds: float


@dataclass(frozen=True)
class SourceDropped:
    peer: str
    version: int
    why: DropReason


@dataclass(frozen=True)
class SourcePassedOver:
    """`peer` is passed over in `stripe` of `version` alone, for `exclude_s` (`why`: `STALLED`,
    `UNAVAILABLE` as a parent that never has the chunk, or `SLOW` as a stand-in; `relay.failures`,
    `_pass_over`): it stays a source in the other stripes,
    is neither excluded nor disconnected, and is not counted among the sources dropped."""
    peer: str
    version: int
    stripe: int
    why: DropReason
