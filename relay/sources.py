"""How a relay's transfer core picks, judges and replaces its sources, with no I/O.

Mixed into `relay.transfer.TransferCore` (`SourceChoice`): these methods read the core's
membership, measured delivery rates and exclusions, and never change them; like the core they
take the time as an argument and draw nothing at random.

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
slow-parent rules below, 164.3 s, and 80.6 s with capped claims last (26.6 s with the liars
telling the truth; capped claims last with the median rule alone, 213.9 s). Honest seeds
advertising beyond the cap are borrowed from last too, while their planned children keep them
(20 of 200 relays at 10 GB/s: 10.41 s either way).

Parents are judged by measured delivery (`_delivers_too_little`): each chunk's time is the time
its bytes took plus the time the request waited in the source's queue for an upload slot (the
source's answer header says; its long poll, waiting for the chunk itself, counts only past our
other sources', below, so a parent is not blamed for its own parent's pace). A parent with more
children than its real upload can feed moves each chunk fast but serves each child rarely; only
its queue shows that.
The queue is the source's word, though, and so is the long poll it leaves: our clock, from the
ask to the last byte, says only how much longer than its report a chunk took, not why. A liar
reporting no queue was timed while its bytes flowed alone (200 relays, 1 GB, 20 claiming 2^64 -
1 and delivering 20 MB/s, seeds 1-3: 191.8, 252.9 and 136.7 s against 80.1, 75.8 and 76.1 s with
the queue told; kept, and the fastest holder to borrow from). No clamp of a report closes that,
and timing holders of the whole version from the request's arrival (122.1 s at seed 1) is
escaped by a liar that never sends `Holding`. So the wait beyond the report is excused only as
far as our other sources wait beyond theirs (`_unexcused_s`: the median of their EWMAs, the
origin aside, over at least 3): in a pipelined broadcast every parent waits for its chunks about
as long; the rest counts as the source's. Our own delays are left out by the shell, which times
the wait from when a request is its to send (not while our disk holds our sends, nor while we
dial the source: the first requests to a source 5 s away by dial were all 5 s late, and it was
dropped as slow) to the answer's header (not our wait for a buffer, nor our storing):
`relay.upstream`; the simulator has none of them. Then: 108.1, 86.5 and 90.7 s hiding the queue,
81.5, 73.9 and 81.0 s telling it; 10 liars in 1,000 relays 115.5 s hiding it (133.1 s before),
111.8 s telling it (116.3 s). Colluding liars that are most of our parents lift the median,
hence the gap left.
The cost: a parent fed by a slow parent waits longer than our others too, and was dropped (one
liar in 200 relays: 801 honest parents dropped as slow instead of 31, every one the liar's child
in the plan, 94.9 s instead of 78.7 s; 107.9 s hiding its queue). So a source whose planned
parent in the stripe is a member whose claim the plan capped, its own claim not capped, is
excused its wait (`_fed_by_a_capped_claim`: every peer knows the plan): one liar, seeds 1-3,
told and hidden: 79.8, 84.3, 67.8, 66.0, 68.2 and 68.8 s (27 and 29 honest drops at seed 1)
instead of 94.9, 107.9, 72.7, 79.3, 69.0 and 68.4; 20 liars, seeds 1-6, told 480.8 s in all
instead of 463.0, hidden 571.8 instead of 566.9; 10 in 1,000, 116.3 s told and 111.7 s
hidden instead of 111.8 and 115.5. Tried and not kept
(same worlds; in all, one liar 434.7 s and 20 liars 1,052.6 s with this, 492.2 and 1,029.9
without): also excusing a source whose planned parent we dropped (no change), that alone (455.1
and 1,044.0 s; 10 in 1,000, 115.3 and 117.3 s), counting the wait only while the source's bytes
are below our other sources' median too (386.1 s, but 20 hiding it 627.8 s against 566.9, 10 in
1,000 hiding it 135.6 s, and a liar moving each chunk fast escapes it), or only the part past
twice the median (seeds 1-3: 20 hiding it 324.5 s against 285.3). Honest worlds as before
(`sim run` broadcast, symmetric, byzantine, churn, hostile at 1,000 relays, seed 1: within -0.3
to +0.2 s, the same with the excuse; 20 seeds at 10 GB/s in 200: 10.41 s; the 20 relays above
telling the truth: 26.6 -> 26.7 s), but 5 seeds at 10 GB/s (capped) in 200 downloading 30 MB/s:
45.6 s, 42.0 s, and 44.4 s with the excuse. Timing from the ask alone (the whole wait counted)
made hiding useless, but blamed more honest parents: 108.3, 117.6 and 119.8 s hidden or told;
one liar in 200, 85.7 s.

A parent is slow (`_delivers_too_little`) when it delivers under half the median of our other
sources (over at least 3 of them) or under a quarter of the fastest of them but the origin, and
under half the stripe's planned rate, and a member other than the origin could replace it.
Liars hide behind each other from the median: in the world above the plan gave them about 60%
of the child links (fan-outs of 20-46 at the cap), most children had liars for most parents,
the median was a liar's rate, and they kept their liars to the end: 263.2 s, and 164.3 s with
the fastest's quarter. When our own download binds, every parent delivers about as much and neither rule
fires. Half of the fastest dropped honest parents merely behind early (1,000 relays, `sim run
byzantine`, seed 1: parents the median kept dropped 1,055 times, mostly at 2.5-3 s, at 6 MB/s
against a median of 8-11 and a fastest of 13-30; 20.70 s -> 21.15 s), with a quarter 20.70 s.
The origin is no measure of a member's delivery (it holds every chunk first and has the
largest upload: a datacenter among home links): in the world of 20 liars, 64 parents the
median kept were dropped against its rate, 62 of them honest (80.55 s; 80.13 s without).
The stripe's planned rate is its capacity over the members, but no more than the origin feeds
the stripe (`_stripe_feed_bps`: its advertised upload over the stripes): every chunk of a stripe
enters the network there, so no member forwards it faster. An origin whose upload is capped (a
trainer on a home uplink) feeds every stripe slowly and alike, so every parent waits on its
own feed; each chunk's bytes take next to nothing on a fast link, the rate we measure is mostly
the part of that wait beyond our other sources' median (noise, one way or the other), and
against the plan's rate (the roots' own advertised uploads) every parent looked slow: real
relays, 7 under a 3 MB/s origin, 24 MiB in 64 KiB chunks (a stripe each, every root its
stripe's only forwarder, so the origin replaced each one dropped) dropped a root 2-9 times
each in a version, the origin served 2.3 copies and every relay took 18-19 s; judged against
the feed, no drop, 1.00 copies, 7.6-7.9 s (`tests/relay/test_capped_origin_processes.py`).
An origin that advertises the default (1 GB/s: nothing measured) on a home uplink advertises
what it measures only after every upload slot was busy for 2 s (`relay.role_members`), and its
first version was judged against the default: 14.5 s and 1.81 copies (the same relays, the
origin sending at 3 MB/s and advertising 1 GB/s; 17.8-18.5 s and 2.28 before the feed counted).
So the feed is also no more than what the origin delivers us, once we timed 3 of its chunks (a
root, or a relay the origin replaced a root for): 12.2 s and 1.54 copies, every drop left in
the first 1.2 s (presumably the origin's first chunks, timed before its queue formed; not
traced); the next version, the measured figure advertised, 8.0 s and 1.00 copies with either.
Peers that crowd the origin lower what it delivers us, and excuse our parents more: still
only those delivering half of it.
Where the origin feeds each stripe faster than the stripe's capacity over the members, nothing
changes (`sim run broadcast`, 1,000 relays, seed 1: 20.276155 s, every relay's time the same).

A parent whose claim the plan capped is judged against that claim too (`_short_of_claim`): it is
slow when it delivers us under a quarter of what the plan gave each of its children (its planned
upload over its planned fan-out: about the stripe's per-child rate, as for any parent) and under
half of what the fastest of our other sources delivers (the origin aside), not a quarter.
Planned at the cap, liars take every stripe's root and most child links, so they set the median,
and a liar root's real upload was spread over its 20-30 children, each waiting on it: 20 liars
in 200 relays (1 GB, each delivering 20 MB/s) held versions 1-8 (seed 1) for 1,459.6 s in all,
322.1 s at worst (version 2; 26.8 s told the truth), and 1,123.4 and 210.7 s hiding their queue;
with the rule, 864.7 and 159.3 s, and 834.4 and 118.0 s. An honest relay whose upload the plan
capped and that has it delivers more than the plan believed of it (20 of 200 at 10 GB/s: 10.41,
9.61, 9.84 and 9.85 s for versions 1-4, as before). One that advertises more than it has (the
default `upload_bps`, 1 GB/s, among slower links) is planned as a liar is, and dropping it
helps: 20 of 200 delivering the median upload (39.3 MB/s), versions 1-4: 59.36, 66.68, 141.89
and 74.29 s against 64.25, 174.18, 181.81 and 122.89; twice it, 49.98, 45.67, 75.09 and 55.84
against 51.57, 78.19, 90.41 and 60.97; four times it, within 1.4% (40.66 against 40.11 at
version 4); with 3 in 10 relays downloading at 30 MB/s, or 60 such relays, none more than 0.4%
slower; with every relay downloading at 30 MB/s and the 20 at four times the median, version 1
took 46.32 s against 43.98 (1.05x; the others 1.01x at most; at the median, all faster). 10
liars in 1,000 relays, versions 1-3: 117.50, 94.75 and 117.55 s, as before. When our own
download binds, every parent delivers about as much, the capped ones short of their plan too:
the quarter and the fastest leave them (the 20 at 10 GB/s with every relay downloading at 30
MB/s, versions 1-4: 37.79, 41.99, 45.91 and 38.02 s, against 38.00, 41.68, 46.36 and 38.46).
Under half of the plan instead of a quarter: 918.6 and 159.3 s told, 815.3 and 129.1 s hidden,
but at 30 MB/s 40.05, 41.52, 45.63 and 46.22 s (470 drops of the honest relays at 10 GB/s as
slow at version 4 instead of 320); an eighth: 854.1 and 146.3 s, 1,029.6 and 201.2 s. Against
the fastest of our sources whose claims were not capped only (dropping a capped parent when we
measured none), at half the plan: 557.1 and 79.4 s, 580.2 and 86.5 s, but 43.35 s instead of
38.00 at 30 MB/s, version 1; with none measured keeping it, 1,573.5 and 337.6 s, 993.6 and 228.7
s; against their median, 1,591.2 and 337.6 s. A relay whose parents are all liars cannot tell
them from its own download. Not kept either: charging a capped claim the whole of its wait
beyond its report where we are a leaf of it (without this rule: 1,355.6 and 304.1 s told,
1,252.2 and 307.6 s hidden), and the origin feeding the first uncapped child of a capped root as
it feeds the first child of a slow root (no change).
Nor a floor whatever our other sources deliver: a capped claim under a sixteenth of what the
plan gave each child, by our clock (its whole wait counted) once 16 of its chunks were timed.
Versions 1-8: told 660.0 s in all, 101.1 s at worst (864.7 and 159.3 without it); hidden 785.5
and 107.9 s (834.4 and 118.0). But a relay downloading at home-link speeds takes every capped
parent for a liar: 100 relays, 1 GB, each downloading at 2 MB/s, 30 of them capped and honest
(they hold the interior of every stripe, so all of a relay's sources are capped claims), 1,320.7
s at version 1 instead of 504.2, 3,460 drops as slow instead of none; 10 of them, 1,061.6 s
instead of 510.0. Sparing it where a source whose claim was not capped is as slow (our download
binds) mended the 10 at version 1 (514.8 s) but not at 4 (628.4 s against 517.0), and left the
30 as they were; judged by the rate the median rule judges, the simulator ran the 30 for 11
minutes without finishing.

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
The same holds for every child of a root that is its stripe's only forwarder (no other member
of the stripe has children: small memberships, one member per stripe, `_root_forwards_alone`):
nobody but the origin can replace it, and it is judged against the plan (`_short_of_plan`): it
is slow when the share of its stripe's planned capacity it delivers is under half the share our
parents in the other stripes deliver of theirs, and its rate under half the fastest of theirs
(our own download may be what binds them all). Comparing rates as such, as for other parents,
never found a relay that advertised far more than it delivered (the wire admits 2^64 - 1 bytes/s)
slower than honest members of a small network, each of which feeds its children at its own few
MB/s; and with no replacement it could not be dropped at all: 8 relays, 1 GB, one of them
claiming 2^64 - 1 and delivering 20 MB/s, planned as the only forwarder of a stripe of most of
the chunks, took 350 s instead of 5.1 s; with the rule (and `relay.planner.ADVERTISED_CAP`),
11.4 s (`tests/relay/test_advertised_extremes.py`).

Whatever dropped our chain (a stall included), the origin is asked only after others when it
is not our planned parent (`_instead_of_origin`): a chain member dropped as slow, a peer we
measured that holds the whole version, then members ranked before us in the stripe (their
ancestors unchecked: the one we dropped is likely theirs too, and busy rather than hung), until
`ORIGIN_SPARE_TRIES` peers failed the chunk. A parent that answers "unavailable" (it did not get
the chunk within its wait limit) is asked again, `PARENT_REASKS` times, before its ancestors: it
is alive and behind, and its ancestors are what feeds it. Measured (`sim run broadcast`, 10 GB,
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

from relay.planner import Membership, StripePlan

if TYPE_CHECKING:
    from relay.transfer import TransferConfig
    from relay.transfer_state import _Version

SLOW_RATIO = 0.5  # a parent delivering under half the median of our other sources (and of the plan) is slow
FASTEST_RATIO = 0.25  # ... or under a quarter of the fastest of them (and half the plan): liars hide from the median
CLAIM_RATIO = 0.25  # a capped claim delivering under a quarter of what the plan gave each child (and half the fastest)
SLOW_MIN_SAMPLES = 3  # chunks timed before a peer's delivery is judged
WAIT_EWMA = 0.3  # as `relay.transfer.RATE_EWMA`: a source's waits beyond its reports (`_unexcused_s`)
ENDGAME_MIN_STRIPES = 4  # a plan of fewer stripes (one tree) has no endgame: no stripe lags the others
# stand-ins that answered "unavailable" for a chunk before the origin is asked (a hung one is dropped, not counted)
ORIGIN_SPARE_TRIES = 2
PARENT_REASKS = 2  # "unavailable" answers from our parent for one chunk before we ask elsewhere
DRAW_PLANS = 4  # plans whose members' substitute order (`_by_draw`) a core keeps


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
    _samples: dict[str, int]
    _waits: dict[str, float]
    _banned: set[str]
    _slow: set[str]
    _draw_orders: dict[StripePlan, dict[int, tuple[str, ...]]]  # `_by_draw`'s, for our current membership

    if TYPE_CHECKING:  # what these call on the core (`relay.transfer.TransferCore` or another of its mixins)
        def _usable(self, now: float, peer: str) -> bool: ...
        def _next_index(self, v: _Version, stripe: int) -> tuple[int | None, bool]: ...

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

    def _delivers_too_little(self, now: float, v: _Version, stripe: int, peer: str) -> bool:
        """Whether `peer`, our parent in `stripe`, delivers less than half of what our other
        sources of this version deliver to us (the median, over at least 3 of them), or less
        than a quarter of what the fastest of them but the origin delivers (see the top), and
        less than half of the stripe's planned rate (capacity / members, and no more than the
        origin feeds the stripe: `_stripe_feed_bps`) too, and some member other than the origin
        could replace it. Judged on measured delivery, never on what the peer
        advertises; relative to our other sources, so our own slow download does not make every
        parent look slow. The origin is never replaced, and takes over from a slow parent only
        for the first-ranked child of a slow stripe root (see the top: a sixteenth of a copy) and
        for the children of a root that is its stripe's only forwarder, judged against the plan
        instead (`_short_of_plan`)."""
        if v.plan is None:
            return False
        chain = v.chains[stripe]
        if not chain or chain[0] != peer or peer == v.plan.origin or self._samples.get(peer, 0) < SLOW_MIN_SAMPLES:
            return False
        rate = self._rates[peer]
        planned = min(v.plan.capacity_bps[stripe] / max(len(self._members), 1), self._stripe_feed_bps(v.plan))
        if rate * self.config.window_per_source >= SLOW_RATIO * planned:
            return False  # (each request's time includes its queue behind our others to this peer)
        if self._root_forwards_alone(v.plan, stripe, peer):
            return self._short_of_plan(v, stripe, peer) and self._usable(now, v.plan.origin)
        origin, rates, samples = v.plan.origin, self._rates, self._samples
        others = sorted((rates[p], p == origin) for p in v.sources
                        if p != peer and samples.get(p, 0) >= SLOW_MIN_SAMPLES)
        fastest = max((r for r, from_origin in others if not from_origin), default=0.0)  # the origin aside
        if self._short_of_claim(v, stripe, peer, rate, fastest) or len(others) >= 3 and (
                rate < SLOW_RATIO * others[len(others) // 2][0] or rate < FASTEST_RATIO * fastest):
            return self._replaceable(now, v.plan, stripe, peer)
        return False

    def _stripe_feed_bps(self, plan: StripePlan) -> float:
        """The rate a stripe enters the network at: the origin's advertised upload over the
        stripes (inf when we do not know it, or it advertises none), and no more than the
        origin delivers us (a window of requests), once we timed `SLOW_MIN_SAMPLES` of its
        chunks: an origin that advertises the default and has a home uplink measures its
        upload only once every slot is busy, and we know it sooner. No member can forward a
        stripe faster than the origin feeds it (see the top)."""
        upload = self._members.uploads.get(plan.origin, 0.0)
        feed = upload / plan.stripes if upload > 0 else math.inf
        if self._samples.get(plan.origin, 0) >= SLOW_MIN_SAMPLES:
            return min(feed, self._rates[plan.origin] * self.config.window_per_source)
        return feed

    def _short_of_claim(self, v: _Version, stripe: int, peer: str, rate: float, fastest: float) -> bool:
        """Whether `peer`, our parent in `stripe`, is a member whose claim the plan capped and
        delivers us (a window of requests at `rate` each) under a quarter of what the plan gave
        each of its children there (its planned upload over its planned fan-out), and under half of
        `fastest`, what the fastest of our other sources delivers, the origin aside (see the top).
        A member that delivers what the plan believed of it never falls short; when our own
        download binds, every parent delivers about as much, and none falls short of the fastest."""
        plan = v.plan
        assert plan is not None
        planned, claimed = self._members.planned, self._members.uploads
        claim = planned.get(peer, 0.0)
        if claim >= claimed.get(peer, 0.0):
            return False
        if rate * self.config.window_per_source >= CLAIM_RATIO * claim / max(plan.fanout[stripe].get(peer, 0), 1):
            return False
        return rate < SLOW_RATIO * fastest

    def _unexcused_s(self, v: _Version, stripe: int, peer: str, unexplained_s: float) -> float:
        """Of `unexplained_s` (how much longer a chunk from `peer` took by our clock than its
        bytes' time plus the queue time `peer` reported: its long poll, by its word), the part
        that counts against it: what exceeds the median of the same wait (EWMA) over our other
        sources of `v` but the origin, at least 3 of them measured; none with fewer, nor when
        `peer` waits on a feed the plan does not believe (`_fed_by_a_capped_claim`; see the
        top). Records the wait."""
        waits, samples, origin = self._waits, self._samples, v.plan.origin if v.plan is not None else None
        unexplained_s = unexplained_s if unexplained_s > 0 else 0.0  # (a report longer than our clock's)
        old = waits.get(peer)
        waits[peer] = unexplained_s if old is None else (1 - WAIT_EWMA) * old + WAIT_EWMA * unexplained_s
        if self._fed_by_a_capped_claim(v, stripe, peer):
            return 0.0
        others = sorted(w for p, w in waits.items()  # (per chunk: sorted only when it may count)
                        if p != peer and p != origin and p in v.sources and samples.get(p, 0) >= SLOW_MIN_SAMPLES)
        if len(others) < 3:
            return 0.0
        return max(unexplained_s - others[len(others) // 2], 0.0)

    def _fed_by_a_capped_claim(self, v: _Version, stripe: int, peer: str) -> bool:
        """Whether `peer`'s planned parent in `stripe` (not the origin) is a member whose claim
        the plan capped, `peer`'s own claim not capped: its long poll waits on a feed nobody
        believes (see the top). Every peer knows as much: the plan is drawn from the signed
        heartbeats."""
        plan = v.plan
        if plan is None or not 0 <= stripe < plan.stripes:  # (a swarm request; a stripe of an older plan)
            return False
        up = plan.parent[stripe].get(peer)
        if up is None or up == plan.origin:
            return False
        planned, claimed = self._members.planned, self._members.uploads
        if planned.get(peer, 0.0) < claimed.get(peer, 0.0):
            return False
        return planned.get(up, 0.0) < claimed.get(up, 0.0)

    def _root_forwards_alone(self, plan: StripePlan, stripe: int, peer: str) -> bool:
        """Whether `peer`, our planned parent in `stripe`, is the stripe's root and its only
        interior member: nobody but the origin can replace it."""
        ranked = plan.ranked_interior(stripe)
        return len(ranked) == 1 and ranked[0][0] == peer and plan.ancestors(stripe, self.self_id) == [peer, plan.origin]

    def _short_of_plan(self, v: _Version, stripe: int, peer: str) -> bool:
        """Whether `peer`, our source in `stripe`, delivers under half the share of its stripe's
        planned capacity that our parents in the other stripes deliver of theirs (the median,
        over at least 3 of them), and under half the rate the fastest of them delivers. For a
        stripe's only forwarder (see the top): an honest peer alone in a stripe delivers at a
        rate that is a share of what it advertised like the others, whatever the figures; one
        that advertised far more than it delivers falls short of that by the ratio of its lie.
        Rates are compared as shares of the plan, not as such: a small network's honest members
        feed their children at their own few MB/s each, and a liar delivering as much was never
        under half of their median. The fastest parent's rate is what our own download lets
        through: when it binds, every parent delivers about as much, and the one with the most
        planned capacity would look short of its plan (8 honest relays, 1 GB, one downloading
        at 5 MB/s: it dropped 3 honest forwarders 6 times, 207.7 s instead of 200.1 s; 12 and 20
        relays downloading at 20 and 30 MB/s: 38 and 37 drops, the origin uploading 8.87 and
        11.01 copies instead of 5.66 and 5.75; with the fastest's rate: no drop at 8 relays,
        200.1 s; 13 and 5 drops, 7.04 and 9.73 copies; not traced, presumably forwarders
        planned at hundreds of MB/s that their own 20-30 MB/s download holds back)."""
        plan = v.plan
        assert plan is not None
        rates, samples = self._rates, self._samples
        parents = [(rates[c[0]], plan.capacity_bps[s]) for s, c in enumerate(v.chains)
                   if s != stripe and c and c[0] != peer and samples.get(c[0], 0) >= SLOW_MIN_SAMPLES]
        if len(parents) < 3:
            return False
        rate = rates[peer]
        shares = sorted(r / capacity for r, capacity in parents)
        return rate / plan.capacity_bps[stripe] < SLOW_RATIO * shares[len(shares) // 2] and \
            rate < SLOW_RATIO * max(r for r, _ in parents)

    def _replaceable(self, now: float, plan: StripePlan, stripe: int, peer: str) -> bool:
        """Whether someone could take over from `peer`, our source in `stripe`: a substitute
        (see the top) or a usable planned ancestor other than the origin; or, for the
        first-ranked child of the stripe's root (`peer`), the origin while it is usable (it
        has no other replacement)."""
        planned = plan.ancestors(stripe, self.self_id)
        if planned and planned[0] == peer and self._first_child_of_root(plan, stripe, planned):
            return self._usable(now, plan.origin)  # only the origin can take over the stripe from its root
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
        than hung). The origin's upload is the scarcest (each stripe is sent once from it, to
        its root). When only the origin could replace a stripe root we dropped as slow (see
        the top, `_origin_replaces_root`): a measured holder of the whole version, else nobody
        (ask the origin)."""
        plan = v.plan
        assert plan is not None
        if self.self_id == plan.origin or plan.parent[stripe].get(self.self_id) == plan.origin:
            return None
        planned = plan.ancestors(stripe, self.self_id)
        slow_root = bool(planned) and planned[0] in self._slow and not self._usable(now, planned[0]) and \
            self._origin_replaces_root(plan, stripe, planned)
        if not slow_root:
            for peer in v.chains[stripe]:
                if peer in self._slow and peer not in tried and peer not in self._banned:
                    return peer
        rates = self._rates
        held = [p for p in v.holders if p in rates and p != plan.origin and p not in tried and self._usable(now, p)]
        if held:
            return max(held, key=lambda p: (rates[p], p))
        if slow_root:
            return None  # the origin feeds the first-ranked child of a slow root, or a lone root's (see the top)
        if len(tried) >= ORIGIN_SPARE_TRIES:
            return None
        if not tried:  # the pick for the stripe's next chunks, kept for one tick (`_substitute` is O(members))
            kept = v.spare.get(stripe)
            if kept is not None and kept[1] > now and (kept[0] is None or self._usable(now, kept[0])):
                return kept[0]
        below = (len(planned), self.self_id) if planned else None
        pick = self._substitute(now, plan, stripe, below, planned[0] if planned else None, avoid=tried, strict=False)
        if not tried:
            v.spare[stripe] = (pick, now + self.config.stall_timeout_s / 4)
        return pick

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
