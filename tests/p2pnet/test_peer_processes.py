"""Real `p2pnet peer start` processes on loopback: discovery, status, clean stop, restart."""

import json
import subprocess
import sys

import pytest

from p2pnet.localnet import start_network, start_peer, wait_for_full_tables

pytestmark = pytest.mark.slow
FAST = ["--heartbeat-interval-s", "0.3", "--peer-expiry-s", "3"]


def run_cli(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "p2pnet", *args], capture_output=True, text=True, timeout=timeout)


def test_three_processes_discover_each_other_and_stop_cleanly(tmp_path):
    peers = start_network(tmp_path, 3, extra_args=FAST)
    try:
        wait_for_full_tables(peers, timeout_s=30)
        out = run_cli("peer", "status", "--data-dir", str(peers[1].data_dir), "--json")
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        assert status["peer_id"] == peers[1].peer_id
        assert status["addrs"] and status["addrs"][0].endswith("/p2p/" + peers[1].peer_id)
        assert {p["peer_id"] for p in status["peers"]} == {peers[0].peer_id, peers[2].peer_id}
    finally:
        codes = [p.stop(timeout_s=15) for p in peers]
    assert codes == [0, 0, 0]
    for p in peers:
        assert "peer stopped" in p.output
        assert not (p.data_dir / "control.sock").exists() and not (p.data_dir / "peer.json").exists()
        assert "Traceback" not in p.log_path.read_text()


def test_restart_keeps_the_peer_id(tmp_path):
    first = start_peer("a", tmp_path / "a", extra_args=FAST)
    first.wait_ready(30)
    peer_id = first.peer_id
    assert first.stop() == 0
    again = start_peer("a", tmp_path / "a", extra_args=FAST)
    again.wait_ready(30)
    try:
        assert again.peer_id == peer_id
        assert again.status()["peer_id"] == peer_id
    finally:
        assert again.stop() == 0


def test_a_second_peer_on_the_same_data_dir_is_refused(tmp_path):
    first = start_peer("a", tmp_path / "a", extra_args=FAST)
    first.wait_ready(30)
    try:
        out = run_cli("peer", "start", "--data-dir", str(tmp_path / "a"))
        assert out.returncode == 2 and "already running" in out.stderr
    finally:
        first.stop()


def test_bad_flags_are_named_errors():
    out = run_cli("peer", "start", "--data-dir", "/tmp/p2pnet-x", "--heartbeat-interval-s", "-1")
    assert out.returncode == 2 and "peertable.heartbeat_interval_s" in out.stderr
    out = run_cli("peer", "start", "--data-dir", "/tmp/p2pnet-x", "--bootstrap", "/ip4/127.0.0.1/tcp/1")
    assert out.returncode == 2 and "peer.bootstrap" in out.stderr
    out = run_cli("peer", "status", "--data-dir", "/tmp/p2pnet-no-such-peer")
    assert out.returncode == 2 and "no peer is running" in out.stderr
