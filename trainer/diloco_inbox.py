"""A DiLoCo round's inbox: the frames other trainer peers sent us (Join, Members, Part) and our own
links' failure reports (`PeerFailed`), waiting until the round reads them (`RoundInbox`, the trio
shell of the pure `InboxCore`).

Nothing reads it while the inner steps run; then the round reads it as fast as frames come
(`DilocoRole._next_event`). Each sender has `PEER_INBOX` places at a time, so that no sender fills
it for the others. Theory of operation: two lanes, by who sent the frame.

- The group's lane: the frames of the senders the round knows as members (`reserve`: in an open
  group the members of the last round we took part in, from its decision on; in a closed group
  every listed trainer), and our own reports. No place there is shared with anyone outside the
  group: a member always finds its `PEER_INBOX` places, whoever else sends. The lane holds at
  most `GROUP_INBOX` frames, `MAX_MEMBERS` (the most a round's Members lists, and a closed group
  lists: checked at start) x `PEER_INBOX`, every member's whole share at the largest group a round
  can hold (an honest member uses about 2 while nothing reads); only the unread frames of a peer
  no longer reserved can make a member wait for that lane. Reports have `REPORTS` places.
- The pool: every other sender's frames (a joiner not yet in a round with us; in an open group any
  identity, and identities cost nothing) share `INBOX` places, each sender within its own
  `PEER_INBOX`. Free identities can fill the pool (16 of them); that holds up only joiners, whose
  frames wait for room there (and are cut past a bound: `DilocoServing._deliver`), as every
  frame did when the pool was the whole inbox.

The round reads the group's lane first, then the pool, each in the order frames came: a member's
frame never waits behind a stranger's. The pool is read whenever no member's frame waits, and
members send a bounded number of frames a round, so it is not starved. A sender's frames keep
their order within a lane; one that becomes a member with frames still in the pool may have its
later frames read before them, which no round minds (those it sent before the round's decision,
its Joins, tell the round nothing after it).

Waiting for room: a frame whose sender has all its places taken waits for one of them to be read;
one whose lane is full waits for a frame of that lane to be read (or, in the pool, for its sender
to become a member); whichever waiter runs first then takes the place. A wait that is cancelled
has put nothing.

This module must not decide who is a member (`trainer.diloco_role`) or what a frame means.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable

import trio

from trainer.diloco_links import InboxEvent, PeerFailed, Received
from trainer.diloco_messages import MAX_MEMBERS

# frames of one sender the inbox holds at a time. While the inner steps run nothing reads it; an
# honest peer sends us a few frames meanwhile (its Joins of our round, again each time the peers
# it takes for dead change, and a Join or Members telling us we are behind): about 2.
PEER_INBOX = 16
INBOX = 256  # the pool: places the senders outside the group share (16 senders' whole share)
GROUP_INBOX = MAX_MEMBERS * PEER_INBOX  # the group's lane: every member's share, at the largest group
REPORTS = 256  # our own failure reports unread (one a failed send or a closed link)


class Lane(enum.Enum):
    """Where a frame waits: the group's lane is read first."""

    GROUP = "group"
    POOL = "pool"


class InboxCore:
    """The inbox's lanes and counts (see the module docstring): no clock, no trio."""

    def __init__(self, members: Iterable[str] = (), *, per_sender: int = PEER_INBOX, pool: int = INBOX,
                 group: int = GROUP_INBOX, reports: int = REPORTS) -> None:
        self.per_sender, self.pool, self.group, self.reports = per_sender, pool, group, reports
        self.members: frozenset[str] = frozenset()
        self.reserve(members)
        self.lanes: dict[Lane, deque[InboxEvent]] = {lane: deque() for lane in Lane}
        self.queued: dict[str, int] = {}  # sender -> its frames unread, in either lane
        self.reported = 0  # our reports unread (in the group's lane, counted apart)

    def reserve(self, members: Iterable[str]) -> None:
        """From now on these senders' frames take the group's lane (replacing the last reservation)."""
        members = frozenset(members)
        if len(members) > MAX_MEMBERS:
            raise ValueError(f"{len(members)} members: a round holds at most {MAX_MEMBERS}")
        self.members = members

    def lane_of(self, peer: str) -> Lane:
        return Lane.GROUP if peer in self.members else Lane.POOL

    def blocked(self, peer: str) -> str | Lane | None:
        """What a frame of `peer` waits for: None, there is room; its sender's id, all its places
        are taken; a lane, that lane is full."""
        if self.queued.get(peer, 0) >= self.per_sender:
            return peer
        lane = self.lane_of(peer)
        frames = len(self.lanes[lane]) - (self.reported if lane is Lane.GROUP else 0)
        return lane if frames >= (self.group if lane is Lane.GROUP else self.pool) else None

    def put(self, received: Received) -> None:
        """`received` into its sender's lane; there must be room (`blocked`)."""
        if (full := self.blocked(received.peer)) is not None:
            raise ValueError(f"no room for a frame of {received.peer}: {full} is full")
        self.lanes[self.lane_of(received.peer)].append(received)
        self.queued[received.peer] = self.queued.get(received.peer, 0) + 1

    def report_blocked(self) -> bool:
        return self.reported >= self.reports

    def report(self, failed: PeerFailed) -> None:
        """Our report into the group's lane; there must be room (`report_blocked`)."""
        if self.report_blocked():
            raise ValueError("no room for another report")
        self.lanes[Lane.GROUP].append(failed)
        self.reported += 1

    def take(self) -> tuple[InboxEvent, Lane] | None:
        """The next event the round reads (the group's lane first), and the lane it left."""
        lane = Lane.GROUP if self.lanes[Lane.GROUP] else Lane.POOL
        if not self.lanes[lane]:
            return None
        event = self.lanes[lane].popleft()
        if isinstance(event, PeerFailed):
            self.reported -= 1
        elif self.queued[event.peer] > 1:
            self.queued[event.peer] -= 1
        else:
            del self.queued[event.peer]  # (a peer with nothing queued costs nothing)
        return event, lane

    def __len__(self) -> int:
        return sum(len(lane) for lane in self.lanes.values())


class RoundInbox:
    """The round's inbox in trio: `put` (a frame the data channel took in, waiting for room),
    `report` (our links' failures), `receive` (the round), `reserve` (the role, once a round's
    members are decided). One reader at a time."""

    def __init__(self, members: Iterable[str] = ()) -> None:
        self.core = InboxCore(members)
        self._arrived = trio.Event()  # set (and replaced) at each put or report
        self._room: dict[str | Lane, trio.Event] = {}  # set when what frames wait for frees (`blocked`)
        self._report_room: trio.Event | None = None  # set when a report is read, if a report waits

    def reserve(self, members: Iterable[str]) -> None:
        self.core.reserve(members)
        self._wake(Lane.POOL)  # a frame waiting for the pool may be a member's now

    def queued(self, peer: str) -> int:
        return self.core.queued.get(peer, 0)

    def __len__(self) -> int:
        return len(self.core)

    async def put(self, received: Received) -> None:
        """Into its lane once there is room (cancelled first: nothing put)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while (full := self.core.blocked(received.peer)) is not None:
            await self._room.setdefault(full, trio.Event()).wait()
        self.core.put(received)
        self._wake_reader()
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def report(self, failed: PeerFailed) -> None:
        """Our report (the round reads it before anyone's frame that came after it)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while self.core.report_blocked():
            self._report_room = self._report_room or trio.Event()
            await self._report_room.wait()
        self.core.report(failed)
        self._wake_reader()
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive(self) -> InboxEvent:
        """The next event, waiting for one (cancelled: nothing taken)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while (event := self._take()) is None:
            await self._arrived.wait()
        await trio.lowlevel.cancel_shielded_checkpoint()
        return event

    def receive_nowait(self) -> InboxEvent:
        if (event := self._take()) is None:
            raise trio.WouldBlock
        return event

    def _take(self) -> InboxEvent | None:
        taken = self.core.take()
        if taken is None:
            return None
        event, lane = taken
        if isinstance(event, PeerFailed):
            if self._report_room is not None:
                self._report_room.set()
                self._report_room = None
        else:
            self._wake(event.peer)
            self._wake(lane)
        return event

    def _wake(self, what: str | Lane) -> None:
        if (event := self._room.pop(what, None)) is not None:
            event.set()

    def _wake_reader(self) -> None:
        self._arrived.set()
        self._arrived = trio.Event()
