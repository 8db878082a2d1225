"""scripts/honest_checks.py: every row of honest batches from each version of a run, checked as
the devnet's validator checks them; a rejection is a false one and fails the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.folder import save_model_dir
from models.tiny import build_model
from scripts import honest_checks

torch.set_num_threads(1)


def test_a_versions_honest_rows_all_pass_and_the_numbers_are_written(tmp_path: Path, capsys):
    save_model_dir(*build_model("tiny", seed=3), tmp_path / "v0")
    (tmp_path / "intake_state.json").write_text("{}")  # a trainer's folder holds more than versions
    assert honest_checks.main([str(tmp_path), "--steps", "1", "--json", str(tmp_path / "out.json")]) == 0
    assert "256 honest rows checked, 0 rejected" in capsys.readouterr().out
    (row,) = json.loads((tmp_path / "out.json").read_text())
    assert row["version"] == 0 and row["rows"] == 256 and row["rejected"] == []
    assert row["eos"] == 0 or 0 < row["least_eos_prob"] <= 1


def test_a_rejected_row_fails_the_run_and_is_explained(tmp_path: Path, capsys, monkeypatch):
    """A check one token stricter than the generation (its limit 2, the rows up to 3 tokens): the
    3-token rows are rejected as too long, each line names the row and the numbers."""
    save_model_dir(*build_model("tiny", seed=3), tmp_path / "v0")
    import verify.check

    real = verify.check.check_rollout
    monkeypatch.setattr(verify.check, "check_rollout", lambda *a, **kw: real(*a, **{**kw, "max_new_tokens": 2}))
    assert honest_checks.main([str(tmp_path), "--steps", "1"]) == 1
    out = capsys.readouterr().out
    assert "rejected worker1 step 0 row " in out and ": bad_termination; too_long; replay deficit max 0 " in out
    assert not out.splitlines()[-1].endswith(" 0 rejected")


def test_a_folder_without_versions_is_named(tmp_path: Path):
    with pytest.raises(SystemExit, match="no version folders"):
        honest_checks.main([str(tmp_path)])
    with pytest.raises(SystemExit):
        honest_checks.main([str(tmp_path / "missing")])


def test_rows_are_checked_by_the_validators_own_checker_stop_reason_included(tmp_path: Path, capsys, monkeypatch):
    """The validator refuses a row whose declared stop reason contradicts its last token
    (`bad_stop_reason`, before any recomputation), which `check_rollout` alone never looks at:
    a worker that declared one row's length stop an EOS is a rejection the script must report."""
    import dataclasses

    import trainer.rollout

    save_model_dir(*build_model("tiny", seed=3), tmp_path / "v0")
    real = trainer.rollout.generate_batch

    def one_wrong_stop_reason(*a, **kw):
        batch, timing = real(*a, **kw)
        flip = next(r for r in batch.rollouts if r.stop_reason == "length")
        rollouts = tuple(dataclasses.replace(r, stop_reason="eos") if r is flip else r for r in batch.rollouts)
        return dataclasses.replace(batch, rollouts=rollouts), timing

    monkeypatch.setattr(trainer.rollout, "generate_batch", one_wrong_stop_reason)
    assert honest_checks.main([str(tmp_path), "--steps", "1"]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if "rejected worker" in line]
    assert len(lines) == 2 and all(line.endswith(": bad_stop_reason") for line in lines), lines
