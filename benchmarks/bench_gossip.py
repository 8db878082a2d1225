"""Gossip announcement delivery and latency with N real peer processes; codec throughput.

    .venv/bin/python benchmarks/bench_gossip.py [--peers 20 50] [--notices 20]

For each N: start N `p2pnet peer start` processes on loopback (peer 0 is everyone's bootstrap),
wait until every peer table is full, publish `--notices` signed notices from random peers, and
read every peer's received notices: delivery ratio, and p50/p99 latency from the sender's
timestamp to arrival. The baseline, measured in the same run, is a 2-peer network (one hop).
Then: messages decoded and signature-checked per second by the codec, against signature
checks alone (the floor) on the same frames.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pnet.localnet import control_call, start_network, wait_for_full_tables  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def gossip_run(n: int, notices: int, seed: int) -> dict:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="bench-gossip-") as tmp:
        started = time.monotonic()
        # every heartbeat costs every peer ~10 ms of CPU in py-libp2p gossip; on 2 cores, space them out
        interval_s = max(2.0, n / 2.5)
        peers = start_network(Path(tmp), n, ready_timeout_s=180,
                              extra_args=["--heartbeat-interval-s", str(interval_s), "--peer-expiry-s", str(5 * interval_s)])
        try:
            startup_s = time.monotonic() - started
            table_s = wait_for_full_tables(peers, timeout_s=300, poll_s=1.0, status_timeout_s=60)
            ids = []
            for i in range(notices):
                sender = rng.choice(peers)
                ids.append(control_call(sender.data_dir, {"cmd": "announce", "notice_id": f"n{i}", "text": "x"},
                                        timeout_s=60)["notice_id"])
                time.sleep(0.25)
            time.sleep(5.0)  # let the last notices land
            received: dict[str, list[float]] = {i: [] for i in ids}
            for p in peers:
                for notice in p.status(timeout_s=60)["notices"]:
                    if notice["notice_id"] in received:
                        received[notice["notice_id"]].append(notice["latency_ms"])
        finally:
            for p in peers:
                p.stop(timeout_s=20)
    latencies = [v for values in received.values() for v in values]
    delivered = sum(len(v) for v in received.values())
    return {
        "peers": n,
        "startup_s": startup_s,
        "tables_full_s": table_s,
        "delivery_ratio": delivered / (len(ids) * (n - 1)),
        "p50_ms": percentile(latencies, 0.5) if latencies else float("nan"),
        "p99_ms": percentile(latencies, 0.99) if latencies else float("nan"),
    }


def codec_run(messages: int = 20_000) -> dict:
    from p2pnet.identity import Identity, SignatureChecker
    from p2pnet.messages import Capacity, Heartbeat
    from p2pnet.wire import DOMAIN, SIGNATURE_BYTES, Codec

    identities = [Identity.from_seed_text(f"s{i}") for i in range(100)]
    senders = [Codec(identity) for identity in identities]
    now = time.time()
    frames = [senders[i % 100].encode(Heartbeat(i + 1, 1, ("/ip4/127.0.0.1/tcp/4001/p2p/x",), "127.0.0.1:1",
                                                ("relay",), Capacity(1, 2, 3)), now) for i in range(messages)]
    ids = [identity.peer_id_bytes for identity in identities]
    codec, checker = Codec(None), SignatureChecker()
    t0 = time.perf_counter()
    for frame in frames:
        codec.decode(frame, now)
    codec_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i, frame in enumerate(frames):
        checker.verify(ids[i % 100], DOMAIN + frame[:-SIGNATURE_BYTES], frame[-SIGNATURE_BYTES:])
    verify_s = time.perf_counter() - t0
    return {"frame_bytes": len(frames[0]), "codec_per_s": messages / codec_s, "verify_only_per_s": messages / verify_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[20, 50])
    parser.add_argument("--notices", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    baseline = gossip_run(2, args.notices, args.seed)
    rows = [baseline] + [gossip_run(n, args.notices, args.seed) for n in args.peers]
    print("| peers | startup s | tables full s | delivery ratio | p50 ms | p99 ms | p50 vs 2 peers |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['peers']} | {r['startup_s']:.1f} | {r['tables_full_s']:.1f} | {r['delivery_ratio']:.3f} | "
              f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['p50_ms'] / baseline['p50_ms']:.1f}x |")
    c = codec_run()
    print(f"\ncodec: {c['codec_per_s']:,.0f} heartbeats/s decoded and signature-checked ({c['frame_bytes']} B); "
          f"signature checks alone {c['verify_only_per_s']:,.0f}/s; codec at "
          f"{c['codec_per_s'] / c['verify_only_per_s']:.2f}x of the signature-check floor")


if __name__ == "__main__":
    main()
