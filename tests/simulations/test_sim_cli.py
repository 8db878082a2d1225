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
