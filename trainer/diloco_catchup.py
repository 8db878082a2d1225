"""The `diloco` role's global state outside the rounds: taking a later one when we are behind,
writing ours durably, publishing it as versions.

Mixed into `trainer.diloco_role.DilocoRole` (`CatchingUp`).

Joining and drifting. A peer that starts (fresh, restarted, or resumed from its own durable
state), or learns during a join that the others are at a later round or that its weights
digest is not the round's reference, sits the round out and takes a later global state
(`_catch_up`):

- through the relay (`join_via = "relay"`, the default, on a peer that runs the relay role and
  trusts the publisher): it asks the publishing trainer with `StateWanted`; the publisher puts
  the outer momentum into its next version (`trainer.diloco_join`, which says what that costs
  inference workers), our relay role fetches that version as any other, and we load weights and
  momentum from its verified files and join the round after it. The publisher waits for our
  Join from that round on.
- directly (`join_via = "direct"`, or as the fallback, logged, when the relay path gives
  nothing: no relay role, no live trusted publisher, one that does not publish, or no version by
  a deadline that scales with the round time): a `StateRequest` on the data channel to a live
  trainer peer, which any live trainer can answer, also when the publisher is the peer that died.

`status()` says which path gave the last state taken (`state_via`) and how often each did,
and how many of our direct requests a trainer peer refused for room (`state_asks_refused`).
The other end of both paths, answering a `StateRequest` or a `StateWanted`, is
`trainer.diloco_serving`.

In the background, after each round: the new state is written durably (`_checkpoint`, never a
round back), and on the publishing peer its weights go out as version `round` through the relay
role (`_publish`), with the outer state beside them when a joiner asked for it.

These methods read the role's `node`, `config`, `relay`, `inner`, `suspects`, `state` and the
versions offered with the outer state (`outer_state_versions`); they replace `state` through
the role's `_adopt(state)` and keep `state_via`, `state_via_counts` and `fetched` (the last
`FETCHED` states taken), the durable
writes (`checkpointing`, `pending_checkpoint`, `checkpointed_round`) and what was published
(`publishing`, `published`, `with_outer_state`, `outer_state_bytes`). They call the role's
`_known_trainers()`, `_member_of_group(peer)`, `open_stream(peer)` and `state_due(start, values)`
(`trainer.diloco_state_answer`), and hand the role itself to `trainer.diloco_join.state_via_relay`.
Their log lines go to the role's logger. They must not decide rounds or members
(`trainer.diloco_role`).
"""

from __future__ import annotations

import enum
import logging
import time
from typing import TYPE_CHECKING, Any, cast

import torch
import trio

from p2pnet.dataplane import FrameReader, send_frame
from p2pnet.errors import MessageRejected, PeerUnavailable
from trainer.diloco_local import GlobalState, write_state
from trainer.diloco_messages import STATE_PIECE_VALUES, HoldsFull, StatePiece, StateRequest
from trainer.diloco_serving import MAX_FRAME_BYTES
from trainer.diloco_state_answer import STATE_HOLD_DEADLINES

if TYPE_CHECKING:
    from trainer.diloco_local import InnerTrainer
    from trainer.diloco_role import DilocoConfig, DilocoRole

log = logging.getLogger("trainer.diloco_role")  # the role's logger: its log lines keep their name

FETCHED = 100  # the states taken that `fetched` keeps (and `status()` shows): the latest


class JoinPath(enum.StrEnum):
    """How a peer takes the global state (`join_via`, and `status()["state_via"]`)."""

    RELAY = "relay"  # a version carrying the outer state, fetched by our relay role
    DIRECT = "direct"  # a StateRequest on the data channel to a live trainer peer


class StateRefused(PeerUnavailable):
    """A trainer peer had no room to hold our request for a later round's state (`HoldsFull`): no
    fault of its, nor ours (it holds as many as it takes, or as many of askers it does not know to
    be of its group); we ask the next trainer peer at once."""

    def __init__(self, peer: str, after_round: int, full: HoldsFull) -> None:
        kept = f", the {full.kept} places left kept for its group's members" if full.kept else ""
        super().__init__(f"{peer} had no room to hold our request for the state after round {after_round}: "
                         f"it holds {full.held}{kept}")
        self.peer, self.full = peer, full


class CatchingUp:
    """The global state's catching up, checkpoints and publishing for `trainer.diloco_role.DilocoRole`
    (see the module docstring)."""

    # the role's state these methods use (`DilocoRole.__init__` sets it)
    node: Any
    config: DilocoConfig
    relay: Any
    inner: InnerTrainer | None
    state: GlobalState | None
    suspects: set[str]
    fetched: list[dict[str, Any]]
    state_via: JoinPath | None
    state_via_counts: dict[JoinPath, int]
    checkpointing: trio.Lock
    pending_checkpoint: GlobalState | None
    checkpointed_round: int
    publishing: trio.Lock
    published: list[int]
    outer_state_versions: set[int]
    with_outer_state: list[int]
    outer_state_bytes: int
    # our requests for a later round's state that a trainer peer refused for room (`StateRefused`)
    # since we started, shown in `status()` (a class default, replaced: no host need set it)
    state_asks_refused: int = 0

    if TYPE_CHECKING:  # what these call on the role (`trainer.diloco_role.DilocoRole`, `trainer.diloco_state_answer`)
        def _known_trainers(self) -> set[str]: ...
        def _member_of_group(self, peer: str) -> None: ...
        def _adopt(self, state: GlobalState) -> None: ...
        async def open_stream(self, peer: str) -> trio.SocketStream: ...
        def state_due(self, start: float, values: int) -> float: ...

    # -- taking a later state ----------------------------------------------------------------

    async def fetch_state(self, peer: str, after_round: int = -1) -> GlobalState:
        """The global state of `peer` (a direct fetch on the data channel); in a closed group only
        from one of its trainers (`not_a_trainer`), whoever named `peer`. `after_round` (>= 0): we
        are no member of that round and want a later one's: `peer` answers when its round is
        over (`StateRequest.after_round`), at most `STATE_HOLD_DEADLINES` x deadline_s: we cannot
        tell how long it holds us, so its first piece is due from the longest hold's end, and the
        rest from the first's arrival when that is sooner (`peer` counts from the hold's end, before
        it sent that piece): a peer that stalls once it has begun is given up as soon as on a plain
        request, one that never begins only after the longest hold. One with no room to hold our
        request says so (`HoldsFull`, as we ask it to: `hears_full`): `StateRefused`."""
        self._member_of_group(peer)
        total = self.state.weights.numel()  # type: ignore[union-attr]
        weights, momentum = torch.empty(total), torch.empty(total)
        stream = await self.open_stream(peer)
        async with stream:
            start = trio.current_time()  # before we ask: each piece is due here first (`state_due`)
            if after_round >= 0:
                start += STATE_HOLD_DEADLINES * self.config.deadline_s
            request = StateRequest(self.state.round, after_round, hears_full=True)  # type: ignore[union-attr]
            with trio.fail_at(self.state_due(start, 0)):
                await send_frame(stream, self.node.codec.encode(request, time.time()))
            reader = FrameReader(stream, max_frame_bytes=MAX_FRAME_BYTES)
            got, round = 0, -1
            while got < total:
                with trio.fail_at(self.state_due(start, min(total, got + STATE_PIECE_VALUES))):
                    frame = await reader.frame()
                if frame is None:
                    raise PeerUnavailable(f"{peer} ended the state after {got} of {total} values")
                piece = self.node.codec.decode(frame, time.time()).body
                if isinstance(piece, HoldsFull) and round < 0:  # its answer instead of the state: no room
                    raise StateRefused(peer, after_round, piece)
                if not isinstance(piece, StatePiece) or piece.total != total or piece.offset != got or (
                        round >= 0 and piece.round != round):
                    raise MessageRejected("bad_state", f"{peer} sent a state piece that does not fit", peer)
                if round < 0:  # the first piece: `peer` has begun to answer, the rest are due from here at the latest
                    start = min(start, trio.current_time())
                round = piece.round
                weights[got:got + piece.length] = torch.frombuffer(bytearray(piece.weights), dtype=torch.float32)
                momentum[got:got + piece.length] = torch.frombuffer(bytearray(piece.momentum), dtype=torch.float32)
                got += piece.length
        if not (bool(torch.isfinite(weights).all()) and bool(torch.isfinite(momentum).all())):
            raise MessageRejected("bad_state", f"{peer} sent weights that are not finite", peer)
        return GlobalState(round, weights, momentum)

    async def _catch_up(self, hint: str | None, past: int = -1) -> None:
        """Take the global state of a later round when others are ahead (or, hint given, when we
        were told we drifted): through the relay when we can (`trainer.diloco_join`: the version
        after the publisher's round), else, or when that fails, directly from a live trainer
        peer, of a round after `past` when given (we are no member of that round: `_Behind`)."""
        if self.config.join_via == JoinPath.RELAY:
            if await self._catch_up_via_relay(hint):
                return
        await self._catch_up_directly(hint, past)

    def _publishers(self) -> list[str]:
        """Live trainer peers whose versions our relay role believes (the publisher, in a group)."""
        if self.relay is None:
            return []
        live = self._known_trainers() - self.suspects
        return [p for p in self.relay.config.trusted_publishers if p in live]

    async def _catch_up_via_relay(self, hint: str | None) -> bool:
        """True when we are done: the state came through the relay, or the publisher says we are
        not behind (at start). False: the direct path is to be taken (logged why)."""
        from trainer.diloco_join import state_via_relay

        assert self.state is not None
        if self.relay is None:
            return False  # without a relay role there is no store to take a version into
        publishers = self._publishers()
        others = set(self.relay.config.trusted_publishers) - {self.node.peer_id}
        if not publishers and hint is None and others:  # just started: a live publisher's heartbeat comes soon
            await self.node.wait_for_peers(lambda: bool(self._publishers()), min(
                self.config.deadline_s, 10 * self.node.peertable.config.heartbeat_interval_s))
            publishers = self._publishers()
        if not publishers:
            if others:
                log.info("diloco: no trusted publisher among the live trainer peers; fetching the state directly")
            return False
        role = cast("DilocoRole", self)  # (mixed into the role only)
        for publisher in publishers:
            try:
                fetched = await state_via_relay(role, publisher, self.state.round, behind_only=hint is None)
            except (PeerUnavailable, MessageRejected, trio.TooSlowError, trio.BrokenResourceError, OSError) as exc:
                log.warning("diloco: the state through the relay from %s failed (%s); falling back to the direct fetch",
                            publisher, exc or type(exc).__name__)
                continue
            if fetched is None:
                return True  # the publisher is not ahead of us
            self._took(fetched, publisher, JoinPath.RELAY)
            return True
        return False

    def _took(self, state: GlobalState, source: str, via: JoinPath) -> None:
        had = self.state.round if self.state is not None else -1
        self._adopt(state)
        self.state_via = via
        self.state_via_counts[via] += 1
        self.fetched.append({"from": source, "round": state.round, "at_round": state.round, "had_round": had, "via": via})
        del self.fetched[:-FETCHED]  # the latest only: a peer that drifts takes a state every round
        log.info("diloco: took the global state of round %d from %s (%s)", state.round, source, via)

    async def _catch_up_directly(self, hint: str | None, past: int = -1) -> None:
        """Take the newest global state a live trainer peer has (hint first), if newer than ours;
        also when we are told we drifted (hint given), take the hinted peer's at its round. Told
        we are no member of our round `past` (>= 0), on its weights, we ask for a later round's
        state (`fetch_state`'s `after_round`): the peer answers when its round is over, and we
        fetch it once, not our own round's (the same weights) and then the next one's. One with no
        room to hold that request (`StateRefused`) is no failure: logged as such, the next asked."""
        peers = ([hint] if hint else []) + sorted(self._known_trainers() - {hint} - self.suspects)
        for peer in peers:
            try:
                fetched = await self.fetch_state(peer, past)
            except StateRefused as exc:  # full, not failed: the next one at once
                self.state_asks_refused += 1
                log.info("diloco: %s; asking the next trainer peer", exc)
                continue
            except (PeerUnavailable, MessageRejected, trio.TooSlowError, trio.BrokenResourceError) as exc:
                log.info("diloco: state from %s failed: %s", peer, exc)
                continue
            assert self.state is not None
            if fetched.round > self.state.round or (hint is not None and fetched.round == self.state.round):
                self._took(fetched, peer, JoinPath.DIRECT)
            return
        if hint is not None:
            await trio.sleep(self.config.deadline_s / 10)  # nobody answered: join again later

    # -- background: durable state and published versions ------------------------------------

    async def _checkpoint(self, state: GlobalState) -> None:
        """Write the newest global state to disk, one write at a time. A state that waited while a
        newer one came is not written: the file never steps back a round when a write outlasts a
        round, and writes (each a serialized copy of weights and momentum) never pile up."""
        if self.pending_checkpoint is None or state.round > self.pending_checkpoint.round:
            self.pending_checkpoint = state
        async with self.checkpointing:
            newest = self.pending_checkpoint
            if newest is None or newest.round <= self.checkpointed_round:
                return  # a later call wrote it already
            self.pending_checkpoint = None
            await trio.to_thread.run_sync(write_state, self.config.out_dir, newest)
            self.checkpointed_round = newest.round

    async def _publish(self, state: GlobalState) -> None:
        from models.folder import save_model_dir
        from trainer.checkpoint import published_files, version_dir
        from trainer.diloco_join import OUTER_STATE_FILE, write_outer_state

        relay = self.relay
        assert relay is not None and self.inner is not None
        if relay.watcher.is_complete(state.round):
            return
        async with self.publishing:  # versions go out in order
            folder = version_dir(self.config.out_dir, state.round)
            if not folder.exists():
                model, tokenizer = self.inner.model, self.inner.tokenizer
                await trio.to_thread.run_sync(lambda: save_model_dir(_shell_with(model, state.weights), tokenizer, folder))
            files = published_files(folder)
            if state.round in self.outer_state_versions:  # a joiner asked: the momentum rides along
                path = folder / OUTER_STATE_FILE
                if not path.is_file():
                    await trio.to_thread.run_sync(write_outer_state, folder, state)
                files.append(path)
                self.with_outer_state.append(state.round)
                self.outer_state_bytes = path.stat().st_size
            await relay.publish(files, model=self.config.model_name, version=state.round,
                                previous_version=state.round - 1)
            self.published.append(state.round)


def _shell_with(model: Any, weights: torch.Tensor) -> Any:
    """A copy of `model` holding `weights` (the inner model trains on meanwhile)."""
    import copy

    from trainer.diloco import unflatten_into

    shell = copy.deepcopy(model)
    unflatten_into(weights, shell.state_dict())
    return shell
