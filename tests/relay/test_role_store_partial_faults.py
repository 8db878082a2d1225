"""The relay role's shell on a partly failing disk, in virtual time (MockClock): the writes of one
version fail with EIO (its files lie on bad sectors) while another version's are stored and
flushed. Only the failing version's own chunk made durable (or the hold's own end, or the
version's collection) ends the hold its failure started; the other version's flushes prove
nothing about it. The status and the health check name the version a hold holds alone.

The harness is `tests.relay.test_role_store_faults`'s: the role's real core, runner, dispatcher
and store (batched fsyncs), the network replaced by `Source`, worker threads run inline.
"""

from __future__ import annotations

import errno
import logging

import trio

from relay.metrics import RelayMetrics
from tests.relay.test_role_store_faults import (  # noqa: F401 (fixtures)
    CHUNKS, Harness, clock, complete_on_disk, inline_threads, store_failing_warnings)


class FailingVersions:
    """The role's store's `put_chunk` raises EIO for the chunks of the versions in `failing`."""

    def __init__(self, h: Harness, monkeypatch, *failing: int) -> None:
        self.failing = set(failing)
        real_put = h.role.store.put_chunk

        def put_chunk(version, index, data, **kwargs):
            if version in self.failing:
                raise OSError(errno.EIO, "Input/output error")
            return real_put(version, index, data, **kwargs)

        monkeypatch.setattr(h.role.store, "put_chunk", put_chunk)


def holds_s(caplog) -> list[str]:
    """The length of each hold said, in order (its warning's "for Ns")."""
    return [w.split(" for ")[-1].split("s ")[0] for w in store_failing_warnings(caplog)]


def resumed(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "store takes writes again" in r.getMessage()]


async def test_a_version_whose_writes_fail_is_held_alone_and_a_healthy_version_fetches_on(
        tmp_path, clock, caplog, monkeypatch):
    """Every write of version 1 fails with EIO; version 2, announced once its hold began, is
    fetched at once, every chunk once, and completes inside that first hold (one hold said): the
    hold is version 1's (the core's requests for version 2 were held with it, so version 2 was
    paced by version 1's growing holds, 183 virtual s for 16 chunks). Garbage collection then
    drops version 1, superseded: nothing of it will be stored to end its hold, so its collection
    does, and the store is not reported failing for good."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path, fsync=True, fsync_batch_chunks=4)
    FailingVersions(h, monkeypatch, 1)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        h.source.answer_at_most = 400  # (a bound on the downloads, should no hold pace them)
        await h.announce(1)
        await h.until(lambda: h.role.backoff.active, 30)
        assert holds_s(caplog) == ["1"] and "for version 1" in store_failing_warnings(caplog)[0]
        hold = h.role.status()["store_backoff"]  # the status and the health check name the version held
        assert hold["cause"] == "failing" and hold["version"] == 1, hold
        assert "failing writing version 1" in RelayMetrics(h.node).unhealthy(h.role)
        second = await h.announce(2)
        await h.until(lambda: h.complete(2), 600)
        assert holds_s(caplog) == ["1"], holds_s(caplog)  # version 2 waited on no hold of version 1's
        assert sorted(i for _, v, i in h.source.downloads if v == 2) == list(range(CHUNKS))
        assert complete_on_disk(h, second)
        await h.until(lambda: not h.role.core.knows(1), 60)
        await h.until(lambda: not h.role.backoff.active, 60)
        assert len(resumed(caplog)) == 1 and h.role.status()["store_backoff"]["cause"] is None
        nursery.cancel_scope.cancel()


async def test_a_flush_of_another_version_does_not_end_the_hold_a_failing_version_started(
        tmp_path, clock, caplog, monkeypatch):
    """Every write of version 2 fails with EIO while version 1, fetched from a slow source (its
    chunk i answered after i virtual s), is stored and flushed all along. Version 1's flushes do
    not end version 2's hold: they did, so version 2's requests went to the bad disk again at once
    and every new hold started over at 1 s. The holds double while version 2 fails; version 1
    completes meanwhile, every chunk fetched once; once the disk works, version 2 completes and
    the hold ends."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path, fsync=True, fsync_batch_chunks=4)
    disk = FailingVersions(h, monkeypatch, 2)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        h.source.answer_at_most = 400
        slow_answer = h.source._answer

        async def answer(fetch) -> None:
            if fetch.version == 1:
                await trio.sleep(1.0 * fetch.index)  # (the last after 15 s: no stall)
            await slow_answer(fetch)

        h.source._answer = answer
        await h.announce(1)
        await h.announce(2)
        await h.until(lambda: h.complete(1), 120)
        assert h.role.store.durable_flushes >= 4  # (version 1's batches, flushed inside version 2's holds)
        assert sorted(i for _, v, i in h.source.downloads if v == 1) == list(range(CHUNKS))
        with trio.move_on_after(40):
            await trio.sleep_forever()
        holds = holds_s(caplog)
        assert holds[:6] == ["1", "2", "4", "8", "16", "32"], holds
        assert resumed(caplog) == [] and not h.complete(2)
        disk.failing.clear()
        await h.until(lambda: h.complete(2), 120)
        assert len(resumed(caplog)) == 1 and h.role.status()["store_backoff"]["cause"] is None
        nursery.cancel_scope.cancel()


async def test_another_version_whose_writes_fail_inside_the_hold_makes_it_every_version_s(
        tmp_path, clock, caplog, monkeypatch):
    """Every write of versions 1 and 2 fails with EIO. Version 1's failure holds version 1; version
    2's, inside that hold, starts no hold of its own (one per hold): the hold becomes every
    version's, or version 2's chunks would go to the bad disk again at network speed till the hold
    ended. Both are paced by the same doubling holds; once the disk works, both complete."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path, fsync=True, fsync_batch_chunks=4)
    disk = FailingVersions(h, monkeypatch, 1, 2)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        h.source.answer_at_most = 400  # (a bound on the downloads, should no hold pace them)
        await h.announce(1)
        await h.until(lambda: h.role.backoff.active, 30)
        await h.announce(2)
        await h.until(lambda: any("inside the hold on version 1" in r.getMessage() for r in caplog.records), 30)
        hold = h.role.status()["store_backoff"]  # every version's now: none named
        assert hold["backing_off"] and hold["version"] is None, hold
        assert "version" not in RelayMetrics(h.node).unhealthy(h.role)
        with trio.move_on_after(30):
            await trio.sleep_forever()
        holds = holds_s(caplog)
        assert holds[:4] == ["1", "2", "4", "8"] and len(holds) <= 6, holds
        assert len(h.source.downloads) <= 2 * CHUNKS + 4 * len(holds), len(h.source.downloads)
        disk.failing.clear()
        await h.until(lambda: h.complete(2), 120)  # (version 1 before it, or collected as superseded)
        assert not h.role.backoff.active
        nursery.cancel_scope.cancel()
