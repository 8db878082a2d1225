"""Shared fixtures for trainer tests: one torch thread, a tiny model folder, a fast config, and
one real devnet run that the devnet tests and the dashboard test read."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import pytest
import torch

torch.set_num_threads(1)

from trainer.learner import LearnerConfig  # noqa: E402
from trainer.model import build_model, save_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
    return build_model("micro", seed=0)


@pytest.fixture()
def model_dir(tmp_path, tiny):
    model, tok = tiny
    return save_model_dir(model, tok, tmp_path / "base")


@pytest.fixture()
def learner_config() -> LearnerConfig:
    return LearnerConfig(prompts_per_batch=4, group_size=4, keep_last=0, task_seed=7)


def chromium() -> str | None:
    """A headless browser's path (Debian's chromium; scripts/ops_deps.sh installs it), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def browse(browser: str, url: str, *extra: str) -> subprocess.CompletedProcess:
    """Run headless Chromium on `url`, letting its scripts run 5 s of virtual time."""
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--window-size=1400,1900", "--virtual-time-budget=5000", "--hide-scrollbars", *extra, url]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=20) as reply:
        return reply.read().decode()


def _quiet_leaderboard(trainer_url: str, data_dir, deadline_s: float = 120.0):
    """The trainer's dashboard API, its leaderboard API and `p2pnet leaderboard --json`, read once
    the network is quiet. After the last step each worker still submits a batch for the final
    version and the validator still judges it, so the three reads (a second or two apart) can
    see different counts; quiet = they agree, no worker that is not banned has a batch awaiting
    its verdict, and the rows are the same as one read 2 s earlier. After `deadline_s` the last
    reads are returned as they are (the test's comparison then shows what differed)."""
    previous = None
    deadline = time.monotonic() + deadline_s
    while True:
        api = json.loads(_fetch(trainer_url + "/api/dashboard"))
        board = json.loads(_fetch(trainer_url + "/api/leaderboard"))
        cli = subprocess.run([sys.executable, "-m", "p2pnet", "leaderboard", "--json", "--data-dir", str(data_dir)],
                             capture_output=True, text=True, timeout=60)
        rows = json.loads(cli.stdout)["leaderboard"] if cli.returncode == 0 else None
        judged = rows is not None and all(r["banned"] or r["accepted_batches"] + r["rejected_batches"] == r["submitted"]
                                          for r in rows)
        if (judged and rows == board["leaderboard"] == api["leaderboard"] == previous) or time.monotonic() > deadline:
            return api, board, cli
        previous = rows
        time.sleep(2.0)


@pytest.fixture(scope="session")
def devnet_run(tmp_path_factory):
    """One real devnet shared by the tests that read it (it is the suite's longest single run):
    16 steps, 3 workers of which worker0 cheats, a validator and a relay. While every peer still
    runs after the last step it records what an operator sees: each peer's /metrics and
    /healthz, the trainer's dashboard and leaderboard APIs, `p2pnet leaderboard --json`, and
    (where Chromium is installed) the dashboard page rendered headless. Returns a namespace with
    `summary` (what `p2pnet devnet --json` writes), `seen`, `root`, `printed`, `steps`. Its
    readers are all in test_devnet.py: each of `make test`'s xdist workers sets a session fixture
    up for itself, and one worker takes that whole file, so the devnet runs once."""
    from trainer.devnet import DevnetConfig, run_devnet

    root = tmp_path_factory.mktemp("devnet")
    steps = 16
    seen: dict = {}

    def observe(procs):
        if "metrics" in seen or not procs["trainer"].status()["role_status"]["trainer"]["done"]:
            return
        urls = {name: p.status()["metrics_url"] for name, p in procs.items()}
        seen["api"], seen["api_board"], seen["cli"] = _quiet_leaderboard(urls["trainer"], procs["trainer"].data_dir)
        seen["metrics"] = {name: _fetch(url + "/metrics") for name, url in urls.items()}
        seen["health"] = {name: _fetch(url + "/healthz") for name, url in urls.items()}
        seen["ids"] = {name: p.peer_id for name, p in procs.items()}
        browser = chromium()
        if browser is not None:
            shot = root / "dashboard.png"
            seen["shot"] = (browse(browser, urls["trainer"] + "/", f"--screenshot={shot}"), shot)
            seen["dom"] = browse(browser, urls["trainer"] + "/", "--dump-dom")
            seen["dom_api"] = json.loads(_fetch(urls["trainer"] + "/api/dashboard"))

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = run_devnet(DevnetConfig(steps=steps, workers=3, byzantine=1, validators=1, relays=1),
                             root / "net", plot_to=root / "reward.png", observe=observe)
    return SimpleNamespace(summary=summary, seen=seen, root=root, printed=printed.getvalue(), steps=steps)
