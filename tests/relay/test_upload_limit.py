"""`--upload-bps` is a real limit: a relay process never serves faster than it (one second of
burst aside), measured by the serving peer itself. Real processes on loopback; the assertion is
an upper bound on speed, so a slow machine cannot break it."""

from __future__ import annotations


import numpy as np
import pytest
from safetensors.numpy import save_file

from p2pnet.localnet import control_call, relay_network

pytestmark = pytest.mark.slow

LIMIT = 2_000_000  # bytes a second
SIZE = 6 * 2**20
CHUNK = 256 * 1024
FAST = ["--heartbeat-interval-s", "0.5", "--peer-expiry-s", "6"]


def test_a_relay_never_serves_faster_than_its_upload_limit(tmp_path):
    source = tmp_path / "w.safetensors"
    save_file({"w": np.random.default_rng(5).integers(0, 256, size=SIZE, dtype=np.uint8)}, str(source))
    with relay_network(tmp_path, 1, config="fsync = false\n", args=FAST,
                       args_for={0: ["--upload-bps", str(LIMIT)]}) as net:
        pub, sink = net.peers
        control_call(pub.data_dir, {"cmd": "checkpoint.publish", "paths": [str(source)], "model": "t", "version": 1,
                                    "chunk_bytes": CHUNK}, timeout_s=60)
        control_call(sink.data_dir, {"cmd": "checkpoint.wait", "version": 1, "timeout_s": 120}, timeout_s=130)
        relay = pub.status()["role_status"]["relay"]
        assert relay["upload_limit_bps"] == LIMIT and relay["bytes_served"] >= SIZE
        # the first chunk goes out at once; every byte after one second's burst waits for its tokens
        allowed = LIMIT * relay["serving_window_s"] + LIMIT + CHUNK
        assert relay["bytes_served"] <= allowed, relay
