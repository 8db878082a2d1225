"""`p2pnet devnet --trainers N`: a DiLoCo group of real peer processes on loopback, and a group
whose every trainer is killed and restarted resuming from its durable global state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

from p2pnet.localnet import start_peer
from p2pnet.settings import to_toml
from trainer.diloco import digest
from trainer.diloco_local import STATE_FILE


def test_devnet_with_three_trainers_reports_rounds(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "p2pnet", "devnet", "--trainers", "3", "--inner-steps", "4", "--steps", "3",
           "--relays", "1", "--model", "micro", "--out", str(tmp_path / "run"), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["mode"] == "diloco" and summary["trainers"] == 3
    rounds = summary["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    for row in rounds:
        assert set(row) >= {"round", "loss", "bytes_sent", "contributors", "round_s"}
        assert sorted(row["contributors"]) == ["trainer0", "trainer1", "trainer2"]
        assert row["bytes_sent"] > 0 and row["round_s"] > 0
    assert rounds[-1]["loss"] < rounds[0]["loss"] * 1.5  # finite, and not blown up
    assert 3 in summary["relay_versions"]["relay1" if "relay1" in summary["relay_versions"] else "relay0"]
    assert "round   3/3" in proc.stdout  # the live line per round
    group = {summary["peers"][f"trainer{i}"] for i in range(3)}  # a closed group: each lists all three
    for i in range(3):
        config = tomllib.loads((tmp_path / "run" / f"trainer{i}" / "peer.toml").read_text())
        assert set(config["diloco"]["trainers"]) == group


def _start_trainer(root: Path, name: str, model_dir: Path, rounds: int, bootstrap: list[str]):
    data_dir = root / name
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "peer.toml").write_text(to_toml({
        "peer": {"display_name": name}, "peertable": {"heartbeat_interval_s": 0.5, "expiry_s": 30.0},
        "diloco": {"model_dir": model_dir, "out_dir": data_dir / "state", "rounds": rounds, "inner_steps": 3,
                   "batch_size": 8, "min_peers": 2, "deadline_s": 60.0}}))
    proc = start_peer(name, data_dir, roles=("diloco",), bootstrap=bootstrap,
                      extra_args=["--config", str(data_dir / "peer.toml")])
    proc.wait_ready(300)
    return proc


def _wait(predicate, timeout_s: float = 600.0):
    deadline = time.monotonic() + timeout_s  # generous: a loaded 2-core machine; nothing here is timed
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError("timed out")


def _diloco(proc) -> dict:
    return proc.status(timeout_s=30)["role_status"]["diloco"]


def test_every_trainer_killed_then_restarted_resumes_the_round_and_weights(tmp_path: Path, model_dir: Path) -> None:
    a = _start_trainer(tmp_path, "a", model_dir, 4, [])
    b = _start_trainer(tmp_path, "b", model_dir, 4, [a.addr])
    try:
        _wait(lambda: all(_diloco(p)["round"] >= 2 for p in (a, b)))
        a.kill(), b.kill()  # SIGKILL, both: nothing is flushed on the way out
        saved = {}
        for name in ("a", "b"):
            state = torch.load(tmp_path / name / "state" / STATE_FILE, weights_only=True)
            saved[name] = (int(state["round"]), digest(state["weights"]))
        oldest, newest = min(r for r, _ in saved.values()), max(r for r, _ in saved.values())
        assert oldest >= 1  # the state was written while training went on
        rounds = newest + 3
        a = _start_trainer(tmp_path, "a", model_dir, rounds, [])
        b = _start_trainer(tmp_path, "b", model_dir, rounds, [a.addr])
        _wait(lambda: all(_diloco(p)["done"] for p in (a, b)))
        final = [_diloco(p) for p in (a, b)]
        for name, status in zip(("a", "b"), final):
            history = status["history"]
            # the restarted peers carried on from the newest saved round, not from round 0
            assert history and history[0]["round"] == newest and status["round"] == rounds
            if saved[name][0] < newest:  # an older state was replaced by the newer one before the first round
                assert status["fetched"] and status["fetched"][0]["round"] == newest
            else:  # and the weights continued: the first resumed round started from the saved weights
                assert history[0]["from_digest"] == saved[name][1].hex()
        assert final[0]["weights_digest"] == final[1]["weights_digest"]
    finally:
        a.stop(), b.stop()


def test_the_allreduce_bound_is_what_each_peer_must_move_over_its_link() -> None:
    from trainer.devnet_diloco import _link_bps, allreduce_bound_s

    # 4 peers, 1,000,000 int8 values in blocks of 4,096 (245 scales): S = 1,000,980 bytes;
    # each peer sends 2 x 3/4 of it; at 20 Mbit/s (2.5 MB/s) that takes 0.600588 s
    assert abs(allreduce_bound_s(4, 1_000_000, "int8", 2.5e6) - 1.5 * 1_000_980 / 2.5e6) < 1e-9
    assert allreduce_bound_s(4, 1_000_000, "fp32", 2.5e6) == 1.5 * 4_000_000 / 2.5e6
    assert allreduce_bound_s(1, 1_000_000, "int8", 2.5e6) == 0.0  # alone: nothing to exchange
    hosts = {"trainer0": {"upload_mbit": 50.0, "download_mbit": 80.0},
             "trainer1": {"upload_mbit": 40.0, "download_mbit": None}, "relay0": {"upload_mbit": 1.0, "download_mbit": 1.0}}
    assert _link_bps(hosts) == 40.0 * 1e6 / 8  # the slowest trainer link; relays do not take part
    assert _link_bps({"trainer0": {"upload_mbit": None, "download_mbit": None}}) is None
    assert _link_bps(None) is None


def test_devnet_with_trainers_on_lab_hosts_reports_the_bound(tmp_path: Path) -> None:
    """`devnet --lab --trainers 2`: each trainer on its own host over a 50 Mbit/s link; the rounds
    run over the lab's addresses and each shows the bandwidth lower bound of its all-reduce."""
    from p2pnet.lab import lab_unavailable

    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "p2pnet", "devnet", "--lab", "--link-mbit", "50", "--trainers", "2",
           "--inner-steps", "2", "--steps", "2", "--relays", "0", "--model", "micro",
           "--out", str(tmp_path / "run"), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["lab"]["trainer1"]["upload_mbit"] == 50.0
    assert summary["lab"]["trainer0"]["ip"] != summary["lab"]["trainer1"]["ip"]
    assert "on lab hosts" in proc.stdout
    for row in summary["rounds"]:
        assert sorted(row["contributors"]) == ["trainer0", "trainer1"]
        assert row["bound_s"] > 0  # 2 peers: each sends half of S and gets half back, at 6.25 MB/s


def test_diloco_devnet_settings_are_checked() -> None:
    from p2pnet.errors import ConfigError
    from trainer.devnet_diloco import DilocoDevnetConfig

    with pytest.raises(ConfigError, match="outer-momentum"):
        DilocoDevnetConfig(outer_momentum=1.0)
    with pytest.raises(ConfigError, match="outer-lr"):
        DilocoDevnetConfig(outer_lr=0.0)
    with pytest.raises(ConfigError, match="need --lab"):
        DilocoDevnetConfig(link_mbit=20.0)
    assert DilocoDevnetConfig(lab=True, link_mbit=20.0, outer_momentum=0.0).outer_momentum == 0.0
