"""The event engine: moving an event (`Engine.retime`) runs events in the order that cancelling
it and scheduling it anew gives, ties included, though a move later keeps its heap entry."""

from __future__ import annotations

import random

from simulations.engine import Engine


def _replay(lazy: bool, seed: int) -> list[tuple[float, str]]:
    """Events at whole seconds (many ties), moved earlier and later while the run goes on."""
    engine = Engine(0)
    rng = random.Random(seed)
    ran: list[tuple[float, str]] = []
    handles: dict[str, object] = {}

    def fire(name: str) -> None:
        ran.append((engine.now, name))
        del handles[name]
        for _ in range(3):  # each event moves some pending ones, cancels one now and then
            if not handles:
                return
            other = rng.choice(sorted(handles))
            roll = rng.random()
            if roll < 0.1:
                handles.pop(other).cancel()  # type: ignore[attr-defined]
                continue
            when = engine.now + rng.randrange(0, 6)
            if lazy:
                handles[other] = engine.retime(handles[other], when, fire, other)  # type: ignore[arg-type]
            else:
                handles[other].cancel()  # type: ignore[attr-defined]
                handles[other] = engine.at(when, fire, other)

    for i in range(200):
        name = f"e{i}"
        handles[name] = engine.at(float(rng.randrange(0, 20)), fire, name)
    engine.run()
    return ran


def test_retime_runs_events_in_the_order_cancel_and_schedule_anew_gives() -> None:
    for seed in range(5):
        lazy, plain = _replay(True, seed), _replay(False, seed)
        assert lazy == plain
        assert len(lazy) > 100


def test_an_event_moved_later_runs_once_at_its_new_time_and_is_not_counted_twice() -> None:
    engine = Engine(0)
    ran: list[float] = []
    handle = engine.at(1.0, lambda: ran.append(engine.now))
    handle = engine.retime(handle, 3.0, lambda: ran.append(engine.now))
    handle = engine.retime(handle, 2.0, lambda: ran.append(engine.now))  # still after its entry at 1.0
    engine.run()
    assert ran == [2.0]
    assert engine.events_run == 1
    moved = engine.at(5.0, lambda: ran.append(engine.now))
    engine.retime(moved, 4.0, lambda: ran.append(-engine.now))  # earlier: a new entry, the old one cancelled
    engine.run()
    assert ran == [2.0, -4.0]
    assert engine.events_run == 2


def test_retime_of_a_handle_that_ran_or_was_cancelled_schedules_the_event_anew() -> None:
    engine = Engine(0)
    ran: list[tuple[str, float]] = []
    done = engine.at(1.0, lambda: ran.append(("first", engine.now)))
    engine.run()
    again = engine.retime(done, 2.0, lambda: ran.append(("again", engine.now)))  # it ran: no entry left to move
    cancelled = engine.at(3.0, lambda: ran.append(("old", engine.now)))
    cancelled.cancel()
    revived = engine.retime(cancelled, 4.0, lambda: ran.append(("new", engine.now)))  # still queued, but cancelled
    moved = engine.retime(engine.at(5.0, lambda: ran.append(("moved", engine.now))), 6.0,
                          lambda: ran.append(("moved", engine.now)))
    moved.cancel()  # cancelled after a lazy move: neither time runs it
    engine.run()
    assert ran == [("first", 1.0), ("again", 2.0), ("new", 4.0)]
    assert again is not done and revived is not cancelled
    assert engine.events_run == 3
