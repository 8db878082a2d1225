"""A forwarder taken in place of the origin (`relay.sources`, `_leave_origin`) that we pass over in
its stripe, having asked it for another stripe too (it holds the whole version, and the root of that
other stripe was lost): it is forsaken there as one dropped is (`relay.failures`, `_pass_over`,
`_forsake`), excused once if it delivered us a chunk there since we took it, and a replan takes it
afresh (`relay.transfer`, `_replan`). The transfer core alone, in virtual time."""

from __future__ import annotations

import heapq
import itertools
import math

from p2pnet.core import SetTimer
from relay.effects import Fetch, FetchFailure, SourcePassedOver
from relay.messages import HeldVersion, Holding
from relay.planner import Membership
from relay.transfer import TransferConfig, TransferCore
from tests.relay.test_capped_origin_sources import CHUNK, PUBLISHER, _relay
from tests.relay.test_transfer import envelope

ORIGIN = PUBLISHER.peer_id
CONFIG = TransferConfig(stall_timeout_s=3.0, exclude_s=5.0, announce_interval_s=3600.0)
ME, FORWARDER, LOST_ROOT = "r0", "r1", "r3"  # (the plan: see `_world`)
STRIPE, OTHER = 0, 5  # FORWARDER's home stripe, where our planned parent is the origin; LOST_ROOT's


def _world() -> tuple[TransferCore, list[Fetch]]:
    """Relay r0 of 6 advertising 30 MB/s under an origin advertising the default 1 GB/s, 32 MiB: the
    plan makes the origin our parent in stripes 0-3, each with one forwarder, its root (r1 in stripe
    0), and in stripe 4, whose root we are; r3 is the lone root of stripe 5 and our parent there."""
    core, pending = _relay(1e9, me=0, mib=32, relays=6, relay_bps=3e7, config=CONFIG)
    plan = core._versions[1].plan
    assert plan.parent[STRIPE][ME] == ORIGIN and plan.ranked_interior(STRIPE) == ((FORWARDER, 1),)
    assert plan.parent[OTHER][ME] == LOST_ROOT and plan.ranked_interior(OTHER) == ((LOST_ROOT, 1),)
    return core, pending


def _bps(peer: str, stripe: int, forwarder_bps: float = 3e7) -> float:
    """How fast `peer` sends us each chunk of `stripe`, one after another: the origin 0.2 MB/s (its
    capped uplink), FORWARDER in OTHER as slowly (it holds the whole version, but has its own
    children to feed), FORWARDER in STRIPE `forwarder_bps`, every other member 30 MB/s."""
    if (peer, stripe) == (FORWARDER, STRIPE):
        return forwarder_bps
    return 0.2e6 if peer == ORIGIN or (peer, stripe) == (FORWARDER, OTHER) else 3e7


def _run(core: TransferCore, pending: list[Fetch], withholds_from: float, replan_at: float | None = None,
         forwarder_bps: float = 3e7) -> tuple[dict[tuple[str, int], list[float]], list[float]]:
    """Serve version 1 to `core` until it holds every chunk: each source answers our requests of
    each stripe one after another (`_bps`); LOST_ROOT never answers (its requests unreachable at 1
    s); FORWARDER holds the whole version (its `Holding` at 0.5 s) and, from `withholds_from` on,
    never answers a request of STRIPE while it answers those of OTHER (before, it sends each at
    `forwarder_bps`). At `replan_at` a relay joins
    as a leaf (no upload): a replan. When each (source, stripe) was asked, and when FORWARDER was
    passed over in STRIPE."""
    plan = core._versions[1].plan
    stripe_of = plan.stripe_of_chunk
    free: dict[tuple[str, int], float] = {}
    due: list[tuple[float, int, str, str]] = []  # (time, order, what, argument)
    asked: dict[tuple[str, int], list[float]] = {}
    passed: list[float] = []

    order = itertools.count()

    def push(at: float, what: str, arg: str) -> None:
        heapq.heappush(due, (at, next(order), what, arg))

    def apply(now: float, effects: list) -> None:
        for effect in effects:
            if isinstance(effect, SetTimer):
                push(effect.at, "tick", effect.key)
            elif isinstance(getattr(effect, "event", None), SourcePassedOver):
                if (effect.event.peer, effect.event.stripe) == (FORWARDER, STRIPE):
                    passed.append(now)
            elif isinstance(effect, Fetch):
                peer, stripe = effect.peer, stripe_of[effect.index]
                asked.setdefault((peer, stripe), []).append(now)
                if peer == LOST_ROOT or (peer, stripe) == (FORWARDER, STRIPE) and now >= withholds_from:
                    continue
                link = (peer, stripe)
                free[link] = max(free.get(link, 0.0), now) + CHUNK / _bps(peer, stripe, forwarder_bps)
                push(free[link], "chunk", f"{peer} {effect.index}")

    apply(0.0, pending)
    push(0.5, "holding", FORWARDER)
    push(1.0, "unreachable", LOST_ROOT)
    if replan_at is not None:
        push(replan_at, "replan", "r6")
    while not core._versions[1].complete:
        now, _, what, arg = heapq.heappop(due)
        if what == "chunk":
            peer, index = arg.split()
            out = core.fetched(now, peer, 1, int(index), CHUNK / _bps(peer, stripe_of[int(index)], forwarder_bps), 0.0)
        elif what == "tick":
            out = core.on_timer(now, arg)
        elif what == "holding":
            out = core.on_message(now, envelope(arg, Holding((HeldVersion(1, core._versions[1].signed.manifest_id),))))
        elif what == "unreachable":
            out = []
            for index, entry in list(core._versions[1].in_flight.items()):
                if entry[0] == arg:
                    out += core.fetch_failed(now, arg, 1, index, FetchFailure.UNREACHABLE)
        else:
            out = core.set_members(now, Membership.of({**core._members.uploads, arg: 0.0}))
            plan, stripe_of = core._versions[1].plan, core._versions[1].plan.stripe_of_chunk
        apply(now, out)
    return asked, passed


def test_a_forwarder_taken_in_place_of_the_origin_and_passed_over_there_is_forsaken_after_its_one_excuse():
    """We take STRIPE from FORWARDER in place of the capped origin; it delivers us its first chunks
    there, then from 0.7 s withholds the stripe while it serves us OTHER (a holder of the whole
    version, asked in place of LOST_ROOT): stalled in STRIPE alone, it is passed over there (3.75
    s). It had delivered there since we took it: excused once, the chain is the origin's, and it
    is taken again when its exclusion ends (asked at 8.99 s). Passed over again (12.0 s), having
    delivered nothing since, it is forsaken: not asked for STRIPE again in this plan. With a
    pass-over forsaking nobody, the chain kept it in front of the origin, and it was asked again
    at each exclusion's end (17.24 and 25.49 s) and passed over 4 times."""
    core, pending = _world()
    asked, passed = _run(core, pending, withholds_from=0.7)
    v = core._versions[1]
    first, second = passed
    again = [t for t in asked[(FORWARDER, STRIPE)] if t > first]
    assert again and min(again) >= first + CONFIG.exclude_s and max(again) < second
    assert (FORWARDER, STRIPE) in v.forsaken and v.chains[STRIPE] == [ORIGIN]
    assert max(asked[(FORWARDER, OTHER)]) > second  # (it served us OTHER to the end: passed over, not dropped)


def test_a_replan_takes_a_forwarder_forsaken_in_the_old_plan_afresh():
    """The same, and at 20 s a relay joins as a leaf: the new plan (7 stripes) numbers its stripes
    anew, and what we forsook in the old plan is forgotten (`_Version.forsaken` cleared): FORWARDER,
    the forwarder of STRIPE again, where the origin is our planned parent again, is taken in the
    origin's place there (asked at 20.19 s). With the old plan's forsaken kept, it was not."""
    core, pending = _world()
    asked, passed = _run(core, pending, withholds_from=0.7, replan_at=20.0)
    plan = core._versions[1].plan
    assert plan.stripes == 7 and plan.parent[STRIPE][ME] == ORIGIN and plan.ranked_interior(STRIPE)[0][0] == FORWARDER
    assert len([t for t in passed if t < 20.0]) == 2  # (forsaken in the old plan, as above)
    assert [t for t in asked[(FORWARDER, STRIPE)] if t >= 20.0]


def test_a_forwarder_taken_in_place_of_the_origin_and_dropped_as_slow_there_is_forsaken_at_once():
    """FORWARDER, taken in place of the origin in STRIPE, sends us its chunks there at 0.1 MB/s,
    under the origin's 0.2 MB/s: it is dropped as slow on its first (`relay.judging`,
    `_short_of_origin`), having delivered it, and forsaken at once (only a stall or an unreachable
    link is excused once): asked for STRIPE that once (0.66 s), never again. With a slow drop
    excused as a stall is, it was taken again at each exclusion's end (6.55, 12.45, 18.35 and
    24.25 s), and dropped as slow each time."""
    core, pending = _world()
    asked, _ = _run(core, pending, withholds_from=math.inf, forwarder_bps=0.1e6)
    assert len(asked[(FORWARDER, STRIPE)]) == 1 and FORWARDER in core._slow
