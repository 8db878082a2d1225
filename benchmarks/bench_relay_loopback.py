"""Loopback benchmark: one checkpoint to N peer processes, relay vs star vs raw TCP fan-out.

    python benchmarks/bench_relay_loopback.py --mib 1024 --peers 8 [--fsync off|on]

All three run in the same invocation, one after the other, on the same file:

1. raw: N client processes download the file from one origin (sendfile) over plain TCP, with
   no hashing and no disk: what the sockets alone allow.
2. star: the same fan-out, each client hashing every chunk (`--chunk-mib`) with blake3 and
   writing it to disk: the relay's work per byte, without relaying or a control plane.
3. relay: 1 + N `p2pnet peer start --role relay` processes; the first publishes the checkpoint
   (hashing and storing it is not timed); timed from the publish reply until every other peer
   has every chunk verified and on disk. Split into `announce` (publish reply -> the last peer
   accepted the signed manifest, gossip over libp2p) and `data` (the rest).

fsync is the same for star and relay: `off` (no fsync; the default, as in tests) or `on` (star
fsyncs its file every 32 chunks and at the end; relay peers run with `fsync = true`, fsync
batched every `fsync_batch_chunks` = 32 chunks and at completion). CPU-seconds are those of the
client (or peer) processes and, for the baselines, the origin's server threads.

On loopback nobody's upload is the bottleneck (the CPU cores are), so this measures the cost of
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

FSYNC_EVERY_CHUNKS = 32  # the relay's fsync_batch_chunks, for star with --fsync on


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


def client_main(port: int, mode: str, out: str, chunk: int, fsync: bool) -> None:
    """Child process: download everything; in `star` mode hash per chunk and write to disk."""
    import blake3

    got = 0
    sock = socket.create_connection(("127.0.0.1", port))
    buf = bytearray(chunk)
    view = memoryview(buf)
    fh = open(out, "wb", buffering=0) if mode == "star" else None
    chunks = 0
    while True:
        filled = 0
        while filled < chunk:
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
            chunks += 1
            if fsync and chunks % FSYNC_EVERY_CHUNKS == 0:
                os.fsync(fh.fileno())
        if filled < chunk:
            break
    if fh is not None:
        if fsync:
            os.fsync(fh.fileno())
        fh.close()
    print(got, flush=True)


def _cpu_s(rusage_who: int) -> float:
    import resource

    r = resource.getrusage(rusage_who)
    return r.ru_utime + r.ru_stime


def run_baseline(path: Path, peers: int, mode: str, tmp: Path, chunk: int, fsync: bool) -> tuple[float, float]:
    """(seconds, CPU-seconds of the clients and the origin) for one fan-out."""
    import resource

    cpu0 = _cpu_s(resource.RUSAGE_CHILDREN) + _cpu_s(resource.RUSAGE_SELF)
    port, server = serve_file(path, peers)
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--client", str(port), mode, str(tmp / f"{mode}{i}"),
                               str(chunk), str(int(fsync))], stdout=subprocess.PIPE) for i in range(peers)]
    sizes = [int(p.communicate(timeout=900)[0]) for p in procs]
    took = time.perf_counter() - start
    server.join()
    cpu = _cpu_s(resource.RUSAGE_CHILDREN) + _cpu_s(resource.RUSAGE_SELF) - cpu0
    assert all(s == path.stat().st_size for s in sizes), sizes
    for f in tmp.glob(f"{mode}*"):
        f.unlink()
    return took, cpu


# -- the relay --------------------------------------------------------------------------


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_relay(path: Path, peers: int, tmp: Path, chunk: int, fsync: bool) -> dict:
    from p2pnet.localnet import control_call, start_peer, wait_for_full_tables

    root = tmp / "relay"
    publisher = subprocess.check_output([sys.executable, "-m", "p2pnet", "peer", "id", "--data-dir",
                                         str(root / "peer0")], text=True).strip()
    config = root / "relay.toml"
    config.write_text(f'[relay]\ntrusted_publishers = ["{publisher}"]\nfsync = {str(fsync).lower()}\n'
                      f'fsync_batch_chunks = {FSYNC_EVERY_CHUNKS}\nbudget_bytes = {8 * path.stat().st_size}\n')
    args = ["--config", str(config)]  # default heartbeat interval: the control plane's real load
    procs = [start_peer("peer0", root / "peer0", roles=["relay"], extra_args=args)]
    try:
        procs[0].wait_ready(30)
        procs += [start_peer(f"peer{i}", root / f"peer{i}", roles=["relay"], extra_args=args,
                             bootstrap=[procs[0].addr]) for i in range(1, peers + 1)]
        for p in procs[1:]:
            p.wait_ready(30)
        wait_for_full_tables(procs, 60)
        reply = control_call(procs[0].data_dir, {"cmd": "checkpoint.publish", "paths": [str(path)], "model": "bench",
                                                 "version": 1, "chunk_bytes": chunk}, timeout_s=600)
        published_at = time.time()
        cpu0 = sum(_proc_cpu_s(p.proc.pid) for p in procs)
        times: dict[int, dict] = {}
        while len(times) < peers:  # completion times come from the peers' own wall clock
            for i in range(1, peers + 1):
                if i not in times:
                    timeline = procs[i].status(timeout_s=30)["role_status"]["relay"]["timeline"].get("1", {})
                    if "complete_at_s" in timeline:
                        times[i] = timeline
            if time.time() - published_at > 900:
                raise TimeoutError(f"peers {sorted(set(range(1, peers + 1)) - set(times))} incomplete after 900s")
            time.sleep(0.5)
        cpu = sum(_proc_cpu_s(p.proc.pid) for p in procs) - cpu0  # includes up to 0.5 s idle
        served = {p.name: sum(p.status()["role_status"]["relay"]["served_to"].values()) for p in procs}
        announced = max(t["manifest_at_s"] for t in times.values()) - published_at
        took = max(t["complete_at_s"] for t in times.values()) - published_at
        return {"seconds": took, "announce_s": announced, "cpu_s": cpu, "chunks": reply["chunks"],
                "served": served}
    finally:
        for p in procs:
            p.stop()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6] == "1")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="checkpoint size in MiB")
    parser.add_argument("--peers", type=int, default=8, help="receiving peers")
    parser.add_argument("--chunk-mib", type=int, default=4, help="relay chunk size, and star's hashing unit")
    parser.add_argument("--fsync", choices=("off", "on"), default="off", help="fsync in star and relay alike")
    args = parser.parse_args()
    chunk, fsync = args.chunk_mib << 20, args.fsync == "on"
    tmp = Path(tempfile.mkdtemp(prefix="bench-relay-", dir=os.environ.get("BENCH_TMP")))
    try:
        path = make_checkpoint(tmp / "ckpt.safetensors", args.mib)
        total = args.peers * path.stat().st_size
        raw = run_baseline(path, args.peers, "raw", tmp, chunk, fsync)
        star = run_baseline(path, args.peers, "star", tmp, chunk, fsync)
        relay = run_relay(path, args.peers, tmp, chunk, fsync)
        print(f"{args.mib} MiB to {args.peers} peers ({total / 1e9:.2f} GB delivered), loopback, "
              f"{os.cpu_count()} cores, fsync {args.fsync}, {args.chunk_mib} MiB chunks")
        rows = (("raw TCP fan-out", raw), ("star (TCP+blake3+disk)", star),
                ("relay", (relay["seconds"], relay["cpu_s"])))
        for name, (took, cpu) in rows:
            print(f"  {name:<24} {took:7.2f} s  {total / took / 1e6:8.0f} MB/s delivered  "
                  f"{cpu:7.1f} CPU-s  relay/this = {relay['seconds'] / took:.2f}")
        print(f"  relay split: announce (manifest gossip to the last peer) {relay['announce_s']:.2f} s, "
              f"data {relay['seconds'] - relay['announce_s']:.2f} s")
        print(f"  relay: {relay['chunks']} chunks; chunks served per peer: {relay['served']}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
