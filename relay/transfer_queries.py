"""The transfer core's read-only queries: which versions and chunks it holds, whom a chunk is
asked of (`asking`), and the progress and status it reports (`relay.commands`' `checkpoint.status`,
the simulator's summaries).

Mixed into `relay.transfer.TransferCore` (`Reporting`). These methods read the core's versions,
membership, exclusions, bans and refused manifests, and change nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relay.manifest import SignedManifest
    from relay.planner import Membership
    from relay.transfer_state import _Version


class Reporting:
    """Queries of `relay.transfer.TransferCore` (see the module docstring)."""

    # the core's state these methods read (`TransferCore.__init__` sets it)
    _members: Membership
    _versions: dict[int, _Version]
    _excluded: dict[str, float]
    _banned: set[str]
    rejected_manifests: int

    def has(self, version: int, index: int) -> bool:
        v = self._versions.get(version)
        return v is not None and bool(v.have[index])

    def asking(self, version: int, index: int) -> str | None:
        """The peer our request for chunk `index` of `version` is outstanding with (None: we have
        not asked, or took the request back). The serving core answers that peer's own request
        for the chunk at once instead of holding it (`relay.serving.ServingCore.ask`)."""
        v = self._versions.get(version)
        entry = v.in_flight.get(index) if v is not None else None
        return entry[0] if entry is not None else None

    def knows(self, version: int) -> bool:
        return version in self._versions

    def complete_versions(self) -> list[int]:
        return sorted(n for n, v in self._versions.items() if v.complete)

    def signed(self, version: int) -> SignedManifest | None:
        v = self._versions.get(version)
        return v.signed if v is not None else None

    def progress(self, now: float, version: int) -> dict[str, Any]:
        v = self._versions[version]
        end = v.completed_at if v.completed_at is not None else now
        took = max(end - v.known_at, 1e-9)
        return {
            "version": version,
            "manifest_id": v.signed.manifest_id.hex(),
            "chunks_have": v.have_count,
            "chunks_total": v.count,
            "complete": v.complete,
            "origin": v.is_origin,
            "fetched_chunks": v.fetched_chunks,
            "fetched_bytes": v.fetched_bytes,
            "bytes_per_s": round(v.fetched_bytes / took, 1),
            "in_flight": len(v.in_flight),
            "sources": sorted({peer for peer, _, _ in v.in_flight.values()}),
            "parents": [chain[0] if chain else None for chain in v.chains],
            "holders": len(v.holders),
        }

    def status(self, now: float) -> dict[str, Any]:
        return {
            "versions": self.complete_versions(),
            "progress": [self.progress(now, n) for n in sorted(self._versions)],
            "members": len(self._members),
            "serving_members": sum(1 for upload in self._members.uploads.values() if upload > 0),  # parents to plan
            "excluded": sorted(p for p, until in self._excluded.items() if until > now),
            "banned": sorted(self._banned),
            "rejected_manifests": self.rejected_manifests,
        }
