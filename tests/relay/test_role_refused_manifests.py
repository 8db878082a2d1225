"""Manifests our store will not keep, in virtual time (MockClock): one it refuses for good (it
holds another manifest for the version: an equivocating publisher's) is taken no more, so a new
announce of it costs nothing and logs nothing, and the core follows the manifest the store holds
at once (its chunks fetched), so a third manifest for the version is weighed no more than any
manifest of a version the core knows; one it could not keep for now (a full store) is taken
again at the next announce.

The harness is `tests.relay.test_role_store_faults`'s: the role's real core, runner, dispatcher
and store; manifests arrive as gossip does (`ManifestAnnounce`, `Holding`), through the runner.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import trio

from p2pnet.wire import Envelope
from relay.manifest_answers import MAX_REFUSED_MANIFESTS
from relay.errors import StoreFull
from relay.messages import HeldVersion, Holding, ManifestAnnounce
from relay.store import ChunkStore
from tests.relay.test_role_store_faults import (  # noqa: F401 (fixtures)
    PUBLISHER, Harness, clock, inline_threads, publish)


def gossip(body) -> Envelope:
    return Envelope(body.KIND, PUBLISHER.peer_id, b"", 0, body, 0)


def another_manifest(tmp_path, name: str, version: int, chunks: int):
    """A manifest for `version` that the publisher signed besides the one `Harness.announce` makes."""
    store = ChunkStore(tmp_path / name, budget_bytes=10**9, trusted_publishers=[PUBLISHER.peer_id], fsync=False)
    (tmp_path / f"{name}-files").mkdir()
    try:
        return publish(store, tmp_path / f"{name}-files", version, chunks)
    finally:
        store.close()


def refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused by the store" in r.getMessage()]


class Counted:
    """What the role's store is asked to keep (`add_manifest`), what its core opens, and the
    manifests it asks peers for (`FetchManifest`)."""

    def __init__(self, h: Harness, monkeypatch) -> None:
        self.kept: list[int] = []
        self.opened = 0
        self.asked: list[int] = []
        self.full_once: set[int] = set()  # versions whose first keep finds the store full
        role, core = h.role, h.role.core
        add_manifest, open_frame = role.store.add_manifest, core._open

        def counted_add(signed):
            self.kept.append(signed.version)
            if signed.version in self.full_once:
                self.full_once.discard(signed.version)
                raise StoreFull("injected: no room for the version")
            return add_manifest(signed)

        def counted_open(frame, now):
            self.opened += 1
            return open_frame(frame, now)

        async def asked(ask) -> None:
            self.asked.append(ask.version)

        monkeypatch.setattr(role.store, "add_manifest", counted_add)
        monkeypatch.setattr(core, "_open", counted_open)
        role._fetch_manifest = asked


async def test_a_manifest_the_store_refuses_for_good_is_taken_no_more_and_the_held_one_is_followed(
        tmp_path, clock, caplog, monkeypatch):
    """The store holds another manifest for version 1, so it refuses the one announced. Announced
    again, and named by a holder, each past the core's retry interval, that manifest is not asked
    for, opened, offered to the store or logged (each announce did all four). The core follows the
    held manifest instead, so a third manifest for version 1 is neither asked for nor offered to the
    store (which would refuse it too); before, the core forgot version 1, and weighed the third."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path)
    role, core = h.role, h.role.core
    held = another_manifest(tmp_path, "equivocated", 1, chunks=8)
    role.store.add_manifest(held)  # held: version 1 conflicts
    counted = Counted(h, monkeypatch)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        role._upstream = lambda peer, nursery: SimpleNamespace(submit=lambda fetch: None)  # (nobody serves it)
        refused = await h.announce(1)  # refused by the store, remembered
        await trio.testing.wait_all_tasks_blocked()
        assert counted.kept == [1, 1] and len(refusals(caplog)) == 1  # (the second: the held one, already there)
        assert core.signed(1).manifest_id == held.manifest_id  # type: ignore[union-attr]
        opened = counted.opened
        for _ in range(3):  # announced again, and named by a holder
            await role._command(lambda now: core.on_message(now, gossip(ManifestAnnounce(refused.frame))))
            await role._command(lambda now: core.on_message(
                now, gossip(Holding((HeldVersion(1, refused.manifest_id),)))))
            await trio.sleep(core.config.manifest_retry_s)
        assert counted.kept == [1, 1] and counted.opened == opened and counted.asked == []
        assert len(refusals(caplog)) == 1

        third = another_manifest(tmp_path, "third", 1, chunks=4)  # another manifest for version 1
        await role._command(lambda now: core.on_message(now, gossip(Holding((HeldVersion(1, third.manifest_id),)))))
        await role._command(lambda now: core.on_message(now, gossip(ManifestAnnounce(third.frame))))
        await trio.testing.wait_all_tasks_blocked()
        assert counted.asked == [] and counted.kept == [1, 1] and len(refusals(caplog)) == 1
        assert core.signed(1).manifest_id == held.manifest_id  # type: ignore[union-attr]
        nursery.cancel_scope.cancel()


async def test_the_manifest_the_store_holds_instead_of_a_refused_one_is_fetched_at_once(tmp_path, clock, monkeypatch):
    """Our store holds the manifest of version 1 and none of its chunks (the core had forgotten
    the version: a failing disk, or a restart whose gossip came before the store's manifests were
    read), when a second manifest its publisher signed for it is announced: the store refuses it,
    and the core follows the held one, fetched from its holder, at once. Before, the core forgot
    version 1 until the held manifest's next announce (none here). The requests the core had made
    for the refused manifest are not sent (their chunks are not the held manifest's)."""
    h = Harness(tmp_path)
    role, core = h.role, h.role.core
    held = publish(h.origin, h.root, 1)  # the holder's (the publisher's) store holds it whole
    role.store.add_manifest(held)
    other = another_manifest(tmp_path, "equivocated", 1, chunks=8)
    sent: list[bytes] = []  # the digest of each fetch the role sends
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        submit = h.source.submit  # type: ignore[union-attr]
        h.source.submit = lambda fetch: (sent.append(fetch.digest), submit(fetch))  # type: ignore[union-attr]
        await role._command(lambda now: core.on_message(now, gossip(ManifestAnnounce(other.frame))))
        await h.until(lambda: h.complete(1), 600)
        nursery.cancel_scope.cancel()
    assert core.signed(1).manifest_id == held.manifest_id  # type: ignore[union-attr]
    assert core._store_refused(other.manifest_id) and core.status(0.0)["banned"] == []
    assert sent and set(sent) <= set(held.manifest.chunk_digests)  # none of the other manifest's chunks


async def test_a_manifest_the_store_could_not_keep_for_now_is_taken_again_at_the_next_announce(
        tmp_path, clock, caplog, monkeypatch):
    """A full store is no verdict on the manifest: it is only forgotten, and the next announce
    of it is kept and fetched."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path)
    role, core = h.role, h.role.core
    counted = Counted(h, monkeypatch)
    counted.full_once.add(1)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        signed = await h.announce(1)  # the store is full: not kept, forgotten
        await trio.testing.wait_all_tasks_blocked()
        assert counted.kept == [1] and not core.knows(1)
        await role._command(lambda now: core.on_message(now, gossip(ManifestAnnounce(signed.frame))))
        await h.until(lambda: h.complete(1), 60)
        assert counted.kept == [1, 1]
        nursery.cancel_scope.cancel()


def test_refused_manifests_are_remembered_up_to_the_bound_least_recently_named_first(tmp_path):
    """Any peer may name any manifest: at most `MAX_REFUSED_MANIFESTS` are remembered, and one
    named again since outlives those that were not."""
    core = Harness(tmp_path).role.core
    ids = [bytes([i]) * 32 for i in range(MAX_REFUSED_MANIFESTS + 1)]
    for version, manifest_id in enumerate(ids[:MAX_REFUSED_MANIFESTS]):
        core.refuse_manifest(version, manifest_id)
    assert core._store_refused(ids[0])  # named again: kept over the next oldest
    core.refuse_manifest(MAX_REFUSED_MANIFESTS, ids[-1])
    assert len(core._refused_manifests) == MAX_REFUSED_MANIFESTS
    assert core._store_refused(ids[0]) and not core._store_refused(ids[1]) and core._store_refused(ids[-1])
