"""The `diloco` role: one trainer peer of a DiLoCo group, the trio shell of `trainer.allreduce`.

Each round: take H inner AdamW steps from the global weights (in a worker thread), decide the
round's members (`Membership`: Joins over the data plane), average the pseudo-gradients with
`AllReduce` over direct authenticated connections on the `diloco` data channel, apply the outer
Nesterov step (or discard the round, alike at every member, when the mean would make that step
leave a value not finite: `_outer_step`), then, without waiting for either, write the global
state durably (a worker thread: the next inner steps start at once) and, on the publishing peer,
write the global weights as version `round` and publish them through the relay role, as the
GRPO trainer does, so inference workers fetch them as before.

This module owns the role's config (`DilocoConfig`) and state (`__init__`: each mixin below
declares the part of it that it uses), the model and the global state it starts from (`_load`,
`_adopt`), the rounds (`run`, `_round`, `_all_reduce`), whom they may wait for and who is in the group
(`_known_trainers`, `_member_of_group`, `_reserve`), our connections to other trainer peers
(`open_stream`), and `status()`. The round's inbox is `trainer.diloco_inbox`'s. Mixed in:
deciding a round's members (`trainer.diloco_decide`, `Deciding`);
serving other trainer peers' connections, putting their frames into that inbox and our answers to
them (`trainer.diloco_serving`, `DilocoServing`, with `trainer.diloco_state_answer`'s `AnsweringState`
mixed into it: our state to a joiner's `StateRequest`);
taking a later global state when we join or drift (through the relay or directly), the durable
writes and publishing (`trainer.diloco_catchup`, `CatchingUp`).

Who is in the group. By default the group is open: any peer whose heartbeat claims the diloco
role (any identity, at no cost) is invited, waited for, counts in a round's reference digest, and
can send us to fetch the state from it by naming a later round; a direct fetch then takes
whatever finite weights it sends. `[diloco] trainers` closes the group: our data channel closes
a connection of a peer not listed before reading a frame of it (`not_a_trainer`), and only listed
peers are invited, waited for or asked for the state. The relay path trusts only `[relay]
trusted_publishers` either way. Identities that take no part in our rounds cannot crowd a
round's members out of our inbox: the members of the last round we took part in (`_reserve`;
every listed trainer in a closed group) have places of their own there, read first, and every
other sender (a joiner, or any identity) shares a pool (`trainer.diloco_inbox`), so a flood of
them delays only joiners. In an open group an identity takes part at no cost, though: its Join
makes it a member (a lower id than the group's, its leader). A round's Members we take only from
our leader or a peer we keep places for (`trainer.diloco_decide`): any identity can send one, and
whoever it listed would be the members we keep places for, not the real ones. A round
holds at most `MAX_MEMBERS`, though many identities Join it: the peers we keep places for always
find room among the Joins we hold (`Membership`, `room_for`), the rest go to other joiners first
come. A joiner left out is told so (`NoRoom`, by each member that turned its Join away, taken
from its leader only: `trainer.diloco_decide`): it sits the round out at once and takes a later
state, as a peer the round's Members leave out does. An older joiner, whose Join does not say it
reads that, is not told: it waits out its leader's timeout, may then decide a round of its own
with the Joins it holds, and is behind the group the round after. Joins of the next round
read during our all-reduce are kept for it, of the next round only and as many, the same peers
first (`_keep_join`), and the trainer peers of our table among the senders it had no room for are
remembered for it (`turned_away`), as `Membership` remembers those it turns away, and told.

What being of an open group costs. We know a peer to be of our open group (`contributed`: the
places only the group's members take among the held state requests, `trainer.diloco_state_answer`)
when every shard of the last round we finished took its contribution: one model-sized upload a
round, screened for shape, finiteness and a norm at most `max_norm_ratio` times the median norm of
all the shard's contributions (`trainer.diloco.screen`). That is bandwidth, not compute: nothing
shows a contribution came of inner steps. An all-zero one is the cheapest to make, but we do not
refuse it: a stranger that sends small random values instead spends exactly as much (no compute,
the same upload) and passes any check for zeros, and one that sends random values of an honest
norm passes a check for small norms too, so neither would cost an attacker anything (and an
honest peer's pseudo-gradient is never exactly zero, so they would catch no mistake either).
Zero or tiny contributions dilute the round's mean; noise within the limit moves it. What the
screen does bound: identities that send fewer than half of a shard's contributions cannot get
an honest one rejected (unless the honest ones differ more than `max_norm_ratio`-fold among
themselves), whatever they send, and cannot get one above `max_norm_ratio` times the largest
honest norm taken; half of them sending zeros can get every honest one rejected, and more than
half can do anything: the median is theirs, the honest contributions rejected and their senders
penalised, the round's mean theirs and they alone its whole contributors (`contributed`). In an
open group identities cost nothing, so that is only as many identities as the honest members
(while a round has room for them: `MAX_MEMBERS`), each with one upload a round
(`tests/trainer/test_diloco_open_group.py` shows each case). All that bounds only the shards an
honest peer reduces: one identity admitted to a round owns a shard and sends whatever mean it
likes for it (a shard's reduced value is taken from the member each of us holds to reduce it,
or one before that in the shard's chain, only, so it cannot set another's: `trainer.allreduce_gather`; `trainer.diloco`, "Whose screen
this is"). The defence is to close the group
(`[diloco] trainers`): then only listed trainers are members, and a stranger's connection is
refused before a frame of it is read.

Whom a join waits for, who leads and the members a round takes: `trainer.diloco_decide`.
What we remember of whom we heard and whom we suspect (`heard`, `suspects`) keeps only trainer
peers of our table and the last round's members (`_forget`), and of those heard at most `PEERS`:
any identity can send us a frame or fail us, and both would otherwise grow for as long as we
run. A suspect of our table stays one until it speaks: one forgotten would lead again.
Contributions the core rejects cost their sender a peer table penalty, and a mean that made the
outer step overflow costs its reducer one (`_outer_step`). The Parts of a round read before its
members are decided are kept for its all-reduce within bounds, and only from the peers it may
take (`trainer.diloco_decide`, `EARLY_BYTES`).

This module must not do the arithmetic (trainer.diloco) or decide the protocol (trainer.allreduce).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import trio

from p2pnet.config import from_mapping, validated
from p2pnet.dataplane import open_data_stream
from p2pnet.errors import ConfigError, MessageRejected, PeerUnavailable
from p2pnet.identity import peer_id_from_str
from p2pnet.peertable import PEER_TABLE_CORE
from trainer.allreduce import AllReduce, AllReduceConfig, Finished, Penalise, Send
from trainer.diloco import Encoding, OuterConfig, OuterOptimizer, OuterStepNotFinite, digest
from trainer.diloco_catchup import CatchingUp, JoinPath, _shell_with  # _shell_with: tests import it from here
from trainer.diloco_decide import Deciding, _Behind
# INBOX, PEER_INBOX and the constants below: tests import them from here, to read (patched here, one
# would change nothing: the modules that use them read their own)
from trainer.diloco_inbox import INBOX, PEER_INBOX, RoundInbox
from trainer.diloco_links import InboxEvent, Links, PeerFailed, Received, open_links
from trainer.diloco_local import GlobalState, InnerConfig, InnerTrainer, read_state
from trainer.diloco_messages import CHANNEL, MAX_MEMBERS, Join, Part
from trainer.diloco_serving import ASKER_ROUNDS, IDLE_WINDOWS, MAX_FRAME_BYTES, STALL_WINDOWS, DilocoServing
from trainer.diloco_state_answer import STATE_BYTES_PER_VALUE, STATE_SEND_DEADLINES

log = logging.getLogger(__name__)

PENALTY = 2.0
STEP_NOT_FINITE = "outer_step_not_finite"  # why a reducer is penalised (`_outer_step`; `status()["rejected"]`)
# the most peers `heard` keeps (`_forget`): any identity can send us a frame at no cost. Four
# rounds' worth of members: a group's trainer peers fit, the reserved first.
PEERS = 4 * MAX_MEMBERS


class Phase(enum.StrEnum):
    """Where the role is (`status()["phase"]`, what tests and the devnet watch): its value is the
    text status JSON and logs show."""

    STARTING = "starting"  # loading the model, waiting for peers, catching up
    INNER = "inner"  # the round's inner steps
    JOIN = "join"  # deciding the round's members
    REDUCE = "reduce"  # averaging the pseudo-gradients
    DONE = "done"  # reached `rounds`: no more training, the state is still served


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
    max_norm_ratio: float = 10.0  # a shard's contributions with a norm above this x the lower median of all of its contributions' norms are rejected
    join_via: str = "relay"  # how a joining peer gets the global state: relay (then direct) or direct
    state_min_bytes_per_s: int = 1_000_000  # a direct state fetch slower than this (after 4 x deadline_s) is cut, at both ends
    trainers: tuple[str, ...] = ()  # base58 peer ids of the group's trainer peers, this one among them; empty: an open group, where any peer that heartbeats the diloco role takes part (and can hand a direct join its weights), its contributions screened by norm only (zeros or noise pass: nothing shows they came of training)

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
        if len(set(self.trainers)) > MAX_MEMBERS:  # (each has places of its own in the round's inbox)
            problems["trainers"] = f"at most {MAX_MEMBERS} peers: no round holds more"
        try:
            AllReduceConfig(Encoding(self.encoding) if self.encoding in ("int8", "fp32") else Encoding.INT8,
                            self.block, max(self.deadline_s, 1e-9), self.max_norm_ratio)
            OuterConfig(self.outer_lr, self.outer_momentum)
            InnerConfig(lr=self.inner_lr, batch_size=max(self.batch_size, 1))
        except ValueError as exc:
            problems["block"] = str(exc)
        return problems


class DilocoRole(Deciding, DilocoServing, CatchingUp):
    def __init__(self, node: Any, section: dict[str, Any]) -> None:
        self.node = node
        self.config = from_mapping(DilocoConfig, section, "diloco")
        if self.config.trainers and node.peer_id not in self.config.trainers:  # a list copied to every peer
            raise ConfigError("diloco.trainers", f"does not list this peer ({node.peer_id}): a group's trainers "
                              "refuse the frames of a peer they do not list, so it would never take part")
        self.relay = node.roles.get("relay")  # built before us; publishes, and brings a joiner the state
        if self.config.publish and self.relay is None:
            raise ConfigError("peer.roles", "diloco with publish = true needs the relay role (--role relay)")
        # the round's inbox: the group's members have places of their own there (`_reserve`); in a
        # closed group that is every listed trainer, from the start
        self.inbox = RoundInbox(self.config.trainers)
        self.reduce_config = AllReduceConfig(Encoding(self.config.encoding), self.config.block,
                                             self.config.deadline_s, self.config.max_norm_ratio)
        self.inner: InnerTrainer | None = None
        self.state: GlobalState | None = None  # replaced whole after each outer step, never mutated
        self.outer: OuterOptimizer | None = None
        # bounded by `_forget`: trainer peers of our table, and the members of the last round, only
        self.suspects: set[str] = set()  # failed us lately: joins do not wait for them
        self.heard: set[str] = set()  # trainer peers that sent us anything on the diloco channel
        self.joins: dict[int, dict[str, Join]] = {}  # Joins of the next round read early (`_keep_join`)
        self.turned_away: dict[int, set[str]] = {}  # and the trainer peers among their senders it had no room for
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
        # bounded by `_offer`: the offers of the last ASKER_ROUNDS rounds, at most ASKERS
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
                    await self._catch_up(behind.peer, behind.past)
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
        self._state_moved()  # (the StateRequests we hold for a later round than ours)
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
                    self._reserve(members)
                    self.phase = Phase.REDUCE
                    reducing = trio.current_time()
                    result = await self._all_reduce(state.round, members, pseudo, links, sends)
                except _Behind as exc:  # raised out of the nursery it would come wrapped in a group
                    behind = exc
                links.stop_watching()  # the round is over: a connection closed from now on is no failure
                sends.cancel_scope.deadline = trio.current_time() + self.config.deadline_s  # finish sends, bounded
        if behind is not None:
            raise behind
        new_state, discarded, blamed = self._outer_step(state, result)
        for peer in sorted(blamed):
            self._penalise(peer, STEP_NOT_FINITE)
        self.state = new_state
        self._state_moved()  # the StateRequests held for a later round than the last are answered
        inner.load(new_state.weights)
        contributors = sorted({p for shard in result.contributors for p in shard})
        self.contributed = result.whole_contributors()  # of our group, for the held state requests' places
        eval_loss = await trio.to_thread.run_sync(inner.eval_loss)
        self.history.append({
            "round": state.round, "from_digest": digest(state.weights).hex(), "loss": round(eval_loss, 5), "train_loss": round(train_loss, 5),
            "bytes_sent": links.bytes_sent, "contributors": contributors, "members": list(members),
            "allreduce_s": round(trio.current_time() - reducing, 4), "round_s": round(trio.current_time() - started, 4),
            "step_discarded": discarded,
        })
        for peer, version in list(self.state_askers.items()):
            if new_state.round >= version:  # its state is in this version: wait for its Join from now on
                self._note_heard(peer)
                del self.state_askers[peer]
        background.start_soon(self._checkpoint, new_state)
        if self.config.publish:
            background.start_soon(self._publish, new_state)

    def _outer_step(self, state: GlobalState, result: Finished) -> tuple[GlobalState, bool, set[str]]:
        """The global state after the round whose all-reduce gave `result`, whether its step was
        discarded, and the peers to blame for that. A mean that would make the outer step leave a
        weight or a momentum value not finite (`OuterStepNotFinite`: finite values can overflow
        it) discards the round: the next round starts from this one's weights and momentum,
        unchanged, and the reducers of the shards where it overflowed are blamed (not we: a shard
        we reduced ourselves is screened contributions). Whether the step overflows depends only
        on the state and the mean, so every member that took the same mean from the same state
        discards alike, and they stay together (one digest) where they would otherwise all have
        gone on from weights of inf."""
        assert self.outer is not None
        try:
            weights = self.outer.step(state.weights, result.mean)
        except OuterStepNotFinite as exc:
            blamed = result.reducers_where(exc.where) - {self.node.peer_id}
            log.warning("diloco: round %d discarded: %s (the mean of %s)", state.round, exc,
                        ", ".join(sorted(blamed)) or "our own shards")
            return GlobalState(state.round + 1, state.weights, state.momentum), True, blamed
        return GlobalState(state.round + 1, weights, self.outer.momentum_buffer.clone()), False, set()

    async def _all_reduce(self, round: int, members: tuple[str, ...], pseudo: torch.Tensor, links: Links,
                          sends: trio.Nursery) -> Finished:
        core = AllReduce(self.node.peer_id, round, members, pseudo, self.reduce_config)
        trainers = self._known_trainers()  # whose Joins of the next round we had no room for are remembered
        effects = core.start(trio.current_time())
        for sender, part in self.early_parts:
            effects += core.receive(trio.current_time(), sender, part)
        self.early_parts.clear()
        while True:
            for effect in effects:
                if isinstance(effect, Finished):
                    self._suspect(*core.dead)
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
                if isinstance(body, Join) and body.round == round + 1:
                    for peer in self._keep_join(sender, body, trainers):  # no room for it: it is told
                        sends.start_soon(self._tell_no_room, links, peer, round + 1)
                effects = core.tick(now)

    async def _next_event(self, deadline: float) -> InboxEvent | None:
        with trio.move_on_at(deadline):
            event = await self.inbox.receive()  # the group's frames first (`trainer.diloco_inbox`)
            if isinstance(event, Received):
                self.suspects.discard(event.peer)
                self._note_heard(event.peer)
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

    def _note_heard(self, peer: str) -> None:
        """`peer` spoke to us on the diloco channel (a frame, a state fetch): after our first round,
        only such peers are waited for on our own account. Bounded (`_forget`) as it grows."""
        self.heard.add(peer)
        if len(self.heard) > PEERS:
            self._forget()

    def _suspect(self, *peers: str) -> None:
        """`peers` failed us (a send, a deadline): joins do not wait for them until they speak.
        Bounded (`_forget`) as it grows: a round's Members and contributions go to peers that
        need not be in our table (any identity's Join makes it one we send Members to), and any
        identity's contribution of other members makes it one of the reduction's dead."""
        self.suspects.update(peers)
        if len(self.suspects) > PEERS:
            self._forget()

    def _forget(self) -> None:
        """Bound `heard` and `suspects`, at the start of each round and whenever one outgrows
        `PEERS`: in an open group any identity can send us a frame or fail us at no cost, and
        both would otherwise grow with every identity a long run meets. Kept: the trainer peers of
        our table (only they are invited, waited for, or leaders: `_known_trainers`) and the
        members of the last round we took part in (`inbox.reserved`). A peer that left our table
        is not invited, whatever these say: forgetting it changes nothing until it is back (then
        it is waited for once it speaks, as a newcomer). Of more than `PEERS` heard (a flood of
        trainer peers in our table), the reserved and `PEERS // 2` of the others, whichever
        (half: one that keeps it full then costs a pass over the table every `PEERS // 2`
        frames, not at each); one forgotten is waited for again once it speaks, a member names
        it or its Join reaches us. Suspects of our table are all kept, bounded by it as
        `Membership.refused` is: one forgotten would be a leader again while silent, a leader
        timeout more each time, and past `PEERS` silent leaders of lower ids than ours (a
        heartbeat and a Join each) every member would go round them for ever, never leading."""
        reserved = self.inbox.reserved
        keep = self._known_trainers() | reserved
        self.suspects.intersection_update(keep)
        self.heard.intersection_update(keep)
        if len(self.heard) > PEERS:
            self.heard.difference_update(list(self.heard - reserved)[PEERS // 2:])

    def _reserve(self, members: tuple[str, ...]) -> None:
        """The round's inbox keeps places for `members` from now on, until the next round we take
        part in is decided: their Parts now, their Joins and Members of the next round. In an open
        group these are the only peers we know to be of the group: a heartbeat (`_known_trainers`),
        a frame that reached us (`heard`) or a Join (`Membership.joins`) is what any fresh identity
        can show, and those share the inbox's pool. `members` is only as sound as the Members list
        `_decide` took (from our leader, or a member of the last round: `Deciding._believed`). In a closed
        group every listed trainer has had its places from the start."""
        if not self.config.trainers:
            self.inbox.reserve(members)

    def _member_of_group(self, peer: str) -> None:
        """Refuse `peer`'s connections when the group is closed (`trainers`) and it is not in it: in an
        open group any identity's Join counts in the reference digest's vote, and one naming a
        later round sends us to fetch the state from it (`_Behind`), directly if need be, where we
        take any finite weights it sends."""
        if self.config.trainers and peer not in self.config.trainers:
            raise MessageRejected("not_a_trainer", "not one of this group's [diloco] trainers", peer)

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

    def status(self) -> dict[str, Any]:
        state = self.state
        return {"round": state.round if state else -1, "rounds_target": self.config.rounds, "done": self.done,
                "phase": self.phase, "weights_digest": digest(state.weights).hex() if state else "",
                "history": self.history[-200:], "fetched": self.fetched, "rejected": dict(self.rejected),
                "suspects": sorted(self.suspects), "published": self.published[-20:],
                "encoding": self.config.encoding, "inner_steps": self.config.inner_steps,
                "values": state.weights.numel() if state else 0, "state_via": self.state_via or "",
                "state_via_counts": dict(self.state_via_counts), "with_outer_state": self.with_outer_state[-20:],
                "outer_state_bytes": self.outer_state_bytes, "state_holds": self.holds_status(),
                "state_asks_refused": self.state_asks_refused}

