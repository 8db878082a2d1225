"""`python -m trainer.local`, the single-process loop (generate -> verify -> train): each step's
batch passes the validator's own check, every step makes a new policy version, and the command
prints one line per step and a summary."""

from __future__ import annotations

from pathlib import Path

from trainer.local import LocalConfig, main, run_local


def test_each_local_step_is_verified_and_makes_a_new_version(tmp_path: Path):
    seen = []
    history = run_local(LocalConfig(steps=2, verify_rows=4), tmp_path, report=lambda step, s: seen.append(step))
    assert seen == [0, 1] and len(history) == 2
    assert [h.stats.version for h in history] == [1, 2] and all(h.stats.trained for h in history)
    assert all(h.verified is True and h.reasons == () for h in history)  # an honest batch passes
    assert all(0.0 <= h.stats.reward_mean <= 1.0 and h.stats.n_rollouts > 0 for h in history)


def test_the_local_command_prints_a_line_per_step_and_a_summary(tmp_path: Path, capsys):
    main(["--steps", "2", "--verify-rows", "2", "--work-dir", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[:2]] == [["step", "0"], ["step", "1"]]
    assert lines[-1].startswith("reward mean: first 1 steps") and "2 steps in" in lines[-1]
