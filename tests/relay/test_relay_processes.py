"""Real `p2pnet peer start --role relay` processes on loopback: the relay as users run it.

One network of eight relays serves every test here (starting processes is the slow part):
peer0 publishes, peer1-5 are honest, peer6 runs with the test hook P2PNET_TEST_CORRUPT_CHUNKS=1
and corrupts every chunk it serves, and peer7 publishes too, with its uploads capped at
`SLOW_BPS` (`--upload-bps`). Only the publisher holds a version's chunks at first, so a version
peer7 publishes cannot be whole anywhere before its size over `SLOW_BPS` (less the cap's one
second of burst): a relay killed once it holds some of it is certain to be killed mid-transfer.
The two kill tests share one such version, `v2` (16 MiB): peer4 is killed once it holds 20
chunks, then peer5, holding some. 16 MiB keeps that window several times the time peer4 takes
to hold its 20 chunks (measured after the publish, on one core: 0.9 s; beside two busy loops
1.3 s; peer5 needs one chunk: 0.2-0.3 s, 0.6 s), and no larger, since every relay left must
then fetch it all through the cap. Each relay is its stripe's only forwarder, every other one
its child: the stripes of the victims and of peer6 (banned for corrupting by then) re-form
through one stand-in that alone takes them from peer7 (`relay.sources`, `_stand_in`): peer7
served 1.16-1.18 copies in about 6 s (1.33 once beside two busy loops; the kill test asserts
under 1.7), and 2.55-2.63 copies in 13.6 s when every child took a lost stripe from it (1.84
copies of 12 MiB with no kill, peer6's alone). One transfer through the cap, not one per test: the
file took 43 s, 24 s of it in two. The restarted victim's fetch shows it was not whole when killed.
Each test publishes what it needs (the 64 MiB version of the first two once, in `v1`, the kill
tests' in `v2`) and uses the relays still running, so each passes alone and in any order. Every
wait is bounded, by a deadline that scales with the bytes waited for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from p2pnet.localnet import PeerProcess, control_call, relay_network, wait_for

pytestmark = pytest.mark.slow

PEERS = 8
BYZANTINE = 6
SLOW = 7
SLOW_BPS = 3_000_000  # S bytes from peer7 take at least S / SLOW_BPS - 1 s to leave it: 16 MiB 4.6 s
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


def honest(peers: list[PeerProcess]) -> list[PeerProcess]:
    """The honest relays that are not publishers and still run (a test before may have killed one)."""
    return [peer for peer in peers[1:BYZANTINE] if peer.alive()]


def transfer_deadline_s(nbytes: int) -> float:
    """How long to wait for `nbytes` to move: four times as long as at the slow publisher's rate
    (eight relays and the test may share one loaded core), plus a start-up allowance."""
    return 30.0 + 4 * nbytes / SLOW_BPS


def wait_mid_transfer(victim: PeerProcess, version: int, chunks: int, nbytes: int) -> dict:
    """`victim`'s progress row of `version` once it holds `chunks` chunks or more, asserted not
    complete (it cannot be: see the module docstring)."""
    row = wait_for(lambda: (r := progress(victim, version)) is not None and r["chunks_have"] >= chunks and r,
                   transfer_deadline_s(nbytes), f"{victim.name} holding {chunks} chunks of version {version}",
                   poll_s=0.05)
    assert row["chunks_have"] < row["chunks_total"], (f"{victim.name} finished version {version} before the kill "
                                                      f"({row['chunks_have']} of {row['chunks_total']} chunks)")
    return row


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    root = tmp_path_factory.mktemp("relaynet")
    config = "stall_timeout_s = 3.0\nrequest_timeout_s = 5.0\nannounce_interval_s = 1.0\nfsync = false\n"
    # reachable: else the byzantine relay may not be anyone's parent yet
    with relay_network(root, PEERS - 1, config=config, trusted=(0, SLOW), args=FAST,
                       args_for={SLOW: ["--upload-bps", str(SLOW_BPS)]},
                       env_for={BYZANTINE: {"P2PNET_TEST_CORRUPT_CHUNKS": "1"}}, reachable_timeout_s=60) as net:
        yield net


@pytest.fixture(scope="module")
def v1(network):
    """Version 1, 64 MiB in 1 MiB chunks, published by peer0 and fetched by every honest relay:
    (its source file, the files each fetched)."""
    root, peers = network.root, network.peers
    source = checkpoint(root / "v1.safetensors", 64, seed=1)
    reply = publish(peers[0], source, 1, 1 << 20)
    assert reply["chunks"] == 65
    return source, {peer.name: fetch(peer, 1, root / f"out1-{peer.name}", transfer_deadline_s(64 << 20))
                    for peer in honest(peers)}


def test_a_64_mib_checkpoint_reaches_every_relay_byte_identical(network, v1):
    peers = network.peers
    source, fetched = v1
    want = source.read_bytes()
    assert {name: [Path(f).read_bytes() == want for f in files] for name, files in fetched.items()} == {
        name: [True] for name in fetched}
    served = sum(sum(relay_status(p)["served_to"].values()) for p in honest(peers))
    assert served > 0, "honest relays served each other, not only the origin"


def test_the_byzantine_relay_is_detected_penalised_and_banned(network, v1):
    """Version 1's transfer (`v1`, fetched by every honest relay) asked the liar for chunks."""
    peers = network.peers
    liar = peers[BYZANTINE]
    assert relay_status(liar)["corrupting_chunks"] is True
    accusers = 0
    for peer in honest(peers):
        status = peer.status()
        if liar.peer_id in status["role_status"]["relay"]["transfers"]["banned"]:
            accusers += 1
            entry = [e for e in status["peers"] if e["peer_id"] == liar.peer_id]
            assert not entry or entry[0]["score"] < 0  # penalised (or already banned from the table)
    assert accusers >= 1
    assert all(relay_status(p)["transfers"]["banned"] == [] or liar.peer_id in relay_status(p)["transfers"]["banned"]
               for p in honest(peers))


@pytest.fixture(scope="module")
def v2(network):
    """Version 2, 16 MiB in 64 KiB chunks, published by the slow peer7; its victims killed
    mid-transfer: peer4 once it holds 20 chunks, then peer5 (holding some, not all). (Its source
    file, peer4's progress row just before its kill, the bytes peer7 had served before it.)"""
    root, peers = network.root, network.peers
    source = checkpoint(root / "v2.safetensors", 16, seed=2)
    served_before = relay_status(peers[SLOW])["bytes_served"]
    publish(peers[SLOW], source, 2, 64 * 1024)
    row = wait_mid_transfer(peers[4], 2, 20, 16 << 20)
    peers[4].kill()
    wait_mid_transfer(peers[5], 2, 1, 16 << 20)
    peers[5].kill()
    return source, row, served_before


def test_relays_killed_mid_transfer_do_not_stop_the_others(network, v2):
    """Every relay left fetches version 2 whole, and the capped publisher serves it well under
    twice (see the top: the lost stripes re-form through one stand-in each)."""
    root, peers = network.root, network.peers
    source, _, served_before = v2
    want = source.read_bytes()
    for peer in honest(peers):  # (peer4 among them if the restart test ran first)
        files = fetch(peer, 2, root / f"out2-{peer.name}", transfer_deadline_s(16 << 20))
        assert Path(files[0]).read_bytes() == want
    copies = (relay_status(peers[SLOW])["bytes_served"] - served_before) / source.stat().st_size
    assert copies < 1.7, f"peer7 served {copies:.2f} copies of version 2"


def test_a_peer_restarted_mid_download_fetches_only_what_it_lacked(network, v2):
    root = network.root
    source, row, _ = v2
    have_before = row["chunks_have"]
    restarted = network.start(4)  # (the network stops it at the end)
    files = fetch(restarted, 2, root / "out2-restarted", transfer_deadline_s(16 << 20))
    assert Path(files[0]).read_bytes() == source.read_bytes()
    after = progress(restarted, 2)
    held_at_start = after["chunks_total"] - after["fetched_chunks"]
    assert after["complete"] and held_at_start >= have_before
    assert after["fetched_chunks"] > 0, "the victim was whole when killed (the row above is from before the kill)"
