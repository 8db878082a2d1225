"""`p2pnet.localnet.relay_network`, the starter the relay process tests and benchmarks share: real
`p2pnet peer start --role relay` processes on loopback. A peer that fails to start is named with
its log; every process it started is stopped, by its PID, on error and on exit; a peer that exits
while waited for fails the wait at once, not at its deadline; starting a peer still running is
refused, as is one past the next new peer. Also `stop_all` (one SIGTERM each, SIGKILL to every
survivor at one deadline for the set), `start_network`'s clean stop when a peer fails to start,
`wait_for_full_tables`' budget (the time spent asking does not count), and a Ctrl-C as a peer's
process starts: both starters stop it with the rest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2pnet import localnet
from p2pnet.localnet import (PeerExited, PeerProcess, relay_network, start_network, start_peer, stop_all,
                            wait_for_full_tables, wait_for_reachable)

pytestmark = pytest.mark.slow

FAST = ["--heartbeat-interval-s", "0.5", "--peer-expiry-s", "6"]


def running_under(root: Path) -> list[int]:
    """PIDs of the processes alive now whose command line names a data directory under `root`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # (it exited while we looked)
            continue
        if state != "Z" and any(arg.decode(errors="replace").startswith(f"{root}/") for arg in argv):
            pids.append(int(entry.name))
    return pids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("failing", [0, 2], ids=["publisher", "relay"])
def test_a_peer_that_fails_to_start_is_named_with_its_log_and_every_peer_started_is_stopped(tmp_path, failing):
    with pytest.raises(PeerExited) as caught:
        with relay_network(tmp_path, 2, args=FAST, args_for={failing: ["--upload-bps", "-5"]}):
            pytest.fail("the network started with a peer that cannot")
    message = str(caught.value)
    log = tmp_path / f"peer{failing}" / f"peer{failing}.log"
    assert message.startswith(f"peer{failing} (pid ") and "exited with 2 before it was ready" in message
    assert f"log: {log}" in message
    assert "peer.upload_bps: must be > 0 (got -5)" in message  # the log's tail
    assert log.exists()
    if failing:
        assert "listening on" not in message and (tmp_path / "peer1" / "peer1.log").exists()  # (it was started)
    assert running_under(tmp_path) == []


def test_every_peer_is_stopped_by_its_pid_on_exit_restarted_ones_too(tmp_path):
    with pytest.raises(RuntimeError, match="the caller's own error"):
        with relay_network(tmp_path, 2, args=FAST, reachable_timeout_s=60) as net:
            assert [p.name for p in net.peers] == ["peer0", "peer1", "peer2"] and net.publisher is net.peers[0]
            ids = {p.peer_id for p in net.peers}
            for peer in net.peers:
                status = peer.status()
                assert status["reachable"] is True
                assert {e["peer_id"] for e in status["peers"] if e["reachable"]} == ids - {peer.peer_id}
            trusted = net.config.read_text()
            assert trusted.startswith(f'[relay]\ntrusted_publishers = ["{net.publisher.peer_id}"]\n')
            with pytest.raises(ValueError, match=r"peer1 \(pid \d+\) is still running"):
                net.start(1)  # (a second process on its data directory)
            assert len(running_under(tmp_path)) == 3
            first = net.peers[2].proc.pid
            net.peers[2].kill()
            again = net.start(2)
            assert net.peers[2] is again and again.proc.pid != first
            pids = [p.proc.pid for p in net.peers]
            assert all(alive(pid) for pid in pids)
            raise RuntimeError("the caller's own error")
    assert [pid for pid in pids if alive(pid)] == []
    assert [p.proc.returncode for p in net.peers] == [0, 0, 0]  # each shut down cleanly, on one SIGTERM
    assert running_under(tmp_path) == []
    assert (tmp_path / "peer2" / "peer2.log").exists()  # (logs stay)


def test_a_peer_that_exits_while_waited_for_fails_the_wait_at_once_with_its_log(tmp_path):
    with relay_network(tmp_path, 1, args=FAST) as net:
        victim = net.relays[0]
        victim.kill()
        for wait in (wait_for_full_tables, wait_for_reachable):
            with pytest.raises(PeerExited) as caught:
                wait(net.peers, 120)  # (at its deadline it would raise PeerUnavailable, not PeerExited)
            assert str(caught.value).startswith(f"peer1 (pid {victim.proc.pid}) exited with -9;")
            assert f"log: {victim.log_path}" in str(caught.value)


def test_start_network_stops_the_peers_it_started_cleanly_when_one_fails_to_start(tmp_path, monkeypatch):
    """On SIGTERM a peer shuts down and removes its control socket; killed outright, it leaves it."""
    started: list[PeerProcess] = []
    start_peer = localnet.start_peer

    def recorded(*args, **kwargs) -> PeerProcess:
        started.append(start_peer(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr("p2pnet.localnet.start_peer", recorded)
    with pytest.raises(PeerExited, match=r"^peer2 \(pid \d+\) exited with 2 before it was ready"):
        start_network(tmp_path, 3, extra_args=FAST, roles_for={2: ["nonsense"]})
    assert [p.proc.returncode for p in started] == [0, 0, 2]
    assert [p.name for p in started if (p.data_dir / "control.sock").exists()] == []
    assert running_under(tmp_path) == []


class SlowToAsk:
    """A peer whose status call takes `ask_s` and whose table is full from its `full_from`-th call."""

    def __init__(self, peer_id: str, others: set[str], ask_s: float, full_from: int):
        self.peer_id, self.others, self.ask_s, self.full_from, self.calls = peer_id, others, ask_s, full_from, 0

    def status(self, timeout_s: float) -> dict:
        self.calls += 1
        time.sleep(self.ask_s)
        known = self.others if self.calls >= self.full_from else set()
        return {"peers": [{"peer_id": p} for p in known]}


def test_the_time_spent_asking_the_peers_does_not_count_against_the_tables_deadline():
    """Many peers on a slow machine: one round of status calls outlasts `timeout_s`. The wait still
    gets its second round (its budget is `timeout_s` between rounds, as under the counted poll)."""
    peers = [SlowToAsk(name, {"a", "b"} - {name}, ask_s=0.2, full_from=2) for name in ("a", "b")]
    wait_for_full_tables(peers, timeout_s=0.05, poll_s=0.01)  # type: ignore[arg-type]
    assert [p.calls for p in peers] == [2, 2]


IGNORES_SIGTERM = """
import signal, sys
def count(signum, frame):
    with open(sys.argv[1], "a") as f:
        f.write("TERM\\n")
signal.signal(signal.SIGTERM, count)
print("ready", flush=True)
while True:
    signal.pause()
"""


class Recorded(subprocess.Popen):
    """A child whose signals and waits are written down, in order, in `events`."""

    def __init__(self, args: list[str], events: list[tuple[int, str, object]], **kwargs) -> None:
        super().__init__(args, **kwargs)
        self.events = events

    def send_signal(self, sig: int) -> None:  # (`kill()` sends SIGKILL through it)
        self.events.append((self.pid, "signal", sig))
        super().send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        self.events.append((self.pid, "wait", timeout))
        return super().wait(timeout)


def test_stop_all_sends_one_sigterm_and_kills_every_peer_that_ignores_it_at_one_deadline(tmp_path):
    """Three stubs that ignore SIGTERM (a second SIGTERM would cut a peer's clean shutdown short:
    they count what they get). Each gets one SIGTERM and one SIGKILL; the waits before the last
    SIGKILL ask for one deadline in all, the set's, not one per peer."""
    events: list[tuple[int, str, object]] = []
    peers = []
    try:
        for i in range(3):
            counted = tmp_path / f"stub{i}.signals"
            proc = Recorded([sys.executable, "-c", IGNORES_SIGTERM, str(counted)], events, stdout=subprocess.PIPE)
            peers.append(PeerProcess(f"stub{i}", tmp_path, proc, tmp_path / f"stub{i}.log"))
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"  # (its handler is set)
        stop_all(peers, timeout_s=2.0)
        seen = list(events)
    finally:
        for peer in peers:
            if peer.proc.poll() is None:
                peer.proc.kill()
                peer.proc.wait()
    pids = [p.proc.pid for p in peers]
    assert [p.proc.returncode for p in peers] == [-signal.SIGKILL] * 3 and not any(alive(pid) for pid in pids)
    assert {pid: [what for who, kind, what in seen if who == pid and kind == "signal"] for pid in pids} == {
        pid: [signal.SIGTERM, signal.SIGKILL] for pid in pids}
    last_kill = max(n for n, (_, kind, what) in enumerate(seen) if kind == "signal" and what == signal.SIGKILL)
    asked = [what for _, kind, what in seen[:last_kill] if kind == "wait"]
    assert sum(asked) <= 2.0, asked  # type: ignore[arg-type]
    # received: one each at most (a handler may not have run before the kill)
    counts = [f.read_text().count("TERM") if f.exists() else 0 for f in sorted(tmp_path.glob("*.signals"))]
    assert max(counts) <= 1, counts


class InterruptedAfter(subprocess.Popen):
    """A real child, then a SIGINT to us as its `Popen` returns, at the `at`-th peer started (the
    children started are in `started`): the KeyboardInterrupt of a Ctrl-C in the worst place,
    the child running and not yet in any list of its starter's."""

    started: list[subprocess.Popen] = []
    at = 1
    signum = signal.SIGINT  # (or SIGTERM, where the starter raises KeyboardInterrupt on it: the devnets)

    def __init__(self, args: list[str], **kwargs) -> None:
        super().__init__(args, **kwargs)
        if "start" in args:  # (`p2pnet peer start`, not `peer id`)
            self.started.append(self)
            if len(self.started) == self.at:
                os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("starter", ["start_network", "relay_network"])
def test_a_ctrl_c_as_a_peer_starts_stops_every_peer_started_that_one_too(tmp_path, monkeypatch, starter):
    """The interrupt comes as the second peer's `Popen` returns: the starter stops it with the
    first (each on its list once its process exists), none is left running under `tmp_path`."""
    monkeypatch.setattr(InterruptedAfter, "started", [])
    monkeypatch.setattr(InterruptedAfter, "at", 2)
    monkeypatch.setattr(subprocess, "Popen", InterruptedAfter)
    try:
        with pytest.raises(KeyboardInterrupt):
            if starter == "start_network":
                start_network(tmp_path, 3, extra_args=FAST)
            else:
                with relay_network(tmp_path, 2, args=FAST):
                    pytest.fail("the network started through the interrupt")
        left = [proc.pid for proc in InterruptedAfter.started if proc.poll() is None]
    finally:
        for proc in InterruptedAfter.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert len(InterruptedAfter.started) == 2 and left == []
    assert running_under(tmp_path) == []


def test_a_relay_network_refuses_to_start_a_peer_past_its_next_new_one(tmp_path):
    """`start(i)` starts peer `i` again, or the next new peer: `peers[i]` is peer `i`. One past
    that is refused before any process starts (it went on the list at the next place, under
    another number than its name's)."""
    with relay_network(tmp_path, 0, args=FAST) as net:
        with pytest.raises(ValueError, match=r"^peer2: this network has peers 0 to 0; the next new one is peer1$"):
            net.start(2)
        assert [p.name for p in net.peers] == ["peer0"] and running_under(tmp_path) == [net.publisher.proc.pid]
        assert not (tmp_path / "peer2").exists()


@pytest.fixture
def sigterm_interrupts():
    """SIGTERM raises KeyboardInterrupt in this process, as `p2pnet devnet` has it
    (`trainer.devnet._stop_on_sigterm`), for the test; the handler before it put back after."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_peer_started_into_a_dict_by_name_is_in_it_through_an_interrupt(tmp_path, monkeypatch, signum,
                                                                          sigterm_interrupts):
    """The devnets keep their peers in a dict by name: `into=` a dict names the new peer there once
    its process exists, so an interrupt in the window (a Ctrl-C, or the SIGTERM a devnet turns into
    one) unwinds a caller that holds it, and the handlers are ours again after."""
    monkeypatch.setattr(InterruptedAfter, "started", [])
    monkeypatch.setattr(InterruptedAfter, "signum", signum)
    monkeypatch.setattr(subprocess, "Popen", InterruptedAfter)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    procs: dict[str, object] = {}
    try:
        with pytest.raises(KeyboardInterrupt):
            start_peer("a", tmp_path / "a", extra_args=FAST, into=procs)
        assert [p.proc for p in procs.values()] == InterruptedAfter.started and list(procs) == ["a"]
    finally:
        for proc in InterruptedAfter.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert {s: signal.getsignal(s) for s in handlers} == handlers
