"""The all-reduce of one DiLoCo round, and who takes part in it: pure state machines.

Theory of operation. A round's members are decided by one peer, the round's leader: the
lowest peer id among the trainer peers a peer expects and does not take for dead. A peer that
finished its inner steps sends `Join(round, digest of its global weights, the peers it
expects)` to every trainer peer it knows. The leader's `Membership` collects them; once a Join
arrived from every peer it expects (its own list and the peers the Joins name), or at the join
deadline, the leader decides: the reference digest is the one most Joins carry (ties: the
lowest peer id's), the members are the peers that carry it, and it sends `Members` to everyone
that joined. One decision, so every member runs the all-reduce over the same list. A newcomer
whose Join reaches the leader in time takes part at once, while the round has room: it holds at
most `MAX_MEMBERS` (what a Members lists), and in an open group any identity can Join, so the
peers we keep places for (`room_for`: the members of the last round we took part in) always find
room, and every other joiner takes what is left, first come first served. A joiner turned away
is no member, but still counts for the leader choice (each member holds the Joins that came to
it first: a leader picked among those alone could differ between members) and is not waited
for. A peer whose digest is not the reference (it missed a round, or resumed from an older
checkpoint) sits the round out and fetches the state from a member instead; one left out for want
of room is told so by its leader (`NoRoom`, `trainer.diloco_decide`) and does the same. A
follower that hears no Members by twice the deadline takes the leader for dead and the next
lowest peer leads.

`AllReduce` averages one vector over the members by reduce-scatter then all-gather. The
vector is cut into one contiguous shard per member; shard i is first owned by members[i].

  1. Reduce-scatter: each peer sends its piece of shard i to the shard's owner (quantized,
     in `Part`s of at most PIECE_VALUES values) and keeps its own shard.
  2. The owner reduces a shard when every live member's contribution is in, or at
     `reduce_at` (start + deadline): contributions are screened (`trainer.diloco.screen`:
     shape, finite, norm against the median of all of them, the owner's own included, so a
     minority cannot get an honest one rejected), the rejected are reported (`Penalise`), the
     rest averaged in peer order (the mean, to the bit, depends on which contributions came, not
     on when); the mean is quantized once and sent to every live member.
  3. All-gather: a peer is done when it holds the reduced value of every shard (`Finished`:
     with each shard's contributors and whose value it took). Everyone,
     owner included, uses the dequantized mean, so every member applies the same update. A
     shard's reduced value is taken only from the member we hold to reduce it (the first of its
     chain, below, that we do not take for dead) or one before it in the chain (dead for us, a
     link down one way, yet it reduced), whole: values are kept per sender, one from a later
     member is taken only if our own view comes to make it the reducer, else dropped,
     unpenalised (`trainer.allreduce_gather`, which says why, and what it does not bound: the
     reducer's own mean).

Failures. A peer we cannot send to (`peer_failed`) or an owner whose reduced shard has not
arrived by `gather_at` (start + 2 x deadline) is taken for dead. Its shards (every one it holds
for us that is not reduced yet, whichever deadline found it dead) pass to the next
live member in the shard's chain (members[i], members[i+1], ..., wrapping around): the same
successor on every peer that saw the same failures, without any vote. We send our
contribution to the successor, or, if that is us, adopt the shard and reduce it at now +
deadline with what has arrived; if the successor's reduced value already came (its view ran
ahead of ours), it is used at once. A contribution for a shard we do not reduce (its sender saw
the owner die before we did, or says so) is kept, per sender (a shard's length each: one vector's
length a member in all, as its reduced values), and counted only once our own view
makes us the shard's reducer, as a reduced value is (`trainer.allreduce_gather`): adopted on the
sender's word, any member could have another's shard reduced here, from its contribution and
ours alone (fewer than three are not screened by norm), before the live owner's mean came, and
we would end the round on other weights than the other members. A contribution that arrives
after its shard was reduced is dropped, as is a reduced value. A reduced piece that is not
finite is refused and its sender penalised; the shard waits as on a silent owner. So is one
whose contributors are not a subset of the members (`WRONG_SHAPE`; a contribution names none).
Our own contribution rejected by our screen is left out and recorded, not penalised.
The bytes a peer sends are counted in `bytes_sent` (payload bytes, before framing).

Bytes. With N members and S bytes of vector each peer sends (N-1)/N x S in each phase,
2 (N-1)/N x S in all, where sending the whole vector to everyone costs (N-1) x S.

This module must not do I/O, read a clock or hold global random state: time comes in as
`now`, messages as arguments, and effects go out as return values.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.allreduce_gather import Offers, complete, heard, join_pieces, reducer
from trainer.diloco import Encoding, Packed, Rejection, pack, screen, unpack
from trainer.diloco_messages import MAX_MEMBERS, PIECE_VALUES, STAGE_CONTRIBUTION, STAGE_REDUCED, Join, Part


def members_digest(members: tuple[str, ...]) -> bytes:
    import blake3

    return blake3.blake3("\n".join(members).encode()).digest()[:16]


def shard_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of each of `n` contiguous shards of a vector of `length` values."""
    return [(i * length // n, (i + 1) * length // n) for i in range(n)]


# -- effects ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    peer: str
    body: Part


@dataclass(frozen=True)
class Penalise:
    peer: str
    why: Rejection


@dataclass(frozen=True)
class Finished:
    mean: torch.Tensor
    contributors: tuple[tuple[str, ...], ...]  # per shard
    reducers: tuple[str, ...] = ()  # per shard: the member whose reduced value we took (we, for one we reduced)

    def reducers_where(self, where: torch.Tensor) -> set[str]:
        """The reducers of the shards that hold a True of `where` (a mask over `mean`): whose
        values those are (the shell blames them for an outer step they made overflow)."""
        bounds = shard_bounds(self.mean.numel(), len(self.reducers))
        return {peer for peer, (a, b) in zip(self.reducers, bounds) if bool(where[a:b].any())}

    def whole_contributors(self) -> frozenset[str]:
        """The peers whose contribution every shard took: a whole pseudo-gradient each, sent and
        accepted by every shard's owner (our own shard's list among them, if we own one)."""
        if not self.contributors:
            return frozenset()
        return frozenset(self.contributors[0]).intersection(*self.contributors[1:])


# -- membership -------------------------------------------------------------------------------


def leader_of(candidates: set[str]) -> str:
    """The round's leader among the peers a peer expects (itself included) and trusts alive."""
    return min(candidates)


def room_for(held: Iterable[str], sender: str, keep: Collection[str], limit: int = MAX_MEMBERS) -> tuple[bool, str | None]:
    """Whether a round's Join from `sender` may be held with those of `held` (their senders, in
    the order they first came), at most `limit` of them, and whose it replaces, if any. In an
    open group any identity can Join, so the peers of `keep` (the ones we keep places for: the
    members of the last round we took part in, at most `limit`) always find room and everyone
    else takes what is left, first come first served: a sender already held, yes; room left,
    yes; full, a sender of `keep` replaces the last-come sender not of `keep` (there is one:
    `keep` holds at most `limit`), anyone else is turned away (the round goes on without it; the
    shell tells it: `trainer.diloco_decide`). Pure: the caller drops whom it names."""
    held = list(held)
    if sender in held or len(held) < limit:
        return True, None
    if sender not in keep:
        return False, None
    for peer in reversed(held):
        if peer not in keep:
            return True, peer
    return False, None


def hold_join(held: dict[str, Any], refused: set[str], sender: str, keep: Collection[str],
              trainers: Collection[str]) -> tuple[bool, str | None]:
    """Make room for `sender`'s Join among those `held` (by sender, in the order they first came;
    `room_for`), dropping the one it replaces, and keep `refused` up to date: a sender turned
    away, or replaced, that is one of `trainers` (the trainer peers of the caller's table: any
    identity can Join, and only these can lead or be waited for, so what is kept stays bounded
    by that table) is in it, and leaves it once held. As `room_for`: whether the caller may hold
    the Join (at `held[sender]`), and whose it replaced. One rule for `Membership.receive` and the role's Joins read a round early
    (`trainer.diloco_role`), so that the members choose one leader whichever took the Joins."""
    admitted, replaced = room_for(held, sender, keep)
    if replaced is not None:
        del held[replaced]
        if replaced in trainers:
            refused.add(replaced)
    if admitted:
        refused.discard(sender)
    elif sender in trainers:
        refused.add(sender)
    return admitted, replaced


class Membership:
    """The members of one round as its leader decides them, from the Joins that arrive by a
    deadline: at most `MAX_MEMBERS` of them, the peers of `keep` (the members of the last round
    we took part in, and we) first (`room_for`). A Join turned away, or replaced, makes no
    member, and the peers it names count for nothing here: what we hold stays bounded whoever
    sends. Its sender, when it is a trainer peer of the caller's table (`receive`), is
    remembered (`refused`): it counts for the leader choice as a sender whose Join we hold does
    (which Joins a member holds depends on the order they came to it), and is not waited for."""

    def __init__(self, self_id: str, round: int, weights_digest: bytes, now: float, deadline_s: float,
                 keep: Collection[str] = ()) -> None:
        self.self_id = self_id
        self.round = round
        self.keep = frozenset(keep) | {self_id}
        if len(self.keep) > MAX_MEMBERS:  # the caller's: no round could hold them all
            raise ValueError(f"{len(self.keep)} peers to keep places for: a round holds at most {MAX_MEMBERS}")
        self.joins: dict[str, bytes] = {self_id: weights_digest}  # in the order senders first came
        self.names: dict[str, frozenset[str]] = {}  # sender -> the peers its latest Join names
        # peers named in the Joins we hold, each sender's latest (its view now: a peer sends its
        # Join again when the peers it takes for dead change); redone as `names` changes (`receive`),
        # not at each read: the shell reads it at every event while a round is decided
        self.told: set[str] = set()
        # senders whose Join reached us and was turned away (or replaced), of the trainer peers the
        # caller knows (`receive`): no members, but leader candidates as the senders we hold are
        # (`leader`), and not waited for (`expected`). Bounded by the caller's peer table.
        self.refused: set[str] = set()
        self.deadline_at = now + deadline_s
        self.known: set[str] = set()
        self.excluded: set[str] = set()

    @property
    def expected(self) -> set[str]:
        """The peers whose Joins the decision waits for: not one whose Join we turned away (it
        came, and makes no member: waiting for it again would hold the round to its deadline)."""
        return (self.known | self.told) - self.excluded - self.refused - {self.self_id}

    @property
    def named(self) -> set[str]:
        """Peers the Joins we received name, or that sent them (held or turned away): each is
        waited for by some member, or leads there, so the shell waits for them too (one leader
        for all)."""
        return (self.told | set(self.joins) | self.refused) - {self.self_id}

    def leader(self, own: set[str], invited: set[str], suspects: set[str]) -> str:
        """The round's leader as we see it: the lowest id among ourselves, the peers we wait for
        on our own account (`own`) and the invited peers whose own Join reached us (held, or
        turned away: `refused`), less those we take for dead. A peer only other members name is
        sent our Join and waited for as a member, but leads only once its Join shows it takes
        part: else one that never joins (still loading, still fetching) would hold every member
        for the leader timeout, not the join deadline. A Join turned away counts as one held:
        with more joiners than a round holds, each member holds those that came to it first, and
        a leader picked among only those could differ between members (two of them deciding
        the round, its members split between their lists)."""
        reached = set(self.joins) | self.refused
        return leader_of(((set(own) | (reached & set(invited))) - set(suspects)) | {self.self_id})

    def expect(self, peers: set[str], excluded: Collection[str] = frozenset()) -> None:
        """The trainer peers we know of now, and those we take for dead (refreshed by the shell)."""
        self.known = set(peers)
        self.excluded = set(excluded) - set(self.joins)

    def receive(self, sender: str, join: Join, trainers: Collection[str] = frozenset()) -> bool:
        """Take `sender`'s Join of our round if it finds room (`room_for`); False: turned away.
        A sender turned away, or replaced, is remembered in `refused` when it is one of
        `trainers` (the trainer peers of the caller's table: any identity can send a Join, and
        only these can lead or be waited for; what we keep stays bounded by that table)."""
        if join.round != self.round:
            return False
        admitted, replaced = hold_join(self.joins, self.refused, sender, self.keep, trainers)
        if not admitted:
            return False
        if replaced is not None:
            self.names.pop(replaced, None)
        self.joins[sender] = join.weights_digest
        self.names[sender] = frozenset(join.known)
        self.told = set().union(*self.names.values())
        self.excluded.discard(sender)
        return True

    def turned_away(self, sender: str, trainers: Collection[str] = frozenset()) -> None:
        """`sender`'s Join of our round reached us before the round began (during the last one's
        all-reduce) and found no room among those the caller kept for it, taken first as this
        class takes them (`room_for`): remembered as a Join `receive` turns away is."""
        if sender in trainers and sender not in self.joins:
            self.refused.add(sender)

    def decided(self, now: float) -> tuple[tuple[str, ...], bytes] | None:
        """(members, reference digest) once every expected peer joined or at the deadline. At most
        `MAX_MEMBERS` members: the Joins we hold (`receive`) are no more."""
        if not self.expected <= set(self.joins) and now < self.deadline_at:
            return None
        joins = self.joins
        counts = Counter(joins.values())
        best = max(counts.values())
        tied = {d for d, c in counts.items() if c == best}
        reference = joins[min(p for p, d in joins.items() if d in tied)]
        return tuple(sorted(p for p, d in joins.items() if d == reference)), reference


# -- the all-reduce ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AllReduceConfig:
    encoding: Encoding = Encoding.INT8
    block: int = 4096
    deadline_s: float = 30.0  # the reduce deadline; an owner is taken for dead after twice this
    max_norm_ratio: float = 10.0

    def __post_init__(self) -> None:
        if not 1 <= self.block <= PIECE_VALUES or PIECE_VALUES % self.block:  # (the range first: 0 divides nothing)
            raise ValueError(f"block must be from 1 to {PIECE_VALUES} and divide {PIECE_VALUES}")
        if not self.deadline_s > 0 or not self.max_norm_ratio > 1:
            raise ValueError("deadline_s must be > 0 and max_norm_ratio > 1")


@dataclass
class _Shard:
    start: int
    end: int
    owner: str
    reduce_at: float | None = None  # set while we own it
    gather_at: float = math.inf
    pieces: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)  # sender -> offset -> values
    contributions: dict[str, torch.Tensor] = field(default_factory=dict)
    reduced: torch.Tensor | None = None
    contributors: tuple[str, ...] = ()
    reducer: str = ""  # whose reduced value it took, once reduced
    offers: Offers = field(init=False)  # reduced values members sent, per sender (`trainer.allreduce_gather`)

    def __post_init__(self) -> None:
        self.offers = Offers(self.length)

    @property
    def length(self) -> int:
        return self.end - self.start


class AllReduce:
    """One round's reduce-scatter and all-gather at one peer; see the module docstring."""

    def __init__(self, self_id: str, round: int, members: tuple[str, ...], vector: torch.Tensor,
                 config: AllReduceConfig) -> None:
        if self_id not in members or list(members) != sorted(set(members)):
            raise ValueError("members must be sorted, unique and include this peer")
        self.self_id = self_id
        self.round = round
        self.members = members
        self.digest = members_digest(members)
        self.vector = vector.reshape(-1).to(torch.float32)
        self.config = config
        self.dead: set[str] = set()
        self.shards = [_Shard(a, b, members[i]) for i, (a, b) in enumerate(shard_bounds(self.vector.numel(), len(members)))]
        self.bytes_sent = 0
        self.finished = False
        self.rejected: dict[str, str] = {}

    # -- inputs ---------------------------------------------------------------------------

    def start(self, now: float) -> list[object]:
        effects: list[object] = []
        for i, shard in enumerate(self.shards):
            shard.gather_at = now + 2 * self.config.deadline_s
            if shard.owner == self.self_id:
                self._adopt(i, now)
            else:
                effects += self._contribute(i, shard.owner)
        return effects + self._progress(now)

    def receive(self, now: float, sender: str, part: Part) -> list[object]:
        """A Part from `sender` (signature already checked by the codec)."""
        if part.round != self.round or part.members_digest != self.digest or sender not in self.members:
            return []  # another round or another view of the members: not ours to judge
        if not 0 <= part.shard < len(self.shards) or part.shard_length != self.shards[part.shard].length:
            return [Penalise(sender, Rejection.WRONG_SHAPE)]
        shard_length = part.shard_length
        if part.offset % PIECE_VALUES or part.length != min(PIECE_VALUES, shard_length - part.offset):
            return [Penalise(sender, Rejection.WRONG_SHAPE)]
        if not self._contributors_fit(part):
            return [Penalise(sender, Rejection.WRONG_SHAPE)]
        try:
            values = unpack(Packed(Encoding(part.encoding), part.length, part.block, part.values, part.scales))
        except ValueError:
            return [Penalise(sender, Rejection.WRONG_SHAPE)]
        shard = self.shards[part.shard]
        if part.stage == STAGE_CONTRIBUTION:
            return self._on_contribution(now, sender, part, shard, values)
        if not bool(torch.isfinite(values).all()):  # never an honest reducer's (`_reduce`): judged on the
            return [Penalise(sender, Rejection.NOT_FINITE)]  # bytes alone, so alike at every member
        if shard.reduced is None:
            shard.offers.add(sender, part.offset, values, part.contributors)
            self._take_offered(part.shard)
        return self._progress(now)

    def peer_failed(self, now: float, peer: str) -> list[object]:
        """We could not deliver to `peer`: take it for dead."""
        if peer == self.self_id or peer in self.dead:
            return []
        self.dead.add(peer)
        return self._after_deaths(now)

    def tick(self, now: float) -> list[object]:
        for shard in self.shards:
            if shard.reduced is None and shard.owner != self.self_id and now >= shard.gather_at:
                self.dead.add(shard.owner)
        return self._after_deaths(now)

    def next_deadline(self) -> float:
        times = [s.reduce_at if s.owner == self.self_id and s.reduce_at is not None else s.gather_at
                 for s in self.shards if s.reduced is None]
        return min(times, default=math.inf)

    # -- internals ------------------------------------------------------------------------

    def _contributors_fit(self, part: Part) -> bool:
        """A reduced piece names a sorted subset of the round's members (a Part checks only that
        they are sorted, unique and no more than a round holds); a contribution names none."""
        if part.stage == STAGE_CONTRIBUTION:
            return not part.contributors
        return set(part.contributors) <= set(self.members)  # (sorted and unique: `Part`)

    def _on_contribution(self, now: float, sender: str, part: Part, shard: _Shard,
                         values: torch.Tensor) -> list[object]:
        """Kept per sender, whoever reduces the shard for us: counted only once we do
        (`_adopt`; never on the sender's word, see the module docstring)."""
        if shard.reduced is not None or sender in shard.contributions:
            return []
        pieces = shard.pieces.setdefault(sender, {})
        pieces[part.offset] = values
        if complete(pieces, shard.length):
            shard.contributions[sender] = join_pieces(pieces, shard.length)
            del shard.pieces[sender]
        return self._progress(now)

    def _after_deaths(self, now: float) -> list[object]:
        """`dead` grew: every shard not reduced yet whose owner is dead passes on (`_reassign`),
        and each takes its reducer's value if it came before (`_take_offered`)."""
        effects: list[object] = []
        for i, shard in enumerate(self.shards):
            if shard.reduced is None and shard.owner in self.dead:
                effects += self._reassign(i, now)
            self._take_offered(i)
        return effects + self._progress(now)

    def _take_offered(self, index: int) -> None:
        """Take shard `index`'s reduced value from the member we hold to reduce it (`reducer`),
        or from one before it in the chain that we took for dead but reduced it all the same
        (`heard`; the first of them that sent it whole, in chain order), even where we are the
        reducer; never from a member after it."""
        shard = self.shards[index]
        if shard.reduced is not None:
            return
        for who in heard(self.members, index, self.dead):
            offered = shard.offers.of(who) if who != self.self_id else None
            if offered is not None:
                shard.reduced, shard.contributors = offered
                shard.reducer = who
                shard.offers.clear()
                shard.pieces.clear()  # contributions held in case we came to reduce it: not needed now
                shard.contributions.clear()
                return

    def _adopt(self, index: int, now: float) -> None:
        shard = self.shards[index]
        shard.owner = self.self_id
        shard.reduce_at = now + self.config.deadline_s
        shard.contributions.setdefault(self.self_id, self.vector[shard.start:shard.end].clone())

    def _reassign(self, index: int, now: float) -> list[object]:
        shard = self.shards[index]
        candidate = reducer(self.members, index, self.dead) or self.self_id  # we are never dead
        shard.owner = candidate
        shard.gather_at = now + 2 * self.config.deadline_s
        if candidate == self.self_id:
            self._adopt(index, now)
            return []
        self._take_offered(index)  # it reduced the shard before we saw the owner die: used at once
        if shard.reduced is not None:
            return []
        return self._contribute(index, candidate)

    def _contribute(self, index: int, owner: str) -> list[object]:
        shard = self.shards[index]
        return self._parts(index, STAGE_CONTRIBUTION, self.vector[shard.start:shard.end], (owner,), ())

    def _parts(self, index: int, stage: int, values: torch.Tensor, to: tuple[str, ...],
               contributors: tuple[str, ...]) -> list[object]:
        shard = self.shards[index]
        effects: list[object] = []
        for offset in range(0, max(shard.length, 1), PIECE_VALUES):
            piece = values[offset:offset + PIECE_VALUES]
            packed = pack(piece, self.config.encoding, self.config.block)
            body = Part(self.round, self.digest, stage, index, shard.length, offset, packed.length,
                        packed.encoding.value, packed.block, packed.values, packed.scales, contributors)
            for peer in to:
                effects.append(Send(peer, body))
                self.bytes_sent += packed.nbytes
        return effects

    def _waiting_for(self, shard: _Shard) -> set[str]:
        return set(self.members) - self.dead - set(shard.contributions)

    def _progress(self, now: float) -> list[object]:
        effects: list[object] = []
        for i, shard in enumerate(self.shards):
            if shard.reduced is not None or shard.owner != self.self_id or shard.reduce_at is None:
                continue
            if self._waiting_for(shard) and now < shard.reduce_at:
                continue
            effects += self._reduce(i)
        if not self.finished and all(s.reduced is not None for s in self.shards):
            self.finished = True
            mean = torch.cat([s.reduced for s in self.shards]) if self.shards else torch.zeros(0)
            effects.append(Finished(mean, tuple(s.contributors for s in self.shards),
                                    tuple(s.reducer for s in self.shards)))
        return effects

    def _reduce(self, index: int) -> list[object]:
        shard = self.shards[index]
        accepted, rejected = screen(shard.contributions, shard.length, self.config.max_norm_ratio)
        # our own contribution rejected is our fault, no peer's: recorded, not penalised
        effects: list[object] = [Penalise(peer, why) for peer, why in sorted(rejected.items()) if peer != self.self_id]
        for peer, why in rejected.items():
            self.rejected[peer] = why.value
        if not accepted:  # only when no contribution, ours included, was finite: keep ours, flagged
            accepted = {self.self_id: shard.contributions[self.self_id]}
        stacked = torch.stack(list(accepted.values()))  # in peer order (`screen`)
        mean = stacked.mean(dim=0)
        if not bool(torch.isfinite(mean).all()):  # float32 overflowed on finite values: the mean of
            mean = stacked.double().mean(dim=0).float()  # finite values lies between them, so is finite
        contributors = tuple(sorted(accepted))
        to = tuple(p for p in self.members if p != self.self_id and p not in self.dead)
        effects += self._parts(index, STAGE_REDUCED, mean, to, contributors)
        # use exactly what the others will decode, so every member applies the same update
        shard.reduced = torch.cat([unpack(pack(mean[o:o + PIECE_VALUES], self.config.encoding, self.config.block))
                                   for o in range(0, max(shard.length, 1), PIECE_VALUES)])[:shard.length]
        shard.contributors = contributors
        shard.reducer = self.self_id
        shard.contributions.clear()
        shard.pieces.clear()
        shard.offers.clear()
        return effects
