"""`Uploads`: the trio shell of the serving core (`relay.serving.ServingCore`).

Each answer task of the relay role takes its turn here: `async with uploads.turn(...) as
queued_s` waits until the core gives the request an upload slot (`queued_s`: the seconds it
waited for the slot once we held the chunk, told to the requester in the answer's header; send
the chunk, the slot is freed when the block ends) or refuses it because the chunk did not
arrive within the wait limit (`queued_s` None: answer "unavailable"). `arrived(version, index)` tells
the core a chunk is now held (a request from the peer we asked for that chunk ourselves is refused
at once: `ServingCore.ask`); `run()` wakes the core at its `next_deadline`: it refuses requests
whose wait limit passed and releases the slots of serves that lasted too long
(`ServingConfig.linger_factor`: the chunk goes on, the next queued request is served). The
decisions are the core's; this module only waits on trio events and keeps no policy of its own.
`on_full` follows the core's `full` (every slot held by a serve that has not lingered, so a new
request would wait): a serve that lingers frees its slot for that notion too, because a slow
receiver, not our upload, is what keeps it going (`relay.serving.UploadMeter` measures our
upload only while requests would wait for it).
"""

from __future__ import annotations

import math
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

import trio

from relay.serving import Refuse, Serve, ServingConfig, ServingCore


class Uploads:
    def __init__(self, config: ServingConfig, on_full: Callable[[bool], None] = lambda full: None) -> None:
        self.core = ServingCore(config)
        self._on_full = on_full  # told True when the last slot is taken, False when one is free again
        self._events: dict[object, trio.Event] = {}
        self._granted: dict[object, float | None] = {}  # token -> seconds queued, None: refused
        self._waits_changed = trio.Event()  # set when the core's next deadline came earlier than `_wake_at`
        self._wake_at = math.inf  # when `run` wakes next
        self._full = False

    async def run(self) -> None:
        """Refuse waiting requests as their wait limit passes and release slots as serves
        linger (runs until cancelled)."""
        while True:
            deadline = self.core.next_deadline()
            self._wake_at = deadline if deadline is not None else math.inf
            with trio.move_on_at(self._wake_at):
                await self._waits_changed.wait()
            self._waits_changed = trio.Event()
            self._wake_at = -math.inf  # awake: no need to be woken
            self._apply(self.core.expire(trio.current_time()))

    @asynccontextmanager
    async def turn(self, peer: str, version: int, index: int, urgent: bool,
                   held: bool, asked_of: str | None = None) -> AsyncIterator[float | None]:
        """`asked_of`: the peer our own request for the chunk is outstanding with (refused at
        once if that is `peer`: `ServingCore.ask`)."""
        token = object()
        event = self._events[token] = trio.Event()
        self._apply(self.core.ask(trio.current_time(), token, peer, version, index, urgent, held, asked_of))
        try:
            await event.wait()
        except BaseException:
            self._events.pop(token, None)
            if self._granted.pop(token, None) is not None:
                self._apply(self.core.done(trio.current_time(), token))  # handed a slot while cancelled
            else:
                self.core.cancel(token)
            raise
        queued_s = self._granted.pop(token)
        if queued_s is None:
            yield None
            return
        try:
            yield queued_s
        finally:
            self._apply(self.core.done(trio.current_time(), token))

    def set_slots(self, slots: int) -> None:
        self._apply(self.core.set_slots(trio.current_time(), slots))

    def arrived(self, version: int, index: int) -> None:
        self._apply(self.core.arrived(trio.current_time(), version, index))

    def _apply(self, actions: list[Serve | Refuse]) -> None:
        for action in actions:
            event = self._events.pop(action.token, None)
            if event is not None:
                self._granted[action.token] = action.queued_s if isinstance(action, Serve) else None
                event.set()
        deadline = self.core.next_deadline()  # a new wait, a new serve, a new typical serving time
        if deadline is not None and deadline < self._wake_at:
            self._waits_changed.set()
        if self.core.full != self._full:
            self._full = self.core.full
            self._on_full(self._full)
