"""The `diloco` role's serving side: other trainer peers' connections to our data channel, the
round's inbox they fill, and our answers to them.

Mixed into `trainer.diloco_role.DilocoRole` (`DilocoServing`), which registers `_serve` for the
data-plane channel `diloco` (`trainer.diloco_messages.CHANNEL`) before its model loads. Each
connection's frames are taken in order (`_serve`: a connection that stalls, or idles past
`IDLE_WINDOWS` windows, is closed; its docstring says why each bound) and acted on (`_on_frame`):

- Join, Members, Part, NoRoom: into the round's inbox (`_deliver`, `trainer.diloco_inbox`), where each
  sender has `PEER_INBOX` places, the round's members in a lane of their own and everyone else in
  a pool they share, less what no round of ours will use (`_stale`) and, in a closed group, the
  names of peers `[diloco] trainers` does not list (`_listed_only`). A Join of an older round is
  answered with ours (`_tell_ahead`): its sender is behind.
- StateRequest (a direct join): our global state, held first when the asker wants a later
  round's (`trainer.diloco_state_answer`, `AnsweringState`, mixed in here: `_hold`, `_send_state`).
- StateWanted (a join through the relay): our offer (`_offer`): the next version we publish
  carries the outer state (`trainer.diloco_join`), or a refusal.

These methods read the role's `node`, `config`, `state` and `history`; they add to `heard` (a
peer that asked for our state, through the role's `_note_heard`, which keeps it bounded), put
frames into the round's inbox (`inbox`: the role says whose places it keeps), and, on the
publisher, keep the offers (`outer_state_versions`, `state_askers`, `granted_at`: those of the last
`ASKER_ROUNDS` rounds, at most `ASKERS`). They call the
role's `_member_of_group(peer)`, `_known_trainers()` and `_note_heard(peer)`, and hand
the role itself to `trainer.diloco_links.open_links` (`_tell_ahead`). Their log lines go to the
role's logger. They must not decide rounds or members (`trainer.diloco_role`, `trainer.allreduce`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Awaitable, cast

import trio

from p2pnet.dataplane import FrameReader, send_frame
from p2pnet.errors import MessageRejected
from trainer.diloco import digest
from trainer.diloco_inbox import Lane, frame_bytes
from trainer.diloco_links import Received, open_links
from trainer.diloco_messages import (MAX_MEMBERS, MAX_PART_BYTES, HoldsFull, Idle, Join, Members, NoRoom, Part,
                                     RoundFrame, StateOffer, StateRequest, StateWanted)
from trainer.diloco_state_answer import STATE_HOLD_DEADLINES, AnsweringState

if TYPE_CHECKING:
    from trainer.diloco_inbox import RoundInbox
    from trainer.diloco_local import GlobalState
    from trainer.diloco_role import DilocoConfig, DilocoRole

log = logging.getLogger("trainer.diloco_role")  # the role's logger: its log lines keep their name

ASKER_WAIT_S = 5.0  # a StateWanted from a peer not yet in our table waits this long for its heartbeat
ASKER_ROUNDS = 4  # a peer gets the outer state in a version at most once in this many rounds
# the most trainer peers offered the outer state within ASKER_ROUNDS rounds (`_offer`): what we
# remember of them (`granted_at`, `state_askers`) grows by one per asker, and a role in a heartbeat
# is any identity's claim. Four rounds' worth of whole groups: honest joiners fit.
ASKERS = 4 * MAX_MEMBERS
MAX_FRAME_BYTES = MAX_PART_BYTES + 64 * 1024
STALL_WINDOWS = 2  # x deadline_s: a connection with no first frame, or a frame under way, that long is closed
# x STALL_WINDOWS x deadline_s: a connection idle between frames that long is closed (`_serve`). A
# round's link carries a frame every 3 x deadline_s at most in all but rare rounds: Joins again each
# time a leader is taken for dead (2 x deadline_s), contributions once Members come, a reduced shard by
# the reduce deadline, a contribution to the next owner when one is taken for dead (the gather's
# 2 x deadline_s). Only owners that go silent (not dead: that is seen at once) three in a row can keep
# a link to a bystander idle that long: a newer sender then reconnects; an older one reports us.
IDLE_WINDOWS = 3


class DilocoServing(AnsweringState):
    """Serving other trainer peers for `trainer.diloco_role.DilocoRole` (see the module docstring)."""

    # the role's state these methods use (`DilocoRole.__init__` sets it)
    node: Any
    config: DilocoConfig
    state: GlobalState | None
    history: list[dict[str, Any]]
    heard: set[str]
    inbox: RoundInbox
    outer_state_versions: set[int]
    state_askers: dict[str, int]
    granted_at: dict[str, int]

    if TYPE_CHECKING:  # what these call on the role (`trainer.diloco_role.DilocoRole`)
        def _known_trainers(self) -> set[str]: ...
        def _member_of_group(self, peer: str) -> None: ...
        def _note_heard(self, peer: str) -> None: ...

    async def _serve(self, stream: trio.SocketStream, reader: FrameReader, peer: str) -> None:
        """One peer's connection to our diloco channel: its frames, in order. Each connection
        holds one of our data plane's few (by default 512 in all, 8 a peer, the relay's chunk
        transfers included), and any admitted identity (they cost nothing) can open some; so none is kept
        past a bound of ours without a frame coming:

        - Honest senders open a connection to send a frame at once, and give a frame up (closing
          the connection) when it is not sent within their deadline: a connection whose first
          frame has not come, or whose frame has been under way, for a whole `STALL_WINDOWS` x
          `deadline_s` is closed ("stalled").
        - A round's link is quiet between the round's stages, and lives one round: a connection
          idle between frames for `IDLE_WINDOWS` windows is closed too. When its frames said so
          (`hears_idle`: newer senders) we tell the sender first (`Idle`): it forgets the link
          and sends its next frame on a new connection, which is no death; we read on until it
          closes, at most one more window (its sends end by its deadline), so no frame it sent
          before it read the notice is lost. An older sender is not told (its watcher would take
          the notice for a live peer, stop watching, and write its next frame into the closed
          connection): it sees a plain close, as any before this bound, reports us failed (a
          suspect until we next speak to it) and opens a new connection for its next frame.

        Why a time bound. Keeping only each peer's newest idle connection bounds how many an
        identity holds (one, not 8) but not for how long, and identities are free: 512 of them
        would hold every connection for ever; it would also close an honest round link when the
        same peer's `_tell_ahead` link arrives. Closing the connections of peers that are not
        trainers of our round does not bound them either: that is a heartbeat's claim, and a
        newcomer's Join must reach us before it is one. The bound ends the free hold, not the
        holding: a connection with a valid frame (any Part, say) every `IDLE_WINDOWS` windows stays,
        so 512 are held for about 3 frames a second at the default deadline. A frame that waits
        for room in the round's inbox (nothing reads it while the inner steps run) is bounded
        the same way (`_deliver`: a share of the inbox per sender, a window to find room).

        Our answers are bounded too: a peer that asks for the state (or an offer) and does not
        read it held the connection, and the task writing to it, once the sockets' buffers
        filled; each piece of the state must be taken by its `state_due` time (`STATE_SEND_DEADLINES`
        x `deadline_s`, then `state_min_bytes_per_s`), as long as an honest asker waits for it, an
        offer within `deadline_s`."""
        self._member_of_group(peer)  # before any read: a stranger's frames are not taken in, nor checked
        reader.max_frame_bytes = MAX_FRAME_BYTES
        window_s = STALL_WINDOWS * self.config.deadline_s
        frames, under_way = 0, False  # under way: a frame had begun at the last window's end
        quiet = 0  # whole windows since the last frame with none under way
        hears_idle = False  # a frame on it said its sender reads our Idle notice
        closing_at = math.inf  # told it is idle: its sender closes it by then
        while True:
            with trio.move_on_at(min(trio.current_time() + window_s, closing_at)) as waited:
                frame = await reader.frame()  # (cancelled, it keeps what it read: no byte is lost)
            if waited.cancelled_caught:
                if trio.current_time() >= closing_at:
                    raise MessageRejected("idle", f"told it was idle, still open {window_s:g} s later", peer)
                if not frames or (under_way and reader.buffered):
                    raise MessageRejected("stalled", f"no whole frame in {window_s:g} s", peer)
                under_way = reader.buffered > 0
                quiet = 0 if under_way else quiet + 1
                if quiet == IDLE_WINDOWS:
                    if not hears_idle:
                        log.info("diloco: closed %s's connection, idle for %g s (not told: its frames did not ask)",
                                 peer, quiet * window_s)
                        return
                    await self._tell_idle(stream, peer, quiet * window_s)
                    closing_at = trio.current_time() + window_s
                continue
            frames, under_way, quiet = frames + 1, False, 0
            if frame is None:
                return
            envelope = self.node.codec.decode(frame, time.time())  # MessageRejected ends the connection
            if envelope.sender != peer:
                raise MessageRejected("wrong_sender", "a frame signed by another peer than the connection's")
            if isinstance(envelope.body, RoundFrame):
                hears_idle = hears_idle or envelope.body.hears_idle
            if not await self._on_frame(stream, peer, envelope.body, envelope.kind):
                return

    async def _on_frame(self, stream: trio.SocketStream, peer: str, body: object, kind: str) -> bool:
        """Act on one frame `peer` sent on our diloco channel; False: the connection is to end."""
        if isinstance(body, StateRequest):
            if self.state is None:  # our model still loads (`run` registers the channel first): no one's fault
                log.info("diloco: %s asked for the state before ours was loaded: connection closed", peer)
                return False  # the joiner asks again, or another trainer peer
            self._note_heard(peer)
            start = trio.current_time()
            if body.after_round >= 0:  # it wants a later round's state: held, then counted from the hold's end
                held = await self._hold(stream, peer, body.after_round,
                                        start + STATE_HOLD_DEADLINES * self.config.deadline_s)
                if isinstance(held, HoldsFull):  # no room: told why when it reads that, so it asks elsewhere at once
                    if body.hears_full:
                        await self._sent_within(self.config.deadline_s, peer, "refusal",
                                                send_frame(stream, self.node.codec.encode(held, time.time())))
                    return False
                if held is None:
                    return False
                start = held
            await self._send_state(stream, peer, start)
        elif isinstance(body, StateWanted):
            # its heartbeat may be on its way to us
            await self.node.wait_for_peers(lambda: peer in self._known_trainers(), ASKER_WAIT_S)
            offer = self._offer(peer, body)
            await self._sent_within(self.config.deadline_s, peer, "offer",
                                    send_frame(stream, self.node.codec.encode(offer, time.time())))
        elif isinstance(body, RoundFrame):
            if isinstance(body, Join) and self.state is not None and body.round < self.state.round:
                await self._tell_ahead(peer)
            listed = self._listed_only(peer, body)
            if listed is not None and not self._stale(listed):
                await self._deliver(peer, listed)
        else:
            raise MessageRejected("unexpected", f"{kind} on the diloco channel")
        return True

    def _listed_only(self, peer: str, body: RoundFrame) -> RoundFrame | None:
        """`body` as a round takes it in: in a closed group, the names of peers `trainers` does not
        list are left out (logged), where they enter. A listed peer whose own list differs (a
        list not copied to every peer) would otherwise make a leader wait a join deadline for
        the strangers its Join names, or, in its Members, make us send them our contributions and
        leave them shards to own. Members naming none of ours is dropped (None). Left out of a
        leader's Members, those peers make our members digest differ from the others': the round
        then goes on without us, and we fetch the state after it, as on any disagreement."""
        allowed = self.config.trainers
        if not allowed or isinstance(body, (Part, NoRoom)):
            return body
        names = body.known if isinstance(body, Join) else body.members
        kept = tuple(p for p in names if p in allowed)
        if len(kept) == len(names):
            return body
        log.warning("diloco: %s named %d peers not of [diloco] trainers (%s); left out", peer,
                    len(names) - len(kept), ", ".join(sorted(set(names) - set(kept))[:4]))
        if isinstance(body, Join):
            return dataclasses.replace(body, known=kept)
        return dataclasses.replace(body, members=kept) if kept else None

    def _stale(self, body: RoundFrame) -> bool:
        """A frame no round of ours will use, not worth a place in the inbox: of a round before
        ours (a Join of one was answered, `_tell_ahead`), or a Part of another round than ours
        (a round takes Parts of its own round only; one of a later round needs our Join first)."""
        if self.state is None:
            return False  # our model still loads: any round may be ours
        return body.round < self.state.round or (isinstance(body, Part) and body.round != self.state.round)

    async def _deliver(self, peer: str, body: RoundFrame) -> None:
        """Put `peer`'s frame into the round's inbox, where it waits until the round reads it
        (nothing does while the inner steps run). A sender has `PEER_INBOX` places there at a time,
        so that no sender fills it for the others, and a sender outside the round's group shares
        the pool with every other such sender (`trainer.diloco_inbox`); a frame that finds no room
        (its sender's places, or its lane, full) within `STALL_WINDOWS` x `deadline_s` ends its
        connection ("inbox_full"), which would otherwise wait unbounded, its reader held, past the
        idle bound. An honest sender never has that many frames for us unread: during the round we
        read at once, and before it it sends a few (`PEER_INBOX`); a member always has its places,
        in a lane shared only with members (bounded in bytes: there it waits behind their Parts
        only, as it waited behind every Part before), so only a joiner's frame can meet a pool
        that strangers filled. One that meets this sees a closed connection and takes us for
        failed until our next frame, as on any close, and its next send opens another (a
        joiner's Join is sent again)."""
        window_s = STALL_WINDOWS * self.config.deadline_s
        with trio.move_on_after(window_s):
            await self.inbox.put(Received(peer, body))
            return
        full = self.inbox.core.blocked(peer, frame_bytes(body))  # what it waited for last
        where = f"the inbox's {full.value} lane" if isinstance(full, Lane) else "its places"
        raise MessageRejected("inbox_full", f"{self.inbox.queued(peer)} frames of it unread and no room in {where} "
                              f"for another in {window_s:g} s", peer)

    @staticmethod
    async def _sent_within(limit_s: float, peer: str, what: str, sending: Awaitable[None]) -> None:
        """Await `sending`, something we write to `peer` that it asked for or must read (its
        connection holds one of our slots and the task writing): not taken within `limit_s`, it
        is the peer's fault ("stalled") and the connection ends."""
        with trio.move_on_after(limit_s) as waited:
            await sending
        if waited.cancelled_caught:
            raise MessageRejected("stalled", f"did not take our {what} in {limit_s:g} s", peer)

    async def _tell_idle(self, stream: trio.SocketStream, peer: str, idle_s: float) -> None:
        """Tell the sender of a connection we close idle (`Idle`). One small frame into a buffer
        nothing else of ours was written to on a round's link; bounded all the same (a peer could
        have left unread an answer we wrote on a connection it also sent Joins on)."""
        await self._sent_within(self.config.deadline_s, peer, "idle notice",
                                send_frame(stream, self.node.codec.encode(Idle(idle_s), time.time())))
        log.info("diloco: closing %s's connection, idle for %g s (told)", peer, idle_s)

    def _offer(self, peer: str, wanted: StateWanted) -> StateOffer:
        """Our answer to a peer that wants the outer state in a version: the next version we
        write after this round carries it, unless we do not publish, have no round left, or the
        peer is not behind and asked only then."""
        state = self.state
        round = state.round if state is not None else 0
        round_s = float(self.history[-1]["round_s"]) if self.history else self.config.deadline_s
        if (not self.config.publish or state is None or round >= self.config.rounds
                or (wanted.behind_only and wanted.have_round >= round)):
            return StateOffer(round, -1, round_s)
        if peer not in self._known_trainers():  # only a trainer peer may make every worker fetch more
            log.warning("diloco: %s wants the outer state but is not a trainer peer we know: refused", peer)
            return StateOffer(round, -1, round_s)
        if self.granted_at.get(peer, -ASKER_ROUNDS) > round - ASKER_ROUNDS:
            # asked a moment ago: it joined, or falls back to the direct fetch; one version per
            # ASKER_ROUNDS rounds, so no peer can make every version carry the momentum
            log.info("diloco: %s asked for the outer state again within %d rounds: refused", peer, ASKER_ROUNDS)
            return StateOffer(round, -1, round_s)
        # an offer older than ASKER_ROUNDS rounds is read no more (above): forgotten, as an asker
        # whose version we have (`_round` forgets it as the version is made; one we took whole, as we
        # caught up, here). Those of the last rounds are at most ASKERS; past that, an asker takes
        # the direct fetch, as on any refusal
        for asker in [p for p, at in self.granted_at.items() if at <= round - ASKER_ROUNDS]:
            del self.granted_at[asker]
        for asker in [p for p, version in self.state_askers.items() if version <= round]:
            del self.state_askers[asker]
        if len(self.granted_at) >= ASKERS or len(self.state_askers) >= ASKERS:
            log.warning("diloco: %s wants the outer state, %d trainer peers were offered it within %d rounds: refused",
                        peer, len(self.granted_at), ASKER_ROUNDS)
            return StateOffer(round, -1, round_s)
        version = round + 1
        self.outer_state_versions.add(version)
        self.state_askers[peer] = version
        self.granted_at[peer] = round
        log.info("diloco: %s (at round %d) wants the outer state: version %d carries it",
                 peer, wanted.have_round, version)
        return StateOffer(round, version, round_s)

    async def _tell_ahead(self, peer: str) -> None:
        """A peer joins an older round: our Join of the round we are in tells it it is behind.
        Called by the data plane's reader, at any time: a failure is not reported to the round's
        inbox (`reports`), where it would wait unread while the inner steps run, beyond any
        sender's share, and, once the inbox filled, hold this reader unbounded. A peer we could
        not tell sends its old Join again, or our next round's Join fails and reports it there."""
        if self.state is not None:
            role = cast("DilocoRole", self)  # (mixed into the role only)
            async with open_links(role, self.config.deadline_s, reports=False) as links:
                await links.send(peer, Join(self.state.round, digest(self.state.weights), ()))
