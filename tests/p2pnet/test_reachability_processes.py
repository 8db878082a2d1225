"""Real peer processes on loopback: advertised addresses, dial-back reachability, late bootstrap.

Across real hosts (wildcard listen, NAT, a bootstrap 90 s late) the same is tested in the lab:
tests/p2pnet/test_lab_network.py.
"""

import subprocess
import sys

import pytest

from p2pnet.localnet import peer_id_of, start_peer, wait_for

pytestmark = pytest.mark.slow
FAST = ["--heartbeat-interval-s", "0.3", "--peer-expiry-s", "3"]


def test_dialback_finds_who_can_be_dialled_and_announce_is_advertised(tmp_path, reserve_port):
    """b announces a libp2p address where nothing listens (a port that is not forwarded): a
    dials it back with a new connection, which fails, so b is not reachable; a is."""
    closed = reserve_port(closed=True)  # bound and not listening: every dial there is refused
    a = start_peer("a", tmp_path / "a", extra_args=FAST)
    a.wait_ready(30)
    b = start_peer("b", tmp_path / "b", bootstrap=[a.addr],
                   extra_args=[*FAST, "--announce", f"/ip4/127.0.0.1/tcp/{closed}"])
    try:
        b.wait_ready(30)
        assert b.addrs == [f"/ip4/127.0.0.1/tcp/{closed}/p2p/{b.peer_id}"]  # what `listening on` shows
        status_b = wait_for(lambda: (s := b.status())["reachable"] is not None and s, 60, "b's reachability")
        assert status_b["reachable"] is False
        assert status_b["reachability"]["libp2p"] is False and status_b["reachability"]["data"] is True
        assert {x["libp2p"] for x in status_b["reachability"]["answers"].values()} == {"failed"}
        assert status_b["addrs"] == [f"/ip4/127.0.0.1/tcp/{closed}/p2p/{b.peer_id}"]
        assert status_b["listen_addrs"][0].startswith("/ip4/127.0.0.1/tcp/")
        status_a = wait_for(lambda: (s := a.status())["reachable"] is not None and s, 60, "a's reachability")
        assert status_a["reachable"] is True
        # everyone else learns it from heartbeats
        seen = wait_for(lambda: {p["peer_id"]: p["reachable"] for p in a.status()["peers"]}.get(b.peer_id) is False,
                        30, "a sees b unreachable")
        assert seen
        text = run_cli("peer", "status", "--data-dir", str(b.data_dir))
        assert "reachable: no" in text and f"/ip4/127.0.0.1/tcp/{closed}/p2p/{b.peer_id}" in text
    finally:
        assert b.stop() == 0 and a.stop() == 0
    assert "Traceback" not in a.log_path.read_text() + b.log_path.read_text()


def run_cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "p2pnet", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_bootstrap_peer_that_starts_late_is_still_joined(tmp_path, reserve_port):
    """b and c are started with a bootstrap address nobody listens on yet; a starts there later
    (after b has failed several dials): b and c join through it and find each other."""
    port = reserve_port()
    config = tmp_path / "peer.toml"
    config.write_text("[peer]\nbootstrap_backoff_max_s = 2.0\n")
    boot_id = peer_id_of(tmp_path / "a")
    boot = f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_id}"
    late = [start_peer(n, tmp_path / n, bootstrap=[boot], extra_args=[*FAST, "--config", str(config)])
            for n in ("b", "c")]
    a = None
    try:
        for p in late:
            p.wait_ready(30)
        wait_for(lambda: "no connections" in late[0].log_path.read_text(), 30, "b reports it is alone")
        a = start_peer("a", tmp_path / "a", extra_args=[*FAST, "--listen", f"/ip4/127.0.0.1/tcp/{port}"])
        a.wait_ready(30)
        assert a.peer_id == boot_id
        want = {boot_id, late[0].peer_id, late[1].peer_id}
        for p in late:
            wait_for(lambda: {e["peer_id"] for e in p.status()["peers"]} == want - {p.peer_id}, 60,
                     f"{p.name} knows every peer")
    finally:
        codes = [p.stop() for p in [*late, *([a] if a else [])]]
    assert codes == [0] * len(codes)

