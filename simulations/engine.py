"""The discrete-event engine: one seeded event queue in virtual time.

Events are `(time, sequence, callback, args)` in a heap; ties are broken by insertion order,
so a run is a pure function of its inputs and seed. Cancelling is lazy: a cancelled event's
handle is marked and skipped when popped. The engine knows nothing about networks.
"""

from __future__ import annotations

import random
from heapq import heappop, heappush
from typing import Any, Callable


class Handle:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Engine:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.random = random.Random(seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, Handle, Callable[..., Any], tuple[Any, ...]]] = []
        self._sequence = 0
        self.events_run = 0

    def at(self, when: float, callback: Callable[..., Any], *args: Any) -> Handle:
        if when < self.now:
            when = self.now
        handle = Handle()
        self._sequence += 1
        heappush(self._queue, (when, self._sequence, handle, callback, args))
        return handle

    def after(self, delay_s: float, callback: Callable[..., Any], *args: Any) -> Handle:
        return self.at(self.now + delay_s, callback, *args)

    def pending(self) -> int:
        return len(self._queue)

    def run(self, *, until: float = float("inf"), max_events: int = 50_000_000,
            stop: Callable[[], bool] | None = None) -> bool:
        """Run events up to time `until`; returns True if `stop()` became true."""
        queue = self._queue
        budget = max_events
        while queue and budget > 0:
            if queue[0][0] > until:
                break
            when, _, handle, callback, args = heappop(queue)
            if handle.cancelled:
                continue
            self.now = when
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
