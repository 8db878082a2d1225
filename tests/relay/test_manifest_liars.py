"""Manifest asks under many liar identities (`relay.manifest_asks`: `_rank`, `_ask_when_usable`,
`_after_failure`): the core alone, in virtual time. The other holders of a version asked for, and
their bounds: `tests/relay/test_manifest_holders.py`."""

from __future__ import annotations

import heapq
import itertools
import math

import pytest

from relay.effects import FetchFailure
from relay.manifest_answers import MAX_FAILED_ASKS
from relay.manifest_asks import MAX_ASKS_AFTER_FAILURES, MAX_OTHER_HOLDERS
from relay.messages import HeldVersion, Holding
from relay.transfer import TransferCore
from tests.relay.test_manifest_holders import CONFIG, _asked, _core, asks, failed
from tests.relay.test_transfer import SIGNED, envelope

HOLDING = Holding((HeldVersion(1, SIGNED.manifest_id),))


def _liars_and_an_honest_member(liars: list[str], first_at: float, until_s: float,
                                flood: float = 0.0, h_refuses: int = 0, liars_decline: bool = False,
                                h_joins_at: float = 0.0, core: TransferCore | None = None) -> list[tuple[float, str]]:
    """The liars (members) name version 1 every second, in turn, and answer each ask that they do
    not hold it (with `liars_decline`, with a status we do not know: `manifest_declined`, nobody's
    fault), 0.01 s after it; an honest member h names it first at `first_at`, then every 30 s; it
    joins our membership at `h_joins_at` (0: a member before the version was first asked for).
    With `flood`, fresh liar identities (members too, "f00000" on: each joins our membership,
    its heartbeat come, just before its first `Holding`) come besides, `flood` per second from
    1 s, each naming the version every second from its first `Holding`.
    h refuses its first `h_refuses` asks as not admitted (it had not heard our heartbeat: nobody's
    fault), 0.01 s after each. Returns what happened until h is asked and does not refuse, or until
    `until_s`: the asks, (when, of whom), and h's `Holding`s, (when, "h named"). With `core`, that
    core, with its membership as it is."""
    fresh = [f"f{i:05d}" for i in range(int(flood * until_s))]
    c = core if core is not None else _core((*liars, "h") if h_joins_at == 0.0 else tuple(liars))
    uploads = dict(c._members.uploads)
    queue: list[tuple[float, int, str, str]] = []
    order = itertools.count()

    def push(at: float, what: str, peer: str) -> None:
        heapq.heappush(queue, (at, next(order), what, peer))

    log: list[tuple[float, str]] = []
    for i, liar in enumerate(liars):
        push(i / len(liars), "holding", liar)
    for i, liar in enumerate(fresh):
        push(1.0 + i / flood, "holding", liar)
    push(first_at, "holding", "h")
    if h_joins_at:
        push(h_joins_at, "join", "h")
    ticks: set[float] = set()
    while queue:
        now, _, what, peer = heapq.heappop(queue)
        if now > until_s:
            break
        if what == "join" or (what == "holding" and peer not in uploads):  # (a fresh one's heartbeat came just before)
            uploads[peer] = 1e9
            effects = c.set_members(now, uploads)
        if what == "join":
            pass
        elif what == "holding":
            effects = c.on_message(now, envelope(peer, HOLDING))
            push(now + (30.0 if peer == "h" else 1.0), "holding", peer)
            if peer == "h":
                log.append((now, "h named"))
        elif what == "failed" and liars_decline:
            effects = c.manifest_declined(now, peer, 1)
        elif what in ("failed", "refused"):
            why = FetchFailure.UNAVAILABLE if what == "failed" else FetchFailure.NOT_ADMITTED
            effects = c.manifest_failed(now, peer, 1, why)
        else:
            effects = c.on_timer(now, "relay/tick")
        for asked in _asked(effects):
            log.append((now, asked))
            if asked == "h" and h_refuses == 0:
                return log
            h_refuses -= asked == "h"
            push(now + 0.01, "refused" if asked == "h" else "failed", asked)
        if c._tick_at is not None and c._tick_at not in ticks:
            ticks.add(c._tick_at)
            push(c._tick_at, "tick", "")
    return log


@pytest.mark.parametrize("first_at", [1.5, 7.3])
def test_an_honest_member_is_asked_once_each_of_many_liar_identities_failed_once(first_at):
    """1.5 times `MAX_OTHER_HOLDERS` members name a version every second, all in the first, and
    answer each ask that they do not hold it; an honest member names it every 30 s, first at
    `first_at`, when the holders remembered are full of liars not asked yet. Holders are ranked by
    when an ask of them last failed (`_rank`): a liar that failed takes a place, and is asked, only
    after those that have not, so the honest member is remembered at its first `Holding` once
    fewer liars than the places remain unasked, and asked once each liar was, before any is asked
    again. Before stop 49, the liars not yet asked kept the places full (each freed place taken by
    the next liar's `Holding`, within the second), and with their exclusions (`exclude_s`, 60 s)
    ending as new ones were asked the honest member was never asked in 600 s (with 16 places and
    100 liars: 481 asks of liars); it was asked (at 80 s) only if it first named the version at
    0.5 s."""
    liars = [f"l{i:03d}" for i in range(3 * MAX_OTHER_HOLDERS // 2)]
    log = _liars_and_an_honest_member(liars, first_at, until_s=600.0)
    assert log[-1][1] == "h"
    asked = [p for _, p in log[:-1] if p != "h named"]
    assert sorted(asked) == liars  # each liar was asked once before the honest member, none twice
    last_named = max(i for i, (_, what) in enumerate(log) if what == "h named")
    assert len([p for _, p in log[last_named + 1:-1]]) < MAX_OTHER_HOLDERS  # asked soon after its last `Holding`


def test_a_holder_remembered_that_declined_is_asked_as_its_exclusion_for_the_version_ends():
    """m0 declines our ask (a status we do not know: `manifest_declined`, so, for this version,
    as if excluded for `exclude_s`), and is the only holder: it names the version again after
    `manifest_retry_s` and is remembered, and asked as that exclusion ends, on the tick; so it is
    when a stranger that named the version since was asked, and declined too. Before, nothing
    was asked then: the exclusion's end was looked for among the holders excluded from us
    (`_excluded`), and a holder's `manifest_declined` asked no one later; m0 waited for a
    `Holding` after the exclusion, the stranger's for a `Holding` after its own."""
    until = 0.5 + CONFIG.exclude_s
    for stranger in (False, True):
        c = _core(("m0",))
        assert asks(c, 0.0, "m0") == ["m0"]
        assert _asked(c.manifest_declined(0.5, "m0", 1)) == []
        assert asks(c, CONFIG.manifest_retry_s + 1.0, "m0") == []  # remembered, excluded for the version
        if stranger:
            assert asks(c, CONFIG.manifest_retry_s + 2.0, "s1") == ["s1"]  # (`manifest_retry_s` after the last ask)
            assert _asked(c.manifest_declined(CONFIG.manifest_retry_s + 2.5, "s1", 1)) == []
        assert c._tick_at is not None and c._tick_at <= until
        assert _asked(c.on_timer(until - 0.1, "relay/tick")) == []
        assert _asked(c.on_timer(until, "relay/tick")) == ["m0"]


def test_a_stranger_that_names_a_version_after_its_ask_failed_is_asked_when_a_holding_would_ask_it():
    """The ask of a version failed with no other holder remembered; a stranger names it 0.9 s
    later: it is only remembered (a stranger's `Holding` asks at most once per `manifest_retry_s`
    per version, failure or not), and asked `manifest_retry_s` after the last ask, on the tick,
    as its `Holding` would have been then. Before, it waited for a `Holding` of the version after
    that, its own next one maybe an announce interval away (and nobody's, never)."""
    c = _core()
    assert asks(c, 0.0, "s0") == ["s0"]
    assert failed(c, 0.1, "s0", FetchFailure.UNREACHABLE) == []
    assert asks(c, 1.0, "s1") == []
    assert c._tick_at == CONFIG.manifest_retry_s
    assert _asked(c.on_timer(CONFIG.manifest_retry_s, "relay/tick")) == ["s1"]


def test_a_holder_that_never_answers_is_passed_over_at_the_next_retry_for_one_remembered():
    """A liar member names the version every second and never answers our ask (its failure,
    `unreachable` after the role's 10 s, comes after the next `Holding` has asked again, so it is
    a late report); an honest member names it at 1.5 s and is remembered. The ask unanswered for
    `manifest_retry_s` counts as failed (`_rank`): the liar's `Holding` then asks the first
    remembered, the honest member, not the liar again; and the liar's late report asks nothing.
    Before, each liar `Holding` `manifest_retry_s` after the last ask asked the liar again, its
    late reports gave no verdict, and the honest member was never asked (in 600 s; 1, 8 or 100
    such liars alike)."""
    c = _core(("l", "h"))
    assert asks(c, 0.0, "l") == ["l"]
    assert asks(c, 1.0, "l") == []
    assert asks(c, 1.5, "h") == []  # remembered
    assert [asks(c, float(t), "l") for t in (2, 3, 4)] == [[], [], []]
    assert asks(c, CONFIG.manifest_retry_s, "l") == ["h"]
    assert _asked(c.manifest_failed(10.0, "l", 1, FetchFailure.UNREACHABLE, asked_at=0.0)) == []


def test_the_peers_whose_asks_failed_are_remembered_at_most_max_failed_asks_the_first_failed_forgotten_first():
    """When each peer's manifest ask last failed (`_rank`) is remembered for the last
    `MAX_FAILED_ASKS` peers (any number of identities may fail asks), one failing again counting
    as the last: past the bound the peer whose last failure is the oldest is forgotten, and ranks
    as one never failed."""
    c = _core()
    peers = ["p0", "p1", *(f"x{i:05d}" for i in range(MAX_FAILED_ASKS - 1))]
    c._manifest_excused.update(dict.fromkeys(peers, 0))  # each had its one failure excused, for version 0 (`_failed`)
    for i, peer in enumerate(peers[:2]):
        assert asks(c, float(i), peer, version=10 + i) == [peer]
        c.manifest_declined(i + 0.5, peer, 10 + i)
    assert asks(c, 2.0, "p0", version=12) == ["p0"]
    c.manifest_declined(2.5, "p0", 12)  # p0 failed again: now the last
    for i, peer in enumerate(peers[2:], 3):
        assert asks(c, float(i), peer, version=10 + i) == [peer]
        c.manifest_declined(i + 0.5, peer, 10 + i)
    assert len(c._manifest_failed_at) == MAX_FAILED_ASKS
    assert c._rank("p0") == 2.5 and c._rank("p1") == -math.inf


def test_a_holder_takes_the_place_of_the_one_of_its_kind_that_failed_last_if_later_never_a_strangers_a_members():
    """The holders remembered are full of members whose asks (of other versions) failed: a member
    that never failed takes the place of the one that failed last, one that failed later than all
    takes none; a stranger that never failed takes none (anyone may send `Holding` under any
    number of identities: strangers never keep a member out)."""
    members = [f"m{i:02d}" for i in range(MAX_OTHER_HOLDERS)]
    c = _core(("a", "new", "late", *members))
    c._manifest_excused.update(dict.fromkeys(("late", *members), 0))  # each had its one failure excused (`_failed`)
    assert asks(c, 19.0, "late", version=99) == ["late"]
    c.manifest_declined(19.5, "late", 99)  # after all the members' failures
    for i, member in enumerate(members):  # each declines an ask of its own version: failed, still usable for 1
        assert asks(c, i / 10, member, version=1000 + i) == [member]
        c.manifest_declined(i / 10 + 0.05, member, 1000 + i)
    assert asks(c, 20.0, "a") == ["a"]
    assert [asks(c, 20.1, member) for member in members] == [[]] * MAX_OTHER_HOLDERS
    assert asks(c, 20.2, "s") == []
    assert list(c._manifest_others[1].named) == members  # the stranger took no member's place
    assert asks(c, 20.25, "late") == []
    assert list(c._manifest_others[1].named) == members  # nor the member that failed last of all
    assert asks(c, 20.3, "new") == []
    assert list(c._manifest_others[1].named) == [*members[:-1], "new"]  # the member failed last gave way


def test_fresh_liar_identities_coming_faster_than_asks_are_made_cannot_keep_an_honest_member_out():
    """120 members (`MAX_OTHER_HOLDERS` less 8; 7.5 times stop 49's 16) name a version in the first
    second, and fresh identities (members) come besides, 2 per second from 1 s, faster than asks are made
    (`_spend`: 4 per 5 s); each names it every second and answers each ask that it does not hold
    it. An honest member names it every 30 s from 1.25 s, when those named before it fit in the
    holders remembered (`MAX_OTHER_HOLDERS`): it is remembered then, and no identity that named
    the version after it, ranked as never failed like it but remembered after it, is asked
    before it; nor can one push it out (a newcomer takes only an excluded holder's place, or that
    of one whose ask failed later than its own). Before (16 places), the places were full of
    liars not asked yet when it first named the version, each freed place was taken by the next
    fresh identity within the second, and it was never asked in 300 s (241 asks of liars)."""
    liars = [f"l{i:03d}" for i in range(120)]
    assert len(liars) < MAX_OTHER_HOLDERS
    log = _liars_and_an_honest_member(liars, first_at=1.25, until_s=300.0, flood=2.0)
    assert log[-1][1] == "h"
    asked = [p for _, p in log[:-1] if p != "h named"]
    named_before = {*liars, "f00000"}  # (f00000 named it at 1.0 s)
    assert set(asked) <= named_before and len(asked) == len(set(asked))


def test_a_member_refused_once_through_nobodys_fault_is_asked_again_before_fresh_identities_that_never_failed():
    """60 members name a version every second, the first at 0 s, and answer each ask that they do
    not hold it; fresh identities (members) come besides, 2 per second from 1 s, faster than asks
    are made (`_spend`: 4 per 5 s). An honest member names it at 0.005 s, is asked once the first
    liar failed, and refuses as not admitted (it had not heard our heartbeat: nobody's fault; it
    is excluded for `not_admitted_s`, then asked again). That failure is excused (`_failed`): it
    keeps its rank, and stands in line for the version as a member that joined since, from when
    it is remembered again (`_settled`): it is asked again once each liar settled before the version
    was, and before any fresh identity. Before stop 51, it ranked as failed then, behind every
    identity that never failed, and with fresh ones coming faster than asks it was never asked
    again (300 s); with the excuse alone (hE's eae2eb8..65d9aca), at 5 s, ahead of the settled
    liars, which could then fail so once each and be asked twice (see the next test)."""
    liars = [f"l{i:03d}" for i in range(60)]
    log = _liars_and_an_honest_member(liars, first_at=0.005, until_s=300.0, flood=2.0, h_refuses=1)
    asks_of = [p for _, p in log if p != "h named"]
    assert asks_of[:2] == ["l000", "h"]  # asked, and refused as not admitted
    assert asks_of[-1] == "h"
    assert sorted(asks_of[2:-1]) == liars[1:]  # each other liar once, no fresh identity, then h


def test_settled_liars_failing_through_nobodys_fault_are_not_asked_twice_before_a_member_that_joined_since():
    """100 members name a version every second, all in the first, and decline each ask (a status
    we do not know: nobody's fault, so excused once, `_failed`); an honest member joins our
    membership at 0.4 s, after the version was first asked for (as after our own restart, when
    its heartbeat came after the liars' and their first `Holding`), and names it every 30 s from
    0.5 s. No liar is asked twice before the honest member: a liar whose failure was excused stands
    in line as one that joined since (`_settled`), from its next `Holding`, after the honest member.
    With the excuse and the settled order alone (hE's 65d9aca), the excused liars ranked as never
    failed and settled, ahead of the honest member, and each was asked twice before it (245 s; at
    2d8c0d7, with neither, 60 s: the declines were ranked failures, and no member was settled; now
    120 s, after each settled liar, as the honest member joined since)."""
    liars = [f"l{i:03d}" for i in range(100)]
    log = _liars_and_an_honest_member(liars, first_at=0.5, until_s=600.0, liars_decline=True, h_joins_at=0.4)
    assert log[-1][1] == "h"
    asked = [p for _, p in log[:-1] if p != "h named"]
    assert set(asked) <= set(liars) and len(asked) == len(set(asked))  # none twice


def test_more_liars_than_places_naming_first_and_fresh_ones_cannot_keep_a_settled_member_out():
    """`MAX_OTHER_HOLDERS` + 72 members name a version in its first second, fresh identities join
    our membership and name it besides, 1 per second from 1 s, faster than places are freed (asks:
    4 per 5 s); each names it every second and answers each ask that it does not hold it. An honest
    member, a member since before the version was first asked for, names it every 30 s from 1.5 s.
    Those in line are ranked, after when their asks last failed, members settled before the
    version was first asked for before those that joined since (`_order`): the honest member takes
    a newcomer's place and is asked once each of those settled that named it before it was, and
    no newcomer before it. Before, the places were full of liars not asked yet, each freed place
    taken by the next fresh identity within the second, and it was never asked in 600 s."""
    liars = [f"l{i:03d}" for i in range(MAX_OTHER_HOLDERS + 72)]
    log = _liars_and_an_honest_member(liars, first_at=1.5, until_s=600.0, flood=1.0)
    assert log[-1][1] == "h"
    asked = [p for _, p in log[:-1] if p != "h named"]
    assert sorted(asked) == liars  # each settled liar once, no newcomer


def test_a_holders_one_excused_failure_is_restored_by_a_manifest_it_answers_and_remembered_for_the_last_peers():
    """A failure nobody's fault (here a status we do not know, `manifest_declined`) is excused once
    per holder (`_failed`): it is not ranked; the next one is, unless a manifest the holder answered
    was taken in between, which gives its excuse back. The excuses are remembered for the last
    `MAX_FAILED_ASKS` peers (any number of identities may fail so), the first excused forgotten
    first."""
    c = _core(("m0",))
    assert asks(c, 0.0, "m0", version=5) == ["m0"]
    c.manifest_declined(0.5, "m0", 5)
    assert c._rank("m0") == -math.inf  # excused
    assert asks(c, 1.0, "m0") == ["m0"]
    c.manifest_answer(1.5, "m0", 1, SIGNED.frame, 1.0)
    assert 1 in c._versions  # taken: its excuse is back
    assert asks(c, 2.0, "m0", version=6) == ["m0"]
    c.manifest_declined(2.5, "m0", 6)
    assert c._rank("m0") == -math.inf  # excused again
    assert asks(c, 3.0, "m0", version=7) == ["m0"]
    c.manifest_declined(3.5, "m0", 7)
    assert c._rank("m0") == 3.5  # the second in a row is ranked
    peers = [f"x{i:05d}" for i in range(MAX_FAILED_ASKS + 1)]
    for i, peer in enumerate(peers, 4):
        assert asks(c, float(i), peer, version=10 + i) == [peer]
        c.manifest_declined(i + 0.5, peer, 10 + i)
    assert len(c._manifest_excused) == MAX_FAILED_ASKS and peers[0] not in c._manifest_excused
    assert all(c._rank(peer) == -math.inf for peer in peers)


def test_a_member_that_left_our_membership_and_came_back_stands_in_line_as_one_that_joined_since():
    """Settled (`_settled`) means a member since before the version was first asked for, without a
    break: one that left our membership (`set_members`: its heartbeats expired) and came back is
    one that joined since, as anyone may make up an identity that joins."""
    c = _core(("m0", "m1"))
    assert asks(c, 0.0, "m1") == ["m1"]  # version 1 first asked for at 0 s
    assert c._settled(1, "m0")
    uploads = dict(c._members.uploads)
    del uploads["m0"]
    c.set_members(1.0, uploads)
    uploads["m0"] = 1e9
    c.set_members(2.0, uploads)
    assert not c._settled(1, "m0") and c._settled(1, "m1")
