"""A stand-in for a lost lone root is judged in the stripe it stands in for, and a root dropped as
slow is stood in for too (`relay.sources`, `_stand_in`; `relay.failures`, `_pass_over`;
`relay.judging`, `_short_as_stand_in`).

A stand-in is also our parent in its own stripe. Stalls were judged per source, so one that
served its own stripe and withheld the lost one was never dropped: the lost stripe waited on it
for as long as it served. Now a source that serves us in several stripes is judged per (source,
stripe) too, and passed over in the stripe it withholds alone, and a stand-in's delivery of the
lost stripe is judged there on that stripe's chunks alone, as the root it replaces was. The
transfer core alone, one per relay, 7 relays under an origin capped at 3 MB/s (a stripe each,
every root its stripe's only forwarder, every other relay its child), on a virtual clock;
`tests/relay/test_stand_in_root.py` has the lost root's first cases."""

from p2pnet.identity import Identity
from p2pnet.core import Emit
from relay.effects import DropReason, DropSource, Fetch, FetchFailure, SourceDropped, SourcePassedOver
from relay.planner import Membership, StripePlan
from relay.sources import stand_in_key
from relay.transfer import TransferConfig, TransferCore
from simulations.broadcast import fake_manifest
from tests.relay.test_stand_in_root import capped_relay

PUBLISHER = Identity.from_seed_text("capped origin, judged stand-in")
ORIGIN = PUBLISHER.peer_id
RELAYS = [f"r{i}" for i in range(7)]
CONFIG = TransferConfig(stall_timeout_s=3.0, exclude_s=60.0, announce_interval_s=3600.0)
# 256 chunks, 36-37 a stripe: a stand-in's own stripe (2 chunks a step below) outlasts the stall timeout
SIGNED = fake_manifest(PUBLISHER, 16 * 2**20, 64 * 1024)
STEP_S = 0.25
FAST_S = 0.02  # a 64 KiB chunk's time from a good source (3.3 MB/s)
SLOW_S = 2.0  # ... from a slow one (33 KB/s: under half the origin's 430 KB/s feed of a stripe, over 2 requests)


def _relay(me: str) -> tuple[TransferCore, list[Fetch]]:
    """Relay `me` of 7 under an origin capped at 3 MB/s: its core and first fetches of version 1."""
    return capped_relay(me, SIGNED, CONFIG)


def _plan() -> StripePlan:
    return _relay(RELAYS[0])[0]._versions[1].plan


def _drawn(plan: StripePlan, stripe: int) -> tuple[str, list[str]]:
    """`stripe`'s lone root and its children in the order they stand in for it (`stand_in_key`)."""
    root = plan.ranked_interior(stripe)[0][0]
    return root, sorted(plan.children(stripe, root), key=lambda p: stand_in_key(SIGNED.manifest_id, p))


class _Run:
    """One relay's core driven on a virtual clock: every `STEP_S` each outstanding fetch is
    answered (in `FAST_S`, or as `answer` says: a time, or None to withhold it), and the tick
    runs. Records every fetch and every `DropSource`, and how many fetches came before each
    drop (`marks`)."""

    def __init__(self, me: str, answer) -> None:
        self.core, self.pending = _relay(me)
        self.plan = self.core._versions[1].plan
        self.answer = answer
        self.now = 0.0
        self.fetches: list[tuple[float, Fetch]] = [(0.0, f) for f in self.pending]
        self.dropped: list[str] = []
        self.marks: dict[str, int] = {}
        self.events: list[object] = []

    def take(self, effects) -> None:
        for e in effects:
            if isinstance(e, Fetch):
                self.pending.append(e)
                self.fetches.append((self.now, e))
            elif isinstance(e, DropSource):
                self.dropped.append(e.peer)
                self.marks.setdefault(e.peer, len(self.fetches))
            elif isinstance(e, Emit):
                self.events.append(e.event)

    def fail(self, peer: str, reason: FetchFailure) -> None:
        """Every fetch outstanding at `peer` fails now with `reason`."""
        for f in [f for f in self.pending if f.peer == peer]:
            self.pending.remove(f)
            self.take(self.core.fetch_failed(self.now, peer, 1, f.index, reason))

    def step(self) -> None:
        self.now = round(self.now + STEP_S, 6)
        for f in list(self.pending):
            elapsed = self.answer(f, self.plan.stripe_of_chunk[f.index])
            if elapsed is None or f not in self.pending:
                continue
            self.pending.remove(f)
            if self.core._versions[1].in_flight.get(f.index, (None,))[0] == f.peer:
                self.take(self.core.fetched(self.now, f.peer, 1, f.index, elapsed, 0.0))
        self.take(self.core.on_timer(self.now, "relay/tick"))

    def past_the_stall(self) -> float:
        """Step until two steps past the stall timeout from now; returns when it began."""
        start = self.now
        while self.now < start + CONFIG.stall_timeout_s + 2 * STEP_S:
            self.step()
        return start

    def asked(self, stripe: int, since: float, after: int = 0) -> set[str]:
        """Whom the core asked for `stripe`'s chunks at `since` or later (and past the first
        `after` fetches)."""
        return {f.peer for t, f in self.fetches[after:] if t >= since and self.plan.stripe_of_chunk[f.index] == stripe}


def _withheld_by(stand_in: str, lost: int):
    """Answers in which `stand_in` withholds the lost stripe's chunks and serves the others."""
    return lambda f, stripe: None if f.peer == stand_in and stripe == lost else FAST_S


def _home(plan: StripePlan, peer: str) -> int:
    return next(s for s in range(plan.stripes) if plan.ranked_interior(s)[0][0] == peer)


def _lost_root_run(me: str, stripe: int, answer) -> _Run:
    """`me`'s run once `stripe`'s lone root was found unreachable at 0.25 s."""
    run = _Run(me, answer)
    root = run.plan.ranked_interior(stripe)[0][0]
    run.answer = lambda f, s: None if f.peer == root else answer(f, s)
    run.now = STEP_S
    run.fail(root, FetchFailure.UNREACHABLE)
    return run


def test_a_stand_in_withholding_the_lost_stripe_is_passed_over_there_and_stays_our_parent_in_its_own():
    """The stand-in (first child in the draw) serves its own stripe and never answers for the
    lost one. The third child passes it over in the lost stripe at the stall timeout and asks
    the second child, keeps asking the stand-in for the stand-in's own stripe, and drops no
    source. Before, judged per source, the stand-in made progress and the lost stripe waited on
    it for as long as it served its own."""
    plan = _plan()
    lost = plan.home[RELAYS[3]]
    root, children = _drawn(plan, lost)
    first, second, third = children[:3]
    run = _lost_root_run(third, lost, _withheld_by(first, lost))
    assert run.asked(lost, run.now) == {first}
    start = run.past_the_stall()
    assert run.asked(lost, start + CONFIG.stall_timeout_s) == {second}
    assert first in run.asked(_home(plan, first), start + CONFIG.stall_timeout_s)
    assert run.dropped == []  # (the stand-in's connection stays open)


def test_a_child_with_nobody_before_it_but_a_withholding_stand_in_asks_the_origin():
    """The second child passes the withholding stand-in over in the lost stripe and, nobody left
    before it in the draw, takes the stripe from the origin."""
    plan = _plan()
    lost = plan.home[RELAYS[3]]
    root, children = _drawn(plan, lost)
    first, second = children[:2]
    run = _lost_root_run(second, lost, _withheld_by(first, lost))
    assert run.asked(lost, run.now) == {first}
    start = run.past_the_stall()
    assert run.asked(lost, start + CONFIG.stall_timeout_s) == {ORIGIN}
    assert first in run.asked(_home(plan, first), start + CONFIG.stall_timeout_s)


def _slow_root_run(me: str, stripe: int) -> tuple[_Run, int]:
    """`me`'s run while `stripe`'s lone root delivers every chunk in `SLOW_S`, up to its drop as
    slow: the run and how many fetches came before the drop."""
    root = _plan().ranked_interior(stripe)[0][0]
    run = _Run(me, lambda f, s: SLOW_S if f.peer == root else FAST_S)
    while root not in run.dropped:
        run.step()
        assert run.now < 10.0, "the slow root was never dropped"
    return run, run.marks[root]


def test_the_children_of_a_lone_root_dropped_as_slow_take_its_stripe_from_one_stand_in():
    """Every child of a root that delivers too little drops it as slow: the first child in the
    draw asks the origin, every other child asks that child. Before, each of the 6 asked the
    origin (6 copies of the stripe from a capped origin)."""
    plan = _plan()
    stripe = plan.home[RELAYS[3]]
    root, children = _drawn(plan, stripe)
    asked = {}
    for me in children:
        run, mark = _slow_root_run(me, stripe)
        asked[me] = run.asked(stripe, 0.0, mark)
    assert asked == {me: {ORIGIN} if me == children[0] else {children[0]} for me in children}


def test_a_stand_in_that_delivers_the_lost_stripe_too_little_is_passed_over_there_in_turn():
    """The root is dropped as slow and the stand-in (first child) forwards its stripe as slowly
    (it kept the slow root, or forwards slowly): the third child passes the stand-in over in
    that stripe once it timed 3 of its chunks there, and asks the second child, while the
    stand-in serves its own stripe fast and stays our parent there. Judged per peer, its own
    stripe's chunks kept its rate high and the lost stripe came at the slow pace."""
    plan = _plan()
    stripe = plan.home[RELAYS[3]]
    root, children = _drawn(plan, stripe)
    first, second, third = children[:3]
    run, mark = _slow_root_run(third, stripe)
    assert run.asked(stripe, 0.0, mark) == {first}
    run.answer = lambda f, s: SLOW_S if f.peer == root or (f.peer == first and s == stripe) else FAST_S
    at = run.now
    while run.now < at + 10.0 and second not in run.asked(stripe, at):
        run.step()
    assert second in run.asked(stripe, at), "the slow stand-in was never passed over"
    again = next(t for t, f in run.fetches if f.peer == second and plan.stripe_of_chunk[f.index] == stripe)
    assert run.asked(stripe, again) == {second}
    assert first in run.asked(_home(plan, first), again)
    assert first not in run.dropped


def test_passing_over_excludes_the_stand_in_for_exclude_s_in_the_withheld_stripe_alone():
    """Passing over is an exclusion of `exclude_s` in one stripe (as a stall's is of the whole
    source): the withholding stand-in's link alone is passed over, until `exclude_s` after the
    stall, and the stand-in stays usable."""
    plan = _plan()
    lost = plan.home[RELAYS[3]]
    root, children = _drawn(plan, lost)
    first, second, third = children[:3]
    run = _lost_root_run(third, lost, _withheld_by(first, lost))
    run.past_the_stall()
    v = run.core._versions[1]
    assert v.passed == {(first, lost): v.passed[(first, lost)]}
    assert v.passed[(first, lost)] - run.now > CONFIG.exclude_s - CONFIG.stall_timeout_s
    assert run.core._usable(run.now, first)


def test_a_stand_in_withholding_its_own_stripe_is_passed_over_there_as_a_lost_root():
    """The reverse: the stand-in of a lost stripe serves that stripe and withholds its own, where
    it is the lone root: it is passed over in its own stripe alone, as a lost root, whose stripe
    we then take from its first child in the draw that ranks before us (the lost root aside),
    while we still take the stripe it stands in for from it."""
    plan = _plan()
    lost = plan.home[RELAYS[3]]
    root, children = _drawn(plan, lost)
    stand_in = children[0]
    own = _home(plan, stand_in)
    _, theirs = _drawn(plan, own)
    me = [p for p in theirs if p != root][-1]
    want = next(p for p in theirs if p != root)
    run = _lost_root_run(me, lost, _withheld_by(stand_in, own))
    start = run.past_the_stall()
    assert run.asked(own, start + CONFIG.stall_timeout_s) == {want}
    assert run.asked(lost, start + CONFIG.stall_timeout_s) == {stand_in}
    assert run.dropped == []


def _first_child_withholding_past_the_stall():
    """The third child of a lost root whose first child (its stand-in) withholds the lost stripe,
    run until past the stall timeout: the plan, the lost stripe, its root, the stand-in, the run."""
    plan = _plan()
    lost = plan.home[RELAYS[3]]
    root, children = _drawn(plan, lost)
    first, third = children[0], children[2]
    run = _lost_root_run(third, lost, _withheld_by(first, lost))
    run.past_the_stall()
    return plan, lost, root, first, run


def test_a_replan_forgets_whom_we_passed_over_in_the_old_plan_s_stripes():
    """Passing over and a stand-in's delivery are kept per stripe of the plan: a replan (a member
    left) numbers the stripes afresh, and a stand-in passed over in the old plan's stripe is not
    passed over in whatever the new plan numbers so."""
    plan, lost, root, first, run = _first_child_withholding_past_the_stall()
    v = run.core._versions[1]
    assert (first, lost) in v.passed
    run.take(run.core.set_members(run.now, Membership.of({ORIGIN: 3e6, **dict.fromkeys(set(RELAYS) - {root}, 1e9)})))
    assert v.plan is not plan and v.passed == {} and v.link_rates == {}


def test_passing_over_is_told_as_a_pass_over_in_that_stripe_not_as_a_drop():
    """Passing a source over in one stripe is not a drop (it stays our source in the others, its
    connection open): the core tells it as `SourcePassedOver`, naming the stripe, and never as
    `SourceDropped`, which the simulator's reports count as sources dropped (`sources_dropped`).
    Before, a pass-over was told as `SourceDropped` and counted among them."""
    plan, lost, root, first, run = _first_child_withholding_past_the_stall()
    assert SourcePassedOver(first, 1, lost, DropReason.STALLED) in run.events
    assert [e.peer for e in run.events if isinstance(e, SourceDropped)] == [root]  # the lost root alone


def test_a_withholding_lost_root_is_passed_over_in_its_stripe_while_another_chunk_has_failed_sources():
    """The mirror case (above) while some chunk of the version has a failed source (`tried`: its
    requests then go through `relay.requests`' `_choose_source`, not the first-usable shortcut):
    here a chunk of the lost stripe the stand-in said it did not have, which the next child in the
    draw then holds on to. The stand-in, passed over in its own stripe, is not asked for it again
    there: that stripe goes to its first child in the draw."""
    plan = _plan()
    lost = plan.home[RELAYS[3]]
    root, children = _drawn(plan, lost)
    stand_in, second = children[0], children[1]
    own = _home(plan, stand_in)
    _, theirs = _drawn(plan, own)
    me = [p for p in theirs if p in children[2:]][-1]
    want = next(p for p in theirs if p != root)
    run = _lost_root_run(me, lost, lambda f, s: None if f.peer == stand_in and s == own else FAST_S)
    run.step()
    stuck = next(f for f in run.pending if f.peer == stand_in and plan.stripe_of_chunk[f.index] == lost)
    run.pending.remove(stuck)
    run.take(run.core.fetch_failed(run.now, stand_in, 1, stuck.index, FetchFailure.UNAVAILABLE))
    answer = run.answer
    run.answer = lambda f, s: None if f.peer == second and f.index == stuck.index else answer(f, s)
    start = run.now
    while run.now < start + CONFIG.stall_timeout_s:
        run.step()
    v = run.core._versions[1]
    assert v.tried == {stuck.index: {stand_in}} and (stand_in, own) in v.passed
    assert run.asked(own, start + STEP_S) == {want}
    assert stand_in in run.asked(lost, start + STEP_S)
    assert stand_in not in run.dropped


def _upstream_run(me: str, lost: int, stand_in: str, upstream_s: float) -> _Run:
    """`me`'s run once `lost`'s lone root was found unreachable, where `stand_in` (honest) waits on
    its own source of the lost stripe (the origin, capped and busy): each of its chunks there comes
    `upstream_s` after we ask; its own stripe comes at once."""
    asked_at: dict[int, float] = {}

    def answer(f: Fetch, stripe: int):
        if f.peer != stand_in or stripe != lost:
            return FAST_S
        at = asked_at.setdefault(f.index, run.now - STEP_S)
        return upstream_s if run.now - at >= upstream_s else None

    run = _lost_root_run(me, lost, answer)
    return run


def test_an_honest_stand_in_whose_upstream_is_slower_than_ours_but_not_slow_is_kept():
    """An honest stand-in that waits on its own upstream for the lost stripe (the origin, busy),
    each of its chunks there coming 2 steps after we ask (over half the stripe's planned rate,
    so not slow: `relay.judging`, `_short_as_stand_in`; one under half of it is passed over as
    slow, above), is never passed over: its link is never idle, and its clock moves on each
    completion, so nobody else is asked for the stripe (the origin not at all)."""
    plan = _plan()
    lost = plan.home[RELAYS[3]]
    root, children = _drawn(plan, lost)
    first, second = children[0], children[1]
    run = _upstream_run(second, lost, first, 2 * STEP_S)
    start = run.now
    while run.now < start + 4 * CONFIG.stall_timeout_s:
        run.step()
    assert run.asked(lost, start) == {first}
    assert run.core._versions[1].passed == {} and run.dropped == []


def test_an_honest_stand_in_whose_upstream_stalls_is_passed_over_as_a_parent_would_be_dropped():
    """An honest stand-in whose own upstream delivers nothing of the lost stripe for longer than
    `stall_timeout_s` is passed over there, as a parent that serves us in one stripe alone is
    dropped as stalled when its upstream stalls (the per-source rule, unchanged): the second child
    in the draw then asks the origin (one more copy of what remains of the stripe), and the third
    asks the second, not the origin, so the origin's extra copies are one per lost stripe, not one
    per child. Before per-(source, stripe) stalls, both waited on the stand-in (its own stripe
    kept its clock moving)."""
    plan = _plan()
    lost = plan.home[RELAYS[3]]
    root, children = _drawn(plan, lost)
    first, second, third = children[0], children[1], children[2]
    for me, then in ((second, ORIGIN), (third, second)):
        run = _upstream_run(me, lost, first, 2 * CONFIG.stall_timeout_s)
        start = run.past_the_stall()
        assert run.asked(lost, start + CONFIG.stall_timeout_s) == {then}, me
        assert first in run.asked(_home(plan, first), start + CONFIG.stall_timeout_s), me
        assert run.dropped == [], me


def test_the_origin_our_only_source_left_for_a_stripe_is_never_passed_over_when_it_stalls_there():
    """The second child of a killed lone root passes the withholding stand-in over and, nobody
    left before it in the draw, takes the lost stripe from the origin, which also feeds it its own
    home stripe (it is that stripe's root). The origin's upload is saturated: its first chunks
    of the lost stripe come only two steps past the stall timeout after we asked, then at the
    usual pace. It is never passed over there (nobody else holds every chunk, and here nobody
    else is left to ask): the stripe waits on it and the version completes from it, well before
    `exclude_s`. Passed over like any source, it left the stripe with nobody to ask until the
    stand-in's exclusion ended (`exclude_s`, 60 s)."""
    plan = _plan()
    lost = plan.home[RELAYS[3]]
    root, children = _drawn(plan, lost)
    first, second = children[:2]
    asked_at: dict[int, float] = {}
    busy_until: list[float] = []

    def answer(f: Fetch, stripe: int):
        if f.peer == first and stripe == lost:
            return None
        if f.peer != ORIGIN or stripe != lost:
            return FAST_S
        at = asked_at.setdefault(f.index, run.now - STEP_S)
        if not busy_until:
            busy_until.append(at + CONFIG.stall_timeout_s + 2 * STEP_S)  # its queue when we first asked
        return FAST_S if run.now >= busy_until[0] else None

    run = _lost_root_run(second, lost, answer)
    run.past_the_stall()  # the stand-in is passed over: the origin is asked
    assert run.asked(lost, run.now - STEP_S) == {ORIGIN}
    v = run.core._versions[1]
    while not v.complete and run.now < CONFIG.exclude_s / 2:
        run.step()
    assert v.complete
    assert not [e for e in run.events if isinstance(e, SourcePassedOver) and e.peer == ORIGIN]
    assert ORIGIN not in run.dropped
