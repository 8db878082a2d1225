"""The relay role's membership: whom the core plans with, and what we advertise of ourselves.

Mixed into `relay.role.RelayRole` (`MemberFollowing`). `_follow_members` hands the core the relay
members of our peer table and their advertised uploads (`serving_uploads`: 0 for a peer others
cannot dial; `unconfirmed_uploads`: those of them not dialled back yet) at least every
`MEMBERS_POLL_S`, and at once when the node tells of a peer that joined, left or changed
(`_on_node_event`); on the way it marks the node busy while chunks move
(`_busy`, `_about_to_move`: heartbeats slow down then), and advertises what our uploads
measurably deliver when that is below `upload_bps` (`_advertise_upload`, measured by the upload
meter while every upload slot is busy: `_uploads_full`). It keeps how long our members have been
members on disk every `SAVE_EVERY_S` (`_keep_members`) and gives it back to the core at start
(`_recall_members`), so our restart does not make newcomers of them (`relay.member_record`).

These methods read the role's node, core, upload meter, serving counters and upstreams, keep
`_members_changed` and `_moved_at`, and call its `_command(fn)`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import trio

from p2pnet.peertable import PeerChanged, PeerJoined, PeerLeft
from relay.member_record import MEMBERS_FILE, SAVE_EVERY_S, MemberRecordUnreadable, load, save
from relay.serving import UploadMeter

if TYPE_CHECKING:
    from p2pnet.node import Node
    from relay.transfer import TransferCore
    from relay.upstream import Upstream

log = logging.getLogger("relay.role")  # the role's logger: its log lines keep their name

MEMBERS_POLL_S = 1.0
BUSY_LINGER_S = 3.0  # the node counts us busy (slower heartbeats) until this long after the last chunk moved


def serving_uploads(node: Node) -> dict[str, float]:
    """Relay members and their advertised upload, 0 for peers that others cannot dial (or not
    yet known to be dialable: `Heartbeat.reachable`), so the planner never makes them parents."""
    uploads = {e.peer_id: float(e.capacity.upload_bps) if e.can_serve else 0.0
               for e in node.peertable.with_role("relay")}
    uploads[node.peer_id] = float(node.peertable.local.capacity.upload_bps) if node.peertable.local.reachable else 0.0
    return uploads


def unconfirmed_uploads(node: Node) -> dict[str, float]:
    """The relay members `serving_uploads` gives 0 only because nobody has dialled them back yet
    (`Heartbeat.reachable` None), ourselves included, at the upload they advertise: a version known
    meanwhile asks its origin first for our own stripes of the plan with them dialable
    (`relay.requests`, "Dial-backs pending")."""
    pending = {e.peer_id: float(e.capacity.upload_bps) for e in node.peertable.with_role("relay")
               if e.reachable is None}
    local = node.peertable.local
    if local.reachable is None:
        pending[node.peer_id] = float(local.capacity.upload_bps)
    return pending


class MemberFollowing:
    """Membership for `relay.role.RelayRole` (see the module docstring)."""

    # the role's state these methods use (`RelayRole.__init__` and its mixins set it)
    node: Any
    core: TransferCore
    _members_changed: trio.Event
    _meter: UploadMeter
    _moved_at: float
    _upstreams: dict[str, Upstream]
    serving_now: dict[str, int]
    bytes_served: int

    if TYPE_CHECKING:  # what these call on the role (`relay.role.RelayRole`)
        async def _command(self, fn: Callable[[float], list[Any]]) -> None: ...

    def _on_node_event(self, origin: str, event: Any) -> None:
        if isinstance(event, (PeerJoined, PeerLeft, PeerChanged)):  # roles and reachability plan too
            self._members_changed.set()

    def _uploads_full(self, full: bool) -> None:
        (self._meter.full if full else self._meter.not_full)(trio.current_time(), self.bytes_served)

    def _advertise_upload(self) -> None:
        """Advertise what our uploads measurably deliver when that is below `upload_bps` by more
        than 10% (no flapping); the configured figure again once nothing recent was measured.
        Peers plan their next version with it (a transfer in progress keeps its plan)."""
        configured = self.node.config.upload_bps
        measured = self._meter.rate(trio.current_time(), self.bytes_served)
        upload = int(min(configured, measured)) if measured is not None else configured
        local = self.node.peertable.local
        if abs(upload - local.capacity.upload_bps) <= 0.1 * local.capacity.upload_bps:
            return
        log.info("advertising an upload of %.1f MB/s (%s)", upload / 1e6,
                 "measured while every upload slot was busy" if upload < configured else "as configured")
        self.node.peertable.set_local(replace(local, capacity=replace(local.capacity, upload_bps=upload)))

    def _about_to_move(self) -> None:
        """A version is about to be fetched or served: busy from now (not from the first chunk,
        up to `MEMBERS_POLL_S` later), lapsing `BUSY_LINGER_S` on if no chunk moves."""
        self._moved_at = trio.current_time()
        self.node.set_busy("relay", True)

    def _busy(self) -> bool:
        """Whether we move chunks now: fetches outstanding, uploads running, or a chunk moved
        within `BUSY_LINGER_S`."""
        return (trio.current_time() - self._moved_at < BUSY_LINGER_S or bool(self.serving_now)
                or any(u.outstanding for u in self._upstreams.values()))

    async def _follow_members(self) -> None:
        await self._recall_members()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep_members_every)  # (a slow disk does not hold up our membership)
            while True:
                self.node.set_busy("relay", self._busy())  # heartbeats slow down while chunks move
                self._advertise_upload()
                uploads, pending = serving_uploads(self.node), unconfirmed_uploads(self.node)
                await self._command(lambda now: self.core.set_members(now, uploads, pending))
                with trio.move_on_after(MEMBERS_POLL_S):
                    await self._members_changed.wait()
                self._members_changed = trio.Event()

    async def _keep_members_every(self) -> None:
        while True:
            await trio.sleep(SAVE_EVERY_S)
            await self._keep_members()

    def _members_path(self) -> Path:
        return Path(self.node.config.data_dir) / MEMBERS_FILE

    async def _recall_members(self) -> None:
        """At start: how long our members had been members before our restart, from our record on
        disk (`relay.member_record`), to the core (`recall_members`)."""
        try:
            ages = await trio.to_thread.run_sync(load, self._members_path())
        except (MemberRecordUnreadable, OSError) as e:  # (only orders manifest asks: as after a first start)
            log.warning("the record of our members is unreadable, starting without it: %s", e)
            ages = {}
        await self._command(partial(self.core.recall_members, ages=ages))

    async def _keep_members(self) -> None:
        """Write how long our members have been members to our record on disk (`relay.member_record`)."""
        seen: dict[str, float] = {}
        await self._command(lambda now: seen.update(self.core.members_seen(now)) or [])
        try:
            await trio.to_thread.run_sync(save, self._members_path(), seen)
        except OSError as e:  # our disk: the record stays as it was; tried again in `SAVE_EVERY_S`
            log.warning("could not keep the record of our members: %s", e)
