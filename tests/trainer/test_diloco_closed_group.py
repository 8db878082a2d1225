"""A closed DiLoCo group (`[diloco] trainers`): the data channel refuses every frame of a peer it
does not list (on the real data-plane listener of tests/trainer/test_diloco_hostile.py), only
listed trainers are waited for, asked for the state or named in a round, and the config and the
command line say so. Moved out of test_diloco_hostile.py, unchanged."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio

from p2pnet.dataplane import send_frame
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from tests.relay.test_hostile_listeners import drain_until_closed
from tests.trainer.test_diloco_hostile import ME, PEER, SLACK_S, Listener, _taken_in
from tests.trainer.test_diloco_hostile import listener  # noqa: F401 (a fixture)
from trainer.diloco_local import GlobalState
from trainer.diloco_messages import Join, Members, StateRequest, StateWanted
from trainer.diloco_role import DilocoConfig, DilocoRole


async def test_a_closed_group_refuses_every_frame_of_a_peer_that_is_not_one_of_its_trainers(listener: Listener) -> None:
    """In an open group any admitted identity's Join counts, and one naming a later round sends
    us to fetch the state from its sender; with `[diloco] trainers` set, the frames of anyone
    else end their connection unread (`not_a_trainer`: not even decoded, so a stranger can make us
    take in and check no frame of up to MAX_FRAME_BYTES), and a listed trainer's still arrive."""
    listener.role.state = GlobalState(3, torch.ones(4), torch.zeros(4))
    codec = Codec(PEER)
    decoded: list[bytes] = []

    def decode(frame: bytes, now: float) -> Any:
        decoded.append(frame)
        return Codec(ME).decode(frame, now)
    listener.role.node.codec = SimpleNamespace(encode=Codec(ME).encode, decode=decode)
    listener.role.config.trainers = (Identity.from_seed_text("the only trainer").peer_id,)
    for body in (Join(9, b"w" * 16, ()), Members(9, b"w" * 16, (PEER.peer_id,)), StateRequest(0), StateWanted(0, False)):
        stream = await listener.connect()
        async with stream:
            await send_frame(stream, codec.encode(body, time.time()))
            assert await drain_until_closed(stream, SLACK_S) == b""  # no state, no offer: closed
        await listener.settle(1)
    assert len(listener.inbox) == 0 and not decoded  # nothing reached the round
    listener.role.config.trainers = (PEER.peer_id,)
    stream = await listener.connect()
    async with stream:
        await send_frame(stream, codec.encode(Join(9, b"w" * 16, ()), time.time()))
        with trio.fail_after(SLACK_S):
            assert (await listener.inbox.receive()).body == Join(9, b"w" * 16, ())


def test_a_closed_group_waits_for_and_fetches_from_its_listed_trainers_only(tmp_path) -> None:
    """`[diloco] trainers` is checked (peer ids), and a closed group's known trainers (whom a
    round invites and waits for, and a direct join asks for the state) are the listed ones in
    our peer table; a heartbeat claiming the role is not enough."""
    from p2pnet.config import from_mapping
    from p2pnet.errors import ConfigError
    from trainer.diloco_role import DilocoConfig

    with pytest.raises(ConfigError, match="trainers"):
        from_mapping(DilocoConfig, {"model_dir": str(tmp_path), "out_dir": str(tmp_path), "trainers": ["nope"]}, "diloco")
    listed, stranger = Identity.from_seed_text("listed trainer").peer_id, PEER.peer_id
    config = from_mapping(DilocoConfig, {"model_dir": str(tmp_path), "out_dir": str(tmp_path), "trainers": [listed]},
                          "diloco")
    assert config.trainers == (listed,)
    role = object.__new__(DilocoRole)
    entries = [SimpleNamespace(peer_id=p, data_addr="127.0.0.1:1") for p in (listed, stranger)]
    role.node = SimpleNamespace(peer_id=ME.peer_id, peertable=SimpleNamespace(
        with_role=lambda name: entries if name == "diloco" else [], is_banned=lambda p, now: False))
    role.config = config

    async def known() -> set[str]:
        return role._known_trainers()
    assert trio.run(known) == {listed}
    role.config = SimpleNamespace(trainers=())  # an open group: every peer claiming the role
    assert trio.run(known) == {listed, stranger}


def test_a_closed_group_lists_this_peer_and_at_least_min_peers(tmp_path) -> None:
    """The listed trainers refuse the frames of a peer they do not list: a list without our own
    id (one list copied to every peer) would leave us retrying for ever, never in a round; and a
    `min_peers` above the list's size would wait for ever before the first round. Both at start."""
    from p2pnet.config import from_mapping
    from p2pnet.errors import ConfigError
    from trainer.diloco_role import DilocoConfig

    other = Identity.from_seed_text("listed trainer").peer_id
    section = {"model_dir": str(tmp_path), "out_dir": str(tmp_path), "trainers": [other]}
    node = SimpleNamespace(peer_id=ME.peer_id, roles={})
    with pytest.raises(ConfigError, match="trainers"):
        DilocoRole(node, section)
    assert DilocoRole(node, {**section, "trainers": [other, ME.peer_id]}).config.trainers == (other, ME.peer_id)
    assert DilocoRole(node, {**section, "trainers": []}).config.trainers == ()  # open: as before
    with pytest.raises(ConfigError, match="min_peers"):
        from_mapping(DilocoConfig, {**section, "trainers": [other, ME.peer_id], "min_peers": 3}, "diloco")


async def test_a_closed_group_fetches_the_state_from_its_trainers_only() -> None:
    """Whoever named it (a members list, a hint), an unlisted peer is never asked for the state:
    `fetch_state` refuses it before connecting."""
    from p2pnet.errors import MessageRejected

    role = object.__new__(DilocoRole)
    role.config = SimpleNamespace(trainers=(Identity.from_seed_text("listed trainer").peer_id,), deadline_s=5.0)
    role.state = GlobalState(3, torch.ones(4), torch.zeros(4))

    async def no_connection(peer: str) -> Any:
        raise AssertionError(f"connected to {peer}")
    role.open_stream = no_connection
    with pytest.raises(MessageRejected, match="not_a_trainer"):
        await role.fetch_state(PEER.peer_id)


def test_the_command_line_closes_the_group(tmp_path) -> None:
    """`--diloco-trainer` (comma-separated or repeated, on every command that starts a peer) adds
    to `[diloco] trainers` through the real parser and overlay, after the file's; none given
    leaves the file's list (an open group when it has none); a value that is no peer id is the
    user's error, named by its flag."""
    import subprocess
    import sys

    from p2pnet.cli import build_parser, peer_configs
    from p2pnet.config import from_mapping
    from trainer.diloco_role import DilocoConfig

    a, b, c = (Identity.from_seed_text(f"trainer {name}").peer_id for name in "abc")
    config = tmp_path / "config.toml"
    config.write_text(f'[diloco]\nmodel_dir = "{tmp_path}"\nout_dir = "{tmp_path}"\ntrainers = ["{a}"]\n')

    def trainers(*argv: str) -> tuple[str, ...]:
        args = build_parser().parse_args([*argv, "--data-dir", str(tmp_path / "p"), "--config", str(config)])
        _, _, sections = peer_configs(args)
        return from_mapping(DilocoConfig, sections["diloco"], "diloco").trainers

    assert trainers("peer", "start", "--diloco-trainer", f"{b},{a}", "--diloco-trainer", c) == (a, b, c)
    assert trainers("trainer", "start", "--diloco-trainer", f" {c} ,") == (a, c)
    assert trainers("peer", "start") == (a,)
    config.write_text(f'[diloco]\nmodel_dir = "{tmp_path}"\nout_dir = "{tmp_path}"\n')
    assert trainers("peer", "start") == ()  # an open group, as before
    out = subprocess.run([sys.executable, "-m", "p2pnet", "peer", "start", "--data-dir", str(tmp_path / "p"),
                          "--diloco-trainer", f"{a},nope"], capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and "--diloco-trainer" in out.stderr and "'nope' is not a peer id" in out.stderr


async def test_a_closed_group_leaves_out_the_unlisted_peers_a_listed_one_names(listener: Listener) -> None:
    """A listed trainer whose own list differs names peers ours does not list: in its Join (a
    leader would wait a join deadline for them) or its Members (we would send them Parts). They
    are left out where the frame enters the round; a Members naming none of ours is dropped."""
    listed, stranger = Identity.from_seed_text("listed trainer").peer_id, Identity.from_seed_text("stranger").peer_id
    listener.role.config.trainers = (ME.peer_id, PEER.peer_id, listed)
    codec = Codec(PEER)
    sent = [Join(1, b"w" * 16, tuple(sorted((stranger, listed)))),
            Members(1, b"w" * 16, tuple(sorted((PEER.peer_id, stranger)))),
            Members(1, b"w" * 16, (stranger,)),  # none of ours: dropped
            Join(2, b"w" * 16, (listed,))]  # nothing to leave out
    received = await _taken_in(listener, codec, sent, 3)
    assert received == [Join(1, b"w" * 16, (listed,)), Members(1, b"w" * 16, (PEER.peer_id,)), Join(2, b"w" * 16, (listed,))]
    listener.role.config.trainers = ()  # an open group: names kept as sent
    assert await _taken_in(listener, codec, sent[:1], 1) == sent[:1]
