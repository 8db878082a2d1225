"""Models of the world a simulated network lives in: regions, bandwidth, churn and partitions.

Everything here is pure and seeded: a model is a frozen dataclass, and drawing from it takes
an explicit `random.Random`, so the same seed gives the same draws on every machine and every
`PYTHONHASHSEED` (nothing iterates over a set of strings). The models say *what happens*
(who is slow, who leaves when, which peers are cut off); `simulations.run` makes it happen
on the engine, and the protocol cores decide what to do about it.

- Regions: `REGIONS` with a one-way latency matrix (US, EU, Asia, figures typical of public
  cloud inter-region round trips halved) and `RegionMix` (what share of peers lives where).
- Bandwidth: `Bandwidth` (fixed, log-uniform or tiered), bytes per second.
- Churn: `Churn` (Poisson leaves, crashes, hangs and joins over a time window), drawn into a
  sorted list of `ChurnEvent`.
- Partitions: `Partition` (a share of the peers cut off from the rest, from start_s to end_s).

Must not: touch an engine or a core, read a clock, or use global randomness.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from p2pnet.config import validated
from simulations.world import NetworkModel

MBIT = 1e6 / 8  # bytes per second in one Mbit/s
GBIT = 1e9 / 8

REGIONS = ("us", "eu", "asia")
#: one-way latency between regions, seconds (about half the usual inter-region round trip)
REGION_LATENCY_S = (("us", "eu", 0.040), ("us", "asia", 0.075), ("eu", "asia", 0.110))
LOCAL_LATENCY_S = 0.005


def network_model(*, loss: float = 0.0, local_latency_s: float = LOCAL_LATENCY_S,
                  regional: bool = True) -> NetworkModel:
    """The world's control-plane network: region-to-region latency and message loss."""
    return NetworkModel(local_latency_s=local_latency_s, latency_s=REGION_LATENCY_S if regional else (), loss=loss)


@validated
@dataclass(frozen=True)
class RegionMix:
    """Shares of peers per region (in `REGIONS` order); they need not sum to one."""

    us: float = 0.4
    eu: float = 0.4
    asia: float = 0.2

    def check(self) -> dict[str, str]:
        shares = (self.us, self.eu, self.asia)
        if min(shares) < 0 or sum(shares) <= 0:
            return {"us": "shares must be >= 0 and not all 0"}
        return {}

    def assign(self, rng: random.Random, count: int) -> list[str]:
        """`count` regions, drawn independently with the mix's weights."""
        return rng.choices(REGIONS, weights=(self.us, self.eu, self.asia), k=count)


@validated
@dataclass(frozen=True)
class Bandwidth:
    """A distribution of link capacity in bytes per second.

    `fixed`: always `low_bps`. `log_uniform`: log-uniform on [low_bps, high_bps] (home links
    to datacenter links). `tiers`: `low_bps` or `high_bps`, the latter with probability
    `high_share`.
    """

    kind: str = "log_uniform"
    low_bps: float = 100 * MBIT
    high_bps: float = 10_000 * MBIT
    high_share: float = 0.2

    def check(self) -> dict[str, str]:
        problems = {}
        if self.kind not in ("fixed", "log_uniform", "tiers"):
            problems["kind"] = "must be fixed, log_uniform or tiers"
        if not self.low_bps > 0:
            problems["low_bps"] = "must be > 0"
        if self.kind != "fixed" and not self.high_bps >= self.low_bps:
            problems["high_bps"] = "must be >= low_bps"
        if not 0.0 <= self.high_share <= 1.0:
            problems["high_share"] = "must lie in [0, 1]"
        return problems

    @classmethod
    def fixed(cls, bps: float) -> Bandwidth:
        return cls("fixed", float(bps), float(bps))

    def draw(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.low_bps
        if self.kind == "tiers":
            return self.high_bps if rng.random() < self.high_share else self.low_bps
        return math.exp(rng.uniform(math.log(self.low_bps), math.log(self.high_bps)))

    def mean(self) -> float:
        if self.kind == "fixed":
            return self.low_bps
        if self.kind == "tiers":
            return self.high_share * self.high_bps + (1 - self.high_share) * self.low_bps
        if self.high_bps == self.low_bps:
            return self.low_bps
        return (self.high_bps - self.low_bps) / math.log(self.high_bps / self.low_bps)


# -- churn ----------------------------------------------------------------------------------

LEAVE, CRASH, HANG, JOIN = "leave", "crash", "hang", "join"


@dataclass(frozen=True, order=True)
class ChurnEvent:
    """At `at_s`, peer number `peer` (an index into the initial peers; a fresh index for a
    join) leaves, crashes, hangs or joins."""

    at_s: float
    kind: str
    peer: int


@validated
@dataclass(frozen=True)
class Churn:
    """Poisson churn between `start_s` and `end_s`.

    `departures` is the expected share of the initial peers that go away in the window; each
    departure is a clean leave, a crash (connections reset) or a hang (the process stops and
    answers nothing) in the ratio `leave_share : crash_share : hang_share`. `joins` is the
    expected number of new peers, as a share of the initial count. Departing peers are drawn
    without replacement, so nobody leaves twice.
    """

    departures: float = 0.0
    joins: float = 0.0
    start_s: float = 0.0
    end_s: float = 30.0
    leave_share: float = 0.5
    crash_share: float = 0.4
    hang_share: float = 0.1

    def check(self) -> dict[str, str]:
        problems = {}
        if not 0.0 <= self.departures <= 1.0:
            problems["departures"] = "must lie in [0, 1]"
        if self.joins < 0:
            problems["joins"] = "must be >= 0"
        if not self.end_s >= self.start_s >= 0:
            problems["end_s"] = "need 0 <= start_s <= end_s"
        shares = (self.leave_share, self.crash_share, self.hang_share)
        if min(shares) < 0 or sum(shares) <= 0:
            problems["leave_share"] = "shares must be >= 0 and not all 0"
        return problems

    def draw(self, rng: random.Random, peers: int) -> list[ChurnEvent]:
        """The churn events for `peers` initial peers (numbered 0..peers-1), sorted by time."""
        window = self.end_s - self.start_s
        events: list[ChurnEvent] = []
        leaving = _poisson(rng, self.departures * peers)
        kinds = rng.choices((LEAVE, CRASH, HANG), weights=(self.leave_share, self.crash_share, self.hang_share),
                            k=min(leaving, peers))
        for peer, kind in zip(rng.sample(range(peers), min(leaving, peers)), kinds):
            events.append(ChurnEvent(self.start_s + rng.random() * window, kind, peer))
        for number in range(_poisson(rng, self.joins * peers)):
            events.append(ChurnEvent(self.start_s + rng.random() * window, JOIN, peers + number))
        return sorted(events)


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth for small means, a rounded normal for large ones)."""
    if mean <= 0:
        return 0
    if mean > 50:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k += 1
        product *= rng.random()
    return k


# -- partitions -------------------------------------------------------------------------------


@validated
@dataclass(frozen=True)
class Partition:
    """From `start_s` to `end_s` a share `fraction` of the peers (drawn at random, or whole
    `region` if one is named) cannot reach the others, control plane and data plane alike."""

    start_s: float = 5.0
    end_s: float = 15.0
    fraction: float = 0.0
    region: str = ""

    def check(self) -> dict[str, str]:
        problems = {}
        if not self.end_s >= self.start_s >= 0:
            problems["end_s"] = "need 0 <= start_s <= end_s"
        if not 0.0 <= self.fraction < 1.0:
            problems["fraction"] = "must lie in [0, 1)"
        if self.region and self.region not in REGIONS:
            problems["region"] = f"must be one of {REGIONS} or empty"
        return problems

    @property
    def active(self) -> bool:
        return bool(self.region) or self.fraction > 0

    def cut_off(self, rng: random.Random, regions: list[str]) -> list[int]:
        """Indices of the peers on the far side (the origin is never among `regions`)."""
        if self.region:
            return [i for i, r in enumerate(regions) if r == self.region]
        count = round(self.fraction * len(regions))
        return sorted(rng.sample(range(len(regions)), count))
