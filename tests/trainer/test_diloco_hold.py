"""A StateRequest for a later round than the server's (`StateRequest.after_round`): the server
holds it while its state is still in that round, at most `STATE_HOLD_DEADLINES` x deadline_s
(`DilocoServing._state_past`), and counts its piece deadlines from the hold's end;
a request without the field (an older asker's) is answered at once. Driven on a mock clock
through the role's real `_on_frame`, with the sending itself noted, not done; and the wire form
both ways between an asker and a server a version apart. Then on a real data plane
(`tests.trainer.test_diloco_hostile.Listener`): askers that never read, the cap on held
requests, and an honest joiner served after them, a request needing no hold answered at once,
an asker leaving while held, an asker giving up on a stalling server. The room for held requests
(the places strangers may not take, the refusal an asker reads, what status shows):
tests/trainer/test_diloco_hold_room.py, on these helpers."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import cbor2
import pytest
import torch
import trio
import trio.testing

from p2pnet.dataplane import FrameReader, send_frame
from p2pnet.identity import Identity
from p2pnet.wire import DOMAIN, WIRE_VERSION, Codec
from tests.relay.test_hostile_listeners import drain_until_closed
from tests.trainer.test_diloco_hostile import HONEST, PEER, SLACK_S, Listener, asking
from tests.trainer.test_diloco_hostile import listener  # noqa: F401 (a fixture)
from trainer.diloco_inbox import RoundInbox
from trainer.diloco_local import GlobalState
from trainer.diloco_messages import STATE_PIECE_VALUES, StatePiece, StateRequest
from trainer.diloco_role import MAX_FRAME_BYTES, DilocoRole
from trainer.diloco_state_answer import STATE_HOLD_DEADLINES, STATE_HOLDS

DEADLINE_S, ROUNDS = 10.0, 8


# an asker's connection while it waits for its answer: it writes nothing, and keeps it open
SILENT = SimpleNamespace(receive_some=lambda max_bytes: trio.sleep_forever())


def _served(request: StateRequest, at_round: int = 3, moves: list[tuple[float, int]] = (), rounds: int = ROUNDS
            ) -> list[tuple[float, int, float]]:
    """The role's `_on_frame` takes `request` at time 0 while its state is of `at_round`; at each
    (time, round) of `moves` its state moves to that round (as `_round` and `_took` move it).
    Each state it sent: (when it began, of which round, the start its piece deadlines count from)."""
    sent: list[tuple[float, int, float]] = []

    async def main() -> None:
        role = DilocoRole.__new__(DilocoRole)
        role.config = SimpleNamespace(deadline_s=DEADLINE_S, rounds=rounds, trainers=())
        role.state = GlobalState(at_round, torch.zeros(4), torch.zeros(4))
        role.inbox, role.history = RoundInbox(), []  # (an open group, no round of ours yet: whom `_of_group` knows)
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
            assert await role._on_frame(SILENT, "asker", request, "diloco/state_request")
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
    """...and counts its piece deadlines from then, not from the longest hold's end: an asker that
    does not read holds the connection for the hold and a piece's deadline (`DilocoServing._hold`)."""
    assert _served(StateRequest(3, 3), moves=[(7.0, 4)]) == [(7.0, 4, 7.0)]


def test_a_request_held_while_our_round_never_ends_is_answered_at_the_limit_with_what_we_have():
    """Our round does not end within the hold (a stalled group): the asker takes our state of
    its round at the limit, whose piece deadlines it counts from there too (`fetch_state`)."""
    assert _served(StateRequest(3, 3)) == [(HOLD_S, 3, HOLD_S)]
    # a later move comes too late for this request: it was answered, once
    assert _served(StateRequest(3, 3), moves=[(HOLD_S + 1.0, 4)]) == [(HOLD_S, 3, HOLD_S)]


def test_a_request_without_a_later_round_or_one_waiting_cannot_help_is_answered_at_once():
    assert _served(StateRequest(3)) == [(0.0, 3, 0.0)]  # an older asker's, or a plain join
    assert _served(StateRequest(2, 2)) == [(0.0, 3, 0.0)]  # we are past its round already
    assert _served(StateRequest(5, 5)) == [(0.0, 3, 0.0)]  # it is ahead of us: we would wait for nothing
    assert _served(StateRequest(3, 3), at_round=ROUNDS, rounds=ROUNDS) == [(0.0, ROUNDS, 0.0)]  # no round left


def test_a_move_wakes_every_held_request_and_the_next_hold_waits_for_the_next_move():
    """Two held requests wake on one move; a request made after it is held for the move after."""
    sent: list[tuple[str, float, int]] = []

    async def main() -> None:
        role = DilocoRole.__new__(DilocoRole)
        role.config = SimpleNamespace(deadline_s=DEADLINE_S, rounds=ROUNDS, trainers=())
        role.state = GlobalState(3, torch.zeros(4), torch.zeros(4))
        role.inbox, role.history = RoundInbox(), []
        role._note_heard = lambda peer: None

        async def send_state(stream: Any, peer: str, start: float) -> None:
            sent.append((peer, trio.current_time(), role.state.round))
        role._send_state = send_state

        def move(round: int) -> None:
            role.state = GlobalState(round, torch.zeros(4), torch.zeros(4))
            role._state_moved()

        async with trio.open_nursery() as nursery:
            for asker in ("one", "two"):
                nursery.start_soon(role._on_frame, SILENT, asker, StateRequest(3, 3), "diloco/state_request")
            await trio.sleep(1.0)
            move(4)
            await trio.sleep(1.0)
            nursery.start_soon(role._on_frame, SILENT, "three", StateRequest(4, 4), "diloco/state_request")
            await trio.sleep(1.0)
            move(5)
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(sent) == [("one", 1.0, 4), ("three", 3.0, 5), ("two", 1.0, 4)]


def test_an_older_askers_request_reads_as_no_later_round_and_ours_is_its_fields_plus_trailing_ones():
    """An asker a version apart: its request (`[have_round]`) decodes here with `after_round`
    -1 (answered at once, above), one without `hears_full` as not reading `HoldsFull` (refused
    with a bare close, below); ours carries the new fields last, so an older server, which takes
    the fields it knows and ignores the rest (p2pnet.wire), reads the same `have_round`."""
    assert decode([3]) == StateRequest(3, -1, False)
    assert decode([3, 3]) == StateRequest(3, 3, False)
    assert decode([3, 3, True]) == StateRequest(3, 3, True)
    assert decode([3, 3, True, "later"]) == StateRequest(3, 3, True)
    ours = Codec(ASKER).encode(StateRequest(3, 3, hears_full=True), NOW)
    assert cbor2.loads(ours[:-64])[4] == [3, 3, True]  # (the payload, then its Ed25519 signature)
    assert Codec(None).decode(ours, NOW).body == StateRequest(3, 3, True)


# -- on a real data plane -------------------------------------------------------------------------

BIG = 8 << 20  # values: a 64 MiB answer, far more than the sockets' buffers hold


def _at(listener: Listener, round: int, values: int = BIG) -> None:
    """The listener's state moves to `round` (as `_round` moves it), which wakes its held requests."""
    listener.role.state = GlobalState(round, torch.ones(values), torch.zeros(values))
    listener.role._state_moved()


async def _until(check: Callable[[], bool]) -> None:
    with trio.fail_after(SLACK_S):
        while not check():
            await trio.sleep(0.01)


async def _ask(listener: Listener, who: Identity, after_round: int, hears_full: bool = False
               ) -> trio.SocketStream:
    """`who` asks for the state after `after_round` and reads nothing (as an older asker, which
    does not read `HoldsFull`, unless `hears_full`)."""
    stream = await listener.connect(who)
    await send_frame(stream, Codec(who).encode(StateRequest(after_round, after_round, hears_full), time.time()))
    return stream


def _fast(listener: Listener, deadline_s: float) -> None:
    listener.role.config.deadline_s = deadline_s
    # the rate's share of the bound negligible: what is left is the hold and the head start
    listener.role.config.state_min_bytes_per_s = 10**9


async def test_an_asker_that_does_not_read_its_held_answer_is_cut_a_piece_deadline_after_the_hold(
        listener: Listener) -> None:
    """Our round ends soon after the request came: the answer's piece deadlines count from then
    (`state_due` from the hold's end), so an asker that never reads is cut a piece's deadline
    later, not that and the longest hold (`STATE_HOLD_DEADLINES` x deadline_s) after it asked."""
    _fast(listener, 1.0)
    _at(listener, 3)
    stream = await _ask(listener, PEER, 3)
    async with stream:
        await _until(lambda: PEER.peer_id in listener.role.holding)
        moved = trio.current_time()
        _at(listener, 4)
        with trio.fail_at(listener.role.state_due(moved, BIG) + listener.role.config.deadline_s):
            while listener.plane.connections():  # never read: our answer gives up on it and closes
                await trio.sleep(0.02)
    assert not listener.role.holding


async def test_at_most_state_holds_requests_are_held_the_rest_refused_and_an_honest_joiner_is_served_after(
        listener: Listener) -> None:
    """Identities cost nothing, and each held request holds a connection and a task: at most
    `STATE_HOLDS` are held at once, one an asker; one more is refused (its connection closed,
    nothing written), an honest joiner's too while they are held. Once our round ends those that
    never read are cut (above), and the honest joiner asking then is held and gets the state of
    the round after its own, whole. (The askers held are members of our group, who may take
    every place: strangers take at most `STRANGER_HOLDS`, below. The refused ask as older askers
    do, not reading `HoldsFull`: they see a bare close.)"""
    _fast(listener, 1.0)
    listener.plane.admit_peer = lambda peer: None  # every identity of our table
    askers = [Identity.from_seed_text(f"held asker {i}") for i in range(STATE_HOLDS + 1)]
    listener.inbox.reserve(a.peer_id for a in askers)
    _at(listener, 3)
    held: list[trio.SocketStream] = []
    try:
        for i, asker in enumerate(askers[:STATE_HOLDS]):
            held.append(await _ask(listener, asker, 3))
            await _until(lambda: len(listener.role.holding) == i + 1)
            if i == 0:  # a second request of an asker held already
                async with await _ask(listener, asker, 3) as again:
                    assert await drain_until_closed(again, SLACK_S) == b""
        for who in (askers[-1], HONEST):  # the cap is reached
            async with await _ask(listener, who, 3) as refused:
                assert await drain_until_closed(refused, SLACK_S) == b""
        assert listener.role.holding == {a.peer_id for a in askers[:STATE_HOLDS]}
        moved = trio.current_time()
        _at(listener, 4)
        with trio.fail_at(listener.role.state_due(moved, BIG) + listener.role.config.deadline_s):
            while listener.plane.connections():  # none read: each answer gives up and closes
                await trio.sleep(0.02)
    finally:
        for stream in held:
            await stream.aclose()
    weights = torch.arange(5, dtype=torch.float32)
    async with await _ask(listener, HONEST, 4) as stream:
        await _until(lambda: HONEST.peer_id in listener.role.holding)
        listener.role.state = GlobalState(5, weights, torch.zeros(5))
        listener.role._state_moved()
        with trio.fail_after(SLACK_S):
            frame = await FrameReader(stream, max_frame_bytes=MAX_FRAME_BYTES).frame()
    piece = Codec(HONEST).decode(frame or b"", time.time()).body
    assert (piece.round, piece.offset, piece.length, piece.total) == (5, 0, 5, 5)
    assert piece.weights == weights.numpy().tobytes()


async def test_a_request_that_needs_no_hold_is_answered_at_once_while_state_holds_are_held(
        listener: Listener) -> None:
    """The cap bounds the requests we hold, not the others: while `STATE_HOLDS` strangers' requests
    for the round after ours are held, a joiner asking for the state after a round we are past
    already (its own, which ended as it asked) is answered at once, not refused."""
    _fast(listener, 1000.0)  # the hold's end far off
    listener.plane.admit_peer = lambda peer: None  # every identity of our table
    _at(listener, 3, values=4)
    members = [Identity.from_seed_text(f"held asker {i}") for i in range(STATE_HOLDS)]
    listener.inbox.reserve(m.peer_id for m in members)  # (members: they may take every place)
    held = [await _ask(listener, member, 3) for member in members]
    try:
        await _until(lambda: len(listener.role.holding) == STATE_HOLDS)
        async with await _ask(listener, HONEST, 2) as stream:
            with trio.fail_after(SLACK_S):
                frame = await FrameReader(stream, max_frame_bytes=MAX_FRAME_BYTES).frame()
        assert frame is not None, "refused"
        assert Codec(HONEST).decode(frame, time.time()).body.round == 3
        assert len(listener.role.holding) == STATE_HOLDS
    finally:
        for stream in held:
            await stream.aclose()


@pytest.mark.parametrize("leaves", ["closes", "writes"])
async def test_an_asker_that_leaves_while_held_frees_its_place_at_once(listener: Listener, leaves: str) -> None:
    """A held request's asker that closes its connection (or writes on it, out of turn: an honest
    one waits for its answer) frees its place among the `STATE_HOLDS` while our round goes on, not
    at the hold's end: a stranger cannot keep the places with requests it left, nor is a joiner
    that asks again (restarted, or on a new connection) refused as one held already."""
    _fast(listener, 1000.0)  # the hold's end far off: only the asker's leaving ends it
    _at(listener, 3, values=4)
    stream = await _ask(listener, PEER, 3)
    await _until(lambda: PEER.peer_id in listener.role.holding)
    if leaves == "closes":
        await stream.aclose()
    else:
        async with stream:
            await send_frame(stream, Codec(PEER).encode(StateRequest(3, 3), time.time()))
            assert await drain_until_closed(stream, SLACK_S) == b""  # rejected: nothing written
    await _until(lambda: not listener.role.holding)
    async with await _ask(listener, PEER, 3) as again:  # held, not refused
        await _until(lambda: PEER.peer_id in listener.role.holding)
        _at(listener, 4, values=4)
        with trio.fail_after(SLACK_S):
            frame = await FrameReader(again, max_frame_bytes=MAX_FRAME_BYTES).frame()
    assert Codec(PEER).decode(frame or b"", time.time()).body.round == 4


async def test_the_asker_gives_up_on_a_server_that_stalls_after_its_first_piece_from_that_piece_on() -> None:
    """The asker cannot tell how long its request is held, so its first piece is due from the
    longest hold's end; once that piece has come, the rest are due from its arrival (the server
    counts from before it sent it): a server that stalls then is given up a piece's deadline
    later, not that and the longest hold after the request."""
    server, values = Identity.from_seed_text("diloco stalling server"), 2 * STATE_PIECE_VALUES
    first_sent: list[float] = []

    async def serve(stream: trio.SocketStream) -> None:
        async with stream:
            await FrameReader(stream, max_frame_bytes=MAX_FRAME_BYTES).frame()  # the StateRequest: answered at once
            piece = StatePiece(4, values, 0, STATE_PIECE_VALUES, bytes(4 * STATE_PIECE_VALUES), bytes(4 * STATE_PIECE_VALUES))
            await send_frame(stream, Codec(server).encode(piece, time.time()))
            first_sent.append(trio.current_time())
            await trio.sleep_forever()  # then stalls

    async with asking(serve, values, 1.0, 10**9) as role:
        with pytest.raises(trio.TooSlowError):
            await role.fetch_state(server.peer_id, after_round=3)
        assert trio.current_time() < role.state_due(first_sent[0], values) + role.config.deadline_s
