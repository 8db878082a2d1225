"""The simulator at scale: one 10 GB checkpoint to 10,000 relay peers with the real transfer core.

    python benchmarks/bench_sim_scale.py                    # 10,000 peers / 10 GB, then 1,000 / 1 GB
    python benchmarks/bench_sim_scale.py --only 1000        # just the comparison row
    python benchmarks/bench_sim_scale.py --chunking         # also 1,000 peers in 2 MiB chunks
    python benchmarks/bench_sim_scale.py --chunks 256       # finer chunks: better ratio, slower

Uploads log-uniform between 100 Mbit/s and 10 Gbit/s, origin 10 Gbit/s, downloads unlimited,
5 ms one-way latency, 16 stripes, about 150 chunks per checkpoint (`simulations.scale`). Each
row runs in its own process, so peak memory (ru_maxrss) is that run's alone. Wall time is
building the world plus running it; CPU time is the same span in process time (this machine is
shared: when wall is well above CPU, someone else had the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {10_000: 10**10, 1_000: 10**9}
COLUMNS = (("peers", "peers", 6), ("GB", "gb", 4), ("chunk MiB", "chunk_mib", 9), ("chunks", "chunks", 6),
           ("time-to-all s", "time_to_all_s", 13), ("bound s", "lower_bound_s", 8), ("ratio", "ratio", 6),
           ("events", "events", 9), ("events/s", "events_per_s", 8), ("build s", "build_s", 7),
           ("run s", "run_s", 6), ("wall s", "wall_s", 6), ("cpu s", "cpu_s", 6), ("peak MiB", "peak_rss_mib", 8))


def one(peers: int, total: int, seed: int, chunk_mib: int | None, chunks: int) -> dict:
    from simulations.scale import simulate_at_scale

    r = simulate_at_scale(peers, total, seed=seed, target_chunks=chunks,
                          chunk_bytes=chunk_mib * 2**20 if chunk_mib else None)
    return r.row()


def in_subprocess(peers: int, total: int, seed: int, chunk_mib: int | None, chunks: int) -> dict:
    """One run in a fresh interpreter (so ru_maxrss is its own); PYTHONHASHSEED fixed for replay."""
    cmd = [sys.executable, __file__, "--child", str(peers), str(total), str(seed), str(chunk_mib or 0), str(chunks)]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def show(row: dict) -> str:
    row = {**row, "gb": row["checkpoint_bytes"] / 1e9, "chunk_mib": row["chunk_bytes"] / 2**20}
    return " ".join(f"{_fmt(row[key]):>{width}}" for _, key, width in COLUMNS)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if value < 10 else f"{value:.1f}"
    return str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", type=int, choices=sorted(CASES), help="run one of the two sizes")
    parser.add_argument("--chunking", action="store_true", help="also 1,000 peers in the real 2 MiB chunks")
    parser.add_argument("--chunks", type=int, default=150, help="about this many chunks per checkpoint")
    parser.add_argument("--child", nargs=5, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        peers, total, seed, chunk_mib, chunks = args.child
        print(json.dumps(one(peers, total, seed, chunk_mib or None, chunks)), flush=True)
        return 0
    print(" ".join(f"{title:>{width}}" for title, _, width in COLUMNS), flush=True)
    runs: list[tuple[int, int, int | None]] = [(p, t, None) for p, t in CASES.items() if args.only in (None, p)]
    if args.chunking:
        runs.append((1_000, 10**9, 2))
    for peers, total, chunk_mib in runs:
        print(show(in_subprocess(peers, total, args.seed, chunk_mib, args.chunks)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
