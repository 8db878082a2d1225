"""The peer table core, fed by hand: no clock, no network."""

from p2pnet.core import Connect, Emit, Publish, SetTimer
from p2pnet.identity import Identity
from p2pnet.messages import HEARTBEAT_TOPIC, Capacity, Heartbeat
from p2pnet.peertable import TIMER_HEARTBEAT, LeftBecause, LocalInfo, PeerJoined, PeerLeft, PeerTable, PeerTableConfig
from p2pnet.wire import Envelope

ME = Identity.from_seed_text("me").peer_id
BOB = Identity.from_seed_text("bob").peer_id
LOCAL = LocalInfo(("/ip4/127.0.0.1/tcp/1/p2p/me",), "127.0.0.1:9", ("relay",), Capacity(1, 2, 3))


def table(**kw) -> PeerTable:
    return PeerTable(PeerTableConfig(heartbeat_interval_s=1.0, expiry_s=3.0, **kw), ME, LOCAL, started_ms=100)


def beat_from(peer: str, seq: int, started_ms: int = 7) -> Envelope:
    body = Heartbeat(seq, started_ms, ("/ip4/127.0.0.1/tcp/2/p2p/x",), "127.0.0.1:8", ("worker",), Capacity(5, 6, 7))
    return Envelope("heartbeat", peer, b"", 0, body, 100)


def test_start_publishes_a_heartbeat_and_schedules_the_next():
    effects = table().start(10.0)
    assert isinstance(effects[0], Publish) and effects[0].topic == HEARTBEAT_TOPIC
    assert effects[0].body.roles == ("relay",) and effects[0].body.seq == 1
    assert effects[1] == SetTimer(11.0, TIMER_HEARTBEAT)



def test_busy_spaces_heartbeats_by_the_factor_but_never_past_a_third_of_expiry():
    t = PeerTable(PeerTableConfig(heartbeat_interval_s=1.0, expiry_s=10.0, busy_heartbeat_factor=2.0), ME, LOCAL,
                  started_ms=100)
    assert t.start(0.0)[1] == SetTimer(1.0, TIMER_HEARTBEAT)
    t.set_busy(True)
    assert t.on_timer(1.0, TIMER_HEARTBEAT)[-1] == SetTimer(3.0, TIMER_HEARTBEAT)
    t.set_busy(False)
    assert t.on_timer(3.0, TIMER_HEARTBEAT)[-1] == SetTimer(4.0, TIMER_HEARTBEAT)
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
    assert t.on_timer(3.5, TIMER_HEARTBEAT)[0:0] == [] and t.get(BOB) is not None
    effects = t.on_timer(4.5, TIMER_HEARTBEAT)
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
