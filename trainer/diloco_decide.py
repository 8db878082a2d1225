"""The `diloco` role's members of a round: whom a join waits for, who leads, and the members it
decides or is told (`_decide`), the trio shell of `trainer.allreduce.Membership`.

Mixed into `trainer.diloco_role.DilocoRole` (`Deciding`), whose `_round` calls `_decide` once its
inner steps are done, and whose all-reduce keeps the next round's Joins it reads (`_keep_join`).

Whom a join waits for: the trainer peers of our peer table, less suspects (peers that could
not be reached, closed a connection or missed a deadline, until a message from them arrives),
and, after our first round, only peers that have spoken to us on the diloco channel,
so a newcomer still loading its model does not hold a round up: it is waited for from its
state fetch on. To these we add, during the join, every trainer peer another member's Join
names or whose Join reached us: the round's leader must be the same at every member, and only
the peer a joiner took its state from (the publisher, through the relay) knows to wait for it;
a joiner with the lowest id would otherwise lead the round there and not at the others, and the
round split (a Join names at most `MAX_MEMBERS`: of more, the lowest ids, which lead first). The
leader (`Membership.leader`) is the lowest id among the peers we wait for on our own account
and those whose own Join reached us, held or turned away for want of room (of
more Joins than a round holds, each member holds those that came to it first: counting only
those, two members could pick two leaders): a peer only others name leads once it joined, so a
named peer that never joins costs one join deadline, not the leader timeout. A peer whose Join
was turned away is not waited for: it came, and is no member. (A leader we wait for on our own
account is waited for until the leader timeout, 2 x deadline_s: leaving it at the join deadline
would let a late lowest-id peer decide the round a second time.) We take the round's Members
from the leader we follow, or from a peer the round's inbox keeps places for (`_believed`), not
from anyone: in an open group any identity can send one. One from another invited peer is kept,
and taken if that peer comes to lead here too (its predecessors taken for dead).

A lower id the group gave up on. On our first round (no round of ours behind us) we wait on our
own account for every trainer peer of our table, silent ones too: a joiner's table may still hold
a trainer peer the group took for dead (its heartbeat not expired yet, or alive but taking no part:
it accepts our Join and never answers). With a lower id than the group's real leader it would hold
us for its leader timeout while the others, which name it in no Join, average without us. So on
our first round a candidate that has not spoken to us this round is passed over as leader
(`_passed_over`; not suspected, and still waited for as a member) once every peer we wait for but
such ones has Joined us, at least one has, none of the Joins we hold names it, and we turned no
Join away (whose names we would not know): every peer of the round we hear from has given up on it.
Its Join, Members or NoRoom reaching us, or a Join naming it, makes it lead again (with the time
it had: `timed`). When we lead instead (every other peer's id above ours), we wait for it as a
member to the join deadline (deadline_s, not the leader timeout), then decide without it: the
race a late lower id's Join makes for any leader deciding at its join deadline (it reaches another
member just before, and that member follows it, not us) is ours too then. What is authenticated:
each frame is its sender's, proven by the data plane's handshake (`p2pnet.handshake`); nothing a
frame says about others is (a Join's `known` is its sender's word). So the rule trusts no one's
word that a peer is dead: it follows what every peer we hear from does. An identity cannot make
us pass over a live peer that any other peer we wait for still names (we wait for that peer's Join
first, and it names it), nor one whose Join reached us. What is left: when the silent peer is
the only other honest peer we wait for (a one-trainer group whose trainer is slower than us in its
inner steps, or one the group gave up on), any identity of our table that Joins us naming no one
else makes us pass it over: it leads our first round when its id is below ours, else we lead and
decide with it at our join deadline unless the silent peer Joins by then; either way our round is
not that trainer's. In an open group the lowest id that Joins leads every round anyway (here and
at every member its Join reaches), and an id below a given one costs a few key generations, so
this buys an attacker nothing it lacked. A closed group (`[diloco] trainers`) is the defence
against identities leading, here as elsewhere.

A joiner left out. A round holds at most `MAX_MEMBERS` Joins (`Membership`, `room_for`); a member
that turns away a trainer peer of its table, or gives its place to a peer it keeps places for,
tells it so (`NoRoom`), now or, for a Join of the next round read during our all-reduce
(`_keep_join`), from there, when its Join said it reads that (`hears_no_room`: an older peer's
server would end the connection on a kind it does not know). The joiner takes it from the leader
it follows only (any identity can send one, and a member that is not the leader may have had no
room where the leader had): it sits the round out at once (`_Behind`) and takes a later state,
as a peer the round's Members leave out does, instead of waiting out its leader's timeout. One
from an invited peer we do not follow yet is kept (one a sender, bounded by our table) and taken
if that peer comes to lead here: a member tells a joiner once a round (each send may wait on a
peer that reads none), and a peer it turned away stays turned away for the round. Telling is
best effort (`_tell_no_room`): a joiner we could not tell is no suspect for it.

These methods read the role's `node`, `config`, `history`, `heard` and `suspects` and the round's
inbox (`inbox`, through the role's `_next_event`); they keep the Joins of the next round read early
(`joins`, `turned_away`) and the Parts of this round read before its members were decided
(`early_parts`: bounded, only from peers that may be members, dropped when we sit the round
out). They call the role's `_forget()`, `_known_trainers()`, `_suspect(*peers)` and
`_next_event(deadline)`. Their log lines go to the role's logger. They must not do the arithmetic
(`trainer.diloco`) or decide the protocol (`trainer.allreduce`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import trio

from trainer.allreduce import Membership, hold_join
from trainer.diloco_inbox import GROUP_BYTES, INBOX, frame_bytes
from trainer.diloco_links import Links, PeerFailed
from trainer.diloco_messages import MAX_MEMBERS, Join, Members, NoRoom, Part

if TYPE_CHECKING:
    from trainer.diloco_inbox import RoundInbox
    from trainer.diloco_links import InboxEvent
    from trainer.diloco_role import DilocoConfig

log = logging.getLogger("trainer.diloco_role")  # the role's logger: its log lines keep their name

# the Parts of a round read before its members are decided (`early_parts`): at most these many, and
# these many bytes (`frame_bytes`), what the inbox's group lane holds. An honest group sends us,
# early, at most its contributions to our shard: a vector's packed bytes in all, in Parts of 256 Ki
# values (fewer frames than this for models up to 268 M values).
EARLY_FRAMES = INBOX * 4
EARLY_BYTES = GROUP_BYTES


class _Behind(Exception):
    """Another trainer peer is at a later round, or our weights are not the round's reference.
    `past`: we are no member of that round of ours, on its weights (told `NoRoom`, or left out
    of its Members): only a later round's state is worth fetching (`StateRequest.after_round`);
    -1: any later state, or the round's own (we drifted)."""

    def __init__(self, peer: str, past: int = -1) -> None:
        super().__init__(peer)
        self.peer = peer
        self.past = past


class Deciding:
    """A round's members for `trainer.diloco_role.DilocoRole` (see the module docstring)."""

    # the role's state these methods use (`DilocoRole.__init__` sets it)
    node: Any
    config: DilocoConfig
    inbox: RoundInbox
    suspects: set[str]
    heard: set[str]
    history: list[dict[str, Any]]
    joins: dict[int, dict[str, Join]]
    turned_away: dict[int, set[str]]
    early_parts: list[tuple[str, Part]]

    if TYPE_CHECKING:  # what these call on the role (`trainer.diloco_role.DilocoRole`)
        def _forget(self) -> None: ...
        def _known_trainers(self) -> set[str]: ...
        def _suspect(self, *peers: str) -> None: ...
        async def _next_event(self, deadline: float) -> InboxEvent | None: ...

    async def _decide(self, round: int, weights_digest: bytes, links: Links,
                      sends: trio.Nursery) -> tuple[str, ...]:
        """The members of this round: decided here when we lead, else told by the leader. The
        Parts of this round read meanwhile are kept in `early_parts` for its all-reduce
        (`_keep_early_part`), dropped when no all-reduce of ours follows (we sit the round out:
        `_Behind`, or we are cancelled), and any left from an earlier round dropped first."""
        self.early_parts.clear()
        try:
            return await self._members(round, weights_digest, links, sends)
        except BaseException:
            self.early_parts.clear()  # (a catch-up follows: nothing would read them)
            raise

    async def _members(self, round: int, weights_digest: bytes, links: Links,
                       sends: trio.Nursery) -> tuple[str, ...]:
        """`_decide`'s work."""
        me = self.node.peer_id
        early_bytes = 0  # of `early_parts` (`frame_bytes`), empty at the start
        self._forget()
        # trainer peers whose Join takes a NoRoom answer: those of the Joins kept for this round too
        # (one of them a reserved peer's Join replaces here is told, as one `receive` turns away)
        hearing = {peer for peer, join in self.joins.get(round, {}).items() if join.hears_no_room}
        membership = self._membership(round, weights_digest, self._known_trainers())
        delivered: dict[str, frozenset[str]] = {}  # peer -> the peers our Join to it named
        invited = self._known_trainers()  # whom we wait for; grows during the round, never shrinks
        if self.history:  # a newcomer is waited for once it spoke to us (a state fetch, a Join)
            invited &= self.heard
        own = set(invited)  # leader candidates on our own account (Membership.leader)
        leader_deadline = trio.current_time() + 2 * self.config.deadline_s
        followed, timed = me, set()  # the leader we wait for Members from; those given their own time to decide
        told: dict[str, Members] = {}  # Members of this round from invited peers we did not follow then (`_believed`)
        no_room: set[str] = set()  # invited peers that had no room for us before we followed them
        while True:
            # a peer some member waits for (named in its Join), or whose Join reached us, is one we
            # wait for too: every member then picks its leader from the same peers. Else a joiner
            # only its state's source waits for could lead there and not here, and split the round.
            trainers = self._known_trainers()
            invited |= membership.named & trainers
            membership.expect(invited, self.suspects)
            # what our Join names: not the peers we take for dead; of more than a Join names (a flood of
            # trainer peers, whose heartbeats cost nothing), the lowest ids: the ones that lead first
            alive = frozenset(sorted(invited - self.suspects)[:MAX_MEMBERS])
            for peer in sorted(invited):  # (re)send when not delivered yet or when a peer failed us since
                if delivered.get(peer) != alive:
                    delivered[peer] = alive
                    join = Join(round, weights_digest, tuple(sorted(alive)), hears_no_room=True)
                    sends.start_soon(self._send_join, links, peer, join, delivered)
            now = trio.current_time()
            candidates = own - self._passed_over(membership, own, invited, set(told) | no_room)
            leader = membership.leader(candidates, invited, self.suspects)
            if leader != followed:  # the last one failed us, or a lower id joined: not its predecessor's rest of time
                followed = leader
                if leader not in timed:  # once per peer and round: a leader that comes and goes cannot hold the round
                    timed.add(leader)
                    leader_deadline = max(leader_deadline, now + 2 * self.config.deadline_s)
            if leader != me and leader in told:  # it told us before we followed it: it leads now
                earlier = told.pop(leader)
                return self._check_members(round, earlier.members, earlier.weights_digest, weights_digest, leader)
            if leader != me and leader in no_room:  # it had no room for us before we followed it: it leads now
                log.info("diloco: leader %s had no room for us in round %d: sitting it out", leader, round)
                raise _Behind(leader, past=round)
            if leader == me:
                decided = membership.decided(now)
                if decided is not None:
                    members, reference = decided
                    for peer in sorted(set(membership.joins) - {me}):
                        sends.start_soon(links.send, peer, Members(round, reference, members))
                    return self._check_members(round, members, reference, weights_digest, me)
            elif now >= leader_deadline:
                log.info("diloco: no members from leader %s for round %d", leader, round)
                self._suspect(leader)
                leader_deadline = now + 2 * self.config.deadline_s
                continue
            wake = membership.deadline_at if leader == me else leader_deadline
            event = await self._next_event(min(wake, trio.current_time() + 0.5))
            if event is None:
                continue
            if isinstance(event, PeerFailed):
                self._suspect(event.peer)
                continue
            sender, body = event.peer, event.body
            if isinstance(body, (Join, Members)) and body.round > round:
                raise _Behind(sender)
            elif isinstance(body, Join) and body.round == round:
                refused = set(membership.refused)
                membership.receive(sender, body, trainers)
                if body.hears_no_room and sender in trainers:
                    hearing.add(sender)
                # tell the trainer peers turned away now (this one, or the one it replaced), so that
                # they stop waiting for our Members: it does not come to them. Once each (a peer stays
                # turned away for the round): a Join sent again, by any trainer peer as often as it
                # likes, is no send more, each of which may wait `deadline_s` on a peer that reads none
                for peer in sorted((membership.refused - refused) & hearing):
                    sends.start_soon(self._tell_no_room, links, peer, round)
            elif isinstance(body, NoRoom) and body.round == round:
                if sender == membership.leader(candidates, invited, self.suspects):  # no one else's say (`_believed`)
                    log.info("diloco: leader %s had no room for us in round %d: sitting it out", sender, round)
                    raise _Behind(sender, past=round)
                if sender in invited:  # it may lead yet (it is told once a round): taken then
                    no_room.add(sender)
            elif isinstance(body, Members) and body.round == round:
                leader = membership.leader(candidates, invited, self.suspects)  # (it spoke: no suspect now)
                if self._believed(sender, leader):
                    return self._check_members(round, body.members, body.weights_digest, weights_digest, sender)
                if sender in invited:  # it may lead yet, once those before it are taken for dead
                    told[sender] = body
                log.info("diloco: Members of round %d from %s, not our leader %s: not taken%s", round, sender,
                         leader, " yet" if sender in invited else "")
            elif isinstance(body, Part) and body.round == round:
                if self._keep_early_part(sender, body, early_bytes, invited | set(membership.joins)):
                    early_bytes += frame_bytes(body)

    def _keep_early_part(self, sender: str, part: Part, held_bytes: int, invited: Collection[str]) -> bool:
        """Keep `part`, of the round we decide, from `sender` for its all-reduce (`early_parts`,
        `held_bytes` of them held already), if there is room: a member that heard the round's
        Members before we did sends its contribution to our shard now. Only from a peer that can
        be a member here: one we wait for or whose Join we hold (`invited`), or one the inbox
        keeps places for (the last round's members); any identity can send Parts, and what it
        sends would wait until the round's end. At most `EARLY_FRAMES` of them and `EARLY_BYTES`
        in all (`frame_bytes`). What is not kept is dropped: a Part of a member left out costs
        only that member's contribution to one of our shards (left out of its mean)."""
        if sender not in invited and sender not in self.inbox.reserved:
            return False
        if len(self.early_parts) >= EARLY_FRAMES or held_bytes + frame_bytes(part) > EARLY_BYTES:
            return False
        self.early_parts.append((sender, part))
        return True

    def _passed_over(self, membership: Membership, own: set[str], invited: set[str],
                     spoke: Collection[str]) -> set[str]:
        """The peers we wait for on our own account that we pass over as the round's leader (see
        the module docstring): those with a lower id than the leader we would follow without them
        that did not speak to us this round (no Join, Members or NoRoom of it: `spoke`) and that
        none of the Joins we hold names. On our first round only (after it we wait on our own
        account only for peers that spoke to us), once we hold no Join turned away, at least one
        other peer's Join, and the Join of every peer we wait for but these."""
        if self.history or membership.refused or not set(membership.joins) - {self.node.peer_id}:
            return set()
        silent = own - set(membership.joins) - set(spoke) - membership.told
        if not silent:
            return set()
        leader = membership.leader(own - silent, invited, self.suspects)
        passed = {peer for peer in silent if peer < leader}
        if not passed or not membership.expected - passed <= set(membership.joins):
            return set()
        return passed

    def _believed(self, sender: str, leader: str) -> bool:
        """Whether we take a round's Members from `sender` now: from the peer we follow as the
        round's leader (`Membership.leader`), or from one of the peers the round's inbox keeps
        places for (the members of the last round we took part in; every listed trainer in a
        closed group), who decides in our leader's place when it took that leader for dead
        before we did. In an open group anyone else could be any identity (a heartbeat costs
        nothing): one that named us on our weights would make whoever it lists this round's
        members, and the peers we keep places for next. An invited peer's Members not believed
        yet is kept (`_decide`): taken once it leads here too."""
        return sender == leader or sender in self.inbox.reserved

    def _membership(self, round: int, weights_digest: bytes, trainers: set[str]) -> Membership:
        """The round's `Membership`, with the Joins of it read during the last round's all-reduce
        (`_keep_join`): those kept, then the trainer peers among the senders it had no room for."""
        # the peers whose Joins always find room, however many identities Join (`room_for`): those
        # the inbox keeps places for (the last round's members; a closed group's trainers)
        membership = Membership(self.node.peer_id, round, weights_digest, trio.current_time(),
                                self.config.deadline_s, self.inbox.reserved)
        for sender, join in self.joins.pop(round, {}).items():
            membership.receive(sender, join, trainers)
        for sender in sorted(self.turned_away.pop(round, set())):
            membership.turned_away(sender, trainers)
        self.joins = {r: j for r, j in self.joins.items() if r > round}
        self.turned_away = {r: s for r, s in self.turned_away.items() if r > round}
        return membership

    def _check_members(self, round: int, members: tuple[str, ...], reference: bytes, ours: bytes,
                       source: str) -> tuple[str, ...]:
        """`members` if we are one of them on the reference weights; else we sit the round out
        and fetch the state (from `source`, a member). Never a round alone while others live."""
        me = self.node.peer_id
        if me not in members or reference != ours:  # on the round's weights, only a later state is news
            raise _Behind(source if source != me else members[0], past=round if reference == ours else -1)
        others = self._known_trainers() - self.suspects
        if members == (me,) and others:
            raise _Behind(min(others))
        return members

    @staticmethod
    async def _tell_no_room(links: Links, peer: str, round: int) -> None:
        """Tell `peer`, a trainer peer whose Join of `round` we turned away, that we had no room
        for it. Best effort: a failure is not reported (`report`), so a joiner that left or reads
        slowly is no suspect for it (it would not be waited for, nor lead, in a later round until
        it speaks again); it waits out its leader's timeout, as an older joiner does."""
        await links.send(peer, NoRoom(round), report=False)

    async def _send_join(self, links: Links, peer: str, join: Join, delivered: dict[str, frozenset[str]]) -> None:
        if not await links.send(peer, join, report_refusal=False):
            delivered.pop(peer, None)  # again at the next poll: a newcomer may not have our heartbeat yet

    def _keep_join(self, sender: str, join: Join, trainers: Collection[str] = frozenset()) -> list[str]:
        """A Join of the next round, read during our all-reduce, kept for the next `_decide`. Only
        the next round's: an honest peer that ended this round before us sends those; one further
        ahead means we are behind, which the next round's Joins show us again (`_Behind`; a peer
        ahead answers our Join with its own). At most `MAX_MEMBERS` senders, this round's members
        (reserved: `_reserve`) first, as `Membership` takes them (`room_for`). A sender turned
        away, or replaced, that is one of `trainers` (of our table) is remembered
        (`turned_away`), as `Membership` remembers one: it counts for the leader choice, and is
        not waited for (it sends its Join once; another member may hold it). Returned: those of
        them turned away by this call (it, or the one it replaced) whose Join takes a `NoRoom`
        answer (`Join.hears_no_room`), for the all-reduce to tell: once each, as `_decide` tells
        (a sender turned away before, sending its Join again, is not named again)."""
        kept = self.joins.setdefault(join.round, {})
        refused = self.turned_away.setdefault(join.round, set())
        replaceable = dict(kept) if len(kept) >= MAX_MEMBERS else {}  # (a Join replaced is dropped from `kept`)
        told = sender in refused  # turned away before: told then
        admitted, replaced = hold_join(kept, refused, sender, self.inbox.reserved | {self.node.peer_id}, trainers)
        if admitted:
            kept[sender] = join
        tell = [] if admitted or told or not join.hears_no_room or sender not in refused else [sender]
        if replaced is not None and replaced in refused and replaceable[replaced].hears_no_room:
            tell.append(replaced)
        return tell
