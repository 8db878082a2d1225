"""Peers on separate hosts of the lab (network namespaces, real links): the real-network behaviour.

Every peer is a real `p2pnet peer start` process inside its own lab host, listening on
`/ip4/0.0.0.0/tcp/0`; only the lab's own addresses are contacted. Skipped, with the lab's
one-line reason, where network namespaces cannot be made.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from p2pnet.lab import HostSpec, Lab
from p2pnet.localnet import PeerProcess, control_call, peer_id_of, start_peer, wait_for

pytestmark = pytest.mark.slow
FAST = ["--heartbeat-interval-s", "0.5", "--peer-expiry-s", "6"]
ANY = "/ip4/0.0.0.0/tcp/0"
LATE_S = 90.0  # the scenario: the bootstrap peer comes up this long after the others


def relay_toml(path: Path, publisher: str) -> Path:
    path.write_text(f'[relay]\ntrusted_publishers = ["{publisher}"]\nchunk_bytes = 262144\nstall_timeout_s = 5.0\n'
                    'request_timeout_s = 5.0\nannounce_interval_s = 1.0\nfsync = false\n')
    return path


def start_on(lab: Lab, name: str, root: Path, *args: str, bootstrap: list[str] = ()) -> PeerProcess:
    return start_peer(name, root / name, bootstrap=bootstrap, wrap=lab.wrap(name),
                      extra_args=["--listen", ANY, *FAST, *args])


def reachable_status(peer: PeerProcess, timeout_s: float = 60.0) -> dict:
    return wait_for(lambda: (s := peer.status())["reachable"] is not None and s, timeout_s,
                    f"{peer.name} learns whether it can be dialled")


def checkpoint(path: Path, mib: float, seed: int) -> Path:
    data = np.random.default_rng(seed).integers(0, 256, size=int(mib * 2**20), dtype=np.uint8)
    save_file({"weights": data}, str(path))
    return path


def fetch(peer: PeerProcess, version: int, out: Path, timeout_s: float = 120.0) -> list[str]:
    reply = control_call(peer.data_dir, {"cmd": "checkpoint.fetch", "version": version, "out_dir": str(out),
                                         "timeout_s": timeout_s}, timeout_s=timeout_s + 10)
    return reply["files"]


def stop_all(peers: list[PeerProcess]) -> list[int]:
    return [p.stop(timeout_s=15) for p in peers]


def test_hosts_behind_a_wildcard_listen_find_each_other_and_get_a_checkpoint(lab_factory, tmp_path):
    """Three hosts, one bootstrap, every peer listening on 0.0.0.0; a NAT'd fourth host joins,
    downloads, is reported unreachable and never serves anyone."""
    lab = lab_factory([HostSpec("a", 200, 400), HostSpec("b", 200, 400), HostSpec("c", 200, 400),
                       HostSpec("n", 200, 400, nat="home")])
    config = relay_toml(tmp_path / "relay.toml", peer_id_of(tmp_path / "a"))
    relay = ["--role", "relay", "--config", str(config)]
    peers = [start_on(lab, "a", tmp_path, *relay)]
    try:
        a = peers[0]
        a.wait_ready(60)
        ip_a = lab.host("a").ip
        assert a.addrs and all(addr.startswith(f"/ip4/{ip_a}/tcp/") for addr in a.addrs), a.addrs
        peers += [start_on(lab, name, tmp_path, *relay, bootstrap=[a.addr]) for name in ("b", "c", "n")]
        for peer in peers[1:]:
            peer.wait_ready(60)
        by_name = {p.name: p for p in peers}
        ids = {p.peer_id for p in peers}
        for peer in peers:
            wait_for(lambda: {e["peer_id"] for e in peer.status()["peers"]} == ids - {peer.peer_id}, 90,
                     f"{peer.name} knows every other host")
        for name in ("a", "b", "c"):
            status = reachable_status(by_name[name])
            ip = lab.host(name).ip
            assert status["reachable"] is True, status["reachability"]
            assert status["data_addr"].startswith(f"{ip}:") and status["data_listen"].startswith("0.0.0.0:")
            assert all(f"/ip4/{ip}/" in addr for addr in status["addrs"])
            assert not any("0.0.0.0" in x or "127.0.0.1" in x for x in [*status["addrs"], status["data_addr"]])
        nat = reachable_status(by_name["n"])
        assert nat["reachable"] is False, nat["reachability"]
        assert nat["reachability"]["data"] is False  # its private address is not where it connects from
        wait_for(lambda: all({e["peer_id"]: e["reachable"] for e in by_name[x].status()["peers"]}[by_name["n"].peer_id]
                             is False for x in ("a", "b", "c")), 30, "every host hears that n is unreachable")

        source = checkpoint(tmp_path / "model.safetensors", 6, seed=1)
        out = subprocess.run([sys.executable, "-m", "p2pnet", "checkpoint", "publish", str(source), "--data-dir",
                              str(a.data_dir), "--model", "lab", "--version", "1"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        for name in ("b", "c", "n"):
            files = fetch(by_name[name], 1, tmp_path / f"out-{name}")
            assert Path(files[0]).read_bytes() == source.read_bytes(), name
        served = by_name["n"].status()["role_status"]["relay"]
        assert served["bytes_served"] == 0 and not served["served_to"], served["served_to"]  # never anyone's source
        for name in ("a", "b", "c"):
            relay_status = by_name[name].status()["role_status"]["relay"]
            assert by_name["n"].peer_id not in relay_status["fetched_from"], (name, relay_status["fetched_from"])
    finally:
        codes = stop_all(peers)
    assert codes == [0] * len(peers)
    for peer in peers:
        assert "Traceback" not in peer.log_path.read_text()


def test_a_bootstrap_host_that_starts_90s_late_still_joins_everyone(lab_factory, tmp_path):
    lab = lab_factory([HostSpec("boot"), HostSpec("b"), HostSpec("c")])
    boot_id = peer_id_of(tmp_path / "boot")
    boot_addr = f"/ip4/{lab.host('boot').ip}/tcp/4001/p2p/{boot_id}"
    early = [start_on(lab, name, tmp_path, bootstrap=[boot_addr]) for name in ("b", "c")]
    peers = list(early)
    try:
        started = time.monotonic()
        for peer in early:
            peer.wait_ready(60)
        wait_for(lambda: all("no connections" in p.log_path.read_text() for p in early), 60,
                 "b and c report that nobody answers")
        time.sleep(max(0.0, LATE_S - (time.monotonic() - started)))  # the scenario itself: 90 s alone
        assert all(not p.status()["connected"] for p in early)
        boot = start_peer("boot", tmp_path / "boot", wrap=lab.wrap("boot"),
                          extra_args=["--listen", "/ip4/0.0.0.0/tcp/4001", *FAST])
        peers.append(boot)
        boot.wait_ready(60)
        want = {boot.peer_id, *(p.peer_id for p in early)}
        for peer in early:  # the backoff is capped at 30 s by default
            wait_for(lambda: {e["peer_id"] for e in peer.status()["peers"]} == want - {peer.peer_id}, 90,
                     f"{peer.name} joined through the late bootstrap and found the others")
    finally:
        codes = stop_all(peers)
    assert codes == [0] * len(peers)
