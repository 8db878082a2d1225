"""Broadcast experiments: one checkpoint from an origin to N relay peers, in virtual time.

`simulate_broadcast(peers, checkpoint_bytes, ...)` builds a `RelayWorld` of N+1 peers, each
running the real `relay.transfer.TransferCore`, gives them upload capacities drawn from a
distribution (log-uniform between 100 Mbit/s and 10 Gbit/s by default), publishes a signed
manifest from the origin and runs until every peer holds every chunk. It reports time-to-all
against the lower bound max(S/U_origin, N*S/(U_origin + sum of uploads)) (`relay.planner`).

Strategies run the same core and the same bandwidth model; only the layout differs:
`relay` (striped capacity-weighted trees, the default), `tree4` (one pipelined tree of fan-out
4, fastest peers nearest the root) and `star` (every peer pulls from the origin).

`build_broadcast` returns the world before it runs, for tests that crash, hang or corrupt peers
and for `simulations.hostile`, which builds its scenarios with it (regions, per-relay downloads,
its own world class, network model, stall timeout, corruption rate).
Run from a shell: `python -m simulations.broadcast --peers 1000 --bytes 1e9 --seed 1`.
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import blake3

from p2pnet.identity import Identity
from relay.errors import ManifestRejected
from relay.manifest import FileEntry, Manifest, SignedManifest, open_manifest, sign_manifest
from relay.planner import Membership, lower_bound_s
from relay.effects import VersionComplete
from relay.serving import ByteBudget, ServingConfig
from relay.transfer import TransferConfig, TransferCore
from simulations.dataplane import RelayWorld
from simulations.engine import Engine
from simulations.world import EPOCH_S, NetworkModel

MBIT = 1e6 / 8
STRATEGIES: dict[str, dict[str, Any]] = {"relay": {"layout": "striped"}, "tree4": {"layout": "tree", "tree_fanout": 4},
              "star": {"layout": "star"}, "swarm": {"layout": "swarm"}}
_IDENTITIES: dict[str, Identity] = {}


@dataclass
class BroadcastResult:
    strategy: str
    peers: int
    checkpoint_bytes: int
    chunk_bytes: int
    time_to_all_s: float
    lower_bound_s: float
    ratio: float
    per_peer_completion: dict[str, float]
    wall_s: float
    events: int
    stats: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        return (f"{self.strategy:>6}: {self.peers} peers, {self.checkpoint_bytes / 1e9:.2f} GB in "
                f"{self.chunk_bytes / 2**20:.0f} MiB chunks: all done at {self.time_to_all_s:.2f}s, bound "
                f"{self.lower_bound_s:.2f}s, ratio {self.ratio:.3f} ({self.events} events, {self.wall_s:.1f}s wall)")


@dataclass
class BroadcastSim:
    engine: Engine
    world: RelayWorld
    origin: str
    peer_ids: list[str]
    cores: dict[str, TransferCore]
    uploads: dict[str, float]
    signed: SignedManifest
    completed: dict[str, float]
    config: TransferConfig | None = None
    regions: dict[str, str] = field(default_factory=dict)
    rng: random.Random | None = None  # drew uploads, downloads and regions; draw what comes next from it
    open_frame: Callable[[bytes, float], SignedManifest] | None = None  # trusts the origin alone
    downloads: dict[str, float] = field(default_factory=dict)

    def publish(self) -> None:
        self.world.apply(self.origin, self.cores[self.origin].publish(self.engine.now, self.signed))

    def done(self, among: list[str] | None = None) -> bool:
        among = among if among is not None else self.peer_ids
        return all(p in self.completed for p in among)


class _SimIdentity(Identity):
    """An `Identity` whose peer id is encoded once (base58 costs ~50 us; a 10,000-peer world
    asks for each peer's id several times while it is built)."""

    @functools.cached_property
    def peer_id_bytes(self) -> bytes:
        return Identity.peer_id_bytes.fget(self)  # type: ignore[attr-defined]

    @functools.cached_property
    def peer_id(self) -> str:
        return Identity.peer_id.fget(self)  # type: ignore[attr-defined]


def identity(name: str) -> Identity:
    found = _IDENTITIES.get(name)
    if found is None:
        found = _IDENTITIES[name] = _SimIdentity.from_seed_text(name)
    return found


def log_uniform(low: float, high: float) -> Callable[[random.Random], float]:
    return lambda rng: math.exp(rng.uniform(math.log(low), math.log(high)))


def fake_manifest(publisher: Identity, total_bytes: int, chunk_bytes: int, version: int = 1) -> SignedManifest:
    """A signed manifest of one file with made-up chunk digests (the simulator moves no bytes)."""
    count = -(-total_bytes // chunk_bytes)
    digests = tuple(blake3.blake3(f"{version}/{i}".encode()).digest() for i in range(count))
    manifest = Manifest("sim-model", version, version - 1, (FileEntry("model.safetensors", total_bytes, 0, ()),),
                        chunk_bytes, total_bytes, digests, int(EPOCH_S * 1000))
    return sign_manifest(publisher, manifest, EPOCH_S)


def default_chunk_bytes(checkpoint_bytes: int) -> int:
    """About 256 chunks, between 1 MiB and 64 MiB, a multiple of 1 MiB."""
    mib = 2**20
    return int(min(64, max(1, round(checkpoint_bytes / 256 / mib)))) * mib


def build_broadcast(
    peers: int,
    checkpoint_bytes: int,
    *,
    upload_bps: Callable[[random.Random], float] | tuple[float, float] = (100 * MBIT, 10_000 * MBIT),
    origin_upload_bps: float = 10_000 * MBIT,
    download_bps: float | Callable[[random.Random], float] = math.inf,
    seed: int = 0,
    strategy: str | None = "relay",
    chunk_bytes: int | None = None,
    latency_s: float = 0.005,
    config: TransferConfig | None = None,
    corrupt: frozenset[str] = frozenset(),
    corrupt_rate: float = 1.0,
    regions: Callable[[random.Random, int], Sequence[str]] | Sequence[str] | None = None,
    origin_region: str = "eu",
    network: NetworkModel | None = None,
    world_class: type[RelayWorld] = RelayWorld,
    stall_timeout_s: float | None = None,
    download_ratio: float = math.inf,
    window_bytes: float = math.inf,
    serving: ServingConfig | None = None,
    pace_uploads: bool = True,
) -> BroadcastSim:
    """The world of one broadcast, every relay started and given the membership, nothing published.

    Per relay, drawn from `random.Random(seed)` in this order (`sim.rng` goes on from there):
    its upload (`upload_bps`: a (low, high) log-uniform range or a draw), its download
    (`download_bps`: one rate for all, or a draw), its region (`regions`: one per relay, or
    `assign(rng, n)`; default: all in `origin_region`). `network` replaces the plain model of
    `latency_s`; `world_class` is a `RelayWorld` subclass. `strategy` None keeps `config`'s
    layout; `stall_timeout_s` sets the stall timeout (and excludes a stalled source for 3x that).
    `corrupt` peers serve each chunk corrupt with probability `corrupt_rate`. A relay's download
    is at most `download_ratio` times its upload (1: symmetric links); `window_bytes` limits
    each connection to window / round trip (TCP). `pace_uploads`: each relay paces what it serves
    at its upload, as the relay role does (`relay.serving.ByteBudget`; see `simulations.dataplane`)."""
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}")
    draw = log_uniform(*upload_bps) if isinstance(upload_bps, tuple) else upload_bps
    rng = random.Random(seed)
    chunk_bytes = chunk_bytes or default_chunk_bytes(checkpoint_bytes)
    engine = Engine(seed)
    world = world_class(engine, network or NetworkModel(local_latency_s=latency_s), corrupt_peers=corrupt,
                        corrupt_rate=corrupt_rate, corrupt_seed=str(seed), window_bytes=window_bytes,
                        serving=serving, pace_uploads=pace_uploads)
    origin = identity("sim/origin")
    ids = [identity(f"sim/peer-{i}") for i in range(peers)]
    uploads = {origin.peer_id: float(origin_upload_bps)}
    uploads.update({i.peer_id: float(draw(rng)) for i in ids})
    downloads = [download_bps(rng) for _ in ids] if callable(download_bps) else [download_bps] * peers
    downloads = [min(d, uploads[i.peer_id] * download_ratio) for i, d in zip(ids, downloads)]
    placed = regions(rng, peers) if callable(regions) else regions or [origin_region] * peers
    where = {origin.peer_id: origin_region, **{i.peer_id: r for i, r in zip(ids, placed)}}
    signed = fake_manifest(origin, checkpoint_bytes, chunk_bytes)
    opened: dict[bytes, SignedManifest | ManifestRejected] = {}

    def open_frame(frame: bytes, now: float) -> SignedManifest:
        """Every peer would open the same frame: check each once and keep the outcome."""
        outcome = opened.get(frame)
        if outcome is None:
            try:
                outcome = open_manifest(frame, trusted_publishers={origin.peer_id}, now_s=EPOCH_S + now)
            except ManifestRejected as exc:
                outcome = exc
            opened[frame] = outcome
        if isinstance(outcome, ManifestRejected):
            raise outcome
        return outcome

    base = config or TransferConfig(stall_timeout_s=10.0, exclude_s=30.0, announce_interval_s=3600.0)
    changes = dict(STRATEGIES[strategy]) if strategy is not None else {}
    if stall_timeout_s is not None:
        changes.update(stall_timeout_s=stall_timeout_s, exclude_s=3 * stall_timeout_s)
    cfg = TransferConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, **changes})
    cores: dict[str, TransferCore] = {}
    for ident, download in [(origin, math.inf)] + list(zip(ids, downloads)):
        core = TransferCore(cfg, ident.peer_id, open_frame=open_frame, self_upload_bps=uploads[ident.peer_id])
        cores[ident.peer_id] = core
        world.add_relay_peer(ident, [core], upload_bps=uploads[ident.peer_id], download_bps=download,
                             region=where[ident.peer_id])
    for ident in ids:
        world.connect(origin.peer_id, ident.peer_id)
    members = Membership.of(uploads)
    for peer_id, core in cores.items():
        world.apply(peer_id, core.set_members(engine.now, members))
    sim = BroadcastSim(engine, world, origin.peer_id, [i.peer_id for i in ids], cores, uploads, signed, {},
                       cfg, where, rng, open_frame, {i.peer_id: d for i, d in zip(ids, downloads)})

    def on_event(now: float, peer: str, event: object) -> None:
        if isinstance(event, VersionComplete) and peer != origin.peer_id:
            sim.completed[peer] = now

    world.listeners.append(on_event)
    return sim


def simulate_broadcast(
    peers: int,
    checkpoint_bytes: int,
    upload_bps_range: tuple[float, float] | Callable[[random.Random], float] = (100 * MBIT, 10_000 * MBIT),
    origin_upload_bps: float = 10_000 * MBIT,
    seed: int = 0,
    strategy: str = "relay",
    *,
    chunk_bytes: int | None = None,
    download_bps: float = math.inf,
    latency_s: float = 0.005,
    config: TransferConfig | None = None,
    until_s: float = 1e6,
) -> BroadcastResult:
    """Send `checkpoint_bytes` from an origin to `peers` peers; time-to-all against the bound."""
    wall = time.perf_counter()
    sim = build_broadcast(peers, checkpoint_bytes, upload_bps=upload_bps_range, origin_upload_bps=origin_upload_bps,
                          download_bps=download_bps, seed=seed, strategy=strategy, chunk_bytes=chunk_bytes,
                          latency_s=latency_s, config=config)
    return run_broadcast_sim(sim, strategy=strategy, seed=seed, until_s=until_s, started=wall)


def advertise_lies(sim: BroadcastSim, liars: Sequence[str], claim: float | None, real_bps: float | None,
                   hide_queue: bool = False) -> None:
    """Make `liars` advertise `claim` bytes/s of upload (None: their true figure) and deliver
    `real_bps` (None: their drawn upload): their link and their pacing. Every core is handed the
    advertised membership, as every real peer reads the same signed heartbeats. `hide_queue`:
    their answers report no queue time either (`RelayWorld.hide_queue_peers`)."""
    if hide_queue:
        sim.world.hide_queue_peers.update(liars)
    for liar in liars:
        if real_bps is not None:
            port = sim.world.ports[liar]
            port.upload_bps, port.budget = real_bps, ByteBudget(real_bps)
    claims = {liar: claim if claim is not None else sim.uploads[liar] for liar in liars}
    advertised = Membership.of({**sim.uploads, **claims})
    for peer, core in sim.cores.items():
        sim.world.apply(peer, core.set_members(0.0, advertised))


def run_broadcast_sim(sim: BroadcastSim, *, strategy: str = "relay", seed: int = 0, until_s: float = 1e6,
                      started: float | None = None) -> BroadcastResult:
    """Publish on a built `sim` and run until every peer completes (wall time from `started`)."""
    wall = time.perf_counter() if started is None else started
    peers = len(sim.peer_ids)
    sim.publish()
    sim.engine.run(until=until_s, stop=lambda: len(sim.completed) == peers)
    if len(sim.completed) < peers:
        raise RuntimeError(f"seed {seed}: only {len(sim.completed)} of {peers} peers completed by {until_s}s")
    finished = max(sim.completed.values())
    total = sim.signed.manifest.total_bytes
    links = sim.world.ports  # the uploads as simulated, not as drawn (`advertise_lies` changes some)
    bound = lower_bound_s(total, links[sim.origin].upload_bps, [links[p].upload_bps for p in sim.peer_ids],
                          [sim.downloads[p] for p in sim.peer_ids])
    return BroadcastResult(strategy, peers, total, sim.signed.manifest.chunk_bytes, finished, bound,
                           finished / bound, dict(sim.completed), time.perf_counter() - wall,
                           sim.engine.events_run, dict(sim.world.transfer_stats))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Simulate one checkpoint broadcast and compare it to the bound.")
    parser.add_argument("--peers", type=int, default=100)
    parser.add_argument("--bytes", type=float, default=1e9, help="checkpoint size in bytes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy", choices=sorted(STRATEGIES) + ["all"], default="all")
    parser.add_argument("--chunk-mib", type=int, help="chunk size (default: about 256 chunks)")
    parser.add_argument("--origin-gbit", type=float, default=10.0, help="origin upload, Gbit/s")
    args = parser.parse_args(argv)
    strategies = sorted(STRATEGIES) if args.strategy == "all" else [args.strategy]
    for strategy in strategies:
        result = simulate_broadcast(args.peers, int(args.bytes), origin_upload_bps=args.origin_gbit * 1000 * MBIT,
                                    seed=args.seed, strategy=strategy,
                                    chunk_bytes=args.chunk_mib * 2**20 if args.chunk_mib else None)
        print(result.summary(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
