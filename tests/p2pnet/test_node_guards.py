"""What a peer takes from others and from its operator, guarded where a helper's review found the
gaps: a banned peer's direct frames (only gossip was refused), a notice whose text is short in
characters but long in bytes (it passed the check and failed the frame's limit at the send,
stopping the peer), and more announced addresses than a heartbeat carries (a traceback at start)."""

from __future__ import annotations

import time
import types

import pytest
import trio

from p2pnet.errors import ConfigError
from p2pnet.identity import Identity
from p2pnet.messages import Capacity
from p2pnet.node import Node, PeerConfig
from p2pnet.notices import Notice
from p2pnet.peertable import LocalInfo, PeerTable, PeerTableConfig
from p2pnet.wire import Codec

ME, BANNED, OTHER = (Identity.from_seed_text(n) for n in ("me", "banned", "other"))


def test_a_banned_peers_direct_frames_reach_no_core():
    table = PeerTable(PeerTableConfig(reject_penalty=100.0), ME.peer_id,
                      LocalInfo((), "", (), Capacity(1, 1, 1)), int(time.time() * 1000))
    delivered = []
    node = types.SimpleNamespace(
        codec=Codec(ME), peertable=table, peer_id=ME.peer_id, stats={"received": 0, "rejected": 0},
        rejections={}, _runners=[], _routes={"notice": [types.SimpleNamespace(deliver=delivered.append)]})
    node._on_frame = lambda frame, via: Node._on_frame(node, frame, via)
    node._from_banned = lambda peer: Node._from_banned(node, peer)

    async def main() -> None:
        table.on_rejected(trio.current_time(), BANNED.peer_id, "garbage")  # one rejection bans it
        for sender, via in ((BANNED, BANNED), (BANNED, OTHER), (OTHER, BANNED), (OTHER, OTHER)):
            frame = Codec(sender).encode(Notice("n", f"from {sender.peer_id[-4:]}"), time.time())
            await Node._on_direct(node, frame, via.peer_id)

    trio.run(main)
    assert [e.sender for e in delivered] == [OTHER.peer_id]  # not from it, nor carried by it
    assert node.stats["banned_dropped"] == 3


def test_a_notice_is_limited_in_bytes():
    Notice("n", "a" * 1024)
    with pytest.raises(ValueError, match="1024 bytes"):
        Notice("n", "€" * 342)  # 1,026 bytes
    frame = Codec(ME).encode(Notice("n" * 64, "€" * 341), time.time())  # the most it allows fits its frame
    assert len(frame) <= 2048


@pytest.mark.parametrize("field, value, says", [
    ("announce", ("/ip6/0::0/tcp/4001",), "wildcard"),  # a wildcard, however spelled
    ("announce", ("/ip4/203.0.113.7/tcp/0",), "port 0"),
    ("announce", ("/not/a/multiaddr",), "not a multiaddr"),
    ("announce", ("/ip4/999.1.1.1/tcp/1",), "not a multiaddr"),
    ("announce", ("/ip4/203.0.113.7/udp/4001",), "TCP port"),
    ("data_announce", "[0::0]:4002", "concrete HOST:PORT"),
    ("data_announce", "[::ffff:0.0.0.0]:4002", "concrete HOST:PORT"),
    ("bootstrap", ("/ip4/203.0.113.7/tcp/99999/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo",),
     "not a multiaddr"),
    ("bootstrap", ("/ip4/203.0.113.7/tcp/4001/p2p/notapeerid",), "not a multiaddr"),
    ("bootstrap", ("/ip4/203.0.113.7/tcp/4001",), "has no /p2p/<peer id>"),
])
def test_addresses_in_the_settings_are_checked_as_addresses_not_as_text(field, value, says):
    """Wildcards spelled otherwise than 0.0.0.0 and ::, and multiaddrs that do not parse, were
    advertised as they were (or, as bootstrap addresses, retried for ever)."""
    with pytest.raises(ConfigError, match=field) as refused:
        PeerConfig(data_dir="/tmp/x", **{field: value})
    assert says in str(refused.value)


def test_concrete_addresses_in_the_settings_are_taken():
    PeerConfig(data_dir="/tmp/x", announce=("/ip4/203.0.113.7/tcp/4001", "/dns4/example.org/tcp/4001",
                                            "/ip6/2001:db8::7/tcp/4001"), data_announce="[2001:db8::7]:4002",
               bootstrap=("/ip4/203.0.113.7/tcp/4001/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo",))


def test_more_announced_addresses_than_a_heartbeat_carries_are_refused_by_the_settings():
    many = tuple(f"/ip4/203.0.113.{i}/tcp/4001" for i in range(17))
    with pytest.raises(ConfigError, match="at most 16 addresses"):
        PeerConfig(data_dir="/tmp/x", announce=many)
    with pytest.raises(ConfigError, match="longer than"):
        PeerConfig(data_dir="/tmp/x", announce=("/dns4/" + "a" * 250 + "/tcp/1",))
    PeerConfig(data_dir="/tmp/x", announce=many[:16])
