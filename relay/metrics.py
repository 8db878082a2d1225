"""The relay role's Prometheus metrics (a provider for `p2pnet.metrics.PeerCollector`).

Read at scrape time from the role's own counters: data-plane bytes served and fetched, per
role the peer on the other end had when they moved (`BytesByRole`, added to as they move: a
counter must never go down, and regrouping per-peer totals at scrape time moved a departed
peer's bytes from its role to `unknown`); fetched chunks verified and rejected against their digest;
the versions held; how long the newest versions took to become complete here (from the first
manifest heard to the last chunk stored); the store's use. Nothing here changes the role.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from p2pnet.metrics import counter, gauge, labelled, peer_role


class BytesByRole:
    """Data-plane bytes served and verified bytes fetched, by the role of the peer on the other
    end when they moved (`p2pnet.metrics.peer_role`); a handful of labels, whatever the peers."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self.served: dict[str, int] = {}
        self.fetched: dict[str, int] = {}

    def add(self, totals: dict[str, int], peer: str, amount: int) -> None:
        role = peer_role(self.node, peer)
        totals[role] = totals.get(role, 0) + amount


class RelayMetrics:
    def __init__(self, node: Any) -> None:
        self.node = node

    def unhealthy(self, role: Any) -> str | None:
        hold = role.store_hold(0.0)  # (not its timing: only what it holds, and why)
        if hold["backing_off"]:  # (between holds too: each new request waits on a probe of the store then)
            cause = hold["cause"] or "full or failing"
            alone = f" writing version {hold['version']}" if hold["version"] is not None else ""
            return f"chunk store {cause}{alone}: fetching backs off until it stores again"
        return None

    def collect(self, role: Any) -> Iterator[Metric]:
        yield labelled(CounterMetricFamily("p2pnet_relay_bytes_served", "Checkpoint bytes served on the data plane, "
                                           "by the receiving peer's role.", labels=["peer_role"]),
                       role.bytes_by_role.served)
        yield labelled(CounterMetricFamily("p2pnet_relay_bytes_received", "Verified checkpoint bytes fetched on the "
                                           "data plane, by the sending peer's role.", labels=["peer_role"]),
                       role.bytes_by_role.fetched)
        yield counter("p2pnet_relay_chunks_verified", "Fetched chunks whose blake3 digest matched.",
                      role.chunk_checks["verified"])
        yield counter("p2pnet_relay_chunks_rejected", "Fetched chunks whose digest did not match (dropped).",
                      role.chunk_checks["rejected"])
        complete = role.core.complete_versions()
        yield gauge("p2pnet_relay_versions_held", "Checkpoint versions complete in the store.", len(complete))
        yield gauge("p2pnet_relay_latest_version", "Newest complete checkpoint version (absent before the first).",
                    max(complete) if complete else None)
        took = GaugeMetricFamily("p2pnet_relay_version_complete_seconds", "Seconds from first hearing a version's "
                                 "manifest to holding all its chunks, for the versions held.", labels=["version"])
        for version in sorted(complete):
            times = role.timeline.get(version, {})
            if "complete_at_s" in times and "manifest_at_s" in times:
                took.add_metric([str(version)], max(0.0, times["complete_at_s"] - times["manifest_at_s"]))
        yield took
        store = role.store
        yield gauge("p2pnet_relay_store_used_bytes", "Bytes the chunk store uses.", store.used_bytes)
        yield gauge("p2pnet_relay_upload_limit_bytes_per_second", "Upload rate the data plane keeps to.",
                    role._upload.rate_bps)
