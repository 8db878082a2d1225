"""The contract between pure protocol cores and the worlds that run them.

A core is a plain synchronous object. It is fed inputs, `start(now)`, `on_message(now,
envelope)`, `on_timer(now, key)`, `on_rejected(now, peer, reason)`, and returns a list of
effects. It never awaits, reads a clock, touches a socket or draws global randomness: time
comes in as `now` (seconds), randomness through a seeded `random.Random` it is given, and
everything it wants done goes out as an effect. The real world (trio + libp2p, see
`p2pnet.driver`) and the simulated world (`simulations`) both carry effects out, so the same
core runs unchanged in both.

Effects:
- `Publish(topic, body)`: gossip a message to every peer subscribed to `topic`.
- `Send(peer, body)`: deliver a message to one peer (request and response are both Sends,
  matched by ids inside the bodies).
- `Connect(peer, addrs)`: open a control connection to a peer we learned of.
- `SetTimer(at, key)`: call `on_timer(now, key)` at time `at` (one pending timer per key; a new
  one replaces it).
- `Emit(event)`: hand an event to the local application (for example `PeerJoined`).

`ReactiveCore` gives the no-op inputs to cores that only react to messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from p2pnet.wire import Envelope


@dataclass(frozen=True, slots=True)
class Publish:
    topic: str
    body: Any


@dataclass(frozen=True, slots=True)
class Send:
    peer: str
    body: Any


@dataclass(frozen=True, slots=True)
class Connect:
    peer: str
    addrs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SetTimer:
    at: float
    key: str


@dataclass(frozen=True, slots=True)
class Emit:
    event: Any


Effect = Publish | Send | Connect | SetTimer | Emit


class Core(Protocol):
    """What every protocol core offers to the worlds that drive it."""

    @property
    def topics(self) -> Sequence[str]:
        """Gossip topics the core wants to receive."""

    @property
    def kinds(self) -> Sequence[str]:
        """Message kinds the core handles (direct Sends and gossip alike)."""

    def start(self, now: float) -> list[Effect]: ...

    def on_message(self, now: float, envelope: Envelope[Any]) -> list[Effect]: ...

    def on_timer(self, now: float, key: str) -> list[Effect]: ...

    def on_rejected(self, now: float, peer: str, reason: str) -> list[Effect]: ...


class ReactiveCore:
    """A base for cores that only react to messages: no start-up work, timers or rejection logic."""

    topics: Sequence[str] = ()
    kinds: Sequence[str] = ()

    def start(self, now: float) -> list[Effect]:
        return []

    def on_timer(self, now: float, key: str) -> list[Effect]:
        return []

    def on_rejected(self, now: float, peer: str, reason: str) -> list[Effect]:
        return []
