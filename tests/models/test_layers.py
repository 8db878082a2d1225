"""The package layers: verify and models import nothing from trainer; tasks imports no torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).glob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        found[path.name] = names
    return found


@pytest.mark.parametrize("package", ["verify", "models", "tasks"])
def test_no_import_runs_back_up_to_the_trainer(package):
    offenders = {f: sorted(n for n in names if n == "trainer" or n.startswith("trainer."))
                 for f, names in imported_modules(package).items()}
    assert not {f: n for f, n in offenders.items() if n}


def test_tasks_are_pure():
    heavy = {f: sorted(n for n in names if n.split(".")[0] in ("torch", "transformers", "trio"))
             for f, names in imported_modules("tasks").items()}
    assert not {f: n for f, n in heavy.items() if n}
