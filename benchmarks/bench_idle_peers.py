"""What a network of relay peers costs doing nothing: CPU per second of N idle peer processes.

    python benchmarks/bench_idle_peers.py [--peers 9] [--seconds 10] [--rounds 1]

Starts `--peers` `p2pnet peer start --role relay` processes the way the loopback race does (peer 0
as everyone's bootstrap and trusted publisher, the same relay config), waits until every peer
table is full and a few seconds more, then reads each process's CPU (/proc/PID/stat) over
`--seconds`. Prints CPU-s per second for all peers together (user and system) and per peer. With
no transfer under way, all of it is the background: peer-table heartbeats, GossipSub's own
heartbeat and mesh upkeep, and py-libp2p's stream handling for both. Compare settings by running
it with different environments (for example `PY_YAMUX_RELEASE_ON_READ=1`, py-libp2p's default)
or with `--config-extra` (TOML appended to every peer's config file), for example

    python benchmarks/bench_idle_peers.py --config-extra $'[peertable]\nheartbeat_interval_s = 20\nexpiry_s = 100\n'
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_relay_loopback import cpu_s  # noqa: E402
from p2pnet.localnet import peer_id_of, start_peer, wait_for_full_tables  # noqa: E402

SETTLE_S = 3.0


def idle_round(peers: int, seconds: float, config_extra: str = "") -> tuple[float, float, list[float]]:
    """(user, system) CPU-s per second of all peers together, and each peer's total per second."""
    work = Path(tempfile.mkdtemp(prefix="bench-idle-"))
    root = work / "p2pnet"
    config = root / "relay.toml"
    procs = []
    try:
        publisher = peer_id_of(root / "peer0")
        config.write_text(f'[relay]\ntrusted_publishers = ["{publisher}"]\nbudget_bytes = {4 << 30}\n'
                          + (f"\n{config_extra}\n" if config_extra else ""))
        args = ["--config", str(config)]
        procs.append(start_peer("peer0", root / "peer0", roles=["relay"], extra_args=args))
        procs[0].wait_ready(60)
        procs += [start_peer(f"peer{i}", root / f"peer{i}", roles=["relay"], extra_args=args,
                             bootstrap=[procs[0].addr]) for i in range(1, peers)]
        for p in procs[1:]:
            p.wait_ready(60)
        wait_for_full_tables(procs, 120)
        time.sleep(SETTLE_S)  # the joins' own gossip settles
        before = [cpu_s(p.proc.pid) for p in procs]
        time.sleep(seconds)
        after = [cpu_s(p.proc.pid) for p in procs]
    finally:
        for p in procs:
            p.stop()
        shutil.rmtree(work, ignore_errors=True)
    user = sum(b[0] - a[0] for a, b in zip(before, after)) / seconds
    system = sum(b[1] - a[1] for a, b in zip(before, after)) / seconds
    return user, system, [(sum(b) - sum(a)) / seconds for a, b in zip(before, after)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--peers", type=int, default=9, help="peer processes (default 9, as the race: 1 + 8)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured idle seconds (default 10)")
    parser.add_argument("--rounds", type=int, default=1, help="fresh networks, one after another (default 1)")
    parser.add_argument("--config-extra", default="", metavar="TOML",
                        help="TOML appended to every peer's config file (other sections than [relay], "
                             "e.g. [peertable] or [peer]); checked by the peers as their own settings are")
    args = parser.parse_args()
    for r in range(args.rounds):
        user, system, per = idle_round(args.peers, args.seconds, args.config_extra)
        print(f"round {r + 1}: {args.peers} idle peers use {user + system:.3f} CPU-s per second "
              f"({user:.3f} user, {system:.3f} system); per peer {min(per):.3f}-{max(per):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
