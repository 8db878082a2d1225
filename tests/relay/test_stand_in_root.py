"""A stripe whose root, its only forwarder, is lost (killed or banned) under a capped origin
re-forms through one stand-in (`relay.sources`, `_stand_in`): the first of the root's children
in an order drawn per version takes the stripe from the origin and the others from it, instead of every child
taking it from the origin (real relays under a 3 MB/s origin, one root killed and one banned:
2.38 copies from the origin, 1.16 with the stand-in). The transfer core alone, one per relay;
`tests/relay/test_relay_processes.py` kills roots of real relay processes."""

import pytest

from p2pnet.identity import Identity
from p2pnet.wire import Envelope
from relay.effects import DropSource, Fetch, FetchFailure
from relay.manifest import SignedManifest, open_manifest
from relay.messages import ManifestAnnounce
from relay.planner import Membership, StripePlan
from relay.sources import stand_in_key
from relay.transfer import TransferConfig, TransferCore
from simulations.broadcast import fake_manifest
from simulations.world import EPOCH_S

PUBLISHER = Identity.from_seed_text("capped origin, lost root")
ORIGIN = PUBLISHER.peer_id
RELAYS = [f"r{i}" for i in range(7)]
CONFIG = TransferConfig(stall_timeout_s=3.0, exclude_s=60.0, announce_interval_s=3600.0)
SIGNED = fake_manifest(PUBLISHER, 4 * 2**20, 64 * 1024)


def capped_relay(me: str, signed: SignedManifest, config: TransferConfig) -> tuple[TransferCore, list[Fetch]]:
    """Relay `me` of `RELAYS` under `signed`'s publisher capped at 3 MB/s (a stripe each, every
    root its stripe's only forwarder): its core and first fetches of `signed`'s version 1."""
    origin = signed.publisher
    members = Membership.of({origin: 3e6, **dict.fromkeys(RELAYS, 1e9)})

    def opener(frame: bytes, now: float):
        return open_manifest(frame, trusted_publishers={origin}, now_s=EPOCH_S + now)

    core = TransferCore(config, me, open_frame=opener, self_upload_bps=1e9)
    core.set_members(0.0, members)
    announce = Envelope(ManifestAnnounce.KIND, origin, b"", 0, ManifestAnnounce(signed.frame), 0)
    pending = [e for e in core.on_message(0.0, announce) if isinstance(e, Fetch)]
    plan = core._versions[1].plan
    assert plan.stripes == 7 and all(len(plan.ranked_interior(s)) == 1 for s in range(7))
    return core, pending


def _relay(me: str) -> tuple[TransferCore, list[Fetch]]:
    """Relay `me` of 7 under the capped origin: a 4 MiB version in 64 KiB chunks."""
    return capped_relay(me, SIGNED, CONFIG)


def _drawn(plan: StripePlan, stripe: int) -> tuple[str, list[str]]:
    """`stripe`'s lone root and its children in the order they stand in for it (`stand_in_key`)."""
    root = plan.ranked_interior(stripe)[0][0]
    return root, sorted(plan.children(stripe, root), key=lambda p: stand_in_key(SIGNED.manifest_id, p))


def _asked_again(me: str, stripe: int, failure: FetchFailure) -> set[str]:
    """Whom relay `me` asks for `stripe`'s chunks once every fetch from its lost root failed."""
    core, pending = _relay(me)
    plan = core._versions[1].plan
    root = plan.ranked_interior(stripe)[0][0]
    again = []
    for f in [f for f in pending if f.peer == root]:
        again += [e for e in core.fetch_failed(0.5, root, 1, f.index, failure) if isinstance(e, Fetch)]
    return {f.peer for f in again if plan.stripe_of_chunk[f.index] == stripe}


@pytest.mark.parametrize("failure", [FetchFailure.UNREACHABLE, FetchFailure.CORRUPT])
def test_the_children_of_a_lost_lone_root_take_its_stripe_from_one_stand_in_that_asks_the_origin(failure):
    """Every child of the lost root fails a fetch from it (`unreachable`: killed; `corrupt`:
    banned) and asks again for the stripe's chunks: the first child in the drawn order asks the
    origin, every other child asks that child. Before, each of the 6 asked the origin."""
    plan = _relay(RELAYS[0])[0]._versions[1].plan
    stripe = plan.home[RELAYS[3]]
    root, children = _drawn(plan, stripe)
    assert sorted(children) == sorted(set(RELAYS) - {root})
    asked = {me: _asked_again(me, stripe, failure) for me in children}
    stand_in = children[0]
    assert asked == {me: {ORIGIN} if me == stand_in else {stand_in} for me in children}


def test_the_stand_ins_are_drawn_per_version_not_the_lowest_peer_id():
    """Each stripe's root lost in turn: its stand-in is the first of its children in the
    version's draw, so a peer whose id sorts first (one can be ground) is not the stand-in of
    every version. In peer id order "r0" stood in for the 6 stripes it is a child in."""
    plan = _relay(RELAYS[0])[0]._versions[1].plan
    stand_ins = {}
    for stripe in range(plan.stripes):
        root, children = _drawn(plan, stripe)
        assert _asked_again(children[-1], stripe, FetchFailure.UNREACHABLE) == {children[0]}
        stand_ins[stripe] = children[0]
    assert stand_ins != {s: min(_drawn(plan, s)[1]) for s in range(plan.stripes)}


def test_a_child_that_saw_the_stand_in_fail_too_takes_the_stripe_from_the_next_child_or_the_origin():
    """The stand-in (first child in the draw) is lost as well: the second child, with nobody
    left before it, asks the origin; the third asks the second."""
    plan = _relay(RELAYS[0])[0]._versions[1].plan
    stripe = plan.home[RELAYS[3]]
    root, children = _drawn(plan, stripe)
    first, second, third = children[:3]
    for me, want in ((second, ORIGIN), (third, second)):
        core, pending = _relay(me)
        core.fetch_failed(0.5, first, 1, next(f.index for f in pending if f.peer == first), FetchFailure.UNREACHABLE)
        again = []
        for f in [f for f in pending if f.peer == root]:
            again += [e for e in core.fetch_failed(0.6, root, 1, f.index, FetchFailure.UNREACHABLE)
                      if isinstance(e, Fetch)]
        assert {f.peer for f in again if plan.stripe_of_chunk[f.index] == stripe} == {want}, me


def test_a_child_whose_stand_in_stalls_drops_it_and_takes_the_stripe_from_the_next_child():
    """The stand-in (first child in the draw) hangs: it takes our requests, its own stripe's
    and the lost one's, and never answers, while our other sources deliver: after the stall
    timeout we drop it and ask the next child before us (the third child asks the second), not
    the origin while the second is usable."""
    plan = _relay(RELAYS[0])[0]._versions[1].plan
    stripe = plan.home[RELAYS[3]]
    root, children = _drawn(plan, stripe)
    first, second, third = children[:3]
    core, pending = _relay(third)
    out = []
    for f in [f for f in pending if f.peer == root]:
        out += core.fetch_failed(0.5, root, 1, f.index, FetchFailure.UNREACHABLE)
    assert {f.peer for f in out if isinstance(f, Fetch) and plan.stripe_of_chunk[f.index] == stripe} == {first}
    delivered = 0.5 + CONFIG.stall_timeout_s - 0.1  # every other source answers in time (new asks go out)
    for f in [f for f in pending if f.peer not in (root, first)]:
        core.fetched(delivered, f.peer, 1, f.index, 0.02, 0.0)
    effects = core.on_timer(0.5 + CONFIG.stall_timeout_s + 0.01, "relay/tick")
    assert [e.peer for e in effects if isinstance(e, DropSource)] == [first]
    again = {f.peer for f in effects if isinstance(f, Fetch) and plan.stripe_of_chunk[f.index] == stripe}
    assert again == {second}
