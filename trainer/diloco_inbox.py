"""A DiLoCo round's inbox: the frames other trainer peers sent us (Join, Members, Part, NoRoom) and our own
links' failure reports (`PeerFailed`), waiting until the round reads them (`RoundInbox`, the trio
shell of the pure `InboxCore`).

Nothing reads it while the inner steps run; then the round reads it as fast as frames come
(`DilocoRole._next_event`). Each sender has `PEER_INBOX` places at a time, so that no sender fills
it for the others. Theory of operation: two lanes, by who sent the frame.

- The group's lane: the frames of the senders the round knows as members (`reserve`: in an open
  group the members of the last round we took part in, from its decision on; in a closed group
  every listed trainer). No place there is shared with anyone outside the group: a member always
  finds its `PEER_INBOX` places, whoever outside it sends. The lane holds at most `GROUP_INBOX`
  frames, `MAX_MEMBERS` (the most a round's Members lists, and a closed group lists: checked at
  start) x `PEER_INBOX`, every member's whole share at the largest group a round can hold (an
  honest member uses about 2 while nothing reads), and at most `GROUP_BYTES` of them
  (`frame_bytes`), what the whole inbox held before: full shares of 2 MB Parts from every member
  would be gigabytes. A member's frame can wait for that lane only behind other members' frames
  (and those of a peer no longer reserved): members' Parts, which come while the round reads, or a
  hostile member's share.
- The pool: every other sender's frames (a joiner not yet in a round with us; in an open group any
  identity, and identities cost nothing) share `INBOX` places, each sender within its own
  `PEER_INBOX`. Free identities can fill the pool (16 of them); that holds up only joiners, whose
  frames wait for room there (and are cut past a bound: `DilocoServing._deliver`), as every
  frame did when the pool was the whole inbox.

Our own reports (`PeerFailed`) go into the lane of the peer they name, after the frames of it
that came before them: read after the report, one of those would clear the suspicion the report
raises (`DilocoRole.suspects`). They have `REPORTS` places of their own, outside the lanes'
bounds: a report never waits for a frame to be read, only for another report.

The round reads the group's lane first, then the pool, each in the order frames came: a member's
frame never waits behind a stranger's. The pool is read whenever no member's frame waits, and
members send a bounded number of frames a round, so it is not starved. A sender's frames keep
their order: one that becomes a member with frames still in the pool has them moved to the end of
the group's lane (`reserve`), before any it sends from then on (else its Parts taken in before our
decision would wait behind every member's later frames, past the round's deadlines).

Waiting for room: a frame whose sender has all its places taken waits for one of them to be read;
one whose lane is full waits for a frame of that lane to be read (or for its sender to change
lanes: `reserve`); whichever waiter runs first then takes the place. A wait that is cancelled
has put nothing.

This module must not decide who is a member (`trainer.diloco_role`) or what a frame means.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable

import trio

from trainer.diloco_links import InboxEvent, PeerFailed, Received
from trainer.diloco_messages import MAX_MEMBERS, MAX_PART_BYTES, Join, NoRoom, Part, RoundFrame

# frames of one sender the inbox holds at a time. While the inner steps run nothing reads it; an
# honest peer sends us a few frames meanwhile (its Joins of our round, again each time the peers
# it takes for dead change, and a Join or Members telling us we are behind): about 2.
PEER_INBOX = 16
INBOX = 256  # the pool: places the senders outside the group share (16 senders' whole share)
GROUP_INBOX = MAX_MEMBERS * PEER_INBOX  # the group's lane: every member's share, at the largest group
# the group's lane in bytes (`frame_bytes`): what the whole inbox held before it had lanes, 256 whole
# Parts. An honest group of `MAX_MEMBERS` leaves under 2% of it taken while nothing reads (2 frames
# a member, each Join or Members naming at most `MAX_MEMBERS` peers); a member's frame waits here
# only behind other members' Parts, which come when the round reads.
GROUP_BYTES = INBOX * MAX_PART_BYTES
FRAME_BYTES = 1024  # what a frame costs over its payload (`frame_bytes`), so that none is free
REPORTS = 256  # our own failure reports unread (one a failed send or a closed link)


class Lane(enum.Enum):
    """Where a frame waits: the group's lane is read first."""

    GROUP = "group"
    POOL = "pool"


def frame_bytes(body: RoundFrame) -> int:
    """What a frame holds in memory, near enough: its payload, peer ids included, and `FRAME_BYTES`."""
    if isinstance(body, Part):
        return FRAME_BYTES + len(body.values) + len(body.scales) + sum(map(len, body.contributors))
    if isinstance(body, NoRoom):
        return FRAME_BYTES
    return FRAME_BYTES + sum(map(len, body.known if isinstance(body, Join) else body.members))


class InboxCore:
    """The inbox's lanes and counts (see the module docstring): no clock, no trio."""

    def __init__(self, members: Iterable[str] = (), *, per_sender: int = PEER_INBOX, pool: int = INBOX,
                 group: int = GROUP_INBOX, group_bytes: int = GROUP_BYTES, reports: int = REPORTS) -> None:
        self.per_sender, self.pool, self.reports = per_sender, pool, reports
        self.group, self.group_bytes = group, group_bytes
        self.members: frozenset[str] = frozenset()
        self.lanes: dict[Lane, deque[InboxEvent]] = {lane: deque() for lane in Lane}
        self.held = 0  # bytes of the frames in the group's lane (`frame_bytes`)
        self.queued: dict[str, int] = {}  # sender -> its frames unread, in either lane
        self.reported = {lane: 0 for lane in Lane}  # our reports unread, by lane (counted apart from frames)
        self.reserve(members)

    def reserve(self, members: Iterable[str]) -> None:
        """From now on these senders' frames take the group's lane (replacing the last reservation).
        A new member's frames still in the pool move to the group's lane's end, so that each
        sender's frames are still read in the order they came (they came before any it sends now;
        the lane may then hold more than its bounds until it is read). A former member's frames
        stay where they are: the group's lane is read first."""
        members = frozenset(members)
        if len(members) > MAX_MEMBERS:
            raise ValueError(f"{len(members)} members: a round holds at most {MAX_MEMBERS}")
        joined = members - self.members
        self.members = members
        moved = [e for e in self.lanes[Lane.POOL] if e.peer in joined]
        if moved:
            self.lanes[Lane.POOL] = deque(e for e in self.lanes[Lane.POOL] if e.peer not in joined)
            self.lanes[Lane.GROUP].extend(moved)
            reports = sum(isinstance(e, PeerFailed) for e in moved)
            self.reported[Lane.POOL] -= reports
            self.reported[Lane.GROUP] += reports
            self.held += sum(frame_bytes(e.body) for e in moved if isinstance(e, Received))

    def lane_of(self, peer: str) -> Lane:
        return Lane.GROUP if peer in self.members else Lane.POOL

    def blocked(self, peer: str, size: int = FRAME_BYTES) -> str | Lane | None:
        """What a frame of `peer` of `size` bytes (`frame_bytes`) waits for: None, there is room;
        its sender's id, all its places are taken; a lane, that lane is full (in the group's lane,
        frames or bytes; a frame finds room in an empty lane whatever its size)."""
        if self.queued.get(peer, 0) >= self.per_sender:
            return peer
        lane = self.lane_of(peer)
        frames = len(self.lanes[lane]) - self.reported[lane]
        if lane is Lane.POOL:
            return lane if frames >= self.pool else None
        if frames >= self.group or (frames and self.held + size > self.group_bytes):
            return lane
        return None

    def put(self, received: Received) -> None:
        """`received` into its sender's lane; there must be room (`blocked`)."""
        size = frame_bytes(received.body)
        if (full := self.blocked(received.peer, size)) is not None:
            raise ValueError(f"no room for a frame of {received.peer}: {full} is full")
        lane = self.lane_of(received.peer)
        self.lanes[lane].append(received)
        self.held += size if lane is Lane.GROUP else 0
        self.queued[received.peer] = self.queued.get(received.peer, 0) + 1

    def report_blocked(self) -> bool:
        return sum(self.reported.values()) >= self.reports

    def report(self, failed: PeerFailed) -> None:
        """Our report into the lane of the peer it names, after that peer's frames that came
        before it (a frame read after it would clear the suspicion it raises: `DilocoRole.suspects`);
        there must be room (`report_blocked`), which the frames' bounds do not take."""
        if self.report_blocked():
            raise ValueError("no room for another report")
        lane = self.lane_of(failed.peer)
        self.lanes[lane].append(failed)
        self.reported[lane] += 1

    def take(self) -> tuple[InboxEvent, Lane] | None:
        """The next event the round reads (the group's lane first), and the lane it left."""
        lane = Lane.GROUP if self.lanes[Lane.GROUP] else Lane.POOL
        if not self.lanes[lane]:
            return None
        event = self.lanes[lane].popleft()
        if isinstance(event, PeerFailed):
            self.reported[lane] -= 1
            return event, lane
        self.held -= frame_bytes(event.body) if lane is Lane.GROUP else 0
        if self.queued[event.peer] > 1:
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
        for lane in Lane:  # a frame waiting for one lane may be of the other now
            self._wake(lane)

    @property
    def reserved(self) -> frozenset[str]:
        """The senders with places of their own (`reserve`)."""
        return self.core.members

    def queued(self, peer: str) -> int:
        return self.core.queued.get(peer, 0)

    def __len__(self) -> int:
        return len(self.core)

    async def put(self, received: Received) -> None:
        """Into its lane once there is room (cancelled first: nothing put)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        size = frame_bytes(received.body)
        while (full := self.core.blocked(received.peer, size)) is not None:
            await self._room.setdefault(full, trio.Event()).wait()
        self.core.put(received)
        self._wake_reader()
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def report(self, failed: PeerFailed) -> None:
        """Our report (the round reads it after the frames of the peer it names that came before
        it, and before those that came after)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while self.core.report_blocked():
            if self._report_room is None:  # (an Event has no truth value: trio refuses `or`)
                self._report_room = trio.Event()
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
