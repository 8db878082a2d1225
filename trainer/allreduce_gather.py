"""The all-gather's reduced values at one peer: kept per sender, and taken only from the member
we hold to reduce the shard. Pure: `trainer.allreduce` (`AllReduce`) feeds it.

Whose value a shard takes. Shard i of a round is reduced by the first member of its chain
(members[i], members[i+1], ..., wrapping around) that we do not take for dead (`reducer`): the
owner as we see it. A reduced value is taken from that member only, whole: the pieces of one
sender are never joined with another's (`Offers`). A value from any other member is kept, not
taken, and is taken if and when our own view makes its sender the shard's reducer (the members
before it in the chain die for us: a failed send, or an owner silent past `gather_at`). That is
how an honest successor whose view ran ahead of ours (it saw the owner die first, reduced the
shard and sent us its mean while we still wait on the owner) is heard: its mean waits here
until we too take the owner for dead, and is then used at once, where it would not be sent
again. The other way round, a member before the reducer in the chain that we took for dead
(a link down one way: our sends to it failed, its own work) but that reduced the shard all the
same is heard too (`heard`), even where we are the reducer ourselves, as long as the shard is
not reduced: its value claims no more than the reducer's would (every member before it is dead
for us as well; the owner, first, needs nobody's death), and it is the value every member that
sees it alive takes. The first in chain order of those that sent it whole is taken.

Why not sooner. A value from a later member of the chain is only its claim that the members
before it are dead; taken on that claim, every member could set its predecessor's shard as well
as its own (the owner alive, its screened mean in flight), and members that got the two values
in different orders would end the round on different weights. So the rule goes by our own
`dead` alone, which grows only by what we saw (a send that failed, a deadline that passed): a
member's value is taken as soon as, and only while, we take every member before it in the
chain for dead, never on its word or a third member's. The cost falls on honest failures only:
a successor that saw the owner die first has its mean used when we see it too (at the latest
when the owner's `gather_at` passes: twice the deadline after we last passed the shard on), not
when it comes. A value whose sender never becomes
the reducer is dropped once the shard is reduced, unpenalised: an honest member whose view
differs from ours (one link down) sends such values, and one never taken costs us memory only,
bounded below. Members whose views of the dead differ can still take different values of a
shard and end the round apart (as they could before), which the next round's Joins show (their
digests differ: those not of the reference sit out and fetch the state).

Bounds. At most one value per member and shard, a shard's length each, and a sender's pieces
are kept at the offsets a shard has, the first of each only: a member can make us hold at most
one vector's length of reduced values (as its contributions already can, one per shard, kept
until we reduce it or take its value: `trainer.allreduce`). A shard's offers are dropped once it is reduced.

What this does not bound: the reducer itself. The member we hold to reduce a shard sets its
mean, screened by no one but itself; every member owns a shard each round, and nothing compares
what it sends one member with what it sends another (different means to different members split
them, as above). A check of the mean's norm at each receiver (against `max_norm_ratio` times our
own contribution's, say) is not built: each member would judge against its own contribution, so
an owner could send a mean that passes at some members and fails at others, and the members
would then apply different updates; a round that fails at some members only needs an agreement
this protocol does not have (one reducer per shard, no vote), and a member that refused the mean
alone would fetch the others' state, the mean in it, at its next round. And a mean within any
norm bound can still point anywhere (the honest mean reversed). Only the group's membership
bounds what an owner sends (`[diloco] trainers`). One check is sound, and made before a piece is
kept (`trainer.allreduce`, `receive`): a reduced piece that is not finite (NaN or inf, from fp32
bytes or an int8 block's scale) is refused and its sender penalised (`Rejection.NOT_FINITE`).
Whether it is finite depends on its bytes alone, so every member that got the same bytes judges
alike, and an honest reducer never sends one (the screen takes finite contributions only, and a
mean that overflows float32 is taken again in float64: it lies between finite values). The
shard then waits on its reducer to its `gather_at` and passes on, as from a silent owner; one
owner could otherwise put NaN into every member's weights with a single piece. A mean finite
but huge (2.5e38) passes here and would overflow the outer step: that step is checked instead
(`trainer.diloco.OuterStepNotFinite`), and the round discarded alike at every member that took
the mean, its reducer blamed (`trainer.diloco_role`); a cap here would need a bound on honest
means that nothing gives (the screen bounds contributions by one another, not by a number).

This module must not do I/O, read a clock or hold global random state.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from trainer.diloco_messages import PIECE_VALUES


def reducer(members: tuple[str, ...], index: int, dead: Collection[str]) -> str | None:
    """The member that reduces shard `index` as we see it: the first of its chain
    (members[index], members[index + 1], ..., wrapping around) not in `dead`; None if all are."""
    chain = heard(members, index, dead)
    return chain[-1] if chain and chain[-1] not in dead else None


def heard(members: tuple[str, ...], index: int, dead: Collection[str]) -> tuple[str, ...]:
    """The members whose value of shard `index` we take, in chain order: the chain up to and
    including `reducer`, i.e. each member all of whose predecessors in the chain we take for
    dead. Those before the reducer are in `dead` themselves, but a value from one of them is
    still no claim beyond its own (the owner, first, needs nobody's death to reduce the shard):
    it reduced because, for it, it was alive (a link down one way only)."""
    n = len(members)
    chain = []
    for k in range(n):
        candidate = members[(index + k) % n]
        chain.append(candidate)
        if candidate not in dead:
            break
    return tuple(chain)


@dataclass
class Offers:
    """The reduced values of one shard that members sent us, per sender (see the module docstring)."""

    length: int
    pieces: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)  # sender -> offset -> values
    values: dict[str, tuple[torch.Tensor, tuple[str, ...]]] = field(default_factory=dict)  # whole, with contributors

    def add(self, sender: str, offset: int, values: torch.Tensor, contributors: tuple[str, ...]) -> None:
        """A piece of `sender`'s reduced value (its offset and length already checked against the
        shard's): the first at each offset is kept; the piece that completes the value gives its
        contributors."""
        if sender in self.values:
            return
        pieces = self.pieces.setdefault(sender, {})
        pieces.setdefault(offset, values)
        if complete(pieces, self.length):
            self.values[sender] = (join_pieces(pieces, self.length), tuple(contributors))
            del self.pieces[sender]

    def of(self, sender: str | None) -> tuple[torch.Tensor, tuple[str, ...]] | None:
        """`sender`'s whole value and contributors, if it sent them all."""
        return self.values.get(sender) if sender is not None else None

    def clear(self) -> None:
        self.pieces.clear()
        self.values.clear()


def complete(pieces: dict[int, torch.Tensor], length: int) -> bool:
    return sum(p.numel() for p in pieces.values()) >= length and all(
        o in pieces for o in range(0, length, PIECE_VALUES))


def join_pieces(pieces: dict[int, torch.Tensor], length: int) -> torch.Tensor:
    if length == 0:
        return torch.zeros(0)
    return torch.cat([pieces[o] for o in range(0, length, PIECE_VALUES)])
