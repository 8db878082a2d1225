"""The transfer core's holders: announcing what we hold, learning who holds what, completing.

Mixed into `relay.transfer.TransferCore` (`Announcing`). A peer announces `Holding` (gossip on
`HOLDING_TOPIC`) only once every chunk of a version is verified, and again every
`announce_interval_s` (the core's tick decides when; `publish` announces at once), listing its
newest `MAX_HELD_VERSIONS` complete versions. Only about `announce_sample` peers announce per
interval, network-wide (`_my_turn_to_announce`: a pure draw from our id and the round), so
deliveries grow as O(N) per interval, not O(N^2). On completing a version we also tell our
children in its plan directly (`_completed`): they pull from us and may now ask us anything;
not a child that told us it holds the version already (it wants nothing more).

A `Holding` for a version we know makes its sender a holder (a candidate for any chunk, after
our chain: see `relay.transfer`) and gives the chunks parked for want of a source another try;
one for a version we do not know asks the sender for the manifest, and the answer makes it a
holder: `relay.manifest_asks` (`_ask_manifest`, mixed into the core too). A version keeps at most
`MAX_HOLDERS` holders (`_add_holder`): a `Holding` needs no heartbeat, so any number of made-up
identities could each add one (100,000 of them took 10 MiB, and every request that looks past our
chain walks them all). Past the bound, a holder we measured (it served us a chunk) outranks one we
did not, and a member we can dial outranks a stranger; a newcomer that outranks nobody is not
kept, and one that does takes the place of the lowest-ranked holder (ties drawn per relay, as
`relay.requests`' `_choose_source` draws them). So a flood of strangers fills only what strangers
may take, and never puts out a member or a peer that delivered.

Completing a version settles any request for it still out (`_completed`): none should be, since a
chunk that arrives settles every request for it (`relay.transfer`, `fetched`), but a complete
version is never checked for stalls, and a request left out would hold a share of `max_in_flight`
for as long as the version is kept.

These methods read the core's configuration, membership, versions and bans, and add holders to
a version; they also call the core's `_pump(now, v, effects)`, `_arm(now, effects)` and
`complete_versions()`, and `relay.manifest_asks`' `_ask_manifest`. Like the core they do no I/O
and take the time as an argument.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import blake3

from p2pnet.core import Emit, Publish, Send
from relay.effects import VersionComplete
from relay.messages import HOLDING_TOPIC, MAX_HELD_VERSIONS, HeldVersion, Holding
from relay.planner import Membership, tiebreak
from relay.transfer_state import _requeue

#: holders kept per version at once (`_add_holder`; see the top)
MAX_HOLDERS = 256

if TYPE_CHECKING:
    from relay.transfer import TransferConfig
    from relay.transfer_state import _Version


class Announcing:
    """Holders and announcements for `relay.transfer.TransferCore` (see the module docstring)."""

    # the core's state these methods use (`TransferCore.__init__` sets it)
    config: TransferConfig
    self_id: str
    _members: Membership
    _versions: dict[int, _Version]
    _banned: set[str]
    _rates: dict[str, float]

    if TYPE_CHECKING:  # what these call on the core (`relay.transfer.TransferCore` or another of its mixins)
        def _pump(self, now: float, v: _Version, effects: list[Any], stripe: int | None = None) -> None: ...
        def _settle(self, now: float, v: _Version, index: int, entry: tuple[str, int, float],
                    progress: bool) -> None: ...
        def _arm(self, now: float, effects: list[Any]) -> list[Any]: ...
        def complete_versions(self) -> list[int]: ...
        def _ask_manifest(self, now: float, sender: str, version: int, manifest_id: bytes, effects: list[Any],
                          holds_all: bool = True) -> bool: ...

    def _on_holding(self, now: float, sender: str, body: Holding) -> list[Any]:
        effects: list[Any] = []
        room = True  # for the asks this message makes (once there is none, the rest are not weighed)
        for held in body.versions:
            v = self._versions.get(held.version)
            if v is None:
                room = room and self._ask_manifest(now, sender, held.version, held.manifest_id, effects)
                continue
            if held.manifest_id != v.signed.manifest_id or sender in v.holders or sender in self._banned:
                continue
            if not self._add_holder(v, sender):
                continue
            if not v.complete and v.parked:
                for index in v.parked:
                    v.tried.pop(index, None)
                    _requeue(v, index)
                v.parked.clear()
                self._pump(now, v, effects)
        return self._arm(now, effects)

    def _add_holder(self, v: _Version, peer: str) -> bool:
        """Make `peer` (not a holder yet) a holder of `v`, within `MAX_HOLDERS` (see the top):
        whether it is one now. O(1) below the bound and for a stranger at it; O(`MAX_HOLDERS`)
        for a newcomer that may outrank a holder."""
        holders = v.holders
        if len(holders) >= MAX_HOLDERS:
            rank = self._holder_rank(peer)
            if rank == (False, False):  # a stranger we never measured: nobody ranks below it
                return False
            salt = f"{self.self_id}/holders".encode()
            worst = min(holders, key=lambda p: (self._holder_rank(p), tiebreak(salt, p)))
            if self._holder_rank(worst) >= rank:
                return False
            holders.discard(worst)
        holders.add(peer)
        return True

    def _holder_rank(self, peer: str) -> tuple[bool, bool]:
        """How much a holder is worth keeping (`_add_holder`): measured (it served us a chunk),
        then a member we can dial (upload above 0, as `_choose_source` asks only those)."""
        return peer in self._rates, self._members.uploads.get(peer, 0.0) > 0

    def _completed(self, now: float, v: _Version, effects: list[Any]) -> None:
        """`v` is complete: settle what of it is still asked (see the top), say so, and tell our
        children in its plan that we hold it."""
        for index, entry in list(v.in_flight.items()):
            self._settle(now, v, index, entry, progress=False)
        v.completed_at = now
        v.parked.clear()
        effects.append(Emit(VersionComplete(v.version, v.signed.manifest_id, v.fetched_chunks, now - v.known_at)))
        if v.plan is not None:  # our children pull from us: tell them we can now serve anything
            held = Holding((HeldVersion(v.version, v.signed.manifest_id),))
            children = {c for s in range(v.plan.stripes) for c in v.plan.children(s, self.self_id)}
            # (not those that told us they hold it all: they want nothing more, and the frame costs
            # both ends CPU while the last peers still receive)
            effects.extend(Send(child, held) for child in sorted(children - v.holders))

    def _announce(self, now: float, effects: list[Any]) -> None:
        held = self._held_list()
        if held:
            effects.append(Publish(HOLDING_TOPIC, held))

    def _held_list(self) -> Holding | None:
        held = [HeldVersion(n, self._versions[n].signed.manifest_id) for n in self.complete_versions()]
        return Holding(tuple(held[-MAX_HELD_VERSIONS:])) if held else None

    def _my_turn_to_announce(self, now: float) -> bool:
        """Gossip `Holding` with probability announce_sample / members, per interval: O(N)
        deliveries network-wide per interval instead of O(N^2). Pseudo-random, but pure."""
        chance = self.config.announce_sample / max(len(self._members), 1)
        if chance >= 1:
            return True
        rounds = int(now / self.config.announce_interval_s)
        draw = int.from_bytes(blake3.blake3(f"{self.self_id}/{rounds}".encode()).digest(8), "big") / 2**64
        return draw < chance
