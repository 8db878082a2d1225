"""Scenarios: typed, frozen configs of one simulated run, and the named functions that return them.

A scenario says everything a run depends on (sizes, models, attackers, seed); running it
(`simulations.run.run_scenario`) is a pure function of it, apart from the wall time spent.
There are three kinds:

- `BroadcastScenario`: one checkpoint from an origin to N relay peers running the real
  `relay.transfer.TransferCore`, over modeled bandwidth and regional latency, with optional
  churn, a partition and byzantine relays (corrupt chunks, a forged manifest, false Holding).
- `AuditScenario`: validators running the real `verify.validator.ValidatorCore` (with peer
  tables) check submissions of workers, some of which forge proofs; the outcome is how soon
  cheaters are caught and how much forged work gets through, against 1-(1-p)^k.
- `InferenceWaitScenario`: the RL loop (train step, publish, broadcast, generate) with
  `async_level`; how long inference workers wait for weights.

`SCENARIOS` maps the names the CLI accepts to functions `(peers, seed) -> config`;
`with_params` overrides fields by (dotted) name from strings, for `--set` and sweeps.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Union

from p2pnet.config import validated
from p2pnet.errors import ConfigError
from relay.serving import ServingConfig, linger_problems
from simulations.models import GBIT, MBIT, Bandwidth, Churn, Partition, RegionMix

STRATEGIES = ("relay", "tree4", "star", "chain", "tree", "swarm")


@validated
@dataclass(frozen=True)
class BroadcastScenario:
    """One checkpoint broadcast. Sizes in bytes, rates in bytes/s, times in seconds.

    `strategy`: relay (striped trees), tree4 (one tree of fan-out 4), star, chain (fan-out 1),
    tree (fan-out `tree_fanout`) or swarm (no plan: rarest-first pulls from neighbours that
    told their bitmaps, `relay.swarm`). `chunk_bytes` 0 picks about 256 chunks.
    `announce_interval_s` paces `Holding` gossip, which late joiners learn the version from (the
    plain broadcasts, without joiners, set it to an hour: nobody needs it and it costs events).
    `byzantine` is the share of relays that are byzantine: each chunk they serve is corrupt
    with probability `corrupt_rate`; with `forge` they also gossip a manifest signed by
    themselves and claim to hold the real version. `membership_lag_s` is how long the others
    take to notice a departure or a join (the peer table's expiry) before replanning. The real
    table notices a silent departure only after the peer's horizon, which grows with the network
    (`p2pnet.peertable`: 10 s up to 10 peers, 5 heartbeat intervals of (N / 5) s beyond, 150 s
    past 150 peers); the default models a small network's.
    `stall_timeout_s` (the transfer core's default, 30 s) must exceed the time a slow parent
    needs for a chunk, or big chunks over slow links are mistaken for stalls.

    What a real peer sees, on by default (set to 0 / inf to switch each off):
    `view_miss`: each relay's membership misses this share of the other relays (peer tables
    disagree: heartbeats arrive late or are lost, a peer joined a moment ago); relays fall into
    `view_classes` groups that share one view (two relays of different groups disagree as two
    independent views would; one view per relay would cost a plan per relay).
    `download_ratio`: a relay downloads at most this many times its upload (home links are
    asymmetric; 1 is symmetric). `slow_fraction` of the relays deliver 1/`slow_factor` of the
    upload they advertise. `window_bytes`: one connection carries at most window / round trip
    (TCP; 6 MiB is Linux's default tcp_rmem maximum). `upload_slots`: chunks a relay serves at
    once (`[relay] max_concurrent_uploads`); `upload_linger` and `upload_linger_cap`: a chunk
    served for longer than `upload_linger` times the relay's typical serving time stops holding
    its slot, at most `upload_linger_cap` x the slots at once (`relay.serving.ServingConfig`
    `linger_factor` and `linger_cap`; 0: off). `stable_plan` False plans stripes by capacity as
    before (see `relay.planner.plan_broadcast`): the baseline for experiments. `pace_uploads`:
    each relay paces what it serves at its advertised upload, chunk by chunk, as the relay role
    does (`relay.serving.ByteBudget`); on by default, as the real peer does it.
    """

    name: str = "broadcast"
    peers: int = 1000
    checkpoint_bytes: int = 1_000_000_000
    chunk_bytes: int = 0
    strategy: str = "relay"
    tree_fanout: int = 4
    upload: Bandwidth = field(default_factory=Bandwidth)
    download: Bandwidth = field(default_factory=lambda: Bandwidth.fixed(math.inf))
    origin_upload_bps: float = 10 * GBIT
    regions: RegionMix = field(default_factory=RegionMix)
    regional_latency: bool = True
    local_latency_s: float = 0.005
    loss: float = 0.0
    churn: Churn = field(default_factory=Churn)
    partition: Partition = field(default_factory=Partition)
    byzantine: float = 0.0
    corrupt_rate: float = 1.0
    forge: bool = False
    membership_lag_s: float = 10.0
    window_per_source: int = 2
    stripes: int = 16
    stall_timeout_s: float = 30.0
    announce_interval_s: float = 5.0
    until_s: float = 100_000.0
    view_miss: float = 0.01
    view_classes: int = 32
    download_ratio: float = 4.0
    slow_fraction: float = 0.1
    slow_factor: float = 2.0
    window_bytes: float = 6 * 2**20
    upload_slots: int = 16
    upload_linger: float = ServingConfig.linger_factor
    upload_linger_cap: int = ServingConfig.linger_cap
    stable_plan: bool = True
    pace_uploads: bool = True
    seed: int = 0

    def check(self) -> dict[str, str]:
        problems = {}
        if self.peers < 1:
            problems["peers"] = "must be >= 1"
        if not 0.0 <= self.view_miss < 1.0:
            problems["view_miss"] = "must lie in [0, 1)"
        if not 0.0 <= self.slow_fraction <= 1.0:
            problems["slow_fraction"] = "must lie in [0, 1]"
        for name in ("view_classes", "upload_slots"):
            if getattr(self, name) < 1:
                problems[name] = "must be >= 1"
        names = {"linger_factor": "upload_linger", "linger_cap": "upload_linger_cap"}
        problems.update({names[k]: v for k, v in linger_problems(self.upload_linger, self.upload_linger_cap).items()})
        for name in ("download_ratio", "slow_factor"):
            if not getattr(self, name) >= 1.0:
                problems[name] = "must be >= 1 (inf: no limit)" if name == "download_ratio" else "must be >= 1"
        if not self.window_bytes > 0:
            problems["window_bytes"] = "must be > 0 (inf: no per-connection limit)"
        if self.checkpoint_bytes < 1:
            problems["checkpoint_bytes"] = "must be >= 1"
        if self.chunk_bytes < 0:
            problems["chunk_bytes"] = "must be >= 0 (0: about 256 chunks)"
        if self.strategy not in STRATEGIES:
            problems["strategy"] = f"must be one of {STRATEGIES}"
        if self.tree_fanout < 1:
            problems["tree_fanout"] = "must be >= 1"
        if not self.origin_upload_bps > 0:
            problems["origin_upload_bps"] = "must be > 0"
        if not 0.0 <= self.loss < 1.0:
            problems["loss"] = "must lie in [0, 1)"
        for name in ("byzantine", "corrupt_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                problems[name] = "must lie in [0, 1]"
        for name in ("membership_lag_s", "local_latency_s"):
            if getattr(self, name) < 0:
                problems[name] = "must be >= 0"
        for name in ("window_per_source", "stripes"):
            if getattr(self, name) < 1:
                problems[name] = "must be >= 1"
        for name in ("stall_timeout_s", "announce_interval_s", "until_s"):
            if not getattr(self, name) > 0:
                problems[name] = "must be > 0"
        for name, kind in (("upload", Bandwidth), ("download", Bandwidth), ("regions", RegionMix),
                           ("churn", Churn), ("partition", Partition)):
            if not isinstance(getattr(self, name), kind):
                problems[name] = f"must be a {kind.__name__}"
        return problems


@validated
@dataclass(frozen=True)
class AuditScenario:
    """Cheating workers against sampled validators.

    Each of `cheaters` workers publishes `submissions` submissions whose proofs are forged;
    `honest` workers publish genuine ones. A check of a forged submission detects it with
    probability `detection_rate` (the stub checker's recall); the network checks a share
    `sample_rate` of submissions. `gain_per_batch` is what an accepted forged batch is worth
    to its cheater (in honest batches' compute).
    """

    name: str = "audit"
    validators: int = 8
    cheaters: int = 100
    honest: int = 10
    submissions: int = 12
    sample_rate: float = 0.1
    detection_rate: float = 1.0
    ban_after_failures: int = 1
    claim_window_s: float = 0.5
    check_s: float = 1.0
    submit_every_s: float = 10.0
    gain_per_batch: float = 1.0
    seed: int = 0

    def check(self) -> dict[str, str]:
        problems = {}
        for name in ("validators", "submissions", "ban_after_failures"):
            if getattr(self, name) < 1:
                problems[name] = "must be >= 1"
        for name in ("cheaters", "honest"):
            if getattr(self, name) < 0:
                problems[name] = "must be >= 0"
        for name in ("sample_rate", "detection_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                problems[name] = "must lie in [0, 1]"
        if not self.submit_every_s > self.claim_window_s + self.check_s:
            problems["submit_every_s"] = "must exceed claim_window_s + check_s"
        return problems


@validated
@dataclass(frozen=True)
class InferenceWaitScenario:
    """The RL loop: how long inference waits for weights, given bandwidth and async level.

    The trainer takes `train_step_s` per step and publishes each new version at once; the
    checkpoint reaches each of `peers` inference workers after the broadcast time that the
    relay simulation (real cores, every peer at `upload_bps`) measures for it; a worker spends
    `generate_s` on each step's rollouts and may use weights at most `async_level` versions old.
    """

    name: str = "inference_wait"
    peers: int = 100
    checkpoint_bytes: int = 8_000_000_000
    chunk_bytes: int = 0
    upload_bps: float = 1 * GBIT
    origin_upload_bps: float = 10 * GBIT
    async_level: int = 2
    train_step_s: float = 60.0
    generate_s: float = 90.0
    steps: int = 30
    seed: int = 0

    def check(self) -> dict[str, str]:
        problems = {}
        if self.peers < 1:
            problems["peers"] = "must be >= 1"
        if self.async_level < 0:
            problems["async_level"] = "must be >= 0"
        if self.steps < 2:
            problems["steps"] = "must be >= 2"
        for name in ("upload_bps", "origin_upload_bps", "train_step_s", "generate_s"):
            if not getattr(self, name) > 0:
                problems[name] = "must be > 0"
        return problems


Scenario = Union[BroadcastScenario, AuditScenario, InferenceWaitScenario]


# -- the named scenarios ------------------------------------------------------------------------

#: switches off what the default broadcast models of the real world (views that disagree, asymmetric
#: downloads, peers slower than they claim, TCP windows): for validating against closed forms
EXACT_WORLD: dict[str, Any] = {"view_miss": 0.0, "download_ratio": math.inf, "slow_fraction": 0.0,
                               "window_bytes": math.inf}


def broadcast(peers: int | None = None, seed: int = 0) -> BroadcastScenario:
    """A 1 GB checkpoint to 1,000 relays (log-uniform 100 Mbit/s to 10 Gbit/s, three regions)."""
    return BroadcastScenario(peers=peers or 1000, announce_interval_s=3600.0, seed=seed)


def broadcast_10g(peers: int | None = None, seed: int = 0) -> BroadcastScenario:
    """The benchmark: a 10 GB checkpoint in 64 MiB chunks to 10,000 relays."""
    return BroadcastScenario(name="broadcast_10g", peers=peers or 10_000, checkpoint_bytes=10_000_000_000,
                             chunk_bytes=64 * 2**20, announce_interval_s=3600.0, seed=seed)


def churn(peers: int | None = None, seed: int = 0) -> BroadcastScenario:
    """20% of relays leave, crash or hang during the broadcast and 10% new ones join."""
    return BroadcastScenario(name="churn", peers=peers or 1000, churn=Churn(departures=0.2, joins=0.1, end_s=3.0),
                             seed=seed)


def byzantine(peers: int | None = None, seed: int = 0) -> BroadcastScenario:
    """10% of relays serve corrupt chunks, gossip a forged manifest and claim to hold the version."""
    return BroadcastScenario(name="byzantine", peers=peers or 1000, byzantine=0.1, forge=True, seed=seed)


def hostile(peers: int | None = None, seed: int = 0) -> BroadcastScenario:
    """Churn, byzantine relays, message loss and a 5 s partition of 20% of the peers, together."""
    return BroadcastScenario(name="hostile", peers=peers or 1000, byzantine=0.1, forge=True, loss=0.01,
                             churn=Churn(departures=0.15, joins=0.05, end_s=3.0),
                             partition=Partition(start_s=0.5, end_s=5.5, fraction=0.2), seed=seed)


def chain(peers: int | None = None, seed: int = 0) -> BroadcastScenario:
    """Validation: a pipelined chain, equal 1 Gbit/s links, one request in flight per link."""
    return BroadcastScenario(name="chain", peers=peers or 20, checkpoint_bytes=64 * 2**24, chunk_bytes=2**24,
                             strategy="chain", upload=Bandwidth.fixed(GBIT), origin_upload_bps=GBIT,
                             regional_latency=False, local_latency_s=0.0005, window_per_source=1,
                             **EXACT_WORLD, seed=seed)


def kary_tree(peers: int | None = None, seed: int = 0, fanout: int = 3) -> BroadcastScenario:
    """Validation: a pipelined k-ary tree (k=3), equal 1 Gbit/s links, one request per link."""
    return dataclasses.replace(chain(peers or 120, seed), name="tree", strategy="tree", tree_fanout=fanout)


def audit(peers: int | None = None, seed: int = 0) -> AuditScenario:
    """100 cheaters against 8 validators sampling 10% of submissions."""
    return AuditScenario(cheaters=peers or 100, seed=seed)


def inference_wait(peers: int | None = None, seed: int = 0) -> InferenceWaitScenario:
    """100 inference workers, an 8 GB checkpoint over 1 Gbit/s links, async level 2."""
    return InferenceWaitScenario(peers=peers or 100, seed=seed)


SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "broadcast": broadcast,
    "broadcast_10g": broadcast_10g,
    "churn": churn,
    "byzantine": byzantine,
    "hostile": hostile,
    "chain": chain,
    "tree": kary_tree,
    "audit": audit,
    "inference_wait": inference_wait,
}


def scenario(name: str, peers: int | None = None, seed: int = 0) -> Scenario:
    try:
        make = SCENARIOS[name]
    except KeyError:
        raise ConfigError("scenario", f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None
    return make(peers, seed)


# -- overriding fields by name ------------------------------------------------------------------


def with_params(config: Any, params: dict[str, Any]) -> Any:
    """A copy of `config` with fields replaced; names may be dotted (`churn.departures`) and
    values strings (parsed by the field's type). Raises ConfigError for unknown names."""
    for name, value in params.items():
        config = _replace_path(config, name.split("."), value, name)
    return config


def _replace_path(config: Any, path: list[str], value: Any, full: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(config)}
    head = path[0]
    if head not in fields:
        raise ConfigError(full, f"unknown setting; known: {', '.join(sorted(fields))}")
    current = getattr(config, head)
    if len(path) > 1:
        if not dataclasses.is_dataclass(current):
            raise ConfigError(full, f"{head} has no sub-settings")
        new = _replace_path(current, path[1:], value, full)
    else:
        new = _parse(value, current, full) if isinstance(value, str) else value
    return dataclasses.replace(config, **{head: new})


def _parse(text: str, current: Any, name: str) -> Any:
    try:
        if isinstance(current, bool):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if isinstance(current, int):
            return int(float(text)) if float(text).is_integer() else int(text)
        if isinstance(current, float):
            return float(text)
    except ValueError:
        raise ConfigError(name, f"cannot parse {text!r} as {type(current).__name__}") from None
    if isinstance(current, str):
        return text
    raise ConfigError(name, "only numbers, booleans and strings can be set by name")


def to_jsonable(config: Any) -> dict[str, Any]:
    """The config as plain JSON values, nested configs as nested objects (inf as a string)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_jsonable(value)
        elif isinstance(value, float) and not math.isfinite(value):
            out[f.name] = str(value)
        else:
            out[f.name] = value
    return out


__all__ = ["AuditScenario", "BroadcastScenario", "InferenceWaitScenario", "SCENARIOS", "Scenario", "scenario",
           "with_params", "to_jsonable", "MBIT", "GBIT"]
