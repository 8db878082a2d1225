"""Every command block of README.md, run in order and as written, on a fresh home directory:
the README and the code cannot drift apart.

How the README is read: each ```sh block is a step. A line that starts a peer (`p2pnet peer
start`, `worker start`, `trainer start`, `validator start`) is what a reader runs in a terminal
of its own: it runs in the background, and the next line waits until the peer prints where it
listens. Every other line must exit 0 with no traceback. `NAME=$(...)` lines keep their value for
the lines after them, as a shell would. An HTML comment above a block says what a reader does
that cannot be typed: `<!-- test: skip, REASON -->` (the block needs root, a long run or an
extra: skipped, the reason reported) and `<!-- test: stop the peers started above -->` (Ctrl-C in
their terminals: every peer started so far is stopped by its PID and must exit 0). The only
change made to a command is the fixed port of a first peer (4001, 4011), replaced by a free one
(`reserve_port`, tests/port_fixtures.py).
"""

import os
import re
import shlex
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from p2pnet.localnet import PeerProcess

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- test: (.+?) -->$")
STARTS_PEER = re.compile(r"p2pnet (peer|worker|trainer|validator) start\b")
ASSIGNMENT = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$")
FIXED_PORTS = ("4001", "4011")


@dataclass
class Step:
    kind: str  # "run", "skip" or "stop"
    lines: tuple[str, ...] = ()
    reason: str = ""


def readme_steps(text: str) -> list[Step]:
    """The README as steps: blocks to run (their commands, continuations joined), blocks to skip
    and the points where the reader stops the running peers."""
    steps: list[Step] = []
    pending_skip = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        marker = MARKER.match(line)
        if marker:
            note = marker.group(1)
            if note.startswith("skip"):
                pending_skip = note.partition(",")[2].strip() or "skipped"
            elif note == "stop the peers started above":
                steps.append(Step("stop"))
            else:
                raise AssertionError(f"README.md: unknown test marker {line!r}")
        elif line == "```sh":
            body = []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            if pending_skip:
                steps.append(Step("skip", reason=pending_skip))
            else:
                steps.append(Step("run", tuple(_commands(body))))
            pending_skip = ""
        elif line:
            pending_skip = ""  # a skip marker belongs to the block right below it
        i += 1
    return steps


def _commands(body: list[str]) -> list[str]:
    out, current = [], ""
    for raw in body:
        line = raw.rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip() and not current.strip().startswith("#"):
            out.append(current.strip())
        current = ""
    return out


class Reader:
    """A reader following the README in a fresh home directory, with terminals for peers."""

    def __init__(self, tmp_path: Path, reserve_port: Callable[[], int]) -> None:
        self.home = tmp_path / "home"
        self.cwd = tmp_path / "work"
        self.home.mkdir()
        self.cwd.mkdir()
        (self.cwd / ".venv").symlink_to(ROOT / ".venv")
        self.env = {k: v for k, v in os.environ.items() if k != "P2PNET_HOME"}
        self.env.update(HOME=str(self.home), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.ports = {port: str(reserve_port()) for port in FIXED_PORTS}
        self.peers: list[PeerProcess] = []

    def as_here(self, command: str) -> str:
        for fixed, port in self.ports.items():
            command = command.replace(f"/tcp/{fixed}", f"/tcp/{port}")
        return command

    def run(self, command: str) -> None:
        command = self.as_here(command)
        assignment = ASSIGNMENT.match(command)
        if STARTS_PEER.search(command):
            self._start(command)
        elif assignment:
            name, value = assignment.groups()
            out = self._shell(f"printf %s {value}", command)
            self.env[name] = out.stdout
        else:
            self._shell(command, command)

    def _shell(self, script: str, shown: str) -> subprocess.CompletedProcess:
        out = subprocess.run(["bash", "-c", script], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                             timeout=180, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, f"README command failed ({out.returncode}): {shown}\n{out.stdout}\n{out.stderr}"
        assert "Traceback" not in out.stderr, f"{shown}\n{out.stderr}"
        return out

    def _start(self, command: str) -> None:
        name = f"peer{len(self.peers)}"
        log = self.cwd / f"{name}.log"
        with open(log, "ab") as err:  # `exec`: the child's PID is the peer's
            proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                                    stderr=err, stdin=subprocess.DEVNULL)
        words = shlex.split(command)
        data_dir = Path(words[words.index("--data-dir") + 1].replace("~", str(self.home), 1))
        peer = PeerProcess(name, data_dir, proc, log)
        self.peers.append(peer)
        peer.wait_ready(90)

    def stop_peers(self) -> None:
        peers, self.peers = self.peers, []
        codes = {p.name: p.stop(timeout_s=30) for p in peers}
        assert all(code == 0 for code in codes.values()), (codes, {p.name: p.log_path.read_text()[-2000:]
                                                                   for p in peers})


def test_the_readme_parses_into_runnable_steps():
    steps = readme_steps((ROOT / "README.md").read_text())
    ran = [line for s in steps if s.kind == "run" for line in s.lines]
    assert any("peer start" in line for line in ran) and any("checkpoint fetch" in line for line in ran)
    assert all(s.reason for s in steps if s.kind == "skip")


def test_every_readme_command_runs_as_written(tmp_path, reserve_port):
    reader = Reader(tmp_path, reserve_port)
    skipped = []
    try:
        for step in readme_steps((ROOT / "README.md").read_text()):
            if step.kind == "skip":
                skipped.append(step.reason)
            elif step.kind == "stop":
                reader.stop_peers()
            else:
                for command in step.lines:
                    reader.run(command)
        reader.stop_peers()
    finally:
        for peer in reader.peers:
            peer.kill()
    for name in ("v7", "latest", "offline"):  # what the reader would look at
        assert (reader.cwd / name / "model.safetensors").is_file(), name
    if skipped:
        warnings.warn("README blocks not run here: " + "; ".join(skipped))
