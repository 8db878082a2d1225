"""The peer-table core behaves the same over real libp2p and in the simulator."""

import pytest
import trio

from p2pnet.identity import Identity
from p2pnet.messages import Capacity, Heartbeat
from p2pnet.wire import Codec
from tests.conformance.worlds import RealWorld, SimulatedWorld

NAMES = ["n0", "n1", "n2", "n3"]


@pytest.fixture(params=["real", "sim"])
async def world(request, tmp_path, nursery):
    if request.param == "real":
        w = RealWorld(tmp_path, nursery)
    else:
        w = SimulatedWorld()
    yield w
    if request.param == "real":
        for name in list(w.scopes):
            await w.stop(name)


def full(world, names):
    def check():
        return all({e.peer_id for e in world.table(n).peers()} == {world.peer_id(m) for m in names if m != n}
                   for n in names)
    return check


async def start_chain(world):
    await world.add(NAMES[0])
    for previous, name in zip(NAMES, NAMES[1:]):
        await world.add(name, bootstrap=previous)


async def test_peers_joined_in_a_chain_all_learn_each_other(world):
    await start_chain(world)
    await world.wait_until(full(world, NAMES), timeout_s=20)
    entry = world.table("n0").get(world.peer_id("n3"))
    assert entry.last_heard > 0 and entry.score == 0.0


async def test_a_stopped_peer_expires_from_every_table(world):
    await start_chain(world)
    await world.wait_until(full(world, NAMES), timeout_s=20)
    await world.stop("n2")
    gone = world.peer_id("n2")
    await world.wait_until(lambda: all(world.table(n).get(gone) is None for n in ("n0", "n1", "n3")), timeout_s=20)
    await world.wait_until(full(world, ["n0", "n1", "n3"]), timeout_s=20)


async def test_garbage_and_forgeries_cost_the_sender_until_it_is_banned(world):
    await world.add("n0")
    await world.add("n1", bootstrap="n0")
    await world.wait_until(full(world, ["n0", "n1"]), timeout_s=20)
    culprit = world.peer_id("n1")
    forged = Codec(Identity.from_seed_text("someone-else")).encode(
        Heartbeat(1, 1, (), "x:1", (), Capacity(0, 0, 0)), 0.0)  # signed, but stale by decades
    frames = [b"\x00garbage", forged[:-1] + bytes([forged[-1] ^ 1])] + [b"\xffjunk"] * 6
    for frame in frames:
        await world.send_frame("n1", "n0", frame)
    await world.wait_until(lambda: world.table("n0").is_banned(culprit, 0.0) or
                           world.table("n0").score(culprit) <= -5.0, timeout_s=20)
    assert world.table("n0").get(culprit) is None
