"""The transfer core's side of the "swarm" layout: telling neighbours what we hold, and pulling.

Mixed into `relay.transfer.TransferCore` (`SwarmTransfer`); used only with `layout="swarm"`, a
baseline with no plan, whose bookkeeping (neighbours, bitmaps, the rarest-first pick) is
`relay.swarm`. Peers send their chunk bitmaps (`HaveChunks`) to their neighbours and pull any
chunk from any neighbour known to hold it, rarest first; a peer that announced `Holding` the
whole version is a source of every chunk. What we gain goes out at once, or at most
`have_interval_s` after our last bitmaps (`TIMER_HAVE`); a peer that sends us its bitmap
without being our neighbour (it chose us) gets ours back at once, the first time.

These methods read the core's configuration, membership, versions and bans, count requests in
`_in_flight` (through the core's `_note_request`) and keep the bitmap timer's state
(`_neighbours` is set by the core's `set_members`). Like the core they do no I/O and take the
time as an argument.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from p2pnet.core import Send, SetTimer
from relay.effects import Fetch
from relay.messages import HaveChunks
from relay.planner import Membership
from relay.swarm import bitmap_bits, bitmap_bytes

if TYPE_CHECKING:
    from relay.transfer import TransferConfig
    from relay.transfer_state import _Version

TIMER_HAVE = "relay/have"  # the swarm layout: tell our neighbours what we hold now
SWARM = -1  # the "stripe" of a swarm request (no plan, no stripes)


class SwarmTransfer:
    """The swarm layout for `relay.transfer.TransferCore` (see the module docstring)."""

    # the core's state these methods use (`TransferCore.__init__` sets it)
    config: TransferConfig
    self_id: str
    _members: Membership
    _versions: dict[int, _Version]
    _banned: set[str]
    _in_flight: int
    _neighbours: frozenset[str]
    _have_at: float | None
    _have_sent: float

    if TYPE_CHECKING:  # what these call on the core (`relay.transfer.TransferCore` or another of its mixins)
        def _usable(self, now: float, peer: str) -> bool: ...
        def _note_request(self, now: float, v: _Version, source: str, index: int, stripe: int) -> None: ...
        def _pump(self, now: float, v: _Version, effects: list[Any], stripe: int | None = None) -> None: ...
        def _arm(self, now: float, effects: list[Any]) -> list[Any]: ...
        def _ask_manifest(self, now: float, sender: str, version: int, manifest_id: bytes, effects: list[Any],
                          holds_all: bool = True) -> bool: ...

    def _pump_swarm(self, now: float, v: _Version, effects: list[Any]) -> None:
        """Ask neighbours (and complete holders) for chunks we lack, rarest first, up to the
        window per source and the in-flight budget."""
        swarm = v.swarm
        assert swarm is not None
        budget = self.config.max_in_flight - self._in_flight
        if budget <= 0:
            return
        everything = (1 << v.count) - 1
        peers = sorted(set(swarm.peer_bits) | v.holders)
        if not peers:
            return
        start = v.fetched_chunks % len(peers)  # a different neighbour goes first each time
        uploads, window = self._members.uploads, self.config.window_per_source
        for peer in peers[start:] + peers[:start]:
            if not self._usable(now, peer) or uploads.get(peer, 1.0) <= 0:
                continue
            bits = everything if peer in v.holders else swarm.peer_bits.get(peer, 0)
            link = (peer, SWARM)
            load = v.link_load.get(link, 0)
            while load < window and budget > 0:
                index = swarm.pick(bits, v.tried, peer)
                if index is None:
                    break
                swarm.asked |= 1 << index
                load += 1
                budget -= 1
                self._note_request(now, v, peer, index, SWARM)
                effects.append(Fetch(peer, v.version, index, v.digests[index], v.size(index), False))
            if budget <= 0:
                return

    def _gained(self, now: float, v: _Version, bits: int, effects: list[Any]) -> None:
        """We hold `bits` more of `v`: our neighbours hear of it now, or at most `have_interval_s`
        after they last heard from us."""
        swarm = v.swarm
        assert swarm is not None
        swarm.mine |= bits
        swarm.dirty = True
        due = self._have_sent + self.config.have_interval_s
        if now >= due:
            self._send_haves(now, effects)
        elif self._have_at is None:
            self._have_at = due
            effects.append(SetTimer(due, TIMER_HAVE))

    def _send_haves(self, now: float, effects: list[Any]) -> None:
        self._have_sent = now
        for v in self._versions.values():
            swarm = v.swarm
            if swarm is None or not swarm.dirty:
                continue
            swarm.dirty = False
            swarm.sent_bits = swarm.mine
            have = HaveChunks(v.version, v.signed.manifest_id, bitmap_bytes(swarm.mine, v.count))
            for peer in sorted(self._neighbours | set(swarm.peer_bits)):
                if peer != self.self_id and peer not in self._banned:
                    effects.append(Send(peer, have))

    def _on_have(self, now: float, sender: str, body: HaveChunks) -> list[Any]:
        v = self._versions.get(body.version)
        effects: list[Any] = []
        if v is None:
            self._ask_manifest(now, sender, body.version, body.manifest_id, effects, holds_all=False)
            return self._arm(now, effects)
        swarm = v.swarm
        if swarm is None or body.manifest_id != v.signed.manifest_id or sender in self._banned:
            return []
        if sender not in swarm.peer_bits:
            swarm.peer_bits[sender] = 0
            if sender not in self._neighbours and swarm.sent_bits >= 0:  # it chose us: it has not heard from us
                effects.append(Send(sender, HaveChunks(v.version, v.signed.manifest_id,
                                                       bitmap_bytes(swarm.mine, v.count))))
        if swarm.told(sender, bitmap_bits(body.bitmap, v.count)) and not v.complete:
            self._pump(now, v, effects)
        return self._arm(now, effects)
