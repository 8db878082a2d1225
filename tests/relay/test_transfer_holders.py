"""Holders of a version (`relay.announce`): a `Holding` needs no heartbeat, so made-up identities
cannot be kept without bound, and never put out a member or a peer that delivered us chunks."""

from p2pnet.identity import Identity
from p2pnet.wire import Envelope
from relay.announce import MAX_HOLDERS
from relay.effects import DropReason, Fetch
from relay.manifest import open_manifest
from relay.messages import HeldVersion, Holding, ManifestAnnounce
from relay.transfer import TransferConfig, TransferCore
from simulations.broadcast import fake_manifest
from simulations.world import EPOCH_S

PUBLISHER = Identity.from_seed_text("publisher")
FAST = TransferConfig(stall_timeout_s=2.0, exclude_s=6.0, announce_interval_s=3600.0)
SIGNED = fake_manifest(PUBLISHER, 64 * 2**20, 2**20)
HELD = Holding((HeldVersion(1, SIGNED.manifest_id),))


def opener(frame: bytes, now: float):
    return open_manifest(frame, trusted_publishers={PUBLISHER.peer_id}, now_s=EPOCH_S + now)


def envelope(sender: str, body) -> Envelope:
    return Envelope(body.KIND, sender, b"", 0, body, 0)


def started() -> tuple[TransferCore, list[Fetch]]:
    c = TransferCore(FAST, "me", open_frame=opener, self_upload_bps=1e8)
    c.set_members(0.0, {PUBLISHER.peer_id: 1e9, "me": 1e8, "member": 1e8, **{f"m{i}": 1e8 for i in range(8)}})
    return c, [e for e in c.on_message(0.0, envelope(PUBLISHER.peer_id, ManifestAnnounce(SIGNED.frame)))
               if isinstance(e, Fetch)]


def test_a_flood_of_made_up_holders_is_kept_within_a_bound_and_puts_out_no_member_or_measured_peer():
    """Thousands of identities that never sent a heartbeat each say they hold the version: at
    most `MAX_HOLDERS` are kept (before, all of them, 10 MiB per 100,000, walked by every request
    past our chain). A member that then says so is still a holder, in a stranger's place; a peer
    that delivered us a chunk (measured) too, and is the holder asked first once our chain
    fails us."""
    c, first = started()
    measured = "stranger-that-delivered"
    c.fetched(0.1, measured, 1, first[0].index, 0.01)  # a chunk from it (the shell's store tells it)
    for k in range(3 * MAX_HOLDERS):
        c.on_message(0.2, envelope(f"sybil{k:05d}", HELD))
    assert c.progress(0.2, 1)["holders"] == MAX_HOLDERS

    c.on_message(0.3, envelope("member", HELD))
    c.on_message(0.3, envelope(measured, HELD))
    assert c.progress(0.3, 1)["holders"] == MAX_HOLDERS
    for k in range(MAX_HOLDERS):  # more strangers put out neither
        c.on_message(0.4, envelope(f"late{k:05d}", HELD))
    assert {"member", measured} <= c._versions[1].holders

    f = next(f for f in first if f.peer != PUBLISHER.peer_id and f.index != first[0].index)
    plan = c._versions[1].plan
    for peer in plan.ancestors(plan.stripe_of_chunk[f.index], "me"):  # our whole chain fails us
        c._exclude(0.5, peer, DropReason.UNREACHABLE, [])
    effects = c.on_timer(0.5, "relay/tick")
    assert [e.peer for e in effects if isinstance(e, Fetch) and e.index == f.index] == [measured]
