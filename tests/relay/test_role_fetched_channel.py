"""The relay role's channel of stored chunks waiting for the transfer core (`_fetched`), in
virtual time (MockClock): it holds at most `max_in_flight` (the requests the core keeps out);
answers past that wait for the core, holding their chunk buffers, and none is lost; a role that
stops lets the waiting ones go.

The role runs its real core, runner, dispatcher and store (`Harness`); only the network is
replaced: each `Fetch` is answered from the publisher's store in the name of the peer it was asked
of, shielded as `relay.upstream` does. The core lags: its rounds that hear of stored chunks wait
until the test lets them go. More answers than requests out come from `asked_for` (a request for
a chunk outside our home stripe, fetched at once down that stripe, past the in-flight budget).
"""

from __future__ import annotations

import logging
from functools import partial

import trio
import trio.testing

from tests.relay.test_role_store_faults import (  # noqa: F401 (fixtures)
    CHUNKS, PUBLISHER, Harness, Source, clock, inline_threads)

OTHERS = {f"12D3KooWmember{i}": 1e8 for i in range(7)}  # members enough that our home stripe is one of several
GIVE_UP_S = 600.0  # virtual: a reporter still waiting then is stuck


class PeerSource(Source):
    """Answers each fetch in the name of the peer it was asked of, shielded (a received chunk is
    always stored and told, even as the role stops: `Upstream._report`). `stuck` counts answers
    whose report was still waiting after `GIVE_UP_S`."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.stuck = 0

    async def _answer(self, fetch) -> None:
        await self.gate.wait()
        self.downloads.append((trio.current_time(), fetch.version, fetch.index))
        data = self.store.read_chunk(fetch.version, fetch.index)
        with trio.CancelScope(shield=True, deadline=trio.current_time() + GIVE_UP_S) as scope:
            await self.role.report_fetched(fetch.peer, fetch, data, 0.01)
        if scope.cancelled_caught:
            self.stuck += 1


async def start_lagging(h: Harness, nursery: trio.Nursery) -> tuple[trio.Event, PeerSource]:
    """Start `h` with a `PeerSource` (returned), and a core that hears of stored chunks
    (`_tell_fetched`'s rounds) only once the returned event is set."""
    go = trio.Event()
    role, command = h.role, h.role._command

    async def lagging(fn) -> None:
        if isinstance(fn, partial) and fn.func == role._stored_all:
            await go.wait()
        await command(fn)

    role._command = lagging
    await h.start(nursery)
    h.source = source = PeerSource(role, h.origin, nursery)
    role._upstream = lambda peer, nursery: source
    await role._command(lambda now: role.core.set_members(now, {PUBLISHER.peer_id: 1e9, **OTHERS}))
    return go, source


async def ask_for_every_chunk(h: Harness) -> None:
    """Peers ask us for every chunk of version 1: those outside our home stripe are fetched at
    once, urgent, past `max_in_flight`."""
    for index in range(CHUNKS):
        await h.role._command(lambda now, index=index: h.role.core.asked_for(now, 1, index))


async def test_answers_past_the_requests_out_wait_for_the_core_and_no_fetch_is_lost(tmp_path, clock):
    h = Harness(tmp_path, max_concurrent_downloads=1)  # max_in_flight 2
    async with trio.open_nursery() as nursery:
        go, source = await start_lagging(h, nursery)
        await h.announce(1)
        await ask_for_every_chunk(h)
        assert h.role.core._in_flight > 2  # the urgent requests are past the budget
        await trio.testing.wait_all_tasks_blocked()
        waiting = h.role._fetched_send.statistics()
        assert waiting.max_buffer_size == 2 and waiting.current_buffer_used == 2
        assert waiting.tasks_waiting_send >= CHUNKS // 2  # the other answers wait, holding their buffers
        answered = [i for _, _, i in source.downloads]  # (0 and 1 maybe twice: asked again at once)
        assert {i for i in range(CHUNKS) if h.role.store.holds(1, i)} == set(answered)  # all stored meanwhile

        go.set()  # the core catches up
        await h.until(lambda: h.complete(1), 60)
        later = [i for _, _, i in source.downloads[len(answered):]]
        assert sorted(later) == sorted(set(range(CHUNKS)) - set(answered))  # no answer is fetched again
        assert h.role.core.progress(trio.current_time(), 1)["in_flight"] == 0
        assert h.role._fetched_send.statistics().tasks_waiting_send == 0
        assert source.stuck == 0
        nursery.cancel_scope.cancel()


async def test_a_role_that_stops_lets_go_of_the_answers_waiting_for_the_core(tmp_path, clock, caplog):
    caplog.set_level(logging.INFO, logger="relay.role")
    h = Harness(tmp_path, max_concurrent_downloads=1)
    async with trio.open_nursery() as nursery:
        _, source = await start_lagging(h, nursery)  # never let go: the core stays behind until the role stops
        await h.announce(1)
        await ask_for_every_chunk(h)
        await trio.testing.wait_all_tasks_blocked()
        waiting = h.role._fetched_send.statistics().tasks_waiting_send
        assert waiting > 0
        nursery.cancel_scope.cancel()  # the role stops: `_tell_fetched` ends, its channel closes
    assert source.stuck == 0  # no shielded answer waits for ever on a core that is gone
    untold = [r for r in caplog.records if "stored as the relay stops" in r.getMessage()]
    assert len(untold) == waiting
    assert all(h.role.store.holds(1, i) for _, _, i in source.downloads)  # stored all the same
