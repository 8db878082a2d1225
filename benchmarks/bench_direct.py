"""What a direct frame costs: a stream of its own per frame against the stream kept per peer.

    .venv/bin/python benchmarks/bench_direct.py [--frames 500] [--bytes 200] [--rounds 3]

Two real libp2p hosts (Noise, yamux) in one process on loopback, connected once. Each round sends
`--frames` frames of `--bytes` bytes from one to the other, each way of sending in turn, and waits until
the receiver's handler has every frame: (1) one stream per frame, opened, written and closed, as
p2pnet did before `p2pnet.direct` and as py-libp2p's examples do; (2) `Host.send_frame`, which
writes on the stream kept for the peer. The CPU (process time: both hosts, both ends) and wall
time per frame are printed per round, then the medians and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pnet.host import MSG_PROTOCOL, open_host  # noqa: E402
from p2pnet.identity import Identity  # noqa: E402


async def measure(frames: int, nbytes: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    from libp2p.peer.id import ID

    results: dict[str, list[tuple[float, float]]] = {"stream per frame": [], "kept stream": []}
    received = 0
    done = trio.Event()

    async def on_frame(frame: bytes, peer: str) -> None:
        nonlocal received
        received += 1
        if received == frames:
            done.set()

    body = b"x" * nbytes
    async with open_host(Identity.from_seed_text("bench-direct-a"), "/ip4/127.0.0.1/tcp/0") as a, \
            open_host(Identity.from_seed_text("bench-direct-b"), "/ip4/127.0.0.1/tcp/0") as b:
        b.set_frame_handler(on_frame)
        await a.connect(b.addrs()[0])
        target = ID.from_base58(b.peer_id)

        async def per_frame() -> None:
            stream = await a._host.new_stream(target, [MSG_PROTOCOL])
            await stream.write(len(body).to_bytes(4, "big") + body)
            await stream.close()

        async def kept() -> None:
            await a.send_frame(b.peer_id, body)

        await per_frame()  # warm both paths (and the kept stream) before any clock starts
        await kept()
        await trio.sleep(0.5)
        for _ in range(rounds):
            for name, send in (("stream per frame", per_frame), ("kept stream", kept)):
                received, done = 0, trio.Event()
                cpu0, wall0 = time.process_time(), time.perf_counter()
                for _ in range(frames):
                    await send()
                with trio.fail_after(120):
                    await done.wait()
                cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
                results[name].append((cpu / frames, wall / frames))
                print(f"{name:<17} {cpu / frames * 1e3:6.3f} ms CPU, {wall / frames * 1e3:6.3f} ms wall per frame",
                      flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=500, help="frames per round and way (default 500)")
    parser.add_argument("--bytes", type=int, default=200, help="bytes per frame (default 200)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, median reported (default 3)")
    args = parser.parse_args()
    if args.frames < 1 or args.bytes < 0 or args.rounds < 1:
        parser.error("--frames and --rounds must be >= 1, --bytes >= 0")
    results = trio.run(measure, args.frames, args.bytes, args.rounds)
    med = {name: (statistics.median(c for c, _ in r), statistics.median(w for _, w in r)) for name, r in results.items()}
    old, new = med["stream per frame"], med["kept stream"]
    print(f"\n{args.frames} frames of {args.bytes} bytes per round, median of {args.rounds}, both hosts in one process:")
    for name, (cpu, wall) in med.items():
        print(f"  {name:<17} {cpu * 1e3:6.3f} ms CPU, {wall * 1e3:6.3f} ms wall per frame")
    print(f"  stream per frame / kept stream: {old[0] / new[0]:.1f}x the CPU, {old[1] / new[1]:.1f}x the time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
