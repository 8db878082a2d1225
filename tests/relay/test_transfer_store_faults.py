"""The transfer core when our own store fails it: a chunk lost on disk, a version garbage-collected,
a full disk (requests held, nobody blamed). Pure and deterministic: no clock, no I/O."""

from p2pnet.core import Publish, SetTimer
from p2pnet.identity import Identity
from p2pnet.wire import Envelope
from relay.effects import Fetch, FetchFailure, FetchManifest, Penalise, VersionComplete
from relay.manifest import open_manifest
from relay.messages import HeldVersion, Holding
from relay.transfer import TIMER_TICK, TransferConfig, TransferCore
from simulations.broadcast import fake_manifest
from simulations.world import EPOCH_S

PUBLISHER = Identity.from_seed_text("publisher")
SIGNED = fake_manifest(PUBLISHER, 10 * 2**20, 2**20)
OLDER = fake_manifest(PUBLISHER, 4 * 2**20, 2**20, version=0)
FAST = TransferConfig(stall_timeout_s=2.0, exclude_s=6.0, announce_interval_s=3600.0)


def opener(frame: bytes, now: float):
    return open_manifest(frame, trusted_publishers={PUBLISHER.peer_id}, now_s=EPOCH_S + now)


def core(name: str = "me") -> TransferCore:
    c = TransferCore(FAST, name, open_frame=opener, self_upload_bps=1e8)
    c.set_members(0.0, {PUBLISHER.peer_id: 1e9, name: 1e8, "other": 1e8})
    return c


def envelope(sender: str, body) -> Envelope:
    return Envelope(body.KIND, sender, b"", 0, body, 0)


def fetches(effects) -> list[Fetch]:
    return [e for e in effects if isinstance(e, Fetch)]


def complete(c: TransferCore, effects, t: float = 0.0) -> tuple[float, list]:
    """Answer every fetch (and those they lead to) until nothing is asked; the time and effects."""
    seen, pending = [], fetches(effects)
    for _ in range(1000):
        if not pending:
            return t, seen
        f = pending.pop(0)
        t += 0.01
        out = c.fetched(t, f.peer, f.version, f.index, 0.01)
        seen += out
        pending += fetches(out)
    raise AssertionError("never finished")


def holding(c: TransferCore, now: float) -> list[int]:
    """The versions `c` announces as held on its next announce."""
    published = [e for e in c.on_timer(now, TIMER_TICK) if isinstance(e, Publish) and isinstance(e.body, Holding)]
    return [h.version for p in published for h in p.body.versions]


def test_a_chunk_lost_on_disk_makes_the_version_incomplete_until_it_is_fetched_again():
    c = core()
    t, _ = complete(c, c.manifest_frame(0.0, PUBLISHER.peer_id, SIGNED.frame))
    assert c.complete_versions() == [1] and holding(c, 4000.0) == [1]
    out = c.lost(4001.0, 1, 7)
    again = fetches(out)
    assert [f.index for f in again] == [7]  # fetched again at once
    assert c.complete_versions() == [] and not c.progress(4001.0, 1)["complete"]
    assert holding(c, 8000.0) == []  # not announced while incomplete
    assert c.lost(4001.0, 1, 7) == [] and c.lost(4001.0, 1, 99) == [] and c.lost(4001.0, 5, 0) == []
    _, told = complete(c, again, 8001.0)
    assert c.complete_versions() == [1]
    assert [e.event.version for e in told if isinstance(getattr(e, "event", None), VersionComplete)] == [1]
    assert holding(c, 12000.0) == [1]


def test_the_origin_that_loses_a_chunk_fetches_it_from_a_holder():
    c = TransferCore(FAST, PUBLISHER.peer_id, open_frame=opener, self_upload_bps=1e9)
    c.set_members(0.0, {PUBLISHER.peer_id: 1e9, "other": 1e8})
    c.publish(0.0, SIGNED)
    assert not fetches(c.lost(1.0, 1, 3))  # nobody else holds it yet: parked
    assert c.complete_versions() == []
    asked = fetches(c.on_message(2.0, envelope("other", Holding((HeldVersion(1, SIGNED.manifest_id),)))))
    assert [(f.peer, f.index) for f in asked] == [("other", 3)]
    c.fetched(3.0, "other", 1, 3, 0.1)
    assert c.complete_versions() == [1]


def test_a_collected_version_is_forgotten_and_never_fetched_again():
    c = core()
    complete(c, c.manifest_frame(0.0, PUBLISHER.peer_id, OLDER.frame))
    assert c.complete_versions() == [0]
    assert c.collected(0) == []
    assert c.complete_versions() == [] and not c.knows(0) and c.status(1.0)["versions"] == []
    # others still hold it: neither their Holding nor the manifest brings it back
    held = Holding((HeldVersion(0, OLDER.manifest_id),))
    assert not [e for e in c.on_message(2.0, envelope("other", held)) if isinstance(e, FetchManifest)]
    assert c.manifest_frame(3.0, "other", OLDER.frame) == [] and not c.knows(0)
    # a newer version is still taken
    assert fetches(c.manifest_frame(4.0, PUBLISHER.peer_id, SIGNED.frame))


def test_a_full_store_holds_new_requests_blames_nobody_and_resumes_at_the_end_of_the_hold():
    c = core()
    first = fetches(c.manifest_frame(0.0, PUBLISHER.peer_id, SIGNED.frame))
    assert first
    victim = first[0]
    c.hold_requests(0.1, 1.1)
    out = c.fetch_failed(0.1, victim.peer, 1, victim.index, FetchFailure.STORE_FULL)
    assert not fetches(out) and not [e for e in out if isinstance(e, Penalise)]
    # the other outstanding requests complete, but no new ones go out during the hold
    for f in first[1:]:
        assert not fetches(c.fetched(0.5, f.peer, f.version, f.index, 0.1))
    tick = c.on_timer(1.0, TIMER_TICK)
    assert not fetches(tick) and SetTimer(1.1, TIMER_TICK) in tick  # woken exactly when the hold ends
    resumed = fetches(c.on_timer(1.1, TIMER_TICK))
    assert victim.index in {f.index for f in resumed}
    again = [f for f in resumed if f.index == victim.index][0]
    assert again.peer == victim.peer  # not blamed: the same source may be asked again
    assert c.status(1.2)["excluded"] == [] and c.status(1.2)["banned"] == []
    complete(c, resumed, 1.2)
    assert c.complete_versions() == [1]


def test_lifting_a_hold_early_resumes_at_once():
    c = core()
    first = fetches(c.manifest_frame(0.0, PUBLISHER.peer_id, SIGNED.frame))
    c.hold_requests(0.0, 60.0)
    for f in first:
        c.fetch_failed(0.1, f.peer, 1, f.index, FetchFailure.STORE_FULL)
    assert not fetches(c.on_timer(30.0, TIMER_TICK))
    assert {f.index for f in fetches(c.hold_requests(31.0, 31.0))} >= {f.index for f in first}


def test_a_hold_on_one_version_holds_its_requests_alone_and_the_store_wide_lift_ends_it():
    """Our disk fails the writes of version 0's files only (the shell holds that version): version
    1 is fetched on meanwhile, and a tick comes when version 0's hold ends; lifting the hold on
    every version (the store takes writes again) lifts version 0's too."""
    c = core()
    older = fetches(c.manifest_frame(0.0, PUBLISHER.peer_id, OLDER.frame))
    assert older and {f.version for f in older} == {0}
    effects = c.hold_requests(0.1, 1.1, version=0)
    for f in older:
        effects += c.fetch_failed(0.1, f.peer, 0, f.index, FetchFailure.STORE_FAILED)
    assert not fetches(effects)
    newer = fetches(c.manifest_frame(0.2, PUBLISHER.peer_id, SIGNED.frame))
    assert newer and {f.version for f in newer} == {1}  # not held with version 0
    t, seen = complete(c, newer, 0.2)
    assert c.complete_versions() == [1] and {f.version for f in fetches(seen)} <= {1} and t < 1.1
    tick = c.on_timer(1.0, TIMER_TICK)
    assert not fetches(tick) and SetTimer(1.1, TIMER_TICK) in tick  # woken when version 0's hold ends
    assert {f.index for f in fetches(c.on_timer(1.1, TIMER_TICK))} == {f.index for f in older}

    c = core()
    older = fetches(c.manifest_frame(0.0, PUBLISHER.peer_id, OLDER.frame))
    c.hold_requests(0.0, 60.0, version=0)
    for f in older:
        c.fetch_failed(0.1, f.peer, 0, f.index, FetchFailure.STORE_FAILED)
    assert not fetches(c.on_timer(30.0, TIMER_TICK))
    assert {f.index for f in fetches(c.hold_requests(31.0, 31.0))} == {f.index for f in older}


def test_a_chunk_our_disk_failed_to_keep_blames_nobody_and_is_fetched_again():
    c = core()
    first = fetches(c.manifest_frame(0.0, PUBLISHER.peer_id, SIGNED.frame))
    victim = first[0]
    out = c.fetch_failed(0.1, victim.peer, 1, victim.index, FetchFailure.STORE_FAILED)
    again = [f for f in fetches(out) if f.index == victim.index]
    assert again and again[0].peer == victim.peer  # the same source may be asked again at once
    assert not [e for e in out if isinstance(e, Penalise)] and c.status(0.2)["excluded"] == []
    assert c._versions[1].tried == {}
