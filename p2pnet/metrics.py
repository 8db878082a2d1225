"""Prometheus metrics and the health check of one peer, read from its live state at scrape time.

`PeerCollector` is a prometheus_client custom collector: nothing is counted twice and no
protocol code calls into it. At each scrape it reads the node's own counters (peer table,
messages received, sent and rejected by reason) and asks each running role's metrics
provider for its families. Providers live in the packages that own the roles
(`relay.metrics`, `verify.metrics`, `trainer.metrics`), named in `ROLE_METRICS` and imported
lazily as `p2pnet.roles` does; each is built once with the node (so it can listen to the
node's core events from the start, `Node.on_event`) and has `collect(role)`, which yields
metric families from the role object. Scrapes run in the peer's trio thread (the HTTP
server is a trio task, `p2pnet.web`), so reading state needs no lock.

Names follow Prometheus conventions: `p2pnet_` prefix, base units in the name (`_seconds`,
`_bytes`), counters end in `_total`, labels of bounded cardinality only (reasons, roles,
phases; never a peer id except in the one `p2pnet_peer_info` series).

`health(node, providers)` is what `/healthz` answers: None while the peer runs every role it was given,
else the reason it is not healthy.

This module must not change any state it reads, nor block: a scrape is a read.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterable, Iterator

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

ROLE_METRICS = {
    "relay": "relay.metrics:RelayMetrics",
    "validator": "verify.metrics:ValidatorMetrics",
    "worker": "trainer.metrics:WorkerMetrics",
    "trainer": "trainer.metrics:TrainerMetrics",
}
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# a peer's role for per-role labels when it advertises several: the most specific one
ROLE_PRECEDENCE = ("trainer", "validator", "worker", "relay")


def gauge(name: str, doc: str, value: float | None, **labels: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    if value is not None:
        family.add_metric(list(labels.values()), value)
    return family


def counter(name: str, doc: str, value: float, **labels: str) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def labelled(family: GaugeMetricFamily | CounterMetricFamily, values: dict[str, float]) -> Metric:
    """`family` with one sample per label value (the family has exactly one label)."""
    for label, value in sorted(values.items()):
        family.add_metric([label], value)
    return family


def peer_role(node: Any, peer: str) -> str:
    """The role label of a remote peer: its most specific advertised role, `unknown` when it is
    not in our peer table (left, or never heard)."""
    entry = node.peertable.get(peer)
    if entry is None:
        return "unknown"
    for role in ROLE_PRECEDENCE:
        if role in entry.roles:
            return role
    return "none"


def health(node: Any, providers: dict[str, Any] | None = None) -> str | None:
    """None while the peer runs its roles; otherwise why not (for `/healthz`'s 503). A role's
    metrics provider may say its role is in trouble (`unhealthy(role)`: a reason, or None)."""
    if not node.roles_running:
        return "starting: roles not running yet"
    for name, provider in (providers or {}).items():
        role = node.roles.get(name)
        check = getattr(provider, "unhealthy", None)
        if role is not None and check is not None and (why := check(role)) is not None:
            return f"{name}: {why}"
    return None


class PeerCollector:
    """The custom collector of one node (see the module docstring)."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self.providers: dict[str, Any] = {}
        for role in node.config.roles:
            target = ROLE_METRICS.get(role)
            if target is None:
                continue
            module_name, _, attr = target.partition(":")
            self.providers[role] = getattr(importlib.import_module(module_name), attr)(node)

    def health(self) -> str | None:
        return health(self.node, self.providers)

    def collect(self) -> Iterator[Metric]:
        yield from self._peer()
        for name, provider in self.providers.items():
            role = self.node.roles.get(name)
            if role is not None:
                yield from provider.collect(role)

    def _peer(self) -> Iterable[Metric]:
        node = self.node
        now = trio.current_time()
        info = GaugeMetricFamily("p2pnet_peer_info", "This peer's id and roles (always 1).",
                                 labels=["peer_id", "roles"])
        info.add_metric([node.peer_id, ",".join(node.config.roles)], 1)
        yield info
        yield gauge("p2pnet_peer_uptime_seconds", "Seconds since the peer started.", now - node.started_at)
        yield gauge("p2pnet_peer_healthy", "1 while the peer runs its roles (as /healthz), else 0.",
                    0 if self.health() else 1)
        reachable = node.peertable.local.reachable
        yield gauge("p2pnet_peer_reachable", "1 when other peers could dial this one back, 0 when not "
                    "(absent while unknown).", None if reachable is None else int(reachable))
        yield gauge("p2pnet_peers_known", "Peers in the peer table (heard from recently, not banned).",
                    len(node.peertable.peers()))
        yield gauge("p2pnet_peers_connected", "Peers with an open libp2p connection.",
                    len(node.host.connected_peers()))
        yield gauge("p2pnet_data_connections", "Open data-plane connections.",
                    sum(node.dataplane.connections().values()))
        stats = node.stats
        yield counter("p2pnet_gossip_messages_received", "Signed messages accepted (gossip and direct).",
                      stats["received"])
        yield counter("p2pnet_gossip_messages_sent", "Messages published or sent.", stats["sent"])
        yield counter("p2pnet_gossip_send_failures", "Publishes or sends that failed or were dropped.",
                      stats["send_failed"])
        yield counter("p2pnet_gossip_messages_not_forwarded",
                      "Gossip refused by a kind's gate before it was forwarded.", stats.get("gated", 0))
        yield labelled(CounterMetricFamily("p2pnet_gossip_messages_rejected",
                                           "Messages rejected on decode, by reason (stale, bad_signature, ...).",
                                           labels=["reason"]), node.rejections)


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format."""
    return generate_latest(registry)
