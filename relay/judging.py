"""How a relay's transfer core judges whether a parent delivers too little (slow), with no I/O.

Mixed into `relay.transfer.TransferCore` (`SourceJudgement`): these methods read the core's
membership, the plan and measured delivery rates and waits, and change nothing but the waits
(`_unexcused_s` records each); like the core they take the time as an argument and draw nothing
at random. Who replaces a parent
judged slow is `relay.sources`' (`_replaceable`, `_substitute`, `_instead_of_origin`).

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
root, or a relay the origin replaced a root for): 12.2 s and 1.54 copies, every drop in the
first 1.2 s. Traced (11.9 s, 1.50 copies): each relay dropped 1-3 roots, every one judged
against the other roots' rates as the stripe's only forwarder (`_short_of_plan`, 4.5-35 MB/s
against a median of 50-700 MB/s, the noise above), after 3-11 of its chunks, with the origin
already timed over 4-12 chunks at 50 MB/s to 1.2 GB/s: its first chunks leave within its burst
(a second of its upload) and before its queue forms, so their time is their bytes' on a fast
link, and the EWMA still held them. A rate per request says how fast a source answers when it
answers, not how much it sends over time. So the feed is also no more than what the origin
sent us of each stripe where it is our planned parent (a root's own stripe; `_count_feed`,
`_sent_us_bps`): timed from its first chunk there, not from taking the version in (a late start,
our dial or a held send, read as a slow feed, and a slow root under a fast origin was kept where
every first answer came 1-5 s late: a 4 MiB version, the core alone); over its latest chunks
(3 a stripe), not all of them, but while those may hold its burst (within a second of its first
chunk), all it sent over a second more than it took: a burst is at most a second of upload
(`relay.serving.ByteBudget`), and timed from our first request, a capped origin's first second,
sent at once, read 2.7-3.3 MB/s for a stripe fed at 0.43 and roots were dropped again (real
relays: 11.1 s and 1.41 copies; from taking the version in, 7.7-7.8 s and 1.00 copies, by the
grace of our start's delay). Before its first chunk, none: we cannot tell its feed yet. And
no longer once it sent us our last chunk longer ago than it took to send them all: every
stripe enters the network at about one pace, so the others are in it by then, and nothing
waits on the feed; a figure kept to the end was 15 s old when a root of the `--symmetric`
world (below) kept a parent at 12.72 MB/s against 11.98 instead of 12.88. A plan that makes
the origin our parent in other stripes counts afresh.
That figure is our own stripe's feed, not the others': a capped trainer splits its uplink unevenly
(the lab, `tests/relay/test_lab_capped_origin.py`: three stripes whole by 2.6 s, three with 6 of
32 chunks; or one stripe's second chunk at 4.2 s, the others' by 0.3 s), and roots it fed slowly
were dropped (1 run in 4), also with their wait excused as far as our other roots' (1 run of 6;
twice theirs, 2 of 5). Nothing we see of that split tells such a root from one that holds its
chunks; what the origin can feed in all bounds it. So while a capped origin (feeding us under half
a stripe's planned rate) still feeds us (`_origin_feeds_us`: until our own stripes' end and as long
again), a stripe's root is judged on its bytes' time and the queue it tells, its long poll (its
word) left out (`_served_rates`); after, on its rate, waits counted. The cost: a root holding its
chunks keeps them until then, longer under a slower origin (7 and 16 relays, a root serving 0.3
MB/s under 3 MB/s: 17.51, 18.80 s, the base 17.51, 17.27; 0.1 under 1: 43.37, 57.06 (25.02, 48.55)).
Peers that crowd the origin lower what it delivers us, and excuse our parents more: still
only those delivering half of it. A root whose download binds measures the origin's feed as
its own share of that download, as every parent of ours delivers it then.
Where the origin feeds each stripe faster than the stripe's capacity over the members, nothing
changes (`sim run broadcast`, 1,000 relays, seed 1: 20.276155 s, every relay's time the same;
`--symmetric`, every upload alike and 10% of relays at half theirs: 80.032839 s, as with no
feed figure: with one timed until the end, 80.034058).

The origin itself is judged where the plan made it our parent and a member forwards the stripe
(`_origin_feeds_too_little`): it is never dropped (it holds every chunk first, and feeds the
stripes' roots), but when it delivers us under half of what the stripe's forwarders could give
each member by their planned uploads, we take that stripe from a forwarder instead
(`relay.sources`, `_leave_origin`), its first forwarder aside, which keeps taking it from the
origin. A trainer started without `--upload-bps` advertises the default (1 GB/s) on whatever
uplink it has; among relays advertising their caps the plan took it for the fastest member by far
and made it the parent of 5 of the 6 members in every stripe, and nothing moved them off it: the
lab (6 relays of 28-46 MB/s, the origin's link 3 MB/s, 24 MiB in 64 KiB chunks) took 42.8 s and
the origin served 5.00 copies (the simulator: 41.9 s, 5.00); now 9.6 s and 1.14 copies in the
simulator, the copies past one being the requests every relay had sent it before timing 3 of its
chunks (16 relays of 3-25 MB/s: 112.9 s and 13.46 copies -> 14.2 s and 1.64). A fast origin, or
one whose children's downloads bind, delivers more than the members could give and is kept
(the same relays under a 1 GB/s origin telling the truth: 5.00 copies, its bytes' time, as before).
A forwarder we took in its place is judged from its first chunk against what the origin
delivered us (`_short_of_origin`): one that delivers what the plan counts on delivers at least
twice that; one that does not drew our requests away from the origin, and judged as any parent,
after 3 chunks shared by all who moved to it, a forwarder sending 20 KB/s held each of 5
members for 38-55 s (the version: 55.3 s against 43.3 s with the origin kept).

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

A root that is its stripe's only forwarder, as a slow root is, can be replaced only by the origin (no other member
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
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any

from relay.planner import Membership, StripePlan
from relay.transfer_state import _Feed

if TYPE_CHECKING:
    from relay.transfer import TransferConfig
    from relay.transfer_state import _Version

SLOW_RATIO = 0.5  # a parent delivering under half the median of our other sources (and of the plan) is slow
FASTEST_RATIO = 0.25  # ... or under a quarter of the fastest of them (and half the plan): liars hide from the median
CLAIM_RATIO = 0.25  # a capped claim delivering under a quarter of what the plan gave each child (and half the fastest)
SLOW_MIN_SAMPLES = 3  # chunks timed before a peer's delivery is judged
FEED_BURST_S = 1.0  # an uplink's burst, as our own upload budget's (`relay.serving.ByteBudget`): the origin's feed
WAIT_EWMA = 0.3  # as `relay.transfer.RATE_EWMA`: a source's waits beyond its reports (`_unexcused_s`)


class SourceJudgement:
    """Slow-parent judgement for `relay.transfer.TransferCore` (see the module docstring)."""

    # the core's state these methods read (`TransferCore.__init__` sets it)
    config: TransferConfig
    self_id: str
    _members: Membership
    _rates: dict[str, float]
    _served_rates: dict[str, float]
    _samples: dict[str, int]
    _waits: dict[str, float]

    if TYPE_CHECKING:  # what these call on the core (`relay.transfer.TransferCore` or another of its mixins)
        def _usable(self, now: float, peer: str) -> bool: ...
        def _replaceable(self, now: float, plan: StripePlan, stripe: int, peer: str) -> bool: ...
        def _forwarders(self, plan: StripePlan, stripe: int) -> tuple[tuple[str, ...], int]: ...
        def _lost_lone_root(self, now: float, plan: StripePlan, stripe: int, planned: list[str],
                            passed: Any = ()) -> bool: ...
        def _passed_over(self, now: float, v: _Version, stripe: int) -> set[str]: ...

    def _delivers_too_little(self, now: float, v: _Version, stripe: int, peer: str) -> bool:
        """Whether `peer`, our parent in `stripe`, delivers less than half of what our other
        sources of this version deliver to us (the median, over at least 3 of them), or less
        than a quarter of what the fastest of them but the origin delivers (see the top), and
        less than half of the stripe's planned rate (capacity / members, and no more than the
        origin feeds the stripe: `_stripe_feed_bps`) too, and some member other than the origin
        could replace it. Judged on measured delivery, never on what the peer
        advertises; relative to our other sources, so our own slow download does not make every
        parent look slow. The origin is never replaced, and takes over from a slow parent only
        for the first-ranked child of a slow stripe root (`relay.sources`: a sixteenth of a copy) and
        for the children of a root that is its stripe's only forwarder, judged against the plan
        instead (`_short_of_plan`)."""
        if v.plan is None:
            return False
        chain = v.chains[stripe]
        if not chain or chain[0] != peer or peer == v.plan.origin:
            return False
        if chain[1:] == [v.plan.origin] and v.plan.parent[stripe].get(self.self_id) == v.plan.origin:
            return self._short_of_origin(now, v, peer)  # (a forwarder taken in place of the origin)
        if self._samples.get(peer, 0) < SLOW_MIN_SAMPLES:
            return False
        rate, share, feed = self._rates[peer], v.plan.capacity_bps[stripe] / max(len(self._members), 1), \
            self._stripe_feed_bps(now, v)
        if feed < SLOW_RATIO * share and v.plan.parent[stripe].get(peer) == v.plan.origin and \
                self._origin_feeds_us(now, v):
            rate = self._served_rates[peer]  # (a root under a capped origin that still feeds us: see the top)
        if rate * self.config.window_per_source >= SLOW_RATIO * min(share, feed):
            return False  # (each request's time includes its queue behind our others to this peer)
        if self._root_forwards_alone(v.plan, stripe, peer):
            return self._short_of_plan(v, stripe, peer, rate) and self._usable(now, v.plan.origin)
        origin, rates, samples = v.plan.origin, self._rates, self._samples
        others = sorted((rates[p], p == origin) for p in v.sources
                        if p != peer and samples.get(p, 0) >= SLOW_MIN_SAMPLES)
        fastest = max((r for r, from_origin in others if not from_origin), default=0.0)  # the origin aside
        if self._short_of_claim(v, stripe, peer, rate, fastest) or len(others) >= 3 and (
                rate < SLOW_RATIO * others[len(others) // 2][0] or rate < FASTEST_RATIO * fastest):
            return self._replaceable(now, v.plan, stripe, peer)
        return False

    def _origin_feeds_too_little(self, v: _Version, stripe: int) -> bool:
        """Whether the origin, our planned parent in `stripe`, delivers us (a window of requests)
        under half of what the stripe's forwarders (`relay.sources`, `_forwarders`) could give
        each member by the uploads the plan counts on, once `SLOW_MIN_SAMPLES` of its chunks are
        timed, and we are not a forwarder that takes the stripe from the origin whatever it
        delivers (see the top: an origin that advertises more than it has). Judged on measured
        delivery against the members' own planned uploads: a fast origin, or one whose child's
        download binds, delivers more than the members could give, and is kept."""
        plan = v.plan
        if plan is None or not 0 <= stripe < plan.stripes or self.config.layout != "striped":
            return False  # (the baselines, a star and one tree, keep their shape)
        origin = plan.origin
        if plan.parent[stripe].get(self.self_id) != origin or self._samples.get(origin, 0) < SLOW_MIN_SAMPLES:
            return False
        forwarders, keepers = self._forwarders(plan, stripe)
        if not forwarders or self.self_id in forwarders[:keepers]:
            return False
        planned = self._members.planned
        members_bps = sum(planned.get(p, 0.0) for p in forwarders) / max(len(self._members), 1)
        return self._rates[origin] * self.config.window_per_source < SLOW_RATIO * members_bps

    def _short_of_origin(self, now: float, v: _Version, peer: str) -> bool:
        """Whether `peer`, a forwarder we took in place of the origin (`relay.sources`,
        `_leave_origin`), delivers us less than the origin did when we left it, from its first
        timed chunk on, and the origin can take the stripe back (see the top). One delivering
        what the plan counts on delivers at least twice that: we left an origin delivering
        under a quarter of the forwarders' planned upload per member."""
        origin = v.plan.origin  # type: ignore[union-attr]
        return self._rates[peer] < self._rates.get(origin, 0.0) and self._usable(now, origin)

    def _stripe_feed_bps(self, now: float, v: _Version) -> float:
        """The rate a stripe of `v` enters the network at: the origin's advertised upload over
        the stripes (inf when we do not know it, or it advertises none), and no more than the
        origin delivers us (a window of requests), once we timed `SLOW_MIN_SAMPLES` of its
        chunks, nor than it sent us of each stripe where it is our planned parent
        (`_sent_us_bps`): an origin that advertises the default and has a home uplink measures
        its upload only once every slot is busy, and its first chunks, sent within its burst,
        time it as fast as the default (see the top). No member can forward a stripe faster
        than the origin feeds it."""
        plan = v.plan
        assert plan is not None
        upload = self._members.uploads.get(plan.origin, 0.0)
        feed = upload / plan.stripes if upload > 0 else math.inf
        if self._samples.get(plan.origin, 0) >= SLOW_MIN_SAMPLES:
            feed = min(feed, self._rates[plan.origin] * self.config.window_per_source)
        return min(feed, self._sent_us_bps(now, v))

    def _sent_us_bps(self, now: float, v: _Version) -> float:
        """What the origin sent us of each stripe where it is our planned parent (`_count_feed`):
        the bytes of its latest chunks there (`SLOW_MIN_SAMPLES` a stripe after the first kept)
        over the time since the first kept came, or while that one came within `FEED_BURST_S`
        of its first, all it sent there over the time since its first came plus `FEED_BURST_S`
        (a burst counts as that much of the feed). None (0) while we wait on its first; inf
        where it is none of our planned parents, and once it sent us the last of them longer
        ago than it took to send them all: the other stripes are in the network by then (see
        the top)."""
        plan, feed = v.plan, v.feed
        assert plan is not None
        key = self._fed_stripes(plan)
        if not key[1]:
            return math.inf
        waiting = any(v.link_load.get((plan.origin, s), 0) for s in key[1])
        if feed is None or feed.key != key:
            return 0.0 if waiting else math.inf
        latest, first_at = feed.latest, feed.first_at
        end = latest[-1][0]
        if not waiting and now - end > end - first_at:
            return math.inf
        if latest[0][0] - first_at < FEED_BURST_S:  # (the burst may be in it)
            sent = feed.sent / (end - first_at + FEED_BURST_S)
        else:
            sent = (sum(size for _, size in latest) - latest[0][1]) / max(end - latest[0][0], 1e-9)
        return sent / len(key[1])

    def _count_feed(self, now: float, v: _Version, stripe: int, peer: str, size: int) -> None:
        """Count a chunk of `size` bytes `peer` sent us in `stripe` towards the origin's feed
        (`_sent_us_bps`) if `peer` is the origin and our planned parent there (a root's
        stripe; not a stripe we took from it in place of another). A plan in which the
        origin is our planned parent in other stripes starts the count afresh."""
        plan = v.plan
        if plan is None or peer != plan.origin or not 0 <= stripe < plan.stripes or \
                plan.parent[stripe].get(self.self_id) != peer:
            return
        feed, key = v.feed, self._fed_stripes(plan)
        if feed is None or feed.key != key:
            feed = v.feed = _Feed(key, now, deque(maxlen=SLOW_MIN_SAMPLES * len(key[1]) + 1))
        feed.latest.append((now, size))
        feed.sent += size

    def _fed_stripes(self, plan: StripePlan) -> tuple[int, tuple[int, ...]]:
        """`plan`'s stripe count and the stripes where the origin is our planned parent."""
        return plan.stripes, tuple(s for s in range(plan.stripes) if plan.parent[s].get(self.self_id) == plan.origin)

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

    def _origin_feeds_us(self, now: float, v: _Version) -> bool:
        """Whether the origin may still be feeding the stripes of `v`, by what it feeds us where it
        is our planned parent: while we wait on it there, and until it sent us our last chunk there
        longer ago than it took to send them all, the horizon past which `_sent_us_bps` no longer
        counts its feed. Not where it is none of our planned parents: we cannot tell its pace (see
        the top)."""
        return self._sent_us_bps(now, v) < math.inf

    def _root_forwards_alone(self, plan: StripePlan, stripe: int, peer: str) -> bool:
        """Whether `peer`, our planned parent in `stripe`, is the stripe's root and its only
        interior member: nobody but the origin can replace it."""
        ranked = plan.ranked_interior(stripe)
        return len(ranked) == 1 and ranked[0][0] == peer and plan.ancestors(stripe, self.self_id) == [peer, plan.origin]

    def _short_as_stand_in(self, now: float, v: _Version, stripe: int, peer: str) -> bool:
        """Whether `peer`, whom we ask for `stripe` in place of the stripe's lost lone root (a
        stand-in, `relay.sources`; our parent in its own stripe), delivers us too little there,
        judged as that root was (`_delivers_too_little`, `_short_of_plan`) on what it delivered
        of this stripe alone (`_Version.link_rates`, `SLOW_MIN_SAMPLES` chunks timed): a stand-in
        that kept the slow root it stands in for, or that forwards the stripe slowly, is passed
        over there in turn (for the next earlier child, then the origin, while usable)."""
        plan = v.plan
        link = v.link_rates.get((peer, stripe))
        if plan is None or link is None or link[1] < SLOW_MIN_SAMPLES:
            return False
        planned_chain = plan.ancestors(stripe, self.self_id)
        passed = self._passed_over(now, v, stripe) if v.passed else ()
        if not self._lost_lone_root(now, plan, stripe, planned_chain, passed):
            return False
        rate = link[0]
        planned = min(plan.capacity_bps[stripe] / max(len(self._members), 1), self._stripe_feed_bps(now, v))
        if rate * self.config.window_per_source >= SLOW_RATIO * planned:
            return False
        return self._short_of_plan(v, stripe, peer, rate) and self._usable(now, plan.origin)

    def _short_of_plan(self, v: _Version, stripe: int, peer: str, rate: float | None = None) -> bool:
        """Whether `peer`, our source in `stripe`, delivers (at `rate`, or its rate per peer)
        under half the share of its stripe's planned capacity that our parents in the other stripes deliver of theirs (the median,
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
        rate = rates[peer] if rate is None else rate
        shares = sorted(r / capacity for r, capacity in parents)
        return rate / plan.capacity_bps[stripe] < SLOW_RATIO * shares[len(shares) // 2] and \
            rate < SLOW_RATIO * max(r for r, _ in parents)
