"""The "swarm" layout's bookkeeping: who our neighbours are and which chunk to ask each one for.

A baseline in the manner of BitTorrent, run by the same transfer core as the striped trees
(`relay.transfer`, `layout="swarm"`): no plan; each peer tells its neighbours which chunks it
holds (`relay.messages.HaveChunks`, a bitmap, at most every `have_interval_s`) and pulls any
chunk it lacks from any neighbour known to hold it, rarest first among what that neighbour has
(ties broken by a per-peer rotation of the chunk order, so neighbours start on different
chunks). No tit-for-tat: every request is served by the serving core's rules (slots, round
robin), as in the trees.

Neighbours: the `degree` members ranked highest by a hash of (us, member), from our own view of
the membership, plus every peer that sent us its bitmap (it chose us): so the relation becomes
symmetric through messages a real peer receives, and views that disagree only change who is
picked. Peers that completed a version and announced `Holding` are sources of every chunk.

Everything here is pure and O(chunks) per pick at most; bitmaps are Python ints (bit i: chunk i).
"""

from __future__ import annotations

import heapq
from typing import Iterable

import blake3


def neighbours(self_id: str, members: Iterable[str], degree: int) -> frozenset[str]:
    """The `degree` members (not us) with the highest hash of (us, member): rendezvous hashing,
    so a member missing from our view moves one pick, not all of them."""

    def rank(peer: str) -> bytes:
        return blake3.blake3(f"swarm/{self_id}/{peer}".encode()).digest(8)

    return frozenset(heapq.nlargest(degree, (p for p in members if p != self_id), key=rank))


def rotation(self_id: str, count: int) -> int:
    """Where our order of equally rare chunks starts (a per-peer offset into the chunk list)."""
    if count <= 0:
        return 0
    return int.from_bytes(blake3.blake3(f"swarm-order/{self_id}".encode()).digest(8), "big") % count


def bitmap_bytes(bits: int, count: int) -> bytes:
    """Bit i of `bits` as bit i % 8 of byte i // 8 (the `HaveChunks` encoding)."""
    return bits.to_bytes((count + 7) // 8, "little")


def bitmap_bits(data: bytes, count: int) -> int:
    """The inverse of `bitmap_bytes`; bits past `count` are dropped."""
    return int.from_bytes(data, "little") & ((1 << count) - 1)


def set_bits(bits: int) -> Iterable[int]:
    while bits:
        low = bits & -bits
        yield low.bit_length() - 1
        bits ^= low


class SwarmVersion:
    """Per version: what each neighbour told us it holds, and how many of them hold each chunk."""

    __slots__ = ("count", "offset", "peer_bits", "avail", "mine", "asked", "sent_bits", "dirty")

    def __init__(self, count: int, offset: int, mine: int) -> None:
        self.count = count
        self.offset = offset
        self.peer_bits: dict[str, int] = {}
        self.avail = [0] * count  # neighbours known to hold each chunk
        self.mine = mine  # chunks we hold
        self.asked = 0  # chunks with a request out
        self.sent_bits = -1  # what we last told our neighbours (-1: nothing yet)
        self.dirty = True

    def told(self, peer: str, bits: int) -> bool:
        """`peer` says it holds `bits`; whether it holds something new to us. A bitmap only grows
        (a chunk a peer lost is still asked for, and answered "unavailable")."""
        old = self.peer_bits.get(peer, 0)
        grown = bits & ~old
        if not grown:
            return False
        self.peer_bits[peer] = old | grown
        avail = self.avail
        for index in set_bits(grown):
            avail[index] += 1
        return bool(grown & ~self.mine)

    def forget(self, peer: str) -> None:
        bits = self.peer_bits.pop(peer, 0)
        avail = self.avail
        for index in set_bits(bits):
            avail[index] -= 1

    def pick(self, bits: int, refused: dict[int, set[str]], peer: str) -> int | None:
        """The chunk to ask `peer` (holding `bits`) for: one we lack and have not asked anyone for,
        rarest among our neighbours first, then in our rotated order; None if there is none."""
        wanted = bits & ~self.mine & ~self.asked
        if not wanted:
            return None
        avail, count, offset = self.avail, self.count, self.offset
        best, best_key = None, None
        for index in set_bits(wanted):
            if refused and peer in refused.get(index, ()):
                continue
            key = (avail[index], (index - offset) % count)
            if best_key is None or key < best_key:
                best, best_key = index, key
        return best
