"""DiLoCo's membership decision: the pure `Membership` core (whom a join waits for, who leads,
the members a round takes when flooded with Joins) and the role's `_decide` on a mock clock
(leader timeouts, whose Members and NoRoom are taken). Moved out of test_diloco_core.py, unchanged."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import trio
import trio.testing

import trainer.diloco_role as diloco_role
from trainer.allreduce import Membership
from trainer.diloco_decide import _Behind
from trainer.diloco_inbox import RoundInbox
from trainer.diloco_links import PeerFailed, Received
from trainer.diloco_messages import MAX_MEMBERS, Join, Members, NoRoom
from trainer.diloco_role import DilocoRole


def test_membership_waits_for_expected_peers_and_drops_a_drifted_one():
    same, other = b"a" * 16, b"b" * 16
    m = Membership("peer0", 2, same, now=0.0, deadline_s=10.0)
    m.expect({"peer1", "peer2", "peer3"})
    m.receive("peer1", Join(2, same, ("peer0", "peer4")))  # peer1 knows of peer4, which we have not heard of
    m.receive("peer2", Join(1, same, ()))  # an older round does not count
    assert m.decided(1.0) is None
    m.receive("peer2", Join(2, other, ()))
    m.receive("peer3", Join(2, same, ()))
    assert m.decided(1.0) is None  # still waiting for peer4
    m.receive("peer4", Join(2, same, ()))
    assert m.decided(1.0) == (("peer0", "peer1", "peer3", "peer4"), same)
    late = Membership("peer0", 2, same, now=0.0, deadline_s=10.0)
    late.expect({"peer1", "peer2"}, excluded={"peer2"})  # peer2 failed us: not waited for
    assert late.decided(9.9) is None and late.decided(10.0) == (("peer0",), same)


def test_the_leader_is_one_every_member_agrees_on_and_a_peer_only_others_name_leads_once_it_joined():
    d = b"a" * 16
    # ids in this order: j (a joiner) < p (its state's source) < q. Only p waits for j on its own account.
    at_p = Membership("p", 5, d, now=0.0, deadline_s=10.0)
    at_q = Membership("q", 5, d, now=0.0, deadline_s=10.0)
    assert at_p.leader({"j", "q"}, {"j", "q"}, set()) == "j"  # p waits for j on its own account
    assert at_q.leader({"p"}, {"p"}, set()) == "p"
    at_q.receive("p", Join(5, d, ("j", "q")))  # q now waits for j too (named), but j has not joined at q
    assert at_q.leader({"p"}, {"p", "j"}, set()) == "p"
    at_q.receive("j", Join(5, d, ("p", "q")))
    assert at_q.leader({"p"}, {"p", "j"}, set()) == "j"  # j's Join reached q: both now follow j
    assert at_q.leader({"p"}, {"p", "j"}, {"j"}) == "p"  # taken for dead: the next one leads
    # a Join from a peer we do not know as a trainer (not invited) does not make it lead
    stranger = Membership("q", 5, d, now=0.0, deadline_s=10.0)
    stranger.receive("a", Join(5, d, ()))
    assert stranger.leader({"p"}, {"p"}, set()) == "p"


def test_a_leader_flooded_with_joins_decides_at_most_max_members_and_keeps_its_groups_members():
    """In an open group identities cost nothing: 300 fresh ones Join the round we lead, on our
    weights, each naming as many peers as a Join may. The round still decides (a Members of more
    than `MAX_MEMBERS` cannot be built: the role crashed there), with every member of the last
    round (`keep`) among the members whether its Join came before the strangers' or after them,
    and what the Membership holds stays bounded: the Joins it took and the peers they name."""
    rng = random.Random(43)
    same = b"a" * 16
    group = ["g0", "g1", "g2", "g3"]  # the last round's members; g0 leads
    strangers = [f"s{i:03d}" for i in range(300)]
    names = tuple(f"n{i:03d}" for i in range(MAX_MEMBERS))
    for early in (0, 1, 3):  # how many of the group's Joins come before every stranger's
        m = Membership("g0", 7, same, now=0.0, deadline_s=10.0, keep=group)
        m.expect(set(group[1:]))
        order = [(p, Join(7, same, ())) for p in group[1:1 + early]]
        order += [(p, Join(7, same, names)) for p in strangers]
        late = [(p, Join(7, same, ())) for p in group[1 + early:]]
        order[len(order) // 2:len(order) // 2] = late[:1]  # one in the middle of the flood
        order += late[1:]
        taken = [m.receive(p, j) for p, j in order]
        assert len(m.joins) == MAX_MEMBERS and not all(taken)  # full: the last strangers turned away
        assert m.decided(9.9) is None  # the names the strangers sent are waited for, until the deadline
        members, reference = m.decided(10.0)
        assert reference == same and set(group) <= set(members) and len(members) == MAX_MEMBERS
        Members(7, reference, members)  # what the leader sends: within the message's bound
        assert len(m.names) < MAX_MEMBERS and m.told == set(names)
    # a Join sent again by a peer held keeps its place; a stranger's never evicts another
    m = Membership("g0", 7, same, now=0.0, deadline_s=10.0, keep=group)
    for p in strangers[:MAX_MEMBERS - 1]:
        assert m.receive(p, Join(7, same, ()))
    assert m.receive(strangers[0], Join(7, b"b" * 16, ())) and not m.receive(strangers[-1], Join(7, same, ()))
    assert m.receive("g3", Join(7, same, ())) and strangers[MAX_MEMBERS - 2] not in m.joins  # the last come goes
    # however Joins interleave, the group's members are in and the strangers first come hold the rest
    for _ in range(20):
        order = group[1:] + strangers
        rng.shuffle(order)
        m = Membership("g0", 7, same, now=0.0, deadline_s=10.0, keep=group)
        for p in order:
            m.receive(p, Join(7, same, ()))
        first = [p for p in order if p not in group][:MAX_MEMBERS - len(group)]
        assert set(m.joins) == set(group) | set(first)
    with pytest.raises(ValueError, match="at most"):  # the caller's: no round holds them
        Membership("g0", 7, same, now=0.0, deadline_s=10.0, keep=strangers[:MAX_MEMBERS])


def _own_digest(peer: str) -> bytes:
    """Weights of a stranger's own: no two the same, so the strangers outvote no one."""
    return peer.encode().ljust(16, b".")


def _leader_as_the_shell_sees_it(m: Membership, own: set[str], trainers: set[str], suspects: set[str]) -> str:
    """What `DilocoRole._decide` computes at each event: whom it invites (its own peers, and the
    trainer peers of its table that the Joins name or sent), then the leader among them."""
    invited = own | (m.named & trainers)
    m.expect(invited, suspects)
    return m.leader(own, invited, suspects)


def test_two_members_flooded_with_joins_in_other_orders_pick_the_same_leader():
    """300 identities, more than a round holds, Join the round of two members of the last round,
    g1 and g2, all of them trainer peers of both tables (a heartbeat claims the role at no cost)
    and all with lower ids. Each member holds the Joins that came to it first: g1 got them in one
    order, g2 in the other, so each holds strangers the other turned away. The leader is picked
    from the senders whose Joins reached a member, held or turned away, so both pick the same
    one (before, g1 took the lowest it held and g2 the lowest it held: two leaders, and with
    both deciding, two Members lists, the round's members split between them), then the same
    next one as each is taken for dead, and, with every stranger dead, g1. What a member keeps
    of the Joins it turned away stays within its table's trainer peers."""
    same = b"a" * 16
    group = {"g1", "g2"}
    strangers = [f"e{i:03d}" for i in range(300)]  # 'e' < 'g': every stranger has a lower id
    trainers = group | set(strangers)
    at: dict[str, Membership] = {}
    for me, order in (("g1", strangers), ("g2", strangers[::-1])):
        m = at[me] = Membership(me, 7, same, now=0.0, deadline_s=10.0, keep=group)
        for p in order:
            m.receive(p, Join(7, _own_digest(p), ()), trainers)
        (other,) = group - {me}
        assert m.receive(other, Join(7, same, tuple(sorted(group))), trainers)  # replaces a stranger
        assert len(m.joins) == MAX_MEMBERS
    assert set(at["g1"].joins) != set(at["g2"].joins)  # each holds strangers the other turned away
    assert "e000" in at["g1"].joins and "e000" not in at["g2"].joins
    own = {"g1": {"g2"}, "g2": {"g1"}}
    suspects: set[str] = set()
    for dead in strangers:
        leaders = {me: _leader_as_the_shell_sees_it(m, own[me], trainers, suspects) for me, m in at.items()}
        assert leaders == {"g1": dead, "g2": dead}
        suspects.add(dead)  # it never sends Members: each member takes it for dead in turn
    assert {me: _leader_as_the_shell_sees_it(m, own[me], trainers, suspects) for me, m in at.items()} == {
        "g1": "g1", "g2": "g1"}
    # strangers that no table lists as trainer peers lead nowhere, and are not kept
    m = Membership("g1", 7, same, now=0.0, deadline_s=10.0, keep=group)
    for p in strangers:
        m.receive(p, Join(7, _own_digest(p), ()), group)
    assert m.refused == set() and _leader_as_the_shell_sees_it(m, {"g2"}, group, set()) == "g1"


def test_a_leader_does_not_wait_for_a_trainer_peer_whose_join_it_turned_away():
    """The leader g1 waits for g2 and for a newcomer, n, that fetched the state from it (both on
    its own account). 300 trainer peers' Joins fill the places a round has before n's comes: n's
    is turned away (n sits the round out). Once g2 joined the round is decided, not at the join
    deadline (before, the leader waited for n's Join, which it had already turned away, until
    then), and n still counts for the leader choice (its id is higher: g1 leads)."""
    same = b"a" * 16
    group = {"g1", "g2"}
    strangers = [f"s{i:03d}" for i in range(300)]
    trainers = group | set(strangers) | {"n"}
    m = Membership("g1", 7, same, now=0.0, deadline_s=10.0, keep=group)
    own = {"g2", "n"}
    for p in strangers:
        m.receive(p, Join(7, _own_digest(p), ()), trainers)
    assert _leader_as_the_shell_sees_it(m, own, trainers, set()) == "g1" and m.decided(1.0) is None  # g2's to come
    assert not m.receive("n", Join(7, same, ("g1", "g2")), trainers)
    assert m.receive("g2", Join(7, same, ("g1", "n")), trainers)
    assert _leader_as_the_shell_sees_it(m, own, trainers, set()) == "g1"
    members, reference = m.decided(1.0)
    assert reference == same and members == ("g1", "g2") and "n" in m.refused


DEADLINE_S, DIGEST = 10.0, b"w" * 16


FIRST, SECOND, ME = "a_first", "b_second", "c_me"


def _decide(script, trainers=(FIRST, SECOND), within_s=math.inf, sent=None, reserved=(), sent_to=None,
            kept=(), heard=None) -> dict:
    """Run the role's real `_decide` for round 1 at ME (`trainers` known as trainers: FIRST <
    SECOND < ME) on a mock clock, failing past `within_s`; `script` is [(time, event)] put in its
    inbox, and what it sends goes into `sent` (and, with whom to, `sent_to`); `reserved`: the last
    round's members (`_reserve`); `kept`: [(sender, Join)] of round 1 read during the last round's
    all-reduce (`_keep_join`); `heard`: not our first round (a round of ours behind us), these
    peers heard from (`heard`: whom we wait for on our own account).
    What it returned (or whom it sits the round out for), whom it suspects, and when."""
    class Links:
        async def send(self, peer, body, *, report_refusal=True, report=True):
            if sent is not None:
                sent.append(body)
            if sent_to is not None:
                sent_to.append((peer, body))
            return True

    out = {}

    async def main():
        role = DilocoRole.__new__(DilocoRole)
        entries = [SimpleNamespace(peer_id=p, data_addr="127.0.0.1:1") for p in trainers]
        role.node = SimpleNamespace(peer_id=ME, peertable=SimpleNamespace(
            with_role=lambda name: entries, is_banned=lambda peer, now: False))
        role.config = SimpleNamespace(deadline_s=DEADLINE_S, trainers=())
        role.inbox = RoundInbox()
        role.inbox.reserve(reserved)
        role.suspects, role.heard, role.early_parts, role.history = set(), set(), [], []
        if heard is not None:
            role.heard, role.history = set(heard), [{"round": 0}]
        role.joins = {1: dict(kept)} if kept else {}
        role.turned_away = {}

        async def world():
            for at, event in script:
                await trio.sleep_until(at)
                await (role.inbox.report(event) if isinstance(event, PeerFailed) else role.inbox.put(event))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(world)
            with trio.fail_after(within_s):
                try:
                    out["members"] = await role._decide(1, DIGEST, Links(), nursery)
                except _Behind as behind:  # it sits the round out (`out["behind"]`: whom it was told by)
                    out["behind"], out["past"] = behind.peer, behind.past
            out["suspects"] = set(role.suspects)
            out["t"] = trio.current_time()
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return out


def test_a_leader_that_takes_over_late_in_a_round_gets_its_own_time_to_decide():
    """The lowest id fails us near the end of the leader timeout (our Join to it broke): the next
    one leads. It is not suspected at its predecessor's deadline, a moment later, before its
    Members can arrive: it gets the leader timeout of its own."""
    out = _decide([(0.1, Received(SECOND, Join(1, DIGEST, (FIRST, ME)))),
                   (1.9 * DEADLINE_S, PeerFailed(FIRST)),  # the first leader is gone
                   (2.0 * DEADLINE_S + 1.0, Received(SECOND, Members(1, DIGEST, (SECOND, ME))))])
    assert (out["members"], out["suspects"]) == ((SECOND, ME), {FIRST})


def test_a_leader_that_comes_back_gets_no_new_time():
    """A leader that failed us and speaks again leads again, but with the time it had: once per
    peer and round, else one that comes and goes without deciding would hold the round."""
    out = _decide([(0.1, Received(SECOND, Join(1, DIGEST, (FIRST, ME)))),
                   (1.0 * DEADLINE_S, PeerFailed(FIRST)),  # SECOND leads, until 3 x deadline
                   (1.5 * DEADLINE_S, Received(FIRST, Join(1, DIGEST, (SECOND, ME)))),  # FIRST is back, leads
                   (3.3 * DEADLINE_S, Received(SECOND, Members(1, DIGEST, (SECOND, ME))))])
    assert out["suspects"] == {FIRST}  # suspected at 3 x deadline, not given until 3.5 x
    assert out["t"] == pytest.approx(3.3 * DEADLINE_S)


def test_a_strangers_members_are_not_taken_and_the_round_goes_on_with_the_leaders():
    """In an open group, before our leader (FIRST, the lowest id) decides, two others send us
    Members of our round naming us on our weights: a trainer peer of our table that does not lead
    (a heartbeat costs nothing) and an identity with a lower id than any, in no table. Neither is
    taken (before, the first made it and itself the round's members, and the peers we keep places
    for next): the round's members are the leader's."""
    stranger, outsider = "b_stranger", "0_outsider"  # FIRST < stranger < ME; outsider lowest, not a trainer
    out = _decide([(0.1, Received(SECOND, Join(1, DIGEST, (FIRST, ME)))),
                   (0.2, Received(stranger, Members(1, DIGEST, (stranger, ME)))),
                   (0.3, Received(outsider, Members(1, DIGEST, (outsider, ME)))),
                   (0.5, Received(FIRST, Members(1, DIGEST, (FIRST, SECOND, ME))))],
                  trainers=(FIRST, SECOND, stranger))
    assert out["members"] == (FIRST, SECOND, ME) and out["t"] == pytest.approx(0.5)


THIRD = "d_third"  # a trainer peer with a higher id than ours: it never leads here


def test_members_from_a_peer_that_comes_to_lead_are_taken_once_it_leads():
    """SECOND took FIRST for dead before we did, decided and told us: not our leader then, its
    Members is kept, and taken as soon as FIRST fails us too (not at SECOND's leader timeout, nor
    lost: then we would lead alone). THIRD still names FIRST: not every peer we hear from gave up
    on it, so it is not passed over (`_passed_over`)."""
    out = _decide([(0.1, Received(SECOND, Join(1, DIGEST, (ME,)))),
                   (0.15, Received(THIRD, Join(1, DIGEST, (FIRST, ME)))),
                   (0.2, Received(SECOND, Members(1, DIGEST, (SECOND, ME)))),
                   (0.4 * DEADLINE_S, PeerFailed(FIRST))], trainers=(FIRST, SECOND, THIRD))
    assert (out["members"], out["suspects"]) == ((SECOND, ME), {FIRST})
    assert out["t"] == pytest.approx(0.4 * DEADLINE_S)


def test_members_from_a_peer_that_comes_to_lead_are_taken_at_our_leader_timeout():
    """The same in a fresh group (no round behind us, no peer we keep places for), FIRST silent (in
    our table, a newcomer still loading or a peer some took for dead: theirs may not hold it) and
    named by THIRD's Join: SECOND's Members is kept, and taken when FIRST's leader timeout takes
    it for dead (that is what not taking Members from any sender costs such a peer while another
    peer still waits for it); not lost, which would leave us leading alone, then sitting the
    round out."""
    out = _decide([(0.1, Received(SECOND, Join(1, DIGEST, (ME,)))),
                   (0.15, Received(THIRD, Join(1, DIGEST, (FIRST, ME)))),
                   (0.2, Received(SECOND, Members(1, DIGEST, (SECOND, ME))))], trainers=(FIRST, SECOND, THIRD))
    assert (out["members"], out["suspects"]) == ((SECOND, ME), {FIRST})
    assert out["t"] == pytest.approx(2 * DEADLINE_S)


def test_on_our_first_round_a_lower_id_every_peer_gave_up_on_holds_us_no_leader_timeout():
    """A joiner's first round (no round of ours behind us): our table still holds FIRST, which the
    group took for dead (its heartbeat not expired; it takes our Join and never answers). SECOND
    and THIRD, all the others we wait for, Join naming no FIRST, and SECOND, their leader, sends
    its Members: we pass FIRST over as leader (`_passed_over`) and take SECOND's Members as it
    comes, in the round with them. Before, we waited FIRST's leader timeout (2 x deadline) while
    they averaged without us. FIRST is not suspected (it would lead again once it speaks)."""
    script = [(0.1, Received(SECOND, Join(1, DIGEST, (ME, THIRD)))),
              (0.15, Received(THIRD, Join(1, DIGEST, (SECOND, ME)))),
              (0.2, Received(SECOND, Members(1, DIGEST, (SECOND, ME, THIRD))))]
    out = _decide(script, trainers=(FIRST, SECOND, THIRD), within_s=DEADLINE_S)
    assert (out["members"], out["suspects"]) == ((SECOND, ME, THIRD), set())
    assert out["t"] == pytest.approx(0.2)
    # the Members before the last Join we wait for: kept, and taken once THIRD's Join came
    out = _decide([script[0], (0.12, script[2][1]), script[1]], trainers=(FIRST, SECOND, THIRD), within_s=DEADLINE_S)
    assert out["members"] == (SECOND, ME, THIRD) and out["t"] == pytest.approx(0.15)


def test_a_lower_id_is_not_passed_over_while_a_peer_we_wait_for_still_names_it_or_has_not_joined():
    """What keeps an identity from leading us past a live peer (`_passed_over`): SECOND (any
    identity of our table, in an open group) Joins naming no FIRST and sends its Members at once.
    THIRD has not Joined yet: we wait for it; its Join names FIRST: FIRST is not passed over, and
    its Members is the one we take. What is left: with SECOND the only other peer we wait for,
    its word is enough on our first round (FIRST silent: a peer the group gave up on, or a
    one-trainer group's slow trainer; `test_an_identity_joining_us_beside_a_slow_lone_trainer_leads_our_first_round`);
    with no other peer's Join at all FIRST leads to its timeout. Not after our first round
    (`test_members_from_a_peer_that_comes_to_lead_after_our_first_round_are_taken_as_before`), nor
    once FIRST spoke to us this round (`test_a_lower_id_passed_over_that_speaks_to_us_leads_again`)."""
    out = _decide([(0.1, Received(SECOND, Join(1, DIGEST, (ME,)))),
                   (0.2, Received(SECOND, Members(1, DIGEST, (SECOND, ME)))),
                   (0.5, Received(THIRD, Join(1, DIGEST, (FIRST, ME)))),
                   (1.0, Received(FIRST, Members(1, DIGEST, (FIRST, ME, THIRD))))], trainers=(FIRST, SECOND, THIRD))
    assert (out["members"], out["t"]) == ((FIRST, ME, THIRD), pytest.approx(1.0))
    # no other peer's Join (a fresh group, FIRST and SECOND still loading): FIRST leads to its timeout
    out = _decide([(0.2, Received(SECOND, Members(1, DIGEST, (SECOND, ME))))])
    assert (out["members"], out["t"]) == ((SECOND, ME), pytest.approx(2 * DEADLINE_S))


def test_members_from_a_peer_that_comes_to_lead_after_our_first_round_are_taken_as_before():
    """The two tests above as they stood before `_passed_over`, THIRD left out, at a round that is
    not our first (we heard FIRST and SECOND: we wait for them on our own account): SECOND took
    FIRST for dead before we did and its Join names FIRST no more. No first-round rule: FIRST
    leads here until it fails us, or to its leader timeout, and SECOND's Members is kept and
    taken then (SECOND's word that FIRST is gone is not enough once we know the group)."""
    script = [(0.1, Received(SECOND, Join(1, DIGEST, (ME,)))),
              (0.2, Received(SECOND, Members(1, DIGEST, (SECOND, ME))))]
    out = _decide([*script, (0.4 * DEADLINE_S, PeerFailed(FIRST))], heard=(FIRST, SECOND))
    assert (out["members"], out["suspects"], out["t"]) == ((SECOND, ME), {FIRST}, pytest.approx(0.4 * DEADLINE_S))
    out = _decide(script, heard=(FIRST, SECOND))
    assert (out["members"], out["suspects"], out["t"]) == ((SECOND, ME), {FIRST}, pytest.approx(2 * DEADLINE_S))


def test_a_lower_id_passed_over_that_speaks_to_us_leads_again():
    """FIRST is passed over on our first round (SECOND, all we wait for, Joined naming no FIRST),
    then FIRST speaks to us before SECOND's Members comes: it leads here again. Its Members is
    taken (kept while we followed SECOND: not its leader then); its NoRoom makes us sit the round
    out; after its Join we wait for its Members, SECOND's not taken."""
    join = (0.1, Received(SECOND, Join(1, DIGEST, (ME,))))
    seconds = (0.2, Received(SECOND, Members(1, DIGEST, (SECOND, ME))))
    out = _decide([join, (0.15, Received(FIRST, Members(1, DIGEST, (FIRST, SECOND, ME)))), seconds],
                  within_s=DEADLINE_S)
    assert (out["members"], out["t"]) == ((FIRST, SECOND, ME), pytest.approx(0.15))
    out = _decide([join, (0.15, Received(FIRST, NoRoom(1))), seconds], within_s=DEADLINE_S)
    assert (out["behind"], out["past"], out["t"]) == (FIRST, 1, pytest.approx(0.15))
    out = _decide([join, (0.15, Received(FIRST, Join(1, DIGEST, (SECOND, ME)))), seconds,
                   (0.3, Received(FIRST, Members(1, DIGEST, (FIRST, SECOND, ME))))], within_s=DEADLINE_S)
    assert (out["members"], out["t"]) == ((FIRST, SECOND, ME), pytest.approx(0.3))


def test_passing_over_a_lower_id_we_lead_and_wait_for_it_as_a_member_to_the_join_deadline():
    """On our first round THIRD (a higher id than ours, a round behind it, FIRST taken for dead
    there) Joins naming no FIRST: FIRST is passed over and we lead, waiting for FIRST as a member
    to the join deadline (deadline_s; before, we followed FIRST to its leader timeout, 2 x
    deadline_s, then led), then decide without it, FIRST not suspected. If FIRST's Join reaches
    THIRD before that, THIRD follows FIRST and Joins us again naming it (the peers it invites
    changed): FIRST leads here again and we take its Members, as THIRD does. The race left: FIRST's
    Join reaches THIRD just before our join deadline and THIRD's Join naming it reaches us after
    we decided: THIRD follows FIRST (our Members is not its leader's) and our round is split from
    theirs, as a late lower id's Join splits the round of any leader deciding at its join deadline."""
    trainers, join = (FIRST, THIRD), (0.1, Received(THIRD, Join(1, DIGEST, (ME,))))
    sent_to: list = []
    out = _decide([join], trainers=trainers, sent_to=sent_to, within_s=2 * DEADLINE_S)
    assert (out["members"], out["suspects"], out["t"]) == ((ME, THIRD), set(), pytest.approx(DEADLINE_S))
    assert (THIRD, Members(1, DIGEST, (ME, THIRD))) in sent_to
    out = _decide([join, (0.5 * DEADLINE_S, Received(THIRD, Join(1, DIGEST, (FIRST, ME)))),
                   (0.6 * DEADLINE_S, Received(FIRST, Members(1, DIGEST, (FIRST, ME, THIRD))))], trainers=trainers)
    assert (out["members"], out["t"]) == ((FIRST, ME, THIRD), pytest.approx(0.6 * DEADLINE_S))


def test_an_identity_joining_us_beside_a_slow_lone_trainer_leads_our_first_round():
    """The residual `_passed_over` leaves (the module docstring): a one-trainer open group, FIRST,
    slow in its inner steps (alive: it takes our Join, and decides later), and SECOND, any
    identity of our table (a heartbeat costs nothing), which Joins us at once naming no FIRST and
    sends its Members. SECOND is the only other peer we wait for: FIRST is passed over and
    SECOND's Members taken as it comes; our first round is SECOND's and not the group's (FIRST's
    Members, later, is not read). An identity with an id above ours instead makes us lead, and
    decide with it at the join deadline unless FIRST Joins by then (the first case of
    `test_passing_over_a_lower_id_we_lead_and_wait_for_it_as_a_member_to_the_join_deadline`). Before, we followed FIRST,
    unless an identity had an id below FIRST's, which makes it lead here (and at every member
    its Join reaches) still: a few key generations, so this gives an attacker nothing it lacked."""
    out = _decide([(0.1, Received(SECOND, Join(1, DIGEST, (ME,)))),
                   (0.2, Received(SECOND, Members(1, DIGEST, (SECOND, ME)))),
                   (0.5, Received(FIRST, Members(1, DIGEST, (FIRST, ME))))])
    assert (out["members"], out["suspects"], out["t"]) == ((SECOND, ME), set(), pytest.approx(0.2))
    lower = "0_lower"  # below FIRST: it leads us with or without `_passed_over`
    out = _decide([(0.2, Received(lower, Members(1, DIGEST, (lower, ME))))], trainers=(lower, FIRST))
    assert (out["members"], out["t"]) == ((lower, ME), pytest.approx(0.2))


def test_a_lower_id_is_not_passed_over_once_we_turned_a_trainer_peers_join_away():
    """On our first round, strangers' Joins (no trainer peers: they lead nowhere) fill our round
    but for SECOND's, which names no FIRST; THIRD's Join comes when no room is left, and is turned
    away: whom it names we do not keep, so we cannot know that every peer we hear from gave up on
    FIRST. FIRST is not passed over: it leads to its timeout, then SECOND's Members is taken."""
    strangers = [f"e_stranger{i:03d}" for i in range(MAX_MEMBERS - 2)]
    script = [(0.01, Received(s, Join(1, DIGEST, ()))) for s in strangers]
    script += [(0.1, Received(SECOND, Join(1, DIGEST, (ME,)))),
               (0.12, Received(THIRD, Join(1, DIGEST, (FIRST, ME)))),
               (0.2, Received(SECOND, Members(1, DIGEST, (SECOND, ME))))]
    out = _decide(script, trainers=(FIRST, SECOND, THIRD))
    assert (out["members"], out["suspects"], out["t"]) == ((SECOND, ME), {FIRST}, pytest.approx(2 * DEADLINE_S))


def test_members_from_a_member_of_the_last_round_are_taken_at_once():
    """The same, SECOND a member of the last round we took part in (a peer we keep places for): its
    Members is taken as it comes, as before, though FIRST has not failed us yet (it took FIRST for
    dead first: waiting for our own leader timeout would leave it averaging without us)."""
    out = _decide([(0.1, Received(SECOND, Join(1, DIGEST, (ME,)))),
                   (0.2, Received(SECOND, Members(1, DIGEST, (SECOND, ME))))], reserved=(SECOND, ME))
    assert (out["members"], out["suspects"], out["t"]) == ((SECOND, ME), set(), pytest.approx(0.2))


def test_a_full_leader_tells_the_trainer_peers_it_turns_away_that_read_it():
    """We lead (our table's trainer peers have higher ids) and hold as many Joins as a round takes
    (strangers', on our weights) when two trainer peers of our table Join: both are turned away;
    the one whose Join says it reads a `NoRoom` is told, once though it Joins again before we
    decide (a third trainer peer never Joins: we wait for it to the join deadline) (before, no
    one was told: each waited out its leader timeout; and each Join sent again was told again, a
    send each, however often a trainer peer Joins); the other, an older peer (whose server would
    end the connection on a kind it does not know), is not."""
    strangers = [f"b_stranger{i:03d}" for i in range(MAX_MEMBERS - 1)]  # no trainers: they do not lead
    script = [(0.01, Received(s, Join(1, DIGEST, ()))) for s in strangers]
    script += [(0.1, Received("d_new", Join(1, DIGEST, (ME,), hears_no_room=True))),
               (0.2, Received("d_old", Join(1, DIGEST, (ME,)))),
               (0.3, Received("d_new", Join(1, DIGEST, (ME, "d_old"), hears_no_room=True))),
               (0.4, Received("d_new", Join(1, DIGEST, (ME,), hears_no_room=True)))]
    sent_to: list = []
    out = _decide(script, trainers=("d_new", "d_old", "e_silent"), sent_to=sent_to)
    assert out["members"] == tuple(sorted([*strangers, ME])) and out["t"] == pytest.approx(DEADLINE_S)
    assert [(peer, body) for peer, body in sent_to if isinstance(body, NoRoom)] == [("d_new", NoRoom(1))]


def test_a_kept_join_a_member_of_the_last_round_replaces_is_told():
    """The Joins of our round read during the last one's all-reduce filled its places, the last
    come a trainer peer's that reads a `NoRoom`; then a member of the last round Joins: its place
    is that trainer peer's, which is told (before, only a sender read during the join was told)."""
    member, strangers = "b_member", [f"b_stranger{i:03d}" for i in range(MAX_MEMBERS - 2)]
    kept = [(s, Join(1, DIGEST, ())) for s in strangers] + [("d_new", Join(1, DIGEST, (ME,), hears_no_room=True))]
    sent_to: list = []
    out = _decide([(0.1, Received(member, Join(1, DIGEST, (ME,))))], trainers=("d_new", "e_silent"),
                  reserved=(member,), kept=kept, sent_to=sent_to)
    assert out["members"] == tuple(sorted([*strangers, member, ME]))
    assert [(peer, body) for peer, body in sent_to if isinstance(body, NoRoom)] == [("d_new", NoRoom(1))]


def test_no_room_is_taken_from_our_leader_only():
    """A `NoRoom` from a peer that does not lead here (any identity can send one) is not taken: we
    wait on for our leader's Members. Our leader's makes us sit the round out at once."""
    out = _decide([(0.1, Received(SECOND, NoRoom(1))), (0.2, Received("0_outsider", NoRoom(1))),
                   (0.5, Received(FIRST, Members(1, DIGEST, (FIRST, SECOND, ME))))])
    assert out["members"] == (FIRST, SECOND, ME)
    out = _decide([(0.1, Received(FIRST, NoRoom(1)))])
    assert (out["behind"], out["suspects"], out["t"]) == (FIRST, set(), pytest.approx(0.1))


def test_no_room_from_a_peer_that_comes_to_lead_is_taken_once_it_leads():
    """SECOND had no room for our Join and told us while FIRST, silent (a newcomer still loading,
    or a peer the others gave up on), led here: not our leader then, its `NoRoom` is kept, and we
    sit the round out as soon as FIRST is taken for dead and SECOND leads (it tells a joiner once
    a round, and has no room for us still). Before, it was dropped: we waited out SECOND's leader
    timeout too, then decided a round alone. A `NoRoom` of a peer that never leads here is not
    taken (the first case of `test_no_room_is_taken_from_our_leader_only`)."""
    out = _decide([(0.1, Received(SECOND, NoRoom(1))), (0.2, Received("0_outsider", NoRoom(1)))])
    assert (out["behind"], out["suspects"], out["t"]) == (SECOND, {FIRST}, pytest.approx(2 * DEADLINE_S))
    assert out["past"] == 1  # no member of round 1, on its weights: it asks for a later round's state


def test_members_that_leave_us_out_on_our_weights_make_us_ask_for_the_round_after():
    """Our leader's Members of round 1 leave us out: on our weights we ask for a later round's
    state (`_Behind.past`, `StateRequest.after_round`), not the round's own (the same weights);
    on other weights, or named on other weights, we drifted: the round's own state is news."""
    for members, reference, past in [((FIRST, SECOND), DIGEST, 1), ((FIRST, SECOND), b"x" * 16, -1),
                                     ((FIRST, SECOND, ME), b"x" * 16, -1)]:
        out = _decide([(0.1, Received(FIRST, Members(1, reference, members)))])
        assert (out["behind"], out["past"], out["t"]) == (FIRST, past, pytest.approx(0.1))


def test_more_silent_leaders_than_peers_kept_each_hold_a_round_once(monkeypatch):
    """Twice `PEERS` trainer peers of our table (heartbeats cost nothing) have lower ids than ours
    and never send a Members: each leads in turn and is taken for dead at its leader timeout. Our
    suspicions of them all stand until each speaks: once the last is suspected we lead (alone:
    no other peer is left alive), within a leader timeout each. Before, past `PEERS` suspects
    half were forgotten, whichever, and led again: the round never ended."""
    monkeypatch.setattr(diloco_role, "PEERS", 4)
    silent = tuple(f"a_silent{i}" for i in range(8))
    out = _decide([], trainers=silent, within_s=(len(silent) + 1) * 2 * DEADLINE_S)
    assert out["members"] == (ME,) and out["suspects"] == set(silent)


def test_more_trainer_peers_than_a_join_names_are_waited_for_and_named_lowest_first():
    """More trainer peers of our table than a Join names (`MAX_MEMBERS`; heartbeats cost nothing)
    with lower ids than ours never send a Members: our Join to each names the lowest of those we
    take alive, the ones that lead first, and we lead once all are taken for dead. Before, the
    Join naming them all could not be built and the round died with a ValueError."""
    silent = tuple(f"a_silent{i:03d}" for i in range(MAX_MEMBERS + 8))
    joins: list[Join] = []
    out = _decide([], trainers=silent, within_s=(len(silent) + 1) * 2 * DEADLINE_S, sent=joins)
    assert out["members"] == (ME,) and out["suspects"] == set(silent)
    assert joins[0].known == silent[:MAX_MEMBERS] and {j.known[0] for j in joins if j.known} == set(silent)
