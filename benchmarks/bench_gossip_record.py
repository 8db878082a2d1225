"""CPU per delivered gossip message with and without py-libp2p's signed peer record.

    .venv/bin/python benchmarks/bench_gossip_record.py [--hosts 5] [--messages 150] [--rounds 3]

py-libp2p puts its signed peer record (`senderRecord`) on every pubsub RPC and every receiver
checks it (Ed25519, peerstore update, multiaddr parsing). `--hosts` real p2pnet hosts
(`p2pnet.host.open_host`: Noise, yamux, GossipSub) in one process on loopback, fully
connected, all subscribed to one topic; each publishes `--messages` 300-byte frames, paced
under GossipSub's limit of 1000 messages per topic per second. Measured: process CPU (all
threads) per delivered message, record on (py-libp2p's default) against off (p2pnet's),
alternating, in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pnet.host import open_host  # noqa: E402
from p2pnet.identity import Identity  # noqa: E402

TOPIC = "p2pnet/bench/record"


async def one_round(hosts_n: int, messages: int, send_record: bool, tag: str) -> tuple[float, float, int]:
    """The figures are taken before the hosts close: py-libp2p can fail a host's shutdown while
    another still gossips to it (a task scheduled on a stopped service), which is reported, not
    counted."""
    result: list[tuple[float, float, int]] = []
    try:
        await _measure(hosts_n, messages, send_record, tag, result)
    except* Exception as group:
        if not result:
            raise
        print(f"  (shutdown of the hosts failed after the measurement: {group.exceptions[0]!r:.120})", flush=True)
    return result[0]


async def _measure(hosts_n: int, messages: int, send_record: bool, tag: str,
                   result: list[tuple[float, float, int]]) -> None:
    expected = hosts_n * messages * (hosts_n - 1)
    got = [0]
    done = trio.Event()

    async def on_frame(frame: bytes, source: str) -> None:
        got[0] += 1
        if got[0] >= expected:
            done.set()

    async with AsyncExitStack() as stack:
        hosts = [await stack.enter_async_context(open_host(
            Identity.from_seed_text(f"rec-{tag}-{i}"), "/ip4/127.0.0.1/tcp/0", send_peer_record=send_record))
            for i in range(hosts_n)]
        async with trio.open_nursery() as nursery:
            for h in hosts:
                nursery.start_soon(h.subscribe, TOPIC, on_frame)
            for i, a in enumerate(hosts):
                for b in hosts[i + 1:]:
                    await a.connect(b.addrs()[0])
            with trio.fail_after(60):  # until every host knows every other one subscribed
                while any(len(h._pubsub.peer_topics.get(TOPIC, ())) < hosts_n - 1 for h in hosts):
                    await trio.sleep(0.05)
            await trio.sleep(1.5)  # a mesh heartbeat or two
            cpu0, wall0 = time.process_time(), time.monotonic()
            for k in range(messages):
                for i, h in enumerate(hosts):
                    await h.publish(TOPIC, f"{tag}-{i}-{k}-".encode().ljust(300, b"x"))
                await trio.sleep(0.01)  # GossipSub drops a topic over 1000 messages per second
            with trio.fail_after(120):
                await done.wait()
            result.append((time.process_time() - cpu0, time.monotonic() - wall0, got[0]))
            nursery.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=5)
    parser.add_argument("--messages", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    per_msg: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for send in ((True, False) if r % 2 == 0 else (False, True)):
            cpu, wall, n = trio.run(one_round, args.hosts, args.messages, send, f"{r}{int(send)}")
            per_msg[send].append(cpu / n * 1e3)
            print(f"round {r + 1} record {'on ' if send else 'off'}  {n} delivered  {wall:6.2f} s  "
                  f"{cpu:6.2f} CPU-s  {cpu / n * 1e3:6.3f} ms CPU per delivered message", flush=True)
    on, off = statistics.median(per_msg[True]), statistics.median(per_msg[False])
    print(f"\n{args.hosts} hosts, {args.messages} messages each, median of {args.rounds}: "
          f"record on {on:.3f} ms, off {off:.3f} ms CPU per delivered message; on/off {on / off:.2f}x")


if __name__ == "__main__":
    main()
