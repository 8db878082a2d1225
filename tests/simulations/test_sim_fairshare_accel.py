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
import sysconfig
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
    no headers, another interpreter or platform); a failing build fails the test."""
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        pytest.skip("the C share is used only where float sum() adds in order (CPython < 3.12)")
    if (sys.platform, accel.platform.machine()) not in accel.PLATFORMS:
        pytest.skip("the C share is built only where floats round as Python's")
    if shutil.which(accel.compiler()[0]) is None:
        pytest.skip(f"no C compiler here ({accel.compiler()[0]})")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("this interpreter's headers are not installed (a Debian python3.11 without python3.11-dev)")
    path = accel.build(tmp_path, with_stamp)
    spec = importlib.util.spec_from_file_location(accel.MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The C module built from this tree, once for the module's tests."""
    return _build(tmp_path_factory.mktemp("cfairshare"))


def test_a_build_is_used_only_with_the_trees_stamp(built: Any, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def install(module: Any) -> None:  # as if `make sim-accel` had put it in the package
        monkeypatch.setitem(sys.modules, "simulations._cfairshare", module)
        monkeypatch.setattr(simulations, "_cfairshare", module, raising=False)

    monkeypatch.delenv("P2PNET_SIM_PURE", raising=False)
    assert built.STAMP == fairshare.stamp()
    install(built)
    assert fairshare._accelerated() is built.share
    install(_build(tmp_path / "stale", with_stamp="0" * 64))
    with pytest.warns(RuntimeWarning, match="built from another"):
        assert fairshare._accelerated() is None
    install(built)
    monkeypatch.setenv("P2PNET_SIM_PURE", "1")
    assert fairshare._accelerated() is None


def _outputs(monkeypatch: pytest.MonkeyPatch, share: Any, config: Any, out: Path) -> tuple[str, bytes]:
    monkeypatch.setattr(dataplane, "share", share)
    write_outputs(run_scenario(config), out)
    data = json.loads((out / "results.json").read_text())
    data.pop("wall_s")
    assert data.pop("fair_share") == ("python" if share is fairshare.python_share else "c")
    return json.dumps(data), (out / "peers.csv").read_bytes()


WORLDS = {
    "missed views, capped downloads": with_params(broadcast(120, seed=3), {"checkpoint_bytes": "3e8",
                                                                           "view_miss": "0.05"}),
    "slow relays, windows, churn, byzantine": dataclasses.replace(
        broadcast(80), checkpoint_bytes=100_000_000, chunk_bytes=4 * 2**20, seed=5, byzantine=0.1,
        churn=Churn(departures=0.2, end_s=1.0, leave_share=0, crash_share=1, hang_share=1), stall_timeout_s=2.0),
    "unlimited downloads": dataclasses.replace(broadcast(100, seed=2), download_ratio=float("inf")),
}


class _Handle:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def cancel(self) -> None:
        self.log.append("cancel")


class _Engine:
    """Records what a `share` call schedules, to the bit."""

    def __init__(self, now: float) -> None:
        self.now, self.log = now, []  # type: list[Any]

    def at(self, when: float, finish: Any, flow: Any) -> _Handle:
        self.log.append(("at", when.hex(), id(flow)))
        return _Handle(self.log)

    def retime(self, handle: Any, when: float, finish: Any, flow: Any) -> _Handle:
        self.log.append(("retime", when.hex(), id(flow)))
        return _Handle(self.log)


def _differential(fast: Any, calls: list[int]) -> Any:
    """A `share` that runs the C and the Python function on the same state with a recording
    engine, asserts they set the same bits and schedule the same times, then takes the real step."""

    def one(share: Any, flows: list[Any], tag: int, engine: Any, finish: Any, ports: list[Any]) -> list[Any]:
        saved = [(f.rate, f.remaining, f.since, f.handle) for f in flows], [(p.up_load, p.down_load) for p in ports]
        for f in flows:
            if f.handle is not None:
                f.handle = _Handle([])
        fake = _Engine(engine.now)
        share(flows, tag, fake, finish)
        seen = [(f.rate.hex(), f.remaining.hex(), f.since.hex(), f.handle is None) for f in flows]
        seen += [(float(p.up_load).hex(), float(p.down_load).hex()) for p in ports] + fake.log
        for f, (rate, remaining, since, handle) in zip(flows, saved[0]):
            f.rate, f.remaining, f.since, f.handle = rate, remaining, since, handle
        for p, (up, down) in zip(ports, saved[1]):
            p.up_load, p.down_load = up, down
        return seen

    def share(flows: list[Any], tag: int, engine: Any, finish: Any) -> None:
        ports = list({id(p): p for f in flows for p in (f.src, f.dst)}.values())
        c = one(fast, flows, tag, engine, finish, ports)
        python = one(fairshare.python_share, flows, -tag, engine, finish, ports)  # another tag: fresh scratch
        assert c == python, f"call {calls[0]}: the C share differs from python_share"
        calls[0] += 1
        fairshare.python_share(flows, tag, engine, finish)

    return share


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_c_share_sets_the_python_shares_bits_on_every_call(world: str, built: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [0]
    monkeypatch.setattr(dataplane, "share", _differential(built.share, calls))
    result = run_scenario(WORLDS[world])
    assert calls[0] > 1_000 and result.summary["events"] > 3_000  # it shared and moved chunks


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_c_share_gives_the_python_shares_bytes(world: str, built: Any, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    config = WORLDS[world]
    python = _outputs(monkeypatch, fairshare.python_share, config, tmp_path / "python")
    c = _outputs(monkeypatch, built.share, config, tmp_path / "c")
    assert c[0] == python[0]
    assert c[1] == python[1]
    assert json.loads(python[0])["events"] > 3_000  # it moved chunks
