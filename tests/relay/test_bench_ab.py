"""benchmarks/ab_relay_loopback.py: each side's race runs in its own tree with its own extra config,
the sides alternate with the order flipped every pair, and the summary is computed from the rounds.
The race itself is stood in for by a script in a scratch tree (it has its own tests and runs for
minutes); the subprocess, its working directory and its environment are real."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ab_relay_loopback.py"
sys.path.insert(0, str(SCRIPT.parent))
import ab_relay_loopback as ab  # noqa: E402

STAND_IN = """
import json, os, sys
args = sys.argv[1:]
if os.environ.get("BENCH_RELAY_EXTRA") == "fail":
    sys.exit("the race broke")
runs = int(args[args.index("--runs") + 1])
seconds = float(os.environ["STAND_IN_SECONDS"])
rounds = [{"seconds": seconds + i, "cpu_s": 2 * seconds, "cwd": os.getcwd(), "pythonpath": os.environ["PYTHONPATH"],
           "extra": os.environ["BENCH_RELAY_EXTRA"], "args": args} for i in range(runs)]
open(args[args.index("--json") + 1], "w").write(json.dumps({"rounds": {"p2pnet": rounds}}))
"""


def tree(root: Path, name: str) -> Path:
    bench = root / name / "benchmarks" / "bench_relay_loopback.py"
    bench.parent.mkdir(parents=True)
    bench.write_text(STAND_IN)
    return root / name


def options(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"pairs": 2, "runs": 2, "mib": 8, "peers": 2, "pause_page_reporting": False, **kw})


def test_a_side_runs_its_own_trees_race_with_its_extra_config(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("STAND_IN_SECONDS", "4")
    side = ab.Side("B", tree(tmp_path, "other"), "[peertable]\nexpiry_s = 50.0")
    rounds = ab.run_side(side, options(pause_page_reporting=True))
    assert [r["seconds"] for r in rounds] == [4.0, 5.0]
    first = rounds[0]
    assert Path(first["cwd"]) == side.tree and first["pythonpath"] == str(side.tree)
    assert first["extra"] == "[peertable]\nexpiry_s = 50.0"
    assert first["args"][:2] == ["--only", "p2pnet"] and "--pause-page-reporting" in first["args"]
    assert first["args"][first["args"].index("--mib") + 1] == "8"


def test_a_failing_race_stops_the_comparison_with_its_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("STAND_IN_SECONDS", "4")
    with pytest.raises(SystemExit, match=r"(?s)side A.s race failed.*the race broke"):
        ab.run_side(ab.Side("A", tree(tmp_path, "t"), "fail"), options())


def test_the_order_flips_every_pair_and_the_summary_counts_pairs() -> None:
    a, b = ab.Side("A", Path("/a"), ""), ab.Side("B", Path("/b"), "x = 1")
    seconds = iter([4.0, 3.0,   # pair 1: A then B, B lower
                    5.0, 4.0,   # pair 2: B then A, B higher
                    3.5, 3.6])  # pair 3: A then B, B higher
    ran: list[str] = []

    def runner(side: ab.Side, args: argparse.Namespace) -> list[dict]:
        ran.append(side.name)
        s = next(seconds)
        return [{"seconds": s, "cpu_s": 2 * s}]

    lines: list[str] = []
    result = ab.ab(a, b, options(pairs=3, runs=1), runner, lines.append)
    assert ran == ["A", "B", "B", "A", "A", "B"]
    assert lines[0] == "pair 1 A: 4.00 s / 8.0 CPU-s" and len(lines) == 6
    s = result["summary"]
    assert s["pairs"] == 3
    assert s["seconds"]["A"] == 4.0 and s["seconds"]["B"] == 3.6  # medians of 4.0, 4.0, 3.5 and 3.0, 5.0, 3.6
    assert s["seconds"]["B_over_A"] == pytest.approx(0.9) and s["seconds"]["B_lower_in_pairs"] == 1
    assert s["cpu_s"]["B_lower_in_pairs"] == 1


def test_the_command_line_refuses_a_tree_without_the_race(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--b-tree", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "has no benchmarks/bench_relay_loopback.py" in done.stderr


def test_the_json_keeps_every_round(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    env = {"STAND_IN_SECONDS": "2", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--a-tree", str(tree(tmp_path, "a")), "--b-tree",
                           str(tree(tmp_path, "b")), "--pairs", "1", "--runs", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    kept = json.loads(out.read_text())
    assert [len(kept["pairs"][0][s]) for s in "AB"] == [3, 3]
    assert "B/A 1.000" in done.stdout and "B lower in 0 of 1 pairs" in done.stdout
