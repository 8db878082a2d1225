"""The `diloco` role's answer to a `StateRequest` (a direct join): our global state, piece by
piece, each taken by its `state_due` time (`_send_state`); the asker counts the same deadlines
(`trainer.diloco_catchup`). An asker left out of our round asks for a later state
(`after_round`): we hold its request until our round is over (`_hold`, `_state_past`, woken by
`_state_moved`), so it fetches the state once, not its own round's again; at most `STATE_HOLDS`
such requests at once, one an asker, each until its asker closes, and of them at most
`STRANGER_HOLDS` for askers we do not know to be of our group (once we finished a round); one
more is refused (`HoldsFull`). Of our group, here: a listed trainer of a closed group, or in an
open one a peer whose whole contribution the last round we finished took (`contributed`), not
any identity that got into a round's members (`_of_group`).

Mixed into `trainer.diloco_serving.DilocoServing` (`AnsweringState`), whose `_on_frame` takes the
request and calls these; `trainer.diloco_role.DilocoRole` calls `_state_moved` as its state moves,
and `trainer.diloco_catchup` `state_due`. These methods read the role's `node`, `config`, `state`,
`history` and `contributed` (whom we know to be of our group: `_of_group`), and keep what they hold (`holding`,
`strangers_held`, `state_moved`) and count the requests refused for room (`refused_members`,
`refused_strangers`; `holds_status`, shown in the role's `status()`). Their log lines go to the role's
logger. They must not read other frames of the connection than the request, nor decide rounds.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import trio

from p2pnet.dataplane import send_frame
from p2pnet.errors import MessageRejected
from trainer.diloco_messages import STATE_PIECE_VALUES, HoldsFull, StatePiece

if TYPE_CHECKING:
    from trainer.diloco_local import GlobalState
    from trainer.diloco_role import DilocoConfig

log = logging.getLogger("trainer.diloco_role")  # the role's logger: its log lines keep their name


# x deadline_s: the head start of our answer to a StateRequest; from then on it must keep up
# `state_min_bytes_per_s` (`state_due`), a StateOffer must be taken within deadline_s. A peer that
# asks and does not read would otherwise hold the connection, and the task writing to it, once the
# socket buffers fill. The asker gives each piece as long (`fetch_state`), counted from before it
# asks: we never give up on an honest asker first (with the same settings). The state is 8 bytes a
# parameter (1.08 GB for SmolLM2-135M): at the default 1 MB/s it may take 18 minutes, but an asker
# that stops reading is cut once the pieces it left unread fall behind that rate.
STATE_SEND_DEADLINES = 4
# x deadline_s: the longest we hold a StateRequest whose asker wants a later round than ours
# (`StateRequest.after_round`) until our round ends: a round's join and all-reduce, each member
# taken for dead within its own deadlines, end within it but for rare rounds (then the asker takes
# what we have). We count our answer's piece deadlines from the hold's end (`_hold`), the asker,
# which cannot tell when that is, its first piece from the longest hold's end and the rest from
# the first's arrival (`fetch_state`): an asker that does not read holds a connection and our task
# for the hold and a piece's deadline, not the longest hold on top. (We may now give up first on an
# asker that leaves its first piece unread: an honest one waits for it, and reads it as it comes.)
STATE_HOLD_DEADLINES = 4
# the most StateRequests held at once (`_hold`), one an asker: each holds a connection and a task
# for up to the hold, then its answer's first piece deadline, and identities cost nothing. Honest
# askers are the joiners left out of our round (told `NoRoom`, or left out of its Members), each
# asking its leader first: a few a round. One beyond it is refused (`HoldsFull` to an asker that
# reads it, else a bare close; the reason logged): the joiner asks another trainer peer at once.
# An asker that closes its connection while held frees its place then, not at the hold's end: a
# place is kept only by a connection kept open (one of the data plane's few a peer).
STATE_HOLDS = 8
# of those, the most held for askers we do not know to be of our group (`_of_group`): in an open
# group any identity may ask, and strangers holding every place would refuse each member of ours
# left out of a round. The rest, STATE_HOLDS - STRANGER_HOLDS, only a member takes (a member takes
# any free place). A joiner new to the group is a stranger here, as it is in the round's inbox,
# and so is an identity that only got into a round's members (a Join, while there was room): of
# our group is a whole contribution to the last round we finished (`_of_group`).
# Until we finish a round (`history` empty: a new open group, or one we resumed) no member of
# ours can be left out of the round we are in (its members are those of that round; we know no
# earlier one), so every asker is a stranger and none is capped: places kept then would refuse
# honest joiners of the group's first round and serve no one.
STRANGER_HOLDS = 4
STATE_BYTES_PER_VALUE = 8  # a weight and its outer momentum, fp32 each


class AnsweringState:
    """Answering a StateRequest for `trainer.diloco_serving.DilocoServing` (see the module docstring)."""

    # the role's state these methods use (`DilocoRole.__init__` sets it)
    node: Any
    config: DilocoConfig
    state: GlobalState | None
    history: list[dict[str, Any]]
    # set (and forgotten) when our state moves to a later round (`_state_moved`): held StateRequests
    # wait on it (`_state_past`). None: nobody waits (a class default: no host need set it)
    state_moved: trio.Event | None = None
    # the askers whose StateRequests we hold (`_hold`), at most STATE_HOLDS, and those of them not
    # known to be of our group, at most STRANGER_HOLDS (class defaults, replaced, never changed in
    # place: no host need set them)
    holding: frozenset[str] = frozenset()
    strangers_held: frozenset[str] = frozenset()
    # the peers whose contribution every shard of the last round we finished took
    # (`Finished.whole_contributors`; set by `DilocoRole._round`, a class default until then)
    contributed: frozenset[str] = frozenset()
    # the StateRequests refused for room (`HoldsFull`) since we started, of askers of our group and
    # of strangers (`_of_group`), for `holds_status` (class defaults, replaced: no host need set them)
    refused_members: int = 0
    refused_strangers: int = 0

    def state_due(self, start: float, values: int) -> float:
        """When the state's first `values` values are due, for a transfer that began at `start`:
        `STATE_SEND_DEADLINES` x `deadline_s`, then `state_min_bytes_per_s`. Taken by the asker
        (ours, sending) or come (theirs, fetching); the asker starts counting before it asks."""
        return (start + STATE_SEND_DEADLINES * self.config.deadline_s
                + STATE_BYTES_PER_VALUE * values / self.config.state_min_bytes_per_s)

    def _state_moved(self) -> None:
        """Our state is of a later round now (`self.state` replaced): wake the held StateRequests."""
        if self.state_moved is not None:
            self.state_moved.set()
            self.state_moved = None

    async def _hold(self, stream: trio.SocketStream, peer: str, round: int, until: float) -> float | HoldsFull | None:
        """Hold `peer`'s StateRequest for a later round than `round` (`_state_past`, at most until
        `until`), and say when the hold ended: our answer's piece deadlines count from there
        (`state_due`), so an asker that does not read holds its connection and our task at most the
        hold and then a piece's deadline, however soon our round ends. `HoldsFull`: refused for
        room (`STATE_HOLDS` are held, or, once we finished a round, `STRANGER_HOLDS` of askers not
        of our group and `peer` is not either: `_of_group`; logged), the answer to send if the
        asker reads it, then the connection is to end. None: not held, the connection is to end: one of `peer`'s is held
        already (logged; no room refusal: an honest asker has one request at a time), or the
        asker closed `stream` while held (logged: its place is free at once, not at the hold's end,
        and it may ask again). An asker writing while held (it waits for our answer, an honest
        one writes nothing) is rejected ("unexpected"). A request that needs no hold (we are past
        `round`, or at an earlier one: `_unfinished`) is answered at once, whatever we hold: the
        cap bounds what is held, and a joiner that asks after our round ended is never refused."""
        if not self._unfinished(round):
            return trio.current_time()
        if peer in self.holding:
            log.info("diloco: %s asks for the state after round %d; one of its requests is held already: refused "
                     "(connection closed)", peer, round)
            return None
        stranger = not self._of_group(peer)
        capped = stranger and bool(self.history)  # no round finished: no member of ours can be left out yet
        if len(self.holding) >= STATE_HOLDS or (capped and len(self.strangers_held) >= STRANGER_HOLDS):
            kept = 0 if len(self.holding) >= STATE_HOLDS else STATE_HOLDS - len(self.holding)
            if stranger:
                self.refused_strangers += 1
            else:
                self.refused_members += 1
            log.info("diloco: %s asks for the state after round %d; %d requests are held already%s: refused", peer,
                     round, len(self.holding), f", the {kept} places left kept for our group's members" if kept else "")
            return HoldsFull(round, len(self.holding), kept)
        wrote: list[bytes] = []  # what the asker wrote while held (b"": it closed `stream`)

        async def watch() -> None:
            try:
                wrote.append(await stream.receive_some(1))
            except trio.BrokenResourceError:  # a reset: closed as well
                wrote.append(b"")
            held.cancel_scope.cancel()

        self.holding = self.holding | {peer}
        if stranger:
            self.strangers_held = self.strangers_held | {peer}
        try:
            async with trio.open_nursery() as held:
                held.start_soon(watch)
                await self._state_past(round, until)
                held.cancel_scope.cancel()
        finally:
            self.holding = self.holding - {peer}
            self.strangers_held = self.strangers_held - {peer}
        if not wrote:
            return trio.current_time()
        if wrote[0]:
            raise MessageRejected("unexpected", "wrote while its state request was held", peer)
        log.info("diloco: %s closed its connection while its request for the state after round %d was held",
                 peer, round)
        return None

    def holds_status(self) -> dict[str, int]:
        """What `status()` shows of our held StateRequests: the places in use (`held`, of them
        `held_strangers`) of `places` (`STATE_HOLDS`, of them at most `stranger_places` for askers
        not of our group once we finished a round), and the requests refused for room since we
        started, of our group's members and of strangers (`HoldsFull`, or a bare close to an older
        asker; `_hold`). Refusals of strangers while members' places stay free are the cap at
        work; refusals of members mean every place was held."""
        return {"held": len(self.holding), "held_strangers": len(self.strangers_held), "places": STATE_HOLDS,
                "stranger_places": STRANGER_HOLDS, "refused_members": self.refused_members,
                "refused_strangers": self.refused_strangers}

    def _of_group(self, peer: str) -> bool:
        """`peer` is of our group as far as we know here: a listed trainer of a closed group (the
        only askers it reads), or in an open one a peer whose whole contribution the last round we
        finished took (`contributed`: a member left out of the round we are in, the asker a hold is
        for, took part in that one). Not what a heartbeat, a Join or a round's Members says: any
        identity can show those at no cost (`_known_trainers`, `heard`), and a Join gets it into a
        round's members while there is room (`Membership`), so an identity admitted once would
        otherwise take our members' places the round after. A contribution every shard took is
        the dearest thing an open group asks (a pseudo-gradient of the model's size, within every
        shard's norm screen, each round). The cost: a member whose contribution a shard lost (it
        died mid-round, or was screened out) shares the strangers' places the next round."""
        return peer in self.config.trainers or peer in self.contributed

    async def _state_past(self, round: int, until: float) -> None:
        """While we are in our round `round` (the asker is no member of it), until `until` (then
        the asker takes what we have); at once when we are at another round (a later one: what it
        wants; an earlier one: waiting would not help it) or train no more rounds."""
        with trio.move_on_at(until):
            while self._unfinished(round):
                if self.state_moved is None:
                    self.state_moved = trio.Event()
                await self.state_moved.wait()

    def _unfinished(self, round: int) -> bool:
        """We are in our round `round`, and train more: a request for a later round's state waits."""
        return self.state is not None and self.state.round == round < self.config.rounds

    async def _send_state(self, stream: trio.SocketStream, peer: str, start: float) -> None:
        """Our global state to `peer`, which asked for it at `start` (or wanted a later round's, at
        the end of our wait for it), piece by piece, each taken by its `state_due` time or the
        asker is at fault ("stalled") and the connection ends: a large state may take long at a
        steady rate, an asker that stops reading is cut all the same."""
        state = self.state
        assert state is not None
        total = state.weights.numel()
        weights, momentum = state.weights.numpy(), state.momentum.numpy()
        for offset in range(0, max(total, 1), STATE_PIECE_VALUES):
            end = min(total, offset + STATE_PIECE_VALUES)
            piece = StatePiece(state.round, total, offset, end - offset, weights[offset:end].tobytes(),
                               momentum[offset:end].tobytes())
            with trio.move_on_at(self.state_due(start, end)) as waited:
                await send_frame(stream, self.node.codec.encode(piece, time.time()))
            if waited.cancelled_caught:
                raise MessageRejected("stalled", f"took {offset} of our state's {total} values, slower than "
                                      f"{self.config.state_min_bytes_per_s} bytes/s", peer)
