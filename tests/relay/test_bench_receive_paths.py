"""benchmarks/bench_receive_paths.py runs end to end: every receive path takes a file over real
loopback TCP, fsyncs it, and its chunks' digests match the sent file's (the script exits non-zero
when they do not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_receive_paths.py"


def test_every_receive_path_delivers_the_file_and_reports_medians(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--mib", "3", "--chunk-mib", "2", "--runs", "1",
                           "--dir", str(tmp_path), "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report["medians"]) == {"raw", "buffer", "mapped", "splice"}
    for path, figures in report["medians"].items():
        assert figures["wall_s"] > 0 and figures["receiver_cpu_s"] >= 0, path
    assert list(tmp_path.iterdir()) == []  # the files are gone


def test_a_receiver_whose_digests_differ_fails_the_run(tmp_path: Path) -> None:
    """The digest check is real: a receiver that hashed other bytes than were sent fails the run."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import sys\n"
        "if '--receive' in sys.argv:\n"
        "    import blake3\n"
        "    real = blake3.blake3\n"
        "    class Wrong:\n"
        "        def __init__(self, data=b'', **kw):\n"
        "            self._h = real(bytes(data)[:-1] + b'x', **kw)\n"
        "        def hexdigest(self):\n"
        "            return self._h.hexdigest()\n"
        "    blake3.blake3 = Wrong\n")
    env = {"PYTHONPATH": str(hook), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--mib", "2", "--chunk-mib", "1", "--runs", "1",
                           "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode != 0
    assert "digests differ" in done.stderr


def test_a_receiver_that_dies_before_it_connects_fails_the_run_and_leaves_no_sender_behind(tmp_path: Path) -> None:
    """A receiver that never connects (it died at start) fails the run, and its sender, waiting
    for the connection, goes with it: the run's output ends (nothing else holds it open) and
    the files are gone."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if '--receive' in sys.argv:\n"
        "    os._exit(3)\n")
    work = tmp_path / "work"
    work.mkdir()
    env = {"PYTHONPATH": str(hook), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--mib", "2", "--chunk-mib", "1", "--runs", "1",
                           "--dir", str(work)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "CalledProcessError" in done.stderr
    assert list(work.iterdir()) == []
