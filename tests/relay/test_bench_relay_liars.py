"""benchmarks/bench_relay_liars.py runs end to end, one row per version asked for, each version
published with its own manifest (so its own plans), and refuses a version below 1."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_relay_liars.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_relay_liars", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_version_asked_for_is_a_row_of_its_own_manifest() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--peers", "12", "--liars", "2", "--bytes", "2e8",
                           "--versions", "1", "3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[2:]]
    assert [(row[0], row[1]) for row in rows] == [("12", "1"), ("12", "3")]
    assert all(float(row[4]) > 0 for row in rows)  # the lying world completed in each
    bench = _bench()
    first, third = (bench.world(12, int(2e8), 1, version).signed for version in (1, 3))
    assert (first.manifest.version, third.manifest.version) == (1, 3)
    assert first.manifest_id != third.manifest_id  # what each stripe's plan is salted with


def test_a_version_below_1_is_refused() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--versions", "0"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--versions >= 1" in done.stderr
