"""What a network of relay peers costs doing nothing: CPU per second of N idle peer processes.

    python benchmarks/bench_idle_peers.py [--peers 9] [--seconds 10] [--rounds 1]

Starts `--peers` `p2pnet peer start --role relay` processes the way the loopback race does (peer 0
as everyone's bootstrap and trusted publisher, the same relay config), waits until every peer
table is full and a few seconds more, then reads each process's CPU (/proc/PID/stat) over
`--seconds`. Prints CPU-s per second for all peers together (user and system) and per peer, the
messages each peer took in per second (its status's `messages.received`, read just before and
after that window: in an idle network nearly all are other peers' heartbeats, each counted once
however many copies GossipSub delivered) and the heartbeat spacing the peers report (`-` from a
peer that reports none). The message rate does not depend on the CPU: it tells the mechanism
apart from a pinned core that is saturated (its CPU-s per second near 1). With no transfer under
way, all the CPU is the background: peer-table heartbeats, GossipSub's own heartbeat and mesh
upkeep, and py-libp2p's stream handling for both. Compare settings by running
it with different environments (for example `PY_YAMUX_RELEASE_ON_READ=1`, py-libp2p's default)
or with `--config-extra` (TOML appended to every peer's config file), for example

    python benchmarks/bench_idle_peers.py --config-extra $'[peertable]\nheartbeat_interval_s = 20\nexpiry_s = 100\n'
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_relay_loopback import cpu_s  # noqa: E402
from p2pnet.localnet import PeerProcess, relay_network  # noqa: E402

SETTLE_S = 3.0
STATUS_TIMEOUT_S = 60.0  # 27 peers pinned to one core saturate it: a status answer can take many seconds


@dataclass(frozen=True)
class IdleRound:
    user: float  # CPU-s per second, all peers together
    system: float
    per_peer: list[float]  # each peer's CPU-s per second
    heard_per_s: list[float]  # messages each peer took in per second
    spacing_s: list[float | None]  # the heartbeat spacing each peer reported (None: not reported)


def _received(procs: list[PeerProcess]) -> list[tuple[float, int, float | None]]:
    """(when, messages received so far, heartbeat spacing) of each peer, from its status."""
    out = []
    for p in procs:
        status = p.status(STATUS_TIMEOUT_S)
        out.append((time.monotonic(), status["messages"]["received"], status.get("heartbeat_interval_s")))
    return out


def idle_round(peers: int, seconds: float, config_extra: str = "") -> IdleRound:
    """What `peers` idle relay peers spend over `seconds`, once their tables are full."""
    work = Path(tempfile.mkdtemp(prefix="bench-idle-"))
    config = f"budget_bytes = {4 << 30}\n" + (f"\n{config_extra}\n" if config_extra else "")
    try:
        # 150 s between rounds at 0.25 s: the 600 rounds it had polling every second. The stop
        # deadline is the set's: peers pinned to one core shut down side by side in about 0.4 s each
        # (16 idle relays 6.7 s), so 27 would pass the default 10 s and be SIGKILLed
        with relay_network(work / "p2pnet", peers - 1, config=config, ready_timeout_s=60, tables_timeout_s=150,
                           status_timeout_s=STATUS_TIMEOUT_S, stop_timeout_s=max(10.0, 1.0 * peers)) as net:
            procs = net.peers
            time.sleep(SETTLE_S)  # the joins' own gossip settles
            heard_before = _received(procs)
            before = [cpu_s(p.proc.pid) for p in procs]
            time.sleep(seconds)
            after = [cpu_s(p.proc.pid) for p in procs]
            heard_after = _received(procs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    user = sum(b[0] - a[0] for a, b in zip(before, after)) / seconds
    system = sum(b[1] - a[1] for a, b in zip(before, after)) / seconds
    return IdleRound(user, system, [(sum(b) - sum(a)) / seconds for a, b in zip(before, after)],
                     [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(heard_before, heard_after)],
                     [b[2] for b in heard_after])


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
        got = idle_round(args.peers, args.seconds, args.config_extra)
        per, heard = got.per_peer, got.heard_per_s
        spacing = sorted({f"{s:.1f}" if s is not None else "-" for s in got.spacing_s})
        print(f"round {r + 1}: {args.peers} idle peers use {got.user + got.system:.3f} CPU-s per second "
              f"({got.user:.3f} user, {got.system:.3f} system); per peer {min(per):.3f}-{max(per):.3f}; "
              f"messages heard per peer per second {statistics.mean(heard):.2f} ({min(heard):.2f}-{max(heard):.2f}); "
              f"heartbeats every {'/'.join(spacing)} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
