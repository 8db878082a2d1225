"""Broadcast at scale: one 10 GB checkpoint to 10,000 relay peers, the real transfer core, in a minute.

`simulate_at_scale(peers, checkpoint_bytes, ...)` is `simulations.broadcast` with the settings a
run of this size needs, and it measures the simulator itself: wall and CPU seconds (building the
world and running it), peak resident memory, engine events and events per second, next to the
usual time-to-all over the lower bound.

What differs from `simulate_broadcast`'s defaults, and why:

- Coarser chunks. The simulator's cost is per chunk delivered (20-30 us of Python for the
  core's `fetched` and next `Fetch` plus the bandwidth model's two events), so 10,000 peers x
  10 GB in the real 2 MiB chunks would be 48 M deliveries, most of an hour. The simulated
  world cuts the checkpoint into about `target_chunks` (150) chunks of whole MiB instead:
  64 MiB for 10 GB (the manifest's largest chunk), 1.5 M deliveries. Coarse chunks cost
  ratio: a chunk is forwarded only once verified, so the pipelining term (tree depth x one
  chunk time at the stripe rate) grows with the chunk; `benchmarks/results/sim_scale.md`
  shows the effect at 1,000 peers, where both chunkings can be run.
- A stall timeout scaled to the chunk time: a 38 MiB chunk at the stripe rate takes a few
  seconds, and a leaf queued behind its parent's forwarding children can wait several chunk
  times, so the 10 s default would exclude healthy parents. No failures are injected here.
- Nothing else: the same `TransferCore`, striped plan, Holding messages to children on
  completion, long polls and processor-shared uploads as every other broadcast run.
"""

from __future__ import annotations

import gc
import math
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

from relay.manifest import MAX_CHUNK_BYTES
from relay.effects import SourceDropped
from relay.transfer import TransferConfig
from simulations.broadcast import MBIT, BroadcastResult, build_broadcast, run_broadcast_sim
from simulations.engine import quiet_gc

MIB = 2**20


def scale_chunk_bytes(checkpoint_bytes: int, target_chunks: int = 150) -> int:
    """The smallest whole-MiB chunk that cuts the checkpoint into at most `target_chunks`
    (never above the manifest's limit, `MAX_CHUNK_BYTES`, 64 MiB)."""
    return min(MAX_CHUNK_BYTES, max(1, math.ceil(checkpoint_bytes / target_chunks / MIB)) * MIB)


def scale_config(chunk_bytes: int, child_rate_bps: float, stripes: int = 16) -> TransferConfig:
    """The broadcast config with the stall timeout stretched to ten chunk times at
    `child_rate_bps` (about what a child gets from its parent), never below the 10 s default."""
    stall_s = max(10.0, 10 * chunk_bytes / child_rate_bps)
    return TransferConfig(stripes=stripes, stall_timeout_s=stall_s, exclude_s=3 * stall_s,
                          announce_interval_s=3600.0)


@dataclass
class ScaleResult:
    broadcast: BroadcastResult
    chunks: int
    stripes: int
    build_s: float
    run_s: float
    cpu_s: float
    peak_rss_mib: float
    sources_dropped: int

    @property
    def wall_s(self) -> float:
        return self.build_s + self.run_s

    @property
    def events_per_s(self) -> float:
        return self.broadcast.events / self.run_s if self.run_s > 0 else 0.0

    def row(self) -> dict[str, Any]:
        b = self.broadcast
        return {"peers": b.peers, "checkpoint_bytes": b.checkpoint_bytes, "chunk_bytes": b.chunk_bytes,
                "chunks": self.chunks, "stripes": self.stripes, "time_to_all_s": round(b.time_to_all_s, 3),
                "lower_bound_s": round(b.lower_bound_s, 3), "ratio": round(b.ratio, 4),
                "events": b.events, "deliveries": b.stats.get("flows", 0), "build_s": round(self.build_s, 2),
                "run_s": round(self.run_s, 2), "wall_s": round(self.wall_s, 2), "cpu_s": round(self.cpu_s, 2),
                "events_per_s": round(self.events_per_s), "peak_rss_mib": round(self.peak_rss_mib, 1),
                "sources_dropped": self.sources_dropped}


def simulate_at_scale(peers: int = 10_000, checkpoint_bytes: int = 10**10, *, seed: int = 1,
                      target_chunks: int = 150, chunk_bytes: int | None = None, stripes: int = 16,
                      upload_bps_range: tuple[float, float] = (100 * MBIT, 10_000 * MBIT),
                      origin_upload_bps: float = 10_000 * MBIT, until_s: float = 1e6) -> ScaleResult:
    """One broadcast of `checkpoint_bytes` to `peers` relays, with the simulator's own costs."""
    chunk_bytes = chunk_bytes or scale_chunk_bytes(checkpoint_bytes, target_chunks)
    low, high = upload_bps_range
    mean_upload = (high - low) / math.log(high / low) if high > low else low  # of the log-uniform draw
    config = scale_config(chunk_bytes, mean_upload / stripes, stripes)
    cpu = time.process_time()
    wall = time.perf_counter()
    with quiet_gc():
        sim = build_broadcast(peers, checkpoint_bytes, upload_bps=upload_bps_range,
                              origin_upload_bps=origin_upload_bps, seed=seed, chunk_bytes=chunk_bytes, config=config)
        gc.freeze()  # the world built so far lives to the end: keep it out of every collection
        built = time.perf_counter()
        result = run_broadcast_sim(sim, seed=seed, until_s=until_s, started=wall)
        run_s = time.perf_counter() - built
    dropped = sum(1 for _, _, event in sim.world.events if isinstance(event, SourceDropped))
    return ScaleResult(result, len(sim.signed.manifest.chunk_digests), config.stripes, built - wall, run_s,
                       time.process_time() - cpu, peak_rss_mib(), dropped)


def peak_rss_mib() -> float:
    """This process's peak resident memory (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024
