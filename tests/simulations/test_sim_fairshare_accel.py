"""The C `share` (`simulations/_cfairshare.c`) gives the Python one's bytes: the same broadcasts
run with each write the same results.json (wall_s aside) and peers.csv.

Built here into a temporary folder with this interpreter's compiler (`simulations.accel`), so the
test runs wherever a run could use it; the worlds cover what `share` branches on: capped
downloads, window-limited connections, slow relays, missed views, crashes and hangs (flows
cancelled mid-way), byzantine relays.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

import simulations
import simulations.dataplane as dataplane
from simulations import accel, fairshare
from simulations.models import Churn
from simulations.run import run_scenario, write_outputs
from simulations.scenarios import broadcast, with_params


def _build(tmp_path: Path, with_stamp: str | None = None) -> Any:
    """The C module built into tmp_path; skips only where it could never be used (no compiler,
    another interpreter or platform); a failing build fails the test."""
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        pytest.skip("the C share is used only where float sum() adds in order (CPython < 3.12)")
    if (sys.platform, accel.platform.machine()) not in accel.PLATFORMS:
        pytest.skip("the C share is built only where floats round as Python's")
    if shutil.which(accel.compiler()[0]) is None:
        pytest.skip(f"no C compiler here ({accel.compiler()[0]})")
    path = accel.build(tmp_path, with_stamp)
    spec = importlib.util.spec_from_file_location(accel.MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_built(tmp_path: Path) -> Any:
    return _build(tmp_path).share


def test_a_build_is_used_only_with_the_trees_stamp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("P2PNET_SIM_PURE", raising=False)
    current = _build(tmp_path / "current")
    assert current.STAMP == fairshare.stamp()
    monkeypatch.setitem(sys.modules, "simulations._cfairshare", current)
    monkeypatch.setattr(simulations, "_cfairshare", current, raising=False)
    assert fairshare._accelerated() is current.share
    stale = _build(tmp_path / "stale", with_stamp="0" * 64)
    monkeypatch.setitem(sys.modules, "simulations._cfairshare", stale)
    monkeypatch.setattr(simulations, "_cfairshare", stale, raising=False)
    with pytest.warns(RuntimeWarning, match="built from another"):
        assert fairshare._accelerated() is None
    monkeypatch.setitem(sys.modules, "simulations._cfairshare", current)
    monkeypatch.setattr(simulations, "_cfairshare", current, raising=False)
    monkeypatch.setenv("P2PNET_SIM_PURE", "1")
    assert fairshare._accelerated() is None


def _outputs(monkeypatch: pytest.MonkeyPatch, share: Any, config: Any, out: Path) -> tuple[str, bytes]:
    monkeypatch.setattr(dataplane, "share", share)
    write_outputs(run_scenario(config), out)
    data = json.loads((out / "results.json").read_text())
    data.pop("wall_s")
    return json.dumps(data), (out / "peers.csv").read_bytes()


WORLDS = {
    "missed views, capped downloads": with_params(broadcast(120, seed=3), {"checkpoint_bytes": "3e8",
                                                                           "view_miss": "0.05"}),
    "slow relays, windows, churn, byzantine": dataclasses.replace(
        broadcast(80), checkpoint_bytes=100_000_000, chunk_bytes=4 * 2**20, seed=5, byzantine=0.1,
        churn=Churn(departures=0.2, end_s=1.0, leave_share=0, crash_share=1, hang_share=1), stall_timeout_s=2.0),
}


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_c_share_gives_the_python_shares_bytes(world: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _load_built(tmp_path)
    config = WORLDS[world]
    assert config.download_ratio > 0 and config.window_bytes != float("inf")
    python = _outputs(monkeypatch, fairshare.python_share, config, tmp_path / "python")
    c = _outputs(monkeypatch, fast, config, tmp_path / "c")
    assert c[0] == python[0]
    assert c[1] == python[1]
    assert json.loads(python[0])["events"] > 3_000  # it moved chunks
