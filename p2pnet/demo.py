"""`p2pnet demo`: a small network of real peer processes on loopback, discovering each other.

Starts N peers (`p2pnet peer start` children), the first as bootstrap for the rest, shows live
discovery progress, prints the final peer table of one peer, and stops every child it started
cleanly. The full training network is `p2pnet devnet`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from p2pnet.localnet import start_network, wait_for_full_tables


def register(commands) -> None:
    demo = commands.add_parser("demo", help="start a few peers on loopback and watch them find each other")
    demo.add_argument("--peers", type=int, default=5, help="number of peer processes (default 5)")
    demo.add_argument("--timeout-s", type=float, default=60.0, help="give up after this long")
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    if not 2 <= args.peers <= 50:
        print("p2pnet: error: --peers must be between 2 and 50", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="p2pnet-demo-") as tmp:
        root = Path(tmp)
        started = time.monotonic()
        print(f"starting {args.peers} peers under {root} ...", flush=True)
        peers = start_network(root, args.peers, extra_args=["--heartbeat-interval-s", "0.5"])
        try:
            for p in peers:
                print(f"  {p.name}: {p.addr}", flush=True)

            def progress(known: dict[str, set[str]]) -> None:
                full = sum(len(v) for v in known.values())
                total = args.peers * (args.peers - 1)
                bar = "#" * int(30 * full / total)
                print(f"\r  discovery [{bar:<30}] {full}/{total} table entries", end="", flush=True)

            took = wait_for_full_tables(peers, args.timeout_s, on_progress=progress)
            print(f"\nevery peer knows every other peer after {took:.1f}s", flush=True)
            status = peers[0].status()
            print(f"\npeer table of {peers[0].name} ({status['peer_id']}):")
            print(f"  {'peer id':<54} {'data plane':<22} {'heard':>7}")
            for entry in status["peers"]:
                print(f"  {entry['peer_id']:<54} {entry['data_addr']:<22} {entry['last_heard_s_ago']:>6.1f}s")
        finally:
            print("\nstopping peers ...", flush=True)
            codes = [p.stop() for p in peers]
        clean = all(code == 0 for code in codes)
        print(f"all peers stopped {'cleanly' if clean else f'with exit codes {codes}'} "
              f"({time.monotonic() - started:.1f}s in all)")
        return 0 if clean else 1
