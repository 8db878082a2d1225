"""The relay in the world a real peer sees: disagreeing views, slow peers, capped downloads, TCP windows.

    python benchmarks/bench_relay_world.py                       # 1,000 relays, 1 GB, seed 1
    python benchmarks/bench_relay_world.py --peers 200 --gb 0.2  # a quick look
    python benchmarks/bench_relay_world.py --mww                 # homogeneous: against the optimum

One run per (world, protocol), all in this process, same seed, same drawn links (log-uniform
uploads 100 Mbit/s-10 Gbit/s, downloads at most 4x upload, three regions, one-way latency
5-110 ms, 6 MiB TCP windows; `simulations.scenarios.BroadcastScenario`). Worlds:

- exact: every relay knows every other (views agree), everyone delivers what it advertises;
- miss1%: each relay's view misses 1% of the others;
- slow10%x10: 10% of the relays deliver a tenth of the upload they advertise;
- default: the scenario's defaults (1% missed, 10% of relays at half their advertised upload).

`--mww` instead runs the homogeneous case with a known optimum: N = 1,023 relays and the origin
all at 1 Gbit/s up and down, no TCP window, 0.5 ms latency, the checkpoint in 64 and 256
chunks, with exact views and with each view missing 1% of the others (`miss1%`); Mundinger,
Weber and Weiss's optimal schedule takes (1 + floor(log2 N) / M) S/U.

Protocols: `striped` (stable stripes, the origin sends each stripe once, 16 upload slots: the
relay today), `striped-v1` (stripes dealt by capacity, the origin feeding several children per
stripe, 4 upload slots: the relay before this change, with today's serving core and slow-parent
rule), `tree` (one tree of fan-out 4), `swarm` (a BitTorrent-style baseline run by the same
transfer core: no plan, chunk bitmaps sent to 8 hashed neighbours at most every 0.2 s,
rarest-first pulls from any neighbour known to hold a chunk, no tit-for-tat). Printed: time-to-all over the lower bound
max(S/U_origin, N*S/(U_origin + sum of delivered uploads), S/min(download)), and how many copies
of the checkpoint the origin uploaded.
"""

from __future__ import annotations

import argparse
import math
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relay.effects import DropReason  # noqa: E402
from simulations.hostile import run_broadcast  # noqa: E402
from simulations.models import GBIT, Bandwidth  # noqa: E402
from simulations.scenarios import EXACT_WORLD, broadcast, with_params  # noqa: E402

WORLDS: dict[str, dict[str, Any]] = {
    "exact": {"view_miss": 0.0, "slow_fraction": 0.0},
    "miss1%": {"view_miss": 0.01, "slow_fraction": 0.0},
    "slow10%x10": {"view_miss": 0.0, "slow_fraction": 0.1, "slow_factor": 10.0},
    "default": {},
}
PROTOCOLS: dict[str, dict[str, Any]] = {
    "striped": {"strategy": "relay"},
    "striped-v1": {"strategy": "relay", "stable_plan": False, "upload_slots": 4},
    "tree": {"strategy": "tree4"},
    "swarm": {"strategy": "swarm"},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--worlds", nargs="+", choices=sorted(WORLDS), default=list(WORLDS))
    parser.add_argument("--protocols", nargs="+", choices=sorted(PROTOCOLS), default=list(PROTOCOLS))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--mww", action="store_true", help="the homogeneous case against its optimum")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="also plot the ratios (matplotlib)")
    parser.add_argument("--no-pace", dest="pace", action="store_false",
                        help="relays share their upload among every chunk they serve at once instead of pacing "
                             "what they serve at their advertised upload as the relay role does (the default)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a scenario setting for every run (`simulations.scenarios.BroadcastScenario`), "
                             "e.g. upload_linger=0")
    args = parser.parse_args()
    args.set = dict(spec.split("=", 1) for spec in args.set)
    if args.mww:
        return mww(args)
    rows = []
    print(f"{'world':>11} {'protocol':>10} {'time s':>8} {'bound s':>8} {'ratio':>6} {'origin copies':>13} "
          f"{'slow drops':>10} {'stall drops':>11} {'wall s':>6}", flush=True)
    for world, changes in ((w, WORLDS[w]) for w in args.worlds):
        for protocol, settings in ((p, PROTOCOLS[p]) for p in args.protocols):
            sc = dataclasses.replace(broadcast(args.peers, args.seed), checkpoint_bytes=int(args.gb * 1e9),
                                     pace_uploads=args.pace, **changes, **settings)
            s, _, _ = run_broadcast(with_params(sc, args.set))
            dropped = s["sources_dropped"]
            row = {"world": world, "protocol": protocol, **{k: s[k] for k in (
                "peers", "checkpoint_bytes", "chunks", "time_to_all_s", "lower_bound_s", "ratio_to_bound",
                "origin_upload_copies", "events", "wall_s")}, "sources_dropped": dropped}
            rows.append(row)
            print(f"{world:>11} {protocol:>10} {s['time_to_all_s']:>8.2f} {s['lower_bound_s']:>8.2f} "
                  f"{s['ratio_to_bound']:>6.2f} {s['origin_upload_copies']:>13.2f} "
                  f"{dropped.get(DropReason.SLOW, 0):>10} {dropped.get(DropReason.STALLED, 0):>11} "
                  f"{s['wall_s']:>6.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = list(dict.fromkeys(r["world"] for r in rows))
    protocols = list(dict.fromkeys(r["protocol"] for r in rows))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(protocols)
    for i, protocol in enumerate(protocols):
        mine = {r["world"]: r for r in rows if r["protocol"] == protocol}
        xs = [w + i * width for w in range(len(worlds))]
        ax.bar(xs, [mine[w]["ratio_to_bound"] for w in worlds], width, label=protocol)
        bx.bar(xs, [mine[w]["origin_upload_copies"] for w in worlds], width, label=protocol)
    for axis, title in ((ax, "time to all / lower bound (log)"), (bx, "copies the origin uploaded (log)")):
        axis.set_xticks([w + 0.4 - width / 2 for w in range(len(worlds))], worlds)
        axis.set_yscale("log")
        axis.set_title(title)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.legend()
    n = rows[0]["peers"]
    fig.suptitle(f"{n} relays, {rows[0]['checkpoint_bytes'] / 1e9:g} GB: the relay in the world a real peer sees")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def mww(args: argparse.Namespace) -> int:
    peers, total = 1023, int(args.gb * 1e9)
    rows = []
    print(f"{'chunks':>6} {'views':>7} {'protocol':>10} {'time s':>8} {'optimum s':>9} {'ratio':>6} "
          f"{'origin copies':>13} {'wall s':>6}", flush=True)
    for chunks in (64, 256):
        optimum = (1 + math.floor(math.log2(peers)) / chunks) * total / GBIT
        for views, miss in (("exact", 0.0), ("miss1%", 0.01)):
            for protocol, settings in ((p, PROTOCOLS[p]) for p in args.protocols):
                sc = dataclasses.replace(broadcast(peers, args.seed), checkpoint_bytes=total,
                                         chunk_bytes=-(-total // chunks), upload=Bandwidth.fixed(GBIT),
                                         origin_upload_bps=GBIT, regional_latency=False, local_latency_s=0.0005,
                                         pace_uploads=args.pace,
                                         **{**EXACT_WORLD, "download_ratio": 1.0, "view_miss": miss}, **settings)
                s, _, _ = run_broadcast(with_params(sc, args.set))
                rows.append({"chunks": chunks, "views": views, "protocol": protocol,
                             "time_to_all_s": s["time_to_all_s"], "optimum_s": round(optimum, 6),
                             "ratio_to_optimum": round(s["time_to_all_s"] / optimum, 4),
                             "origin_upload_copies": s["origin_upload_copies"], "wall_s": s["wall_s"]})
                r = rows[-1]
                print(f"{chunks:>6} {views:>7} {protocol:>10} {r['time_to_all_s']:>8.2f} {optimum:>9.2f} "
                      f"{r['ratio_to_optimum']:>6.2f} {r['origin_upload_copies']:>13.2f} {r['wall_s']:>6.1f}",
                      flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
