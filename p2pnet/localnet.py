"""Real peer processes on this machine: start them, wait for them, ask them, stop them.

Used by `p2pnet demo`, `p2pnet devnet`, the benchmarks and the real-process tests. Each peer is
a `p2pnet peer start` child process with its own data directory and log file. Readiness is the
`listening on` line on its stdout; status comes through its control socket; stopping sends
SIGTERM to that child's PID alone and waits, escalating to SIGKILL after a deadline. Every wait
here is bounded by a deadline, and one that finds a peer exited fails at once with `PeerExited`
(its exit status and the tail of its log), not at the deadline. A peer is on its starter's list
(the peers stopped on the way out) as soon as its process exists: a Ctrl-C while starting a
network stops every peer started (`_interrupts_held`).

`relay_network` starts the network the relay tests and benchmarks share: a publisher and relays
bootstrapped from it, all `--role relay` under one config that trusts the publisher, started
until every table is full (and, if asked, every peer reachable), each stopped by its PID on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import trio

from p2pnet.control import call
from p2pnet.errors import PeerUnavailable

LOG_TAIL_CHARS = 2000


class PeerExited(PeerUnavailable):
    """A peer process we started has exited; the message names it, its exit status and its log,
    with the log's tail. `wait_for` does not retry it: an exited process never comes back."""


@dataclass
class PeerProcess:
    name: str
    data_dir: Path
    proc: subprocess.Popen
    log_path: Path
    peer_id: str = ""
    addrs: list[str] = field(default_factory=list)
    output: list[str] = field(default_factory=list)

    @property
    def addr(self) -> str:
        return self.addrs[0]

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Read stdout until the peer prints its listen address (or exits, or time runs out)."""
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        pending = b""
        while not self.addrs:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerUnavailable(f"{self.name} not ready after {timeout_s}s; log: {self.log_path}\n"
                                      f"{self.log_tail()}")
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            data = os.read(fd, 65536)
            if not data:
                self.proc.wait()
                raise self.exited("before it was ready")
            pending += data
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                self.output.append(line)
                if line.startswith("peer ") and " started" in line:
                    self.peer_id = line.split()[1]
                elif line.startswith("listening on "):
                    self.addrs.append(line.removeprefix("listening on ").strip())

    def status(self, timeout_s: float = 10.0) -> dict[str, Any]:
        self.check_running()
        return control_call(self.data_dir, {"cmd": "status"}, timeout_s=timeout_s)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check_running(self) -> None:
        """PeerExited if this peer's process has exited (a killed one leaves its control socket
        on disk: asking it would only say the connection was refused)."""
        if not self.alive():
            raise self.exited()

    def exited(self, when: str = "") -> PeerExited:
        return PeerExited(f"{self.name} (pid {self.proc.pid}) exited with {self.proc.returncode}"
                          f"{' ' + when if when else ''}; log: {self.log_path}\n{self.log_tail()}")

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def stop(self, timeout_s: float = 10.0, sig: int | None = signal.SIGTERM) -> int:
        """Signal this child (`sig` None: it was signalled already) and wait for it; SIGKILL if it
        has not exited by `timeout_s`."""
        if self.proc.poll() is None:
            if sig is not None:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            rest = self.proc.stdout.read() or b""
            self.output.extend(rest.decode(errors="replace").splitlines())
            self.proc.stdout.close()
        return self.proc.returncode

    def kill(self) -> int:
        return self.stop(timeout_s=5.0, sig=signal.SIGKILL)


def stop_all(peers: Sequence[PeerProcess], timeout_s: float = 10.0) -> None:
    """Stop `peers`, each by its PID: SIGTERM to every one still running, one wait for them all,
    then SIGKILL to every one still running at `timeout_s`, and reap them. They shut down side by
    side (stopped one after another, eight relays took 9.3 s on one core, against 2.8 s), and the
    deadline is the set's, not each peer's: k peers ignoring SIGTERM cost `timeout_s`, not k times it."""
    for peer in peers:
        if peer.alive():
            peer.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for peer in peers:
        try:
            peer.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # (killed below, with every other one still running)
    for peer in peers:
        if peer.alive():
            peer.proc.kill()
    for peer in peers:
        peer.stop(timeout_s, sig=None)  # reaps it (a second SIGTERM would cut a clean shutdown short)


def peer_id_of(data_dir: Path) -> str:
    """The peer id of the key in `data_dir` (`p2pnet peer id`; creates the key if there is none)."""
    return subprocess.check_output([sys.executable, "-m", "p2pnet", "peer", "id", "--data-dir", str(data_dir)],
                                   text=True, timeout=60).strip()


def control_call(data_dir: Path, request: dict[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
    reply = trio.run(lambda: call(data_dir, request, timeout_s=timeout_s))
    if "error" in reply:
        raise PeerUnavailable(f"{data_dir}: {reply['error']}")
    return reply


# the signals whose Python handler a peer's start holds off (`_interrupts_held`): a Ctrl-C, and a
# SIGTERM where the starter raises on it as on a Ctrl-C (`p2pnet devnet`'s handler)
HELD_SIGNALS: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold SIGINT's and SIGTERM's Python handlers (KeyboardInterrupt, by default, for SIGINT;
    `p2pnet devnet` raises it on SIGTERM too) off until the block ends, then run them, once per
    signal that came, in the order they came: a child started inside is on its caller's list
    before the interrupt unwinds the caller, which then stops it (`start_network`,
    `relay_network`, the devnets), where an interrupt between `Popen` and the list (or inside
    `Popen`, once the child exists) left it running, unnamed. Only our own handlers are swapped,
    for the block, and put back whatever the block raised: no signal mask changes, so a child's
    signals are its own as before (exec resets a caught signal to its default; a Ctrl-C reaches
    the children as ever). Outside the main thread, where no handler runs, and for a signal
    ignored or left to its default action (no Python handler: nothing to hold), nothing is
    swapped."""
    main = threading.current_thread() is threading.main_thread()
    previous: dict[int, Callable[[int, Any], Any]] = {}
    for signum in HELD_SIGNALS if main else ():
        handler = signal.getsignal(signum)
        if callable(handler):
            previous[signum] = handler
    caught: list[tuple[int, Any]] = []
    try:
        for signum in previous:
            signal.signal(signum, lambda signum, frame: caught.append((signum, frame)))
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum, frame in caught:
            previous[signum](signum, frame)


def start_peer(
    name: str,
    data_dir: Path,
    *,
    bootstrap: Sequence[str] = (),
    roles: Sequence[str] = (),
    extra_args: Sequence[str] = (),
    log_dir: Path | None = None,
    env: dict[str, str] | None = None,
    wrap: Sequence[str] = (),
    into: list[PeerProcess] | dict[str, PeerProcess] | None = None,
) -> PeerProcess:
    """Start `p2pnet peer start` as a child process; call `wait_ready` before using it.

    `wrap` is a command prefix, for example `Lab.wrap(host)` (`ip netns exec NS`) to run the
    peer on a lab host; it execs the peer, so the child's PID is still the peer's. `into`: the
    caller's peers, to stop on its way out (a list, or a dict by name, where the new one is
    `into[name]`); the new one is in it once its process exists, before a KeyboardInterrupt can
    unwind the caller (`_interrupts_held`): a caller that only keeps what we return never gets
    the peer an interrupt in that window started."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = (log_dir or data_dir) / f"{name}.log"
    args = [*wrap, sys.executable, "-m", "p2pnet", "--log-level", "info", "peer", "start", "--data-dir", str(data_dir)]
    for addr in bootstrap:
        args += ["--bootstrap", addr]
    for role in roles:
        args += ["--role", role]
    args += list(extra_args)
    child_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    child_env.update(env or {})
    with _interrupts_held(), open(log_path, "ab") as log:  # (the child has its own copy of the log's descriptor)
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, env=child_env, stdin=subprocess.DEVNULL)
        peer = PeerProcess(name, data_dir, proc, log_path)
        if isinstance(into, dict):
            into[name] = peer
        elif into is not None:
            into.append(peer)
    return peer


def start_network(
    root: Path,
    count: int,
    *,
    extra_args: Sequence[str] = (),
    roles_for: dict[int, Sequence[str]] | None = None,
    ready_timeout_s: float = 60.0,
) -> list[PeerProcess]:
    """Start `count` peers under `root`: peer 0 first, the others bootstrapped from it. On any
    error, a KeyboardInterrupt too, every peer started is stopped (each is on the list once its
    process exists: `start_peer`'s `into`)."""
    peers: list[PeerProcess] = []
    try:
        first = start_peer("peer0", root / "peer0", extra_args=extra_args, roles=(roles_for or {}).get(0, ()),
                           into=peers)
        first.wait_ready(ready_timeout_s)
        for i in range(1, count):
            start_peer(f"peer{i}", root / f"peer{i}", bootstrap=[first.addr], extra_args=extra_args,
                       roles=(roles_for or {}).get(i, ()), into=peers)
        for peer in peers[1:]:
            peer.wait_ready(ready_timeout_s)
    except BaseException:
        stop_all(peers)  # (SIGTERM first: a peer killed outright leaves its control socket behind)
        raise
    return peers


def wait_for(check: Any, timeout_s: float, what: str, poll_s: float = 0.25) -> Any:
    """Call `check()` until it returns something truthy (returned) or `timeout_s` passes
    (PeerUnavailable naming `what` and the last value). Peers that are not up yet are retried;
    one whose process has exited (`PeerExited`) is not."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = check()
        except PeerExited:
            raise
        except PeerUnavailable as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise PeerUnavailable(f"{what}: not true after {timeout_s}s (last: {str(last)[:300]})")
        time.sleep(poll_s)


def wait_for_reachable(peers: Sequence[PeerProcess], timeout_s: float, poll_s: float = 0.25,
                       status_timeout_s: float = 10.0) -> None:
    """Wait until every peer has been dialled back and sees every other as reachable: from then
    on relays plan each other as parents (`relay.role.serving_uploads`). Any of them exiting
    meanwhile fails the wait at once (`PeerExited`)."""
    ids = {p.peer_id for p in peers}

    def settled(peer: PeerProcess) -> bool:
        for each in peers:
            each.check_running()
        status = peer.status(status_timeout_s)
        seen = {e["peer_id"] for e in status["peers"] if e["reachable"]}
        return status["reachable"] is True and seen >= ids - {peer.peer_id}

    for peer in peers:
        wait_for(lambda: settled(peer), timeout_s, f"{peer.name} reachable and sees every peer reachable", poll_s)


def wait_for_full_tables(peers: Sequence[PeerProcess], timeout_s: float, poll_s: float = 0.25,
                         on_progress: Any = None, status_timeout_s: float = 10.0) -> float:
    """Poll until every peer knows every other; returns seconds taken; raises once `timeout_s`
    has passed between the rounds of status calls. The rounds themselves (one call per peer, each
    bounded by `status_timeout_s`) do not count: they grow with the peers and the machine's load,
    and a deadline that counted them would give many peers on a slow machine fewer rounds than
    `timeout_s / poll_s`, the budget every caller was sized for."""
    start = asked = time.monotonic()
    deadline = start + timeout_s
    want = {p.peer_id for p in peers}
    while True:
        known = {p.peer_id: {e["peer_id"] for e in p.status(status_timeout_s)["peers"]} for p in peers}
        if on_progress is not None:
            on_progress(known)
        if all(known[p] == want - {p} for p in want):
            return time.monotonic() - start
        now = time.monotonic()
        deadline += now - asked
        if now >= deadline:
            raise PeerUnavailable(f"peer tables incomplete after {timeout_s}s between rounds "
                                  f"({now - start:.1f}s in all): "
                                  + json.dumps({k[:12]: len(v) for k, v in known.items()}))
        time.sleep(poll_s)
        asked = time.monotonic()


@dataclass
class RelayNetwork:
    """What `relay_network` started: `peers[0]` is the publisher, `peers[1:]` the relays, each
    named `peer<i>` with its data directory `root/peer<i>` and its log `peer<i>.log` in it."""

    root: Path
    config: Path
    peers: list[PeerProcess]
    _args_for: Mapping[int, Sequence[str]]
    _env_for: Mapping[int, Mapping[str, str]]
    _args: Sequence[str]
    _ready_timeout_s: float
    _wrap_for: Mapping[int, Sequence[str]] = field(default_factory=dict)
    _stop_timeout_s: float = 10.0
    _started: list[PeerProcess] = field(default_factory=list)

    @property
    def publisher(self) -> PeerProcess:
        return self.peers[0]

    @property
    def relays(self) -> list[PeerProcess]:
        return self.peers[1:]

    def start(self, i: int) -> PeerProcess:
        """Start peer `i` again (same data directory, settings and bootstrap) after it was stopped
        or killed, and wait until it listens; it is stopped with the rest on exit. A peer still
        running is the caller's mistake (a second process on its data directory): ValueError, as
        is one past the next new peer (`_launch`)."""
        if i < len(self.peers) and self.peers[i].alive():
            raise ValueError(f"peer{i} (pid {self.peers[i].proc.pid}) is still running: stop or kill it first")
        peer = self._launch(i)
        peer.wait_ready(self._ready_timeout_s)
        return peer

    def _launch(self, i: int) -> PeerProcess:
        """Start peer `i`'s process (not waited for): one of ours again, or the next new one
        (`i` == the number of peers: `peers[i]` is it). Past that, ValueError, nothing started:
        `peers[i]` must be peer `i` (its name, data directory and settings), and a gap would put it
        at another place. Its process is among those stopped on exit (`_started`) as soon as it
        exists, before a KeyboardInterrupt can unwind us (`start_peer`'s `into`)."""
        if not 0 <= i <= len(self.peers):
            raise ValueError(f"peer{i}: this network has peers 0 to {len(self.peers) - 1}; the next new one is "
                             f"peer{len(self.peers)}")
        env = self._env_for.get(i)
        peer = start_peer(f"peer{i}", self.root / f"peer{i}", roles=["relay"],
                          bootstrap=[self.publisher.addr] if i else [],
                          extra_args=["--config", str(self.config), *self._args, *self._args_for.get(i, ())],
                          env=dict(env) if env is not None else None, wrap=self._wrap_for.get(i, ()),
                          into=self._started)
        if i < len(self.peers):
            self.peers[i] = peer
        else:
            self.peers.append(peer)
        return peer

    def stop(self) -> None:
        """Stop every peer this network started (restarted ones too), each by its PID."""
        stop_all(self._started, self._stop_timeout_s)


@contextlib.contextmanager
def relay_network(
    root: Path,
    relays: int,
    *,
    config: str = "",
    trusted: Sequence[int] = (0,),
    args: Sequence[str] = (),
    args_for: Mapping[int, Sequence[str]] | None = None,
    env_for: Mapping[int, Mapping[str, str]] | None = None,
    wrap_for: Mapping[int, Sequence[str]] | None = None,
    ready_timeout_s: float = 30.0,
    tables_timeout_s: float = 30.0,
    reachable_timeout_s: float | None = None,
    status_timeout_s: float = 10.0,
    stop_timeout_s: float = 10.0,
) -> Iterator[RelayNetwork]:
    """A publisher and `relays` relays on loopback, every one `p2pnet peer start --role relay`.

    Writes `root/relay.toml`: a `[relay]` section trusting the peers numbered in `trusted` (peer 0,
    the publisher, by default) followed by the lines of `config` (for example `fsync = false`).
    Every peer gets `--config` and `args`; peer `i` also `args_for[i]`, the environment
    `env_for[i]` and the command prefix `wrap_for[i]` (`Lab.wrap(host)`: it runs on a lab host).
    Starts the publisher, then the relays bootstrapped from it; waits until each listens
    (`ready_timeout_s` each), every table is full (`tables_timeout_s`) and, with
    `reachable_timeout_s`, every peer is reachable and sees every other reachable (from then on
    relays plan each other as parents); each status call in those waits may take
    `status_timeout_s` (many peers on one core answer slowly). Yields the `RelayNetwork`; on exit,
    or on any error while starting, stops every peer it started by its PID (`stop_all`, one
    `stop_timeout_s` for them all). A peer that exits while the network starts raises
    `PeerExited` naming it, with its log's tail; the logs stay under `root`."""
    net = RelayNetwork(root, root / "relay.toml", [], args_for or {}, env_for or {}, args, ready_timeout_s,
                       wrap_for or {}, stop_timeout_s)
    try:
        root.mkdir(parents=True, exist_ok=True)
        trusted_ids = ", ".join(f'"{peer_id_of(root / f"peer{i}")}"' for i in trusted)
        net.config.write_text(f"[relay]\ntrusted_publishers = [{trusted_ids}]\n{config}")
        net.start(0)
        for i in range(1, relays + 1):  # all launched, then waited for: they start side by side
            net._launch(i)
        for peer in net.relays:
            peer.wait_ready(ready_timeout_s)
        wait_for_full_tables(net.peers, tables_timeout_s, status_timeout_s=status_timeout_s)
        if reachable_timeout_s is not None:
            wait_for_reachable(net.peers, reachable_timeout_s, status_timeout_s=status_timeout_s)
        yield net
    finally:
        net.stop()
