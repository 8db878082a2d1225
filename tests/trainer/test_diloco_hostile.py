"""Hostile input to the DiLoCo data channel (`DilocoRole._serve`) on a real data-plane listener
on loopback: what an admitted peer sends ends, at worst, its own connection; the listener goes on
serving honest peers, no connection is left counted, and none is held past our bounds (no whole
frame, or idle after one).

The role is a real `DilocoRole` with only what `_serve` reads set (no model is loaded: a role
whose model is still loading, `state` None, is the case a peer can reach first, since the channel
is registered before the load). Seeded; no timing asserts: deadlines scale with the work. What a
closed group refuses: tests/trainer/test_diloco_closed_group.py, on this listener.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio

from p2pnet.dataplane import DataPlane, DataPlaneLimits, FrameReader, open_data_stream, send_frame
from p2pnet.errors import PeerUnavailable
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from tests.relay.test_hostile_listeners import drain_until_closed
from trainer.diloco_inbox import RoundInbox
from trainer.diloco_local import GlobalState
from trainer.diloco_messages import CHANNEL, Idle, Join, Members, StatePiece, StateRequest, StateWanted
from trainer.diloco_role import (IDLE_WINDOWS, INBOX, MAX_FRAME_BYTES, STALL_WINDOWS, STATE_SEND_DEADLINES, DilocoConfig,
                                 DilocoRole)

ME = Identity.from_seed_text("diloco listener")
PEER = Identity.from_seed_text("diloco admitted peer")
HONEST = Identity.from_seed_text("diloco honest peer")  # admitted too, sends little
SEED = 20261205
SLACK_S = 10.0  # per connection


class Listener:
    """A DilocoRole's `_serve` on a real data plane that admits PEER only."""

    def __init__(self) -> None:
        role = object.__new__(DilocoRole)  # only what `_serve` and its answers read
        role.node = SimpleNamespace(codec=Codec(ME), peer_id=ME.peer_id,
                                    peertable=SimpleNamespace(with_role=lambda role: [], is_banned=lambda p, now: True),
                                    wait_for_peers=self._no_wait)
        role.config = SimpleNamespace(publish=False, rounds=10, deadline_s=5.0, trainers=(),
                                      state_min_bytes_per_s=DilocoConfig.state_min_bytes_per_s)
        role.state = None  # the model is still loading
        role.history, role.heard, role.granted_at, role.state_askers = [], set(), {}, {}
        role.outer_state_versions = set()
        role.inbox = self.inbox = RoundInbox()  # an open group: every sender shares the pool until `reserve`
        self.role = role
        self.plane = DataPlane("127.0.0.1", 0, codec=Codec(ME), self_id=ME.peer_id,
                               limits=DataPlaneLimits(handshake_timeout_s=2.0),
                               admit=lambda peer: None if peer in (PEER.peer_id, HONEST.peer_id) else "not in our peer table")
        self.plane.register(CHANNEL, role._serve)
        self.address = ""

    @staticmethod
    async def _no_wait(check, timeout_s: float) -> bool:
        return check()

    async def connect(self, who: Identity = PEER) -> trio.SocketStream:
        return await open_data_stream(self.address, CHANNEL, codec=Codec(who), peer=ME.peer_id)

    async def settle(self, connections: int) -> None:
        with trio.fail_after(SLACK_S * max(1, connections)):
            while self.plane.connections() or self.plane._open or self.plane._handshaking:
                await trio.sleep(0.02)

    async def state_of(self) -> list[StatePiece]:
        """An honest joiner's StateRequest: the pieces of our state."""
        stream = await self.connect()
        pieces = []
        async with stream:
            await send_frame(stream, Codec(PEER).encode(StateRequest(0), time.time()))
            reader = FrameReader(stream, max_frame_bytes=MAX_FRAME_BYTES)
            with trio.fail_after(SLACK_S):
                while True:
                    piece = Codec(PEER).decode(await reader.frame() or b"", time.time()).body
                    pieces.append(piece)
                    if piece.offset + piece.length == piece.total:
                        return pieces


@pytest.fixture
async def listener(nursery: trio.Nursery) -> Listener:
    listener = Listener()
    listener.address = await nursery.start(listener.plane.serve)
    return listener


async def test_a_state_request_before_our_model_is_loaded_ends_that_connection_only(listener: Listener) -> None:
    """The channel is registered before the model loads (`DilocoRole.run`): a joiner that asks
    for the state then gets its connection closed, and asks elsewhere or again; the peer goes on."""
    stream = await listener.connect()
    async with stream:
        await send_frame(stream, Codec(PEER).encode(StateRequest(0), time.time()))
        assert await drain_until_closed(stream, SLACK_S) == b""
    await listener.settle(1)
    weights = torch.arange(5, dtype=torch.float32)
    listener.role.state = GlobalState(3, weights, torch.zeros(5))  # loaded: the same listener serves it
    pieces = await listener.state_of()
    assert [(p.round, p.total, p.offset, p.length) for p in pieces] == [(3, 5, 0, 5)]
    assert pieces[0].weights == weights.numpy().tobytes()
    await listener.settle(1)


async def test_garbage_and_mutated_frames_end_only_their_connection(listener: Listener) -> None:
    rng = random.Random(SEED)
    codec = Codec(PEER)
    valid = [codec.encode(body, time.time()) for body in
             (Join(1, b"w" * 16, ()), Members(1, b"w" * 16, (PEER.peer_id,)), StateWanted(0, False), StateRequest(0))]
    frames: list[bytes] = [rng.randbytes(n) for n in (0, 1, 4, 17, 300, 4096)]
    for _ in range(40):
        mutated = bytearray(rng.choice(valid))
        for _ in range(rng.randrange(1, 3)):
            mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
        frames.append(bytes(mutated))
    frames.append(Codec(Identity.from_seed_text("someone else")).encode(Join(1, b"w" * 16, ()), time.time()))
    for frame in frames:
        stream = await listener.connect()
        async with stream:
            await send_frame(stream, frame)
            await stream.send_eof()
            await drain_until_closed(stream, SLACK_S)
    for size in (MAX_FRAME_BYTES + 1, 2**32 - 1):  # frames longer than any: closed at their header
        stream = await listener.connect()
        async with stream:
            await stream.send_all(size.to_bytes(4, "big"))
            assert await drain_until_closed(stream, SLACK_S) == b""
    await listener.settle(len(frames) + 2)
    while True:  # what got through was signed by PEER and well-formed: nothing else
        try:
            received = listener.inbox.receive_nowait()
        except trio.WouldBlock:
            break
        assert received.peer == PEER.peer_id and isinstance(received.body, (Join, Members))
    listener.role.state = GlobalState(0, torch.ones(3), torch.zeros(3))
    assert len(await listener.state_of()) == 1


async def test_a_connection_with_no_whole_frame_is_closed_but_one_idle_between_frames_stays(listener: Listener) -> None:
    """(e) Our deadline, not the peer's: a connection that sends nothing after its handshake, or
    half a frame, is closed after `STALL_WINDOWS` x `deadline_s`; an honest link that goes quiet
    between frames (a round's stages) is not, and its next frame is received (quiet for longer
    than `IDLE_WINDOWS` windows, it would be: see the last test)."""
    assert IDLE_WINDOWS > 2.5  # the quiet below stays under the idle bound
    listener.role.config.deadline_s = 0.5
    window_s = STALL_WINDOWS * listener.role.config.deadline_s
    join = Codec(PEER).encode(Join(1, b"w" * 16, ()), time.time())
    framed = len(join).to_bytes(4, "big") + join
    other = Codec(PEER).encode(Join(2, b"w" * 16, ()), time.time())
    other = len(other).to_bytes(4, "big") + other  # a whole frame, then half of the next

    async def stalls(prefix: bytes) -> None:
        stream = await listener.connect()
        async with stream:
            await stream.send_all(prefix)
            assert await drain_until_closed(stream, SLACK_S + 2 * window_s) == b""

    async def quiet_between_frames() -> None:
        stream = await listener.connect()
        async with stream:
            await stream.send_all(framed)
            await trio.sleep(2.5 * window_s)  # quiet for more than two windows: no stall
            await stream.send_all(framed)
            with trio.fail_after(SLACK_S):
                while sum(r.body.round == 1 for r in received) < 2:
                    received.append(await listener.inbox.receive())

    received: list[Any] = []

    async with trio.open_nursery() as nursery:
        for prefix in (b"", framed[:3], framed[:len(framed) // 2], other + other[:10]):
            nursery.start_soon(stalls, prefix)
        nursery.start_soon(quiet_between_frames)
    assert sorted(r.body.round for r in received) in ([1, 1], [1, 1, 2])  # (the stalled one's whole frame counts)
    await listener.settle(5)


async def test_connections_held_idle_after_one_valid_frame_are_closed_and_their_slots_freed(listener: Listener) -> None:
    """The hole: an admitted identity (they cost nothing) opens all the connections a peer may
    have, sends one valid frame on each and holds them idle; 64 such would hold every connection
    of our data plane. Each is closed `IDLE_WINDOWS` windows after its frame: told first (`Idle`)
    when its frame said it reads that, and closed a window later all the same when it does not
    close it then; closed without a word when its frame did not say so (an older sender: its
    watcher sees a plain close, as it would have any close). Then the peer's slots are free."""
    listener.role.config.deadline_s = 0.2
    window_s = STALL_WINDOWS * listener.role.config.deadline_s
    codec = Codec(PEER)
    per_peer = listener.plane.limits.max_connections_per_peer
    held = []
    for i in range(per_peer):
        held.append(await listener.connect())
        await send_frame(held[-1], codec.encode(Join(1, b"w" * 16, (), hears_idle=i % 2 == 0), time.time()))
    with trio.fail_after(SLACK_S):  # every frame arrived: each connection is idle from here
        for _ in range(per_peer):
            assert (await listener.inbox.receive()).body == Join(1, b"w" * 16, ())
    with pytest.raises(PeerUnavailable):
        await listener.connect()  # all this peer's slots are held
    told: dict[int, bytes] = {}

    async def hold(i: int) -> None:
        async with held[i]:
            told[i] = await drain_until_closed(held[i], SLACK_S + (IDLE_WINDOWS + 1) * window_s)

    async with trio.open_nursery() as nursery:
        for i in range(per_peer):
            nursery.start_soon(hold, i)
    for i, written in told.items():
        if i % 2:
            assert written == b""  # not told: a plain close
        else:
            assert int.from_bytes(written[:4], "big") == len(written) - 4
            notice = codec.decode(written[4:], time.time())
            assert notice.sender == ME.peer_id and notice.body == Idle(IDLE_WINDOWS * window_s)
    await listener.settle(per_peer)  # no connection left counted
    stream = await listener.connect()  # a slot is free again
    async with stream:
        await send_frame(stream, codec.encode(Join(2, b"w" * 16, ()), time.time()))
        with trio.fail_after(SLACK_S):
            assert (await listener.inbox.receive()).body == Join(2, b"w" * 16, ())


@pytest.mark.parametrize("ask", ["state", "offer"])
async def test_a_peer_that_asks_and_never_reads_our_answer_loses_its_connection(listener: Listener, ask: str) -> None:
    """A StateRequest is answered with the whole state (here 64 MiB, far more than the sockets'
    buffers hold): an asker that never reads held the connection, and the task writing to it,
    for ever. Each piece of the answer must be taken by its `state_due` time (the asker's own
    limit: `STATE_SEND_DEADLINES` x `deadline_s`, then `state_min_bytes_per_s`), a StateOffer within
    `deadline_s`; then the connection is closed and its slot freed."""
    listener.role.config.deadline_s = 0.2
    values = 8 << 20
    listener.role.state = GlobalState(3, torch.ones(values), torch.zeros(values))
    codec = Codec(PEER)
    body = codec.encode(StateWanted(0, False) if ask == "offer" else StateRequest(0), time.time())
    asks = len(body).to_bytes(4, "big") + body  # one framed ask
    if ask == "offer":  # an offer is small: 64 MiB of asks, none of the answers read, fill the buffers the same way
        asks *= 64 * 2**20 // len(asks)
    stream = await listener.connect()
    async with stream:
        with trio.move_on_after(SLACK_S):  # our own sends stop once the listener stops reading
            try:
                await stream.send_all(asks)
            except trio.BrokenResourceError:  # the listener gave up on us first, our asks unread: a reset
                pass
        # never read, and still open: the listener must give up on its answer and close
        await listener.settle(1 + STATE_SEND_DEADLINES)


async def _taken_in(listener: Listener, codec: Codec, sent: list[Any], count: int) -> list[Any]:
    """`sent` over one connection to `listener`'s role, and the first `count` bodies its round's
    inbox takes in."""
    stream = await listener.connect()
    async with stream:
        for body in sent:
            await send_frame(stream, codec.encode(body, time.time()))
        with trio.fail_after(SLACK_S):
            return [(await listener.inbox.receive()).body for _ in range(count)]


STEADY_STATE_VALUES = 4 << 20  # 32 MiB of state, 16 pieces: more than the sockets' buffers hold
STEADY_PAUSE_S = 0.1  # a piece per pause: about 20 MB/s, far above the least rate and far past the head start


async def test_a_large_state_taken_slowly_but_steadily_is_served_whole(listener: Listener) -> None:
    """The state's bound scales with its size: an asker that reads it at a steady rate above
    `state_min_bytes_per_s` gets it whole, however long past `STATE_SEND_DEADLINES` x
    `deadline_s` that takes (a fixed bound cut it there: 1.08 GB then needed 9 MB/s)."""
    listener.role.config.deadline_s = 0.05
    weights = torch.arange(STEADY_STATE_VALUES, dtype=torch.float32)
    listener.role.state = GlobalState(3, weights, torch.zeros(STEADY_STATE_VALUES))
    assert STEADY_STATE_VALUES // (256 * 1024) * STEADY_PAUSE_S > 4 * STATE_SEND_DEADLINES * 0.05
    codec = Codec(PEER)
    stream = await listener.connect()
    got = 0
    async with stream:
        await send_frame(stream, codec.encode(StateRequest(0), time.time()))
        reader = FrameReader(stream, max_frame_bytes=MAX_FRAME_BYTES)
        with trio.fail_after(SLACK_S + 32 * STEADY_PAUSE_S):
            while got < STEADY_STATE_VALUES:
                await trio.sleep(STEADY_PAUSE_S)  # a slow reader (the scenario, not a wait for an effect)
                frame = await reader.frame()
                assert frame is not None, f"cut after {got} values"
                piece = codec.decode(frame, time.time()).body
                assert piece.offset == got and piece.weights == weights[got:got + piece.length].numpy().tobytes()
                got += piece.length
    await listener.settle(1)


async def test_the_asker_waits_for_a_slow_steady_state_and_gives_up_on_a_stalled_one() -> None:
    """`fetch_state`, the asking end, bounds the transfer as the sending end does: a state
    coming steadily above `state_min_bytes_per_s` is taken whole however long past the head
    start; one that stops coming is given up (TooSlowError, which the joiner takes as that peer
    failing) once its next piece is overdue."""
    from trainer.diloco_messages import STATE_PIECE_VALUES

    values = STEADY_STATE_VALUES
    weights = torch.arange(values, dtype=torch.float32)
    stall_after: list[int] = []  # pieces the server sends before it stalls (none: all)

    async def serve(stream: trio.SocketStream) -> None:
        async with stream:
            await FrameReader(stream, max_frame_bytes=MAX_FRAME_BYTES).frame()  # the StateRequest
            for i, offset in enumerate(range(0, values, STATE_PIECE_VALUES)):
                if stall_after and i == stall_after[0]:
                    await trio.sleep_forever()
                await trio.sleep(STEADY_PAUSE_S)  # a slow sender (the scenario)
                end = min(values, offset + STATE_PIECE_VALUES)
                piece = StatePiece(5, values, offset, end - offset, weights[offset:end].numpy().tobytes(),
                                   bytes(4 * (end - offset)))
                await send_frame(stream, Codec(ME).encode(piece, time.time()))

    async with asking(serve, values, 0.05, DilocoConfig.state_min_bytes_per_s) as role:
        with trio.fail_after(SLACK_S + 32 * STEADY_PAUSE_S):
            fetched = await role.fetch_state(ME.peer_id)
        assert fetched.round == 5 and torch.equal(fetched.weights, weights)
        stall_after.append(2)
        with trio.fail_after(SLACK_S + role.state_due(0, values)):
            with pytest.raises(trio.TooSlowError):
                await role.fetch_state(ME.peer_id)


@asynccontextmanager
async def asking(serve: Callable[[trio.SocketStream], Awaitable[None]], values: int, deadline_s: float,
                 min_bytes_per_s: float) -> AsyncIterator[DilocoRole]:
    """A role of PEER's, its state of round 3 (`values` values), that asks for the state
    (`fetch_state`, of whichever peer it names) from `serve`, a plain TCP server on loopback,
    while the block runs."""
    role = object.__new__(DilocoRole)
    role.node = SimpleNamespace(codec=Codec(PEER))
    role.config = SimpleNamespace(trainers=(), deadline_s=deadline_s, state_min_bytes_per_s=min_bytes_per_s)
    role.state = GlobalState(3, torch.zeros(values), torch.zeros(values))
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]

        async def connect(peer: str) -> trio.SocketStream:
            return await trio.open_tcp_stream("127.0.0.1", port)
        role.open_stream = connect
        yield role
        nursery.cancel_scope.cancel()


async def test_a_sender_that_fills_its_share_of_the_inbox_loses_its_connection_not_the_others_their_place(
        listener: Listener) -> None:
    """Nothing reads the round's inbox while the inner steps run. A sender's frames beyond its
    `PEER_INBOX` places there wait at most `STALL_WINDOWS` x `deadline_s`, then its connection is
    closed ("inbox_full"; it held its reader unbounded, past the idle bound, once 256 filled the
    inbox), and another sender's frame still finds room, and is read among the first."""
    from trainer.diloco_role import PEER_INBOX

    listener.role.config.deadline_s = 0.2
    codec = Codec(PEER)
    frame = codec.encode(Join(1, b"w" * 16, ()), time.time())
    stream = await listener.connect()
    async with stream:
        with trio.move_on_after(SLACK_S):  # our sends stop once the listener stops reading
            try:
                for _ in range(INBOX + 1):
                    await send_frame(stream, frame)
            except trio.BrokenResourceError:
                pass
        await listener.settle(1)  # closed: no connection held
    honest = await listener.connect(HONEST)
    async with honest:
        await send_frame(honest, Codec(HONEST).encode(Join(1, b"h" * 16, ()), time.time()))
        with trio.fail_after(SLACK_S):
            senders = [(await listener.inbox.receive()).peer for _ in range(PEER_INBOX + 1)]
    assert senders == [PEER.peer_id] * PEER_INBOX + [HONEST.peer_id]


async def test_frames_no_round_of_ours_will_read_take_no_place_in_the_inbox(listener: Listener) -> None:
    """At round 3: Members of an older round and Parts of another round than ours are dropped
    where they come in (a round would skip them); a Join of ours, or of a later round, and
    Members of a later round (they tell us we are behind) take their place."""
    from trainer.diloco_messages import Part

    listener.role.state = GlobalState(3, torch.ones(4), torch.zeros(4))
    codec = Codec(PEER)

    def part(round: int) -> Part:
        return Part(round, b"m" * 16, 0, 0, 4, 0, 4, "fp32", 4, bytes(16), b"", ())
    sent = [Members(2, b"w" * 16, (PEER.peer_id,)), part(2), part(4), Join(3, b"w" * 16, ()), part(3),
            Members(4, b"w" * 16, (PEER.peer_id,)), Join(4, b"w" * 16, ())]
    received = await _taken_in(listener, codec, sent, 4)
    assert received == sent[3:]


async def test_a_peer_behind_that_we_cannot_tell_so_fills_no_place_in_the_inbox(listener: Listener) -> None:
    """A Join of an older round is answered with ours (`_tell_ahead`), on a link of its own. Its
    failure is no round's event: reported to the round's inbox (unread while the inner steps
    run, and uncounted), a listed peer sending old Joins and refusing our answers filled it, so
    that our next such answer held that peer's reader unbounded (its connection never ended)
    and an honest frame found no room ("inbox_full"). It reports nothing: the old peer's
    connection ends when it closes it, nothing waits in the inbox, an honest frame is read first."""
    listener.role.config.deadline_s = 0.2
    listener.role.state = GlobalState(3, torch.ones(4), torch.zeros(4))

    async def unreachable(peer: str) -> trio.SocketStream:
        raise PeerUnavailable(f"{peer} does not answer")
    listener.role.open_stream = unreachable
    codec = Codec(PEER)
    stream = await listener.connect()
    async with stream:
        for _ in range(INBOX + 1):
            await send_frame(stream, codec.encode(Join(2, b"w" * 16, ()), time.time()))
    await listener.settle(1)  # every frame read, its connection ended
    with pytest.raises(trio.WouldBlock):
        listener.inbox.receive_nowait()
    honest = await listener.connect(HONEST)
    async with honest:
        await send_frame(honest, Codec(HONEST).encode(Join(3, b"h" * 16, ()), time.time()))
        with trio.fail_after(SLACK_S):
            first = await listener.inbox.receive()
    assert first.peer == HONEST.peer_id and first.body == Join(3, b"h" * 16, ())
    await listener.settle(1)


def test_the_state_rate_is_checked_and_scales_the_bound_with_the_state(tmp_path) -> None:
    """`state_min_bytes_per_s` is at least 1 (0 would divide by zero, a negative rate would make
    every piece due before the request), an integer as TOML writes it; `state_due` gives the
    head start, then 8 bytes a value (a weight and its momentum, fp32) at that rate."""
    from p2pnet.config import from_mapping
    from p2pnet.errors import ConfigError
    from trainer.diloco_role import STATE_BYTES_PER_VALUE, DilocoConfig

    section = {"model_dir": str(tmp_path), "out_dir": str(tmp_path)}
    for bad in (0, -1, 1e6, True):
        with pytest.raises(ConfigError, match="state_min_bytes_per_s"):
            from_mapping(DilocoConfig, {**section, "state_min_bytes_per_s": bad}, "diloco")
    role = object.__new__(DilocoRole)
    role.config = from_mapping(DilocoConfig, {**section, "deadline_s": 2.0, "state_min_bytes_per_s": 4_000}, "diloco")
    assert STATE_BYTES_PER_VALUE == 2 * torch.finfo(torch.float32).bits // 8
    assert role.state_due(10.0, 0) == 10.0 + STATE_SEND_DEADLINES * 2.0
    assert role.state_due(10.0, 1_000) == 10.0 + STATE_SEND_DEADLINES * 2.0 + 2.0
