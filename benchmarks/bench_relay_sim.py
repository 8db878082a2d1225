"""Simulated broadcast: time-to-all over the lower bound, striped relay trees vs baselines.

    python benchmarks/bench_relay_sim.py                      # 1,000 peers, 1 GB, 2 MiB chunks
    python benchmarks/bench_relay_sim.py --peers 300 --star   # also the star baseline

Uploads are log-uniform between 100 Mbit/s and 10 Gbit/s, the origin uploads 10 Gbit/s,
downloads are unlimited, one-way latency 5 ms. All strategies run the same transfer core and
the same bandwidth model (simulations.dataplane); only the layout differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.broadcast import simulate_broadcast  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--bytes", type=float, default=1e9)
    parser.add_argument("--chunk-mib", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--star", action="store_true", help="also run the star baseline (slow at 1,000 peers)")
    args = parser.parse_args()
    strategies = ["relay", "tree4"] + (["star"] if args.star else [])
    print(f"{'seed':>4} {'strategy':>8} {'time-to-all s':>13} {'bound s':>8} {'ratio':>6} {'events':>9} {'wall s':>6}")
    for seed in args.seeds:
        for strategy in strategies:
            r = simulate_broadcast(args.peers, int(args.bytes), seed=seed, strategy=strategy,
                                   chunk_bytes=args.chunk_mib * 2**20)
            print(f"{seed:>4} {strategy:>8} {r.time_to_all_s:>13.3f} {r.lower_bound_s:>8.3f} {r.ratio:>6.3f} "
                  f"{r.events:>9} {r.wall_s:>6.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
