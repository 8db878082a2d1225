"""The trio shell around a pure core: feeds it inputs, keeps its timers, carries out its effects.

One `CoreRunner` task per core. Inputs arrive through a bounded channel (messages the node
routed to this core, rejections, application commands); timers live in a dict keyed by name,
because a core has at most one pending timer per key. The runner reads time with
`trio.current_time()`, so under `trio.testing.MockClock` a test drives hours of protocol in
milliseconds. Effects other than timers go to the `EffectSink` the runner was given (the node
for real peers), which owns I/O.

Once `run` ends (cancelled with the nursery it runs in: a role's, or the node's), the core is
gone: commands still queued are released unrun and later ones return at once. Shielded cleanup
that commands the core at shutdown (a relay reports the fetches it drops) must not wait for ever
on a runner cancelled a moment before it.

This module must not know what any core does.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import trio

from p2pnet.core import Core, Effect, SetTimer
from p2pnet.wire import Envelope

log = logging.getLogger(__name__)


class EffectSink(Protocol):
    def carry_out(self, origin: str, effect: Effect) -> None:
        """Accept one non-timer effect without blocking (queue it; never await here)."""


@dataclass(frozen=True)
class _Message:
    envelope: Envelope[Any]


@dataclass(frozen=True)
class _Rejected:
    peer: str
    reason: str


@dataclass(frozen=True)
class _Command:
    fn: Callable[[float], list[Effect]]
    done: trio.Event


class CoreRunner:
    """Runs one core. Feed it with `deliver`, `rejected` and `command`; start `run` in a nursery."""

    def __init__(self, core: Core, sink: EffectSink, *, name: str, inbox_size: int = 1024) -> None:
        self.core = core
        self.name = name
        self._sink = sink
        self._send, self._receive = trio.open_memory_channel[Any](inbox_size)
        self._timers: dict[str, float] = {}
        self.dropped_inputs = 0
        self.stopped = False  # `run` ended: nothing reads the inbox any more

    def deliver(self, envelope: Envelope[Any]) -> None:
        self._offer(_Message(envelope))

    def rejected(self, peer: str, reason: str) -> None:
        self._offer(_Rejected(peer, reason))

    async def command(self, fn: Callable[[float], list[Effect]]) -> None:
        """Run `fn(now)` inside the runner (between inputs) and carry out its effects. Returns
        without running it once the runner has stopped (see the top)."""
        if self.stopped:
            return
        done = trio.Event()
        await self._send.send(_Command(fn, done))
        await done.wait()

    def command_soon(self, fn: Callable[[float], list[Effect]]) -> None:
        """`command` without waiting: `fn(now)` runs inside the runner after the inputs queued before it."""
        self._offer(_Command(fn, trio.Event()))

    def _offer(self, item: Any) -> None:
        try:
            self._send.send_nowait(item)
        except trio.WouldBlock:
            self.dropped_inputs += 1  # a flooded core sheds load instead of blocking the network
            log.warning("%s: inbox full, dropped %s", self.name, type(item).__name__)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._run(task_status)
        finally:
            self.stopped = True
            self._release_queued()

    def _release_queued(self) -> None:
        """Wake whoever waits on a command still in the inbox (and senders blocked on a full
        one, whose commands land in it as it drains): the core will not run them."""
        while True:
            try:
                item = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return
            if isinstance(item, _Command):
                item.done.set()

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        self._apply(self.core.start(trio.current_time()))
        task_status.started()
        while True:
            deadline = min(self._timers.values(), default=math.inf)
            item = None
            with trio.move_on_at(deadline):
                item = await self._receive.receive()
            now = trio.current_time()
            if item is not None:
                self._apply(self._handle(now, item))
                if isinstance(item, _Command):
                    item.done.set()
            for key in [k for k, at in self._timers.items() if at <= now]:
                del self._timers[key]
                self._apply(self.core.on_timer(now, key))

    def _handle(self, now: float, item: Any) -> list[Effect]:
        if isinstance(item, _Message):
            return self.core.on_message(now, item.envelope)
        if isinstance(item, _Rejected):
            return self.core.on_rejected(now, item.peer, item.reason)
        return item.fn(now)

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, SetTimer):
                self._timers[effect.key] = effect.at
            else:
                self._sink.carry_out(self.name, effect)
