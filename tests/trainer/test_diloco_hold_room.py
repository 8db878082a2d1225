"""Room for held StateRequests (`trainer.diloco_state_answer`): strangers take at most
`STRANGER_HOLDS` of the `STATE_HOLDS` places once we finished a round, a member of our group
takes any, and one more is refused (`HoldsFull`), which an asker that reads it takes as no
failure, asking the next trainer peer; a `HoldsFull` after a state piece is the server's fault;
and the places in use and the refusals show in `status()`. On a real data plane
(`tests.trainer.test_diloco_hostile.Listener`), with the helpers of tests/trainer/test_diloco_hold.py.
Moved out of test_diloco_hold.py, unchanged (but the status test, new)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio
import trio.testing

from p2pnet.control import ControlServer, call
from p2pnet.dataplane import FrameReader, send_frame
from p2pnet.errors import MessageRejected
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from tests.relay.test_hostile_listeners import drain_until_closed
from tests.trainer.test_diloco_hold import _ask, _at, _fast, _until
from tests.trainer.test_diloco_hostile import HONEST, ME, PEER, SLACK_S, Listener, asking
from tests.trainer.test_diloco_hostile import listener  # noqa: F401 (a fixture)
from trainer.diloco_catchup import JoinPath, StateRefused
from trainer.diloco_local import GlobalState
from trainer.diloco_messages import STATE_PIECE_VALUES, HoldsFull, StatePiece
from trainer.diloco_role import MAX_FRAME_BYTES, DilocoRole, Phase
from trainer.diloco_state_answer import STATE_HOLDS, STRANGER_HOLDS


async def test_a_refusal_after_the_first_piece_is_a_bad_state_not_room() -> None:
    """`HoldsFull` answers a request instead of the state: a server that sends it once it has
    begun to send the state (a liar, or broken) sent a state that does not fit, its fault
    ("bad_state"), not a refusal for room the asker logs as no failure."""
    server, values = Identity.from_seed_text("diloco refusing liar"), 2 * STATE_PIECE_VALUES

    async def serve(stream: trio.SocketStream) -> None:
        async with stream:
            await FrameReader(stream, max_frame_bytes=MAX_FRAME_BYTES).frame()  # the StateRequest: answered at once
            piece = StatePiece(4, values, 0, STATE_PIECE_VALUES, bytes(4 * STATE_PIECE_VALUES),
                               bytes(4 * STATE_PIECE_VALUES))
            await send_frame(stream, Codec(server).encode(piece, time.time()))
            await send_frame(stream, Codec(server).encode(HoldsFull(4, STATE_HOLDS, 0), time.time()))
            await trio.sleep_forever()

    async with asking(serve, values, 1.0, 10**9) as role:
        with pytest.raises(MessageRejected) as rejected:
            await role.fetch_state(server.peer_id, after_round=3)
    assert rejected.value.reason == "bad_state"


async def _refusal(stream: trio.SocketStream) -> object:
    """What a refused asker that reads `HoldsFull` reads, once its connection is closed after it."""
    with trio.fail_after(SLACK_S):
        frame = await FrameReader(stream, max_frame_bytes=MAX_FRAME_BYTES).frame()
    assert await drain_until_closed(stream, SLACK_S) == b""
    return Codec(None).decode(frame or b"", time.time()).body


async def _strangers_fill_their_places(listener: Listener, held: list[trio.SocketStream]) -> None:
    """`STATE_HOLDS` strangers ask for the state after our round 3: the first `STRANGER_HOLDS`
    are held (their connections kept in `held`), the rest refused, naming the places kept."""
    for i in range(STATE_HOLDS):  # strangers: as many as there are places
        stranger = Identity.from_seed_text(f"stranger {i}")
        stream = await _ask(listener, stranger, 3, hears_full=True)
        if i >= STRANGER_HOLDS:
            async with stream:
                kept = STATE_HOLDS - STRANGER_HOLDS  # the places only a member takes
                assert await _refusal(stream) == HoldsFull(3, STRANGER_HOLDS, kept)
            continue
        held.append(stream)
        await _until(lambda: stranger.peer_id in listener.role.holding)  # noqa: B023 (awaited here)


async def test_strangers_holding_every_place_they_may_take_leave_a_members_request_held_and_served(
        listener: Listener) -> None:
    """In an open group any identity may ask for the state after our round, and a held request
    is kept until our round ends: strangers asking first hold at most `STRANGER_HOLDS` places, the
    rest are refused (`HoldsFull`, naming the places kept), and a member of our group left out of
    our round (its whole contribution taken by the last round we finished: `contributed`) is
    still held, and served our next round's state."""
    _fast(listener, 1000.0)  # the hold's end far off: only our round's end ends it
    listener.plane.admit_peer = lambda peer: None  # every identity of our table
    listener.role.history = [{"members": [ME.peer_id, PEER.peer_id]}]  # a round of ours finished: strangers capped
    listener.role.contributed = frozenset({ME.peer_id, PEER.peer_id})
    _at(listener, 3, values=4)
    held: list[trio.SocketStream] = []
    try:
        await _strangers_fill_their_places(listener, held)
        async with await _ask(listener, PEER, 3, hears_full=True) as member:
            await _until(lambda: PEER.peer_id in listener.role.holding)
            _at(listener, 4, values=4)
            with trio.fail_after(SLACK_S):
                frame = await FrameReader(member, max_frame_bytes=MAX_FRAME_BYTES).frame()
        assert Codec(PEER).decode(frame or b"", time.time()).body.round == 4
    finally:
        for stream in held:
            await stream.aclose()


@pytest.mark.parametrize("admitted", ["last round", "our round"])
async def test_an_identity_only_admitted_to_a_round_shares_the_strangers_places(listener: Listener,
                                                                               admitted: str) -> None:
    """In an open group a Join gets any identity into a round's members while there is room: one
    listed in the last round we finished (`history`), or in our round, decided (the inbox keeps
    its places: `reserved`), whose contribution did not reach every shard (it sent none, or only
    a part) is no member of ours for the held places: once strangers hold theirs it is refused
    (`HoldsFull`, counted a stranger's), not held in the places kept for our group."""
    _fast(listener, 1000.0)  # the hold's end far off: only our round's end ends it
    listener.plane.admit_peer = lambda peer: None  # every identity of our table
    listener.role.history = [{"members": [ME.peer_id, PEER.peer_id] if admitted == "last round" else [ME.peer_id],
                              "contributors": [ME.peer_id, PEER.peer_id]}]  # (a part from it, to one shard)
    if admitted == "our round":
        listener.inbox.reserve([ME.peer_id, PEER.peer_id])
    listener.role.contributed = frozenset({ME.peer_id})
    _at(listener, 3, values=4)
    held: list[trio.SocketStream] = []
    try:
        await _strangers_fill_their_places(listener, held)
        async with await _ask(listener, PEER, 3, hears_full=True) as admitted_once:
            assert await _refusal(admitted_once) == HoldsFull(3, STRANGER_HOLDS, STATE_HOLDS - STRANGER_HOLDS)
        assert PEER.peer_id not in listener.role.holding
        assert (listener.role.refused_strangers, listener.role.refused_members) == (STATE_HOLDS - STRANGER_HOLDS + 1, 0)
    finally:
        for stream in held:
            await stream.aclose()


async def test_in_a_closed_group_every_listed_trainer_takes_any_place(listener: Listener) -> None:
    """A closed group's data channel reads its listed trainers only, so each is of our group
    (`config.trainers`), whatever the last round we finished took from it: listed trainers left
    out of that round, no contribution of theirs taken, are held in every place, not capped at
    `STRANGER_HOLDS` as strangers."""
    _fast(listener, 1000.0)  # the hold's end far off: only our round's end ends it
    listener.plane.admit_peer = lambda peer: None  # every identity of our table
    listed = [Identity.from_seed_text(f"listed trainer {i}") for i in range(STATE_HOLDS)]
    listener.role.config.trainers = (ME.peer_id, *(t.peer_id for t in listed))
    listener.role.history = [{"members": [ME.peer_id]}]  # a round of ours finished: strangers are capped
    listener.role.contributed = frozenset({ME.peer_id})
    _at(listener, 3, values=4)
    held: list[trio.SocketStream] = []
    try:
        for i, trainer in enumerate(listed):
            held.append(await _ask(listener, trainer, 3, hears_full=True))
            await _until(lambda: len(listener.role.holding) == i + 1)  # noqa: B023 (awaited here)
        assert not listener.role.strangers_held and listener.role.refused_strangers == 0
    finally:
        for stream in held:
            await stream.aclose()


async def test_before_our_first_round_ends_strangers_may_take_every_place(listener: Listener) -> None:
    """An open group's first round (no round of ours finished: `history` empty): every asker for
    the state after it is a stranger, as is every joiner left out of it, and no member of ours can
    be left out yet, so none is capped at `STRANGER_HOLDS`: `STATE_HOLDS` are held, as before
    places were kept, and only one more is refused, naming no places kept."""
    _fast(listener, 1000.0)  # the hold's end far off: only our round's end ends it
    listener.plane.admit_peer = lambda peer: None  # every identity of our table
    _at(listener, 0, values=4)
    held: list[trio.SocketStream] = []
    try:
        for i in range(STATE_HOLDS):  # honest joiners left out of our first round, as strangers are
            held.append(await _ask(listener, Identity.from_seed_text(f"joiner {i}"), 0, hears_full=True))
            await _until(lambda: len(listener.role.holding) == i + 1)  # noqa: B023 (awaited here)
        async with await _ask(listener, HONEST, 0, hears_full=True) as refused:
            assert await _refusal(refused) == HoldsFull(0, STATE_HOLDS, 0)
    finally:
        for stream in held:
            await stream.aclose()


async def test_a_server_with_no_room_says_so_and_the_asker_takes_the_next_trainer_peers_state(
        listener: Listener, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    """A server holding every place refuses our request for the state after our round with
    `HoldsFull`, as we ask it to (`hears_full`): the asker knows it was refused for room
    (`StateRefused`, not "ended the state after 0 of N values", which a broken server shows too),
    logs it as no failure and takes the next trainer peer's state at once. Two real data planes."""
    _fast(listener, 1000.0)  # the hold's end far off
    listener.plane.admit_peer = lambda peer: None  # every identity of our table
    _at(listener, 3, values=4)
    members = [Identity.from_seed_text(f"held asker {i}") for i in range(STATE_HOLDS)]
    listener.inbox.reserve(m.peer_id for m in members)
    held = [await _ask(listener, member, 3) for member in members]
    free = Listener()  # past round 3: answers at once
    free.address = await nursery.start(free.plane.serve)
    weights = torch.arange(4, dtype=torch.float32)
    free.role.state = GlobalState(4, weights, torch.zeros(4))
    servers = {"a full": listener, "b free": free}

    async def connect(peer: str) -> trio.SocketStream:
        return await servers[peer].connect(HONEST)

    role = object.__new__(DilocoRole)  # HONEST's, left out of round 3: only what catching up reads
    role.node = SimpleNamespace(codec=Codec(HONEST))
    role.config = SimpleNamespace(trainers=(), deadline_s=1000.0, state_min_bytes_per_s=10**9)
    role.state = GlobalState(3, torch.zeros(4), torch.zeros(4))
    role.open_stream = connect
    role._known_trainers = lambda: set(servers)
    role.suspects, role.fetched, role.state_via_counts = set(), [], {path: 0 for path in JoinPath}
    role._adopt = lambda state: setattr(role, "state", state)
    try:
        await _until(lambda: len(listener.role.holding) == STATE_HOLDS)
        with pytest.raises(StateRefused) as refused:
            await role.fetch_state("a full", after_round=3)
        assert refused.value.full == HoldsFull(3, STATE_HOLDS, 0)
        with caplog.at_level(logging.INFO, logger="trainer.diloco_role"):
            await role._catch_up_directly(None, 3)  # "a full" first, then "b free"
    finally:
        for stream in held:
            await stream.aclose()
    assert role.state.round == 4 and torch.equal(role.state.weights, weights)
    assert [f["from"] for f in role.fetched] == ["b free"]
    assert role.state_asks_refused == 1  # (`status()` shows it: the test below)
    lines = [r.getMessage() for r in caplog.records if r.name == "trainer.diloco_role"]
    assert any(line.startswith("diloco: a full had no room to hold our request") for line in lines), lines
    assert not any("failed" in line for line in lines), lines


async def _status(listener: Listener, control_dir: Path) -> dict[str, Any]:
    """The listener role's `status()` as `p2pnet peer status --json` reads it: through a real
    control socket, under `role_status` as `run_node`'s status command nests it (the role's other
    fields, which `_serve` does not read, set to a fresh role's)."""
    role = listener.role
    for name, value in (("done", False), ("phase", Phase.STARTING), ("fetched", []), ("rejected", {}),
                        ("suspects", set()), ("published", []), ("state_via", None), ("with_outer_state", []),
                        ("outer_state_bytes", 0), ("state_via_counts", {path: 0 for path in JoinPath})):
        if not hasattr(role, name):
            setattr(role, name, value)
    role.config.encoding, role.config.inner_steps = "int8", 1
    control = ControlServer(control_dir)

    async def status(request: dict[str, Any], reply: Any) -> dict[str, Any]:
        return {"role_status": {"diloco": role.status()}}

    control.register("status", status)
    async with trio.open_nursery() as nursery:
        await nursery.start(control.serve)
        answer = await call(control_dir, {"cmd": "status"})
        nursery.cancel_scope.cancel()
    return answer["role_status"]["diloco"]


async def test_held_places_and_refusals_for_room_show_in_status(listener: Listener, tmp_path: Path) -> None:
    """An operator sees the held requests' places in use and the requests refused for room, of
    strangers and of members (`status()["state_holds"]`), and an asker how often it was refused
    (`state_asks_refused`, in the test above's role): strangers fill their `STRANGER_HOLDS`
    places and two more are refused; members fill the rest and one more member is refused; once
    the askers leave, no place is in use and the refusals stay counted."""
    _fast(listener, 1000.0)  # the hold's end far off: only the askers' leaving ends a hold
    listener.plane.admit_peer = lambda peer: None  # every identity of our table
    members = [Identity.from_seed_text(f"counted member {i}") for i in range(STATE_HOLDS - STRANGER_HOLDS + 1)]
    listener.role.contributed = frozenset(m.peer_id for m in members)
    listener.role.history = [{"members": [ME.peer_id]}]  # a round of ours finished: strangers are capped
    _at(listener, 3, values=4)
    before = await _status(listener, tmp_path)
    assert before["state_holds"] == {"held": 0, "held_strangers": 0, "places": STATE_HOLDS,
                                     "stranger_places": STRANGER_HOLDS, "refused_members": 0, "refused_strangers": 0}
    assert before["state_asks_refused"] == 0
    held: list[trio.SocketStream] = []
    try:
        for i in range(STRANGER_HOLDS + 2):
            stream = await _ask(listener, Identity.from_seed_text(f"counted stranger {i}"), 3, hears_full=True)
            if i >= STRANGER_HOLDS:
                async with stream:
                    assert isinstance(await _refusal(stream), HoldsFull)
                continue
            held.append(stream)
            await _until(lambda: len(listener.role.holding) == i + 1)  # noqa: B023 (awaited here)
        for i, member in enumerate(members):
            stream = await _ask(listener, member, 3, hears_full=True)
            if i == len(members) - 1:
                async with stream:
                    assert await _refusal(stream) == HoldsFull(3, STATE_HOLDS, 0)
                continue
            held.append(stream)
            await _until(lambda: len(listener.role.holding) == STRANGER_HOLDS + i + 1)  # noqa: B023 (awaited here)
        full = await _status(listener, tmp_path)
        assert full["state_holds"] == {"held": STATE_HOLDS, "held_strangers": STRANGER_HOLDS, "places": STATE_HOLDS,
                                       "stranger_places": STRANGER_HOLDS, "refused_members": 1, "refused_strangers": 2}
    finally:
        for stream in held:
            await stream.aclose()
    await _until(lambda: not listener.role.holding)
    after = await _status(listener, tmp_path)
    assert after["state_holds"] == full["state_holds"] | {"held": 0, "held_strangers": 0}
