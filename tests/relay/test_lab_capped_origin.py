"""A trainer on a capped home uplink that never measured it (it advertises the default, 1 GB/s)
publishes to six relays that advertise the default too: on real links in the lab (network
namespaces, the trainer's upload a tbf at 24 Mbit/s), it sends the version about once.

Judged against the origin's claim, every stripe root looks slow to its children (it forwards no
faster than the capped origin feeds it), so each child would drop its root and take the stripe
from the origin itself; the children judge the stripe's feed instead by what the origin sends
them where it is their planned parent (`relay.judging`, `_sent_us_bps`). On the lab benchmark
(`bench_lab_relay.py --unadvertised all`, 24 MiB) the origin served 1.32 copies before that
figure was made sound, 1.00 after.

The version is published once every relay's transfer core plans with every member as a parent
(`serving_members` in its status), and again (`early`) as soon as the relays have started, before
any of them is dialled back: then each relay's first plan makes the origin its parent in every
stripe; it asks the origin only for its own stripe of the plan with the others dialable until
their dial-backs come (`relay.requests`, "Dial-backs pending"), which they do ~1 s after the start
(`p2pnet.reachability`, `NO_PEERS_RETRY_S`; it was ~3 s, and the trainer sent 1.84-2.26 copies).
Published early it asserts copies only, at most MAX_EARLY_COPIES (see there). Skipped, with the
lab's one-line reason, where network namespaces cannot be made. The assertions count bytes and
exclusions, not seconds.

It failed 3 runs of 13 while it was opt-in (1.15-1.61 copies; stop 48's code 5 of 5, 1.15-2.12):
the capped trainer splits its uplink unevenly between the stripes (three whole by 2.6 s, three with
6 of 32 chunks; or one stripe's second chunk at 4.2 s, the others' by 0.3 s), and the relays
dropped honest roots it fed slowly, judged against the feed of their own stripe (`relay.judging`,
`_sent_us_bps`); as they did with a root's wait excused as far as the relay's other roots' (1 run
of 6) or twice that (2 of 5). Now, while the trainer still feeds a relay, a root is judged on what
it served once it had each chunk (`relay.judging`, `_origin_feeds_us`, `_served_rates`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from p2pnet.lab import HostSpec
from p2pnet.localnet import PeerProcess, control_call, peer_id_of, start_peer, wait_for

pytestmark = pytest.mark.slow

RELAYS = 6
TRAINER_MBIT = 24.0  # 3 MB/s: about 2.9 MB/s of TCP goodput through tbf
SIZE = 12 * 2**20
CHUNK = 64 * 1024
FAST = ["--heartbeat-interval-s", "0.5", "--peer-expiry-s", "6"]
MAX_COPIES = 1.1  # each chunk once, and not a stripe more (one relay taking a stripe again adds 1/6)
MAX_EARLY_COPIES = 1.6  # published early: 1.23, 1.27, 1.32, 1.37 copies in four runs on this rule (the last two with
# other tests on the machine), the old rule 1.84-1.98 in five and 1.84-2.26 in three: midway, ~0.23 either side


def relay_status(peer: PeerProcess) -> dict:
    return peer.status()["role_status"]["relay"]


@pytest.mark.parametrize("early", [False, True], ids=["published-planned", "published-early"])
def test_a_trainer_on_a_capped_uplink_advertising_the_default_sends_the_version_about_once(lab_factory, tmp_path,
                                                                                            record_property, early):
    lab = lab_factory([HostSpec("trainer", TRAINER_MBIT, 4 * TRAINER_MBIT),
                       *(HostSpec(f"r{i}", 200, 400) for i in range(RELAYS))])
    config = tmp_path / "relay.toml"
    config.write_text(f'[relay]\ntrusted_publishers = ["{peer_id_of(tmp_path / "trainer")}"]\n'
                      'announce_interval_s = 1.0\nfsync = false\n')
    source = tmp_path / "w.safetensors"
    save_file({"w": np.random.default_rng(5).integers(0, 256, size=SIZE, dtype=np.uint8)}, str(source))
    peers: list[PeerProcess] = []

    def start(name: str, bootstrap: list[str]) -> PeerProcess:  # no --upload-bps: the default advertised
        peers.append(start_peer(name, tmp_path / name, roles=["relay"], bootstrap=bootstrap, wrap=lab.wrap(name),
                                extra_args=["--listen", "/ip4/0.0.0.0/tcp/0", "--config", str(config), *FAST]))
        return peers[-1]

    try:
        trainer = start("trainer", [])
        trainer.wait_ready(60)
        for i in range(RELAYS):
            start(f"r{i}", [trainer.addr])
        for peer in peers:
            peer.wait_ready(60)
        for peer in [] if early else peers:  # every core plans with every member as a possible parent
            wait_for(lambda: relay_status(peer)["transfers"]["serving_members"] == len(peers), 90,
                     f"{peer.name} plans with every peer dialable", poll_s=0.2)
        control_call(trainer.data_dir, {"cmd": "checkpoint.publish", "paths": [str(source)], "model": "t",
                                        "version": 1, "chunk_bytes": CHUNK}, timeout_s=60)
        deadline_s = 30 + 4 * SIZE * RELAYS / (TRAINER_MBIT * 1e6 / 8)  # (even a star through the cap fits)
        for peer in peers[1:]:
            control_call(peer.data_dir, {"cmd": "checkpoint.wait", "version": 1, "timeout_s": deadline_s},
                         timeout_s=deadline_s + 10)
        payload = source.stat().st_size
        served = relay_status(trainer)["bytes_served"]
        taken = {peer.name: relay_status(peer)["fetched_from"].get(trainer.peer_id, 0) for peer in peers[1:]}
        excluded = {peer.name: relay_status(peer)["transfers"]["excluded"] for peer in peers[1:]}
        record_property("copies", round(served / payload, 3))  # (in --junitxml)
        assert served >= payload
        assert served <= (MAX_EARLY_COPIES if early else MAX_COPIES) * payload, (
            f"the trainer served {served / payload:.2f} copies; chunks each relay took from it: {taken}; "
            f"excluded: {excluded}")
        if not early:  # (early, a relay may drop a source in the replans while the dial-backs come)
            assert excluded == {peer.name: [] for peer in peers[1:]}, "an honest relay dropped a source"
    finally:
        codes = [p.stop(timeout_s=15) for p in peers]
    assert codes == [0] * len(peers)
