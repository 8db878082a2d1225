"""The relay role's shell on a partly failing disk, in virtual time (MockClock): the writes of one
version fail with EIO (its files lie on bad sectors) while another version's are stored and
flushed. Only the failing version's own chunk made durable (or the hold's own end, or the
version's collection) ends the hold its failure started; the other version's flushes prove
nothing about it.

The harness is `tests.relay.test_role_store_faults`'s: the role's real core, runner, dispatcher
and store (batched fsyncs), the network replaced by `Source`, worker threads run inline.
"""

from __future__ import annotations

import errno
import logging

import trio

from tests.relay.test_role_store_faults import (  # noqa: F401 (fixtures)
    Harness, clock, complete_on_disk, inline_threads, store_failing_warnings)


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
    return [w.split("requests for ")[1].split("s ")[0] for w in store_failing_warnings(caplog)]


def resumed(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "store takes writes again" in r.getMessage()]


async def test_a_flush_of_another_version_does_not_end_the_hold_a_failing_version_started(
        tmp_path, clock, caplog, monkeypatch):
    """Every write of version 1 fails with EIO; version 2, announced once the first hold began, is
    fetched (newest first) at each hold's end, stored and flushed. Its flushes do not end the hold:
    they did, so version 1's requests went to the bad disk again at once and each new hold started
    over at 1 s (eight holds of 1 s in a row here, for as long as version 2 was fetched). The holds
    double while version 1 fails; version 2 completes (paced by them: 183 virtual s here, 3 s
    when its flushes ended them), and garbage collection drops version 1, superseded. Nothing of
    it will be stored again to end its hold: its collection does, and the store is not reported
    failing for good."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path, fsync=True, fsync_batch_chunks=4)
    FailingVersions(h, monkeypatch, 1)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        h.source.answer_at_most = 400  # (a bound on the downloads, should the holds not pace them)
        await h.announce(1)
        await h.until(lambda: h.role.backoff.active, 30)
        second = await h.announce(2)
        await h.until(lambda: h.complete(2), 600)
        holds = holds_s(caplog)
        assert holds[:5] == ["1", "2", "4", "8", "16"], holds
        assert resumed(caplog) == [] or not h.role.core.knows(1)  # (not before version 1 was dropped)
        assert complete_on_disk(h, second)
        await h.until(lambda: not h.role.core.knows(1), 60)
        await h.until(lambda: not h.role.backoff.active, 60)
        assert len(resumed(caplog)) == 1 and h.role.status()["store_backoff"]["cause"] is None
        nursery.cancel_scope.cancel()
