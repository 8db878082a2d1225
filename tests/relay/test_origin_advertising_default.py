"""A trainer that advertises the default upload (1 GB/s: it never measured its uplink) on a capped
uplink, among relays that advertise their real caps: the plan takes it for the fastest member by
far and makes it the parent of nearly every member in every stripe, and it served a copy to each
(the lab, 6 relays of 28-46 MB/s under a 3 MB/s origin, 24 MiB: 42.8-45.6 s and 5.00 copies).
Its children now judge it against what the stripe's forwarders could give them and take the
stripe from a forwarder when it delivers under half of that (`relay.judging`,
`_origin_feeds_too_little`; `relay.sources`, `_leave_origin`). The simulator with the real
transfer cores, its links capped as the lab's; `tests/relay/test_capped_origin_processes.py` has
real relay processes under a capped origin."""

from __future__ import annotations

import random

import pytest

from relay.effects import SourceDropped
from relay.planner import Membership
from relay.serving import ByteBudget
from relay.transfer import TransferConfig
from simulations.broadcast import MBIT, BroadcastSim, build_broadcast, run_broadcast_sim

DEFAULT_BPS = 1e9  # `p2pnet.node.NodeConfig.upload_bps`: what a peer started without `--upload-bps` advertises
CONFIG = TransferConfig(stall_timeout_s=30.0, exclude_s=60.0, announce_interval_s=1.0, max_in_flight=16)


def _world(relays: int, upload_mbit: tuple[float, float], origin_mbit: float, origin_advertises: float | None,
           lying: dict[int, tuple[float | None, float]] | None = None, mib: int = 24,
           config: TransferConfig = CONFIG) -> BroadcastSim:
    """The lab's world in the simulator: `relays` relays with uploads drawn from `upload_mbit`
    (seed 1) and 4x as much download, each advertising its upload, under an origin whose link
    carries `origin_mbit` and that advertises `origin_advertises` (None: its link); `lying`:
    relay index -> (what it advertises, None: its drawn upload; what its link carries), bytes/s. `mib` MiB in 64 KiB
    chunks, not yet published."""
    rng = random.Random(1)
    ups = [round(rng.uniform(*upload_mbit), 1) * MBIT for _ in range(relays)]
    drawn, downs = iter(ups), iter([4 * u for u in ups])
    sim = build_broadcast(relays, mib * 2**20, upload_bps=lambda r: next(drawn), origin_upload_bps=origin_mbit * MBIT,
                          download_bps=lambda r: next(downs), strategy="relay", chunk_bytes=64 * 1024,
                          latency_s=0.0002, config=config, pace_uploads=True)
    advertised = dict(sim.uploads)
    if origin_advertises is not None:
        advertised[sim.origin] = origin_advertises
    for index, (claim, real_bps) in (lying or {}).items():
        peer = sim.peer_ids[index]
        advertised[peer] = claim if claim is not None else sim.uploads[peer]
        port = sim.world.ports[peer]
        port.upload_bps, port.budget = real_bps, ByteBudget(real_bps)  # its link and its pacing
    members = Membership.of(advertised)
    for peer, core in sim.cores.items():
        sim.world.apply(peer, core.set_members(0.0, members))
    return sim


def _origin_copies(sim: BroadcastSim) -> float:
    return sim.world.ports[sim.origin].bytes_up / sim.signed.manifest.total_bytes


def _origin_children(sim: BroadcastSim) -> float:
    """The share of (member, stripe) pairs in which the plan makes the origin the member's parent."""
    plan = sim.cores[sim.peer_ids[0]]._versions[1].plan
    pairs = [(p, s) for p in sim.peer_ids for s in range(plan.stripes)]
    return sum(plan.parent[s][p] == sim.origin for p, s in pairs) / len(pairs)


@pytest.mark.parametrize("relays, upload_mbit, most", [
    (6, (200.0, 400.0), 1.3),  # the lab's world: 5.00 copies before
    (16, (25.0, 200.0), 2.0),  # slower relays, two stripes with no forwarder in the plan: 13.46 copies before
])
def test_an_origin_advertising_the_default_on_a_capped_uplink_serves_about_one_copy(relays, upload_mbit, most):
    """The origin's link carries 3 MB/s (24 Mbit/s) and it advertises 1 GB/s; the relays tell
    their uploads. The plan makes it the parent of most members in every stripe; they leave it,
    stripe by stripe, for the stripe's forwarders once they have timed 3 of its chunks (where
    the plan gave a stripe no forwarder, for the member whose home stripe it is). What it
    served beyond one copy is mostly the requests every relay sent it before that (the 16 relays
    without the home members as forwarders: 3.10 copies)."""
    sim = _world(relays, upload_mbit, 24.0, DEFAULT_BPS)
    run_broadcast_sim(sim)
    assert _origin_children(sim) > 0.6
    assert sim.done()
    assert _origin_copies(sim) < most


def test_an_origin_that_delivers_what_it_advertises_stays_every_members_parent():
    """A datacenter origin (1 GB/s, told the truth) among the same 6 relays feeds each child
    faster than the stripe's forwarders could: the plan makes it the parent of most members in
    every stripe, and every member keeps its planned parents to the end (it serves 5 copies, as
    planned, and the broadcast takes its bytes' time on the relays' downloads)."""
    sim = _world(6, (200.0, 400.0), 8000.0, None)
    run_broadcast_sim(sim)
    assert _origin_children(sim) > 0.6
    for peer in sim.peer_ids:
        v = sim.cores[peer]._versions[1]
        assert [chain[0] for chain in v.chains] == [v.plan.parent[s][peer] for s in range(v.plan.stripes)], peer
    assert _origin_copies(sim) > 4.5


def _forwarder_sending(real_bps: float) -> tuple[BroadcastSim, str, int, list[str]]:
    """The 6 relays under the origin advertising the default, one of them (its stripe's only
    forwarder, 44 MB/s advertised) sending `real_bps`, run to the end: the sim, that relay, its
    stripe and the members the plan made children of the origin there."""
    sim = _world(6, (200.0, 400.0), 24.0, DEFAULT_BPS, lying={2: (None, real_bps)})
    liar = sim.peer_ids[2]
    run_broadcast_sim(sim)
    assert sim.done()
    plan = sim.cores[sim.peer_ids[0]]._versions[1].plan
    stripe = plan.home[liar]
    assert [p for p, _ in plan.ranked_interior(stripe)] == [liar]
    borrowed = [p for p in sim.peer_ids if p != liar and plan.parent[stripe][p] == sim.origin]
    assert len(borrowed) >= 3
    return sim, liar, stripe, borrowed


def test_a_forwarder_taken_in_place_of_the_origin_that_delivers_too_little_gives_the_stripe_back():
    """Under the origin advertising the default, a relay advertises its drawn upload (44 MB/s,
    its stripe's only forwarder) and its link carries 0.2 MB/s. The members the plan made
    children of the origin in its stripe leave the origin for it, judge it slow and take that
    stripe from the origin again, their planned parent (`relay.sources`, `_replaceable`):
    nobody keeps it as its source, whereas without the origin counted as its replacement they
    could not drop it and kept it to the end."""
    sim, liar, stripe, borrowed = _forwarder_sending(0.2e6)
    assert [p for p in borrowed if sim.cores[p]._versions[1].chains[stripe][0] == liar] == []
    assert all(liar in sim.cores[p]._slow for p in borrowed)


def test_home_members_of_a_stripe_with_no_forwarder_keep_the_origin():
    """4 relays of 3-25 MB/s in 2 stripes under the origin advertising the default: its claim
    outweighs every member, so the plan gives each stripe no forwarder and two home members,
    both children of the origin. The members of the other stripe leave the origin for them;
    they keep taking their home stripe from the origin whatever it delivers (`relay.sources`,
    `_forwarders`: all of them keepers). Were each to leave it for the other, each would wait
    on a stripe the other never gets until the stall rule dropped it, and both would finish
    their home stripe from a source that has none of it (the chain's head stays the other)."""
    config = TransferConfig(stall_timeout_s=30.0, exclude_s=60.0, announce_interval_s=1.0, max_in_flight=16, stripes=2)
    sim = _world(4, (25.0, 200.0), 24.0, DEFAULT_BPS, mib=8, config=config)
    run_broadcast_sim(sim)
    assert sim.done()
    plan = sim.cores[sim.peer_ids[0]]._versions[1].plan
    assert plan.stripes == 2 and all(plan.ranked_interior(s) == () for s in range(2))
    for s in range(2):
        home = [p for p in sim.peer_ids if plan.home[p] == s]
        assert len(home) == 2
        for peer in home:
            assert sim.cores[peer]._versions[1].chains[s][0] == sim.origin, (peer, s)
            assert not any(p in sim.cores[peer]._excluded for p in home), (peer, s)
    others_borrowed = [p for p in sim.peer_ids if sim.cores[p]._versions[1].chains[1 - plan.home[p]][0] != sim.origin]
    assert others_borrowed  # the rule did fire for the members of the other stripe


def test_a_forwarder_taken_in_place_of_the_origin_is_judged_on_its_first_chunk():
    """The same world with the forwarder's link at 20 KB/s, advertising its drawn 44 MB/s: the
    members that left the origin for it judge it against what the origin delivered them, from
    its first chunk (`relay.judging`, `_short_of_origin`) and take the stripe from the origin
    again. Judged as any parent, after 3 chunks shared by the 5 members that moved to it, each
    waited 38-55 s on it, and the version took 55.3 s instead of 43.3 s with the origin kept
    (38.8 s judged from its first chunk; 25.7 s asked one chunk at a time until then, below)."""
    sim, liar, stripe, borrowed = _forwarder_sending(20e3)
    for peer in borrowed:
        core = sim.cores[peer]
        assert liar in core._slow and core._versions[1].chains[stripe][0] != liar, peer
        assert core._samples[liar] < 3, peer  # (chunks it timed from the liar)



def test_a_silent_forwarder_taken_in_place_of_the_origin_is_not_asked_again_when_its_exclusion_ends():
    """The same world with the forwarder's link at 1 byte/s (it sends nothing), the stall
    timeout 5 s and exclusions 10 s, so the version outlasts its exclusion: the members that left
    the origin for it drop it as stalled once, and take the stripe from the origin from then on
    (`relay.failures`, `_forsake`): it is not taken in the origin's place again in this plan.
    Before, the chain kept it in front of the origin, and each asked it again when its exclusion
    ended and waited on it another stall timeout (dropped twice each)."""
    config = TransferConfig(stall_timeout_s=5.0, exclude_s=10.0, announce_interval_s=1.0, max_in_flight=16)
    sim = _world(6, (200.0, 400.0), 24.0, DEFAULT_BPS, lying={2: (None, 1.0)}, config=config)
    liar = sim.peer_ids[2]
    drops: dict[str, int] = {}
    sim.world.listeners.append(lambda now, peer, event: drops.__setitem__(peer, drops.get(peer, 0) + 1)
                               if isinstance(event, SourceDropped) and event.peer == liar else None)
    run_broadcast_sim(sim)
    assert sim.done()
    plan = sim.cores[sim.peer_ids[0]]._versions[1].plan
    stripe = plan.home[liar]
    borrowed = [p for p in sim.peer_ids if p != liar and plan.parent[stripe][p] == sim.origin]
    assert len(borrowed) >= 3
    # (it outlasts a drop, the exclusion and one more stall timeout)
    last = max(sim.cores[p]._versions[1].completed_at for p in sim.peer_ids)
    assert last > 2 * config.stall_timeout_s + config.exclude_s
    assert {p: drops.get(p) for p in borrowed} == dict.fromkeys(borrowed, 1)


def test_a_forwarder_taken_in_place_of_the_origin_is_asked_one_chunk_until_it_is_timed():
    """The forwarder's link at 20 KB/s: each member that leaves the origin for it asks it for one
    chunk, not a window of them, until it timed one (`relay.requests`, `_window`), and then judges
    it slow: it took one chunk's worth of the forwarder's upload from the member it feeds by the
    plan, not two (the version: 38.8 s -> 25.7 s in the simulator, 5 of the 6 relays at 20 KB/s
    251.7 -> 235.3 s)."""
    sim = _world(6, (200.0, 400.0), 24.0, DEFAULT_BPS, lying={2: (None, 20e3)})
    liar = sim.peer_ids[2]
    asked: dict[str, int] = {}
    fetch = sim.world._fetch

    def counted(peer, index, effect):  # (an observer: every fetch goes on as it would)
        if effect.peer == liar:
            asked[peer.peer_id] = asked.get(peer.peer_id, 0) + 1
        return fetch(peer, index, effect)

    sim.world._fetch = counted
    run_broadcast_sim(sim)
    assert sim.done()
    plan = sim.cores[sim.peer_ids[0]]._versions[1].plan
    borrowed = [p for p in sim.peer_ids if p != liar and plan.parent[plan.home[liar]][p] == sim.origin]
    assert len(borrowed) >= 3
    assert {p: asked.get(p) for p in borrowed} == dict.fromkeys(borrowed, 1)
    assert all(liar in sim.cores[p]._slow for p in borrowed)


def _cut_from_borrowers(sim: BroadcastSim, liar: str, at: float, for_s: float) -> set[str]:
    """At `at`, cut `liar`'s data plane to the members that borrow it in place of the origin (the
    members the plan made children of the origin in its home stripe) for `for_s` seconds: their
    requests to it are never answered (lost: the simulator's partition), its flows, queued and paced
    answers to them go silent; the rest of the world, its own feed included, as it was. Returns
    those members (filled in at `at`)."""
    world, borrowers = sim.world, set()
    cut: set[str] = set()
    arrives = world._arrives  # (the engine's callback for a request reaching its source)

    def unanswered(request):  # (every other request goes on as it would)
        return None if request.fetch.peer == liar and request.sink in cut else arrives(request)

    def start() -> None:
        plan = sim.cores[sim.peer_ids[0]]._versions[1].plan
        borrowers.update(p for p in sim.peer_ids if p != liar and plan.parent[plan.home[liar]][p] == sim.origin)
        cut.update(borrowers)
        port = world.ports[liar]
        for sink in sorted(port.serving.requesters()):
            if sink in cut:
                port.serving.drop_peer(sink)
        for request in [r for r in port.paced if r.sink in cut]:
            world._cancel_paced(port, request)
        for flow in [f for f in port.up if f.request.sink in cut]:
            world._end_flow(flow)
            world._done(flow)
        world.engine.at(at + for_s, cut.clear)

    world._arrives = unanswered
    world.engine.at(at, start)
    return borrowers


@pytest.mark.parametrize("cut_s, dropped", [(3.0, 1), (1e9, 2)])
def test_a_forwarder_taken_in_place_of_the_origin_that_stalls_after_it_delivered_is_taken_again(cut_s, dropped):
    """The same world, the forwarder honest, the stall timeout 5 s and exclusions 10 s: 3 s into
    the version its data plane to the members that left the origin for it is cut. Those members
    had timed its chunks: they drop it as stalled, take the stripe from the origin while it is
    excluded, and take it from the forwarder again when its exclusion ends (`relay.failures`,
    `_forsake`: a stall after it delivered is excused once). Forsaken at once, they took the stripe
    from the capped origin for the rest of the version (192 MiB: 74.0 -> 113.3 s, 1.10 -> 1.69
    origin copies). Cut for good, it delivers nothing more: each drops it again when it stalls
    again, and then forsakes it (not dropped every exclusion)."""
    config = TransferConfig(stall_timeout_s=5.0, exclude_s=10.0, announce_interval_s=1.0, max_in_flight=16)
    sim = _world(6, (200.0, 400.0), 24.0, DEFAULT_BPS, mib=96, config=config)
    liar = sim.peer_ids[2]
    borrowers = _cut_from_borrowers(sim, liar, 3.0, cut_s)
    drops: dict[str, list[float]] = {}
    asked: dict[str, list[float]] = {}
    sim.world.listeners.append(lambda now, peer, event: drops.setdefault(peer, []).append(now)
                               if isinstance(event, SourceDropped) and event.peer == liar else None)
    fetch = sim.world._fetch

    def counted(peer, index, effect):  # (an observer: every fetch goes on as it would)
        if effect.peer == liar:
            asked.setdefault(peer.peer_id, []).append(sim.world.engine.now)
        return fetch(peer, index, effect)

    sim.world._fetch = counted
    run_broadcast_sim(sim)
    assert sim.done()
    assert len(borrowers) >= 3
    for peer in borrowers:
        assert len(drops.get(peer, [])) == dropped, peer
        first = drops[peer][0]
        assert any(t < first for t in asked[peer]), peer  # (it had taken the stripe from the forwarder)
        again = [t for t in asked[peer] if t > first]
        assert again and min(again) >= first + config.exclude_s, peer  # taken again once its exclusion ended
        v = sim.cores[peer]._versions[1]
        stripe = v.plan.home[liar]
        assert ((liar, stripe) in v.forsaken) == (dropped == 2), peer
    if dropped == 1:
        assert _origin_copies(sim) < 1.3


def test_home_members_of_a_stripe_with_no_forwarder_are_forsaken_each_in_turn():
    """The 4-relay world above (2 stripes, no forwarder in the plan, 32 MiB), both home members of
    stripe 0 silent (their links at 1 byte/s), the stall timeout 5 s and exclusions 3 s: the members
    of the other stripe leave the origin for the first home member (`relay.sources`,
    `_leave_origin`: the plan has no interior member there), drop it as stalled (6 s), leave the
    origin for the second, drop it too (12 s), and take the stripe from the origin from then on:
    each dropped once by each of them, the version whole by 33.7 s. With the forsaken not passed
    over among the home members, each was taken again when its exclusion ended, in turn, and the
    version took 762 s."""
    config = TransferConfig(stall_timeout_s=5.0, exclude_s=3.0, announce_interval_s=1.0, max_in_flight=16, stripes=2)
    sim = _world(4, (25.0, 200.0), 24.0, DEFAULT_BPS, mib=32, config=config, lying={0: (None, 1.0), 1: (None, 1.0)})
    silent = sim.peer_ids[:2]
    drops: dict[tuple[str, str], int] = {}

    def dropped(now: float, peer: str, event: object) -> None:
        if isinstance(event, SourceDropped) and event.peer in silent:
            drops[(peer, event.peer)] = drops.get((peer, event.peer), 0) + 1

    sim.world.listeners.append(dropped)
    run_broadcast_sim(sim)
    assert sim.done()
    plan = sim.cores[sim.peer_ids[0]]._versions[1].plan
    assert plan.ranked_interior(0) == () and {p for p in sim.peer_ids if plan.home[p] == 0} == set(silent)
    borrowers = [p for p in sim.peer_ids if p not in silent]
    assert drops == {(p, s): 1 for p in borrowers for s in silent}
