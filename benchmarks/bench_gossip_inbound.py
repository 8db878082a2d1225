"""Our CPU per gossiped frame received: what p2pnet's code spends on each message it hears.

    python benchmarks/bench_gossip_inbound.py [--messages 4000] [--passes 5]

GossipSub hands p2pnet only the first copy of each message, twice: the topic validator
(`Host.subscribe`'s: the forwarder's id as text, then `Node._gossip_ok` -> `Codec.precheck`, which
checks the signature) before the message is forwarded, then the subscription (the origin's id as
text, `Codec.decode`, whose second signature check of the same bytes is remembered, and the node's
check that the sender is not itself). This runs that sequence in one process, without py-libp2p or
trio, on `--messages` distinct signed heartbeats from 8 senders, and prints the process CPU per
message, the minimum over `--passes` (after one uncounted pass). It leaves out what the cores do
with the envelope (the peer table's `on_message`) and everything py-libp2p does per copy (see
benchmarks/results/idle_peers.md, where the profile puts this path at about 10-15% of an idle
peer's CPU). Pin it: `flock /tmp/p2pnet-cpu.lock taskset -c 1 ...`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pnet.host import _peer_text  # noqa: E402
from p2pnet.identity import Identity  # noqa: E402
from p2pnet.messages import Capacity, Heartbeat  # noqa: E402
from p2pnet.wire import Codec  # noqa: E402

SENDERS = 8


def frames(messages: int, now: float) -> list[tuple[bytes, bytes]]:
    """(sender's peer id, signed heartbeat frame), each frame distinct (its own sequence number)."""
    senders = [Identity.from_seed_text(f"sender {i}") for i in range(SENDERS)]
    out = []
    for i in range(messages):
        sender = senders[i % SENDERS]
        beat = Heartbeat(i, 1, (), "127.0.0.1:1", ("relay",), Capacity(1, 1, 1))
        out.append((sender.peer_id_bytes, Codec(sender).encode(beat, now)))
    return out


def one_pass(me: Identity, codec: Codec, batch: list[tuple[bytes, bytes]], now: float) -> float:
    """CPU-s per message of the validator's and the subscriber's work over `batch`."""
    forwarder = batch[0][0]
    start = time.process_time()
    for sender, frame in batch:
        _peer_text(forwarder)
        codec.precheck(frame)
        _peer_text(sender)
        if codec.decode(frame, now).sender == me.peer_id:
            raise AssertionError("a frame of our own")
    return (time.process_time() - start) / len(batch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--messages", type=int, default=4000, help="distinct frames per pass (default 4000)")
    parser.add_argument("--passes", type=int, default=5, help="counted passes; the minimum is printed (default 5)")
    args = parser.parse_args()
    now = time.time()
    me = Identity.from_seed_text("receiver")
    batch = frames(args.messages, now)
    one_pass(me, Codec(me), batch, now)  # warm-up
    best = min(one_pass(me, Codec(me), batch, now) for _ in range(args.passes))  # a fresh codec: no check remembered
    print(f"{best * 1e6:.1f} us CPU per message heard (validator + subscriber), minimum of {args.passes} passes "
          f"of {args.messages}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
