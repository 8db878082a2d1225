"""The transfer core's in-flight budget (`max_in_flight`, shared by every version): a request
whose chunk came another way is no longer counted, and what one version frees goes to the
versions still in progress at once, newest first, not on the next tick."""

from p2pnet.identity import Identity
from p2pnet.wire import Envelope
from relay.effects import DropSource, Fetch, FetchFailure
from relay.manifest import open_manifest
from relay.messages import ManifestAnnounce
from relay.transfer import TransferConfig, TransferCore
from simulations.broadcast import fake_manifest
from simulations.world import EPOCH_S

PUBLISHER = Identity.from_seed_text("publisher")
FAST = TransferConfig(stall_timeout_s=2.0, exclude_s=6.0, announce_interval_s=3600.0)
MEMBERS = {PUBLISHER.peer_id: 1e9, "me": 1e8, **{f"m{i}": 1e8 for i in range(8)}}


def opener(frame: bytes, now: float):
    return open_manifest(frame, trusted_publishers={PUBLISHER.peer_id}, now_s=EPOCH_S + now)


def core(config: TransferConfig = FAST) -> TransferCore:
    c = TransferCore(config, "me", open_frame=opener, self_upload_bps=1e8)
    c.set_members(0.0, MEMBERS)
    return c


def announce(c: TransferCore, now: float, signed) -> list[Fetch]:
    envelope = Envelope(ManifestAnnounce.KIND, PUBLISHER.peer_id, b"", 0, ManifestAnnounce(signed.frame), 0)
    return fetches(c.on_message(now, envelope))


def fetches(effects) -> list[Fetch]:
    return [e for e in effects if isinstance(e, Fetch)]


def test_a_request_asked_again_elsewhere_is_settled_when_the_first_source_delivers_the_chunk():
    """A source dropped as stalled had one chunk received whole, which the shell still stores and
    tells (`relay.upstream`) after the core asked another source for it; that other source hangs
    and never answers. The version is complete, nothing of it is awaited any more, and the next
    version gets the whole budget (before, the hung request held a slot of it for as long as
    the complete version was kept: a complete version is never checked for stalls)."""
    c = core()
    v1 = fake_manifest(PUBLISHER, 10 * 2**20, 2**20)
    pending = announce(c, 0.0, v1)
    stalled = next(f for f in pending if f.peer != PUBLISHER.peer_id)
    pending.remove(stalled)
    while pending:  # every other chunk arrives
        f = pending.pop()
        pending += [g for g in fetches(c.fetched(0.5, f.peer, 1, f.index, 0.1)) if g.index != stalled.index]
    effects = c.on_timer(3.0, "relay/tick")  # past the stall timeout
    assert [e.peer for e in effects if isinstance(e, DropSource)] == [stalled.peer]
    (again,) = [f for f in fetches(effects) if f.index == stalled.index]
    assert again.peer != stalled.peer

    c.fetched(3.1, stalled.peer, 1, stalled.index, 0.1)  # received whole before the drop; `again.peer` hangs
    assert c.complete_versions() == [1]
    assert c.progress(3.1, 1)["in_flight"] == 0 and c.progress(3.1, 1)["sources"] == []
    c.fetched(50.0, again.peer, 1, stalled.index, 0.1)  # an answer after all: taken as any late one
    assert c.progress(50.0, 1)["in_flight"] == 0

    v2 = fake_manifest(PUBLISHER, 64 * 2**20, 2**20, version=2)
    assert len(announce(c, 100.0, v2)) == FAST.max_in_flight


def test_a_chunk_delivered_by_a_dropped_source_is_no_longer_asked_of_the_one_asked_in_its_place():
    """The same while the version is still in progress: the chunk is asked of nobody any more
    (`asking`; the serving core refuses at once a request for a chunk from the peer we ask for
    it), so the source asked in its place has no request of ours left for it to answer."""
    c = core()
    pending = announce(c, 0.0, fake_manifest(PUBLISHER, 64 * 2**20, 2**20))
    dropped = next(f for f in pending if f.peer != PUBLISHER.peer_id)
    other = next(f for f in pending if f.peer == dropped.peer and f.index != dropped.index)
    effects = c.fetch_failed(0.1, dropped.peer, 1, other.index, FetchFailure.UNREACHABLE)
    (again,) = [f for f in fetches(effects) if f.index == dropped.index]
    assert c.asking(1, dropped.index) == again.peer != dropped.peer

    c.fetched(0.2, dropped.peer, 1, dropped.index, 0.1)  # received whole before it was dropped
    assert c.asking(1, dropped.index) is None and not c.complete_versions()


def test_budget_one_version_frees_goes_at_once_to_the_newest_version_waiting_for_it():
    """Version 2 comes while version 1 holds the whole budget: it asks for nothing then, and the
    first answer for version 1 frees a slot it takes (newest first, as on the tick); then each
    version takes what the other frees. Both complete with no tick at all (before, version 2
    asked nothing until the core's next tick, `stall_timeout_s / 4`, 7.5 s by default, with
    version 1 long done and nothing in flight)."""
    c = core(TransferConfig(announce_interval_s=3600.0))
    pending = announce(c, 0.0, fake_manifest(PUBLISHER, 64 * 2**20, 2**20, version=1))
    assert len(pending) == c.config.max_in_flight
    assert announce(c, 0.1, fake_manifest(PUBLISHER, 64 * 2**20, 2**20, version=2)) == []

    first = pending.pop(0)
    answered = fetches(c.fetched(0.2, first.peer, 1, first.index, 0.005, 0.0))
    assert [f.version for f in answered] == [2]
    pending += answered
    t = 0.2
    while pending:
        f = pending.pop(0)
        t += 0.01
        pending += fetches(c.fetched(t, f.peer, f.version, f.index, 0.005, 0.0))
        assert c.progress(t, 1)["in_flight"] + c.progress(t, 2)["in_flight"] <= c.config.max_in_flight
    assert c.complete_versions() == [1, 2]
