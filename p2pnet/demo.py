"""`p2pnet demo`: a small network of real peer processes on loopback, discovering each other.

Starts N peers (`p2pnet peer start` children), the first as bootstrap for the rest, shows live
discovery progress, prints the final peer table of one peer, and stops every child it started
cleanly. The full training network is `p2pnet devnet`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from p2pnet.cliargs import command
from p2pnet.errors import ConfigError
from p2pnet.localnet import start_network, wait_for_full_tables


def register(commands) -> None:
    demo = command(commands, "demo", "start a few peers on loopback and watch them find each other",
                   description="Peer processes (`p2pnet peer start` children) in a temporary folder, the first as "
                   "bootstrap for the rest; shows discovery progress and one peer's table, then stops them. The "
                   "whole training network is `p2pnet devnet`.",
                   example="p2pnet demo --peers 8")
    demo.add_argument("--peers", type=int, default=5, metavar="N", help="number of peer processes, 2-50 (default 5)")
    demo.add_argument("--timeout-s", type=float, default=60.0, metavar="S",
                      help="give up after this long (default 60)")
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    if not 2 <= args.peers <= 50:
        raise ConfigError("--peers", "must be between 2 and 50")
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
