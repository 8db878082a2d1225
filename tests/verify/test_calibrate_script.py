"""scripts/calibrate.py end to end on the tiny model: it writes a table the validator can load
(with the tie rule it was measured with) and a report whose decisions catch the gross attacks
and pass the honest submissions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from verify.calibration import load_tables

REPO = Path(__file__).resolve().parents[2]


def test_tiny_calibration_run_writes_tables_and_report(tmp_path: Path):
    doc, table, results = tmp_path / "calibration.md", tmp_path / "tables.json", tmp_path / "results.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "calibrate.py"), "--model", "tiny", "--prompts", "2",
                    "--attack-prompts", "1", "--rows", "8", "--group", "4", "--tokens", "40", "--ties", "open",
                    "--doc", str(doc), "--table", str(table), "--json", str(results)],
                   check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300,
                   capture_output=True)
    tables = load_tables(table)
    assert len(tables.pairs) == 4 and tables.meta["model_config"]["hidden_size"] == 128
    assert tables.ties == "open" and not tables.exact_ties  # a validator with these tables measures open
    text = doc.read_text()
    assert "## Targets (issue 14), judged from these runs" in text and "| int8 weights |" in text
    assert "Ties at the 128th place: **open**" in text
    assert json.loads(results.read_text())["meta"]["ties"] == "open"
    # detection runs on these tables measure with their rule; asking for another is refused
    other = subprocess.run([sys.executable, str(REPO / "scripts" / "calibrate.py"), "--model", "tiny",
                            "--tables", str(table), "--ties", "exact"],
                           cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300,
                           capture_output=True, text=True)
    assert other.returncode == 2 and "measured with ties = open, not exact" in other.stderr
    outcomes = {o["name"]: o for o in json.loads(results.read_text())["outcomes"]}
    for name in ("int4 weights", "another model (random init)", "proofs copied from another rollout",
                 "another sampling seed"):
        assert outcomes[name]["subs_either"] == outcomes[name]["submissions"] > 0, name
    honest = [o for n, o in outcomes.items() if n.startswith("honest")]
    assert len(honest) == 4 and all(o["subs_either"] == 0 for o in honest)


def _calibrate_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("calibrate", REPO / "scripts" / "calibrate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["calibrate"] = module
    spec.loader.exec_module(module)
    return module


def test_escape_bound_covers_the_true_escape_rate_and_shrinks_with_evidence():
    """escape_bound is an upper bound: rollouts that each pass with probability 1/2 and never
    exceed a limit escape as a submission of 16 with probability 2^-16; the bound must not go
    below that. Rollouts that all fail and all exceed give a small bound, smaller with more
    rollouts measured."""
    import numpy as np

    from verify.policy import PairCalibration, StatCalibration

    cal = _calibrate_module()
    pair = PairCalibration("bf16/torch/cpu", "fp32/torch/cpu", False,
                           (("mant_err_mean", StatCalibration(1.7, 0.17)),
                            ("exp_mismatches", StatCalibration(4.0, 0.15))), 512, 256)
    rng = np.random.default_rng(0)

    def outcome(prompts: int, accept_p: float, exceed: float, per_prompt: int = 2):
        o = cal.Outcome("attack")
        for p in range(prompts):
            for _ in range(per_prompt):
                o.records.append({"prompt": p, "accepted": [bool(a) for a in rng.random(16) < accept_p],
                                  "fractions": {"mant_err_mean": [exceed] * 16, "exp_mismatches": [exceed] * 16}})
        return o

    assert cal.escape_bound(outcome(8, 0.5, 0.0), pair, 1e-4, 16, 1e-3) >= 0.5**16
    few, many = (cal.escape_bound(outcome(8, 0.0, 1.0, n), pair, 1e-4, 16, 1e-3) for n in (2, 8))
    assert many < few < 1e-3
    assert cal.aggregate_cut(0.17, 16, 1e-4) > 0.17
    assert abs(cal.binomial_tail(16, 0, 0.3) - 1.0) < 1e-12 and abs(cal.binomial_tail(4, 3, 0.5) - 5 / 16) < 1e-12


def test_a_later_run_on_new_prompts_adds_to_an_earlier_one_and_the_same_prompts_are_refused():
    """--attack-offset numbers a later run's prompts after the earlier run's, so --merge can add
    its submissions (counts summed, records kept: the count bounds grow with them); merging a
    run with itself, or two runs over the same prompts, is refused (not independent)."""
    import pytest

    cal = _calibrate_module()
    first, later = (cal.make_setup("tiny", 2, 3, offset) for offset in (0, 3))
    assert first.prompts == later.prompts and not set(map(tuple, first.attack_prompts)) & set(
        map(tuple, later.attack_prompts))
    assert later.attack_prompts == cal.make_setup("tiny", 2, 6).attack_prompts[3:]

    def outcome(prompts: range, rejected: int) -> "cal.Outcome":
        o = cal.Outcome("int8 weights", submissions=len(prompts), rollouts=16 * len(prompts),
                        chunks=32 * len(prompts), subs_either=rejected, reasons={"toploc_mant_mean"},
                        worst={"mant_err_mean": 2.0})
        o.records = [{"prompt": p} for p in prompts]
        return o

    into = outcome(range(0, 3), 3)
    cal.combine(into, outcome(range(3, 6), 2), "b.json")
    assert (into.submissions, into.rollouts, into.chunks, into.subs_either) == (6, 96, 192, 5)
    assert [r["prompt"] for r in into.records] == list(range(6))
    assert cal.lower_95(into.subs_either, into.submissions) < cal.lower_95(6, 6)
    with pytest.raises(SystemExit, match="already measured on prompts"):
        cal.combine(into, outcome(range(5, 7), 2), "c.json")


def test_counts_with_the_prompt_as_the_unit_need_every_submission_of_a_prompt_rejected():
    """300 rejected submissions on 150 prompts bound the rate only as 150 prompts do (98.0%, not
    99.0%): the report's 'met by counts' needs both bounds at the target."""
    cal = _calibrate_module()
    o = cal.Outcome("int8 weights")
    o.records = [{"prompt": p, "chunk_rule": False, "aggregate": True, "accepted": [True] * 16, "fractions": {}}
                 for p in range(150) for _ in range(2)]
    o.submissions = o.subs_either = 300
    assert cal.prompt_counts(o) == (150, 150)
    assert round(cal.lower_95(300, 300), 3) == 0.990 and round(cal.lower_95(*cal.prompt_counts(o)), 3) == 0.980
    o.records[1] = o.records[1] | {"aggregate": False}  # one of prompt 0's two escaped
    assert cal.prompt_counts(o) == (149, 150)
    row = [line for line in cal.targets([], [o], {o.name: 1e-9}, 1e-3) if line.startswith("| int8 weights")][0]
    assert "met by counts" not in row and "99.0% / " in row


def test_the_shipped_report_ends_with_the_scripts_fixed_text():
    """docs/calibration.md is generated: its fixed tail is calibration_report.TEXT_TAIL, so an edit
    to one of them alone (or to the report by hand) fails here."""
    from scripts.calibration_report import TEXT_TAIL

    assert (REPO / "docs" / "calibration.md").read_text().endswith(TEXT_TAIL + "\n")
