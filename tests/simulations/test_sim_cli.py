"""`p2pnet sim run` and `p2pnet sim sweep`."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from p2pnet.cli import main


def test_sim_run_writes_results_csv_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["sim", "run", "broadcast", "--peers", "50", "--seed", "2", "--set", "checkpoint_bytes=1e8",
                 "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    for key in ("peers", "checkpoint_bytes", "time_to_all_s", "lower_bound_s", "wall_s"):
        assert key in data
    assert data["peers"] == 50 and data["checkpoint_bytes"] == 100_000_000 and data["config"]["seed"] == 2
    assert data["time_to_all_s"] >= data["lower_bound_s"] > 0
    rows = list(csv.DictReader((out / "peers.csv").open()))
    assert len(rows) == 50 and all(float(r["completed_s"]) <= data["time_to_all_s"] for r in rows)
    assert (out / "broadcast.png").read_bytes()[:4] == b"\x89PNG"
    assert "time_to_all_s" in capsys.readouterr().out


def test_sim_sweep_reports_progress_and_writes_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    assert main(["sim", "sweep", "inference_wait", "--peers", "10", "--param", "async_level=0,2",
                 "--param", "upload_bps=1.25e8,1.25e9", "--seeds", "2", "--set", "checkpoint_bytes=1e9",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "[1/8]" in err and "[8/8]" in err
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert len(rows) == 8 and {r["async_level"] for r in rows} == {"0", "2"}
    assert (out / "sweep.png").exists() and json.loads((out / "sweep.json").read_text())["seeds"] == 2


def test_sim_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "run", "nonesuch", "--out", str(tmp_path)]) == 2
    assert main(["sim", "sweep", "audit", "--param", "sample_rate", "--out", str(tmp_path)]) == 2
    assert main(["sim", "run", "audit", "--set", "sample_rate=2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("p2pnet: error:") == 3


def test_sim_run_takes_the_world_a_real_peer_sees_and_reports_against_the_true_bound(tmp_path: Path) -> None:
    def run(name: str, *flags: str) -> dict:
        out = tmp_path / name
        assert main(["sim", "run", "broadcast", "--peers", "40", "--seed", "3", "--set", "checkpoint_bytes=5e7",
                     "--out", str(out), *flags]) == 0
        return json.loads((out / "results.json").read_text())

    exact = run("exact", "--view-miss", "0", "--slow-fraction", "0", "--symmetric", "--layout", "tree")
    config = exact["config"]
    assert config["view_miss"] == 0 and config["slow_fraction"] == 0 and config["download_ratio"] == 1.0
    assert config["strategy"] == "tree4" and exact["slow_relays"] == 0 and exact["view_classes"] == 0
    # symmetric links: the slowest relay's download (its upload) bounds the time from below
    peers = list(csv.DictReader((tmp_path / "exact" / "peers.csv").open()))
    slowest = min(float(r["upload_bps"]) for r in peers)
    assert exact["lower_bound_s"] >= 5e7 / slowest * (1 - 1e-6)
    assert exact["ratio_to_bound"] == pytest.approx(exact["time_to_all_s"] / exact["lower_bound_s"], rel=1e-4)
    assert exact["ratio_to_bound"] >= 1.0 and exact["origin_upload_copies"] >= 1.0

    skewed = run("skewed", "--view-miss", "0.05", "--slow-fraction", "0.25", "--slow-factor", "4")
    assert skewed["slow_relays"] == 10 and skewed["view_classes"] == 32 and skewed["config"]["slow_factor"] == 4.0
    assert skewed["survivors_complete"] == 40 and skewed["ratio_to_bound"] >= 1.0

    swarm = run("swarm", "--layout", "swarm")  # the BitTorrent-style baseline: bitmaps, rarest-first pulls
    assert swarm["config"]["strategy"] == "swarm" and swarm["survivors_right_checkpoint"] == 40
    assert swarm["messages"]["delivered"] > 40 * 8  # each relay told its neighbours what it held


def test_sim_run_refuses_world_flags_that_make_no_sense(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "run", "broadcast", "--view-miss", "1.5", "--out", str(tmp_path)]) == 2
    assert main(["sim", "run", "broadcast", "--slow-factor", "0.5", "--out", str(tmp_path)]) == 2
    assert main(["sim", "run", "audit", "--symmetric", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("p2pnet: error:") == 3 and "--view-miss" in err and "broadcast" in err
