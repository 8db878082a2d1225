"""The `diloco` role's answer to a `StateRequest` (a direct join): our global state, piece by
piece, each taken by its `state_due` time (`_send_state`); the asker counts the same deadlines
(`trainer.diloco_catchup`). An asker left out of our round asks for a later state
(`after_round`): we hold its request until our round is over (`_hold`, `_state_past`, woken by
`_state_moved`), so it fetches the state once, not its own round's again; at most `STATE_HOLDS`
such requests at once, one an asker, each until its asker closes.

Mixed into `trainer.diloco_serving.DilocoServing` (`AnsweringState`), whose `_on_frame` takes the
request and calls these; `trainer.diloco_role.DilocoRole` calls `_state_moved` as its state moves,
and `trainer.diloco_catchup` `state_due`. These methods read the role's `node`, `config` and
`state`, and keep what they hold (`holding`, `state_moved`). Their log lines go to the role's
logger. They must not read other frames of the connection than the request, nor decide rounds.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import trio

from p2pnet.dataplane import send_frame
from p2pnet.errors import MessageRejected
from trainer.diloco_messages import STATE_PIECE_VALUES, StatePiece

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
# asking its leader first: a few a round. One beyond it is refused (the connection closed, the
# reason logged): the joiner asks another trainer peer, as after any failure. An asker that closes
# its connection while held frees its place then, not at the hold's end: a place is kept only
# by a connection kept open (one of the data plane's few a peer).
STATE_HOLDS = 8
STATE_BYTES_PER_VALUE = 8  # a weight and its outer momentum, fp32 each


class AnsweringState:
    """Answering a StateRequest for `trainer.diloco_serving.DilocoServing` (see the module docstring)."""

    # the role's state these methods use (`DilocoRole.__init__` sets it)
    node: Any
    config: DilocoConfig
    state: GlobalState | None
    # set (and forgotten) when our state moves to a later round (`_state_moved`): held StateRequests
    # wait on it (`_state_past`). None: nobody waits (a class default: no host need set it)
    state_moved: trio.Event | None = None
    # the askers whose StateRequests we hold (`_hold`), at most STATE_HOLDS (a class default,
    # replaced, never changed in place: no host need set it)
    holding: frozenset[str] = frozenset()

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

    async def _hold(self, stream: trio.SocketStream, peer: str, round: int, until: float) -> float | None:
        """Hold `peer`'s StateRequest for a later round than `round` (`_state_past`, at most until
        `until`), and say when the hold ended: our answer's piece deadlines count from there
        (`state_due`), so an asker that does not read holds its connection and our task at most the
        hold and then a piece's deadline, however soon our round ends. None: not held, refused (one
        of `peer`'s is held already, or `STATE_HOLDS` are; logged), or the asker closed `stream`
        while held (logged: its place is free at once, not at the hold's end, and it may ask again),
        the connection is to end. An asker writing while held (it waits for our answer, an honest
        one writes nothing) is rejected ("unexpected"). A request that needs no hold (we are past
        `round`, or at an earlier one: `_unfinished`) is answered at once, whatever we hold: the
        cap bounds what is held, and a joiner that asks after our round ended is never refused."""
        if not self._unfinished(round):
            return trio.current_time()
        if peer in self.holding or len(self.holding) >= STATE_HOLDS:
            log.info("diloco: %s asks for the state after round %d; %s: refused (connection closed)", peer, round,
                     "one of its requests is held already" if peer in self.holding
                     else f"{len(self.holding)} requests are held already")
            return None
        wrote: list[bytes] = []  # what the asker wrote while held (b"": it closed `stream`)

        async def watch() -> None:
            try:
                wrote.append(await stream.receive_some(1))
            except trio.BrokenResourceError:  # a reset: closed as well
                wrote.append(b"")
            held.cancel_scope.cancel()

        self.holding = self.holding | {peer}
        try:
            async with trio.open_nursery() as held:
                held.start_soon(watch)
                await self._state_past(round, until)
                held.cancel_scope.cancel()
        finally:
            self.holding = self.holding - {peer}
        if not wrote:
            return trio.current_time()
        if wrote[0]:
            raise MessageRejected("unexpected", "wrote while its state request was held", peer)
        log.info("diloco: %s closed its connection while its request for the state after round %d was held",
                 peer, round)
        return None

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
