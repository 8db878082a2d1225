"""Receiving a checkpoint into its file: the relay's path against the other ways a receiver could.

    python benchmarks/bench_receive_paths.py --mib 1024 --runs 5 --pause-page-reporting

One sender process sends a file over loopback TCP with `os.sendfile`; one receiver process
takes it in chunks of `--chunk-mib` into a file of the same size (created sparse, as the relay's
store creates a version's files) and fsyncs it. The receivers, each a fresh process, in rotating
order after one uncounted warm-up round, median of `--runs`:

- `raw`: `recv_into` a reused buffer and `write`, nothing hashed: what raw fan-out's clients do
  in `bench_relay_loopback.py`, the lower bound.
- `buffer`: the system calls and hashing of the relay's path (`p2pnet.dataplane.FrameReader.exactly_into`,
  then the store's blake3 check and `VersionFiles.write_chunk`), without the relay's trio loop and
  threads: `recv_into` a reused buffer, hash the chunk with blake3, `pwrite` it at its offset.
- `mapped`: `recv_into` the file's shared memory map at the chunk's offset (no copy out of a
  buffer), then hash the chunk from the map.
- `splice`: `os.splice` from the socket into a pipe and from the pipe into the file at the chunk's
  offset (the bytes never enter the process), then read the chunk back into a reused buffer and
  hash it.

Every hashing receiver's digests are checked against the sender's. Reported: wall time, the
receiver's and the sender's CPU seconds (user + system, from their rusage) and the machine's
while the receiver ran (from /proc/stat, the CPUs the run may use: pin it with `taskset -c N`
on a shared machine; it also counts the kernel's writeback and softirqs on those CPUs), each
as a ratio to `buffer`'s in the same run.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_relay_loopback import machine_busy_s, page_reporting_paused  # noqa: E402

PATHS = ("raw", "buffer", "mapped", "splice")
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ (Python 3.10+ names it; spelled out for older type stubs)
PIPE_BYTES = 1 << 20


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    filled = 0
    while filled < len(view):
        n = sock.recv_into(view[filled:])
        if not n:
            raise SystemExit(f"the sender closed after {filled} of {len(view)} bytes")
        filled += n


def receive(path: str, sock: socket.socket, fd: int, size: int, chunk: int) -> list[str]:
    """Take `size` bytes from `sock` into the file `fd` by `path`; the chunks' blake3 digests."""
    import blake3

    digests = []
    if path in ("raw", "buffer"):
        buf = bytearray(chunk)
        for offset in range(0, size, chunk):
            view = memoryview(buf)[:min(chunk, size - offset)]
            _recv_exactly(sock, view)
            if path == "buffer":
                digests.append(blake3.blake3(view, max_threads=1).hexdigest())
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
    elif path == "mapped":
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mapped:
            whole = memoryview(mapped)
            for offset in range(0, size, chunk):
                view = whole[offset:min(offset + chunk, size)]
                _recv_exactly(sock, view)
                digests.append(blake3.blake3(view, max_threads=1).hexdigest())
                view.release()
            whole.release()
    elif path == "splice":
        import fcntl

        pipe_out, pipe_in = os.pipe()
        fcntl.fcntl(pipe_in, F_SETPIPE_SZ, PIPE_BYTES)
        buf = bytearray(chunk)
        for offset in range(0, size, chunk):
            length = min(chunk, size - offset)
            moved = 0
            while moved < length:
                n = os.splice(sock.fileno(), pipe_in, length - moved)
                if not n:
                    raise SystemExit(f"the sender closed after {offset + moved} bytes")
                at, left = offset + moved, n
                while left:
                    wrote = os.splice(pipe_out, fd, left, offset_dst=at)
                    at, left = at + wrote, left - wrote
                moved += n
            view = memoryview(buf)[:length]
            done = 0
            while done < length:
                done += os.preadv(fd, [view[done:]], offset + done)
            digests.append(blake3.blake3(view, max_threads=1).hexdigest())
        os.close(pipe_out)
        os.close(pipe_in)
    else:
        raise SystemExit(f"unknown path {path!r}")
    return digests


def receiver_main(args: argparse.Namespace) -> None:
    sock = socket.create_connection(("127.0.0.1", args.port))
    fd = os.open(args.out, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, args.size)
    before = resource.getrusage(resource.RUSAGE_SELF)
    machine0 = machine_busy_s(os.sched_getaffinity(0))
    started = time.perf_counter()
    digests = receive(args.receive, sock, fd, args.size, args.chunk)
    os.fsync(fd)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    machine = machine_busy_s(os.sched_getaffinity(0)) - machine0
    os.close(fd)
    print(json.dumps({"wall_s": wall, "cpu_s": after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime,
                      "machine_cpu_s": machine,
                      "digests": digests}), flush=True)


def sender_main(args: argparse.Namespace) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    before = resource.getrusage(resource.RUSAGE_SELF)
    with open(args.send, "rb") as fh:
        conn.sendfile(fh)
    after = resource.getrusage(resource.RUSAGE_SELF)
    conn.close()
    print(json.dumps({"cpu_s": after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime}), flush=True)


def one_round(path: str, source: Path, out: Path, size: int, chunk: int) -> dict[str, float]:
    me = [sys.executable, __file__]
    sender = subprocess.Popen(me + ["--send", str(source)], stdout=subprocess.PIPE, text=True)
    assert sender.stdout is not None
    try:
        port = int(sender.stdout.readline())
        receiver = subprocess.run(me + ["--receive", path, "--port", str(port), "--out", str(out), "--size",
                                        str(size), "--chunk", str(chunk)], capture_output=True, text=True, check=True)
        sent = json.loads(sender.stdout.readline())
        sender.wait(timeout=60)
    finally:  # a receiver that failed before it connected leaves the sender waiting in accept
        if sender.poll() is None:
            sender.kill()
            sender.wait()
    got = json.loads(receiver.stdout)
    return {"wall_s": got["wall_s"], "receiver_cpu_s": got["cpu_s"], "sender_cpu_s": sent["cpu_s"],
            "machine_cpu_s": got["machine_cpu_s"], "digests": got["digests"]}


def expected_digests(source: Path, chunk: int) -> list[str]:
    import blake3

    with open(source, "rb") as fh:
        return [blake3.blake3(block, max_threads=1).hexdigest() for block in iter(lambda: fh.read(chunk), b"")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024, help="file size in MiB (default 1024)")
    parser.add_argument("--chunk-mib", type=int, default=8, help="chunk size in MiB, the relay's default 8")
    parser.add_argument("--runs", type=int, default=5, help="rounds per receiver; medians are reported")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go (default the temp folder)")
    parser.add_argument("--pause-page-reporting", action="store_true",
                        help="pause the VM's free page reporting for the run (see bench_relay_loopback.py)")
    parser.add_argument("--json", action="store_true", help="print the medians as JSON instead of a table")
    parser.add_argument("--send", help=argparse.SUPPRESS)
    parser.add_argument("--receive", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.send:
        return sender_main(args)
    if args.receive:
        return receiver_main(args)
    if args.mib < 1 or args.chunk_mib < 1 or args.runs < 1:
        parser.error("--mib, --chunk-mib and --runs must be at least 1")
    size, chunk = args.mib << 20, args.chunk_mib << 20
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="p2pnet-receive-") as folder:
        source, out = Path(folder) / "source.bin", Path(folder) / "received.bin"
        with open(source, "wb") as fh:
            for _ in range(0, size, 64 << 20):
                fh.write(os.urandom(min(64 << 20, size - fh.tell())))
        want = expected_digests(source, chunk)  # (also leaves the source in the page cache)
        rounds: dict[str, list[dict[str, float]]] = {p: [] for p in PATHS}
        with page_reporting_paused(args.pause_page_reporting) as reporting:
            one_round("buffer", source, out, size, chunk)  # warm-up, not counted: the first round ran slow
            out.unlink()
            for r in range(args.runs):
                for path in PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]:
                    result = one_round(path, source, out, size, chunk)
                    if path != "raw" and result.pop("digests") != want:
                        raise SystemExit(f"{path}: the received chunks' digests differ from the sent file's")
                    result.pop("digests", None)
                    rounds[path].append(result)
                    out.unlink()
                    print(f"round {r + 1} {path:7s} {result['wall_s']:5.2f} s  receiver {result['receiver_cpu_s']:5.2f}"
                          f"  sender {result['sender_cpu_s']:5.2f}  machine {result['machine_cpu_s']:5.2f} CPU-s",
                          file=sys.stderr, flush=True)
    keys = ("wall_s", "receiver_cpu_s", "sender_cpu_s", "machine_cpu_s")
    medians = {p: {k: statistics.median(r[k] for r in rounds[p]) for k in keys} for p in PATHS}
    if args.json:
        print(json.dumps({"mib": args.mib, "chunk_mib": args.chunk_mib, "runs": args.runs, "page_reporting": reporting,
                          "medians": medians, "rounds": rounds}, indent=1))
        return
    print(f"{args.mib} MiB in {args.chunk_mib} MiB chunks over loopback, median of {args.runs}; free page reporting "
          f"{reporting}; x = the path's figure over buffer's (the relay's path)")
    print(f"{'':8s}" + "".join(f"{k:>16s}{'x':>6s}" for k in keys))
    for p in PATHS:
        print(f"{p:8s}" + "".join(f"{medians[p][k]:16.2f}{medians[p][k] / medians['buffer'][k]:6.2f}" for k in keys))


if __name__ == "__main__":
    main()
