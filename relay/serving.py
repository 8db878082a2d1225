"""The serving policy's parts that hold no sockets: upload slots, byte budgets and the meter
of what our uploads really deliver.

`UploadSlots`: at most `slots` chunks served at once, at most `per_peer` to one requester,
urgent requests (the requester forwards that stripe) first, then round robin across peers.
`ByteBudget`: a token bucket (one second of burst) for bytes served, to one peer or to all.
`UploadMeter`: bytes sent while every upload slot was taken, over that time, in a sliding
window: when the slots are all busy our upload is the bottleneck, so that rate is what we can
deliver; the relay advertises it instead of its configured `upload_bps` when it is lower.

`ByteBudget` and `UploadMeter` are pure (the caller passes the time); `UploadSlots` uses trio
events for its waiters. This module must not do I/O.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable

import trio


class UploadSlots:
    """At most `slots` chunks served at once and at most `per_peer` of them to one peer, so one
    requester cannot hold them all. Waiters are served urgent first, then round-robin across
    peers (FIFO within a peer)."""

    def __init__(self, slots: int, per_peer: int | None = None,
                 on_full: Callable[[bool], None] = lambda full: None) -> None:
        self.free = slots
        self._on_full = on_full  # told True when the last slot is taken, False when one stays free
        self.per_peer = per_peer or max(1, slots // 2)
        self._held: dict[str, int] = {}
        self._waiters: list[OrderedDict[str, list[trio.Event]]] = [OrderedDict(), OrderedDict()]  # urgent, normal

    def _may_take(self, peer: str) -> bool:
        return self.free > 0 and self._held.get(peer, 0) < self.per_peer

    async def acquire(self, urgent: bool, peer: str = "") -> None:
        if self._may_take(peer) and not any(self._may_take(p) for queues in self._waiters for p in queues):
            self._take(peer)
            return
        event = trio.Event()
        queue = self._waiters[0 if urgent else 1].setdefault(peer, [])
        queue.append(event)
        try:
            await event.wait()
        except BaseException:
            if event in queue:
                queue.remove(event)
                if not queue:
                    self._waiters[0 if urgent else 1].pop(peer, None)
            elif event.is_set():
                self.release(peer)  # we were handed a slot while being cancelled: pass it on
            raise

    def _take(self, peer: str) -> None:
        self.free -= 1
        self._held[peer] = self._held.get(peer, 0) + 1
        if self.free == 0:
            self._on_full(True)

    def release(self, peer: str = "") -> None:
        self.free += 1
        self._held[peer] -= 1
        if not self._held[peer]:
            del self._held[peer]
        for queues in self._waiters:
            for waiting_peer in list(queues):
                if not self._may_take(waiting_peer):
                    continue
                queue = queues.pop(waiting_peer)  # round robin: this peer goes to the back
                event = queue.pop(0)
                if queue:
                    queues[waiting_peer] = queue
                self.free -= 1  # the slot moves straight to this waiter: still full if it was
                self._held[waiting_peer] = self._held.get(waiting_peer, 0) + 1
                event.set()
                return
        if self.free == 1:
            self._on_full(False)


class ByteBudget:
    """Bytes served to one peer per second at most: a token bucket of `rate_bps` with one second
    of burst. `reserve(now, n)` takes `n` bytes and says how long to wait before sending them
    (0 while within budget). Pure: the caller sleeps."""

    def __init__(self, rate_bps: float) -> None:
        self.rate_bps = rate_bps
        self._tokens = rate_bps
        self._at = 0.0

    def reserve(self, now: float, nbytes: int) -> float:
        self._tokens = min(self.rate_bps, self._tokens + (now - self._at) * self.rate_bps)
        self._at = now
        self._tokens -= nbytes
        return max(0.0, -self._tokens / self.rate_bps)


class UploadMeter:
    """The rate our uploads deliver while they are the bottleneck (see the module docstring).

    `full(now, sent)` and `not_full(now, sent)` mark the times every slot became taken and one
    became free again, with the bytes sent so far; `rate(now, sent)` is bytes over seconds of
    such stretches within the last `window_s`, or None with less than `min_full_s` of them."""

    def __init__(self, window_s: float = 30.0, min_full_s: float = 2.0) -> None:
        self.window_s = window_s
        self.min_full_s = min_full_s
        self._since: tuple[float, int] | None = None
        self._stretches: deque[tuple[float, float, int]] = deque()  # (end, seconds, bytes)

    def full(self, now: float, sent: int) -> None:
        if self._since is None:
            self._since = (now, sent)

    def not_full(self, now: float, sent: int) -> None:
        if self._since is not None:
            start, at = self._since
            self._stretches.append((now, now - start, sent - at))
            self._since = None

    def rate(self, now: float, sent: int) -> float | None:
        while self._stretches and self._stretches[0][0] < now - self.window_s:
            self._stretches.popleft()
        seconds = sum(s for _, s, _ in self._stretches)
        nbytes = sum(b for _, _, b in self._stretches)
        if self._since is not None:
            seconds += now - self._since[0]
            nbytes += sent - self._since[1]
        return nbytes / seconds if seconds >= self.min_full_s else None
