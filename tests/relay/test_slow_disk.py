"""benchmarks/slow_disk.py makes a real slow disk and takes it all down again: a command's fsynced
writes on it take at least as long as its cap allows, its exit status comes back, and afterwards
no mount, loop device, file or throttle entry is left (root, a loop device and cgroup v1's block
throttle needed; skipped where the machine has none of them)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "slow_disk.py"
THROTTLE = Path("/sys/fs/cgroup/blkio/blkio.throttle.write_bps_device")

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("losetup") is None or not THROTTLE.exists(),
                                reason="needs root, losetup and cgroup v1's block throttle")

WRITER = """
import json, os, sys, time
folder = sys.argv[1]
t0 = time.monotonic()
with open(os.path.join(folder, "f"), "wb") as fh:
    for _ in range(int(sys.argv[2])):
        fh.write(b"x" * (1 << 20))
    os.fsync(fh.fileno())
print(json.dumps({"seconds": time.monotonic() - t0, "dev": os.stat(folder).st_dev, "folder": folder}))
sys.exit(int(sys.argv[3]))
"""


def _slow_run(tmp_path: Path, mib: int, status: int) -> tuple[subprocess.CompletedProcess, dict]:
    done = subprocess.run([sys.executable, str(SCRIPT), "--write-mbps", "8", "--size-gib", "1", "--image-dir",
                           str(tmp_path), "--", sys.executable, "-c", WRITER, "{}", str(mib), str(status)],
                          capture_output=True, text=True, timeout=300)
    return done, json.loads(done.stdout)


def _left_behind(tmp_path: Path, folder: str) -> list[str]:
    loops = subprocess.run(["losetup", "--list", "--noheadings", "--output", "BACK-FILE"], capture_output=True,
                           text=True).stdout
    return ([f"loop over {line}" for line in loops.split() if line.startswith(str(tmp_path))]
            + [f"file {p}" for p in tmp_path.iterdir()]
            + ([f"mount {folder}"] if Path(folder).exists() else []))


def _capped_device(stderr: str) -> str:
    match = re.search(r"device (\d+:\d+)\): writes capped at 8 MB/s", stderr)
    assert match, stderr
    return match.group(1)


def test_writes_take_as_long_as_the_cap_allows_and_nothing_is_left(tmp_path: Path) -> None:
    done, wrote = _slow_run(tmp_path, 24, 0)
    assert done.returncode == 0, done.stderr
    device = _capped_device(done.stderr)
    assert wrote["dev"] != os.stat(tmp_path).st_dev  # a file system of its own
    # 24 MiB at 8 MB/s is 3.1 s; a loaded machine only makes it slower
    assert wrote["seconds"] > 0.5 * 24 * 2**20 / 8e6, wrote
    assert _left_behind(tmp_path, wrote["folder"]) == []
    # the cap was lifted (a line for another device may be another run's)
    assert not [line for line in THROTTLE.read_text().splitlines() if line.split()[:1] == [device]]


def test_the_commands_status_comes_back_and_a_failed_command_is_cleaned_up_too(tmp_path: Path) -> None:
    done, wrote = _slow_run(tmp_path, 1, 3)
    assert done.returncode == 3, done.stderr
    assert _left_behind(tmp_path, wrote["folder"]) == []


def test_no_command_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--write-mbps", "8", "--image-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no command given" in done.stderr
    assert list(tmp_path.iterdir()) == []
