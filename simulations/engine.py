"""The discrete-event engine: one seeded event queue in virtual time.

Events are `(time, sequence, handle, callback, args)` in a heap; ties are broken by insertion
order, so a run is a pure function of its inputs and seed. The heap is heapq's on a list, or where
the simulator's C module is built (`make install` or `make sim-accel`; `simulations.fairshare.ACCELERATOR`) its
`Queue`, which keeps the two keys as C numbers: sequences are unique, so both pop every entry in
the same order. Cancelling is lazy: a cancelled
event's handle is marked and skipped when popped.

Moving an event (`retime`) is lazy too when it moves later: its entry stays in the heap, the
handle records the new time and the sequence number a fresh entry would have had, and when the
old entry comes up it is pushed again as exactly that entry (`(new time, that sequence)`). So the
order in which events run is the one cancelling and scheduling anew gives, without an entry per
move: the data plane re-times a flow's end every time its rate changes, mostly later (another
flow joined its upload or download). Moved earlier, the old entry is cancelled and a new one
pushed. The engine knows nothing about networks.

`quiet_gc()` is for a big run's process: the cycle collector runs rarely while it is in effect
(events make few cycles; at the default threshold the collector took a tenth of a 1,000-relay
run's time), and `gc.freeze()` inside it keeps a world built once out of every collection.
"""

from __future__ import annotations

import contextlib
import gc
import random
import heapq
from typing import Any, Callable, Iterator

from simulations.fairshare import ACCELERATOR as _C
# the queue: heapq on a list, or the same in C (`simulations/_cqueue.c`: the same pop order, cheaper compares)
new_queue: Callable[[], Any] = list if _C is None else _C.Queue
heappush: Callable[[Any, tuple[Any, ...]], None] = heapq.heappush if _C is None else _C.heappush
heappop: Callable[[Any], Any] = heapq.heappop if _C is None else _C.heappop


def _nan(callback: Callable[..., Any]) -> ValueError:
    # the caller's fault, refused on either queue (heapq would take NaN and lose its order)
    return ValueError(f"an event for {callback!r} scheduled at time NaN")


class Handle:
    """One scheduled event. `sequence` is its order among events at the same time (0: cancelled,
    -1: it ran); `due` its time, later than its heap entry's `entry` when it was moved later."""

    __slots__ = ("sequence", "due", "entry")

    def __init__(self, when: float, sequence: int) -> None:
        self.sequence = sequence
        self.due = self.entry = when

    @property
    def cancelled(self) -> bool:
        return self.sequence == 0

    def cancel(self) -> None:
        self.sequence = 0


class Engine:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.random = random.Random(seed)
        self.now = 0.0
        self._queue: Any = new_queue()  # (time, sequence, handle, callback, args) entries, as heapq's heap
        self._sequence = 0
        self.events_run = 0

    def at(self, when: float, callback: Callable[..., Any], *args: Any) -> Handle:
        if when != when:
            raise _nan(callback)
        if when < self.now:
            when = self.now
        sequence = self._sequence = self._sequence + 1
        handle = Handle(when, sequence)
        heappush(self._queue, (when, sequence, handle, callback, args))
        return handle

    def after(self, delay_s: float, callback: Callable[..., Any], *args: Any) -> Handle:
        return self.at(self.now + delay_s, callback, *args)

    def retime(self, handle: Handle, when: float, callback: Callable[..., Any], *args: Any) -> Handle:
        """Move the event `handle` (scheduled with `callback(*args)`) to `when`, as if it were
        cancelled and `at(when, callback, *args)` called; returns its handle from now on. A handle
        that was cancelled or already ran has no entry to move: the event is scheduled anew."""
        if when != when:
            raise _nan(callback)
        if when < self.now:
            when = self.now
        sequence = self._sequence = self._sequence + 1
        if handle.sequence > 0 and when >= handle.entry:  # lazy: its entry, when popped, is pushed again as this one
            handle.sequence = sequence
            handle.due = when
            return handle
        handle.sequence = 0
        handle = Handle(when, sequence)
        heappush(self._queue, (when, sequence, handle, callback, args))
        return handle

    def pending(self) -> int:
        return len(self._queue)

    def run(self, *, until: float = float("inf"), max_events: int = 50_000_000,
            stop: Callable[[], bool] | None = None) -> bool:
        """Run events up to time `until`; returns True if `stop()` became true (`events_run` counts
        the events run, also while `stop` looks)."""
        queue = self._queue
        budget = max_events
        pop, push = heappop, heappush
        bounded = until != float("inf")
        while queue and budget > 0:
            if bounded and queue[0][0] > until:
                break
            when, sequence, handle, callback, args = pop(queue)
            if handle.sequence != sequence:
                sequence = handle.sequence
                if sequence:  # moved later: pushed again as the entry a fresh `at` would have made
                    when = handle.entry = handle.due
                    push(queue, (when, sequence, handle, callback, args))
                continue
            self.now = when
            handle.sequence = -1  # ran: a later retime schedules anew, a cancel does nothing
            callback(*args)
            self.events_run += 1
            budget -= 1
            if stop is not None and stop():
                return True
        if budget == 0:
            raise RuntimeError(f"simulation exceeded {max_events} events (runaway protocol?)")
        if until != float("inf"):
            self.now = max(self.now, until)
        return False


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """Collect cycles rarely while a big world runs (it makes few cycles, and each full
    collection would walk every object of 10,000 peers); restore the collector after, and
    unfreeze what a `gc.freeze()` inside froze. The collector only decides when unreachable
    cycles are freed, never what a run computes."""
    threshold = gc.get_threshold()
    gc.set_threshold(100_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
