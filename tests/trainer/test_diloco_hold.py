"""A StateRequest for a later round than the server's (`StateRequest.after_round`): the server
holds it while its state is still in that round, at most `STATE_HOLD_DEADLINES` x deadline_s
(`DilocoServing._state_past`), and counts its piece deadlines from the end of that longest hold;
a request without the field (an older asker's) is answered at once. Driven on a mock clock
through the role's real `_on_frame`, with the sending itself noted, not done; and the wire form
both ways between an asker and a server a version apart."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import cbor2
import torch
import trio
import trio.testing

from p2pnet.identity import Identity
from p2pnet.wire import DOMAIN, WIRE_VERSION, Codec
from trainer.diloco_local import GlobalState
from trainer.diloco_messages import StateRequest
from trainer.diloco_role import DilocoRole
from trainer.diloco_serving import STATE_HOLD_DEADLINES

DEADLINE_S, ROUNDS = 10.0, 8


def _served(request: StateRequest, at_round: int = 3, moves: list[tuple[float, int]] = (), rounds: int = ROUNDS
            ) -> list[tuple[float, int, float]]:
    """The role's `_on_frame` takes `request` at time 0 while its state is of `at_round`; at each
    (time, round) of `moves` its state moves to that round (as `_round` and `_took` move it).
    Each state it sent: (when it began, of which round, the start its piece deadlines count from)."""
    sent: list[tuple[float, int, float]] = []

    async def main() -> None:
        role = DilocoRole.__new__(DilocoRole)
        role.config = SimpleNamespace(deadline_s=DEADLINE_S, rounds=rounds)
        role.state = GlobalState(at_round, torch.zeros(4), torch.zeros(4))
        role._note_heard = lambda peer: None

        async def send_state(stream: Any, peer: str, start: float) -> None:
            sent.append((trio.current_time(), role.state.round, start))
        role._send_state = send_state

        async def world() -> None:
            for at, round in moves:
                await trio.sleep_until(at)
                role.state = GlobalState(round, torch.zeros(4), torch.zeros(4))
                role._state_moved()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(world)
            assert await role._on_frame(None, "asker", request, "diloco/state_request")
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return sent


HOLD_S = STATE_HOLD_DEADLINES * DEADLINE_S
ASKER, NOW = Identity.from_seed_text("diloco hold asker"), 1_800_000_000.0


def decode(fields: list[Any]) -> Any:
    """A StateRequest of `fields`, built as a peer of any version builds it (canonical CBOR,
    signed over DOMAIN || payload, as tests/p2pnet/test_wire_evolution.py does), as we decode it."""
    payload = cbor2.dumps([WIRE_VERSION, "diloco/state_request", ASKER.peer_id_bytes, int(NOW * 1000), fields],
                          canonical=True)
    return Codec(None).decode(payload + ASKER.sign(DOMAIN + payload), NOW).body


def test_a_request_for_the_round_after_ours_is_answered_when_our_round_ends():
    assert _served(StateRequest(3, 3), moves=[(7.0, 4)]) == [(7.0, 4, HOLD_S)]


def test_a_request_held_while_our_round_never_ends_is_answered_at_the_limit_with_what_we_have():
    """Our round does not end within the hold (a stalled group): the asker takes our state of
    its round at the limit, whose piece deadlines it counts from there too (`fetch_state`)."""
    assert _served(StateRequest(3, 3)) == [(HOLD_S, 3, HOLD_S)]
    # a later move comes too late for this request: it was answered, once
    assert _served(StateRequest(3, 3), moves=[(HOLD_S + 1.0, 4)]) == [(HOLD_S, 3, HOLD_S)]


def test_a_request_without_a_later_round_or_one_waiting_cannot_help_is_answered_at_once():
    assert _served(StateRequest(3)) == [(0.0, 3, 0.0)]  # an older asker's, or a plain join
    assert _served(StateRequest(2, 2)) == [(0.0, 3, HOLD_S)]  # we are past its round already
    assert _served(StateRequest(5, 5)) == [(0.0, 3, HOLD_S)]  # it is ahead of us: we would wait for nothing
    assert _served(StateRequest(3, 3), at_round=ROUNDS, rounds=ROUNDS) == [(0.0, ROUNDS, HOLD_S)]  # no round left


def test_a_move_wakes_every_held_request_and_the_next_hold_waits_for_the_next_move():
    """Two held requests wake on one move; a request made after it is held for the move after."""
    sent: list[tuple[str, float, int]] = []

    async def main() -> None:
        role = DilocoRole.__new__(DilocoRole)
        role.config = SimpleNamespace(deadline_s=DEADLINE_S, rounds=ROUNDS)
        role.state = GlobalState(3, torch.zeros(4), torch.zeros(4))
        role._note_heard = lambda peer: None

        async def send_state(stream: Any, peer: str, start: float) -> None:
            sent.append((peer, trio.current_time(), role.state.round))
        role._send_state = send_state

        def move(round: int) -> None:
            role.state = GlobalState(round, torch.zeros(4), torch.zeros(4))
            role._state_moved()

        async with trio.open_nursery() as nursery:
            for asker in ("one", "two"):
                nursery.start_soon(role._on_frame, None, asker, StateRequest(3, 3), "diloco/state_request")
            await trio.sleep(1.0)
            move(4)
            await trio.sleep(1.0)
            nursery.start_soon(role._on_frame, None, "three", StateRequest(4, 4), "diloco/state_request")
            await trio.sleep(1.0)
            move(5)
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(sent) == [("one", 1.0, 4), ("three", 3.0, 5), ("two", 1.0, 4)]


def test_an_older_askers_request_reads_as_no_later_round_and_ours_is_its_fields_plus_one_trailing():
    """An asker a version apart: its request (`[have_round]`) decodes here with `after_round`
    -1 (answered at once, above); ours carries the new field last, so an older server, which
    takes the fields it knows and ignores the rest (p2pnet.wire), reads the same `have_round`."""
    assert decode([3]) == StateRequest(3, -1)
    assert decode([3, 3]) == StateRequest(3, 3)
    assert decode([3, 3, "later"]) == StateRequest(3, 3)
    ours = Codec(ASKER).encode(StateRequest(3, 3), NOW)
    assert cbor2.loads(ours[:-64])[4] == [3, 3]  # (the payload, then its Ed25519 signature)
    assert Codec(None).decode(ours, NOW).body == StateRequest(3, 3)
