"""Capped origin: one checkpoint from an origin whose upload is capped to N relays on loopback, p2pnet
against the plain HTTP star a user would set up instead.

    python benchmarks/bench_capped_origin.py --relays 6 --mib 24 --upload-mb 3 --runs 3 [--chunk-kib 64] [--json FILE]

The origin is a trainer on a home uplink: it can send `--upload-mb` MB/s (10^6 bytes) in all, the
receivers are fast. Two contenders, both in every run (the order alternates), on the same file:

1. p2pnet: a publisher started with `p2pnet peer start --role relay --upload-bps CAP` (its token
   bucket, one second of burst, and the upload it advertises) and N `--role relay` processes
   bootstrapped from it (`p2pnet.localnet.relay_network`, as the tests start them), default
   settings (fsync on), a fresh network per run, started and fully meshed (every table full,
   every peer reachable) before the clock starts. Timed from the `checkpoint.publish` request
   until every relay's `checkpoint.wait` returned (the version verified, complete and durable).
   Also: bytes the publisher served (its relay status `bytes_served`) over the file's size: 1.00
   means it sent each chunk once and the relays carried it on.
2. star: python's `http.server` (ThreadingHTTPServer) serves the file through one token bucket of
   the same rate and one second of burst, shared by all its connections (`relay.serving.ByteBudget`,
   the bucket `--upload-bps` uses, in 64 KiB blocks); N client processes download it at once, hash
   it with blake3 as it comes, write it, fsync it and check the digest (the clients of
   bench_relay_loopback.py). Timed from the go sent to the clients until the last says done.

Lower bounds, with S the file's size: the origin must send S at least once, so no layout finishes
before S/CAP - 1 s (the burst); relays' uploads and downloads are not limited on loopback, so the
other terms of the fluid bound (S/min(download), N*S/(CAP + sum of uploads)) are ~0. The star
sends N copies: N*S/CAP - 1 s. Reported per run and as medians of runs: each time, p2pnet's over
the star's and over the bound. The machine's cores are shared by all the processes: on few cores,
run it alone (nothing else measuring).
"""

from __future__ import annotations

import argparse
import http.server
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_relay_loopback import VersionWaits, _expect, _pipe, http_client, make_checkpoint  # noqa: E402

BLOCK = 64 * 1024
BURST_S = 1.0


# -- the star's server (this file, run with --capped-server) --------------------------------------


def capped_server(directory: str, rate_bps: float) -> None:
    """Serve `directory` over HTTP, every connection's bytes drawn from one bucket of `rate_bps`."""
    from relay.serving import ByteBudget

    budget, lock = ByteBudget(rate_bps), threading.Lock()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def copyfile(self, source, outputfile) -> None:  # (the body: headers go out unpaced)
            while block := source.read(BLOCK):
                with lock:  # one bucket for the origin's whole uplink, not one per client
                    wait = budget.reserve(time.monotonic(), len(block))
                if wait:
                    time.sleep(wait)
                outputfile.write(block)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: Handler(*a, directory=directory))
    print(server.server_address[1], flush=True)
    print("ready", flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sys.stdin.read()


def _child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    """Close every child's stdin (they exit on it); kill whichever has not exited in 30 s."""
    for p in procs:
        try:
            _pipe(p.stdin).close()
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# -- the contenders -------------------------------------------------------------------------------


def run_star(path: Path, relays: int, work: Path, digest: str, cap_bps: float) -> dict:
    procs = [_child("--capped-server", str(path.parent), str(cap_bps))]
    try:
        port = _pipe(procs[0].stdout).readline().strip()
        _expect(procs[0], "ready")
        url = f"http://127.0.0.1:{port}/{path.name}"
        clients = [_child("--http-client", url, str(work / f"star{i}"), digest) for i in range(relays)]
        procs += clients
        for c in clients:
            _expect(c, "ready")
        t0 = time.perf_counter()
        for c in clients:
            _pipe(c.stdin).write("go\n")
            _pipe(c.stdin).flush()
        for c in clients:
            _expect(c, "done")
        return {"seconds": time.perf_counter() - t0}
    finally:
        _stop(procs)


def run_p2pnet(path: Path, relays: int, work: Path, chunk: int, cap_bps: float) -> dict:
    from p2pnet.localnet import control_call, relay_network

    with relay_network(work, relays, args_for={0: ["--upload-bps", str(int(cap_bps))]}, ready_timeout_s=60,
                       tables_timeout_s=120, reachable_timeout_s=120) as net:
        origin = net.publisher
        deadline_s = 60 + 4 * relays * path.stat().st_size / cap_bps  # (even a star through the cap fits)
        waits = VersionWaits(net.relays, deadline_s)
        t0 = time.perf_counter()
        control_call(origin.data_dir, {"cmd": "checkpoint.publish", "paths": [str(path)], "model": "bench",
                                       "version": 1, "chunk_bytes": chunk}, timeout_s=600)
        published = time.perf_counter() - t0
        waits.join()
        done = waits.answered()
        served = origin.status()["role_status"]["relay"]["bytes_served"]
        return {"seconds": max(done.values()) - t0, "first_s": min(done.values()) - t0, "publish_s": published,
                "origin_copies": served / path.stat().st_size}


# -- the runs -------------------------------------------------------------------------------------


def main() -> int:
    roles = {"--capped-server": lambda a: capped_server(a[0], float(a[1])),
             "--http-client": lambda a: http_client(a[0], a[1], a[2])}
    if len(sys.argv) > 1 and sys.argv[1] in roles:
        roles[sys.argv[1]](sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--relays", type=int, default=6, help="receiving relays / star clients (default 6)")
    parser.add_argument("--mib", type=int, default=24, help="checkpoint size in MiB (default 24)")
    parser.add_argument("--upload-mb", type=float, default=3.0,
                        help="the origin's upload cap in MB/s, 10^6 bytes (default 3)")
    parser.add_argument("--runs", type=int, default=3, help="runs; medians are reported (default 3)")
    parser.add_argument("--chunk-kib", type=int, default=64, help="p2pnet chunk size in KiB (default 64)")
    parser.add_argument("--tmp", type=Path, help="where the files go (default: the system temp folder)")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    args = parser.parse_args()
    cap = args.upload_mb * 1e6
    work = Path(tempfile.mkdtemp(prefix="bench-capped-", dir=args.tmp))
    runs: list[dict] = []
    try:
        src = work / "src"
        src.mkdir()
        path = src / "ckpt.safetensors"
        digest = make_checkpoint(path, args.mib)
        size = path.stat().st_size
        bound = max(size / cap - BURST_S, 0.0)
        star_bound = max(args.relays * size / cap - BURST_S, 0.0)
        print(f"{size / 2**20:.2f} MiB to {args.relays} relays on loopback, origin capped at {args.upload_mb} MB/s, "
              f"p2pnet chunks {args.chunk_kib} KiB; lower bound {bound:.2f} s (S/cap - {BURST_S:.0f} s burst), "
              f"the star's {star_bound:.2f} s (N*S/cap - {BURST_S:.0f} s)", flush=True)
        for r in range(args.runs):
            row: dict = {}
            for name in ("p2pnet", "star") if r % 2 == 0 else ("star", "p2pnet"):
                scratch = work / f"run{r}-{name}"
                scratch.mkdir()
                try:
                    if name == "p2pnet":
                        row["p2pnet"] = run_p2pnet(path, args.relays, scratch, args.chunk_kib * 1024, cap)
                    else:
                        row["star"] = run_star(path, args.relays, scratch, digest, cap)
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
            row["over_star"] = row["p2pnet"]["seconds"] / row["star"]["seconds"]
            row["over_bound"] = row["p2pnet"]["seconds"] / bound if bound else float("inf")
            runs.append(row)
            p, s = row["p2pnet"], row["star"]
            print(f"run {r + 1}: p2pnet {p['seconds']:6.2f} s (first relay {p['first_s']:.2f} s, publish returned "
                  f"{p['publish_s']:.2f} s, origin served {p['origin_copies']:.2f} copies); star {s['seconds']:6.2f} s; "
                  f"p2pnet/star {row['over_star']:.2f}x, p2pnet/bound {row['over_bound']:.2f}x", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(f) -> float:
        return statistics.median(f(r) for r in runs)

    print(f"\nmedian of {args.runs}: p2pnet {med(lambda r: r['p2pnet']['seconds']):.2f} s, origin served "
          f"{med(lambda r: r['p2pnet']['origin_copies']):.2f} copies; star {med(lambda r: r['star']['seconds']):.2f} s "
          f"({med(lambda r: r['star']['seconds']) / star_bound if star_bound else float('inf'):.2f}x its bound); "
          f"bound {bound:.2f} s; p2pnet/star {med(lambda r: r['over_star']):.2f}x, "
          f"p2pnet/bound {med(lambda r: r['over_bound']):.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "size_bytes": size,
                                         "bound_s": bound, "star_bound_s": star_bound, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
