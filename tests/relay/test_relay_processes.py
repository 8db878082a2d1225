"""Real `p2pnet peer start --role relay` processes on loopback: the relay as users run it.

One network of seven relays serves every test here (starting processes is the slow part):
peer0 publishes, peer1-5 are honest, peer6 runs with the test hook P2PNET_TEST_CORRUPT_CHUNKS=1
and corrupts every chunk it serves. Every wait is bounded.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from p2pnet.localnet import PeerProcess, control_call, peer_id_of, start_peer, wait_for_full_tables, wait_for_reachable

pytestmark = pytest.mark.slow

PEERS = 7
BYZANTINE = 6
FAST = ["--heartbeat-interval-s", "0.5", "--peer-expiry-s", "6"]


def checkpoint(path: Path, mib: float, seed: int) -> Path:
    data = np.random.default_rng(seed).integers(0, 256, size=int(mib * 2**20), dtype=np.uint8)
    save_file({"weights": data}, str(path))
    return path


def relay_status(peer: PeerProcess) -> dict:
    return peer.status()["role_status"]["relay"]


def progress(peer: PeerProcess, version: int) -> dict | None:
    rows = [p for p in relay_status(peer)["transfers"]["progress"] if p["version"] == version]
    return rows[0] if rows else None


def fetch(peer: PeerProcess, version: int, out: Path, timeout_s: float = 60.0) -> list[str]:
    reply = control_call(peer.data_dir, {"cmd": "checkpoint.fetch", "version": version, "out_dir": str(out),
                                         "timeout_s": timeout_s}, timeout_s=timeout_s + 10)
    return reply["files"]


def publish(peer: PeerProcess, path: Path, version: int, chunk_bytes: int) -> dict:
    return control_call(peer.data_dir, {"cmd": "checkpoint.publish", "paths": [str(path)], "model": "test",
                                        "version": version, "chunk_bytes": chunk_bytes}, timeout_s=60)


def start_relay(root: Path, i: int, config: Path, bootstrap: list[str]) -> PeerProcess:
    env = {"P2PNET_TEST_CORRUPT_CHUNKS": "1"} if i == BYZANTINE else None
    return start_peer(f"peer{i}", root / f"peer{i}", roles=["relay"], bootstrap=bootstrap,
                      extra_args=["--config", str(config), *FAST], env=env)


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    root = tmp_path_factory.mktemp("relaynet")
    publisher = peer_id_of(root / "peer0")
    config = root / "relay.toml"
    config.write_text(f'[relay]\ntrusted_publishers = ["{publisher}"]\nstall_timeout_s = 3.0\n'
                      'request_timeout_s = 5.0\nannounce_interval_s = 1.0\nfsync = false\n')
    peers = [start_relay(root, 0, config, [])]
    try:
        peers[0].wait_ready(30)
        peers += [start_relay(root, i, config, [peers[0].addr]) for i in range(1, PEERS)]
        for peer in peers[1:]:
            peer.wait_ready(30)
        wait_for_full_tables(peers, 30)
        wait_for_reachable(peers, 60)  # else the byzantine relay may not be anyone's parent yet
        yield root, config, peers
    finally:
        for peer in peers:
            if peer.proc.stdout is None or not peer.proc.stdout.closed:  # killed ones were stopped already
                peer.stop()


def test_a_64_mib_checkpoint_reaches_every_relay_byte_identical(network):
    root, _, peers = network
    source = checkpoint(root / "v1.safetensors", 64, seed=1)
    reply = publish(peers[0], source, 1, 1 << 20)
    assert reply["chunks"] == 65
    want = source.read_bytes()
    for peer in peers[1:BYZANTINE]:
        files = fetch(peer, 1, root / f"out1-{peer.name}")
        assert [Path(f).read_bytes() == want for f in files] == [True]
    served = sum(sum(relay_status(p)["served_to"].values()) for p in peers[1:BYZANTINE])
    assert served > 0, "honest relays served each other, not only the origin"


def test_the_byzantine_relay_is_detected_penalised_and_banned(network):
    _, _, peers = network
    liar = peers[BYZANTINE]
    assert relay_status(liar)["corrupting_chunks"] is True
    accusers = 0
    for peer in peers[1:BYZANTINE]:
        status = peer.status()
        if liar.peer_id in status["role_status"]["relay"]["transfers"]["banned"]:
            accusers += 1
            entry = [e for e in status["peers"] if e["peer_id"] == liar.peer_id]
            assert not entry or entry[0]["score"] < 0  # penalised (or already banned from the table)
    assert accusers >= 1
    assert all(relay_status(p)["transfers"]["banned"] == [] or liar.peer_id in relay_status(p)["transfers"]["banned"]
               for p in peers[1:BYZANTINE])


def test_a_relay_killed_mid_transfer_does_not_stop_the_others(network):
    root, _, peers = network
    source = checkpoint(root / "v2.safetensors", 24, seed=2)
    victim = peers[5]
    publish(peers[0], source, 2, 64 * 1024)
    for _ in range(200):
        row = progress(victim, 2)
        if row and row["chunks_have"] > 0:
            break
        time.sleep(0.02)
    victim.kill()
    assert row is not None and row["chunks_have"] < row["chunks_total"], "the victim finished before the kill"
    want = source.read_bytes()
    for peer in peers[1:5]:
        files = fetch(peer, 2, root / f"out2-{peer.name}")
        assert Path(files[0]).read_bytes() == want


def test_a_peer_restarted_mid_download_fetches_only_what_it_lacked(network):
    root, config, peers = network
    source = checkpoint(root / "v3.safetensors", 24, seed=3)
    victim = peers[4]
    publish(peers[0], source, 3, 64 * 1024)
    for _ in range(200):
        row = progress(victim, 3)
        if row and row["chunks_have"] >= 20:
            break
        time.sleep(0.02)
    victim.kill()
    assert row is not None and 0 < row["chunks_have"] < row["chunks_total"], row
    have_before = row["chunks_have"]
    restarted = start_relay(root, 4, config, [peers[0].addr])
    peers[4] = restarted  # the fixture stops it at the end
    restarted.wait_ready(30)
    files = fetch(restarted, 3, root / "out3-restarted")
    assert Path(files[0]).read_bytes() == source.read_bytes()
    after = progress(restarted, 3)
    held_at_start = after["chunks_total"] - after["fetched_chunks"]
    assert after["complete"] and held_at_start >= have_before
