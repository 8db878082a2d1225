"""Real relay processes whose stored files rot on disk after a version completed: the next
`checkpoint fetch` finds the rotten chunk, the relay fetches it again from the others, and the
files it returns are byte-identical. The publisher (the origin) recovers the same way, from the
relays that hold the version. Every wait is bounded and scales with the checkpoint size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from p2pnet.localnet import PeerProcess, control_call, relay_network, wait_for

pytestmark = pytest.mark.slow

FAST = ["--heartbeat-interval-s", "0.5", "--peer-expiry-s", "6"]
MIB = 2**20
SIZE_MIB = 4
CHUNK = 64 * 1024
PER_MIB_S = 5.0  # generous seconds per MiB moved, on a loaded 2-core machine


def relay_status(peer: PeerProcess) -> dict:
    return peer.status()["role_status"]["relay"]


def fetch(peer: PeerProcess, version: int, out: Path, timeout_s: float) -> list[str]:
    reply = control_call(peer.data_dir, {"cmd": "checkpoint.fetch", "version": version, "out_dir": str(out),
                                         "timeout_s": timeout_s}, timeout_s=timeout_s + 10)
    return reply["files"]


def stored_file(peer: PeerProcess) -> Path:
    """The peer's copy of the version's one file, in its store's version folder."""
    (path,) = (peer.data_dir / "relay" / "versions").glob("*/v1.safetensors")
    return path


def rot_one_chunk(peer: PeerProcess, index: int) -> None:
    """Flip a byte in the middle of chunk `index` of the peer's stored file (read-only: chmod)."""
    path = stored_file(peer)
    path.chmod(0o644)
    with open(path, "r+b") as fh:
        fh.seek(index * CHUNK + CHUNK // 2)
        byte = fh.read(1)
        fh.seek(index * CHUNK + CHUNK // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    path.chmod(0o444)


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    root = tmp_path_factory.mktemp("rotnet")
    with relay_network(root, 2, args=FAST, config="stall_timeout_s = 3.0\nrequest_timeout_s = 5.0\n"
                       "announce_interval_s = 1.0\nfsync = false\n") as net:
        yield root, net.peers


def test_a_chunk_rotten_on_disk_is_fetched_again_and_checkpoint_fetch_returns_identical_files(network):
    root, peers = network
    source = root / "v1.safetensors"
    data = np.random.default_rng(1).integers(0, 256, size=SIZE_MIB * MIB, dtype=np.uint8)
    save_file({"weights": data}, str(source))
    want = source.read_bytes()
    deadline_s = 20 + PER_MIB_S * SIZE_MIB
    reply = control_call(peers[0].data_dir, {"cmd": "checkpoint.publish", "paths": [str(source)], "model": "test",
                                             "version": 1, "chunk_bytes": CHUNK}, timeout_s=deadline_s)
    chunks = reply["chunks"]
    for peer in peers[1:]:
        assert Path(fetch(peer, 1, root / f"first-{peer.name}", deadline_s)[0]).read_bytes() == want
    wait_for(lambda: all(1 in relay_status(p)["complete_versions"] for p in peers), deadline_s, "all complete")
    before = {p.name: relay_status(p)["transfers"]["progress"][0]["fetched_chunks"] for p in peers}

    rot_one_chunk(peers[1], chunks // 2)
    files = fetch(peers[1], 1, root / "again-peer1", deadline_s)
    assert Path(files[0]).read_bytes() == want
    status = relay_status(peers[1])
    assert status["complete_versions"] == [1] and status["versions"][0]["complete"]
    assert status["transfers"]["progress"][0]["fetched_chunks"] == before["peer1"] + 1  # only the rotten one
    assert stored_file(peers[1]).read_bytes() == want  # the chunk was stored again, in place
    assert "was corrupt on disk" in peers[1].log_path.read_text()

    rot_one_chunk(peers[0], chunks // 3)  # the origin: nobody to fetch from but the relays that hold it
    files = fetch(peers[0], 1, root / "again-peer0", deadline_s)
    assert Path(files[0]).read_bytes() == want
    progress = relay_status(peers[0])["transfers"]["progress"][0]
    assert progress["complete"] and progress["chunks_have"] == chunks
    assert progress["fetched_chunks"] == before["peer0"] + 1
    assert "was corrupt on disk" in peers[0].log_path.read_text()
