"""How a devnet ends early and what it leaves (no peer processes: the trainer is a stand-in that
answers status): a step over its deadline names the step; what a user reads afterwards (logs,
summary, plot) is kept; the summary says nothing about cheaters when there were none. And an
interrupt as a peer starts (one real peer process): the peer is among those stopped."""

import signal
import subprocess
from typing import Any

import pytest

from p2pnet.errors import ConfigError, PeerUnavailable
from tests.p2pnet.test_localnet import InterruptedAfter
from trainer.devnet import DevnetConfig, _follow, _start_peers, _stop_on_sigterm, keep_for_inspection
from trainer.devnet_report import disk_usage, print_summary


class StandIn:
    """A peer process whose trainer never finishes its step `stuck_at`."""

    def __init__(self, steps_done):
        self.history = [{"step": s, "trained": True, "version": s + 1, "reward_mean": 0.1, "accuracy": 0.1,
                         "batches": 1, "accepted_batches": 1, "rejected_batches": 0, "train_s": 0.1}
                        for s in range(steps_done)]
        self.peer_id = "12D3KooWstandin"

    def alive(self):
        return True

    def status(self, timeout_s=10.0):
        return {"peers": [], "role_status": {"trainer": {"history": self.history, "workers": [], "done": False}}}


def test_a_step_over_its_deadline_stops_the_devnet_naming_the_step(capsys):
    seen = {"trainer": {"history": [], "workers": []}}
    config = DevnetConfig(steps=5, step_timeout_s=0.2)
    with pytest.raises(PeerUnavailable, match=r"step 3 of 5 took longer than 0 s \(--step-timeout-s"):
        _follow({"trainer": StandIn(steps_done=2)}, config, 0.0, None, seen)
    assert len(seen["trainer"]["history"]) == 2  # the summary so far
    assert "step   2/5" in capsys.readouterr().out


def test_deadlines_are_checked_when_the_devnet_is_configured():
    with pytest.raises(ConfigError, match="--step-timeout-s"):
        DevnetConfig(step_timeout_s=0)
    with pytest.raises(ConfigError, match="--keep-last"):
        DevnetConfig(keep_last=2)  # workers may still use the versions async_level behind
    assert DevnetConfig(steps=100).timeout_s is None  # no global deadline unless asked


def test_a_stopped_devnet_keeps_logs_summary_and_plot_not_data(tmp_path):
    root = tmp_path / "run"
    (root / "trainer" / "ckpt" / "v1").mkdir(parents=True)
    (root / "trainer" / "ckpt" / "v1" / "model.safetensors").write_bytes(b"x" * 10_000)
    for name in ("trainer.log", "worker0.log", "summary.json", "reward.png"):
        (root / name).write_text(name)
    kept = keep_for_inspection(root, tmp_path / "devnet-stopped-x")
    assert sorted(p.name for p in kept.iterdir()) == ["reward.png", "summary.json", "trainer.log", "worker0.log"]
    usage = disk_usage(root)
    assert usage["trainer_checkpoints_bytes"] >= 10_000 and usage["total_bytes"] >= usage["trainer_checkpoints_bytes"]


def summary(byzantine):
    return {"steps": [], "wall_s": 1.0, "byzantine_caught": True,
            "workers": [{"name": "worker0", "byzantine": byzantine, "submitted": 1, "accepted": 1, "rejected": 0,
                         "banned": False, "trained_batches": 1}],
            "disk": {"total_bytes": 2_000_000, "trainer_checkpoints_bytes": 1_000_000, "relay_stores_bytes": 0}}


def test_no_word_about_caught_cheaters_when_there_were_none(capsys):
    print_summary(summary(False), byzantine=0)
    out = capsys.readouterr().out
    assert "byzantine workers caught" not in out and "disk 2.0 MB" in out
    print_summary(summary(True), byzantine=1)
    assert "byzantine workers caught and kept out of training: True" in capsys.readouterr().out


def test_an_honest_workers_rejected_batch_is_named_with_its_reasons_and_its_logs_kept(tmp_path, capsys):
    """A validator rejecting a worker not told to cheat is a false rejection or a fault: the summary
    says so with the reasons the trainer counted, and the logs that say more are kept."""
    run = summary(False)
    run["workers"][0]["rejected"] = 1
    run["leaderboard"] = [{"devnet_name": "worker0", "rejection_reasons": {"bad_stop_reason": 1}}]
    print_summary(run, byzantine=0)
    assert "honest worker0 had batches rejected (first reason of each rejecting verdict: bad_stop_reason x1)" \
        in capsys.readouterr().out
    print_summary(summary(True) | {"workers": [dict(run["workers"][0], byzantine=True)]}, byzantine=1)
    assert "honest" not in capsys.readouterr().out  # a cheater's rejections are the point
    root = tmp_path / "run"
    root.mkdir()
    (root / "validator0.log").write_text("verdict reject ... row3:bad_stop_reason")
    kept = keep_for_inspection(root, tmp_path / "devnet-rejections-x", run)
    assert sorted(p.name for p in kept.iterdir()) == ["summary.json", "validator0.log"]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_as_a_devnet_peer_starts_leaves_it_among_the_peers_stopped(tmp_path, monkeypatch, signum):
    """A Ctrl-C (or the SIGTERM the devnet raises KeyboardInterrupt on) as the first peer's process
    starts: `_start_peers` has it in `procs` (what `run_devnet`'s finally stops), not running
    unnamed. A real `p2pnet peer start` child; the interrupt from `Popen`, as it returns."""
    monkeypatch.setattr(InterruptedAfter, "started", [])
    monkeypatch.setattr(InterruptedAfter, "signum", signum)
    monkeypatch.setattr(subprocess, "Popen", InterruptedAfter)
    previous = signal.getsignal(signal.SIGTERM)
    procs: dict[str, Any] = {}
    try:
        _stop_on_sigterm()
        with pytest.raises(KeyboardInterrupt):
            _start_peers([("trainer", (), {"peer": {"display_name": "trainer"}})], procs, tmp_path, None, {}, 60.0)
        assert [p.proc for p in procs.values()] == InterruptedAfter.started and list(procs) == ["trainer"]
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in InterruptedAfter.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
