"""Loopback benchmark: one checkpoint to 8 peer processes, relay vs star vs raw TCP fan-out.

    python benchmarks/bench_relay_loopback.py --mib 1024 --peers 8

1. relay: 1 + N `p2pnet peer start --role relay` processes; the first publishes the checkpoint
   (hashing and storing it is not timed); timed from the publish reply until every other peer
   reports the version complete, every chunk verified and on disk (fsync off, as in tests).
2. star: every peer process downloads the whole file straight from one origin server over
   plain TCP, hashing each chunk with blake3 and writing it to disk: the same work per byte,
   no relaying.
3. raw: the same fan-out with no hashing and no disk: what the sockets alone allow.

On loopback nobody's upload is the bottleneck (two CPU cores are), so this measures the cost of
the relay's machinery against plain TCP; the bandwidth-bound comparison is bench_relay_sim.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHUNK = 1 << 20


def make_checkpoint(path: Path, mib: int) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    save_file({"w": rng.integers(0, 256, size=mib * 2**20, dtype=np.uint8)}, str(path))
    return path


# -- baselines: one server thread per client, sendfile -------------------------------------------


def serve_file(path: Path, clients: int) -> tuple[int, threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def one(conn: socket.socket) -> None:
        with conn, open(path, "rb") as fh:
            conn.sendfile(fh)

    def accept_all() -> None:
        threads = []
        with listener:
            for _ in range(clients):
                conn, _ = listener.accept()
                t = threading.Thread(target=one, args=(conn,))
                t.start()
                threads.append(t)
        for t in threads:
            t.join()

    thread = threading.Thread(target=accept_all)
    thread.start()
    return port, thread


def client_main(port: int, mode: str, out: str) -> None:
    """Child process: download everything; in `star` mode hash per chunk and write to disk."""
    import blake3

    got = 0
    sock = socket.create_connection(("127.0.0.1", port))
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    fh = open(out, "wb") if mode == "star" else None
    while True:
        filled = 0
        while filled < CHUNK:
            n = sock.recv_into(view[filled:])
            if n == 0:
                break
            filled += n
        if filled == 0:
            break
        got += filled
        if fh is not None:
            blake3.blake3(view[:filled], max_threads=1).digest()
            fh.write(view[:filled])
        if filled < CHUNK:
            break
    if fh is not None:
        fh.close()
    print(got, flush=True)


def run_baseline(path: Path, peers: int, mode: str, tmp: Path) -> float:
    port, server = serve_file(path, peers)
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--client", str(port), mode, str(tmp / f"{mode}{i}")],
                              stdout=subprocess.PIPE) for i in range(peers)]
    sizes = [int(p.communicate(timeout=900)[0]) for p in procs]
    took = time.perf_counter() - start
    server.join()
    assert all(s == path.stat().st_size for s in sizes), sizes
    return took


# -- the relay --------------------------------------------------------------------------


def run_relay(path: Path, peers: int, tmp: Path) -> tuple[float, dict]:
    from p2pnet.localnet import control_call, start_peer, wait_for_full_tables

    root = tmp / "relay"
    publisher = subprocess.check_output([sys.executable, "-m", "p2pnet", "peer", "id", "--data-dir",
                                         str(root / "peer0")], text=True).strip()
    config = root / "relay.toml"
    config.write_text(f'[relay]\ntrusted_publishers = ["{publisher}"]\nfsync = false\n'
                      f'budget_bytes = {8 * path.stat().st_size}\n')
    args = ["--config", str(config), "--heartbeat-interval-s", "1", "--peer-expiry-s", "10"]
    procs = [start_peer("peer0", root / "peer0", roles=["relay"], extra_args=args)]
    try:
        procs[0].wait_ready(30)
        procs += [start_peer(f"peer{i}", root / f"peer{i}", roles=["relay"], extra_args=args,
                             bootstrap=[procs[0].addr]) for i in range(1, peers + 1)]
        for p in procs[1:]:
            p.wait_ready(30)
        wait_for_full_tables(procs, 60)
        reply = control_call(procs[0].data_dir, {"cmd": "checkpoint.publish", "paths": [str(path)], "model": "bench",
                                                 "version": 1, "chunk_bytes": 4 << 20}, timeout_s=600)
        start = time.perf_counter()
        pending = set(range(1, peers + 1))
        while pending:
            for i in list(pending):
                rows = procs[i].status(timeout_s=30)["role_status"]["relay"]["transfers"]["progress"]
                if rows and rows[0]["complete"]:
                    pending.discard(i)
            if time.perf_counter() - start > 900:
                raise TimeoutError(f"peers {sorted(pending)} incomplete after 900s")
            time.sleep(0.1)
        took = time.perf_counter() - start
        served = {p.name: sum(p.status()["role_status"]["relay"]["served_to"].values()) for p in procs}
        return took, {"chunks": reply["chunks"], "served": served}
    finally:
        for p in procs:
            p.stop()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="checkpoint size in MiB")
    parser.add_argument("--peers", type=int, default=8, help="receiving peers")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-relay-", dir=os.environ.get("BENCH_TMP")))
    try:
        path = make_checkpoint(tmp / "ckpt.safetensors", args.mib)
        total = args.peers * path.stat().st_size
        raw = run_baseline(path, args.peers, "raw", tmp)
        star = run_baseline(path, args.peers, "star", tmp)
        for f in tmp.glob("star*"):
            f.unlink()
        relay, info = run_relay(path, args.peers, tmp)
        print(f"{args.mib} MiB to {args.peers} peers ({total / 1e9:.2f} GB delivered), loopback, 2 cores")
        for name, took in (("raw TCP fan-out", raw), ("star (TCP+blake3+disk)", star), ("relay", relay)):
            print(f"  {name:<24} {took:7.2f} s  {total / took / 1e6:8.0f} MB/s delivered  relay/this = {relay / took:.2f}")
        print(f"  relay: {info['chunks']} chunks of 4 MiB; chunks served per peer: {info['served']}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
