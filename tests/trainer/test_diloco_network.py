"""DiLoCo over the real peer network: libp2p hosts (gossip heartbeats, peer tables) and the
authenticated TCP data plane, several trainer peers in one trio run, one of them dying in the
middle of a round (after it joined, before it contributed) and a new one joining later; a
joiner that runs the relay role taking the global state through the relay, and falling back
to the direct fetch when the publisher is gone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from p2pnet.control import call
from p2pnet.identity import Identity
from p2pnet.node import PeerConfig, run_node
from p2pnet.peertable import PeerTableConfig
from trainer.diloco_state_answer import STATE_HOLDS, STRANGER_HOLDS

FAST = PeerTableConfig(heartbeat_interval_s=0.2, expiry_s=30.0)
ROUNDS = 8


def _section(root: Path, model_dir: Path, name: str, *, min_peers: int, deadline_s: float = 20.0) -> dict[str, Any]:
    return {"diloco": {"model_dir": model_dir, "out_dir": root / name / "state", "rounds": ROUNDS,
                       "inner_steps": 3, "batch_size": 8, "deadline_s": deadline_s, "min_peers": min_peers}}


async def _start(nursery: trio.Nursery, root: Path, name: str, sections: dict[str, Any],
                 bootstrap: tuple[str, ...] = (), scope: trio.CancelScope | None = None,
                 roles: tuple[str, ...] = ("diloco",), identity: Identity | None = None) -> Any:
    config = PeerConfig(data_dir=root / name, bootstrap=bootstrap, roles=roles, display_name=name)

    async def run(task_status: trio.TaskStatus[Any]) -> None:
        with scope or trio.CancelScope():
            await run_node(config, sections=sections, peertable_config=FAST, identity=identity,
                           task_status=task_status)

    return await nursery.start(run)


async def _until(predicate, what: str, timeout_s: float = 300.0) -> None:
    with trio.fail_after(timeout_s):  # generous: a loaded 2-core machine; nothing here is timed
        while not predicate():
            await trio.sleep(0.05)


async def test_trainer_peers_finish_rounds_when_one_dies_mid_round_and_one_joins(tmp_path, model_dir, nursery):
    scopes = {name: trio.CancelScope() for name in ("t0", "t1", "t2")}
    nodes = {"t0": await _start(nursery, tmp_path, "t0", _section(tmp_path, model_dir, "t0", min_peers=3), scope=scopes["t0"])}
    boot = (nodes["t0"].host.addrs()[0],)
    for name in ("t1", "t2"):
        nodes[name] = await _start(nursery, tmp_path, name, _section(tmp_path, model_dir, name, min_peers=3), boot, scopes[name])
    # the victim is not the round's leader (the lowest peer id): a leader dying before its Members
    # arrive makes the others decide the round again without it (its own test below)
    victim_name = max(nodes, key=lambda n: nodes[n].peer_id)
    victim, victim_scope = nodes[victim_name], scopes[victim_name]
    first, third = (nodes[n] for n in sorted(nodes) if n != victim_name)
    survivors = [first, third]

    # the victim stalls once it has joined round 1: members include it, its contributions never come
    victim_role = victim.roles["diloco"]
    joined_round_1 = trio.Event()
    original = victim_role._all_reduce

    async def stall_then_die(round, members, *args):
        if round == 1:
            joined_round_1.set()
            await trio.sleep_forever()
        return await original(round, members, *args)

    victim_role._all_reduce = stall_then_die
    with trio.fail_after(300):
        await joined_round_1.wait()
    victim_scope.cancel()  # the process dies: its listener and connections close

    roles = [p.roles["diloco"] for p in survivors]
    await _until(lambda: all(r.state.round >= 2 for r in roles), "round 2")
    # the survivors' rounds take a fraction of a second: they hold their next round until the joiner
    # has taken the state, or on a loaded machine they could finish every round before it starts
    joiner_in = trio.Event()
    for role in roles:
        async def held(round, *args, _decide=role._decide):
            await joiner_in.wait()
            return await _decide(round, *args)
        role._decide = held
    joiner = await _start(nursery, tmp_path, "t3", _section(tmp_path, model_dir, "t3", min_peers=2),
                          (first.host.addrs()[0],))  # the bootstrap peer may have been the victim
    joiner_role = joiner.roles["diloco"]
    await _until(lambda: bool(joiner_role.fetched), "the joiner took the state")
    joiner_in.set()
    roles.append(joiner_role)
    await _until(lambda: all(r.done for r in roles), "every live peer done")

    # every live peer ends on the same global weights, at the last round
    digests = {r.status()["weights_digest"] for r in roles}
    assert len(digests) == 1 and all(r.state.round == ROUNDS for r in roles)
    # whom each knows to be of the group (the held state requests' places): those whose whole
    # contribution its last round took, itself among them
    for r in roles:
        assert r.node.peer_id in r.contributed and r.contributed == set(r.history[-1]["contributors"])
    # what `p2pnet peer status --json` shows of it, through each live node's own control socket:
    # the held state requests' places (none in use now) and the refusals for room (none here)
    for name in [n for n in nodes if n != victim_name] + ["t3"]:
        shown = (await call(tmp_path / name, {"cmd": "status"}))["role_status"]["diloco"]
        assert shown["state_holds"] == {"held": 0, "held_strangers": 0, "places": STATE_HOLDS,
                                        "stranger_places": STRANGER_HOLDS, "refused_members": 0,
                                        "refused_strangers": 0}
        assert shown["state_asks_refused"] == 0
    rows = {row["round"]: row for row in roles[0].history}
    assert victim.peer_id in rows[1]["members"] and victim.peer_id not in rows[1]["contributors"]
    assert set(rows[1]["contributors"]) == {first.peer_id, third.peer_id}  # round 1 completed without it
    assert all(victim.peer_id not in rows[r]["members"] for r in rows if r > 1)
    # the joiner took the global state from a live peer and contributed to later rounds
    assert joiner_role.fetched and joiner_role.fetched[0]["round"] >= 2
    assert any(joiner.peer_id in rows[r]["contributors"] for r in rows if r >= 2)
    # training made progress: the held-out loss fell from the first round to the last
    assert rows[ROUNDS - 1]["loss"] < rows[0]["loss"]
    assert all(row["bytes_sent"] > 0 for row in rows.values())
    nursery.cancel_scope.cancel()


async def test_a_peer_sending_outsized_pseudo_gradients_is_left_out_penalised_and_banned(tmp_path, model_dir, nursery):
    rounds = 6
    sections = {name: _section(tmp_path, model_dir, name, min_peers=3) for name in ("h0", "h1", "cheat")}
    for section in sections.values():
        section["diloco"]["rounds"] = rounds
    first = await _start(nursery, tmp_path, "h0", sections["h0"])
    boot = (first.host.addrs()[0],)
    second = await _start(nursery, tmp_path, "h1", sections["h1"], boot)
    cheat = await _start(nursery, tmp_path, "cheat", sections["cheat"], boot)
    cheat_role = cheat.roles["diloco"]
    original = cheat_role._all_reduce

    async def outsized(round, members, pseudo, *rest):
        return await original(round, members, pseudo * 1000.0, *rest)

    cheat_role._all_reduce = outsized
    honest = [first.roles["diloco"], second.roles["diloco"]]
    await _until(lambda: all(r.done for r in honest), "the honest peers done")

    assert honest[0].status()["weights_digest"] == honest[1].status()["weights_digest"]
    for role, node in zip(honest, (first, second)):
        assert role.rejected.get("norm_outlier", 0) >= 1  # checked before reduction, and named
        assert all(cheat.peer_id not in row["contributors"] for row in role.history)
        assert node.peertable.is_banned(cheat.peer_id, trio.current_time())  # penalised until banned
    rows = honest[0].history
    assert rows[-1]["loss"] < rows[0]["loss"] * 1.2 and all(row["loss"] < 10 for row in rows)
    nursery.cancel_scope.cancel()


async def test_a_leader_that_dies_before_deciding_is_replaced(tmp_path, model_dir, nursery):
    rounds = 4
    scopes = {name: trio.CancelScope() for name in ("l0", "l1", "l2")}
    sections = {name: _section(tmp_path, model_dir, name, min_peers=3) for name in scopes}
    for section in sections.values():
        section["diloco"]["rounds"] = rounds
    nodes = {"l0": await _start(nursery, tmp_path, "l0", sections["l0"], scope=scopes["l0"])}
    boot = (nodes["l0"].host.addrs()[0],)
    for name in ("l1", "l2"):
        nodes[name] = await _start(nursery, tmp_path, name, sections[name], boot, scopes[name])
    leader = min(nodes, key=lambda n: nodes[n].peer_id)  # the lowest peer id leads while it lives
    role = nodes[leader].roles["diloco"]
    original, stalled = role._decide, trio.Event()

    async def stall_at_round_1(round, *args):
        if round == 1:
            stalled.set()
            await trio.sleep_forever()
        return await original(round, *args)

    role._decide = stall_at_round_1
    with trio.fail_after(300):
        await stalled.wait()
    scopes[leader].cancel()
    survivors = [nodes[n].roles["diloco"] for n in nodes if n != leader]
    await _until(lambda: all(r.done for r in survivors), "the survivors done")
    assert survivors[0].status()["weights_digest"] == survivors[1].status()["weights_digest"]
    for r in survivors:
        assert [row["round"] for row in r.history] == list(range(rounds))
        assert all(nodes[leader].peer_id not in row["members"] for row in r.history[1:])
    nursery.cancel_scope.cancel()


def _relay(publisher: str | None = None) -> dict[str, Any]:
    """A relay section trusting `publisher` (None: only ourselves), keeping every version of a run."""
    return {"trusted_publishers": [publisher] if publisher else [], "chunk_bytes": 64 * 1024, "fsync": False,
            "announce_interval_s": 0.3, "keep_versions": 20}


# the joiner has the lowest peer id, the publisher the next: a round's leader is the lowest id
# among the peers a member waits for, so a joiner that only its state's source waits for would
# lead the round at that source and not at p1 (the round split: p1 left out, waiting a deadline)
JOINER, P0, P1 = sorted((Identity.from_seed_text(f"diloco-join-{i}") for i in range(3)), key=lambda i: i.peer_id)


async def _publisher_and_one(nursery, root: Path, model_dir: Path, rounds: int, scope: trio.CancelScope | None = None,
                             publish: bool = True, deadline_s: float = 20.0):
    """p0 (relay + diloco, publishes each round unless not `publish`) and p1 (diloco), both at min_peers 2."""
    sections = {name: _section(root, model_dir, name, min_peers=2, deadline_s=deadline_s) for name in ("p0", "p1")}
    for section in sections.values():
        section["diloco"]["rounds"] = rounds
    sections["p0"]["diloco"]["publish"] = publish
    sections["p0"]["relay"] = _relay()
    publisher = await _start(nursery, root, "p0", sections["p0"], scope=scope, roles=("relay", "diloco"), identity=P0)
    other = await _start(nursery, root, "p1", sections["p1"], (publisher.host.addrs()[0],), identity=P1)
    return publisher, other


def _hold(role: Any, at_round: int, gate: trio.Event) -> trio.Event:
    """Hold `role` before the inner steps of round `at_round` until `gate` is set (so a joiner
    started meanwhile has rounds left to take part in, however slowly it starts); the event
    returned is set once it is held there."""
    original, reached = role._round, trio.Event()

    async def held(background: trio.Nursery) -> None:
        if role.state.round == at_round and not gate.is_set():
            reached.set()
            await gate.wait()
        return await original(background)

    role._round = held
    return reached


async def _joiner(nursery, root: Path, model_dir: Path, publisher: str, rounds: int, boot: str,
                  deadline_s: float = 20.0) -> Any:
    """j: relay (trusting `publisher`) + diloco, booting from `boot`."""
    section = _section(root, model_dir, "j", min_peers=2, deadline_s=deadline_s)
    section["diloco"]["rounds"] = rounds
    section["relay"] = _relay(publisher)
    return await _start(nursery, root, "j", section, (boot,), roles=("relay", "diloco"), identity=JOINER)


async def test_a_joiner_with_the_relay_role_takes_the_global_state_through_the_relay(tmp_path, model_dir, nursery):
    from models.weights import load_version
    from trainer.diloco import digest, flatten
    from trainer.diloco_join import read_outer_state, state_file_of

    rounds = 6
    publisher, other = await _publisher_and_one(nursery, tmp_path, model_dir, rounds)
    roles = [publisher.roles["diloco"], other.roles["diloco"]]
    gate = trio.Event()
    held = [_hold(role, 3, gate) for role in roles]
    for reached in held:
        with trio.fail_after(300):
            await reached.wait()
    joiner = await _joiner(nursery, tmp_path, model_dir, publisher.peer_id, rounds, other.host.addrs()[0])
    await _until(lambda: publisher.roles["diloco"].state_askers, "the joiner asking for the outer state")
    gate.set()
    joiner_role = joiner.roles["diloco"]
    roles.append(joiner_role)
    await _until(lambda: all(r.done for r in roles), "every peer done")

    status = joiner_role.status()
    assert status["state_via"] == "relay" and status["state_via_counts"]["direct"] == 0
    taken = joiner_role.fetched[0]
    assert taken["via"] == "relay" and taken["from"] == publisher.peer_id and taken["round"] == 4
    version = taken["round"]
    # the publisher put the outer state in the version it offered, and in no other
    assert publisher.roles["diloco"].with_outer_state == [version]
    # the joiner's own relay store holds that version with the state file, signed by the publisher
    store = joiner.roles["relay"].store
    path = state_file_of(store, version)
    assert path is not None and store.manifest(version).publisher == publisher.peer_id
    # a worker loading that version ignores the file and gets the round's global weights
    model, _ = load_version(model_dir, store, version)
    assert digest(flatten(model.state_dict())) == read_outer_state(path)[1]
    # what it added for every relay: the outer state file alone
    # (a later round's version may still be on its way to the joiner's relay when every role is done)
    await _until(lambda: any(v > version for v in store.complete_versions()), "a later version at the joiner")
    later = next(v for v in store.complete_versions() if v > version)
    sizes = {v: store.manifest(v).manifest.total_bytes for v in (version, later)}
    assert sizes[version] - sizes[later] == path.stat().st_size == publisher.roles["diloco"].outer_state_bytes
    # the joiner took part from the round its version starts, with everyone: that round was not
    # split (p1 waited for the joiner too, so it took no state), and every peer ends on the same weights
    everyone = sorted(r.node.peer_id for r in roles)
    for role in roles[:2]:
        rows = {row["round"]: row for row in role.history}
        assert rows[version]["members"] == rows[version]["contributors"] == everyone
    assert not roles[1].fetched
    assert len({r.status()["weights_digest"] for r in roles}) == 1 and all(r.state.round == rounds for r in roles)
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("publisher_fate", ["dead", "not_publishing"])
async def test_a_joiner_falls_back_to_the_direct_fetch_without_a_publisher(tmp_path, model_dir, nursery, publisher_fate):
    """The trusted peer is gone, or lives but publishes nothing (it answers StateWanted with no
    version): either way the joiner fetches the state directly and takes part."""
    rounds = 6
    scope = trio.CancelScope()
    publisher, other = await _publisher_and_one(nursery, tmp_path, model_dir, rounds, scope,
                                                publish=publisher_fate == "dead", deadline_s=10.0)
    survivor = other.roles["diloco"]
    gate = trio.Event()
    held = [_hold(role, 3, gate) for role in (publisher.roles["diloco"], survivor)]
    for reached in held:
        with trio.fail_after(300):
            await reached.wait()
    if publisher_fate == "dead":
        scope.cancel()  # it dies between rounds: p1 goes on alone
    joiner = await _joiner(nursery, tmp_path, model_dir, publisher.peer_id, rounds, other.host.addrs()[0], 10.0)
    joiner_role = joiner.roles["diloco"]
    await _until(lambda: joiner_role.fetched, "the joiner taking a state")
    gate.set()
    live = [survivor, joiner_role] + ([publisher.roles["diloco"]] if publisher_fate != "dead" else [])
    await _until(lambda: all(r.done for r in live), "every live peer done")

    status = joiner_role.status()
    assert status["state_via"] == "direct" and status["state_via_counts"]["relay"] == 0
    assert joiner_role.fetched[0]["round"] == 3 and not publisher.roles["diloco"].with_outer_state
    rows = {row["round"]: row for row in survivor.history}
    assert rows[3]["contributors"] == sorted(r.node.peer_id for r in live)  # the joiner's first round, not split
    assert len({r.status()["weights_digest"] for r in live}) == 1
    nursery.cancel_scope.cancel()
