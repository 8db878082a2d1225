"""The data plane handshake's cost: per connection, against a bare loopback TCP connect.

    .venv/bin/python benchmarks/bench_handshake.py --n 2000

Both measured in the same run on loopback: (1) `trio.open_tcp_stream` + close against a
listener that accepts and closes (the floor any connection pays); (2) the same plus the
three-frame handshake (`p2pnet.handshake`: three Ed25519 signatures, three checks). The cost
per GiB moved follows from how many connections a relay opens per version (one per source: at
most stripes + a few) and is printed for a 1 GiB version fetched from 16 sources.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pnet.dataplane import DataPlane, open_data_stream  # noqa: E402
from p2pnet.identity import Identity  # noqa: E402
from p2pnet.wire import Codec  # noqa: E402


async def measure(n: int) -> tuple[float, float]:
    server, client = Identity.from_seed_text("bench-server"), Identity.from_seed_text("bench-client")
    async with trio.open_nursery() as nursery:
        async def close_at_once(stream):
            await stream.aclose()

        listeners = await nursery.start(lambda task_status: trio.serve_tcp(close_at_once, 0, host="127.0.0.1", task_status=task_status))
        port = listeners[0].socket.getsockname()[1]
        started = time.perf_counter()
        for _ in range(n):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.aclose()
        bare = (time.perf_counter() - started) / n

        plane = DataPlane("127.0.0.1", 0, codec=Codec(server), self_id=server.peer_id, admit=lambda peer: None)

        async def done(stream, reader, peer):
            return

        plane.register("bench", done)
        address = await nursery.start(plane.serve)
        codec = Codec(client)
        started = time.perf_counter()
        for _ in range(n):
            stream = await open_data_stream(address, "bench", codec=codec, peer=server.peer_id)
            await stream.aclose()
        shaken = (time.perf_counter() - started) / n
        nursery.cancel_scope.cancel()
    return bare, shaken


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000)
    args = parser.parse_args()
    bare, shaken = trio.run(measure, args.n)
    extra = shaken - bare
    print(f"bare TCP connect+close {bare * 1e3:.3f} ms; with handshake {shaken * 1e3:.3f} ms "
          f"({shaken / bare:.1f}x); handshake alone {extra * 1e3:.3f} ms per connection (both ends, one process)")
    print(f"per GiB moved, fetching a 1 GiB version from 16 sources: {16 * extra * 1e3:.1f} ms of CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
