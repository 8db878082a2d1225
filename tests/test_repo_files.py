"""What the repository tracks: no symbolic links. A checkout's `.venv` is often a link to another
checkout's environment; `.venv/` in .gitignore matches only a directory, so such a link was
committed once (a path of one machine, meaningless in any other checkout)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True, timeout=60).stdout


@pytest.fixture(scope="module")
def git_checkout() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")


def test_no_tracked_symlinks(git_checkout):
    links = [line.split("\t", 1)[1] for line in _git("ls-files", "-s").splitlines()
             if line.startswith("120000 ")]
    assert links == []


def test_a_venv_link_is_ignored(git_checkout):
    assert _git("check-ignore", "--no-index", "-v", ".venv").strip().endswith("\t.venv")
