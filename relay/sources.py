"""How a relay's transfer core picks and replaces its sources, with no I/O.

Mixed into `relay.transfer.TransferCore` (`SourceChoice`): these methods read the core's
membership, measured delivery rates and exclusions, and never change them; like the core they
take the time as an argument and draw nothing at random. Whether a parent delivers too little
(slow) is judged in `relay.judging` (`SourceJudgement`, mixed in beside this).

Reattaching orphans. When our parent in s is dropped (crashed, stalled, unreachable) or banned,
walking up the ancestor chain would send every orphan of a relay near the root to the origin,
which then serves that stripe like a star until the next membership update replans. Instead we
borrow a substitute parent at once: an interior member of s whose own planned chain holds no
peer we know to be dropped or banned, ranked before us by (depth, peer id) (so borrowed and
planned parent links never form a cycle), picked by rendezvous hashing of (us, stripe, member)
weighted by upload / (1 + depth), so the orphans of one relay spread over the stripe's interior
in proportion to capacity rather than pile onto one peer. The substitute goes in front of our
ancestor chain; if it fails too, the next one is picked. A late joiner (not in the plan)
borrows its parent the same way. The origin is never replaced (nobody else has the chunks
first), and with no eligible member the chain falls back to the ancestors as before.
Siblings (the other children of the dropped parent, ranked before us) are eligible too: they
drop it as we do and borrow in their turn, and for the children of a stripe's root (the
origin's one child in a stable plan) they are the only members above nobody failed; without
them every child of a slow root fell back to the origin (measured at 1,000 relays, 0.25 GB:
9.6-12.5 copies of the checkpoint from the origin instead of 1.0-1.3).
Members whose advertised upload the plan capped (`relay.planner.ADVERTISED_CAP`: claims nobody
checked, beyond 16x the median) are picked only when no other member is eligible: weighted by
their claim they drew most orphans, and a parent that left orphans behind is most often one
whose claim was not kept. Measured (200 relays, 1 GB, 20 of them claiming 2^64 - 1 and
delivering 20 MB/s, seed 1): children that dropped a liar borrowed another liar (at the cap one
outweighed a dozen honest members) and dropped it three chunks later, liar after liar: with the
slow-parent rules of `relay.judging`, 164.3 s, and 80.6 s with capped claims last (26.6 s with the liars
telling the truth; capped claims last with the median rule alone, 213.9 s). Honest seeds
advertising beyond the cap are borrowed from last too, while their planned children keep them
(20 of 200 relays at 10 GB/s: 10.41 s either way).

A peer dropped only as slow is alive and delivers: when the chain falls through to the origin
and the origin is not our planned parent there, we ask the slow member again instead
(`_instead_of_origin`). The origin's upload is the scarcest (every version starts there and
each stripe leaves it once, to its root); without this rule the origin uploaded 2.11 copies of
the checkpoint with 10% of relays at a tenth of their advertised upload (1,000 relays, 1 GB), to
relays whose parent, grandparent and stripe root they had all dropped as slow (a leaf child,
served after its parent's interior children, times a fast root as slow), and with it 1.00.

One exception: a slow stripe root. Its children drop it and borrow each other, so the whole
stripe flows through its first-ranked child (the interior member ranked right after the root),
which has no member ranked before it to borrow and kept the slow root. That child alone
(`_first_child_of_root`, at most one member per stripe) takes the stripe from the origin
instead, while the origin is usable: a sixteenth of a copy per slow root. Traced (1,000 relays,
10 GB, 10% of relays at a tenth, seed 1): two of the 16 roots were slow (1 + 2/16 copies with
the rule), one of them fed its stripe so late that its half of the relays held the stripe's
last chunks only from 193 s (median; 32-109 s for the other stripes), and its stalled subtrees
walked up to the root and then, past their spares, to the origin: 2,412 requests from 480
relays, 9.3 copies of the checkpoint from the origin (10.30 in all); with the rule (and the endgame's below) 1.13
copies, and 1.098x the bound instead of 1.189x. With the rule alone the stripe's median fell
to 128 s, but its last 1% of relays, the children of a slow depth-2 member with 61 of them,
waited until 280 s (1.40x): the origin's copies had been feeding that tail.

A lost lone root (`_stand_in`). A plan of few members may give each stripe one interior member, its
root, and every other member as its children; when that root is killed, banned or dropped as slow,
or passed over in its stripe (below), no member is left to borrow from, and every child took the
stripe from the origin. One stand-in instead: the first of the root's children, in an order drawn
per version, that we did not see fail takes the stripe from the origin, and each later child takes
it from the first one before it that it did not see fail (only earlier ones: no cycle, even between
members whose plans differ, since the order is one for the whole version). The order is salted by
the manifest id (the same for every member; no peer knows it before the version is out): in peer id
order, an id ground to sort first made one peer the stand-in of every lost stripe of every version.
Measured (8 real relays, the publisher capped at 3 MB/s, 16 MiB in 64 KiB chunks, two roots killed
mid-version and one banned for corrupting; in peer id order): 2.55 copies from the origin and 13.6
s, with the stand-in 1.16 copies and 5.8 s. A stand-in is our parent in its own stripe too, so a
stall per source never caught one that served that stripe and withheld the lost one: the lost stripe
waited on it for as long as it served its own. Stalls are judged per (source, stripe) as well
(`relay.failures`, `_pass_over`): one stalled there is passed over in that stripe alone
(`_passed_over`; for the next earlier child, then the origin) and stays our parent in its own; and
its delivery of the lost stripe is judged on that stripe's chunks alone, as the root's was
(`relay.judging`, `_short_as_stand_in`). So a root dropped as slow is stood in for as well (before,
every child that dropped it asked the origin, the first-ranked child's rule below), and a slow
stand-in is passed over in turn. Measured (the same 8 relays, 16 MiB, one run each way unless said):
the stand-in of a killed root withholding the lost stripe, 8.81 and 8.79 s -> 5.61 and 5.86 s
(1.13-1.14 copies either way); a root serving at 250 KB/s while it advertises the default, 1.25 ->
1.13 copies (most of its children never dropped it: holders of the whole version fed its stripe at
the end).

An origin that delivers far less than it advertises (a trainer advertising the default upload on
a home uplink) is left, stripe by stripe, for a forwarder of the stripe where the plan made it our
parent (`_leave_origin`, judged in `relay.judging`): an interior member (`_substitute`; any of
them from a leaf, which nobody borrows from), or where the plan gave the stripe none, the member
whose home stripe it is (`_forwarders`). The origin stays behind it in our chain, and is what
replaces it if it is judged slow (`_replaceable`; from its first chunk, against what the origin
delivered us: `relay.judging`, `_short_of_origin`), so a forwarder that delivers too little
gains nothing by it.

Whatever dropped our chain (a stall included), the origin is asked only after others when it
is not our planned parent (`_instead_of_origin`): a chain member dropped as slow, a peer we
measured that holds the whole version, then members ranked before us in the stripe (their
ancestors unchecked: the one we dropped is likely theirs too, and busy rather than hung), until
`ORIGIN_SPARE_TRIES` peers failed the chunk. A parent that answers "unavailable" (it did not get
the chunk within its wait limit) is asked again, `PARENT_REASKS` times, before its ancestors: it
is alive and behind, and its ancestors are what feeds it (but not for ever: one that answers so to a
window's chunks in a row, each asked as often, delivering nothing between, is passed over in that
stripe, `relay.failures`' `_unavailable_too_often`). Measured (`sim run broadcast`, 10 GB,
258 x 37 MiB, seed 1): at 1,000 relays, stalls at stripe roots whose upload slots were all taken
sent their children to the origin (9.63 copies; 1.38 with these rules); at 10,000 relays, a
lagging subtree's "unavailable" answers sent the relays below it up to the stripe's root (up to
5,744 requesters on one root planned to feed 79), which was then dropped as stalled in turn,
and the chain fell to the origin, itself dropped as stalled 6,099 times (4.38 copies; 1.00 with
these rules, and 1.45x the bound instead of 1.55x).

Endgame (`_endgame_source`). Once no other stripe has chunks left to ask for, the chunks of
the last one still wanted go to a peer that holds the whole version and has served us before
(our parents in the other stripes tell us `Holding` as they complete), fastest measured first,
the origin aside, instead of a chain still forwarding (a plan of fewer than 4 stripes, one
tree, has no endgame). A lagging stripe's parent may itself be fed slowly, which our delivery
measure cannot see: it does not count the long poll, so that a parent is not blamed for its own
parent's pace.
Measured (1,000 relays, 1 GB, 10% of relays at a tenth of their advertised upload): the last
relays finished at 30.0 s, the bound being 19.9 s, each waiting for the second half of one
stripe that its substitute parent forwarded at the pace it received it, long after its other 15
stripes were complete; with the endgame, 25.2 s. Starting it earlier hurt: with at most a
quarter of the stripes left to ask for, the same 25.2 s, but 2,000 relays and 0.5 GB with the
defaults took 15.2 s instead of 12.0 (presumably requests taken from parents about to forward a chunk,
to busy holders; not verified); with no other stripe left, 11.8 s. Holders known from gossip
alone are not asked: they could draw every relay in the endgame to the same few (a precaution;
no measured difference in these runs). A source that holds the whole version gives way in the
endgame too: a slow relay planned by its advertised upload holds everything long before its
dozens of children do, and moves each chunk fast (its pacing sends them one after another) but
serves each child rarely (the 1% tail above: 1.40x -> 1.10x).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import blake3

from relay.planner import Membership, StripePlan, tiebreak

if TYPE_CHECKING:
    from relay.transfer import TransferConfig
    from relay.transfer_state import _Version

ENDGAME_MIN_STRIPES = 4  # a plan of fewer stripes (one tree) has no endgame: no stripe lags the others
# stand-ins that answered "unavailable" for a chunk before the origin is asked (a hung one is dropped, not counted)
ORIGIN_SPARE_TRIES = 2
PARENT_REASKS = 2  # "unavailable" answers from our parent for one chunk before we ask elsewhere
DRAW_PLANS = 4  # plans whose members' substitute order (`_by_draw`) a core keeps


def stand_in_key(manifest_id: bytes, peer: str) -> tuple[bytes, str]:
    """`peer`'s place in the order in which the children of a lost lone root stand in for it
    (`SourceChoice._stand_in`): drawn per version, the same for every member and every stripe."""
    return tiebreak(manifest_id, peer), peer


def draw_score(self_id: str, stripe: int, peer: str, depth: int, uploads: Mapping[str, float]) -> float:
    """`peer`'s weighted rendezvous score as a substitute parent of `self_id` in `stripe`."""
    draw = int.from_bytes(blake3.blake3(f"{self_id}/{stripe}/{peer}".encode()).digest(8), "big")
    return uploads.get(peer, 1.0) / (1 + depth) / -math.log((draw + 1) / (2**64 + 1))


class SourceChoice:
    """Source choice for `relay.transfer.TransferCore` (see the module docstring)."""

    # the core's state these methods read (`TransferCore.__init__` sets it)
    config: TransferConfig
    self_id: str
    _members: Membership
    _rates: dict[str, float]
    _banned: set[str]
    _slow: set[str]
    _draw_orders: dict[StripePlan, dict[int, tuple[str, ...]]]  # `_by_draw`'s, for our current membership

    if TYPE_CHECKING:  # what these call on the core (`relay.transfer.TransferCore` or another of its mixins)
        def _usable(self, now: float, peer: str) -> bool: ...
        def _next_index(self, v: _Version, stripe: int) -> tuple[int | None, bool]: ...
        def _origin_feeds_too_little(self, v: _Version, stripe: int) -> bool: ...
        def _passed_over(self, now: float, v: _Version, stripe: int) -> set[str]: ...

    def _substitute(self, now: float, plan: StripePlan, stripe: int, below: tuple[int, str] | None,
                    lost: str | None = None, skip: str | None = None, avoid: Any = (),
                    strict: bool = True) -> str | None:
        """A live interior member of `stripe` to fetch from instead of our dropped parent `lost`.

        Eligible: ranked before us by (depth, peer id) (any member, if we are not in the plan,
        depth 0), usable, and no planned ancestor of it but the origin and `lost` dropped or
        banned by us. `lost` is allowed above it so that our siblings (its other children, which
        drop it too and borrow in their turn) are eligible: the children of a stripe's root have
        no other member above them, and without siblings they would all fall back to the origin.
        `skip`: a member not to pick (asking whether a substitute exists before dropping it).
        Among them the one with the highest upload / (1 + depth) / -ln(hash(us, stripe, member)):
        weighted rendezvous hashing, deterministic, spread in proportion to capacity and leaning
        toward shallow members (fewer ancestors that may have failed unknown to us). A member
        whose claim the plan capped only when no other is eligible (see the top)."""
        limit = len(plan.ranked_interior(stripe)) if below is None else plan.ranked_before(stripe, below)
        if limit == 0:
            return None
        rank = plan.interior_rank(stripe)
        for peer in self._by_draw(plan, stripe):
            if rank[peer] >= limit:
                continue  # ranked after us: borrowing from it could close a cycle
            if peer == skip or peer in avoid or not self._usable(now, peer) or \
                    (strict and not self._healthy_above(now, plan, stripe, peer, lost)):
                continue
            return peer
        return None

    def _by_draw(self, plan: StripePlan, stripe: int) -> tuple[str, ...]:
        """`stripe`'s interior members by falling rendezvous score (`_substitute`), those whose
        claim the plan capped after all the others, ties in ranked order, so the first eligible
        one is the member a scan of the ranked interior keeping the first strictly highest score
        (capped claims losing to any other) would pick. The score depends only on the plan,
        the stripe, our id and the members' uploads: kept per plan (the newest `DRAW_PLANS`),
        forgotten when our membership changes (`set_members`); a build costs what one scan did
        (a hash per member)."""
        kept = self._draw_orders.get(plan)
        if kept is None:
            if len(self._draw_orders) >= DRAW_PLANS:
                del self._draw_orders[next(iter(self._draw_orders))]
            kept = self._draw_orders[plan] = {}
        order = kept.get(stripe)
        if order is None:
            ranked = plan.ranked_interior(stripe)
            planned, claimed = self._members.planned, self._members.uploads
            scores = [(planned.get(peer, 0.0) >= claimed.get(peer, 0.0),  # False (capped) sorts last
                       draw_score(self.self_id, stripe, peer, depth, planned)) for peer, depth in ranked]
            by_score = sorted(range(len(ranked)), key=scores.__getitem__, reverse=True)  # stable: ties keep rank
            order = kept[stripe] = tuple(ranked[i][0] for i in by_score)
        return order

    def _healthy_above(self, now: float, plan: StripePlan, stripe: int, peer: str, lost: str | None = None) -> bool:
        """No planned ancestor of `peer` in `stripe` (the origin and `lost` aside) is dropped or
        banned by us."""
        parents = plan.parent[stripe]
        current = parents.get(peer)
        while current is not None and current != plan.origin:
            if current != lost and not self._usable(now, current):
                return False
            current = parents.get(current)
        return True

    def _leave_origin(self, now: float, v: _Version) -> None:
        """In each stripe where the origin is our planned parent and delivers too little
        (`relay.judging`, `_origin_feeds_too_little`; see the top), take the stripe from a
        forwarder of it (`_forwarders`) instead: an interior member (`_substitute`), any of
        them if we forward nothing of the stripe ourselves (nobody borrows from a leaf: no
        cycle), else one ranked before us; where the plan has none, the member whose home
        stripe it is (they borrow from nobody there). The origin stays behind it in our chain:
        if the forwarder is dropped, the chain is the plan's again (`_chain`). With no usable
        forwarder, nothing changes; a forwarder we took so and then dropped or passed over there
        is not taken again in this plan (`_Version.forsaken`, `relay.failures`' `_forsake`; a
        stall or a reset after it delivered us a chunk is excused once: `_Version.borrowed`).
        Requests already asked of the origin stay with it. Only in
        striped plans: the baselines (a star, one tree, the swarm) keep their shape."""
        plan = v.plan
        if plan is None or self.config.layout != "striped":
            return
        for stripe, chain in enumerate(v.chains):
            if not chain or chain[0] != plan.origin or not self._origin_feeds_too_little(v, stripe):
                continue
            forsaken = {p for p, s in v.forsaken if s == stripe} if v.forsaken else ()
            if plan.ranked_interior(stripe):
                below = (len(chain), self.self_id) if plan.fanout[stripe].get(self.self_id, 0) > 0 else None
                pick = self._substitute(now, plan, stripe, below, avoid=forsaken)
            else:
                pick = next((p for p in self._forwarders(plan, stripe)[0]
                             if p not in forsaken and self._usable(now, p)), None)
            if pick is not None:
                v.chains[stripe] = [pick] + chain
                v.borrowed[(pick, stripe)] = False  # (nothing delivered yet: `relay.failures`, `_forsake`)

    def _forwarders(self, plan: StripePlan, stripe: int) -> tuple[tuple[str, ...], int]:
        """The members that forward `stripe` in `plan`, and how many of the first of them take
        it from the origin whatever it delivers (`_leave_origin`): its interior members in
        ranked order, the first of them; where the plan made every member a child of the origin
        (its claim outweighing theirs), the serving members whose home stripe it is, the most
        planned upload first, all of them. O(members) in that case only."""
        ranked = plan.ranked_interior(stripe)
        if ranked:
            return tuple(p for p, _ in ranked), 1
        planned = self._members.planned
        home = sorted((p for p, s in plan.home.items() if s == stripe and planned.get(p, 0.0) > 0),
                      key=lambda p: (-planned[p], p))
        return tuple(home), len(home)

    def _replaceable(self, now: float, plan: StripePlan, stripe: int, peer: str) -> bool:
        """Whether someone could take over from `peer`, our source in `stripe`: a substitute
        (see the top) or a usable planned ancestor other than the origin; or, for the
        first-ranked child of the stripe's root (`peer`), the origin while it is usable (it
        has no other replacement)."""
        planned = plan.ancestors(stripe, self.self_id)
        if planned and planned[0] == peer and self._first_child_of_root(plan, stripe, planned):
            return self._usable(now, plan.origin)  # only the origin can take over the stripe from its root
        if planned == [plan.origin]:  # a forwarder we took in place of the origin (`_leave_origin`)
            return self._usable(now, plan.origin)
        if any(p != peer and p != plan.origin and self._usable(now, p) for p in planned):
            return True
        below = (len(planned), self.self_id) if planned else None
        return self._substitute(now, plan, stripe, below, planned[0] if planned else None, skip=peer) is not None

    def _origin_replaces_root(self, plan: StripePlan, stripe: int, planned: list[str]) -> bool:
        """Whether only the origin could replace `stripe`'s root, our parent (`planned`: our
        planned ancestors there): we are its first-ranked child (`_first_child_of_root`), or
        the root is the stripe's only interior member, so nobody else forwards the stripe (see
        the top)."""
        if len(planned) != 2 or planned[1] != plan.origin:
            return False
        ranked = plan.ranked_interior(stripe)
        if len(ranked) == 1:
            return ranked[0][0] == planned[0]
        return self._first_child_of_root(plan, stripe, planned)

    def _first_child_of_root(self, plan: StripePlan, stripe: int, planned: list[str]) -> bool:
        """Whether we are the first-ranked child of `stripe`'s root (`planned`: our planned
        ancestors there): the interior member ranked right after the root, so no member but the
        root ranks before us (we have no substitute parent) and our siblings borrow, directly or
        not, from us. At most one member per stripe; never a leaf (nobody borrows from a leaf),
        nor any child of a root that is the stripe's only interior member."""
        if len(planned) != 2 or planned[1] != plan.origin:
            return False
        ranked = plan.ranked_interior(stripe)
        return len(ranked) > 1 and ranked[0][0] == planned[0] and ranked[1][0] == self.self_id

    def _spare_origin(self, now: float, v: _Version, stripe: int, source: str | None, tried: Any) -> str | None:
        """`source`, unless it is the origin and `_instead_of_origin` names someone to ask instead."""
        if source is not None and source == v.plan.origin:  # type: ignore[union-attr]
            return self._instead_of_origin(now, v, stripe, tried) or source
        return source

    def _instead_of_origin(self, now: float, v: _Version, stripe: int, tried: Any) -> str | None:
        """Whom to ask instead of the origin when the origin is not our planned parent in
        `stripe`: a member of our chain we dropped only as slow (it is alive and delivers, if
        slowly), else a peer we measured that holds the whole version, else (while fewer than
        `ORIGIN_SPARE_TRIES` peers failed this chunk) a member ranked before us in the stripe
        (`_substitute`, its ancestors unchecked: the one we dropped may be theirs, busy rather
        than hung), or for a lost lone root a stand-in (`_stand_in`). The origin's upload is
        the scarcest (each stripe is sent once from it, to its root). When only the origin
        could replace a stripe root we dropped as slow (see the top, `_origin_replaces_root`):
        a measured holder of the whole version, else nobody (ask the origin), unless that root
        is its stripe's only forwarder: a stand-in then, as for one lost. Peers we pass over in
        `stripe` alone (`_passed_over`) are skipped as those in `tried` are, but not counted
        among them."""
        plan = v.plan
        assert plan is not None
        if self.self_id == plan.origin or plan.parent[stripe].get(self.self_id) == plan.origin:
            return None
        planned = plan.ancestors(stripe, self.self_id)
        passed = self._passed_over(now, v, stripe) if v.passed else set()
        avoid = passed.union(tried) if passed else tried
        lone = self._lost_lone_root(now, plan, stripe, planned, passed)
        slow_root = not lone and bool(planned) and planned[0] in self._slow and \
            not self._usable(now, planned[0]) and self._origin_replaces_root(plan, stripe, planned)
        if not slow_root and not lone:
            for peer in v.chains[stripe]:
                if peer in self._slow and peer not in avoid and peer not in self._banned:
                    return peer
        rates = self._rates
        held = [p for p in v.holders if p in rates and p != plan.origin and p not in avoid and self._usable(now, p)]
        if held:
            return max(held, key=lambda p: (rates[p], p))
        if slow_root:
            return None  # the origin feeds the first-ranked child of a slow root (see the top)
        if len(tried) >= ORIGIN_SPARE_TRIES:
            return None
        if not tried:  # the pick for the stripe's next chunks, kept for one tick (`_substitute` is O(members))
            kept = v.spare.get(stripe)
            # (`relay.failures`' `_pass_over` forgets a pick it passes over)
            if kept is not None and kept[1] > now and (kept[0] is None or self._usable(now, kept[0])):
                return kept[0]
        below = (len(planned), self.self_id) if planned else None
        pick = self._substitute(now, plan, stripe, below, planned[0] if planned else None, avoid=avoid, strict=False)
        if pick is None and lone:
            pick = self._stand_in(now, plan, stripe, planned[0], avoid, v.signed.manifest_id)
        if not tried:
            v.spare[stripe] = (pick, now + self.config.stall_timeout_s / 4)
        return pick

    def _lost_lone_root(self, now: float, plan: StripePlan, stripe: int, planned: list[str],
                        passed: Any = ()) -> bool:
        """Whether our parent in `stripe` (`planned`: our planned ancestors there) is the
        stripe's root and only interior member, and we dropped (as slow too) or banned it, or
        pass it over there (`passed`: it withheld the stripe while it served us in another):
        nobody else in the plan forwards the stripe (see the top, a lost lone root)."""
        if len(planned) != 2 or planned[1] != plan.origin or \
                self._usable(now, planned[0]) and planned[0] not in passed:
            return False
        ranked = plan.ranked_interior(stripe)
        return len(ranked) == 1 and ranked[0][0] == planned[0]

    def _stand_in(self, now: float, plan: StripePlan, stripe: int, root: str, tried: Any,
                  manifest_id: bytes) -> str | None:
        """Whom to ask for `stripe` instead of the origin now that its lone root `root` is lost
        (`_lost_lone_root`): the first of the root's children in the order drawn for this version
        (`stand_in_key`, salted by `manifest_id`; see the top) that ranks before us
        and that we neither dropped, banned, tried for this chunk nor pass over in the stripe
        (`tried` holds both). The first child none of us
        saw fail has nobody before it and asks the origin: it is the stripe's stand-in root, and
        the others take the stripe from it (or from the one before it that they still take for
        alive), so picks only point to earlier children and never form a cycle. A liar among
        the children is the stand-in by one chance in the fan-out, not by its id.
        O(fan-out log fan-out): only for a lone root, a small membership."""
        mine = stand_in_key(manifest_id, self.self_id)
        drawn = sorted(stand_in_key(manifest_id, peer) for peer in plan.children(stripe, root))
        for key in drawn:
            peer = key[1]
            if key >= mine:
                return None
            if peer not in tried and self._usable(now, peer):
                return peer
        return None

    def _ask_parent_again(self, v: _Version, index: int, peer: str) -> bool:
        """Whether to ask `peer` again for chunk `index` after it answered "unavailable" (it did
        not get the chunk within its wait limit): yes if it is our source in that chunk's stripe
        (not the origin) and has not answered so `PARENT_REASKS` times already. It is alive and
        behind; its ancestors feed it, and asking them too takes their upload from it."""
        plan = v.plan
        if plan is None or peer == plan.origin:
            return False
        chain = v.chains[plan.stripe_of_chunk[index]]
        if not chain or chain[0] != peer:
            return False
        count = v.reasked.get(index, 0)
        if count >= PARENT_REASKS:
            return False
        v.reasked[index] = count + 1
        return True

    def _endgame_source(self, now: float, v: _Version, stripe: int, index: int) -> str | None:
        """In the endgame (no other stripe has chunks left to ask for), a peer
        that holds the whole version and has served us before (not the origin) with room in its
        window, fastest measured first (our source too, if it holds everything and is the
        fastest), instead of a chain that is still forwarding: a lagging
        stripe's parent may itself be fed slowly, which our delivery measure (the long poll
        counts only past our other sources') does not show. Only peers we measured: holders
        known from gossip alone would draw every relay in the endgame to the same few."""
        plan = v.plan
        assert plan is not None
        if plan.stripes < ENDGAME_MIN_STRIPES:
            return None
        for s in range(plan.stripes):
            if s != stripe and self._next_index(v, s)[0] is not None:
                return None  # another stripe still has chunks to ask for: not the endgame yet
        tried = v.tried.get(index, ())
        if v.passed:
            tried = self._passed_over(now, v, stripe).union(tried)
        window, load = self.config.window_per_source, v.link_load
        best, best_key = None, None
        rates = self._rates
        for peer in v.holders:
            if peer not in rates or peer == plan.origin or peer in tried or not self._usable(now, peer) or \
                    load.get((peer, stripe), 0) >= window:
                continue
            key = (rates[peer], peer)
            if best_key is None or key > best_key:
                best, best_key = peer, key
        return best
