"""The outer state file a DiLoCo joiner takes through the relay: a version that carries it
loads in a worker as any version does (the file is skipped), and gives a joiner the exact
global state; a version whose file does not fit is refused, named as the publisher's."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import trio

from models.folder import load_model_dir, save_model_dir
from models.weights import load_version, stream_tensors
from p2pnet.dataplane import DataPlane, open_data_stream, send_frame
from p2pnet.errors import PeerUnavailable
from p2pnet.handshake import NotAdmitted
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from relay.errors import VersionUnloadable
from relay.loader import load_state_dict
from relay.store import ChunkStore
from trainer.checkpoint import published_files
from trainer.diloco import digest, flatten
from trainer.diloco_join import OUTER_STATE_FILE, ask_publisher, load_from_version, read_outer_state, state_file_of, write_outer_state
from trainer.diloco_local import GlobalState, InnerConfig, InnerTrainer
from trainer.diloco_messages import CHANNEL, StateOffer, StateWanted
from trainer.diloco_role import ASKER_ROUNDS, DilocoRole, _shell_with
from trainer.diloco_serving import ASKERS

NOW = 1_800_000_000.0
PUBLISHER = Identity.from_seed_text("diloco publisher")


def _inner(model_dir) -> InnerTrainer:
    model, tokenizer = load_model_dir(model_dir, dtype=torch.float32)
    return InnerTrainer(model, tokenizer, InnerConfig(batch_size=2), 0)


def _global_state(inner: InnerTrainer, round: int, seed: int) -> GlobalState:
    g = torch.Generator().manual_seed(seed)
    weights = inner.weights() + 0.01 * torch.randn(inner.weights().numel(), generator=g)
    return GlobalState(round, weights, torch.randn(weights.numel(), generator=g))


def _publish(tmp_path, inner: InnerTrainer, state: GlobalState, *, with_state: GlobalState | None) -> ChunkStore:
    """A store holding `state`'s weights as version `state.round`, with `with_state`'s outer state file."""
    folder = save_model_dir(_shell_with(inner.model, state.weights), inner.tokenizer, tmp_path / f"v{state.round}")
    files = published_files(folder)
    if with_state is not None:
        files.append(write_outer_state(folder, with_state))
    store = ChunkStore(tmp_path / "store", budget_bytes=10**9, trusted_publishers=[PUBLISHER.peer_id], fsync=False)
    store.publish_files(PUBLISHER, files, model="tiny", version=state.round, chunk_bytes=64 * 1024, now_s=NOW)
    return store


def test_a_worker_loads_a_version_that_carries_the_outer_state_and_skips_the_file(tmp_path, model_dir):
    inner = _inner(model_dir)
    state = _global_state(inner, 3, seed=1)
    store = _publish(tmp_path, inner, state, with_state=state)
    assert state_file_of(store, 3) is not None
    # the worker's path (models.weights.load_version -> relay.loader.load_into) ignores the file
    model, _ = load_version(model_dir, store, 3)
    assert torch.equal(flatten(model.state_dict()), state.weights)
    assert "momentum" not in load_state_dict(store, 3)
    assert "momentum" not in {name for name, _ in stream_tensors(store.version_files(3))}  # the vLLM push
    # the file itself: exactly the momentum, the round and the weights digest, memory-mapped
    round, weights_digest, momentum = read_outer_state(state_file_of(store, 3))
    assert round == 3 and weights_digest == digest(state.weights) and torch.equal(momentum, state.momentum)
    # what it adds for workers: the momentum in fp32 and a small header
    extra = state_file_of(store, 3).stat().st_size
    assert 4 * state.weights.numel() < extra < 4 * state.weights.numel() + 1024


def test_a_joiner_takes_the_exact_global_state_from_the_version(tmp_path, model_dir):
    publisher_inner, joiner_inner = _inner(model_dir), _inner(model_dir)
    state = _global_state(publisher_inner, 5, seed=2)
    store = _publish(tmp_path, publisher_inner, state, with_state=state)
    taken = load_from_version(joiner_inner, store, 5)
    assert taken.round == 5 and torch.equal(taken.weights, state.weights) and torch.equal(taken.momentum, state.momentum)
    assert torch.equal(joiner_inner.weights(), state.weights)


@pytest.mark.parametrize("fault", ["no_file", "other_round", "other_weights"])
def test_a_version_whose_outer_state_does_not_fit_is_the_publishers_fault(tmp_path, model_dir, fault):
    inner = _inner(model_dir)
    state = _global_state(inner, 4, seed=3)
    other = {"no_file": None, "other_round": GlobalState(3, state.weights, state.momentum),
             "other_weights": _global_state(inner, 4, seed=4)}[fault]
    store = _publish(tmp_path, inner, state, with_state=other)
    with pytest.raises(VersionUnloadable) as caught:
        load_from_version(_inner(model_dir), store, 4)
    assert caught.value.sender == PUBLISHER.peer_id
    assert (fault == "no_file") == (OUTER_STATE_FILE in str(caught.value))


def _publisher(round: int, trainers: set[str]) -> SimpleNamespace:
    """What `DilocoRole._offer` reads of the publishing role."""
    return SimpleNamespace(state=SimpleNamespace(round=round), history=[{"round_s": 1.5}],
                           config=SimpleNamespace(publish=True, rounds=100, deadline_s=30.0),
                           _known_trainers=lambda: trainers, granted_at={}, outer_state_versions=set(),
                           state_askers={})


def test_only_a_known_trainer_gets_the_outer_state_and_at_most_once_in_a_few_rounds():
    """A peer that is not a trainer we know (an inference worker, a stranger) cannot make a
    version carry the momentum, which every worker would download; a trainer that asks again
    right away is refused too (it joined, or takes the direct fetch)."""
    publisher = _publisher(7, {"trainer4"})
    assert DilocoRole._offer(publisher, "worker1", StateWanted(0, False)).version == -1
    assert publisher.outer_state_versions == set()
    offer = DilocoRole._offer(publisher, "trainer4", StateWanted(0, False))
    assert (offer.round, offer.version) == (7, 8) and publisher.outer_state_versions == {8}
    publisher.state.round = 8
    assert DilocoRole._offer(publisher, "trainer4", StateWanted(0, False)).version == -1
    publisher.state.round = 7 + ASKER_ROUNDS
    assert DilocoRole._offer(publisher, "trainer4", StateWanted(0, False)).version == 8 + ASKER_ROUNDS


def test_what_the_publisher_remembers_of_its_offers_stays_bounded():
    """Each trainer peer offered the outer state is remembered (`granted_at`, `state_askers`), and
    a role in a heartbeat is any identity's claim: at most `ASKERS` offers within `ASKER_ROUNDS`
    rounds (one more asker is refused: it takes the direct fetch), and an offer older than that,
    which no answer reads again, is forgotten (before, both grew by one per asker for good)."""
    askers = [f"trainer{i:04d}" for i in range(ASKERS + 1)]
    publisher = _publisher(7, set(askers))
    for asker in askers[:ASKERS]:
        assert DilocoRole._offer(publisher, asker, StateWanted(0, False)).version == 8
    assert DilocoRole._offer(publisher, askers[-1], StateWanted(0, False)).version == -1
    assert len(publisher.granted_at) == len(publisher.state_askers) == ASKERS
    publisher.state.round = 8  # (taken whole, caught up: `_round` did not forget the askers of version 8)
    assert DilocoRole._offer(publisher, askers[-1], StateWanted(0, False)).version == -1  # round 7's offers stand
    assert publisher.state_askers == {}  # version 8 is ours: they are waited for once they speak
    publisher.state.round = 7 + ASKER_ROUNDS
    assert DilocoRole._offer(publisher, askers[-1], StateWanted(0, False)).version == 8 + ASKER_ROUNDS
    assert publisher.granted_at == {askers[-1]: 7 + ASKER_ROUNDS}
    assert publisher.state_askers == {askers[-1]: 8 + ASKER_ROUNDS}


async def test_a_joiner_asks_again_until_the_publisher_has_heard_its_heartbeat():
    """The joiner hears of the publisher before the publisher hears of the joiner: the publisher's
    data plane (real TCP, real handshake) refuses it until then; the joiner introduces itself after
    each refusal (its heartbeat sent directly), and its ask goes through once admitted instead of
    falling back to the direct fetch at the first refusal."""
    joiner = Identity.from_seed_text("diloco joiner")
    codec = Codec(PUBLISHER)
    refusals = []

    def admit(peer):  # the joiner's heartbeat reaches the publisher after two refused connections
        if len(refusals) < 2:
            refusals.append(peer)
            return "not in our peer table (no heartbeat heard)"
        return None

    async def serve(stream, reader, peer):
        wanted = codec.decode(await reader.frame(), time.time()).body
        await send_frame(stream, codec.encode(StateOffer(7, 8, 1.5), time.time()))
        assert isinstance(wanted, StateWanted) and wanted.have_round == 3

    plane = DataPlane("127.0.0.1", 0, codec=codec, self_id=PUBLISHER.peer_id, admit=admit)
    plane.register(CHANNEL, serve)
    known = {PUBLISHER.peer_id}
    introduced = []

    async def introduce(peer):  # the node sends our heartbeat to a peer that refused us as unknown
        introduced.append(peer)
        return True

    async with trio.open_nursery() as nursery:
        address = await nursery.start(plane.serve)
        role = SimpleNamespace(
            config=SimpleNamespace(deadline_s=30.0),
            node=SimpleNamespace(codec=Codec(joiner), introduce=introduce, peertable=SimpleNamespace(
                config=SimpleNamespace(heartbeat_interval_s=0.05), get=lambda peer: peer if peer in known else None)),
            open_stream=lambda peer: open_data_stream(address, CHANNEL, codec=Codec(joiner), peer=peer))
        with trio.fail_after(60):
            offer = await ask_publisher(role, PUBLISHER.peer_id, StateWanted(3, False))
            assert (offer.round, offer.version) == (7, 8)
            assert refusals == [joiner.peer_id] * 2 and plane.refused == {"not_admitted": 2}
            assert introduced == [PUBLISHER.peer_id] * 2  # after each refusal, before trying again
            # a publisher that never admits us: the path fails at the deadline
            plane.admit_peer = lambda peer: "banned"
            role.config.deadline_s = 0.3
            with pytest.raises(NotAdmitted):
                await ask_publisher(role, PUBLISHER.peer_id, StateWanted(3, False))
            # one that left our table: at once, even with time left
            role.config.deadline_s = 30.0
            known.clear()
            started = plane.refused["not_admitted"]
            with pytest.raises(NotAdmitted):
                await ask_publisher(role, PUBLISHER.peer_id, StateWanted(3, False))
            assert plane.refused["not_admitted"] == started + 1
        # any other failure is not retried: nobody listens there
        role.open_stream = lambda peer: open_data_stream("127.0.0.1:1", CHANNEL, codec=Codec(joiner), peer=peer)
        known.add(PUBLISHER.peer_id)
        with pytest.raises(PeerUnavailable) as failed:
            await ask_publisher(role, PUBLISHER.peer_id, StateWanted(3, False))
        assert not isinstance(failed.value, NotAdmitted)
        nursery.cancel_scope.cancel()


async def test_a_slow_introduction_does_not_carry_the_asking_past_its_deadline(autojump_clock):
    """An introduction may take up to the node's `send_timeout_s` (it may dial the publisher): the
    asking still ends by its deadline, and the next try comes a heartbeat interval after the
    refusal, not an interval after a slow introduction ended."""
    tries = []

    async def refuse(peer):
        tries.append(trio.current_time())
        raise NotAdmitted(f"{peer} closed the connection after our hello")

    async def introduce(peer):  # a dial that hangs until the node's send timeout
        await trio.sleep(10.0)
        return False

    interval = 2.0
    role = SimpleNamespace(
        config=SimpleNamespace(deadline_s=30.0),
        node=SimpleNamespace(codec=Codec(PUBLISHER), introduce=introduce, peertable=SimpleNamespace(
            config=SimpleNamespace(heartbeat_interval_s=interval), get=lambda peer: peer)),
        open_stream=refuse)
    start = trio.current_time()
    with pytest.raises(NotAdmitted):
        await ask_publisher(role, PUBLISHER.peer_id, StateWanted(3, False))
    assert trio.current_time() - start <= role.config.deadline_s  # given up by the deadline
    assert all(later - earlier <= 10.0 for earlier, later in zip(tries, tries[1:]))  # at the introduction's end
    assert len(tries) >= 3
