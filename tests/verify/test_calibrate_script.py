"""scripts/calibrate.py end to end on the tiny model: it writes a table the validator can load
and a report whose decisions catch the gross attacks and pass the honest submissions."""

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
                    "--attack-prompts", "1", "--rows", "8", "--group", "4", "--tokens", "40",
                    "--doc", str(doc), "--table", str(table), "--json", str(results)],
                   check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300,
                   capture_output=True)
    tables = load_tables(table)
    assert len(tables.pairs) == 4 and tables.meta["model_config"]["hidden_size"] == 128
    text = doc.read_text()
    assert "## Targets (issue 14), judged from these runs" in text and "| int8 weights |" in text
    outcomes = {o["name"]: o for o in json.loads(results.read_text())["outcomes"]}
    for name in ("int4 weights", "another model (random init)", "proofs copied from another rollout",
                 "another sampling seed"):
        assert outcomes[name]["subs_either"] == outcomes[name]["submissions"] > 0, name
    honest = [o for n, o in outcomes.items() if n.startswith("honest")]
    assert len(honest) == 4 and all(o["subs_either"] == 0 for o in honest)
