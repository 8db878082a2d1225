"""The project type-checks (mypy, configured in pyproject.toml): the packages (p2pnet, relay,
verify, trainer, simulations, models, tasks) and the scripts/ and benchmarks/ folders. The relay's
cores, store and shells, and the diloco role, are built from mixins (relay/failures.py,
relay/serving_shell.py, relay/store_durability.py, ..., trainer/diloco_serving.py,
trainer/diloco_catchup.py) that call methods of the class they are mixed into and declare them;
a method re-typed in one place and not the other fails here instead of at run time (one the class
renames does not: the mixin's declaration stands in for it; tests/test_mixins.py checks that every
name a mixin declares is still its host's). The
bodies of functions without annotations are checked everywhere, and so are the scripts and
benchmarks (namespace packages, `scripts.calibrate`, `benchmarks.fuzz_parsers`): many run only on
a GPU or lab machine (for instance scripts/gpu_check_vllm.py against trainer/vllm_backend.py), so
a name or attribute they lost after a change in a package fails here, not when a machine is lent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_project_type_checks(tmp_path: Path):
    result = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues found in" in result.stdout
