"""Loopback race: one checkpoint to N peer processes, p2pnet against what a user would pick instead.

    python benchmarks/bench_relay_loopback.py --mib 1024 --peers 8 --runs 3 [--tmp DIR] [--json FILE]

Four contenders, all in every round (the order rotates), on the same file; medians over rounds:

1. raw: an origin process sends the file to N client processes over plain TCP (`os.sendfile`,
   one thread per client); each client writes it to its own file and fsyncs it. No hashing,
   no protocol: what moving these bytes onto this disk costs at the least.
2. rawhash: raw, but each client also hashes what it receives with blake3 (one thread) before
   writing it and checks the digest at the end: the least a *verified* copy costs, the floor
   for anything that checks the bytes it is given (p2pnet, the star).
3. http: python's `http.server` (ThreadingHTTPServer) serves the file; N client processes
   download it with urllib, hash it with blake3 as they go, write it, fsync it and check the
   digest: the plain star a user would set up.
4. p2pnet: 1 + N `p2pnet peer start --role relay` processes (fsync on, as by default), a fresh
   network each round; timed from the `checkpoint.publish` request to the publisher until every
   other peer's `checkpoint.wait` returned (the version verified, complete and durable in its
   store: a folder of the version's files).

Every process is started (and the baselines' connections made) before the clock starts, and
the same amount of page cache is written and freed just before it (`warm`); in a VM that hands
freed memory back to its host, `--pause-page-reporting` keeps that cost out of the race altogether
(see `page_reporting_paused`: without it, the longer a contender takes, the more of its writes
land in memory the host must fault in again). Per
contender: wall seconds; CPU core-seconds of all its processes (/proc/PID/stat) and of the whole
machine (/proc/stat: kernel threads too, such as the flusher that writes back what a process
wrote without fsync, and loopback's softirqs; the harness's sampling adds a little); bytes its
processes wrote to the storage layer (/proc/PID/io write_bytes - cancelled_write_bytes; tmpfs has
no storage layer and reads 0); the peak private memory of each process (RssAnon of
/proc/PID/status, sampled every 0.05 s for every contender alike: resident anonymous memory,
private here since no process shares its heap with another; smaps_rollup's Private_* walks
every mapping at each read, which took 3.5% of the machine during p2pnet's round, competing
with the peers, and also counts libraries' clean pages); and its phases, read with those samples:
when the bytes all its processes wrote reached 1% and 99% of the total (the start; the rest, until done,
is the last chunks and the fsyncs), and the core-seconds the machine left idle in each of those three
phases (its cores times the phase's length, less /proc/stat's busy time then: a phase with none idle
was CPU-bound, and only its CPU can shorten it). With `--tmp` on tmpfs (/dev/shm) the
disk leaves the race and what remains is CPU and protocol; on a disk, fsync makes everyone wait for it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import http.server
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUFFER = 4 << 20
CONTENDERS = ("raw", "rawhash", "http", "p2pnet")
IDLE_S = 5.0


def make_checkpoint(path: Path, mib: int) -> str:
    """A safetensors file of `mib` MiB of random bytes, on disk; its blake3 hex digest."""
    import blake3
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    save_file({"w": rng.integers(0, 256, size=mib * 2**20, dtype=np.uint8)}, str(path))
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
        return blake3.blake3(fh.read(), max_threads=1).hexdigest()


# -- child processes of the baselines (this file, run with a role flag) ---------------------------


def _write_all(fh, view) -> None:
    while view:
        view = view[fh.write(view):]


def raw_origin(path: str, clients: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    conns = [listener.accept()[0] for _ in range(clients)]
    print("ready", flush=True)
    sys.stdin.readline()  # go

    def send(conn: socket.socket) -> None:
        with conn, open(path, "rb") as fh:
            conn.sendfile(fh)

    threads = [threading.Thread(target=send, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("done", flush=True)
    sys.stdin.read()


def raw_client(port: int, out: str, digest: str | None = None) -> None:
    """Receive the file into `out`; with `digest`, hash it (blake3, one thread) as it arrives
    and check it at the end."""
    import blake3

    hasher = blake3.blake3(max_threads=1) if digest else None
    sock = socket.create_connection(("127.0.0.1", port))
    print("ready", flush=True)
    buf = bytearray(BUFFER)
    view = memoryview(buf)
    with open(out, "wb", buffering=0) as fh:
        while True:
            filled = 0
            while filled < BUFFER:  # whole buffers: one write per 4 MiB, as the http client does
                n = sock.recv_into(view[filled:])
                if not n:
                    break
                filled += n
            if hasher is not None:
                hasher.update(view[:filled])
            _write_all(fh, view[:filled])
            if filled < BUFFER:
                break
        os.fsync(fh.fileno())
    if hasher is not None and hasher.hexdigest() != digest:
        raise SystemExit(f"{out}: digest mismatch")
    print("done", flush=True)
    sys.stdin.read()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def http_server(directory: str) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=directory))
    print(server.server_address[1], flush=True)
    print("ready", flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sys.stdin.read()


def http_client(url: str, out: str, digest: str) -> None:
    import urllib.request

    import blake3

    print("ready", flush=True)
    sys.stdin.readline()  # go
    hasher = blake3.blake3(max_threads=1)
    buf = bytearray(BUFFER)
    view = memoryview(buf)
    with urllib.request.urlopen(url) as response, open(out, "wb", buffering=0) as fh:
        while True:
            n = response.readinto(view)
            if not n:
                break
            hasher.update(view[:n])
            _write_all(fh, view[:n])
        os.fsync(fh.fileno())
    if hasher.hexdigest() != digest:
        raise SystemExit(f"{out}: digest mismatch")
    print("done", flush=True)
    sys.stdin.read()


# -- measuring processes --------------------------------------------------------------------------


def cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def written(pid: int) -> int:
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(io["write_bytes"]) - int(io["cancelled_write_bytes"])


def machine_busy_s(cpus: set[int] | None = None) -> float:
    """CPU seconds every core of this machine (or only the cores numbered in `cpus`) spent busy so
    far, kernel threads included: /proc/stat's counters less idle and iowait."""
    wanted = {"cpu"} if cpus is None else {f"cpu{n}" for n in cpus}  # ("cpu": the line of all cores)
    busy = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name in wanted:
            fields = [int(x) for x in values[:8]]
            busy += sum(fields) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK")


def private_bytes(pid: int) -> int:
    """Resident anonymous memory of `pid` (cheap to read: no walk over its mappings)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class Watch:
    """CPU, bytes written and peak private memory of some processes, from `start` to `stop`, and
    when the writing got under way and when it was nearly done (`phases`): the bytes written by
    them all, read every `SAMPLE_S`, reaching 1% and 99% of what they wrote in the end, and the
    core-seconds the whole machine left idle before, between and after those two moments."""

    SAMPLE_S = 0.05

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.peak = {name: private_bytes(pid) for name, pid in pids.items()}
        self.progress: list[tuple[float, int, float]] = []  # (seconds since start, bytes written, machine busy CPU-s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.SAMPLE_S):
            total = 0
            for name, pid in self.pids.items():
                try:
                    self.peak[name] = max(self.peak[name], private_bytes(pid))
                    total += written(pid) - self.io0[name]
                except (FileNotFoundError, ProcessLookupError):
                    pass
            self.progress.append((time.perf_counter() - self.t0, total, machine_busy_s() - self.busy0))

    def phases(self, total: int, took: float, busy: float) -> dict:
        """When the bytes written reached 1% and 99% of `total` (seconds since start; None if never
        seen, between samples at the end), and the machine's idle core-seconds from the start to
        the first, from the first to the second and from the second to the end (`took` seconds,
        `busy` CPU-s in all); the phases' bounds are the samples', so they are `SAMPLE_S` coarse."""
        def reached(share: float) -> tuple[float, float] | None:
            return next(((t, b) for t, n, b in self.progress if n >= share * total), None)
        first, most = reached(0.01), reached(0.99)
        cores = os.cpu_count() or 1
        marks = [(0.0, 0.0), *(m for m in (first, most) if m is not None), (took, busy)]
        idle = [max(0.0, cores * (t1 - t0) - (b1 - b0)) for (t0, b0), (t1, b1) in zip(marks, marks[1:])]
        return {"first_pct_s": None if first is None else first[0], "most_s": None if most is None else most[0],
                "idle_core_s": idle if len(idle) == 3 else None}

    def start(self) -> None:
        self.cpu0 = {n: cpu_s(p) for n, p in self.pids.items()}
        self.io0 = {n: written(p) for n, p in self.pids.items()}
        self.busy0 = machine_busy_s()
        self.t0 = time.perf_counter()
        self._thread.start()

    def stop(self) -> dict:
        took = time.perf_counter() - self.t0
        busy = machine_busy_s() - self.busy0
        self._stop.set()
        self._thread.join()
        user = sum(cpu_s(p)[0] - self.cpu0[n][0] for n, p in self.pids.items())
        system = sum(cpu_s(p)[1] - self.cpu0[n][1] for n, p in self.pids.items())
        per = {n: [round(a - b, 2) for a, b in zip(cpu_s(p), self.cpu0[n])] for n, p in self.pids.items()}
        total = sum(written(p) - self.io0[n] for n, p in self.pids.items())
        return {"seconds": took, "cpu_s": user + system, "user_s": user, "sys_s": system, "machine_cpu_s": busy,
                "per_process": per, "written_bytes": total, "peak_private": dict(self.peak),
                **self.phases(total, took, busy)}


def warm(folder: Path, nbytes: int) -> None:
    """Write and delete `nbytes` of page cache right before a clock starts. In a VM that hands
    freed memory back to its host (free page reporting, as here), the first writer into fresh
    memory pays the host's page faults: warming the same amount before every contender keeps
    that cost out of the comparison (measured: it decides which contender wins otherwise)."""
    block = bytes(64 << 20)
    path = folder / "warm"
    with open(path, "wb", buffering=0) as fh:
        for _ in range(nbytes // len(block)):
            fh.write(block)
    path.unlink()


PAGE_REPORTING_ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")
PAGE_REPORTING_LOCKS = (Path("/run/p2pnet-page-reporting.lock"),  # the first whose folder we may write
                        Path(tempfile.gettempdir()) / "p2pnet-page-reporting.lock")


@contextlib.contextmanager
def page_reporting_paused(pause: bool):
    """With `pause`, stop the kernel handing free memory back to the VM's host for the duration.

    Free page reporting (virtio-balloon) returns freed blocks of 2^order pages to the host within
    seconds; writing into them later costs the host's page faults, here 8x the system time of
    writing into memory the guest kept (2 GiB into the page cache: 0.36-0.40 s written at once
    after freeing, 3.1-4.9 s written 5-10 s later; 0.38 s at every delay with reporting paused).
    `warm` hides that only from whoever writes within those seconds, so the race charged a
    contender more per byte the longer it took. Raising the reporting order above the largest
    block the buddy allocator has (/proc/buddyinfo's columns) reports nothing; the old order is
    written back on exit. One run at a time: a second run would save the first's raised order
    as "old" and leave reporting paused when it ends, so the pause holds an exclusive lock
    (`page_reporting_lock`) and a second run refuses to start. The lock file also keeps the old
    order while it is raised: a run killed before it could write it back (SIGKILL, the OOM
    killer) leaves it there, and the next run restores that, not the raised order it reads.
    Yields what was done, for the report."""
    if not pause:
        yield "as the machine has it"
        return
    with page_reporting_lock() as (lock_fd, unrestored):
        orders = max(len(line.split()) - 4 for line in Path("/proc/buddyinfo").read_text().splitlines() if line.strip())
        # `timeout` and kill send SIGTERM: leave through the `finally` below, as on Ctrl-C
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        try:
            try:
                old = unrestored or PAGE_REPORTING_ORDER.read_text().strip()
                _note_lock(lock_fd, old)  # before raising it: a run killed from here on leaves it
                PAGE_REPORTING_ORDER.write_text(f"{orders}\n")
            except OSError as exc:
                _note_lock(lock_fd, None)  # (not raised: nothing to restore)
                raise SystemExit(f"--pause-page-reporting: cannot set {PAGE_REPORTING_ORDER} to {orders} ({exc}); it "
                                 "needs root, the page_reporting module, and a kernel that takes an order above its "
                                 "largest block (some cap it, and then reporting cannot be paused this way)") from exc
            try:
                yield f"paused (page_reporting_order {old} -> {orders})" + \
                    (" (restoring the order a killed run left raised)" if unrestored else "")
            finally:
                PAGE_REPORTING_ORDER.write_text(f"{old}\n")
                _note_lock(lock_fd, None)
        finally:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def page_reporting_lock():
    """Hold the exclusive lock on pausing page reporting (the first of `PAGE_REPORTING_LOCKS`
    whose folder we may write) until the block ends; SystemExit at once, naming the holder, if
    another run holds it. The kernel drops the lock when the process dies, however it dies.
    Yields the lock's fd and the old order an earlier run noted and did not write back (None)."""
    path = next((p for p in PAGE_REPORTING_LOCKS if os.access(p.parent, os.W_OK)), PAGE_REPORTING_LOCKS[-1])
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = (os.pread(fd, 64, 0).decode(errors="replace").split() or ["unknown"])[0]
            raise SystemExit(f"--pause-page-reporting: another run (pid {holder}) has paused free page reporting "
                             f"and holds {path}; run one at a time (it restores the setting when it ends)") from None
        noted = os.pread(fd, 64, 0).decode(errors="replace").split()
        unrestored = noted[1] if len(noted) > 1 else None
        _note_lock(fd, unrestored)  # (kept until the caller has written it back)
        yield fd, unrestored
    finally:
        os.close(fd)  # (releases the lock)


def _note_lock(fd: int, old: str | None) -> None:
    """The lock file says who holds it and, while the order is raised, the order to restore."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, (f"{os.getpid()}" + (f" {old}" if old is not None else "") + "\n").encode(), 0)


def _pipe(stream: IO[str] | None) -> IO[str]:
    """A child's stdin or stdout: `_child` opens both as pipes."""
    assert stream is not None
    return stream


def _child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def _expect(proc: subprocess.Popen, word: str) -> None:
    line = _pipe(proc.stdout).readline().strip()
    if line != word:
        raise RuntimeError(f"child said {line!r}, expected {word!r}")


def _finish(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        _pipe(p.stdin).close()
        p.wait(timeout=60)


# -- the three contenders -------------------------------------------------------------------------


def run_raw(path: Path, peers: int, work: Path, digest: str | None = None) -> dict:
    """raw fan-out; with `digest`, each client hashes what it receives (rawhash)."""
    origin = _child("--raw-origin", str(path), str(peers))
    port = _pipe(origin.stdout).readline().strip()
    clients = [_child("--raw-client", port, str(work / f"raw{i}"), *([digest] if digest else []))
               for i in range(peers)]
    for c in clients:
        _expect(c, "ready")
    _expect(origin, "ready")
    warm(work, peers * path.stat().st_size)
    watch = Watch({"origin": origin.pid, **{f"client{i}": c.pid for i, c in enumerate(clients)}})
    watch.start()
    _pipe(origin.stdin).write("go\n")
    _pipe(origin.stdin).flush()
    for c in clients:
        _expect(c, "done")
    result = watch.stop()
    _expect(origin, "done")
    _finish(clients + [origin])
    return result


def run_http(path: Path, peers: int, work: Path, digest: str) -> dict:
    server = _child("--http-server", str(path.parent))
    port = _pipe(server.stdout).readline().strip()
    _expect(server, "ready")
    url = f"http://127.0.0.1:{port}/{path.name}"
    clients = [_child("--http-client", url, str(work / f"http{i}"), digest) for i in range(peers)]
    for c in clients:
        _expect(c, "ready")
    warm(work, peers * path.stat().st_size)
    watch = Watch({"server": server.pid, **{f"client{i}": c.pid for i, c in enumerate(clients)}})
    watch.start()
    for c in clients:
        _pipe(c.stdin).write("go\n")
        _pipe(c.stdin).flush()
    for c in clients:
        _expect(c, "done")
    result = watch.stop()
    _finish(clients + [server])
    return result


class VersionWaits:
    """Each peer's `checkpoint.wait` of version 1, in a thread of its own, placed before the publish
    (a wait costs nothing while it waits): `join` waits for every answer, `answered` gives when each
    came (`time.perf_counter`) or raises the first failure."""

    def __init__(self, peers: list, timeout_s: float) -> None:
        self._done: dict[str, float] = {}
        self._failed: list[BaseException] = []
        self._threads = [threading.Thread(target=self._wait, args=(p, timeout_s)) for p in peers]
        for t in self._threads:
            t.start()
        time.sleep(1.0)  # the waits are in place

    def _wait(self, peer, timeout_s: float) -> None:
        from p2pnet.localnet import control_call

        try:
            control_call(peer.data_dir, {"cmd": "checkpoint.wait", "version": 1, "timeout_s": timeout_s},
                         timeout_s=timeout_s + 10)
            self._done[peer.name] = time.perf_counter()
        except BaseException as exc:  # reported by `answered`
            self._failed.append(exc)

    def join(self) -> None:
        for t in self._threads:
            t.join()

    def answered(self) -> dict[str, float]:
        if self._failed:
            raise RuntimeError(f"checkpoint.wait failed: {self._failed[0]}")
        return self._done


def run_p2pnet(path: Path, peers: int, work: Path, chunk: int) -> dict:
    from p2pnet.localnet import control_call, relay_network

    with relay_network(work / "p2pnet", peers, config=f"budget_bytes = {4 * path.stat().st_size}\n"
                       + os.environ.get("BENCH_RELAY_EXTRA", ""), ready_timeout_s=60, tables_timeout_s=120) as net:
        procs = net.peers
        waits = VersionWaits(procs[1:], 900)
        idle0 = [cpu_s(p.proc.pid) for p in procs]
        time.sleep(IDLE_S)  # what the network costs doing nothing: heartbeats and gossip
        idle_cpu_per_s = sum(sum(b) - sum(a) for a, b in zip(idle0, (cpu_s(p.proc.pid) for p in procs))) / IDLE_S
        warm(work, peers * path.stat().st_size)
        watch = Watch({p.name: p.proc.pid for p in procs})
        watch.start()
        control_call(procs[0].data_dir, {"cmd": "checkpoint.publish", "paths": [str(path)], "model": "bench",
                                         "version": 1, "chunk_bytes": chunk}, timeout_s=600)
        published = time.perf_counter() - watch.t0
        waits.join()
        result = watch.stop()
        result["seconds"] = max(waits.answered().values()) - watch.t0  # the last peer's answer, not the harness's join
        result["publish_s"] = published
        result["idle_cpu_per_s"] = idle_cpu_per_s
        result["served"] = {p.name: p.status()["role_status"]["relay"]["bytes_served"] for p in procs}
        return result


# -- the race -------------------------------------------------------------------------------------


def main() -> int:
    roles = {"--raw-origin": lambda a: raw_origin(a[0], int(a[1])), "--raw-client": lambda a: raw_client(int(a[0]), a[1], *a[2:]),
             "--http-server": lambda a: http_server(a[0]), "--http-client": lambda a: http_client(a[0], a[1], a[2])}
    if len(sys.argv) > 1 and sys.argv[1] in roles:
        roles[sys.argv[1]](sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--mib", type=int, default=1024, help="checkpoint size in MiB (default 1024)")
    parser.add_argument("--peers", type=int, default=8, help="receiving peers (default 8)")
    parser.add_argument("--runs", type=int, default=3, help="rounds; medians are reported (default 3)")
    parser.add_argument("--chunk-mib", type=int, default=8,
                        help="p2pnet chunk size in MiB (default 8, as [relay] chunk_bytes)")
    parser.add_argument("--tmp", type=Path, help="where the files go (default: the system temp folder)")
    parser.add_argument("--json", type=Path, help="write every round's figures here")
    parser.add_argument("--only", choices=CONTENDERS, action="append", help="run only this contender (repeatable)")
    parser.add_argument("--pause-page-reporting", action="store_true",
                        help="stop the kernel handing freed memory back to the VM's host during the race "
                             "(root; restored at the end; one run at a time, a second refuses): see "
                             "page_reporting_paused")
    args = parser.parse_args()
    contenders = tuple(args.only or CONTENDERS)
    work = Path(tempfile.mkdtemp(prefix="bench-relay-", dir=args.tmp))
    rounds: dict[str, list[dict]] = {c: [] for c in contenders}
    with page_reporting_paused(args.pause_page_reporting) as reporting:
        args.page_reporting = reporting
        race(args, contenders, work, rounds)
    report(rounds, args, path_bytes=args.mib * 2**20)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds},
                                        indent=1))
    return 0


def race(args: argparse.Namespace, contenders: tuple[str, ...], work: Path, rounds: dict[str, list[dict]]) -> None:
    try:
        src = work / "src"
        src.mkdir()
        path = src / "ckpt.safetensors"
        digest = make_checkpoint(path, args.mib)
        for r in range(args.runs):
            order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
            for name in order:
                scratch = work / f"round{r}-{name}"
                scratch.mkdir()
                if name == "raw":
                    result = run_raw(path, args.peers, scratch)
                elif name == "rawhash":
                    result = run_raw(path, args.peers, scratch, digest)
                elif name == "http":
                    result = run_http(path, args.peers, scratch, digest)
                else:
                    result = run_p2pnet(path, args.peers, scratch, args.chunk_mib << 20)
                shutil.rmtree(scratch, ignore_errors=True)
                rounds[name].append(result)
                print(f"round {r + 1} {name:<7} {result['seconds']:7.2f} s {result['cpu_s']:7.1f} CPU-s "
                      f"({result['user_s']:.1f} user, {result['machine_cpu_s']:.1f} machine) "
                      f"{result['written_bytes'] / 2**30:6.2f} GiB written", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _median_of(rounds: list[dict], key: str) -> str:
    seen = [r[key] for r in rounds if r.get(key) is not None]
    return f"{statistics.median(seen):.2f} s" if seen else "-"


def _idle_of(rounds: list[dict]) -> str:
    seen = [r["idle_core_s"] for r in rounds if r.get("idle_core_s") is not None]
    return " / ".join(f"{statistics.median(phase):.2f}" for phase in zip(*seen)) if seen else "-"


def report(rounds: dict[str, list[dict]], args: argparse.Namespace, path_bytes: int) -> None:
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "cpu_s", "machine_cpu_s",
                                                                      "written_bytes")}
           for name, rs in rounds.items()}
    for name, rs in rounds.items():
        receivers = [max(v for k, v in r["peak_private"].items() if k not in ("origin", "server", "peer0"))
                     for r in rs]
        med[name]["peak_private_mib"] = statistics.median(receivers) / 2**20
    payload = path_bytes * args.peers
    print(f"\n{args.mib} MiB to {args.peers} peers on loopback, {os.cpu_count()} cores, files in "
          f"{args.tmp or tempfile.gettempdir()}, median of {args.runs}; free page reporting {args.page_reporting}")
    print(f"{'':8} {'seconds':>8} {'p2pnet/x':>9} {'CPU-s':>7} {'p2pnet/x':>9} {'machine CPU-s':>14} "
          f"{'p2pnet/x':>9} {'written/payload':>16} {'peak private MiB per receiver':>30}")
    p = med.get("p2pnet", next(iter(med.values())))

    def over(key: str, m: dict) -> str:  # p2pnet's figure over the contender's ("-" when it measured 0)
        return f"{p[key] / m[key]:9.2f}" if m[key] else f"{'-':>9}"

    for name in med:
        m = med[name]
        print(f"{name:<8} {m['seconds']:8.2f} {over('seconds', m)} {m['cpu_s']:7.1f} "
              f"{over('cpu_s', m)} {m['machine_cpu_s']:14.1f} {over('machine_cpu_s', m)} "
              f"{m['written_bytes'] / payload:16.2f} {m['peak_private_mib']:30.0f}")
    print("phases (medians; bytes written by all of a contender's processes, read every "
          f"{Watch.SAMPLE_S:.2f} s): " + "; ".join(
              f"{name} 1% at {_median_of(rs, 'first_pct_s')}, 99% at {_median_of(rs, 'most_s')}, "
              f"done at {statistics.median(r['seconds'] for r in rs):.2f} s" for name, rs in rounds.items()))
    print(f"idle core-seconds of the machine's {os.cpu_count()} cores (medians) until 1%, from 1% to 99%, from 99% "
          "to done: " + "; ".join(f"{name} {_idle_of(rs)}" for name, rs in rounds.items()))
    if "p2pnet" not in rounds:
        return
    publish = statistics.median(r["publish_s"] for r in rounds["p2pnet"])
    served = statistics.median(sum(r["served"].values()) for r in rounds["p2pnet"])
    print(f"p2pnet: the publish request returned after {publish:.2f} s (median); peak private MiB of the "
          f"publisher {statistics.median(r['peak_private']['peer0'] for r in rounds['p2pnet']) / 2**20:.0f}; "
          f"bytes served / payload {served / payload:.3f}; idle, the {args.peers + 1} peers use "
          f"{statistics.median(r['idle_cpu_per_s'] for r in rounds['p2pnet']):.2f} CPU-s per second")


if __name__ == "__main__":
    raise SystemExit(main())
