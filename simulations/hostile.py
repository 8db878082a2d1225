"""Broadcast scenarios in a hostile world: regions, churn, partitions and byzantine relays.

`run_broadcast(scenario)` builds N+1 peers (an origin and N relays), each running the real
`relay.transfer.TransferCore` over `simulations.dataplane`'s bandwidth model, publishes one
signed checkpoint manifest at t=0 and runs until every live honest relay holds every chunk.
What the world does to them comes from `simulations.models`, drawn from the scenario's seed:

- regions: each relay lives in US, EU or Asia; requests and gossip pay one-way latency.
- churn: at drawn times relays leave or crash (their connections reset), hang (they stop
  answering, only stall detection notices) or join (a fresh peer that learns the version
  from `Holding` gossip). `membership_lag_s` later, like a peer table's expiry, every live
  relay is given the new membership and replans.
- partition: a share of the relays (or a region) is cut off from the rest between start_s and
  end_s: gossip, requests and running flows across the cut go silent, then heal.
- byzantine relays: each chunk they serve is corrupt with probability `corrupt_rate`; with
  `forge` they also gossip a manifest signed with their own key and claim `Holding` of the
  genuine version to attract requests.

Theory of operation. The world is built by `simulations.broadcast.build_broadcast` (regions,
per-relay downloads, network model, stall timeout, corruption rate are its options) with
the data plane's `RelayWorld`, which respects partitions and corrupts a byzantine source's
chunks at a rate itself (its gossip fans out in sorted peer order, so runs replay exactly
whatever PYTHONHASHSEED is). Nothing
of the protocol is reimplemented: fetching, verifying, banning, replanning and recovery are the
transfer core's.

Results: time to all surviving honest relays against the lower bound (of the initial
membership), per-peer completion, and whether every surviving honest relay ends with the
genuine manifest and every chunk.
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass, field
from typing import Any

from p2pnet.core import Publish
from p2pnet.identity import Identity
from relay.manifest import SignedManifest
from relay.messages import HOLDING_TOPIC, MANIFEST_TOPIC, HeldVersion, Holding, ManifestAnnounce
from relay.planner import Membership, lower_bound_s
from relay.effects import SourceDropped, SourcePassedOver, VersionComplete
from relay.serving import ServingConfig
from relay.transfer import TransferConfig, TransferCore
from simulations.broadcast import build_broadcast, fake_manifest, identity
from simulations.dataplane import RelayWorld
from simulations.engine import Engine, quiet_gc
from simulations.models import CRASH, HANG, JOIN, LEAVE, ChurnEvent, network_model
from simulations.scenarios import BroadcastScenario

LAYOUTS = {"relay": ("striped", 4), "tree4": ("tree", 4), "star": ("star", 4), "chain": ("tree", 1),
           "swarm": ("swarm", 4)}
ORIGIN_REGION = "us"


@dataclass
class BroadcastRun:
    """A built broadcast scenario: the world, its peers and what happened to them."""

    scenario: BroadcastScenario
    engine: Engine
    world: RelayWorld
    origin: Identity
    signed: SignedManifest
    config: TransferConfig
    cores: dict[str, TransferCore]
    uploads: dict[str, float]
    regions: dict[str, str]
    initial: list[str]
    byzantine: frozenset[str]
    churn: list[ChurnEvent]
    rng: random.Random
    members: Membership
    downloads: dict[str, float] = field(default_factory=dict)
    slow: frozenset[str] = frozenset()  # deliver 1/slow_factor of the upload they advertise
    view_class: dict[str, int] = field(default_factory=dict)  # relay -> the view it shares
    unseen: list[frozenset[str]] = field(default_factory=list)  # per view class: relays it misses
    fate: dict[str, str] = field(default_factory=dict)  # peer -> leave / crash / hang
    joined: dict[str, float] = field(default_factory=dict)  # joiner -> when
    completed: dict[str, float] = field(default_factory=dict)
    waiting: set[str] = field(default_factory=set)  # live honest relays not complete yet
    replans: int = 0
    _replan_pending: bool = False
    _open: Any = None  # the built world's manifest check (`BroadcastSim.open_frame`)

    # -- the run ------------------------------------------------------------------------------

    def start(self) -> None:
        sc = self.scenario
        self.world.apply(self.origin.peer_id, self.cores[self.origin.peer_id].publish(0.0, self.signed))
        if sc.forge:
            self.engine.at(0.001, self._forge)
        for event in self.churn:
            self.engine.at(event.at_s, self._churn, event)
        if sc.partition.active:
            self.engine.at(sc.partition.start_s, self._cut)
            self.engine.at(sc.partition.end_s, self.world.heal)

    def run(self) -> None:
        settle_s = max([e.at_s for e in self.churn] + [self.scenario.partition.end_s if
                                                       self.scenario.partition.active else 0.0])
        engine = self.engine
        engine.run(until=self.scenario.until_s, stop=lambda: not self.waiting and engine.now >= settle_s)

    # -- what the world does ----------------------------------------------------------------

    def _forge(self) -> None:
        genuine = Holding((HeldVersion(self.signed.version, self.signed.manifest_id),))
        for peer_id in sorted(self.byzantine):
            peer = self.world.peers[peer_id]
            if not peer.alive:
                continue
            forged = fake_manifest(peer.identity, self.signed.manifest.total_bytes,
                                   self.signed.manifest.chunk_bytes, version=self.signed.version)
            self.world.apply(peer_id, [Publish(MANIFEST_TOPIC, ManifestAnnounce(forged.frame)),
                                        Publish(HOLDING_TOPIC, genuine)])

    def _churn(self, event: ChurnEvent) -> None:
        if event.kind == JOIN:
            self._join(event)
        else:
            peer_id = self.initial[event.peer]
            if not self.world.peers[peer_id].alive:
                return
            self.fate[peer_id] = event.kind
            self.waiting.discard(peer_id)
            if event.kind == HANG:
                self.world.hang(peer_id)
            else:  # a clean leave and a crash look alike to the data plane: connections reset
                self.world.crash(peer_id)
        self._schedule_replan()

    def _join(self, event: ChurnEvent) -> None:
        sc = self.scenario
        ident = identity(f"sim/join-{event.peer}")
        peer_id = ident.peer_id
        self.uploads[peer_id] = sc.upload.draw(self.rng)
        self.regions[peer_id] = sc.regions.assign(self.rng, 1)[0]
        core = self._core(peer_id)
        self.world.add_relay_peer(ident, [core], upload_bps=self.uploads[peer_id],
                                  download_bps=sc.download.draw(self.rng), region=self.regions[peer_id])
        self.world.connect(self.origin.peer_id, peer_id)
        # the joiner starts from what the others believe right now (it is not in it: it borrows a parent)
        self.view_class[peer_id] = self.rng.randrange(max(len(self.unseen), 1))
        self.world.apply(peer_id, core.set_members(self.engine.now, self.view_of(peer_id, self.members)))
        self.cores[peer_id] = core
        self.joined[peer_id] = self.engine.now
        self.waiting.add(peer_id)

    def _schedule_replan(self) -> None:
        if not self._replan_pending:
            self._replan_pending = True
            self.engine.after(self.scenario.membership_lag_s, self._replan)

    def _replan(self) -> None:
        self._replan_pending = False
        self.replans += 1
        live = [p for p in self.cores if self.world.peers[p].alive]
        self.members = Membership.of({p: self.uploads[p] for p in live})
        views: dict[int, Membership] = {}
        for peer_id in live:
            self.world.apply(peer_id, self.cores[peer_id].set_members(self.engine.now,
                                                                      self.view_of(peer_id, self.members, views)))

    def view_of(self, peer_id: str, members: Membership, cache: dict[int, Membership] | None = None) -> Membership:
        """`members` as `peer_id` sees them: without the relays its view class misses."""
        cls = self.view_class.get(peer_id)
        if cls is None or not self.unseen or not self.unseen[cls]:
            return members
        view = cache.get(cls) if cache is not None else None
        if view is None:
            unseen = self.unseen[cls]
            view = Membership.of({p: u for p, u in members.uploads.items() if p not in unseen})
            if cache is not None:
                cache[cls] = view
        return view

    def _cut(self) -> None:
        sc = self.scenario
        regions = [self.regions[p] for p in self.initial]
        far = [self.initial[i] for i in sc.partition.cut_off(random.Random(f"partition/{sc.seed}"), regions)]
        self.world.partition([far])

    # -- building ---------------------------------------------------------------------------

    def _core(self, peer_id: str) -> TransferCore:
        return TransferCore(self.config, peer_id, open_frame=self.open_frame, self_upload_bps=self.uploads[peer_id])

    def open_frame(self, frame: bytes, now: float) -> SignedManifest:
        """The origin is the one trusted publisher (each distinct frame is checked once)."""
        return self._open(frame, now)

    def on_event(self, now: float, peer: str, event: object) -> None:
        if isinstance(event, VersionComplete) and peer in self.waiting:
            self.completed[peer] = now
            self.waiting.discard(peer)
        elif isinstance(event, VersionComplete) and peer != self.origin.peer_id:
            self.completed.setdefault(peer, now)


def transfer_config(sc: BroadcastScenario) -> TransferConfig:
    layout, fanout = LAYOUTS.get(sc.strategy, ("tree", sc.tree_fanout))
    return TransferConfig(stripes=sc.stripes, window_per_source=sc.window_per_source,
                          stall_timeout_s=sc.stall_timeout_s, exclude_s=3 * sc.stall_timeout_s,
                          announce_interval_s=sc.announce_interval_s, layout=layout, tree_fanout=fanout,
                          stable_plan=sc.stable_plan)


def build(sc: BroadcastScenario) -> BroadcastRun:
    """The world of `sc`, every relay started and given the membership, nothing published yet."""
    config = transfer_config(sc)
    sim = build_broadcast(sc.peers, sc.checkpoint_bytes, upload_bps=sc.upload.draw,
                          origin_upload_bps=sc.origin_upload_bps, download_bps=sc.download.draw, seed=sc.seed,
                          strategy=None, chunk_bytes=sc.chunk_bytes or None, config=config,
                          corrupt_rate=sc.corrupt_rate, regions=sc.regions.assign, origin_region=ORIGIN_REGION,
                          network=network_model(loss=sc.loss, local_latency_s=sc.local_latency_s,
                                                regional=sc.regional_latency),
                          world_class=RelayWorld, download_ratio=sc.download_ratio, window_bytes=sc.window_bytes,
                          serving=ServingConfig(slots=sc.upload_slots, linger_factor=sc.upload_linger,
                                                linger_cap=sc.upload_linger_cap), pace_uploads=sc.pace_uploads)
    rng = sim.rng
    assert rng is not None
    byzantine = frozenset(rng.sample(sim.peer_ids, round(sc.byzantine * sc.peers)))
    sim.world.corrupt_peers = set(byzantine)
    churn = sc.churn.draw(random.Random(f"churn/{sc.seed}"), sc.peers)
    origin = identity("sim/origin")
    world_rng = random.Random(f"world/{sc.seed}")  # what the real world adds, apart from the draws above
    slow = frozenset(world_rng.sample(sim.peer_ids, round(sc.slow_fraction * sc.peers)))
    for peer_id in sorted(slow):
        sim.world.ports[peer_id].upload_bps /= sc.slow_factor  # advertised (planned with) stays
    run = BroadcastRun(sc, sim.engine, sim.world, origin, sim.signed, config, sim.cores,
                       sim.uploads, sim.regions, list(sim.peer_ids), byzantine, churn, rng,
                       Membership.of(sim.uploads), dict(sim.downloads), slow, _open=sim.open_frame)
    if sc.view_miss > 0:
        classes = min(sc.view_classes, sc.peers)
        run.view_class = {p: world_rng.randrange(classes) for p in sim.peer_ids}
        for cls in range(classes):
            others = [p for p in sim.peer_ids if run.view_class[p] != cls]
            run.unseen.append(frozenset(world_rng.sample(others, round(sc.view_miss * len(others)))))
        views: dict[int, Membership] = {}
        for peer_id in sim.peer_ids:
            sim.world.apply(peer_id, sim.cores[peer_id].set_members(0.0, run.view_of(peer_id, run.members, views)))
    run.waiting = {p for p in sim.peer_ids if p not in byzantine}
    sim.world.listeners.append(run.on_event)
    return run


def run_broadcast(sc: BroadcastScenario) -> tuple[dict[str, Any], list[dict[str, Any]], BroadcastRun]:
    """Run `sc`: (summary for results.json, one row per relay, the finished run)."""
    wall = time.perf_counter()
    with quiet_gc():
        run = build(sc)
        gc.freeze()  # the world built so far lives to the end: keep it out of every collection
        run.start()
        run.run()
    wall_s = time.perf_counter() - wall
    return summarize(run, wall_s), peer_rows(run), run


def summarize(run: BroadcastRun, wall_s: float) -> dict[str, Any]:
    sc = run.scenario
    honest_initial = [p for p in run.initial if p not in run.byzantine]
    survivors = [p for p in honest_initial if p not in run.fate]
    done = [run.completed[p] for p in survivors if p in run.completed]
    joiners = [p for p in run.joined if run.world.peers[p].alive]
    right = [p for p in survivors + joiners if _holds_genuine(run, p)]
    delivered = [run.world.ports[p].upload_bps for p in run.initial]  # what slow relays really upload
    bound = lower_bound_s(sc.checkpoint_bytes, sc.origin_upload_bps, delivered, [run.downloads[p] for p in run.initial])
    origin_sent = run.world.ports[run.origin.peer_id].bytes_up
    finished = max(done) if len(done) == len(survivors) and done else None
    penalised = sorted({peer for _, _, peer, _ in run.world.penalties})
    dropped: dict[str, int] = {}
    passed: dict[str, int] = {}
    for _, _, event in run.world.events:
        if isinstance(event, SourceDropped):
            why = event.why.value  # (the reason's word: the summary is plain data, written as JSON)
            dropped[why] = dropped.get(why, 0) + 1
        elif isinstance(event, SourcePassedOver):  # (in one stripe alone: not a drop)
            passed[event.why.value] = passed.get(event.why.value, 0) + 1
    join_s = [run.completed[p] - run.joined[p] for p in joiners if p in run.completed]
    return {
        "scenario": sc.name,
        "strategy": sc.strategy,
        "seed": sc.seed,
        "peers": sc.peers,
        "checkpoint_bytes": sc.checkpoint_bytes,
        "chunk_bytes": run.signed.manifest.chunk_bytes,
        "chunks": len(run.signed.manifest.chunk_digests),
        "time_to_all_s": _round(finished),
        "lower_bound_s": _round(bound),
        "ratio": _round(finished / bound if finished is not None else None),
        "ratio_to_bound": _round(finished / bound if finished is not None else None),
        "origin_upload_copies": _round(origin_sent / sc.checkpoint_bytes),
        "slow_relays": len(run.slow),
        "view_classes": len(run.unseen),
        "mean_completion_s": _round(sum(done) / len(done) if done else None),
        "survivors": len(survivors),
        "survivors_complete": len(done),
        "survivors_right_checkpoint": sum(1 for p in survivors if p in right),
        "departed": {kind: sum(1 for f in run.fate.values() if f == kind) for kind in (LEAVE, CRASH, HANG)},
        "joined": len(run.joined),
        "joiners_complete": len(join_s),
        "joiners_right_checkpoint": sum(1 for p in joiners if p in right),
        "joiner_mean_time_s": _round(sum(join_s) / len(join_s) if join_s else None),
        "byzantine": len(run.byzantine),
        "byzantine_penalised": sum(1 for p in penalised if p in run.byzantine),
        "honest_penalised": sum(1 for p in penalised if p not in run.byzantine),
        "chunks_accepted_from_byzantine": run.world.genuine_from_corrupt_peers,
        "forged_manifests_rejected": sum(c.rejected_manifests for c in run.cores.values()),
        "sources_dropped": dict(sorted(dropped.items())),
        "sources_passed_over": dict(sorted(passed.items())),
        "replans": run.replans,
        "transfer": dict(sorted(run.world.transfer_stats.items())),
        "messages": dict(sorted(run.world.stats.items())),
        "bytes_moved_over_needed": _round(run.world.transfer_stats["bytes"] / (sc.checkpoint_bytes * sc.peers)),
        "virtual_end_s": _round(run.engine.now),
        "events": run.engine.events_run,
        "wall_s": round(wall_s, 3),
        "fair_share": fair_share_implementation(),  # like wall_s, not a result: which code shared
    }


def fair_share_implementation() -> str:
    """Which fair share the data plane runs: "c" (simulations/_cfairshare.c, built by `make
    sim-accel`) or "python" (simulations.fairshare.python_share); "other" for a substitute."""
    import simulations.dataplane as dataplane
    from simulations.fairshare import python_share

    if dataplane.share is python_share:
        return "python"
    return "c" if str(getattr(dataplane.share, "__module__", "")).endswith("_cfairshare") else "other"


def _holds_genuine(run: BroadcastRun, peer_id: str) -> bool:
    core = run.cores[peer_id]
    signed = core.signed(run.signed.version)
    return signed is not None and signed.manifest_id == run.signed.manifest_id and \
        run.signed.version in core.complete_versions()


def peer_rows(run: BroadcastRun) -> list[dict[str, Any]]:
    rows = []
    for number, peer_id in enumerate(run.initial + list(run.joined)):
        kind = "byzantine" if peer_id in run.byzantine else "joiner" if peer_id in run.joined else "honest"
        done = run.completed.get(peer_id)
        rows.append({
            "peer": number,
            "peer_id": peer_id,
            "kind": kind,
            "region": run.regions[peer_id],
            "upload_bps": round(run.uploads[peer_id], 1),
            "fate": run.fate.get(peer_id, "stayed"),
            "joined_s": _round(run.joined.get(peer_id)),
            "completed_s": _round(done),
        })
    return rows


def _round(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)
