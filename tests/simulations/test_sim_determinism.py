"""Same scenario and seed, same results.json, byte for byte (wall_s aside), whatever PYTHONHASHSEED."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from simulations.run import results_json, run_scenario
from simulations.scenarios import hostile, with_params

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from pathlib import Path
from simulations.run import run_scenario, write_outputs
from simulations.scenarios import scenario, with_params
smaller = {"checkpoint_bytes": "2e8"} if sys.argv[1] != "audit" else {}
config = with_params(scenario(sys.argv[1], int(sys.argv[2]), 7), smaller)
write_outputs(run_scenario(config), Path(sys.argv[3]))
"""


def _without_wall(text: str) -> str:
    data = json.loads(text)
    assert isinstance(data.pop("wall_s"), float)
    return json.dumps(data)


def _run(tmp_path: Path, name: str, peers: int, hashseed: str) -> Path:
    out = tmp_path / f"{name}-{hashseed}"
    env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", SCRIPT, name, str(peers), str(out)], check=True, env=env, cwd=ROOT,
                   timeout=120)
    return out


def test_hostile_broadcast_is_identical_across_processes_and_hash_seeds(tmp_path: Path) -> None:
    a, b = _run(tmp_path, "hostile", 60, "1"), _run(tmp_path, "hostile", 60, "4242")
    text_a, text_b = (a / "results.json").read_text(), (b / "results.json").read_text()
    assert _without_wall(text_a) == _without_wall(text_b)
    lines_a = [line for line in text_a.splitlines() if '"wall_s"' not in line]
    lines_b = [line for line in text_b.splitlines() if '"wall_s"' not in line]
    assert lines_a == lines_b  # byte for byte, line by line
    assert (a / "peers.csv").read_bytes() == (b / "peers.csv").read_bytes()
    assert (a / "hostile.png").exists()
    data = json.loads(text_a)
    assert data["departed"]["leave"] + data["departed"]["crash"] > 0 and data["byzantine"] > 0  # it did something


def test_audit_is_identical_across_hash_seeds(tmp_path: Path) -> None:
    a, b = _run(tmp_path, "audit", 20, "3"), _run(tmp_path, "audit", 20, "99")
    assert _without_wall((a / "results.json").read_text()) == _without_wall((b / "results.json").read_text())
    assert (a / "workers.csv").read_bytes() == (b / "workers.csv").read_bytes()


def test_same_seed_same_result_other_seed_other_result() -> None:
    base = with_params(hostile(40), {"checkpoint_bytes": "1e8"})
    one, again = run_scenario(base), run_scenario(base)
    assert _without_wall(results_json(one)) == _without_wall(results_json(again))
    other = run_scenario(with_params(base, {"seed": "1"}))
    assert _without_wall(results_json(one)) != _without_wall(results_json(other))
