"""An origin whose upload is capped (`--upload-bps`: a trainer on a home uplink) sends each chunk
once, to its stripe's root, and the relays carry it on: real `p2pnet peer start --role relay`
processes on loopback.

Every stripe enters the network at the origin's pace, so each root forwards its stripe no faster
than the origin feeds it, however fast its own upload. Judged against the plan's rate for the
stripe (its capacity over the members, the root's advertised upload included), every root
looked slow to its children, who dropped it and fetched the stripe from the origin itself,
the only other holder: with 7 relays under a 3 MB/s origin, 24 MiB in 64 KiB chunks, the origin
served 2.3 copies and every relay took 18-19 s instead of 8 (`relay.sources`,
`_stripe_feed_bps`). The assertions count bytes and exclusions, not seconds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from p2pnet.localnet import control_call, relay_network

pytestmark = pytest.mark.slow

RELAYS = 5
ORIGIN_BPS = 3_000_000
SIZE = 12 * 2**20
CHUNK = 64 * 1024
FAST = ["--heartbeat-interval-s", "0.5", "--peer-expiry-s", "6"]


def relay_status(peer) -> dict:
    return peer.status()["role_status"]["relay"]


def test_a_capped_origin_sends_each_chunk_once_and_no_relay_drops_a_root(tmp_path: Path):
    source = tmp_path / "w.safetensors"
    save_file({"w": np.random.default_rng(7).integers(0, 256, size=SIZE, dtype=np.uint8)}, str(source))
    with relay_network(tmp_path, RELAYS, config="announce_interval_s = 1.0\nfsync = false\n", args=FAST,
                       args_for={0: ["--upload-bps", str(ORIGIN_BPS)]}, reachable_timeout_s=60) as net:
        origin = net.publisher
        control_call(origin.data_dir, {"cmd": "checkpoint.publish", "paths": [str(source)], "model": "t",
                                       "version": 1, "chunk_bytes": CHUNK}, timeout_s=60)
        deadline_s = 30 + 4 * SIZE * RELAYS / ORIGIN_BPS  # (even a star through the cap fits)
        for peer in net.relays:
            control_call(peer.data_dir, {"cmd": "checkpoint.wait", "version": 1, "timeout_s": deadline_s},
                         timeout_s=deadline_s + 10)
        payload = source.stat().st_size
        served = relay_status(origin)["bytes_served"]
        assert served >= payload
        assert served <= 1.25 * payload, f"the origin served {served / payload:.2f} copies"
        excluded = {peer.name: relay_status(peer)["transfers"]["excluded"] for peer in net.relays}
        assert excluded == {peer.name: [] for peer in net.relays}, "an honest relay dropped a source"
