"""Who fetches which chunk from whom: striped, capacity-weighted relay trees (pure functions).

Theory of operation. A single k-ary tree is about k times slower than the lower bound
(DESIGN.md, principle 4): leaves upload nothing. We cut the checkpoint into K stripes (sets of
chunks) and build one tree per stripe, every tree rooted at the origin (the publisher) and
spanning every other member. Each member is *interior* in exactly one tree, its home stripe,
and a leaf in the others, so every member's upload carries one stripe to others.

Balancing, from advertised upload capacities u_p (bytes/s), each at most `ADVERTISED_CAP` times the
membership's median (`Membership.planned`: an advertised figure is a stranger's claim):

1. Home stripes: members in descending capacity are dealt to the stripe with the least capacity
   so far (LPT scheduling), so the stripes' interior capacities are nearly equal.
2. Fan-out: stripe s has capacity c_s = sum of its interior uploads + U_origin/K and must reach
   N members, so each child could be fed at R_s = c_s / N. A member's fan-out is floor(u_p / R)
   for the largest R <= R_s whose floors still give N slots, so no parent feeds a child slower
   than R (rounding a slow parent up would make its whole subtree the stripe's straggler). The
   stripe then takes about S_s / R seconds.
3. Shape: children are attached breadth-first to parents in descending capacity, interior
   members first, so the fast members sit near the root and trees stay shallow; then the
   leaves: fastest first in plans dealt by capacity (under 64 members, and the `striped-v1`
   baseline, where slowest first made 1,000 relays 1.03x -> 1.71x the bound), slowest first in
   stable plans. A relay's download tends to grow with its upload (the simulator caps
   it at 4x), so the slowest leaves are likely the slowest downloaders, which need every stripe
   fed at their share of their download from the start: attached last they got the deepest,
   slowest interior members, whose own copy of their home stripe arrives late (their download
   is shared among every stripe), and set the time to all (2,000 relays, 10 GB: the last 1% sat
   at depth 3.9 under parents of 25 MB/s that completed at 103 s, against depth 3.0 and 736
   MB/s for the median relay; 10,000 relays: 1.455x the bound before, 1.224x after). A fast
   leaf, with download to spare, catches up from a deep parent. The price: the slowest leaves
   now share fast forwarders with dozens of others, served after those forwarders' interior
   children (1,000 relays, 1 GB, exact views: 1.04x -> 1.09x). Slots a fast origin has left
   over after the interior members go to the fastest leaves first: given to the slowest, one
   slow relay held an origin slot in every stripe and drained it at its own download's pace
   (seen while plans under 64 members took the rule: 32 relays, 1 GB, up to 1.46x).
4. Chunks: stripe s gets a share of the chunks proportional to c_s (largest remainder),
   interleaved so every stripe advances through the file at once. Stable plans (below) give
   every stripe an equal share, except a stripe whose integer fan-outs waste a real part of its
   capacity (small fan-outs, as with equal uploads): its share follows its per-child rate R.
   One deal for all of them, so views differing by a few members agree on almost every chunk
   (`_stable_chunks`).

With more members than it serves at once (`ORIGIN_SLOTS`), the origin is planned with at most the
same ceiling as any member (`Membership.ceiling`, applied in `plan_broadcast`), although its figure
is no stranger's claim: what it can serve at once is not its link. It serves at most
`RelayConfig.max_concurrent_uploads` (16) chunks at once, each to one child over one connection,
which carries what the child's download and the connection's window allow, not the origin's link
divided among them; counting each such flow at about the median member's upload,
16 of them deliver about `ADVERTISED_CAP` x the median. Planned with its whole advertised link, a
datacenter origin far faster than the relays took most members as its own children in every stripe
(at 200 relays, 800 Gbit/s: 139-154 of 200 per stripe), each drained through one window- and
download-limited flow while 16 (48 with lingering) were served at once: it delivered mostly 0.7-4
GB/s of the 100 GB/s planned, served a copy to nearly every relay, and the broadcast took 2.9x the
bound (6.4 Tbit/s: 4.1x; 1,000 relays at 800 Gbit/s 5.6x, at 6.4 Tbit/s 21.9x), where a 10 Gbit/s
origin took 1.01x. Capped, such an origin is planned as one of 16x the median (about 16 Gbit/s
against relays of 0.1-10 Gbit/s), the members carry the stripes, and every origin from 10 Gbit/s to
6.4 Tbit/s takes 1.01-1.02x at 200 and 1,000 relays (`p2pnet sim run broadcast`, seed 1). What it
has beyond the plan it still serves: in the endgame and to those that fetch from it directly. With
no more members than it serves at once, each can have a flow of its own and the whole figure is
kept: capped, `benchmarks/bench_relay_liars.py`'s 8 relays of 12.5-125 MB/s under a 1.25 GB/s origin
(no windows, unlimited downloads) took 6.13 s instead of 5.16 s against a 4.82 s bound. The price
that remains, where flows are not limited: 200 relays with exact views, no windows and unlimited
downloads under an 800 Gbit/s origin: 4.30 s -> 6.94 s (a 10 Gbit/s origin: 6.89 s).

With balanced stripes every stripe finishes at about N*S/(U_origin + sum u_p), the lower bound,
plus a pipelining term (tree depth x one chunk time, since each chunk is forwarded as soon as
it is verified). `lower_bound_s` gives the bound the simulator reports against.

Plans are cached: many simulated peers sharing one `Membership` object compute a plan once.
This module is pure: no I/O, no clock, no randomness (ties are broken by hashed peer ids).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterable, Mapping

import blake3


#: a stable plan needs this many members per stripe: home stripes drawn by hash leave fewer
#: unevenly loaded (at 32 per stripe, log-uniform uploads over 100x give stripes within about
#: 20% of each other); smaller networks are dealt by capacity (their views rarely disagree)
STABLE_MIN_MEMBERS_PER_STRIPE = 32
#: when the members' uploads are at least this share of a stripe's capacity, the origin sends the
#: stripe once (to its root) and the members carry it on: the origin's upload is the scarcest
#: (every version starts there) and what it would add is under 1/(share) - 1 of the stripe's rate
MEMBERS_CARRY_SHARE = 0.8
#: a stable plan weighs its stripes' chunk counts by their per-child rates only when some stripe's
#: rate is below this share of its capacity / N (see `_stripe_weights`)
FANOUT_LOSS = 0.9
#: a stable plan whose members' fan-outs are all at most this many times its stripe count (about
#: equal uploads: each feeds about K children, against dozens for fast members when uploads
#: differ) says so (`StripePlan.small_fanouts`): there a forwarder serves all its children at
#: once (`relay.effects.ServeAtOnce`). It changes only our own upload slots, never which chunk
#: is in which stripe, so views that disagree on it still agree on the chunks.
SMALL_FANOUT = 2
#: a stable plan has at least this many chunks per stripe: with fewer, a stripe's pipeline fill
#: (about fan-out x depth chunk times) and its chunk count rounded to whole chunks set its time,
#: not its bulk (measured at N = 1,023, equal uploads, 64 chunks: 16 stripes 2.05x the optimum,
#: 4 stripes 1.22x; 1,000 relays with a tenth of them slow keep 16 stripes of 15 chunks: with 8
#: the slow relays cost 1.76x instead of 1.26x; see docs/experiments.md section 6)
MIN_CHUNKS_PER_STRIPE = 12
#: a member is planned with at most this many times the (lower) median upload its membership's
#: serving members advertise (`Membership.planned`). An advertised upload is a stranger's claim
#: (its heartbeat's `Capacity.upload_bps`, any integer up to 2^64 - 1): uncapped, one relay
#: claiming 2^64 - 1 was planned as the only forwarder of its stripe, parent of every member,
#: with a share of the chunks in proportion to its claim (all 256 of them at 8 members, half at
#: 200), and fed everyone at the rate it really delivers. Honest uploads differ by less: the
#: simulator's default draws span 100x, so within 10x of the median at scale. An honest member
#: faster than the cap is planned below its upload (it still serves what it holds, in the
#: endgame and to those that measured it). Lower caps bound a liar more (a relay claiming
#: 2^64 - 1 and delivering 20 MB/s, 200 relays, 1 GB, with the slow-root rules of
#: `relay.sources`: cap 4: 46.7 s, 16: 81.5 s, 64: 146.9 s; 25.8 s without the lie; with its
#: quarter-of-the-fastest-member rule and capped claims borrowed from last: 46.7, 78.7 and 149.3 s, and
#: with 20 such liars 65.1, 80.1 and 325.6 s instead of 111.9, 263.2 and 478.2 s; 26.6 s told the truth).
ADVERTISED_CAP = 16

#: The chunks an origin serves at once (`RelayConfig.max_concurrent_uploads`' default): with more
#: members than this, the origin is planned at most at the members' ceiling (see the top). A
#: constant, not the origin's setting, so that every relay plans alike.
ORIGIN_SLOTS = 16


@dataclass(frozen=True, eq=False)
class Membership:
    """The peers taking part in a broadcast and their upload capacities (bytes/s).

    Compared and hashed by a digest of its contents, computed once, so a plan cache keyed by
    membership costs O(1) per lookup even with 10,000 members.
    """

    uploads: Mapping[str, float]
    digest: bytes = field(default=b"")

    @classmethod
    def of(cls, uploads: Mapping[str, float]) -> Membership:
        items = sorted((p, float(u)) for p, u in uploads.items())
        bad = [p for p, u in items if not 0.0 <= u < math.inf]
        if bad:  # (the wire's Capacity is a non-negative int: a caller's mistake)
            raise ValueError(f"upload of {bad[0]} must be finite and >= 0, got {dict(items)[bad[0]]}")
        h = blake3.blake3()
        for peer, upload in items:
            h.update(f"{peer}={upload!r};".encode())
        return cls(dict(items), h.digest())

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Membership) and other.digest == self.digest

    def __len__(self) -> int:
        return len(self.uploads)

    @property
    def planned(self) -> Mapping[str, float]:
        """The uploads plans are built with: each at most `ADVERTISED_CAP` times the lower median
        of the uploads > 0 (serving members), so that no member's claim outweighs many honest
        ones. Members advertising more than half of the serving members could still move the
        median. Computed once; the same mapping as `uploads` when nobody is capped."""
        kept = self.__dict__.get("_planned")
        if kept is None:
            ceiling = self.ceiling
            kept = self.uploads if all(u <= ceiling for u in self.uploads.values()) else \
                {p: min(u, ceiling) for p, u in self.uploads.items()}
            object.__setattr__(self, "_planned", kept)
        return kept

    @property
    def ceiling(self) -> float:
        """The most upload a plan counts on from one member (bytes/s): `ADVERTISED_CAP` times the
        lower median of the uploads > 0 (inf when nobody serves). Computed once."""
        kept = self.__dict__.get("_ceiling")
        if kept is None:
            serving = sorted(u for u in self.uploads.values() if u > 0)
            kept = ADVERTISED_CAP * serving[(len(serving) - 1) // 2] if serving else math.inf
            object.__setattr__(self, "_ceiling", kept)
        return kept

    def __contains__(self, peer: object) -> bool:
        return peer in self.uploads

    def serves_as(self, other: Membership) -> bool:
        """Whether `other` has the same members as this one, and the same of them may serve
        (advertise an upload > 0): only their figures differ. O(N) once per pair, then kept
        (every relay of a simulated world is handed one of the same few memberships)."""
        kept = self.__dict__.get("_serves_as")
        if kept is None:
            kept = {}
            object.__setattr__(self, "_serves_as", kept)
        same = kept.get(other.digest)
        if same is None:
            same = kept[other.digest] = self._serving() == other._serving()
        return same

    def _serving(self) -> tuple[frozenset[str], frozenset[str]]:
        """Who is a member and who may serve; computed once."""
        kept = self.__dict__.get("_serving_sets")
        if kept is None:
            kept = (frozenset(self.uploads), frozenset(p for p, u in self.uploads.items() if u > 0))
            object.__setattr__(self, "_serving_sets", kept)
        return kept


@dataclass(frozen=True, eq=False)
class StripePlan:
    """The trees of one broadcast. `parent[s][p]` is p's parent in stripe s's tree."""

    origin: str
    stripes: int
    home: Mapping[str, int]
    parent: tuple[Mapping[str, str], ...]
    fanout: tuple[Mapping[str, int], ...]
    stripe_of_chunk: tuple[int, ...]
    chunks_of_stripe: tuple[tuple[int, ...], ...]
    capacity_bps: tuple[float, ...]
    #: every member's fan-out is small (at most `SMALL_FANOUT` x the stripes: about equal uploads)
    small_fanouts: bool = False

    def ancestors(self, stripe: int, peer: str) -> list[str]:
        """p's parent, grandparent, ... up to the origin in `stripe`; [] if p is not planned."""
        chain: list[str] = []
        parents = self.parent[stripe]
        current = parents.get(peer)
        while current is not None and len(chain) <= len(parents):
            chain.append(current)
            current = parents.get(current)
        return chain

    def depth(self, stripe: int, peer: str) -> int:
        return len(self.ancestors(stripe, peer))

    def children(self, stripe: int, peer: str) -> list[str]:
        """`peer`'s children in `stripe` (the index is built once per plan, O(N))."""
        index = self.__dict__.get("_children")
        if index is None:
            index = [{} for _ in range(self.stripes)]
            for s, parents in enumerate(self.parent):
                for child, parent in parents.items():
                    index[s].setdefault(parent, []).append(child)
            object.__setattr__(self, "_children", index)
        return sorted(index[stripe].get(peer, ()))

    def interior(self, stripe: int) -> list[str]:
        return sorted(p for p, _ in self.ranked_interior(stripe))

    def ranked_interior(self, stripe: int) -> tuple[tuple[str, int], ...]:
        """`stripe`'s interior members (those with children) and their depths, by (depth, peer id).

        This rank orders substitute parents (see `relay.transfer`): a peer only ever borrows a
        parent ranked before itself, and plan parents are shallower than their children, so
        parent links, planned or borrowed, never form a cycle. Built once per plan, O(N)."""
        index = self.__dict__.get("_ranked")
        if index is None:
            index = [[] for _ in range(self.stripes)]
            for p, s in self.home.items():
                if self.fanout[s].get(p, 0) > 0:
                    index[s].append((p, self.depth(s, p)))
            index = [tuple(sorted(members, key=lambda m: (m[1], m[0]))) for members in index]
            object.__setattr__(self, "_ranked", index)
        return index[stripe]

    def interior_rank(self, stripe: int) -> Mapping[str, int]:
        """Each interior member of `stripe` -> its position in `ranked_interior(stripe)`.
        Built once per plan and stripe, O(N)."""
        ranks = self.__dict__.get("_ranks")
        if ranks is None:
            ranks = [None] * self.stripes
            object.__setattr__(self, "_ranks", ranks)
        rank = ranks[stripe]
        if rank is None:
            rank = ranks[stripe] = {p: i for i, (p, _) in enumerate(self.ranked_interior(stripe))}
        return rank

    def ranked_before(self, stripe: int, below: tuple[int, str]) -> int:
        """How many interior members of `stripe` rank before `below` = (depth, peer id)."""
        return bisect_left(self.ranked_interior(stripe), below, key=lambda m: (m[1], m[0]))


def plan_broadcast(origin: str, origin_upload_bps: float, members: Membership, chunk_count: int,
                   stripes: int, salt: bytes = b"", stable: bool = False) -> StripePlan:
    """The striped trees for sending `chunk_count` chunks from `origin` to every member.

    `stable` (from 64 members; fewer stripes than `stripes` below 512, so that each has at
    least `STABLE_MIN_MEMBERS_PER_STRIPE` members, and fewer with few chunks, see
    `MIN_CHUNKS_PER_STRIPE`): home stripes by hashed peer id and chunks dealt by
    `_stable_chunks`, so two peers whose memberships differ by a few peers agree on every
    peer's home stripe and on all but a few chunks' stripes (dealing by capacity moves most
    chunks to other stripes when one peer is missing from a view)."""
    origin_upload = float(origin_upload_bps)
    if sum(p != origin for p in members.uploads) > ORIGIN_SLOTS:  # (see the top: what it serves at once)
        origin_upload = min(origin_upload, members.ceiling)
    return _plan_cached(origin, origin_upload, members, chunk_count, stripes, salt, stable)


@lru_cache(maxsize=64)
def _plan_cached(origin: str, origin_upload_bps: float, members: Membership, chunk_count: int,
                 stripes: int, salt: bytes, stable: bool = False) -> StripePlan:
    uploads = members.planned
    order = sorted((p for p in uploads if p != origin), key=lambda p: (-uploads[p], tiebreak(salt, p)))
    n = len(order)
    k = max(1, min(stripes, n, chunk_count)) if n and chunk_count else 1
    stable_now = stable and n >= 2 * STABLE_MIN_MEMBERS_PER_STRIPE and chunk_count > 0
    if stable_now:
        k = _stable_stripes(n, min(stripes, chunk_count), chunk_count)
        home = {p: int.from_bytes(tiebreak(salt, p), "big") % k for p in order}
    else:
        home = _deal_home_stripes(order, uploads, k)
    parents: list[dict[str, str]] = []
    fanouts: list[dict[str, int]] = []
    capacities: list[float] = []
    rates: list[float] = []
    origin_share = max(origin_upload_bps, 1.0) / k
    for s in range(k):
        interior = [p for p in order if home[p] == s]
        capacity = origin_share + sum(uploads[p] for p in interior)
        fanout, rate = _fanouts(origin, origin_share, interior, uploads, n, capacity, one_copy=stable_now)
        rates.append(rate)
        leaves = [p for p in order if home[p] != s]  # fastest first
        if stable_now:  # slowest first, but the origin's slots left over for leaves go to the fastest
            spare = max(0, fanout.get(origin, 0) - len(interior))
            leaves = leaves[:spare] + leaves[spare:][::-1]
        parents.append(_attach(origin, interior + leaves, fanout))
        fanouts.append(fanout)
        capacities.append(capacity)
    small = stable_now and max((f for fo in fanouts for p, f in fo.items() if p != origin), default=0) <= \
        SMALL_FANOUT * k
    if stable_now:
        stripe_of_chunk = _stable_chunks(chunk_count, _stripe_weights(rates, capacities, n))
    else:
        stripe_of_chunk = _deal_chunks(chunk_count, capacities)
    chunks_of_stripe = tuple(tuple(i for i, s in enumerate(stripe_of_chunk) if s == t) for t in range(k))
    return StripePlan(origin, k, home, tuple(parents), tuple(fanouts), stripe_of_chunk, chunks_of_stripe,
                      tuple(capacities), small)


def plan_tree(origin: str, members: Membership, chunk_count: int, fanout: int, salt: bytes = b"") -> StripePlan:
    """Baseline: one pipelined tree of fixed `fanout`, fastest members nearest the root.

    `fanout` >= the member count gives a star (everyone pulls from the origin)."""
    return _tree_cached(origin, members, chunk_count, fanout, salt)


@lru_cache(maxsize=16)
def _tree_cached(origin: str, members: Membership, chunk_count: int, fanout: int, salt: bytes) -> StripePlan:
    uploads = members.planned
    order = sorted((p for p in uploads if p != origin), key=lambda p: (-uploads[p], tiebreak(salt, p)))
    slots = {origin: fanout, **{p: fanout for p in order}}
    parent = _attach(origin, order, slots)
    home = {p: 0 for p in order}
    return StripePlan(origin, 1, home, (parent,), (slots,), (0,) * chunk_count, (tuple(range(chunk_count)),),
                      (float(sum(uploads.values())),))


def _stable_stripes(n: int, most: int, chunk_count: int) -> int:
    """Stripes of a stable plan: the largest power of two <= `most` that leaves at least
    `STABLE_MIN_MEMBERS_PER_STRIPE` members and `MIN_CHUNKS_PER_STRIPE` chunks per stripe.
    Powers of two, so views of slightly different sizes agree on it except near 64, 128, 256,
    ... members."""
    k = 1
    while 2 * k <= most and n >= 2 * k * STABLE_MIN_MEMBERS_PER_STRIPE and \
            chunk_count >= MIN_CHUNKS_PER_STRIPE * 2 * k:
        k *= 2
    return k


def tiebreak(salt: bytes, peer: str) -> bytes:
    """`peer`'s place among equals, drawn by `salt` (rendezvous hashing): the same for everyone
    with that salt, and not one a peer can pick its id to come first in, as it could by its id."""
    return blake3.blake3(salt + peer.encode()).digest(8)


def _deal_home_stripes(order: list[str], uploads: Mapping[str, float], k: int) -> dict[str, int]:
    heap = [(0.0, s) for s in range(k)]
    home = {}
    for peer in order:
        load, s = heapq.heappop(heap)
        home[peer] = s
        heapq.heappush(heap, (load + uploads[peer], s))
    return home


def _fanouts(origin: str, origin_share: float, interior: list[str], uploads: Mapping[str, float],
             n: int, capacity: float, one_copy: bool = False) -> tuple[dict[str, int], float]:
    """Integer fan-outs with every parent feeding each child at >= R, for the largest such R
    (returned with them: the stripe takes about its bytes / R).

    Rounding a slow parent's fan-out up would make its children slower than the stripe, so we
    search the per-child rate R (at most capacity / n) for which the floors still add up to n
    slots; the origin keeps at least one child, and with `one_copy` (the stable plans of large
    networks) only one when the members carry at least `MEMBERS_CARRY_SHARE` of the stripe's
    capacity. (A stripe's root is then a single point: if it fails, its orphans can only fetch
    the rest of the stripe from the origin, after their stall timeout.)
    """
    if n == 0:
        return {origin: 0}, capacity  # nobody to send to yet (a publisher alone)
    names = [origin] + interior
    caps = [origin_share] + [uploads[p] for p in interior]

    members_alone = one_copy and sum(caps[1:]) >= capacity * MEMBERS_CARRY_SHARE

    def origin_slots(rate: float) -> int:
        return 1 if members_alone else max(1, int(caps[0] / rate))

    def slots(rate: float) -> int:
        return origin_slots(rate) + sum(int(c / rate) for c in caps[1:])

    high = capacity / n
    if slots(high) >= n:
        rate = high
    else:
        low = high
        while slots(low) < n:
            low /= 2
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (mid, high) if slots(mid) >= n else (low, mid)
        rate = low
    counts = [origin_slots(rate)] + [int(c / rate) for c in caps[1:]]
    return dict(zip(names, counts)), rate


def _attach(origin: str, to_place: list[str], fanout: Mapping[str, int]) -> dict[str, str]:
    """Breadth-first: each peer in order takes a slot of the earliest parent with one free."""
    parent: dict[str, str] = {}
    queue = [origin]
    slots = {origin: fanout.get(origin, 0)}
    head = 0
    for peer in to_place:
        while slots[queue[head]] == 0:
            head += 1
        chosen = queue[head]
        slots[chosen] -= 1
        parent[peer] = chosen
        if fanout.get(peer, 0) > 0:
            queue.append(peer)
            slots[peer] = fanout[peer]
    return parent


def _stripe_weights(rates: list[float], capacities: list[float], n: int) -> list[float]:
    """How many chunks each stripe of a stable plan should carry, relatively: its per-child rate R
    (a stripe takes about its bytes / R), but only where integer fan-outs waste a real part of
    some stripe's capacity (R below `FANOUT_LOSS` x capacity / N: fan-outs of 4 or 5, as with
    equal uploads), and rounded to a power of 2^(1/8), so that views differing by a few members
    agree on the weights. Weight 1 for every stripe that wastes little (with big fan-outs, fast
    members feeding dozens, that is every stripe): decided stripe by stripe, so a member more or
    less changes at most the weights of the stripes it touches, not the whole plan's layout."""
    best = max(rates, default=0.0)
    return [2.0 ** (-math.floor(-8 * math.log2(r / best) + 0.5) / 8)
            if 0 < r < FANOUT_LOSS * c / max(n, 1) else 1.0 for r, c in zip(rates, capacities)]


def _stable_chunks(chunk_count: int, weights: list[float]) -> tuple[int, ...]:
    """Chunk i -> stripe for stable plans: each stripe gets a share of the chunks proportional to
    its weight (`_stripe_weights`; at N = 1,023 equal uploads and 4 stripes, a stripe with 240
    interior members needs fan-out 5 where the others have 4), largest remainder, at least one
    each. Views that differ a little agree on almost every chunk: stripe s owns a contiguous run
    of positions 0..M-1, and position j holds chunk (j * g) mod M for a step g near M / golden
    ratio and coprime to M, so each stripe's chunks are spread over the file, and a count that
    differs between two views' plans moves each later boundary by that much (dealing by
    weighted round robin would move most chunks). Equal weights use the same layout (one layout
    for every stable plan: a view whose weights differ in one stripe moves a few boundaries,
    never the whole deal)."""
    k = len(weights)
    if chunk_count <= k:
        return tuple(i % k for i in range(chunk_count))
    total = sum(weights)
    quota = [(chunk_count - k) * w / total for w in weights]
    counts = [1 + int(q) for q in quota]
    by_remainder = sorted(range(k), key=lambda s: (-(quota[s] - int(quota[s])), s))
    for s in by_remainder[:chunk_count - sum(counts)]:
        counts[s] += 1
    step = max(1, round(chunk_count * 0.381966))
    while math.gcd(step, chunk_count) != 1:
        step += 1
    out = [0] * chunk_count
    position = 0
    for s, count in enumerate(counts):
        for j in range(position, position + count):
            out[(j * step) % chunk_count] = s
        position += count
    return tuple(out)


def _deal_chunks(chunk_count: int, capacities: list[float]) -> tuple[int, ...]:
    """Chunk i -> stripe, shares proportional to capacity, interleaved (smooth weighted round robin)."""
    total = sum(capacities)
    weights = [c / total for c in capacities]
    credit = [0.0] * len(capacities)
    out = []
    for _ in range(chunk_count):
        for s, w in enumerate(weights):
            credit[s] += w
        best = max(range(len(credit)), key=lambda s: credit[s])
        credit[best] -= 1.0
        out.append(best)
    return tuple(out)


def lower_bound_s(total_bytes: int, origin_upload_bps: float, uploads: Iterable[float],
                  downloads: Iterable[float] = ()) -> float:
    """max(S/U_origin, N*S/(U_origin + sum of peers' upload), S/min(peers' download)): no schedule
    can beat it (the origin sends every byte once; N copies need N*S bytes uploaded; the slowest
    downloader must receive all S bytes)."""
    uploads = list(uploads)
    if not uploads:
        return 0.0
    n = len(uploads)
    slowest = min(downloads, default=math.inf)
    return max(total_bytes / origin_upload_bps, n * total_bytes / (origin_upload_bps + sum(uploads)),
               total_bytes / slowest if slowest > 0 else math.inf)
