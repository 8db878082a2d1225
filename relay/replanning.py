"""Membership and plans for the transfer core: the relay members we know (`set_members`), the
per-peer marks that follow them (`_prune_peers`), and each version's plan (`_replan`, at the upload
its origin is planned at, `_origin_upload`).

Mixed into `relay.transfer.TransferCore` (`Replanning`). Membership changes replan the versions in
progress only when peers join or leave or start or stop serving; a peer's new upload figure alone (a
relay advertising what its uploads measurably deliver) applies from the next version on: replanning
mid-way sent requests to parents that no longer forwarded those chunks, and they stalled (measured
on loopback). Members nobody has dialled back yet are planned as leaves (upload 0); a version known
before their dial-backs come asks the origin first only for our own stripes of the plan with them
dialable (`set_members`' `unconfirmed`; `relay.requests`, "Dial-backs pending").

These methods read and set the core's membership and per-peer marks, replan its versions and call
its pumps (`relay.requests`); pure, like the core: no I/O, no clock, the time as an argument.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from relay.planner import Membership, StripePlan, plan_broadcast, plan_tree
from relay.swarm import SwarmVersion, neighbours, rotation
from relay.transfer_state import _requeue

if TYPE_CHECKING:
    from relay.transfer_config import TransferConfig
    from relay.transfer_state import _Version


class Replanning:
    """Membership and plans for `relay.transfer.TransferCore` (see the module docstring)."""

    # the core's state these methods use (`TransferCore.__init__` sets it)
    config: TransferConfig
    self_id: str
    _self_upload: float
    _members: Membership
    _unconfirmed: dict[str, float]
    _pending_since: dict[str, float]
    _slow: set[str]
    _refused: dict[str, int]
    _unaddressed: dict[str, float]
    _rates: dict[str, float]
    _served_rates: dict[str, float]
    _samples: dict[str, int]
    _waits: dict[str, float]
    _excluded: dict[str, float]
    _draw_orders: dict[StripePlan, Any]
    _neighbours: frozenset[str]

    if TYPE_CHECKING:  # what these call on the core (`relay.transfer.TransferCore` or another of its mixins)
        def _note_members(self, now: float, members: Membership) -> None: ...
        def _reconsider_origin(self, now: float) -> list[Any]: ...
        def _newest_first(self) -> list[_Version]: ...
        def _pump(self, now: float, v: _Version, effects: list[Any], stripe: int | None = None) -> None: ...
        def _arm(self, now: float, effects: list[Any]) -> list[Any]: ...
        def _chain(self, now: float, plan: StripePlan, stripe: int) -> list[str]: ...
        def _await_dial_backs(self, now: float, v: _Version, origin_upload: float) -> None: ...

    def set_members(self, now: float, uploads: dict[str, float] | Membership,
                    unconfirmed: dict[str, float] | None = None) -> list[Any]:
        """The relay peers we know and their upload capacities (bytes/s); a peer that must not
        serve (not dialable) is given 0, so it is planned as a leaf only. Our own entry defaults
        to `self_upload_bps` when `uploads` leaves it out. `unconfirmed`: those given 0 only because
        nobody has dialled them back yet, at the upload they advertise (a version known meanwhile
        asks the origin first for our own stripes of the plan with them dialable: `relay.requests`);
        when each was first told us pending is kept while it stays pending (`PENDING_HOPE_S`)."""
        members = uploads if isinstance(uploads, Membership) else Membership.of(
            {self.self_id: self._self_upload, **uploads})
        pending_changed = (unconfirmed or {}) != self._unconfirmed
        self._unconfirmed = dict(unconfirmed or {})
        since = self._pending_since
        self._pending_since = {p: since.get(p, now) for p in self._unconfirmed}
        if members == self._members:
            return self._reconsider_origin(now) if pending_changed else []
        only_figures = members.serves_as(self._members)  # (who serves is what a replan must follow)
        self._members = members
        self._note_members(now, members)
        self._prune_peers(now)
        self._draw_orders.clear()  # (scored with the old membership's uploads: rebuilt on demand)
        if self.config.layout == "swarm":
            self._neighbours = neighbours(self.self_id, members.uploads, self.config.swarm_degree)
        if only_figures:  # the same peers serve, at other rates: a transfer in progress keeps its plan
            # (replanning mid-way strands requests); the next version uses them
            return self._reconsider_origin(now) if pending_changed else []
        effects: list[Any] = []
        for v in self._newest_first():
            if not v.complete:
                self._replan(now, v)
                self._pump(now, v, effects)
        return self._arm(now, effects)

    def _prune_peers(self, now: float) -> None:
        """Forget per-peer marks that no longer matter, so a long-running peer's state follows its
        membership, not every peer it ever saw: `slow` and refusal counts of peers that left
        (a peer that comes back is judged afresh), their measured rates, exclusions that have
        ended, and when members went without an address (their heartbeat came)."""
        members = self._members.uploads
        if self._slow:
            self._slow = {p for p in self._slow if p in members}  # (O(slow), not O(members))
        if self._refused:
            self._refused = {p: n for p, n in self._refused.items() if p in members}
        if self._unaddressed:  # a member's heartbeat came: its address with it (`relay.failures`, `no_address`)
            self._unaddressed = {p: t for p, t in self._unaddressed.items() if p not in members}
        if any(p not in members for p in self._rates):
            self._rates = {p: r for p, r in self._rates.items() if p in members}
            self._served_rates = {p: r for p, r in self._served_rates.items() if p in members}
            self._samples = {p: n for p, n in self._samples.items() if p in members}
        if any(p not in members for p in self._waits):
            self._waits = {p: w for p, w in self._waits.items() if p in members}
        if self._excluded:
            self._excluded = {p: until for p, until in self._excluded.items() if until > now}

    def _origin_upload(self, v: _Version) -> float:
        """The upload `v`'s origin is planned at. An origin our view lacks (its heartbeat not heard
        yet) is planned at the view's ceiling, a figure every relay derives alike from its
        membership: with our own upload, relays of different uploads planned the same version
        differently, though plans are meant to agree across relays (`relay.planner`, stable plans).
        The ceiling is also what `plan_broadcast` caps a known origin at beyond `ORIGIN_SLOTS`
        members, so a view lacking a fast origin plans it about as the views that have it do.
        (0 when nobody serves: the ceiling is inf.)"""
        ceiling = self._members.ceiling
        return self._members.uploads.get(v.signed.publisher, ceiling if ceiling < math.inf else 0.0)

    def _replan(self, now: float, v: _Version) -> None:
        if self.config.layout == "swarm":
            if v.swarm is None:  # no plan to redo: membership only changes our neighbours
                mine = sum(1 << i for i in range(v.count) if v.have[i])
                v.swarm = SwarmVersion(v.count, rotation(self.self_id, v.count), mine)
            return
        origin_upload = self._origin_upload(v)
        if self.config.layout == "striped":
            v.plan = plan_broadcast(v.signed.publisher, origin_upload, self._members, v.count, self.config.stripes,
                                    salt=v.signed.manifest_id, stable=self.config.stable_plan)
        else:
            fanout = self.config.tree_fanout if self.config.layout == "tree" else len(self._members)
            v.plan = plan_tree(v.signed.publisher, self._members, v.count, fanout, salt=v.signed.manifest_id)
        v.chains = [self._chain(now, v.plan, s) for s in range(v.plan.stripes)]
        home = v.plan.home.get(self.self_id, -1)
        v.forwards = home if home >= 0 and v.plan.fanout[home].get(self.self_id, 0) > 0 else -1
        v.next_pos = [0] * v.plan.stripes
        v.passed.clear()  # (passed over and timed per stripe of the old plan: its stripes are not the new one's)
        v.link_rates.clear()
        v.unavailable.clear()
        v.forsaken.clear()
        v.borrowed.clear()
        old = [i for q in v.retry if q for i in q] + v.parked
        v.retry = [None] * v.plan.stripes  # a queue is made when a stripe first needs one
        v.parked = []
        for index in old:
            _requeue(v, index)
        self._await_dial_backs(now, v, origin_upload)  # (the chunks kept from the origin go back last)
