"""Other holders of a version we asked for, asked when the ask fails (`relay.manifest_asks`,
`_remember_other`, `_ask_another`, `manifest_failed`): the core alone, in virtual time. Through
the relay role and a real serving peer: `tests/relay/test_role_manifest_asks.py`."""

from __future__ import annotations

from dataclasses import replace

import blake3
import pytest

from p2pnet.core import SetTimer
from relay.manifest_asks import MAX_ASKS_AFTER_FAILURES, MAX_DECLINED, MAX_MANIFEST_ASKS, MAX_OTHER_HOLDERS, SETTLE_S
from relay.effects import FetchFailure, FetchManifest, Penalise
from relay.failures import MAX_BANNED
from relay.manifest import sign_manifest
from relay.messages import HeldVersion, Holding, ManifestAnnounce
from relay.transfer import TransferConfig, TransferCore
from simulations.broadcast import fake_manifest
from simulations.world import EPOCH_S
from tests.relay.test_transfer import MALLORY, PUBLISHER, SIGNED, envelope, opener

CONFIG = TransferConfig(exclude_s=60.0, announce_interval_s=3600.0)  # the role's figures (`manifest_retry_s` 5 s)


def _core(members: tuple[str, ...] = ()) -> TransferCore:
    c = TransferCore(CONFIG, "me", open_frame=opener, self_upload_bps=1e8)
    c.set_members(-SETTLE_S, {PUBLISHER.peer_id: 1e9, "me": 1e8, **{m: 1e9 for m in members}})  # (settled at 0 s)
    return c


def _asked(effects: list) -> list[str]:
    return [e.peer for e in effects if isinstance(e, FetchManifest)]


def asks(c: TransferCore, now: float, sender: str, version: int = 1) -> list[str]:
    return _asked(c.on_message(now, envelope(sender, Holding((HeldVersion(version, SIGNED.manifest_id),)))))


def failed(c: TransferCore, now: float, peer: str, why: FetchFailure, version: int = 1) -> list[str]:
    return _asked(c.manifest_failed(now, peer, version, why))


def test_each_failed_ask_asks_the_next_holder_that_named_the_version_a_member_first():
    """Holders that named the version while a member's ask was in flight are asked one at a time,
    each as the ask before it fails, for any reason, members first; a report of an ask no longer
    in flight asks nothing. Before, a failed ask was made again only after `no_address` or
    `not_admitted`, of the same holder, and the others waited for their next `Holding`."""
    c = _core(("m0", "m1", "m2"))
    assert asks(c, 0.0, "m0") == ["m0"]
    assert [asks(c, t, s) for t, s in ((1.0, "s1"), (2.0, "s2"), (3.0, "m1"))] == [[], [], []]  # remembered
    assert failed(c, 4.0, "m0", FetchFailure.UNREACHABLE) == ["m1"]  # the member first, named last
    assert failed(c, 4.0, "m0", FetchFailure.UNREACHABLE) == []  # (no longer the ask in flight)
    assert failed(c, 5.0, "m1", FetchFailure.UNAVAILABLE) == ["s1"]  # then strangers, first named first
    assert failed(c, 5.1, "s1", FetchFailure.CORRUPT) == ["s2"]
    assert failed(c, 5.1, "s1", FetchFailure.CORRUPT) == []
    assert failed(c, 5.2, "s2", FetchFailure.UNREACHABLE) == []  # nobody left: each waits for its next `Holding`
    assert asks(c, 6.0, "m0") == []  # excluded: unreachable, as a source of chunks
    assert asks(c, 6.0, "m2") == ["m2"]  # a member's, at once: the ask failed (`_asks_instead`)
    c.on_message(6.5, envelope("m1", ManifestAnnounce(SIGNED.frame)))  # the manifest came: its asks go with it
    assert c.knows(1) and c._manifest_asked == {} and c._manifest_others == {}


def test_other_holders_are_bounded_per_version_and_members_take_strangers_places():
    """At most `MAX_OTHER_HOLDERS` other holders per version: strangers (anyone may send
    `Holding`, under any number of identities) only fill free room, and a member takes the place
    of the first stranger named, so strangers named first cannot keep a member from being asked
    next; members beyond the bound are not kept, nor a holder not usable when its turn comes."""
    n = MAX_OTHER_HOLDERS
    members = tuple(f"m{i}" for i in range(1, n + 4))
    c = _core(("m0", *members))
    assert asks(c, 0.0, "m0") == ["m0"]
    for i in range(n + 6):
        asks(c, 0.1 + i / 1000, f"s{i}")
    assert list(c._manifest_others[1].named) == [f"s{i}" for i in range(n)]
    asks(c, 1.0, "m1")
    asks(c, 1.1, "m2")
    assert list(c._manifest_others[1].named) == [*(f"s{i}" for i in range(2, n)), "m1", "m2"]
    for i, m in enumerate(members[2:]):
        asks(c, 2.0 + i / 1000, m)
    asks(c, 3.0, "s99")
    assert list(c._manifest_others[1].named) == list(members[:n])
    c.fetch_failed(3.5, "m2", 1, 0, FetchFailure.UNREACHABLE)  # (excluded `exclude_s`, as a source of chunks)
    order, peer, t = [], "m0", 4.0
    for _ in range(2 * n):  # (bounded: a holder asked again and again must fail the test, not hang it)
        nxt = failed(c, t, peer, FetchFailure.UNREACHABLE)
        if not nxt:
            break
        order += nxt
        peer, t = nxt[0], t + 1.3  # (within `_spend`'s bound: 4 asks per 5 s)
    within = int(CONFIG.exclude_s / 1.3) - 1  # (asks made while m2 is excluded)
    assert order[:within] == ["m1", *members[2:within + 1]]  # m2 excluded when its turn came
    assert sorted(order) == sorted(members[:n])  # (m2 once no longer excluded) none beyond the bound, no stranger, none twice


def _flood(identities: int, members: bool, why: FetchFailure, until_s: float = 60.0) -> tuple[int, int, TransferCore]:
    """`identities` peers (members or strangers) each send a `Holding` for version 1 every second,
    in turn; every ask fails for `why` 0.01 s after it is made. Returns the asks made, the most in
    flight at once, and the core."""
    names = [f"p{i:03d}" for i in range(identities)]
    c = _core(tuple(names) if members else ())
    made, in_flight, most = 0, [], 0
    due: list[tuple[float, str]] = []

    def carry(now: float, effects: list) -> None:
        nonlocal made, most
        for peer in _asked(effects):
            made += 1
            in_flight.append(peer)
            most = max(most, len(in_flight))
            due.append((now + 0.01, peer))

    step = 1.0 / identities
    for k in range(int(until_s / step)):
        now = k * step
        for at, peer in sorted(d for d in due if d[0] <= now):
            due.remove((at, peer))
            in_flight.remove(peer)
            carry(at, c.manifest_failed(at, peer, 1, why))
        carry(now, c.on_timer(now, "relay/tick") if c._tick_at is not None and c._tick_at <= now else [])
        carry(now, c.on_message(now, envelope(names[k % identities], Holding((HeldVersion(1, SIGNED.manifest_id),)))))
    return made, most, c


@pytest.mark.parametrize("members, why", [(False, FetchFailure.UNREACHABLE), (True, FetchFailure.UNREACHABLE),
                                           (True, FetchFailure.UNAVAILABLE)])
def test_holders_naming_a_version_under_many_identities_get_a_few_asks_per_retry_period(members, why):
    """100 identities name one version every second each, and every ask of them fails at once
    (unreachable, or it answers that it does not hold it: each excludes it): one ask at a
    time, and at most `MAX_ASKS_AFTER_FAILURES` made because an ask failed per `manifest_retry_s`
    (`_spend`: of a remembered holder, or a member's `Holding` at once), besides the one a
    `Holding` may make per `manifest_retry_s` (before: that one alone, 12 in 60 s); without the
    bound, members that fail at once would have an ask made of each `Holding` (6,000 in 60 s).
    What is remembered per version stays bounded."""
    made, most, c = _flood(100, members=members, why=why)
    windows = 60.0 / CONFIG.manifest_retry_s
    assert most == 1
    assert windows < made <= windows * (1 + MAX_ASKS_AFTER_FAILURES) + 1  # more than before: failures ask at once
    assert len(c._manifest_others[1].named) <= MAX_OTHER_HOLDERS


def test_other_holders_are_remembered_only_with_an_ask_and_go_with_it():
    """Other holders are kept only for a version asked for and go with its ask, so their memory
    is bounded by `MAX_MANIFEST_ASKS` versions as the asks are: a peer naming ever new versions
    and another naming them after it crowd out only the asks made of the first."""
    c = _core()
    for i in range(MAX_MANIFEST_ASKS // 16 + 16):
        body = Holding(tuple(HeldVersion(10_000 + 16 * i + j, bytes(32)) for j in range(16)))
        c.on_message(0.0, envelope("mallory", body))
        c.on_message(0.0, envelope("eve", body))
    assert len(c._manifest_asked) <= MAX_MANIFEST_ASKS
    assert set(c._manifest_others) <= set(c._manifest_asked)
    assert all(list(o.named) == ["eve"] for o in c._manifest_others.values())
    # (past the bound, eve's `Holding`s asked eve instead of remembering it: mallory's asks gave way)
    assert sum(a.peer == "eve" for a in c._manifest_asked.values()) > 0
    version = max(n for n, a in c._manifest_asked.items() if a.peer == "mallory")
    assert failed(c, 0.5, "mallory", FetchFailure.UNREACHABLE, version) == ["eve"]
    assert asks(c, CONFIG.manifest_retry_s, "holder") == ["holder"]  # a real holder's version is asked for


def test_a_version_forgotten_takes_its_put_off_ask_with_it():
    """A holder refused our ask as not admitted, and its ask was put off; the manifest came by
    gossip, and our store would not keep it (`refuse_manifest`, then `forget`): no ask of the
    version, nor a tick for one, is left. Before, the put-off ask stayed remembered (and kept a
    tick armed for it) after the version was forgotten."""
    c = _core(("holder",))
    assert asks(c, 0.0, "holder") == ["holder"]
    assert failed(c, 0.01, "holder", FetchFailure.NOT_ADMITTED) == []
    assert 1 in c._manifest_again
    c.on_message(0.5, envelope(PUBLISHER.peer_id, ManifestAnnounce(SIGNED.frame)))
    c.refuse_manifest(1, SIGNED.manifest_id)
    assert not c.knows(1)
    assert c._manifest_again == {} and c._manifest_asked == {} and c._manifest_others == {}
    effects = c.on_timer(2.01, "relay/tick")
    assert _asked(effects) == [] and not any(isinstance(e, SetTimer) for e in effects)


def test_a_holder_that_refused_is_asked_again_when_the_one_asked_instead_fails_too():
    """A member refuses our ask as not admitted (excluded `not_admitted_s`, to be asked again): a
    member that named the version is asked instead at once, and the refusing one remembered;
    when that ask fails too, the first is asked as its exclusion ends (as it would have been
    without the other), not left for its next `Holding`; while it is excluded nothing is asked."""
    c = _core(("m0", "m1"))
    assert asks(c, 0.0, "m0") == ["m0"]
    assert asks(c, 0.5, "m1") == []
    assert failed(c, 1.0, "m0", FetchFailure.NOT_ADMITTED) == ["m1"]
    assert failed(c, 1.5, "m1", FetchFailure.UNREACHABLE) == []  # m0 excluded until 3.0
    assert _asked(c.on_timer(2.0, "relay/tick")) == []
    assert c._manifest_again == {1: (1.0 + CONFIG.not_admitted_s, "m0")}
    assert _asked(c.on_timer(1.0 + CONFIG.not_admitted_s, "relay/tick")) == ["m0"]


def test_a_late_report_of_an_earlier_ask_of_the_same_holder_asks_nothing():
    """A holder asked, then asked again `manifest_retry_s` later (its `Holding` came again while
    the first ask was still in flight, as the shell allows up to `request_timeout_s`): the first
    ask's failure, reported late, is no failure of the ask in flight and asks no other holder;
    the second's is. Before, the report named only the holder, and the late one made the ask in
    flight count as failed: another holder was asked beside it."""
    c = _core(("m0", "m1"))
    holding = Holding((HeldVersion(1, SIGNED.manifest_id),))
    first = [e for e in c.on_message(0.0, envelope("m0", holding)) if isinstance(e, FetchManifest)]
    second = [e for e in c.on_message(CONFIG.manifest_retry_s, envelope("m0", holding)) if isinstance(e, FetchManifest)]
    assert [e.peer for e in first] == [e.peer for e in second] == ["m0"]  # (none other remembered to ask)
    assert asks(c, CONFIG.manifest_retry_s + 0.5, "m1") == []  # remembered
    late = c.manifest_failed(6.0, "m0", 1, FetchFailure.UNREACHABLE, first[0].asked_at)
    assert _asked(late) == [] and not c._manifest_asked[1].failed
    assert _asked(c.manifest_failed(7.0, "m0", 1, FetchFailure.UNREACHABLE, second[0].asked_at)) == ["m1"]


def test_holders_that_name_a_version_and_answer_they_have_not_got_it_cannot_keep_its_asks():
    """Members name a version, again and again, and answer our asks that they do not hold it:
    each is excluded (`exclude_s`) on its answer, so their `Holding`s ask no more and they keep
    no room among the other holders; an honest member that names it meanwhile is remembered, and
    asked on its next `Holding`. Before, nothing was held against them: once the bound on asks
    after failures was spent, the honest member's `Holding` was not kept (the room was theirs),
    and their next `Holding` asked them again (as a core-alone run showed, 8 such members kept
    an honest one naming the version every 30 s from being asked for 600 s)."""
    liars = tuple(f"l{i}" for i in range(MAX_ASKS_AFTER_FAILURES + 1))
    c = _core((*liars, "h"))
    assert asks(c, 0.0, "l0") == ["l0"]
    assert [asks(c, 0.1 * i, liar) for i, liar in enumerate(liars[1:], 1)] == [[]] * MAX_ASKS_AFTER_FAILURES
    order, peer = [], "l0"
    while nxt := failed(c, 0.5, peer, FetchFailure.UNAVAILABLE):
        order += nxt
        peer = nxt[0]
    assert order == list(liars[1:])
    assert [asks(c, 1.0 + 0.1 * i, liar) for i, liar in enumerate(liars)] == [[]] * len(liars)
    assert asks(c, 2.0, "h") == []  # the bound on asks after failures is spent: remembered, its ask put off
    assert "h" in c._manifest_others[1].named
    assert _asked(c.on_timer(0.5 + CONFIG.manifest_retry_s, "relay/tick")) == ["h"]  # as the bound allows one


def test_holders_that_name_a_version_again_and_again_cannot_jump_the_line_of_those_remembered():
    """20 members name a version every second and answer each ask that they do not hold it; an
    honest member names it once, at 0.5 s, and would next at 30.5 s. Asks after failures are
    still at most `MAX_ASKS_AFTER_FAILURES` per `manifest_retry_s`, but they go to the holders
    remembered in the order they named the version, and one put off by the bound is made as the
    bound allows (`_ask_another`), so the honest member is asked within a few periods, before its
    next `Holding`, and before every liar was. Before, once the liars spent the bound, the
    honest member waited for its next `Holding` (30.5 s), each liar being asked first."""
    liars = [f"l{i:02d}" for i in range(20)]
    c = _core((*liars, "h"))
    holding = Holding((HeldVersion(1, SIGNED.manifest_id),))
    events = [(k + i / 20, liar) for k in range(30) for i, liar in enumerate(liars)] + [(0.5, "h")]
    asked: list[tuple[float, str]] = []
    due: list[tuple[float, str]] = []
    now = 0.0
    while (events or due) and not any(p == "h" for _, p in asked):
        tick = c._tick_at if c._tick_at is not None else float("inf")
        now = min(min(events)[0] if events else tick, min(due)[0] if due else tick, tick)
        if due and min(due)[0] == now:
            _, peer = min(due)
            due.remove((now, peer))
            effects = c.manifest_failed(now, peer, 1, FetchFailure.UNAVAILABLE)
        elif events and min(events)[0] == now:
            _, sender = min(events)
            events.remove((now, sender))
            effects = c.on_message(now, envelope(sender, holding))
        else:
            effects = c.on_timer(now, "relay/tick")
        for peer in _asked(effects):
            asked.append((now, peer))
            due.append((now + 0.01, peer))
    assert asked[-1][1] == "h" and asked[-1][0] < 30.5
    assert set(liars) - {p for _, p in asked}  # not every liar was asked first
    windows = asked[-1][0] / CONFIG.manifest_retry_s
    assert len(asked) <= (1 + MAX_ASKS_AFTER_FAILURES) * (windows + 1)


def test_a_holder_whose_manifest_answer_is_broken_is_banned_and_penalised():
    """A broken answer to a manifest ask (the shell's `corrupt`: it broke the protocol on a
    connection that proved its id) bans and penalises its sender, as a chunk that does not
    verify does; it is asked for nothing more. Before, nothing was held against it."""
    c = _core(("m0",))
    assert asks(c, 0.0, "m0") == ["m0"]
    effects = c.manifest_failed(0.5, "m0", 1, FetchFailure.CORRUPT)
    assert [e.peer for e in effects if isinstance(e, Penalise)] == ["m0"]
    assert asks(c, 10.0, "m0") == [] and asks(c, 10.0, "m0", version=2) == []


@pytest.mark.parametrize("answer", [SIGNED.frame, b"not a manifest"], ids=["another-version", "garbage"])
def test_an_answer_that_gives_no_manifest_of_the_version_asked_is_a_broken_one(answer):
    """A holder answers our ask for version 2 with a signed manifest of version 1 (a real one:
    anyone can replay it) or with bytes that do not open: the answer is broken (`corrupt`): its
    holder is banned and penalised, and another that named the version is asked at once. Before,
    the ask stayed in flight with no verdict: no other holder was asked, and the liar's next
    `Holding` `manifest_retry_s` later was asked again."""
    c = _core(("m0", "m1"))
    assert asks(c, 0.0, "m0", version=2) == ["m0"]
    assert asks(c, 1.0, "m1", version=2) == []
    effects = c.manifest_answer(1.5, "m0", 2, answer, 0.0)
    assert _asked(effects) == ["m1"]
    assert [e.peer for e in effects if isinstance(e, Penalise)] == ["m0"]
    assert asks(c, 10.0, "m0", version=2) == []


def _sound_manifest_we_will_not_take(kind: str) -> bytes:
    """A manifest of version 2 that opens for its holder but not for us: signed by a publisher we
    do not trust (MALLORY), or by ours and stamped an hour past our clock (the holder's is ahead)."""
    if kind == "untrusted":
        return fake_manifest(MALLORY, 2**20, 2**20, version=2).frame
    return sign_manifest(PUBLISHER, fake_manifest(PUBLISHER, 2**20, 2**20, version=2).manifest, EPOCH_S + 3600).frame


@pytest.mark.parametrize("kind", ["untrusted", "stamped-ahead"])
def test_a_sound_manifest_we_will_not_take_fails_its_ask_and_blames_nobody(kind):
    """A holder answers our ask for version 2 with a real signed manifest of version 2 that our
    trust or clock will not take, though its holder's took it: the ask fails and another holder
    that named the version is asked at once, and the holder is neither banned, penalised nor
    excluded (it is still asked for another version); the same answer again, no longer to the ask
    in flight, asks nothing. One of an untrusted publisher is remembered: a `Holding` naming it
    asks for it no more. Before, such an answer banned its honest holder."""
    frame = _sound_manifest_we_will_not_take(kind)
    c = _core(("m0", "m1", "m2"))
    assert asks(c, 0.0, "m0", version=2) == ["m0"]
    assert asks(c, 1.0, "m1", version=2) == [] and asks(c, 1.2, "m2", version=2) == []
    effects = c.manifest_answer(1.5, "m0", 2, frame, 0.0)
    assert _asked(effects) == ["m1"]
    assert _asked(c.manifest_answer(1.6, "m0", 2, frame, 0.0)) == []  # (m1's ask is in flight)
    assert [e for e in effects if isinstance(e, Penalise)] == []
    assert "m0" not in c._banned and c._excluded.get("m0", 0.0) <= 1.5
    assert asks(c, 10.0, "m0", version=3) == ["m0"]
    named = envelope("s3", Holding((HeldVersion(2, blake3.blake3(frame).digest()),)))
    assert _asked(c.on_message(20.0, named)) == ([] if kind == "untrusted" else ["m2"])  # (m1's ask unanswered)


def test_bans_are_bounded_and_a_flood_of_identities_unbans_a_liar_only_after_as_many_bans():
    """A holder answers our manifest ask with garbage and is banned; then ever new identities
    each serve garbage once (a chunk that does not verify, or a broken manifest answer): the bans
    remembered stay at `MAX_BANNED`, the first banned forgotten first, so the liar is banned
    until `MAX_BANNED` others were banned after it. Before, each identity added a ban for ever."""
    c = _core(("liar",))
    assert asks(c, 0.0, "liar") == ["liar"]
    c.manifest_failed(0.5, "liar", 1, FetchFailure.CORRUPT)
    for i in range(MAX_BANNED - 1):
        c.fetch_failed(1.0, f"x{i:05d}", 1, 0, FetchFailure.CORRUPT)
    assert len(c._banned) == MAX_BANNED and "liar" in c._banned
    assert asks(c, 10.0, "liar", version=2) == []
    for i in range(MAX_BANNED - 1, 2 * MAX_BANNED):
        c.fetch_failed(2.0, f"x{i:05d}", 1, 0, FetchFailure.CORRUPT)
    assert len(c._banned) == MAX_BANNED and "liar" not in c._banned
    assert c._banned == {f"x{i:05d}" for i in range(MAX_BANNED, 2 * MAX_BANNED)}


def test_strangers_that_fail_at_once_cannot_spend_the_asks_a_member_named_since_is_asked_in():
    """Strangers name a version and fail each ask at once: those made because one failed are
    asked of them, while no member is remembered, but one of the `MAX_ASKS_AFTER_FAILURES` per
    `manifest_retry_s` is kept for a member, so an honest member naming the version then is asked
    at once. Before, the strangers spent the bound, and the member's ask was put off until it
    allowed one (`manifest_retry_s`; 5.02 s against 0.51 s in a core-alone run of 100 such)."""
    strangers = [f"s{i}" for i in range(MAX_ASKS_AFTER_FAILURES + 2)]
    c = _core(("h",))
    assert asks(c, 0.0, strangers[0]) == [strangers[0]]
    assert [asks(c, 0.01 * i, s) for i, s in enumerate(strangers[1:], 1)] == [[]] * (len(strangers) - 1)
    order, peer = [], strangers[0]
    while nxt := failed(c, 0.1, peer, FetchFailure.UNAVAILABLE):
        order += nxt
        peer = nxt[0]
    assert order == strangers[1:MAX_ASKS_AFTER_FAILURES]  # one kept for a member
    assert asks(c, 0.5, "h") == ["h"]


def test_a_holding_after_the_retry_period_asks_the_first_holder_remembered_not_its_sender():
    """The ask of a version failed with no other holder to ask; strangers name it since, s1 first
    (a stranger's `Holding` after a failure only joins those remembered). `manifest_retry_s`
    after the last ask, s2 names it again: the first remembered, s1, is asked, not s2. Before,
    the `Holding` asked its sender, so one that names the version again and again was asked
    each period ahead of a holder that named it once."""
    c = _core()
    assert asks(c, 0.0, "s0") == ["s0"]
    assert failed(c, 0.1, "s0", FetchFailure.UNREACHABLE) == []  # none other named it
    assert asks(c, 1.0, "s1") == []
    assert asks(c, 2.0, "s2") == []
    assert asks(c, CONFIG.manifest_retry_s + 0.5, "s2") == ["s1"]


def test_holders_that_answer_with_a_status_we_do_not_know_cannot_keep_an_honest_member_out():
    """`MAX_OTHER_HOLDERS` + 1 members name a version, answer each ask with a status we do not
    know (`manifest_declined`: neither excluded nor banned) and name it again at once; an honest
    member names it once, at 1 s. A holder that declined an ask of a version counts, for it, as
    excluded for `exclude_s` (as "not held" would exclude it), so the honest member is
    remembered and asked once each liar was, once, and a liar is asked again only after
    `exclude_s`. Before, each liar joined the holders remembered again at once, which it kept
    full of members: the honest member was not remembered, and liars were asked for ever."""
    liars = [f"l{i:02d}" for i in range(MAX_OTHER_HOLDERS + 1)]
    c = _core((*liars, "h"))
    assert asks(c, 0.0, liars[0]) == [liars[0]]
    assert [asks(c, 0.01 * i, liar) for i, liar in enumerate(liars[1:], 1)] == [[]] * MAX_OTHER_HOLDERS
    nxt = _asked(c.manifest_declined(0.5, liars[0], 1))
    assert asks(c, 0.5, liars[0]) == []  # it names the version again at once
    assert asks(c, 1.0, "h") == []  # the one asked is a member, its ask in flight: remembered
    order, now = [], 1.5
    while nxt and nxt[0] != "h" and now < 10.0 * MAX_OTHER_HOLDERS:
        order.append(nxt[0])
        nxt = _asked(c.manifest_declined(now, nxt[0], 1))
        asks(c, now, order[-1])
        if not nxt:  # put off by `_spend`'s bound: made as it allows
            now += CONFIG.manifest_retry_s
            nxt = _asked(c.on_timer(now, "relay/tick"))
        now += 0.1
    assert nxt == ["h"]
    assert order == liars[1:]
    assert list(c._manifest_others[1].declined) == liars
    assert asks(c, now + CONFIG.manifest_retry_s, liars[-1]) == []
    # as "not held" would exclude them; h's ask unanswered: the one that declined longest ago first
    assert asks(c, now + CONFIG.exclude_s, liars[-1]) == [liars[1]]


def test_the_holders_that_declined_an_ask_are_remembered_per_version_the_first_forgotten_first():
    """Holders that decline an ask of a version (`manifest_declined`) are not asked for it for
    `exclude_s`, the last `MAX_DECLINED` of them (anyone may decline under any number of
    identities): one forgotten names it and is asked again, `manifest_retry_s` after the last ask."""
    peers = [f"s{i:02d}" for i in range(MAX_DECLINED + 2)]
    c = TransferCore(replace(CONFIG, exclude_s=3600.0), "me", open_frame=opener, self_upload_bps=1e8)
    for i, peer in enumerate(peers):
        assert asks(c, 10.0 * i, peer) == [peer]
        c.manifest_declined(10.0 * i + 1.0, peer, 1)
    assert list(c._manifest_others[1].declined) == peers[2:]
    assert asks(c, 10.0 * len(peers), peers[-1]) == []
    assert asks(c, 10.0 * len(peers), peers[0]) == [peers[0]]


def test_a_holder_whose_ask_failed_with_no_verdict_is_not_asked_again_for_naming_the_version_at_once():
    """m0 answers a sound manifest we will not take (stamped past our clock: no verdict on it, it
    stays usable) and names the version again and again: nothing is asked (its `Holding` within
    `manifest_retry_s` of its failed ask does not make it a holder remembered: `_after_failure`)
    until `manifest_retry_s` after the last ask, as before the failure; else each `Holding` of a
    holder whose answer we cannot take would ask it again, within `_spend`'s bound."""
    frame = _sound_manifest_we_will_not_take("stamped-ahead")
    c = _core(("m0",))
    assert asks(c, 0.0, "m0", version=2) == ["m0"]
    assert _asked(c.manifest_answer(0.5, "m0", 2, frame, 0.0)) == []
    assert [asks(c, 1.0 + i, "m0", version=2) for i in range(3)] == [[]] * 3
    assert asks(c, CONFIG.manifest_retry_s, "m0", version=2) == ["m0"]
