"""The peer table core, fed by hand: no clock, no network."""

import math
from dataclasses import replace

import pytest

from p2pnet.core import Connect, Emit, Publish, Send, SetTimer
from p2pnet.errors import ConfigError
from p2pnet.identity import Identity
from p2pnet.messages import HEARTBEAT_TOPIC, Capacity, Heartbeat
from p2pnet.peertable import (GROWTH_PER_BEAT, MAX_REMEMBERED, REPLAY_MEMORY_S, TIMER_EXPIRE, TIMER_HEARTBEAT,
                              LeftBecause, LocalInfo, PeerJoined, PeerLeft, PeerTable, PeerTableConfig)
from p2pnet.wire import Envelope

ME = Identity.from_seed_text("me").peer_id
BOB = Identity.from_seed_text("bob").peer_id
LOCAL = LocalInfo(("/ip4/127.0.0.1/tcp/1/p2p/me",), "127.0.0.1:9", ("relay",), Capacity(1, 2, 3))


def table(**kw) -> PeerTable:
    return PeerTable(PeerTableConfig(heartbeat_interval_s=1.0, expiry_s=3.0, **kw), ME, LOCAL, started_ms=100)


def beat_from(peer: str, seq: int, started_ms: int = 7, interval_ms: int = 0) -> Envelope:
    body = Heartbeat(seq, started_ms, ("/ip4/127.0.0.1/tcp/2/p2p/x",), "127.0.0.1:8", ("worker",), Capacity(5, 6, 7),
                     interval_ms=interval_ms)
    return Envelope("heartbeat", peer, b"", 0, body, 100)


def test_start_publishes_a_heartbeat_and_schedules_the_next():
    effects = table().start(10.0)
    assert isinstance(effects[0], Publish) and effects[0].topic == HEARTBEAT_TOPIC
    assert effects[0].body.roles == ("relay",) and effects[0].body.seq == 1
    assert effects[1] == SetTimer(11.0, TIMER_HEARTBEAT)
    assert effects[2] == SetTimer(11.0, TIMER_EXPIRE)


def filled(t: PeerTable, others: int, now: float = 0.0, interval_ms: int = 0) -> PeerTable:
    """`t` after hearing one heartbeat (declaring `interval_ms`) from each of `others` peers at `now`."""
    for i in range(others):
        t.on_message(now, beat_from(f"peer-{i}", 1, interval_ms=interval_ms))
    return t


def next_beat(t: PeerTable, now: float) -> tuple[int, float]:
    """(the interval our heartbeat at `now` declares in ms, when the timer it sets fires)."""
    publish, timer = t.on_timer(now, TIMER_HEARTBEAT)
    assert isinstance(publish, Publish) and timer.key == TIMER_HEARTBEAT
    return publish.body.interval_ms, timer.at


def test_a_small_table_keeps_the_base_spacing_and_declares_it():
    t = filled(PeerTable(PeerTableConfig(), ME, LOCAL, started_ms=100), 9)  # defaults: 2 s, 5 heard a second
    assert t.start(0.0)[0].body.interval_ms == 2000
    assert next_beat(t, 2.0) == (2000, 4.0)
    t.on_message(3.0, beat_from("peer-10", 1))  # a tenth other peer: 11 / 5 = 2.2 s
    assert next_beat(t, 4.0) == (2200, 4.0 + 2.2)


def test_the_spacing_grows_with_the_table_and_is_capped():
    config = PeerTableConfig(heartbeat_interval_s=2.0, expiry_s=10.0, max_heard_per_s=5.0, max_interval_s=30.0)
    t = PeerTable(config, ME, LOCAL, started_ms=100)
    t.start(0.0)
    settled, now = [], 0.0
    for others in (49, 99, 149, 500):
        filled(t, others, now=now)
        for _ in range(6):  # it grows by at most 1.5 times a beat (and a third of a horizon)
            declared_ms, at = next_beat(t, now)
            assert declared_ms == pytest.approx((at - now) * 1000, abs=1)  # it declares the timer it sets
            now = at
        settled.append(declared_ms / 1000)
    assert settled == pytest.approx([10.0, 20.0, 30.0, 30.0], abs=0.001)
    assert [config.base_interval_s(n) for n in (0, 9, 24, 10_000)] == [2.0, 2.0, 5.0, 30.0]


def test_a_peer_that_declares_a_long_interval_is_kept_until_its_horizon():
    t = PeerTable(PeerTableConfig(heartbeat_interval_s=2.0, expiry_s=10.0, max_interval_s=120.0), ME, LOCAL,
                  started_ms=100)
    t.on_message(0.0, beat_from(BOB, 1, interval_ms=60_000))  # horizon 10 / 2 x 60 = 300 s
    assert t.get(BOB).interval_s == 60.0 and t.get(BOB).horizon_s == 300.0
    assert t.get(BOB).to_json(5.0)["horizon_s"] == 300.0
    assert t.on_timer(299.0, TIMER_EXPIRE) == [SetTimer(301.0, TIMER_EXPIRE)] and t.get(BOB) is not None
    assert Emit(PeerLeft(BOB, LeftBecause.EXPIRED)) in t.on_timer(301.0, TIMER_EXPIRE) and t.get(BOB) is None


def test_a_declared_interval_above_the_cap_buys_no_more_than_the_cap():
    t = PeerTable(PeerTableConfig(heartbeat_interval_s=2.0, expiry_s=10.0, max_interval_s=120.0), ME, LOCAL,
                  started_ms=100)
    t.on_message(0.0, beat_from(BOB, 1, interval_ms=86_400_000))  # claims a day between heartbeats
    assert t.get(BOB).horizon_s == 600.0  # 5 x 120 s
    t.on_timer(599.0, TIMER_EXPIRE)
    assert t.get(BOB) is not None
    assert Emit(PeerLeft(BOB, LeftBecause.EXPIRED)) in t.on_timer(601.0, TIMER_EXPIRE)


def test_an_undeclared_interval_gets_our_expiry():
    t = PeerTable(PeerTableConfig(heartbeat_interval_s=2.0, expiry_s=10.0), ME, LOCAL, started_ms=100)
    t.on_message(0.0, beat_from(BOB, 1, interval_ms=60_000))
    t.on_message(1.0, beat_from(BOB, 2))  # one that declares nothing (0)
    assert t.get(BOB).interval_s == 0.0 and t.get(BOB).horizon_s == 10.0
    t.on_timer(10.5, TIMER_EXPIRE)
    assert t.get(BOB) is not None
    assert Emit(PeerLeft(BOB, LeftBecause.EXPIRED)) in t.on_timer(11.5, TIMER_EXPIRE)


def test_expiry_is_checked_every_base_interval_however_far_apart_our_heartbeats_are():
    t = PeerTable(PeerTableConfig(heartbeat_interval_s=2.0, expiry_s=10.0), ME, LOCAL, started_ms=100)
    filled(t, 99, interval_ms=20_000)  # a table of 100 peers, each 20 s apart (so kept for 100 s)
    assert t.start(0.0)[1:] == [SetTimer(20.0, TIMER_HEARTBEAT), SetTimer(2.0, TIMER_EXPIRE)]
    t.on_message(1.0, beat_from(BOB, 1))
    assert t.on_timer(10.5, TIMER_EXPIRE) == [SetTimer(12.5, TIMER_EXPIRE)]  # nothing published on this timer
    assert Emit(PeerLeft(BOB, LeftBecause.EXPIRED)) in t.on_timer(12.5, TIMER_EXPIRE)  # long before our next beat


@pytest.mark.parametrize("others", [0, 9, 30, 99, 599, 5000])
@pytest.mark.parametrize("factor", [1.0, 3.0, 10.0, 1000.0])
def test_busy_spacing_never_exceeds_a_third_of_the_horizon_its_receivers_allow(others, factor):
    config = PeerTableConfig(heartbeat_interval_s=2.0, expiry_s=10.0, busy_heartbeat_factor=factor)
    t = filled(PeerTable(config, ME, LOCAL, started_ms=100), others)
    idle_ms, _ = next_beat(t, 0.0)
    t.set_busy(True)
    busy_ms, _ = next_beat(t, 1.0)
    horizon_s = PeerTableConfig(heartbeat_interval_s=2.0, expiry_s=10.0).horizon_s(idle_ms / 1000)
    assert idle_ms <= busy_ms <= horizon_s / 3 * 1000 + 1  # + 1: declared in whole ms, rounded up
    # (and no more than `GROWTH_PER_BEAT` times the spacing declared before, as any growth)
    assert busy_ms == pytest.approx(min(idle_ms * factor, idle_ms * GROWTH_PER_BEAT, horizon_s / 3 * 1000), abs=1)


def test_busy_spacing_grows_with_the_table():
    config = PeerTableConfig(heartbeat_interval_s=2.0, expiry_s=10.0, busy_heartbeat_factor=3.0, max_interval_s=120.0)
    assert [config.interval_s(True, n) for n in (0, 99, 10_000)] == pytest.approx([10 / 3, 100 / 3, 200.0])


def test_going_busy_moves_the_due_heartbeat_within_a_third_of_the_horizon_it_declared():
    config = PeerTableConfig(heartbeat_interval_s=2.0, expiry_s=10.0, busy_heartbeat_factor=10.0, max_interval_s=120.0)
    t = filled(PeerTable(config, ME, LOCAL, started_ms=100), 199)  # 200 / 5 = 40 s
    declared_ms, at = next_beat(t, 0.0)
    assert (declared_ms, at) == (40_000, 40.0)
    filled(t, 400, now=1.0)  # the table grew since: the heartbeat due was spaced for the old one
    assert t.set_busy(True) == [SetTimer(config.horizon_s(40.0) / 3, TIMER_HEARTBEAT)]  # 200 / 3 s
    assert t.set_busy(False) == [SetTimer(40.0, TIMER_HEARTBEAT)]  # what it declared


def test_the_new_settings_and_the_declared_interval_are_checked():
    with pytest.raises(ConfigError, match="max_heard_per_s"):
        PeerTableConfig(max_heard_per_s=0.0)
    with pytest.raises(ConfigError, match="max_interval_s"):
        PeerTableConfig(heartbeat_interval_s=2.0, max_interval_s=1.0)
    with pytest.raises(ValueError, match="interval_ms"):
        Heartbeat(1, 1, (), "x:1", (), Capacity(0, 0, 0), interval_ms=-1)
    with pytest.raises(ValueError, match="interval_ms"):
        Heartbeat(1, 1, (), "x:1", (), Capacity(0, 0, 0), interval_ms=86_400_001)



def test_busy_spaces_heartbeats_by_the_factor_but_never_past_a_third_of_expiry():
    t = PeerTable(PeerTableConfig(heartbeat_interval_s=1.0, expiry_s=10.0, busy_heartbeat_factor=2.0), ME, LOCAL,
                  started_ms=100)
    assert t.start(0.0)[1] == SetTimer(1.0, TIMER_HEARTBEAT)
    t.set_busy(True)
    assert t.on_timer(1.0, TIMER_HEARTBEAT)[-1] == SetTimer(2.5, TIMER_HEARTBEAT)  # growing 1.5 x a beat at most
    assert t.on_timer(2.5, TIMER_HEARTBEAT)[-1] == SetTimer(4.5, TIMER_HEARTBEAT)  # then the factor
    t.set_busy(False)
    assert t.on_timer(4.5, TIMER_HEARTBEAT)[-1] == SetTimer(5.5, TIMER_HEARTBEAT)
    capped = PeerTableConfig(heartbeat_interval_s=2.0, expiry_s=10.0, busy_heartbeat_factor=3.0)
    assert capped.interval_s(True) == 10.0 / 3 and capped.interval_s(False) == 2.0
    assert PeerTableConfig(heartbeat_interval_s=3.0, expiry_s=4.0).interval_s(True) == 3.0  # never faster than idle


def test_busy_moves_the_heartbeat_already_due_counting_from_the_last_one_sent():
    t = PeerTable(PeerTableConfig(heartbeat_interval_s=2.0, expiry_s=12.0, busy_heartbeat_factor=2.0), ME, LOCAL,
                  started_ms=100)
    assert t.set_busy(True) == []  # nothing sent yet: the first heartbeat is not held back
    t.set_busy(False)
    assert t.start(5.0)[1] == SetTimer(7.0, TIMER_HEARTBEAT)
    assert t.set_busy(True) == [SetTimer(9.0, TIMER_HEARTBEAT)]
    assert t.set_busy(False) == [SetTimer(7.0, TIMER_HEARTBEAT)]

def test_a_new_peer_is_added_announced_and_connected_once():
    t = table()
    effects = t.on_message(1.0, beat_from(BOB, 1))
    assert Emit(PeerJoined(BOB)) in effects
    assert any(isinstance(e, Connect) and e.peer == BOB for e in effects)
    assert t.on_message(1.5, beat_from(BOB, 2)) == []
    entry = t.get(BOB)
    assert entry.data_addr == "127.0.0.1:8" and entry.roles == ("worker",) and entry.last_heard == 1.5


def test_replayed_heartbeats_do_not_refresh_a_peer():
    t = table()
    t.on_message(1.0, beat_from(BOB, 5))
    t.on_message(2.0, beat_from(BOB, 5))
    t.on_message(2.5, beat_from(BOB, 4))
    assert t.get(BOB).last_heard == 1.0
    t.on_message(3.0, beat_from(BOB, 1, started_ms=8))  # a restart: new run, seq starts over
    assert t.get(BOB).last_heard == 3.0


def test_silent_peers_expire():
    t = table()
    t.on_message(1.0, beat_from(BOB, 1))
    t.on_timer(3.5, TIMER_EXPIRE)
    assert t.get(BOB) is not None
    effects = t.on_timer(4.5, TIMER_EXPIRE)
    assert Emit(PeerLeft(BOB, LeftBecause.EXPIRED)) in effects and t.get(BOB) is None


def test_rejections_lower_the_score_and_finally_ban():
    t = table(reject_penalty=4.0, ban_score=-10.0)
    t.on_message(1.0, beat_from(BOB, 1))
    assert t.on_rejected(2.0, BOB, "bad_signature") == []
    assert t.score(BOB) == -4.0 and t.get(BOB).score == -4.0
    t.on_rejected(2.0, BOB, "garbage")
    assert t.on_rejected(2.0, BOB, "garbage") == [Emit(PeerLeft(BOB, LeftBecause.BANNED))]
    assert t.is_banned(BOB, 3.0)
    assert t.on_message(3.0, beat_from(BOB, 9)) == []  # ignored while banned
    assert not t.is_banned(BOB, 2.0 + 600.0)


def test_own_heartbeats_are_ignored():
    assert table().on_message(1.0, beat_from(ME, 1)) == []


def _beats_heard(sender: PeerTable, receiver: PeerTable, lost: set[int], beats: int, busy_after: int | None) -> list:
    """Run `sender` for `beats` heartbeats, its table 599 peers from 0.5 s on, each delivered to
    `receiver` as it is published except those numbered in `lost` (0: the first), and busy from
    just after the one numbered `busy_after` (None: never); `receiver` checks expiry on its own
    timer all along. Returns the events `receiver` emitted."""
    emitted = []
    published_at = 0.0
    publish, timer = sender.start(published_at)[:2]
    expire_at = receiver.start(0.0)[-1].at
    filled(sender, 599, now=0.5)
    for number in range(beats):
        if number not in lost:
            emitted += receiver.on_message(published_at, Envelope("heartbeat", BOB, b"", 0, publish.body, 100))
        if number == busy_after:
            [timer] = sender.set_busy(True)  # the heartbeat due moves
        while expire_at <= timer.at:  # up to the next heartbeat
            effects = receiver.on_timer(expire_at, TIMER_EXPIRE)
            emitted += effects[:-1]
            expire_at = effects[-1].at
        published_at = timer.at
        publish, timer = sender.on_timer(published_at, TIMER_HEARTBEAT)
    return [e.event for e in emitted if isinstance(e, Emit)]


@pytest.mark.parametrize("busy_after", [None, 0, 1, 3])
@pytest.mark.parametrize("lost", [1, 2, 3, 6])
def test_one_lost_heartbeat_expires_nobody_while_the_senders_table_grows(lost, busy_after):
    # a peer that starts alone and then hears of a whole network (its own start, a network's
    # bring-up): the heartbeat announcing the longer spacing is the one a receiver may miss
    config = PeerTableConfig()  # 2 s, 10 s, 5 heard a second, 30 s at most
    sender = PeerTable(config, BOB, LOCAL, started_ms=7)
    receiver = PeerTable(config, ME, LOCAL, started_ms=100)
    emitted = _beats_heard(sender, receiver, {lost}, beats=12, busy_after=busy_after)
    assert not [e for e in emitted if isinstance(e, PeerLeft)] and receiver.get(BOB) is not None


@pytest.mark.parametrize("busy_after", [None, 0, 1, 3, 6])
@pytest.mark.parametrize("first_lost", range(10))
def test_two_heartbeats_lost_in_a_row_expire_nobody_while_the_senders_table_grows(first_lost, busy_after):
    # as above, two in a row: growing by a third of the horizon a beat (5 / 3 of the spacing),
    # 1 + 5/3 + 25/9 = 5.44 declared intervals went by silent, past the horizon of 5
    config = PeerTableConfig()
    sender = PeerTable(config, BOB, LOCAL, started_ms=7)
    receiver = PeerTable(config, ME, LOCAL, started_ms=100)
    emitted = _beats_heard(sender, receiver, {first_lost, first_lost + 1}, beats=14, busy_after=busy_after)
    assert not [e for e in emitted if isinstance(e, PeerLeft)] and receiver.get(BOB) is not None


def test_two_heartbeats_lost_in_a_row_expire_nobody_after_going_busy_moved_the_one_due():
    # a relay whose transfer ended (its spacing back to the idle one it declares) and the next
    # one began at once: going busy moves the heartbeat due past what the last one declared (to
    # a third of its horizon, 5 / 3 of it), and its table grows meanwhile (a network's bring-up).
    # The spacings after grow 1.5 times a beat, less what the moved one came late: without that,
    # 5/3 + 1.5 + 2.25 = 5.42 declared intervals went by silent when the next two were lost
    config = PeerTableConfig()
    sender = PeerTable(config, BOB, LOCAL, started_ms=7)
    receiver = PeerTable(config, ME, LOCAL, started_ms=100)
    emitted = []
    expire_at = receiver.start(0.0)[-1].at

    def heard(publish: Publish, at: float, delivered: bool = True) -> None:
        nonlocal emitted, expire_at
        while expire_at <= at:  # the receiver's expiry, on its own timer, up to this heartbeat
            effects = receiver.on_timer(expire_at, TIMER_EXPIRE)
            emitted += effects[:-1]
            expire_at = effects[-1].at
        if delivered:  # a check just as it arrives too: the worst phase of the receiver's timer
            emitted += receiver.on_timer(at, TIMER_EXPIRE)[:-1]
            emitted += receiver.on_message(at, Envelope("heartbeat", BOB, b"", 0, publish.body, 100))

    publish, timer = sender.start(0.0)[:2]
    heard(publish, 0.0)
    filled(sender, 10, now=0.1)  # 11 / 5 = 2.2 s apart
    [timer] = sender.set_busy(True)
    for _ in range(4):  # busy: up to a third of the horizon, 11 / 3 s
        at = timer.at
        publish, timer = sender.on_timer(at, TIMER_HEARTBEAT)
        heard(publish, at)
    [timer] = sender.set_busy(False)  # the transfer ended
    idle_at = timer.at
    publish, timer = sender.on_timer(idle_at, TIMER_HEARTBEAT)
    assert publish.body.interval_ms == 2200
    heard(publish, idle_at)
    [timer] = sender.set_busy(True)  # the next one begins: the heartbeat due moves
    assert timer.at == pytest.approx(idle_at + 11.0 / 3)
    filled(sender, 599, now=idle_at + 0.1)
    for lost in (True, True, False):
        at = timer.at
        publish, timer = sender.on_timer(at, TIMER_HEARTBEAT)
        heard(publish, at, delivered=not lost)
    assert not [e for e in emitted if isinstance(e, Emit) and isinstance(e.event, PeerLeft)]
    assert receiver.get(BOB) is not None


def test_the_spacing_reaches_what_the_table_asks_for_growing_at_most_one_and_a_half_times_a_beat():
    config = PeerTableConfig()
    t = PeerTable(config, ME, LOCAL, started_ms=100)
    t.start(0.0)
    filled(t, 599)
    declared, now = [2000], 0.0
    for _ in range(12):
        declared_ms, at = next_beat(t, now)
        assert declared_ms <= math.ceil(min(GROWTH_PER_BEAT * declared[-1], config.horizon_s(declared[-1] / 1000) / 3
                                            * 1000))
        assert declared_ms == pytest.approx((at - now) * 1000, abs=1)  # it declares the timer it sets
        declared.append(declared_ms)
        now = at
    assert declared[-1] == 30_000 and declared[1:8] == [3000, 4500, 6750, 10_125, 15_188, 22_782, 30_000]
    assert len([e for e in t.on_timer(now + 11.0, TIMER_EXPIRE) if isinstance(e, Emit)]) == 599  # all silent
    assert next_beat(t, now + 11.0)[0] == 2000  # a table that shrank spaces the next at once


def test_a_configuration_whose_busy_spacing_no_heartbeat_can_declare_is_refused():
    with pytest.raises(ConfigError, match="max_interval_s"):
        PeerTableConfig(heartbeat_interval_s=2.0, expiry_s=10.0, max_interval_s=60_000.0)  # busy: 100,000 s
    config = PeerTableConfig(heartbeat_interval_s=2.0, expiry_s=10.0, max_interval_s=50_000.0)  # busy: 83,334 s
    t = filled(PeerTable(config, ME, LOCAL, started_ms=100), 300_000)
    t.set_busy(True)
    assert next_beat(t, 0.0)[0] <= 86_400_000


def test_nothing_is_introduced_before_our_first_heartbeat_then_the_latest_one_is_sent():
    t = table()
    assert t.introduce(0.5, BOB) == []  # no heartbeat of ours yet: nothing to say
    first = t.start(1.0)[0].body
    assert t.introduce(1.0, BOB) == [Send(BOB, first)]  # unknown to us: no address to dial, sent as is
    second = t.on_timer(2.0, TIMER_HEARTBEAT)[0].body
    assert t.introduce(2.0, BOB) == [Send(BOB, second)] and second.seq == 2  # the latest, unchanged


def test_a_known_peer_is_dialled_first_unless_it_said_nobody_can_dial_it():
    t = table()
    t.start(0.0)
    beat = t.on_timer(1.0, TIMER_HEARTBEAT)[0].body
    t.on_message(1.0, beat_from(BOB, 1))
    assert t.introduce(1.0, BOB) == [Connect(BOB, ("/ip4/127.0.0.1/tcp/2/p2p/x",)), Send(BOB, beat)]
    carol = Identity.from_seed_text("carol").peer_id
    behind_nat = Envelope("heartbeat", carol, b"", 0, replace(beat_from(carol, 1).body, reachable=False), 100)
    t.on_message(1.0, behind_nat)
    assert t.introduce(1.0, carol) == [Send(carol, beat)]  # it dials us; a Send reaches it only if connected


def test_introductions_are_rate_limited_per_peer_and_never_to_ourselves_or_the_banned():
    t = table(reject_penalty=20.0)  # one rejection bans
    beat = t.start(0.0)[0].body
    assert t.introduce(5.0, BOB) == [Send(BOB, beat)]
    assert t.introduce(5.9, BOB) == []  # within heartbeat_interval_s (1 s) of the last
    carol = Identity.from_seed_text("carol").peer_id
    assert t.introduce(5.9, carol) == [Send(carol, beat)]  # another peer is not held back by Bob
    assert t.introduce(6.0, BOB) == [Send(BOB, beat)]  # an interval later, again
    assert t.introduce(9.0, ME) == []
    t.on_rejected(9.0, carol, "bad_signature")
    assert t.is_banned(carol, 9.0) and t.introduce(9.0, carol) == []


def test_introduced_peers_are_forgotten_after_an_interval():
    t = table()
    t.start(0.0)
    for i in range(1000):
        t.introduce(1.0 + i / 2000, f"peer-{i}")
    assert len(t._introduced) == 1000
    assert t.introduce(2.4, BOB) != [] and len(t._introduced) == 1 + 199  # those of the last second stay
    assert t.introduce(2.6, "peer-0") != []
    assert list(t._introduced) == [BOB, "peer-0"]  # the others are more than an interval old: gone


def test_an_introduction_is_taken_like_a_gossiped_heartbeat_and_a_copy_is_dropped_as_a_replay():
    bob = PeerTable(PeerTableConfig(heartbeat_interval_s=1.0, expiry_s=3.0), BOB, LOCAL, started_ms=50)
    t = table()
    t.start(0.0)
    (send,) = t.introduce(0.0, BOB)
    direct = Envelope("heartbeat", ME, b"", 0, send.body, 100)
    assert Emit(PeerJoined(ME)) in bob.on_message(0.1, direct)
    assert bob.get(ME).data_addr == LOCAL.data_addr and bob.get(ME).last_heard == 0.1
    assert bob.on_message(0.5, direct) == [] and bob.get(ME).last_heard == 0.1  # the gossiped copy, later: a replay


def test_after_a_ban_ends_the_peer_starts_again_from_a_clean_score():
    """The score was reset only if something happened to ask `is_banned` first: the first rejected
    frame after the ban then banned the peer again at once."""
    t = table(reject_penalty=4.0, ban_score=-10.0)
    for _ in range(3):
        t.on_rejected(2.0, BOB, "garbage")
    assert t.is_banned(BOB, 3.0) and t.score(BOB) <= -10.0
    after = 2.0 + 600.0 + 1.0
    assert t.on_rejected(after, BOB, "garbage") == []  # one rejection after the ban ended
    assert not t.is_banned(BOB, after) and t.score(BOB) == -4.0


def test_a_departed_peers_replayed_heartbeat_does_not_bring_it_back():
    """A frame stays fresh for the codec's 300 s, longer than a horizon, and a direct frame has no
    seen-cache: the last heartbeat of a peer that went silent, replayed, put it back (a join, a
    connect to dead addresses), again and again. A restart (a later start) or a later heartbeat
    still comes back."""
    t = table()
    t.on_message(1.0, beat_from(BOB, 7))
    t.on_timer(10.0, TIMER_EXPIRE)
    assert t.get(BOB) is None
    assert t.on_message(14.0, beat_from(BOB, 7)) == [] and t.get(BOB) is None
    assert t.on_message(15.0, beat_from(BOB, 8)) != [] and t.get(BOB) is not None  # it is alive after all
    t.on_timer(30.0, TIMER_EXPIRE)
    assert t.on_message(31.0, beat_from(BOB, 1, started_ms=9)) != []  # restarted: seq from 1, a later start


def test_what_peers_outside_the_table_leave_behind_is_bounded():
    t = table(reject_penalty=1.0, ban_score=-1.0)
    for i in range(3 * MAX_REMEMBERED):  # one rejected frame from each of many fresh identities: each banned
        t.on_rejected(1.0, f"sybil-{i}", "garbage")
    for i in range(3 * MAX_REMEMBERED):
        t.on_message(2.0, beat_from(f"gone-{i}", 1))
    t.on_timer(2.0 + 700.0, TIMER_EXPIRE)  # every ban over, every peer expired
    t.on_timer(2.0 + 700.0 + REPLAY_MEMORY_S + 1.0, TIMER_EXPIRE)
    assert len(t._scores) <= MAX_REMEMBERED and len(t._banned_until) == 0 and len(t._departed) == 0
