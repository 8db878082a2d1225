"""The relay in the world a real peer sees: disagreeing views, slow peers, capped downloads, TCP windows.

    python benchmarks/bench_relay_world.py                       # 1,000 relays, 1 GB, seed 1
    python benchmarks/bench_relay_world.py --peers 200 --gb 0.2  # a quick look

One run per (world, protocol), all in this process, same seed, same drawn links (log-uniform
uploads 100 Mbit/s-10 Gbit/s, downloads at most 4x upload, three regions, one-way latency
5-110 ms, 6 MiB TCP windows; `simulations.scenarios.BroadcastScenario`). Worlds:

- exact: every relay knows every other (views agree), everyone delivers what it advertises;
- miss1%: each relay's view misses 1% of the others;
- slow10%x10: 10% of the relays deliver a tenth of the upload they advertise;
- default: the scenario's defaults (1% missed, 10% of relays at half their advertised upload).

Protocols: `striped` (stable stripes, the origin sends each stripe once, 16 upload slots: the
relay today), `striped-v1` (stripes dealt by capacity, the origin feeding several children per
stripe, 4 upload slots: the relay before this change, with today's serving core and slow-parent
rule), `tree` (one tree of fan-out 4). Printed: time-to-all over the lower bound
max(S/U_origin, N*S/(U_origin + sum of delivered uploads), S/min(download)), and how many copies
of the checkpoint the origin uploaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.hostile import run_broadcast  # noqa: E402
from simulations.scenarios import broadcast  # noqa: E402

WORLDS = {
    "exact": {"view_miss": 0.0, "slow_fraction": 0.0},
    "miss1%": {"view_miss": 0.01, "slow_fraction": 0.0},
    "slow10%x10": {"view_miss": 0.0, "slow_fraction": 0.1, "slow_factor": 10.0},
    "default": {},
}
PROTOCOLS = {
    "striped": {"strategy": "relay"},
    "striped-v1": {"strategy": "relay", "stable_plan": False, "upload_slots": 4},
    "tree": {"strategy": "tree4"},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--worlds", nargs="+", choices=sorted(WORLDS), default=list(WORLDS))
    parser.add_argument("--protocols", nargs="+", choices=sorted(PROTOCOLS), default=list(PROTOCOLS))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    print(f"{'world':>11} {'protocol':>10} {'time s':>8} {'bound s':>8} {'ratio':>6} {'origin copies':>13} "
          f"{'slow drops':>10} {'stall drops':>11} {'wall s':>6}", flush=True)
    for world, changes in ((w, WORLDS[w]) for w in args.worlds):
        for protocol, settings in ((p, PROTOCOLS[p]) for p in args.protocols):
            sc = dataclasses.replace(broadcast(args.peers, args.seed), checkpoint_bytes=int(args.gb * 1e9),
                                     **changes, **settings)
            s, _, _ = run_broadcast(sc)
            dropped = s["sources_dropped"]
            row = {"world": world, "protocol": protocol, **{k: s[k] for k in (
                "peers", "checkpoint_bytes", "chunks", "time_to_all_s", "lower_bound_s", "ratio_to_bound",
                "origin_upload_copies", "events", "wall_s")}, "sources_dropped": dropped}
            rows.append(row)
            print(f"{world:>11} {protocol:>10} {s['time_to_all_s']:>8.2f} {s['lower_bound_s']:>8.2f} "
                  f"{s['ratio_to_bound']:>6.2f} {s['origin_upload_copies']:>13.2f} {dropped.get('slow', 0):>10} "
                  f"{dropped.get('stalled', 0):>11} {s['wall_s']:>6.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
