"""Lingering serves (`relay.serving.ServingConfig.linger_factor`): a chunk served for longer than
`linger_factor` times the source's typical serving time (the 25th percentile of its last 64
completed serves, lingering ones included, once it has 8) stops holding its upload slot, at most `linger_cap` x the slots
at once; and the relay's trio shell (`relay.uploads.Uploads`) wakes the core at that time, with
its "every slot busy" notion (`on_full`, which the upload meter follows) freed with the slot.
"""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from p2pnet.errors import ConfigError
from relay.serving import LINGER_MIN_SAMPLES, LINGER_SAMPLES, Serve, ServingConfig, ServingCore
from relay.uploads import Uploads


def _timed(core: ServingCore, durations: list[float], start: float = 0.0) -> float:
    """Serve one chunk after the other, each taking its duration (nothing else is served
    meanwhile); the time when the last ended."""
    now = start
    for i, seconds in enumerate(durations):
        token = ("t", now, i)
        assert core.ask(now, token, f"p{i % 5}", 1, i, False, True) == [Serve(token, 0.0)]
        now += seconds
        core.done(now, token)
    return now


def _core(**config) -> ServingCore:
    return ServingCore(ServingConfig(**{"slots": 1, "per_peer": 1, "linger_factor": 2.0, "linger_cap": 1, **config}))


def test_a_serve_longer_than_the_factor_times_the_typical_time_gives_its_slot_to_the_next_request():
    core = _core()
    now = _timed(core, [1.0] * LINGER_MIN_SAMPLES)  # typical: 1 s, so a serve lingers after 2 s
    assert core.ask(now, "slow", "s", 1, 100, False, True) == [Serve("slow", 0.0)]
    assert core.ask(now + 0.5, "next", "n", 1, 101, False, True) == []  # the one slot is held
    assert core.next_deadline() == now + 2.0
    assert core.expire(now + 1.999) == []
    assert core.status()["lingering"] == 0
    assert core.expire(now + 2.0) == [Serve("next", 1.5)]
    assert core.status() == {"slots": 1, "serving": 2, "lingering": 1, "queued": 0, "waiting": 0}
    assert core.full  # `next` holds the slot; `slow` goes on without one
    assert core.done(now + 3.0, "slow") == []  # a lingering serve's end frees no slot
    assert core.full and core.status()["serving"] == 1


def test_no_serve_lingers_before_the_core_has_timed_enough_serves():
    core = _core()
    now = _timed(core, [1.0] * (LINGER_MIN_SAMPLES - 1))
    core.ask(now, "slow", "s", 1, 100, False, True)
    core.ask(now, "next", "n", 1, 101, False, True)
    assert core.next_deadline() is None
    assert core.expire(now + 1000.0) == []
    assert core.done(now + 1000.0, "slow") == [Serve("next", 1000.0)]


def test_at_most_the_cap_times_the_slots_linger_and_the_end_of_one_releases_the_next_due():
    core = _core(slots=1, linger_cap=1)
    now = _timed(core, [1.0] * LINGER_MIN_SAMPLES)
    core.ask(now, "slow1", "a", 1, 100, False, True)
    core.ask(now, "slow2", "b", 1, 101, False, True)
    core.ask(now, "fast", "c", 1, 102, False, True)
    assert core.expire(now + 2.0) == [Serve("slow2", 2.0)]  # slow1 lingers: the one lingering place is taken
    assert core.next_deadline() is None  # slow2 can not linger while slow1 does
    assert core.expire(now + 100.0) == []
    assert core.done(now + 100.0, "slow1") == [Serve("fast", 100.0)]  # slow2 (due since +4 s) lingers at once
    assert core.status()["lingering"] == 1


def test_the_cap_follows_the_slots_the_transfer_core_asks_for():
    core = _core(slots=1, linger_cap=1)
    now = _timed(core, [1.0] * LINGER_MIN_SAMPLES)
    core.set_slots(now, 2)
    for name in ("s1", "s2", "s3", "s4"):
        core.ask(now, name, name, 1, hash(name) % 1000, False, True)
    assert core.expire(now + 2.0) == [Serve("s3", 2.0), Serve("s4", 2.0)]
    assert core.status()["lingering"] == 2


def test_no_serve_lingers_when_the_factor_is_zero():
    core = _core(linger_factor=0.0)
    now = _timed(core, [1.0] * LINGER_SAMPLES)
    core.ask(now, "slow", "s", 1, 100, False, True)
    core.ask(now, "next", "n", 1, 101, False, True)
    assert core.next_deadline() is None
    assert core.expire(now + 1000.0) == []
    assert core.status()["lingering"] == 0


def test_the_typical_time_is_the_25th_percentile_of_the_last_64_serves():
    rng = random.Random(7)
    core = _core(linger_factor=1.5)
    durations = [rng.choice([0.5, 1.0, 2.0, 3.0]) * rng.uniform(0.5, 1.5) for _ in range(3 * LINGER_SAMPLES)]
    now = 0.0
    for n, seconds in enumerate(durations):
        assert core.ask(now, n, "p", 1, n, False, True) == [Serve(n, 0.0)]
        last = sorted(durations[max(0, n - LINGER_SAMPLES):n])
        expected = now + 1.5 * last[len(last) // 4] if n >= LINGER_MIN_SAMPLES else None
        assert core.next_deadline() == (pytest.approx(expected, abs=1e-9) if expected is not None else None)
        now += seconds
        core.done(now, n)


def test_the_next_deadline_is_the_earlier_of_a_wait_limit_and_a_release():
    core = _core(wait_limit_s=5.0)
    now = _timed(core, [1.0] * LINGER_MIN_SAMPLES)  # release after 2 s
    core.ask(now, "slow", "s", 1, 100, False, True)
    core.ask(now + 0.5, "later", "w", 1, 200, False, False)  # waits for chunk 200 until now + 5.5
    assert core.next_deadline() == now + 2.0
    core.expire(now + 2.0)  # slow lingers (nothing queued: its slot is free)
    assert not core.full
    assert core.next_deadline() == now + 5.5


def test_a_lingering_serve_still_counts_against_its_requesters_cap():
    core = _core(slots=2, per_peer=1)
    now = _timed(core, [1.0] * LINGER_MIN_SAMPLES)
    core.ask(now, "slow", "s", 1, 100, False, True)
    core.ask(now, "slow-next", "s", 1, 101, False, True)
    assert core.expire(now + 2.0) == []  # slow lingers, but its requester may hold 1 at once
    assert core.status()["lingering"] == 1
    assert core.ask(now + 2.5, "other", "o", 1, 102, False, True) == [Serve("other", 0.0)]
    assert core.done(now + 3.0, "slow") == [Serve("slow-next", 3.0)]


@pytest.mark.parametrize("config", [{"linger_factor": 0.5}, {"linger_factor": -1.0}, {"linger_cap": 0},
                                    {"linger_cap": 17}])
def test_linger_settings_out_of_bounds_are_refused(config):
    with pytest.raises(ConfigError):
        ServingConfig(**config)


async def test_the_trio_shell_releases_at_the_deadline_and_full_follows_the_slot(autojump_clock):
    """A release with a request queued hands the slot on at once (`full` stays true: requests
    still wait for our upload); one with nothing queued frees the slot (`full` false: our upload
    is not what the lingering chunk waits on, so the meter does not count that stretch)."""
    fulls: list[tuple[float, bool]] = []
    uploads = Uploads(ServingConfig(slots=1, per_peer=1, linger_factor=2.0, linger_cap=2),
                      on_full=lambda full: fulls.append((trio.current_time(), full)))
    served: list[tuple[str, float, float]] = []

    async def answer(name: str, index: int, at: float, send_s: float) -> None:
        await trio.sleep_until(at)
        async with uploads.turn(name, 1, index, False, True) as queued_s:
            served.append((name, trio.current_time(), queued_s))
            await trio.sleep(send_s)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(uploads.run)
        for i in range(LINGER_MIN_SAMPLES):
            nursery.start_soon(answer, f"q{i}", i, 1.5 * i, 1.0)  # each 1 s, one after the other
        nursery.start_soon(answer, "slow", 100, 12.0, 20.0)  # lingers at 14.0 (2 x 1 s), ends at 32.0
        nursery.start_soon(answer, "next", 101, 12.5, 1.0)  # served at 14.0, the release, until 15.0
        nursery.start_soon(answer, "slow2", 102, 16.0, 20.0)  # lingers at 18.0, nothing queued then
        await trio.sleep(40)
        nursery.cancel_scope.cancel()
    assert ("next", 14.0, 1.5) in served
    assert ("slow2", 16.0, 0.0) in served
    assert [(round(t, 6), f) for t, f in fulls if t >= 12.0] == [(12.0, True), (15.0, False), (16.0, True),
                                                                (18.0, False)]


def test_a_source_whose_own_upload_is_the_bottleneck_stops_lingering_once_its_serves_slow_down():
    """Our upload (one chunk a second, shared by every chunk being sent) is the bottleneck: more
    chunks at once only make each slower. Our first serves ran alone (1 s each: the typical time);
    then requests pile up, every serve shares the upload and passes 1.5 x that time. Lingering
    serves are timed too, so the typical time follows them and lingering stops, back to the
    slots; timing only serves that kept their slot froze it at 1 s, and every serve lingered,
    at the cap for good (6 chunks at once, each at a sixth of the upload: review 12)."""
    core = ServingCore(ServingConfig(slots=2, per_peer=1, linger_factor=1.5, linger_cap=2))
    now = _timed(core, [1.0] * LINGER_MIN_SAMPLES)
    left: dict = {}  # token -> chunk left to send
    asked, step, at_once = 0, 0.01, []
    for _ in range(int(600 / step)):
        now += step
        while core.status()["queued"] < 4:  # requesters always waiting, from many peers
            asked += 1
            for action in core.ask(now, asked, f"p{asked}", 1, asked, False, True):
                left[action.token] = 1.0
        for action in core.expire(now):
            left.setdefault(action.token, 1.0)
        share = step / max(1, len(left))
        for token in list(left):
            left[token] -= share
            if left[token] <= 1e-9:
                del left[token]
                for action in core.done(now, token):
                    left[action.token] = 1.0
        at_once.append(len(left))
    late = at_once[-int(100 / step):]  # the last 100 s
    assert max(late) <= 3 and core.status()["lingering"] <= 1


def test_a_lingering_urgent_serve_no_longer_counts_as_an_urgent_request_holding_a_slot():
    """Urgent requests go first until they hold every slot but one (then a waiting normal one
    goes before them): an urgent serve that lingers holds no slot, so it does not count there,
    and the next urgent request gets the freed slot (review 12's case)."""
    core = ServingCore(ServingConfig(slots=3, per_peer=1, linger_factor=2.0, linger_cap=1))
    now = _timed(core, [1.0] * LINGER_MIN_SAMPLES)
    core.ask(now, "u1", "a", 1, 100, True, True)
    core.ask(now + 1.5, "u2", "b", 1, 101, True, True)
    core.ask(now + 1.5, "x", "e", 1, 104, False, True)
    core.ask(now + 1.6, "u3", "c", 1, 102, True, True)
    core.ask(now + 1.6, "n1", "d", 1, 103, False, True)
    assert core.expire(now + 2.0) == [Serve("u3", pytest.approx(0.4))]
    assert core.status()["lingering"] == 1


def test_finished_serves_do_not_pile_up_behind_one_that_never_ends():
    """Two serves that never end (hung receivers) linger and keep the cap reached, so nothing
    releases serves any more; the serves finished after them are still dropped from the start
    order (memory stays flat over thousands of serves; review 12)."""
    core = ServingCore(ServingConfig(slots=2, per_peer=1, linger_factor=2.0, linger_cap=1))
    now = _timed(core, [1.0] * LINGER_MIN_SAMPLES)
    core.ask(now, "hung1", "h1", 1, 100, False, True)
    now += 3.0
    core.expire(now)  # hung1 lingers (the cap: 1 x the 2 slots)
    core.ask(now, "hung2", "h2", 1, 101, False, True)
    now += 3.0
    core.expire(now)  # hung2 too: at the cap, nothing more lingers
    for i in range(2000):  # 2,000 quick serves in the slot left
        token = ("q", i)
        core.ask(now, token, f"q{i % 7}", 1, 1000 + i, False, True)
        now += 0.5
        core.done(now, token)
    assert len(core._order) <= 4 * core.slots + 64
