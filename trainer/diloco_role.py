"""The `diloco` role: one trainer peer of a DiLoCo group, the trio shell of `trainer.allreduce`.

Each round: take H inner AdamW steps from the global weights (in a worker thread), decide the
round's members (`Membership`: Joins over the data plane), average the pseudo-gradients with
`AllReduce` over direct authenticated connections on the `diloco` data channel, apply the outer
Nesterov step, then, without waiting for either, write the global state durably (a worker
thread: the next inner steps start at once) and, on the publishing peer, write the global
weights as version `round` and publish them through the relay role, as the GRPO trainer does,
so inference workers fetch them as before.

Joining and drifting. A peer that starts (fresh, restarted, or resumed from its own durable
state), or learns during a join that the others are at a later round or that its weights
digest is not the round's reference, sits the round out and takes a later global state:

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

`status()` says which path gave the last state taken (`state_via`) and how often each did.

Who is in the group. By default the group is open: any peer whose heartbeat claims the diloco
role (any identity, at no cost) is invited, waited for, counts in a round's reference digest, and
can send us to fetch the state from it by naming a later round; a direct fetch then takes
whatever finite weights it sends. `[diloco] trainers` closes the group: our data channel closes
a connection of a peer not listed before reading a frame of it (`not_a_trainer`), and only listed
peers are invited, waited for or asked for the state. The relay path trusts only `[relay]
trusted_publishers` either way.

Whom a join waits for: the trainer peers of our peer table, less suspects (peers that could
not be reached, closed a connection or missed a deadline, until a message from them arrives),
and, after our first round, only peers that have spoken to us on the diloco channel,
so a newcomer still loading its model does not hold a round up: it is waited for from its
state fetch on. To these we add, during the join, every trainer peer another member's Join
names or whose Join reached us: the round's leader must be the same at every member, and only
the peer a joiner took its state from (the publisher, through the relay) knows to wait for it;
a joiner with the lowest id would otherwise lead the round there and not at the others, and the
round split. The leader (`Membership.leader`) is the lowest id among the peers we wait for on
our own account and those whose own Join reached us: a peer only others name leads once it
joined, so a named peer that never joins costs one join deadline, not the leader timeout. (A
leader we wait for on our own account is waited for until the leader timeout, 2 x deadline_s:
leaving it at the join deadline would let a late lowest-id peer decide the round a second
time.) Contributions the core rejects cost their sender a peer table penalty.

This module must not do the arithmetic (trainer.diloco) or decide the protocol (trainer.allreduce).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable

import torch
import trio

from p2pnet.config import from_mapping, validated
from p2pnet.dataplane import FrameReader, open_data_stream, send_frame
from p2pnet.errors import ConfigError, MessageRejected, PeerUnavailable
from p2pnet.identity import peer_id_from_str
from p2pnet.peertable import PEER_TABLE_CORE
from trainer.allreduce import AllReduce, AllReduceConfig, Finished, Membership, Penalise, Send
from trainer.diloco import Encoding, OuterConfig, OuterOptimizer, digest
from trainer.diloco_links import InboxEvent, Links, PeerFailed, Received, open_links
from trainer.diloco_local import GlobalState, InnerConfig, InnerTrainer, read_state, write_state
from trainer.diloco_messages import (CHANNEL, MAX_PART_BYTES, STATE_PIECE_VALUES, Idle, Join, Members, Part,
                                     StateOffer, StatePiece, StateRequest, StateWanted)

log = logging.getLogger(__name__)

PENALTY = 2.0
ASKER_WAIT_S = 5.0  # a StateWanted from a peer not yet in our table waits this long for its heartbeat
ASKER_ROUNDS = 4  # a peer gets the outer state in a version at most once in this many rounds
MAX_FRAME_BYTES = MAX_PART_BYTES + 64 * 1024
INBOX = 256
# frames of one sender the round's inbox holds at a time (`_deliver`). While the inner steps run
# nothing reads it; an honest peer sends us a few frames meanwhile (its Joins of our round, again
# each time the peers it takes for dead change, and a Join or Members telling us we are behind),
# so 16 a sender leaves room for any honest group: 15 others of ours fill at most 240 of 256.
PEER_INBOX = 16
STALL_WINDOWS = 2  # x deadline_s: a connection with no first frame, or a frame under way, that long is closed
# x STALL_WINDOWS x deadline_s: a connection idle between frames that long is closed (`_serve`). A
# round's link carries a frame every 3 x deadline_s at most in all but rare rounds: Joins again each
# time a leader is taken for dead (2 x deadline_s), contributions once Members come, a reduced shard by
# the reduce deadline, a contribution to the next owner when one is taken for dead (the gather's
# 2 x deadline_s). Only owners that go silent (not dead: that is seen at once) three in a row can keep
# a link to a bystander idle that long: a newer sender then reconnects; an older one reports us.
IDLE_WINDOWS = 3
# x deadline_s: the head start of our answer to a StateRequest; from then on it must keep up
# `state_min_bytes_per_s` (`state_due`), a StateOffer must be taken within deadline_s. A peer that
# asks and does not read would otherwise hold the connection, and the task writing to it, once the
# socket buffers fill. The asker gives each piece as long (`fetch_state`), counted from before it
# asks: we never give up on an honest asker first (with the same settings). The state is 8 bytes a
# parameter (1.08 GB for SmolLM2-135M): at the default 1 MB/s it may take 18 minutes, but an asker
# that stops reading is cut once the pieces it left unread fall behind that rate.
STATE_SEND_DEADLINES = 4
STATE_BYTES_PER_VALUE = 8  # a weight and its outer momentum, fp32 each


class Phase(enum.StrEnum):
    """Where the role is (`status()["phase"]`, what tests and the devnet watch): its value is the
    text status JSON and logs show."""

    STARTING = "starting"  # loading the model, waiting for peers, catching up
    INNER = "inner"  # the round's inner steps
    JOIN = "join"  # deciding the round's members
    REDUCE = "reduce"  # averaging the pseudo-gradients
    DONE = "done"  # reached `rounds`: no more training, the state is still served


class JoinPath(enum.StrEnum):
    """How a peer takes the global state (`join_via`, and `status()["state_via"]`)."""

    RELAY = "relay"  # a version carrying the outer state, fetched by our relay role
    DIRECT = "direct"  # a StateRequest on the data channel to a live trainer peer


@validated
@dataclass(frozen=True)
class DilocoConfig:
    model_dir: Path  # the starting model folder (round 0's global weights)
    out_dir: Path  # the durable global state, and published versions v{round}/ on the publisher
    model_name: str = "tiny"  # the model name in published manifests
    rounds: int = 10  # outer rounds, then stop training (the peer keeps serving its state)
    inner_steps: int = 20  # H: inner AdamW steps per round
    inner_lr: float = 3e-3  # inner AdamW learning rate
    batch_size: int = 32  # sequences per inner step
    outer_lr: float = 0.7  # outer Nesterov SGD learning rate (DiLoCo's default)
    outer_momentum: float = 0.9  # outer Nesterov momentum (DiLoCo's default)
    encoding: str = "int8"  # how pseudo-gradients travel: int8 (per-block scales) or fp32
    block: int = 4096  # values per int8 scale
    deadline_s: float = 30.0  # join and reduce deadline; an owner is taken for dead after twice this
    data_seed: int = -1  # this peer's data shard (-1: derived from its peer id)
    publish: bool = False  # publish each round's global weights through this peer's relay role
    min_peers: int = 1  # trainer peers (this one included) to see before the first round
    max_norm_ratio: float = 10.0  # contributions with a norm above this x the others' lower median are rejected
    join_via: str = "relay"  # how a joining peer gets the global state: relay (then direct) or direct
    state_min_bytes_per_s: int = 1_000_000  # a direct state fetch slower than this (after 4 x deadline_s) is cut, at both ends
    trainers: tuple[str, ...] = ()  # base58 peer ids of the group's trainer peers, this one among them; empty: an open group, where any peer that heartbeats the diloco role takes part (and can hand a direct join its weights)

    def check(self) -> dict[str, str]:
        problems = {}
        if self.rounds < 1 or self.inner_steps < 1 or self.batch_size < 1 or self.min_peers < 1:
            problems["rounds"] = "rounds, inner_steps, batch_size and min_peers must be >= 1"
        if self.encoding not in ("int8", "fp32"):
            problems["encoding"] = "must be int8 or fp32"
        if self.join_via not in tuple(JoinPath):
            problems["join_via"] = "must be relay or direct"
        if not self.deadline_s > 0:
            problems["deadline_s"] = "must be > 0"
        if self.state_min_bytes_per_s < 1:
            problems["state_min_bytes_per_s"] = "must be >= 1"
        for peer in self.trainers:
            try:
                peer_id_from_str(peer)
            except ValueError:
                problems["trainers"] = f"{peer!r} is not an Ed25519 peer id"
        if self.trainers and self.min_peers > len(set(self.trainers)):  # (this peer is one of them)
            problems["min_peers"] = f"must be <= the {len(set(self.trainers))} peers of trainers, or it waits for ever"
        try:
            AllReduceConfig(Encoding(self.encoding) if self.encoding in ("int8", "fp32") else Encoding.INT8,
                            self.block, max(self.deadline_s, 1e-9), self.max_norm_ratio)
            OuterConfig(self.outer_lr, self.outer_momentum)
            InnerConfig(lr=self.inner_lr, batch_size=max(self.batch_size, 1))
        except ValueError as exc:
            problems["block"] = str(exc)
        return problems


class _Behind(Exception):
    """Another trainer peer is at a later round, or our weights are not the round's reference."""

    def __init__(self, peer: str) -> None:
        super().__init__(peer)
        self.peer = peer


class DilocoRole:
    def __init__(self, node: Any, section: dict[str, Any]) -> None:
        self.node = node
        self.config = from_mapping(DilocoConfig, section, "diloco")
        if self.config.trainers and node.peer_id not in self.config.trainers:  # a list copied to every peer
            raise ConfigError("diloco.trainers", f"does not list this peer ({node.peer_id}): a group's trainers "
                              "refuse the frames of a peer they do not list, so it would never take part")
        self.relay = node.roles.get("relay")  # built before us; publishes, and brings a joiner the state
        if self.config.publish and self.relay is None:
            raise ConfigError("peer.roles", "diloco with publish = true needs the relay role (--role relay)")
        self.inbox_send, self.inbox = trio.open_memory_channel[InboxEvent](INBOX)
        self.queued: dict[str, int] = {}  # sender -> its frames in the inbox, unread (`_deliver`)
        self.taken = trio.Event()  # set (and replaced) each time one is read
        self.reduce_config = AllReduceConfig(Encoding(self.config.encoding), self.config.block,
                                             self.config.deadline_s, self.config.max_norm_ratio)
        self.inner: InnerTrainer | None = None
        self.state: GlobalState | None = None  # replaced whole after each outer step, never mutated
        self.outer: OuterOptimizer | None = None
        self.suspects: set[str] = set()  # failed us lately: joins do not wait for them
        self.heard: set[str] = set()  # trainer peers that sent us anything on the diloco channel
        self.joins: dict[int, dict[str, Join]] = {}
        self.early_parts: list[tuple[str, Part]] = []
        self.history: list[dict[str, Any]] = []
        self.fetched: list[dict[str, Any]] = []
        self.rejected: dict[str, int] = {}
        self.done = False
        self.published: list[int] = []
        self.publishing = trio.Lock()
        self.checkpointing = trio.Lock()  # one state write at a time (`_checkpoint`)
        self.pending_checkpoint: GlobalState | None = None
        self.checkpointed_round = -1
        self.outer_state_versions: set[int] = set()  # versions to publish with the outer state (someone asked)
        self.state_askers: dict[str, int] = {}  # peer -> the version offered to it
        self.granted_at: dict[str, int] = {}  # trainer peer -> our round when we last offered it the state
        self.with_outer_state: list[int] = []  # versions published with the outer state
        self.outer_state_bytes = 0  # the size of the last outer state file published
        self.state_via: JoinPath | None = None  # how we took the global state last
        self.state_via_counts = {path: 0 for path in JoinPath}
        self.phase = Phase.STARTING

    # -- the loop -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.node.dataplane.register(CHANNEL, self._serve)
        await trio.to_thread.run_sync(self._load)
        assert self.state is not None and self.inner is not None
        async with trio.open_nursery() as background:
            if self.config.publish:
                background.start_soon(self._publish, self.state)
            task_status.started()
            await self._wait_for_peers()
            await self._catch_up(None)
            while self.state.round < self.config.rounds:
                try:
                    await self._round(background)
                except _Behind as behind:
                    await self._catch_up(behind.peer)
            self.done = True
            self.phase = Phase.DONE
            log.info("diloco: reached %d rounds", self.config.rounds)

    def _load(self) -> None:
        torch.set_num_threads(1)
        from models.folder import load_model_dir

        cfg = self.config
        model, tokenizer = load_model_dir(cfg.model_dir, dtype=torch.float32)
        seed = cfg.data_seed if cfg.data_seed >= 0 else int.from_bytes(self.node.identity.peer_id_bytes[-8:], "big")
        self.inner = InnerTrainer(model, tokenizer, InnerConfig(lr=cfg.inner_lr, batch_size=cfg.batch_size), seed)
        weights = self.inner.weights()
        saved = read_state(cfg.out_dir, weights.numel())
        state = saved or GlobalState(0, weights, torch.zeros_like(weights))
        self._adopt(state)
        if saved is not None:
            log.info("diloco: resumed at round %d from %s", saved.round, cfg.out_dir)

    def _adopt(self, state: GlobalState) -> None:
        self.state = state
        self.outer = OuterOptimizer(OuterConfig(self.config.outer_lr, self.config.outer_momentum),
                                    state.weights.numel(), state.momentum)
        self.inner.load(state.weights)  # type: ignore[union-attr]

    async def _round(self, background: trio.Nursery) -> None:
        state, inner = self.state, self.inner
        assert state is not None and inner is not None and self.outer is not None
        started = trio.current_time()
        self.phase = Phase.INNER
        train_loss = await trio.to_thread.run_sync(inner.train, self.config.inner_steps)
        local = inner.weights()
        pseudo = state.weights - local
        behind: _Behind | None = None
        async with open_links(self, self.config.deadline_s) as links:  # closed after the sends end
            async with trio.open_nursery() as sends:
                try:
                    self.phase = Phase.JOIN
                    members = await self._decide(state.round, digest(state.weights), links, sends)
                    self.phase = Phase.REDUCE
                    reducing = trio.current_time()
                    result = await self._all_reduce(state.round, members, pseudo, links, sends)
                except _Behind as exc:  # raised out of the nursery it would come wrapped in a group
                    behind = exc
                links.stop_watching()  # the round is over: a connection closed from now on is no failure
                sends.cancel_scope.deadline = trio.current_time() + self.config.deadline_s  # finish sends, bounded
        if behind is not None:
            raise behind
        new_weights = self.outer.step(state.weights, result.mean)
        new_state = GlobalState(state.round + 1, new_weights, self.outer.momentum_buffer.clone())
        self.state = new_state
        inner.load(new_weights)
        contributors = sorted({p for shard in result.contributors for p in shard})
        eval_loss = await trio.to_thread.run_sync(inner.eval_loss)
        self.history.append({
            "round": state.round, "from_digest": digest(state.weights).hex(), "loss": round(eval_loss, 5), "train_loss": round(train_loss, 5),
            "bytes_sent": links.bytes_sent, "contributors": contributors, "members": list(members),
            "allreduce_s": round(trio.current_time() - reducing, 4), "round_s": round(trio.current_time() - started, 4),
        })
        for peer, version in list(self.state_askers.items()):
            if new_state.round >= version:  # its state is in this version: wait for its Join from now on
                self.heard.add(peer)
                del self.state_askers[peer]
        background.start_soon(self._checkpoint, new_state)
        if self.config.publish:
            background.start_soon(self._publish, new_state)

    async def _decide(self, round: int, weights_digest: bytes, links: Links,
                      sends: trio.Nursery) -> tuple[str, ...]:
        """The members of this round: decided here when we lead, else told by the leader."""
        me = self.node.peer_id
        membership = Membership(me, round, weights_digest, trio.current_time(), self.config.deadline_s)
        for sender, join in self.joins.pop(round, {}).items():
            membership.receive(sender, join)
        self.joins = {r: j for r, j in self.joins.items() if r > round}
        delivered: dict[str, frozenset[str]] = {}  # peer -> the peers our Join to it named
        invited = self._known_trainers()  # whom we wait for; grows during the round, never shrinks
        if self.history:  # a newcomer is waited for once it spoke to us (a state fetch, a Join)
            invited &= self.heard
        own = set(invited)  # leader candidates on our own account (Membership.leader)
        leader_deadline = trio.current_time() + 2 * self.config.deadline_s
        followed, timed = me, set()  # the leader we wait for Members from; those given their own time to decide
        while True:
            # a peer some member waits for (named in its Join), or whose Join reached us, is one we
            # wait for too: every member then picks its leader from the same peers. Else a joiner
            # only its state's source waits for could lead there and not here, and split the round.
            invited |= membership.named & self._known_trainers()
            membership.expect(invited, self.suspects)
            alive = frozenset(invited - self.suspects)  # what our Join names: not the peers we take for dead
            for peer in sorted(invited):  # (re)send when not delivered yet or when a peer failed us since
                if delivered.get(peer) != alive:
                    delivered[peer] = alive
                    sends.start_soon(self._send_join, links, peer, Join(round, weights_digest, tuple(sorted(alive))),
                                     delivered)
            now = trio.current_time()
            leader = membership.leader(own, invited, self.suspects)
            if leader != followed:  # the last one failed us, or a lower id joined: not its predecessor's rest of time
                followed = leader
                if leader not in timed:  # once per peer and round: a leader that comes and goes cannot hold the round
                    timed.add(leader)
                    leader_deadline = max(leader_deadline, now + 2 * self.config.deadline_s)
            if leader == me:
                decided = membership.decided(now)
                if decided is not None:
                    members, reference = decided
                    for peer in sorted(set(membership.joins) - {me}):
                        sends.start_soon(links.send, peer, Members(round, reference, members))
                    return self._check_members(round, members, reference, weights_digest, me)
            elif now >= leader_deadline:
                log.info("diloco: no members from leader %s for round %d", leader, round)
                self.suspects.add(leader)
                leader_deadline = now + 2 * self.config.deadline_s
                continue
            wake = membership.deadline_at if leader == me else leader_deadline
            event = await self._next_event(min(wake, trio.current_time() + 0.5))
            if event is None:
                continue
            if isinstance(event, PeerFailed):
                self.suspects.add(event.peer)
                continue
            sender, body = event.peer, event.body
            if isinstance(body, (Join, Members)) and body.round > round:
                raise _Behind(sender)
            elif isinstance(body, Join) and body.round == round:
                membership.receive(sender, body)
            elif isinstance(body, Members) and body.round == round:
                return self._check_members(round, body.members, body.weights_digest, weights_digest, sender)
            elif isinstance(body, Part) and body.round == round and len(self.early_parts) < INBOX * 4:
                self.early_parts.append((sender, body))

    def _check_members(self, round: int, members: tuple[str, ...], reference: bytes, ours: bytes,
                       source: str) -> tuple[str, ...]:
        """`members` if we are one of them on the reference weights; else we sit the round out
        and fetch the state (from `source`, a member). Never a round alone while others live."""
        me = self.node.peer_id
        if me not in members or reference != ours:
            raise _Behind(source if source != me else members[0])
        others = self._known_trainers() - self.suspects
        if members == (me,) and others:
            raise _Behind(min(others))
        return members

    async def _send_join(self, links: Links, peer: str, join: Join, delivered: dict[str, frozenset[str]]) -> None:
        if not await links.send(peer, join, report_refusal=False):
            delivered.pop(peer, None)  # again at the next poll: a newcomer may not have our heartbeat yet

    async def _all_reduce(self, round: int, members: tuple[str, ...], pseudo: torch.Tensor, links: Links,
                          sends: trio.Nursery) -> Finished:
        core = AllReduce(self.node.peer_id, round, members, pseudo, self.reduce_config)
        effects = core.start(trio.current_time())
        for sender, part in self.early_parts:
            effects += core.receive(trio.current_time(), sender, part)
        self.early_parts.clear()
        while True:
            for effect in effects:
                if isinstance(effect, Finished):
                    self.suspects |= core.dead
                    return effect
                if isinstance(effect, Send):
                    sends.start_soon(links.send, effect.peer, effect.body)
                elif isinstance(effect, Penalise):
                    self._penalise(effect.peer, effect.why.value)
            event = await self._next_event(core.next_deadline())
            now = trio.current_time()
            if event is None:
                effects = core.tick(now)
                continue
            if isinstance(event, PeerFailed):
                effects = core.peer_failed(now, event.peer)
                continue
            sender, body = event.peer, event.body
            if isinstance(body, Part) and body.round == round and body.members_digest != core.digest:
                effects = core.peer_failed(now, sender)  # it decided other members: not in this reduction
            elif isinstance(body, Part):
                effects = core.receive(now, sender, body)
            else:
                if isinstance(body, Join) and body.round > round:
                    self.joins.setdefault(body.round, {})[sender] = body
                effects = core.tick(now)

    async def _next_event(self, deadline: float) -> InboxEvent | None:
        with trio.move_on_at(deadline):
            event = await self.inbox.receive()
            if isinstance(event, Received):
                self._unqueue(event.peer)
                self.suspects.discard(event.peer)
                self.heard.add(event.peer)
            return event
        return None

    # -- peers ------------------------------------------------------------------------------

    def _known_trainers(self) -> set[str]:
        """Trainer peers in our peer table (those that stopped heartbeating expire from it), of
        `trainers` when the group is closed: a role in a heartbeat is only a claim."""
        now = trio.current_time()
        table = self.node.peertable
        allowed = self.config.trainers
        return {e.peer_id for e in table.with_role("diloco")
                if e.peer_id != self.node.peer_id and e.data_addr and not table.is_banned(e.peer_id, now)
                and (not allowed or e.peer_id in allowed)}

    def _member_of_group(self, peer: str) -> None:
        """Refuse `peer`'s connections when the group is closed (`trainers`) and it is not in it: in an
        open group any identity's Join counts in the reference digest's vote, and one naming a
        later round sends us to fetch the state from it (`_Behind`), directly if need be, where we
        take any finite weights it sends."""
        if self.config.trainers and peer not in self.config.trainers:
            raise MessageRejected("not_a_trainer", "not one of this group's [diloco] trainers", peer)

    def _listed_only(self, peer: str, body: Join | Members | Part) -> Join | Members | Part | None:
        """`body` as a round takes it in: in a closed group, the names of peers `trainers` does not
        list are left out (logged), where they enter. A listed peer whose own list differs (a
        list not copied to every peer) would otherwise make a leader wait a join deadline for
        the strangers its Join names, or, in its Members, make us send them our contributions and
        leave them shards to own. Members naming none of ours is dropped (None). Left out of a
        leader's Members, those peers make our members digest differ from the others': the round
        then goes on without us, and we fetch the state after it, as on any disagreement."""
        allowed = self.config.trainers
        if not allowed or isinstance(body, Part):
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

    async def _wait_for_peers(self) -> None:
        await self.node.wait_for_peers(lambda: len(self._known_trainers()) + 1 >= self.config.min_peers)

    def _penalise(self, peer: str, why: str) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + 1
        for effect in self.node.peertable.penalise(trio.current_time(), peer, PENALTY):
            self.node.carry_out(PEER_TABLE_CORE, effect)
        log.warning("diloco: rejected a contribution of %s (%s)", peer, why)

    async def open_stream(self, peer: str) -> trio.SocketStream:
        entry = self.node.peertable.get(peer)
        if entry is None or not entry.data_addr:
            raise PeerUnavailable(f"no data address known for {peer}")
        return await open_data_stream(entry.data_addr, CHANNEL, codec=self.node.codec, peer=peer,
                                      timeout_s=self.config.deadline_s)

    # -- serving ----------------------------------------------------------------------------

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
            if isinstance(envelope.body, (Join, Members, Part)):
                hears_idle = hears_idle or envelope.body.hears_idle
            if not await self._on_frame(stream, peer, envelope.body, envelope.kind):
                return

    async def _on_frame(self, stream: trio.SocketStream, peer: str, body: object, kind: str) -> bool:
        """Act on one frame `peer` sent on our diloco channel; False: the connection is to end."""
        if isinstance(body, StateRequest):
            if self.state is None:  # our model still loads (`run` registers the channel first): no one's fault
                log.info("diloco: %s asked for the state before ours was loaded: connection closed", peer)
                return False  # the joiner asks again, or another trainer peer
            self.heard.add(peer)
            await self._send_state(stream, peer)
        elif isinstance(body, StateWanted):
            # its heartbeat may be on its way to us
            await self.node.wait_for_peers(lambda: peer in self._known_trainers(), ASKER_WAIT_S)
            offer = self._offer(peer, body)
            await self._sent_within(self.config.deadline_s, peer, "offer",
                                    send_frame(stream, self.node.codec.encode(offer, time.time())))
        elif isinstance(body, (Join, Members, Part)):
            if isinstance(body, Join) and self.state is not None and body.round < self.state.round:
                await self._tell_ahead(peer)
            listed = self._listed_only(peer, body)
            if listed is not None and not self._stale(listed):
                await self._deliver(peer, listed)
        else:
            raise MessageRejected("unexpected", f"{kind} on the diloco channel")
        return True

    def _stale(self, body: Join | Members | Part) -> bool:
        """A frame no round of ours will use, not worth a place in the inbox: of a round before
        ours (a Join of one was answered, `_tell_ahead`), or a Part of another round than ours
        (a round takes Parts of its own round only; one of a later round needs our Join first)."""
        if self.state is None:
            return False  # our model still loads: any round may be ours
        return body.round < self.state.round or (isinstance(body, Part) and body.round != self.state.round)

    async def _deliver(self, peer: str, body: Join | Members | Part) -> None:
        """Put `peer`'s frame into the round's inbox, where it waits until the round reads it
        (nothing does while the inner steps run). A sender has `PEER_INBOX` places there at a time,
        so that no sender fills it for the others; a frame that finds none (its sender's, or the
        whole inbox's) within `STALL_WINDOWS` x `deadline_s` ends its connection ("inbox_full"),
        which would otherwise wait unbounded, its reader held, past the idle bound. An honest sender
        never has that many frames for us unread: during the round we read at once, and before it
        it sends a few (`PEER_INBOX`); one that meets this sees a closed connection and takes us for
        failed until our next frame, as on any close, and its next send opens another."""
        window_s = STALL_WINDOWS * self.config.deadline_s
        delivered = False
        with trio.move_on_after(window_s):
            while self.queued.get(peer, 0) >= PEER_INBOX:
                await self.taken.wait()
            self.queued[peer] = self.queued.get(peer, 0) + 1
            try:
                await self.inbox_send.send(Received(peer, body))
                delivered = True
            finally:
                if not delivered:
                    self._unqueue(peer)
        if not delivered:
            raise MessageRejected("inbox_full", f"{self.queued.get(peer, 0)} frames of it unread and no room for "
                                  f"another in {window_s:g} s", peer)

    def _unqueue(self, peer: str) -> None:
        """One frame of `peer` left the inbox (read, or never put there): a place freed, waiters woken."""
        left = self.queued.get(peer, 0) - 1
        if left > 0:
            self.queued[peer] = left
        else:
            self.queued.pop(peer, None)  # (a peer with nothing queued costs nothing)
        self.taken.set()
        self.taken = trio.Event()

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
            async with open_links(self, self.config.deadline_s, reports=False) as links:
                await links.send(peer, Join(self.state.round, digest(self.state.weights), ()))

    def state_due(self, start: float, values: int) -> float:
        """When the state's first `values` values are due, for a transfer that began at `start`:
        `STATE_SEND_DEADLINES` x `deadline_s`, then `state_min_bytes_per_s`. Taken by the asker
        (ours, sending) or come (theirs, fetching); the asker starts counting before it asks."""
        return (start + STATE_SEND_DEADLINES * self.config.deadline_s
                + STATE_BYTES_PER_VALUE * values / self.config.state_min_bytes_per_s)

    async def _send_state(self, stream: trio.SocketStream, peer: str) -> None:
        """Our global state to `peer`, which asked for it, piece by piece, each taken by its
        `state_due` time or the asker is at fault ("stalled") and the connection ends: a large
        state may take long at a steady rate, an asker that stops reading is cut all the same."""
        state = self.state
        assert state is not None
        start = trio.current_time()
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

    async def fetch_state(self, peer: str) -> GlobalState:
        """The global state of `peer` (a direct fetch on the data channel); in a closed group only
        from one of its trainers (`not_a_trainer`), whoever named `peer`."""
        self._member_of_group(peer)
        total = self.state.weights.numel()  # type: ignore[union-attr]
        weights, momentum = torch.empty(total), torch.empty(total)
        stream = await self.open_stream(peer)
        async with stream:
            start = trio.current_time()  # before we ask: each piece is due here first (`state_due`)
            with trio.fail_at(self.state_due(start, 0)):
                await send_frame(stream, self.node.codec.encode(StateRequest(self.state.round), time.time()))  # type: ignore[union-attr]
            reader = FrameReader(stream, max_frame_bytes=MAX_FRAME_BYTES)
            got, round = 0, -1
            while got < total:
                with trio.fail_at(self.state_due(start, min(total, got + STATE_PIECE_VALUES))):
                    frame = await reader.frame()
                if frame is None:
                    raise PeerUnavailable(f"{peer} ended the state after {got} of {total} values")
                piece = self.node.codec.decode(frame, time.time()).body
                if not isinstance(piece, StatePiece) or piece.total != total or piece.offset != got or (
                        round >= 0 and piece.round != round):
                    raise MessageRejected("bad_state", f"{peer} sent a state piece that does not fit", peer)
                round = piece.round
                weights[got:got + piece.length] = torch.frombuffer(bytearray(piece.weights), dtype=torch.float32)
                momentum[got:got + piece.length] = torch.frombuffer(bytearray(piece.momentum), dtype=torch.float32)
                got += piece.length
        if not (bool(torch.isfinite(weights).all()) and bool(torch.isfinite(momentum).all())):
            raise MessageRejected("bad_state", f"{peer} sent weights that are not finite", peer)
        return GlobalState(round, weights, momentum)

    async def _catch_up(self, hint: str | None) -> None:
        """Take the global state of a later round when others are ahead (or, hint given, when we
        were told we drifted): through the relay when we can (`trainer.diloco_join`), else, or
        when that fails, directly from a live trainer peer."""
        if self.config.join_via == JoinPath.RELAY:
            if await self._catch_up_via_relay(hint):
                return
        await self._catch_up_directly(hint)

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
        for publisher in publishers:
            try:
                fetched = await state_via_relay(self, publisher, self.state.round, behind_only=hint is None)
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
        log.info("diloco: took the global state of round %d from %s (%s)", state.round, source, via)

    async def _catch_up_directly(self, hint: str | None) -> None:
        """Take the newest global state a live trainer peer has (hint first), if newer than ours;
        also when we are told we drifted (hint given), take the hinted peer's at its round."""
        peers = ([hint] if hint else []) + sorted(self._known_trainers() - {hint} - self.suspects)
        for peer in peers:
            try:
                fetched = await self.fetch_state(peer)
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

    def status(self) -> dict[str, Any]:
        state = self.state
        return {"round": state.round if state else -1, "rounds_target": self.config.rounds, "done": self.done,
                "phase": self.phase, "weights_digest": digest(state.weights).hex() if state else "",
                "history": self.history[-200:], "fetched": self.fetched, "rejected": dict(self.rejected),
                "suspects": sorted(self.suspects), "published": self.published[-20:],
                "encoding": self.config.encoding, "inner_steps": self.config.inner_steps,
                "values": state.weights.numel() if state else 0, "state_via": self.state_via or "",
                "state_via_counts": dict(self.state_via_counts), "with_outer_state": self.with_outer_state[-20:],
                "outer_state_bytes": self.outer_state_bytes}


def _shell_with(model: Any, weights: torch.Tensor) -> Any:
    """A copy of `model` holding `weights` (the inner model trains on meanwhile)."""
    import copy

    from trainer.diloco import unflatten_into

    shell = copy.deepcopy(model)
    unflatten_into(weights, shell.state_dict())
    return shell
