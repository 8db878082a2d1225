"""A relay killed (SIGKILL) the moment `checkpoint wait` says a version is complete keeps it:
real processes, fsync on (the default). After the restart the version is complete without
fetching a chunk again, its files load as they are, and `checkpoint fetch --out` hands out hard
links of verified files. (A killed process keeps the page cache; what this shows is that the
bitmap on disk already named every chunk when the answer came, so no announced chunk can be
missing after a restart. The fsync before that is the store's `put_chunk`; see relay/store.py.)
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from p2pnet.errors import PeerUnavailable
from p2pnet.localnet import control_call, relay_network

pytestmark = pytest.mark.slow

MIB = 2**20
SIZE_MIB = 5
CHUNK = 64 * 1024  # 81 chunks: the last of the store's fsync batches of 32 leaves 17 behind
PER_MIB_S = 5.0  # generous seconds per MiB moved, on a loaded 2-core machine
FAST = ["--heartbeat-interval-s", "0.5", "--peer-expiry-s", "6"]


def test_a_relay_killed_as_soon_as_a_version_is_complete_keeps_it(tmp_path):
    source = tmp_path / "weights.safetensors"
    save_file({"w": np.random.default_rng(3).integers(0, 256, size=SIZE_MIB * MIB, dtype=np.uint8)}, str(source))
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"model": {"vocab": {"a": 0}}}')
    want = {p.name: p.read_bytes() for p in (source, tokenizer)}
    deadline_s = 30 + PER_MIB_S * SIZE_MIB
    with relay_network(tmp_path, 1, config="announce_interval_s = 1.0\n", args=FAST) as net:
        pub, sink = net.peers
        control_call(pub.data_dir, {"cmd": "checkpoint.publish", "paths": [str(source), str(tokenizer)],
                                    "model": "test", "version": 1, "chunk_bytes": CHUNK}, timeout_s=60)
        answer = control_call(sink.data_dir, {"cmd": "checkpoint.wait", "version": 1, "timeout_s": deadline_s},
                              timeout_s=deadline_s + 10)
        sink.kill()  # SIGKILL, at once: no flush on the way out
        assert {Path(f).name: Path(f).read_bytes() for f in answer["files"]} == want

        again = net.start(1)  # (same data directory, settings and bootstrap; stopped with the rest)
        latest = control_call(again.data_dir, {"cmd": "checkpoint.wait", "version": "latest", "timeout_s": 30},
                              timeout_s=40)
        assert latest["version"] == 1 and latest["dir"] == answer["dir"]
        relay = again.status()["role_status"]["relay"]
        row = relay["transfers"]["progress"][0]
        assert row["complete"] and row["fetched_chunks"] == 0  # nothing fetched again after the restart
        assert load_file(latest["files"][0])["w"].nbytes == SIZE_MIB * MIB  # an ordinary safetensors file

        out = control_call(again.data_dir, {"cmd": "checkpoint.fetch", "version": 1,
                                            "out_dir": str(tmp_path / "out"), "timeout_s": 30}, timeout_s=40)
        exported = {Path(f).name: Path(f) for f in out["files"]}
        assert {name: p.read_bytes() for name, p in exported.items()} == want
        stored = {Path(f).name: Path(f) for f in latest["files"]}
        assert all(os.stat(exported[n]).st_ino == os.stat(stored[n]).st_ino for n in want)  # links, not copies


def test_a_restarted_relay_hashes_what_its_bitmap_claims_before_wait_answers(tmp_path):
    """A chunk rots on disk while the relay is down: after the restart its bitmap still claims
    it, and `checkpoint wait` (whose folder a worker opens directly) answers only once that chunk
    was found, fetched again and the files are whole. A version older than those the relay keeps
    is refused at once, not waited for."""
    source = tmp_path / "weights.safetensors"
    save_file({"w": np.random.default_rng(4).integers(0, 256, size=SIZE_MIB * MIB, dtype=np.uint8)}, str(source))
    want = source.read_bytes()
    deadline_s = 30 + PER_MIB_S * SIZE_MIB
    with relay_network(tmp_path, 1, config="announce_interval_s = 1.0\nkeep_versions = 1\n", args=FAST) as net:
        pub, sink = net.peers
        control_call(pub.data_dir, {"cmd": "checkpoint.publish", "paths": [str(source)],
                                    "model": "test", "version": 1, "chunk_bytes": CHUNK}, timeout_s=60)
        answer = control_call(sink.data_dir, {"cmd": "checkpoint.wait", "version": 1, "timeout_s": deadline_s},
                              timeout_s=deadline_s + 10)
        sink.stop()
        stored = Path(answer["files"][0])
        mode = stored.stat().st_mode
        os.chmod(stored, 0o644)
        with open(stored, "r+b") as fh:  # a chunk in the middle of the tensor rots
            fh.seek(2 * MIB)
            fh.write(b"rot!")
        os.chmod(stored, mode)

        again = net.start(1)
        latest = control_call(again.data_dir, {"cmd": "checkpoint.wait", "version": 1, "timeout_s": deadline_s},
                              timeout_s=deadline_s + 10)
        assert Path(latest["files"][0]).read_bytes() == want
        row = again.status()["role_status"]["relay"]["transfers"]["progress"][0]
        assert row["complete"] and row["fetched_chunks"] == 1  # the rotten one, and only it

        control_call(pub.data_dir, {"cmd": "checkpoint.publish", "paths": [str(source)],
                                    "model": "test", "version": 2, "chunk_bytes": CHUNK}, timeout_s=60)
        control_call(again.data_dir, {"cmd": "checkpoint.wait", "version": 2, "timeout_s": deadline_s},
                     timeout_s=deadline_s + 10)
        with pytest.raises(PeerUnavailable, match="will not be held here"):
            control_call(again.data_dir, {"cmd": "checkpoint.wait", "version": 1, "timeout_s": deadline_s},
                         timeout_s=10)
