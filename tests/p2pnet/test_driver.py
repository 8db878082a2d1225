"""The trio shell around a core, under MockClock: timers fire at virtual times, effects flow."""

import trio

from p2pnet.core import Emit, Publish, SetTimer
from p2pnet.driver import CoreRunner


class Ticker:
    topics = ()
    kinds = ("tick",)

    def __init__(self):
        self.fired = []

    def start(self, now):
        return [SetTimer(now + 5, "t")]

    def on_timer(self, now, key):
        self.fired.append(now)
        return [Publish("x", len(self.fired)), SetTimer(now + 5, "t")] if len(self.fired) < 3 else [Emit("done")]

    def on_message(self, now, envelope):
        return [Emit(("got", envelope))]

    def on_rejected(self, now, peer, reason):
        return [Emit(("rejected", peer, reason))]


class Sink:
    def __init__(self):
        self.effects = []

    def carry_out(self, origin, effect):
        self.effects.append(effect)


async def test_timers_fire_in_virtual_time_and_effects_reach_the_sink(autojump_clock):
    sink = Sink()
    core = Ticker()
    runner = CoreRunner(core, sink, name="ticker")
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        start = trio.current_time()
        while Emit("done") not in sink.effects:
            await trio.sleep(1)
        assert [round(t - start) for t in core.fired] == [5, 10, 15]
        runner.rejected("peerX", "garbage")
        await runner.command(lambda now: [Emit("commanded")])
        assert Emit(("rejected", "peerX", "garbage")) in sink.effects
        assert sink.effects[-1] == Emit("commanded")
        nursery.cancel_scope.cancel()
    assert [e.body for e in sink.effects if isinstance(e, Publish)] == [1, 2]


async def test_a_command_to_a_runner_that_stopped_returns_instead_of_waiting_forever(autojump_clock):
    """At shutdown the runner and the tasks that command it are cancelled together, and some of
    those tasks command it from shielded cleanup (a relay's upstreams report the fetches they
    drop). A runner that stopped first must not leave them waiting for ever: the command is not
    run (the core is gone) and `command` returns."""
    sink = Sink()
    runner = CoreRunner(Ticker(), sink, name="ticker")
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        nursery.cancel_scope.cancel()
    ran = []
    with trio.CancelScope(shield=True), trio.fail_after(60):  # virtual seconds: before the fix, for ever
        await runner.command(lambda now: ran.append(now) or [Emit("late")])
    assert ran == [] and Emit("late") not in sink.effects


async def test_commands_queued_when_the_runner_is_cancelled_are_released(autojump_clock):
    """Commands sent while the runner is busy, then the runner is cancelled before it reads them:
    their senders return (shielded, as cleanup code is)."""
    sink = Sink()
    runner = CoreRunner(Ticker(), sink, name="ticker")
    returned = []

    async def cleanup(i):
        with trio.CancelScope(shield=True), trio.fail_after(60):
            await runner.command(lambda now: [Emit(("cmd", i))])
        returned.append(i)

    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            await trio.sleep(1)
            nursery.cancel_scope.cancel()  # the runner exits at its next checkpoint
            for i in range(3):  # queued before it gets there
                outer.start_soon(cleanup, i)
    assert sorted(returned) == [0, 1, 2]
