"""What the relay transfer core asks of the world that runs it, and what it tells the application.

Effects (beside p2pnet's Publish/Send/SetTimer/Emit) that the relay shell (`relay.role`) or the
simulator (`simulations.dataplane`) carries out: `Fetch` a chunk over the data plane,
`FetchManifest` from a holder, `DropSource` (close a stalled connection), `Penalise` a peer that
served bytes that do not verify. Events (inside `Emit`): `ManifestAccepted`, `VersionComplete`,
`SourceDropped`. Plain frozen data; no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

from relay.manifest import SignedManifest


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
    `manifest_frame`."""

    peer: str
    version: int


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
    why: str
