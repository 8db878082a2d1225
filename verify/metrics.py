"""The validator role's Prometheus metrics (a provider for `p2pnet.metrics.PeerCollector`).

Verdicts this validator published, by result and by first reason code, and the time each
check took, are counted from the validator core's `VerdictPublished` events as they happen
(the provider listens from the peer's start); the rest is read from the core's counters at
scrape time: submissions seen, checked, refused by reason, checks dropped or failed, checks
in flight, workers banned. Nothing here changes the role.
"""

from __future__ import annotations

import bisect
import re
from typing import Any, Iterator

import trio
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from p2pnet.metrics import counter, gauge, labelled
from verify.validator import VerdictPublished

CHECK_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ROW_PREFIX = re.compile(r"^row\d+:")


def reason_label(reasons: tuple[str, ...] | list[str]) -> str:
    """The label of a verdict's reasons: `none` when accepted, else its first code without the
    row it was found in (`row3:toploc_exp` -> `toploc_exp`), so the label set stays small."""
    return _ROW_PREFIX.sub("", reasons[0]) if reasons else "none"


class ValidatorMetrics:
    def __init__(self, node: Any) -> None:
        from verify.daemon import CORE_NAME

        self.core_name = CORE_NAME
        self.verdicts: dict[tuple[str, str], int] = {}
        self.bucket_counts = [0] * (len(CHECK_BUCKETS_S) + 1)
        self.check_s_sum = 0.0
        node.on_event(self.on_event)

    def on_event(self, origin: str, event: Any) -> None:
        if origin != self.core_name or not isinstance(event, VerdictPublished):
            return
        verdict = event.verdict
        key = ("accepted" if verdict.accepted else "rejected", reason_label(verdict.reasons))
        self.verdicts[key] = self.verdicts.get(key, 0) + 1
        self.bucket_counts[bisect.bisect_left(CHECK_BUCKETS_S, event.check_s)] += 1
        self.check_s_sum += event.check_s

    def collect(self, role: Any) -> Iterator[Metric]:
        verdicts = CounterMetricFamily("p2pnet_validator_verdicts", "Verdicts this validator published, by result "
                                       "and first reason code.", labels=["result", "reason"])
        for (result, reason), count in sorted(self.verdicts.items()):
            verdicts.add_metric([result, reason], count)
        yield verdicts
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, CHECK_BUCKETS_S), "+Inf"), self.bucket_counts):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily("p2pnet_validator_check_seconds", "Time to check one submission "
                                    "(recompute and compare proofs), per published verdict.",
                                    buckets=buckets, sum_value=self.check_s_sum)
        stats = role.core.status(trio.current_time())
        yield counter("p2pnet_validator_submissions_seen", "Submissions heard.", stats["seen"])
        yield counter("p2pnet_validator_submissions_selected", "Submissions this validator was drawn for.",
                      stats["selected"])
        yield counter("p2pnet_validator_checks_failed", "Checks our side could not do (model missing).",
                      stats["check_errors"])
        yield counter("p2pnet_validator_checks_dropped", "Checks dropped with the queue full.", stats["dropped"])
        yield counter("p2pnet_validator_takeovers", "Checks taken over from a silent drawn validator.",
                      stats["takeovers"])
        yield labelled(CounterMetricFamily("p2pnet_validator_submissions_refused", "Submissions refused before "
                                           "any check, by reason.", labels=["reason"]),
                       dict(stats["submissions_rejected"]))
        yield gauge("p2pnet_validator_checks_in_flight", "Checks running or queued now.", stats["in_flight"])
        yield gauge("p2pnet_validator_workers_banned", "Workers this validator's reputation bans now.",
                    len(stats["reputation"].get("banned", [])))
