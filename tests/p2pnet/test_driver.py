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
