"""A wrong clock is named: stale rejections carry their offset, `ClockSkew` words one warning a
minute, and the node logs it where it logs rejections."""

import logging
from types import SimpleNamespace

from p2pnet.errors import MessageRejected, StaleMessage
from p2pnet.identity import Identity
from p2pnet.messages import Capacity, Heartbeat
from p2pnet.node import Node
from p2pnet.peertable import ClockSkew
from p2pnet.wire import Codec

NOW = 1_800_000_000.0
PEERS = [Identity.from_seed_text(f"peer{i}") for i in range(3)]


def beat() -> Heartbeat:
    return Heartbeat(1, 5, ("/ip4/127.0.0.1/tcp/1/p2p/x",), "127.0.0.1:2", ("relay",), Capacity(10, 20, 30))


def stale(sender: Identity, their_clock: float, our_clock: float) -> StaleMessage:
    try:
        Codec(None).decode(Codec(sender).encode(beat(), their_clock), our_clock)
    except StaleMessage as exc:
        return exc
    raise AssertionError("not rejected as stale")


def test_a_stale_rejection_carries_how_far_off_the_timestamp_was():
    behind = stale(PEERS[0], NOW, NOW - 400)  # our clock is 400 s behind theirs
    assert behind.reason == "stale" and isinstance(behind, MessageRejected)
    assert behind.sender == PEERS[0].peer_id and round(behind.age_s) == -400
    assert round(stale(PEERS[0], NOW - 900, NOW).age_s) == 900


def test_a_clock_400_s_behind_is_named_once_a_minute_with_the_number_of_peers():
    skew = ClockSkew(window_s=60.0, interval_s=60.0)
    rejections = [stale(p, NOW, NOW - 400) for p in PEERS]
    first = skew.observe(0.0, PEERS[0].peer_id, rejections[0])
    assert first is not None and "~400 s ahead of our clock" in first and "clock wrong" in first
    warned = [skew.observe(t / 10, PEERS[int(t) % 3].peer_id, rejections[int(t) % 3]) for t in range(1, 599)]
    assert warned == [None] * 598  # every stale frame is counted, none warns again within the minute
    again = skew.observe(60.0, PEERS[1].peer_id, rejections[1])
    assert again is not None and again.startswith("messages from 3 peers are ~400 s ahead")
    assert skew.stale_frames == 600


def test_other_rejections_are_not_clock_trouble_and_old_peers_are_forgotten():
    skew = ClockSkew(window_s=60.0, interval_s=60.0)
    assert skew.observe(0.0, "x", MessageRejected("bad_signature", "", "x")) is None
    assert skew.observe(0.0, PEERS[0].peer_id, stale(PEERS[0], NOW - 500, NOW)).startswith(
        "messages from 1 peer are ~500 s behind our clock")
    later = skew.observe(200.0, PEERS[1].peer_id, stale(PEERS[1], NOW - 450, NOW))
    assert later.startswith("messages from 1 peer are ~450 s behind")  # peer0 fell out of the window
    assert list(skew.offsets()) == [PEERS[1].peer_id] and round(skew.offsets()[PEERS[1].peer_id]) == 450


async def test_the_node_logs_the_skew_at_warning_where_it_rejects_the_frame(caplog):
    rejected = []
    fake = SimpleNamespace(
        codec=Codec(None), stats={"rejected": 0}, rejections={}, peer_id="me",
        peertable=SimpleNamespace(clock_skew=ClockSkew()),
        _runners=[SimpleNamespace(rejected=lambda peer, reason: rejected.append((peer, reason)))])
    frame = Codec(PEERS[0]).encode(beat(), 4_000_000_000.0)  # far in our future
    caplog.set_level(logging.INFO, logger="p2pnet.node")

    Node._on_frame(fake, frame, "via")
    Node._on_frame(fake, frame, "via")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ahead of our clock" in warnings[0] and "clock wrong" in warnings[0]
    assert fake.stats["rejected"] == 2
    assert rejected == []  # not scored: one wrong clock must not ban every neighbour
    Node._on_frame(fake, frame[:-1] + bytes([frame[-1] ^ 1]), "via")  # a bad signature still costs
    assert rejected == [("via", "bad_signature")]  # the forwarder: a bad signature names nobody
