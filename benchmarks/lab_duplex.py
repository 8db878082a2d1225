"""How much of a lab link one TCP connection gets one way and both ways at once.

A check behind the DiLoCo lab figures in BENCHMARKS.md: in an all-reduce every peer sends and
receives at the same time, so the bound 2 (N-1)/N x S / U assumes a link carries U each way
while TCP's acknowledgements share the shaped queues with the data. Two lab hosts (`p2pnet.lab`)
with `--mbit` up and down; host b sends `--mb` MB to host a over one connection, then both send
as much to each other at once; printed: each receiver's goodput.

Must not: download anything. Needs root (the lab). Run it under `flock /tmp/p2pnet-cpu.lock`.

Run: .venv/bin/python benchmarks/lab_duplex.py --mbit 20 --mb 5
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PORT = 9999


def peer(mode: str, address: str, nbytes: int, send: bool) -> None:
    """One end: connect (or accept), send `nbytes` when `send`, receive `nbytes` when the other sends."""
    if mode == "server":
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, PORT))
        listener.listen(1)
        print("ready", flush=True)
        conn, _ = listener.accept()
    else:
        conn = socket.create_connection((address, PORT))
    started = time.monotonic()
    sender = threading.Thread(target=lambda: conn.sendall(bytes(nbytes)) if send else None)
    sender.start()
    got = 0
    while mode == "client" or got < nbytes:
        data = conn.recv(1 << 20)
        if not data:
            break
        got += len(data)
        if got >= nbytes:
            break
    elapsed = time.monotonic() - started
    sender.join()
    print(f"{mode} received {got} bytes in {elapsed:.3f} s: {got / elapsed / 1e6:.3f} MB/s", flush=True)
    time.sleep(0.5)  # let the other end finish reading before the connection closes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mbit", type=float, default=20.0)
    parser.add_argument("--mb", type=float, default=5.0)
    parser.add_argument("--peer", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        mode, address, nbytes, send = args.peer
        peer(mode, address, int(nbytes), send == "1")
        return
    sys.path.insert(0, str(ROOT))
    from p2pnet.lab import HostSpec, Lab, LabSpec

    nbytes = int(args.mb * 1e6)
    me = [sys.executable, str(Path(__file__).resolve()), "--peer"]
    print(f"link {args.mbit} Mbit/s each way = {args.mbit / 8:.3f} MB/s; {nbytes} bytes", flush=True)
    spec = LabSpec((HostSpec("a", args.mbit, args.mbit), HostSpec("b", args.mbit, args.mbit)), "duplex")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="lab-duplex-") as tmp, Lab.up(spec, Path(tmp)) as lab:
        ip_b = lab.host("b").ip
        for label, both in (("one way (b -> a)", False), ("both ways at once", True)):
            server = lab.popen("b", [*me, "server", ip_b, str(nbytes), "1"], stdout=subprocess.PIPE, text=True)
            assert server.stdout is not None
            server.stdout.readline()
            client = lab.popen("a", [*me, "client", ip_b, str(nbytes), "1" if both else "0"],
                               stdout=subprocess.PIPE, text=True)
            lines = [client.communicate(timeout=120)[0].strip()]
            if both:
                lines.append(server.communicate(timeout=120)[0].strip())
            else:
                server.kill()
                server.wait()
            print(f"{label}: " + "; ".join(lines), flush=True)


if __name__ == "__main__":
    main()
