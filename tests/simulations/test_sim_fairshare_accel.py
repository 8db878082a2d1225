"""The C `share` (`simulations/_cfairshare.c`) gives the Python one's bytes: the same broadcasts
run with each write the same results.json (wall_s aside) and peers.csv; so does the engine on the
C queue (`simulations/_cqueue.c`, in the same module) against heapq.

Built here into a temporary folder with this interpreter's compiler (`simulations.accel`), so the
test runs wherever a run could use it; the worlds cover what `share` branches on: capped
downloads, window-limited connections, slow relays, missed views, crashes and hangs (flows
cancelled mid-way), byzantine relays.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import json
import math
import os
import random
import subprocess
import sys
import types
import weakref
from pathlib import Path
from typing import Any

import pytest

import simulations
import simulations.dataplane as dataplane
import simulations.engine as engine_module
from p2pnet import cbuild
from simulations import accel, fairshare
from simulations.models import Churn
from simulations.run import run_scenario, write_outputs
from simulations.scenarios import broadcast, with_params


def _build(tmp_path: Path, with_stamp: str | None = None) -> Any:
    """The C module built into tmp_path; skips only where it could never be used (no compiler,
    no headers, another interpreter or platform); a failing build fails the test."""
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        pytest.skip("the C share is used only where float sum() adds in order (CPython < 3.12)")
    if (reason := cbuild.unbuildable()) is not None:
        pytest.skip(reason)
    path = accel.build(tmp_path, with_stamp)
    return cbuild.import_file(path, accel.MODULE)


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
    assert fairshare.accelerator() is built
    install(_build(tmp_path / "stale", with_stamp="0" * 64))
    with pytest.warns(RuntimeWarning, match="built from another"):
        assert fairshare.accelerator() is None
    install(built)
    monkeypatch.setenv("P2PNET_SIM_PURE", "1")
    assert fairshare.accelerator() is None


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


def _ports_and_flows(flow_classes: tuple[type, ...]) -> list[Any]:
    """Five ports (two with unlimited downloads) and nine flows among them, of `flow_classes` in
    turn, some with rates already (so loads and re-timings count), some window-capped."""
    ports = [dataplane._Port(upload_bps=up, download_bps=down, serving=None, core_index=0)  # type: ignore[arg-type]
             for up, down in [(1e8, 4e8), (3e7, math.inf), (5e7, 1.2e8), (2e7, 8e7), (9e7, math.inf)]]
    flows = []
    for k, (s, d, cap, rate) in enumerate([(0, 1, math.inf, 0.0), (0, 2, 3e7, 2e7), (0, 3, math.inf, 0.0),
                                           (1, 2, math.inf, 1e7), (1, 3, 7e6, 0.0), (2, 4, math.inf, 0.0),
                                           (3, 2, math.inf, 5e6), (4, 0, 2.5e7, 0.0), (4, 3, math.inf, 0.0)]):
        request = types.SimpleNamespace(fetch=types.SimpleNamespace(size=4 * 2**20 + k))
        flow = flow_classes[k % len(flow_classes)]("source", request, 0.25 * k, ports[s], ports[d], cap)
        flow.rate = rate
        flow.handle = _Handle([]) if rate else None
        ports[s].up.append(flow)
        ports[d].down.append(flow)
        flows.append(flow)
    return flows


class _OtherFlow(dataplane._Flow):
    """A flow of another class: in a call whose first flow is a `_Flow` (the class the C share
    learns), the C share reads it by attribute, not at the learnt slots."""

    __slots__ = ()


def _one_call(share: Any, flow_classes: tuple[type, ...]) -> list[Any]:
    """The bits one `share` call over `_ports_and_flows(flow_classes)` leaves and schedules."""
    flows = _ports_and_flows(flow_classes)
    engine = _Engine(3.0)
    share(flows[:7], 1, engine, None)
    ports = {id(p): p for f in flows for p in (f.src, f.dst)}.values()
    return ([(f.rate.hex(), f.remaining.hex(), f.since.hex()) for f in flows] +
            [(float(p.up_load).hex(), float(p.down_load).hex()) for p in ports] +
            [entry[:2] for entry in engine.log])


@pytest.mark.parametrize("flow_classes", [(dataplane._Flow,), (dataplane._Flow, _OtherFlow)])
def test_c_share_reads_slots_and_attributes_alike(flow_classes: tuple[type, ...], built: Any) -> None:
    """The same bits from the C share whether it reads the flows at their slots or by attribute
    (every other flow of another class), as from the Python one."""
    seen = [_one_call(share, flow_classes) for share in (built.share, fairshare.python_share)]
    assert seen[0] == seen[1]
    assert any(entry[0] == "retime" for entry in seen[0]) and any(entry[0] == "at" for entry in seen[0])


def test_c_share_relearns_a_class_changed_after_it_learnt_it(built: Any) -> None:
    """A learnt class whose field becomes a property is read through it on the next call (the
    class's version tag changed), as the Python share reads it."""
    class Changed(dataplane._Flow):
        __slots__ = ()

    assert _one_call(built.share, (Changed,)) == _one_call(fairshare.python_share, (Changed,))  # learnt
    Changed.rate = property(lambda flow: 7.0, lambda flow, value: None)  # type: ignore[assignment]
    seen = [_one_call(share, (Changed,)) for share in (built.share, fairshare.python_share)]
    assert seen[0] == seen[1]
    assert seen[0][0][0] == (7.0).hex()


_FOREIGN = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location(sys.argv[1], sys.argv[2])
built = importlib.util.module_from_spec(spec)
spec.loader.exec_module(built)
from simulations import dataplane, fairshare
# a class holding _Flow's member descriptors (another layout's offsets) but no slots of its own
members = {n: d for n, d in vars(dataplane._Flow).items() if type(d).__name__ == "member_descriptor"}
Foreign = type("Foreign", (), {"__slots__": (), **members})
class Engine:
    now = 0.0
for share in (built.share, fairshare.python_share):
    try:
        share([Foreign()], 1, Engine(), None)
    except TypeError as error:
        print("TypeError", "doesn't apply" in str(error))
    else:
        print("no error")
"""


def test_c_share_refuses_another_classs_descriptors_as_python_does(built: Any) -> None:
    """A class whose fields are another class's member descriptors is not learnt (their offsets
    are the other layout's): the C share raises the descriptor's TypeError as the Python one does.
    In a child process: reading at those offsets would be a crash, not a failure."""
    root = Path(simulations.__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _FOREIGN, accel.MODULE, built.__file__], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout) == (0, "TypeError True\nTypeError True\n"), done.stderr


def test_c_queue_pops_in_heapqs_order(built: Any) -> None:
    """Interleaved pushes and pops, many at equal times: the C queue pops the entries heapq pops."""
    rng = random.Random(7)
    queue, heap, sequence = built.Queue(), [], 0
    popped: list[tuple[Any, Any]] = []
    for _ in range(20_000):
        if heap and rng.random() < 0.45:
            popped.append((built.heappop(queue), heapq.heappop(heap)))
            assert queue[0] is heap[0] if heap else len(queue) == 0
        else:
            sequence += 1
            entry = (float(rng.randrange(50)) / 8, sequence, object(), None, ())
            built.heappush(queue, entry)
            heapq.heappush(heap, entry)
        assert len(queue) == len(heap)
    while heap:
        popped.append((built.heappop(queue), heapq.heappop(heap)))
    assert len(popped) > 10_000 and all(c is python for c, python in popped)
    with pytest.raises(IndexError):
        built.heappop(queue)
    with pytest.raises(ValueError, match="NaN"):
        built.heappush(queue, (math.nan, 1, None, None, ()))
    with pytest.raises(TypeError):
        built.heappush(queue, [1.0, 2])


def test_c_queue_gives_its_earliest_entry_and_cannot_be_iterated(built: Any) -> None:
    """`queue[0]` and `len` as on heapq's list; iterating or `in` (which on a heap would see
    only part of it, in no useful order) is refused rather than answered wrongly."""
    queue = built.Queue()
    entries = [(float(t), k + 1, None, None, ()) for k, t in enumerate([5, 1, 4, 2, 3])]
    for entry in entries:
        built.heappush(queue, entry)
    assert queue[0] is entries[1] and len(queue) == 5 and queue
    with pytest.raises(IndexError):
        queue[1]
    with pytest.raises(TypeError):
        list(queue)
    with pytest.raises(TypeError):
        entries[0] in queue  # noqa: B015


def test_c_queue_in_a_cycle_is_collected(built: Any) -> None:
    """The queue shows the collector its entries: a cycle through a queued entry is freed."""
    class Owner:
        pass

    owner = Owner()
    owner.queue = built.Queue()  # type: ignore[attr-defined]
    built.heappush(owner.queue, (0.0, 1, owner, None, ()))  # type: ignore[attr-defined]
    alive = weakref.ref(owner)
    del owner
    gc.collect()
    assert alive() is None


def _use_queue(monkeypatch: pytest.MonkeyPatch, queue: str, built: Any) -> None:
    """Make the engine run on heapq's list ("heapq") or on the built C queue ("c")."""
    new, push, pop = ((list, heapq.heappush, heapq.heappop) if queue == "heapq"
                      else (built.Queue, built.heappush, built.heappop))
    for name, value in (("new_queue", new), ("heappush", push), ("heappop", pop)):
        monkeypatch.setattr(engine_module, name, value)


@pytest.mark.parametrize("queue", ["heapq", "c"])
def test_engine_refuses_an_event_at_time_nan_on_either_queue(queue: str, built: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`at` and `retime` name the caller's NaN, on heapq (which would take it and lose its order)
    as on the C queue."""
    _use_queue(monkeypatch, queue, built)
    engine = engine_module.Engine(seed=1)
    ran: list[float] = []
    handle = engine.at(1.0, ran.append, 1.0)
    with pytest.raises(ValueError, match="NaN"):
        engine.at(math.nan, ran.append, 2.0)
    with pytest.raises(ValueError, match="NaN"):
        engine.retime(handle, math.nan, ran.append, 1.0)
    assert engine.pending() == 1
    engine.run()
    assert ran == [1.0]


def test_engine_on_the_c_queue_gives_the_heapq_runs_bytes(built: Any, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    config = WORLDS["slow relays, windows, churn, byzantine"]
    outputs = []
    for name in ("heapq", "c"):
        _use_queue(monkeypatch, name, built)
        outputs.append(_outputs(monkeypatch, fairshare.python_share, config, tmp_path / name))
    assert outputs[0] == outputs[1]
    assert json.loads(outputs[0][0])["events"] > 3_000
