"""The peer table: who is out there, how to reach them, what they offer, and how much we trust them.

A pure core (see `p2pnet.core`). It publishes this peer's signed heartbeat, learns other peers
from theirs, asks the world to connect to newly learned peers while it has fewer than
`target_connections`, forgets peers that stay silent past their horizon (below), and keeps a
score per peer: every rejected message costs `reject_penalty`, and a peer whose score falls to
`ban_score` is dropped and ignored for `ban_s`.

Theory of operation: heartbeat spacing. Every peer hears (a few copies of) every other peer's
heartbeats, and each delivered one costs it CPU (py-libp2p: about 1-10 ms, measured). With a
fixed spacing each peer's cost grows with the network and the network's with its square: a few
hundred peers would spend whole cores saying they are alive. So each peer spaces its heartbeats
by the size of its own table: with `n` other peers known, the base interval is
`(n + 1) / max_heard_per_s`, never below `heartbeat_interval_s` and never above
`max_interval_s`. If every peer does the same (their tables are about the same size), each hears
at most `max_heard_per_s` heartbeats a second, times the copies GossipSub delivers of each, however
large the network; up to `max_heard_per_s * heartbeat_interval_s - 1` other peers (9 by default)
nothing changes. Past `max_interval_s * max_heard_per_s` peers (150 by default) the cap holds and
the cost grows again, linearly. The cap is 30 s because a relay's wait for a holder's address
waits on heartbeats (one whose address has not come when the wait ends, `request_timeout_s`, is
asked again soon: `relay.failures`, `no_address`), so a longer cap would trade that delay for
less CPU. A peer's admission on the data plane waits on them no longer: a peer refused as
unknown (a restarted peer refuses fetches from peers it has not heard yet) introduces itself
(below).

The price is paid in time. Every heartbeat declares its sender's spacing (`Heartbeat.interval_ms`:
the interval of the timer set when it was published), and a receiver forgets a peer only after
`horizon = max(expiry_s, expiry_s / heartbeat_interval_s * min(declared, max_interval_s))` of
silence: as many of the sender's own intervals as `expiry_s` allows at the base spacing (5 by
default), so a dead peer leaves tables after up to its horizon (5 x 30 s = 150 s at the cap),
and a newcomer hears of each peer within that peer's interval (its own first heartbeats are
frequent, its table being small). The declared interval is clamped by the receiver's
`max_interval_s`, so no peer can buy itself a longer horizon than the cap, and an undeclared one
(0) gets `expiry_s`. Expiry is checked every `heartbeat_interval_s` (a timer of its own), however
far apart our own heartbeats are.

A receiver knows only the last declaration it heard, so the spacing grows by at most
`GROWTH_PER_BEAT` (1.5) times, and a third of the horizon, of what the previous heartbeat
declared (`next_cap_s`; from 2 s to 30 s in 7 heartbeats) however fast our table grows: the
heartbeats announcing a longer spacing may be lost (a peer's start, a network's bring-up, when
tables jump from nothing to everyone) without the receivers that missed them forgetting us. A
third of the horizon alone lets one be lost: growing 5 / 3 a beat (that third, by default), two
lost in a row left a silence of 1 + 5/3 + 25/9 = 5.44 declared intervals, past the horizon of 5,
and the receivers forgot us (it joined their tables again at its next heartbeat, a relay among
them replanning twice); at 1.5 a beat it is 4.75 of them. It shrinks at once. Older peers'
heartbeats (without `interval_ms`) are not decoded at all (`p2pnet.wire` wants every field), so
a network runs one version.

While a role moves bulk data (`set_busy`: a checkpoint transfer), heartbeats are
`busy_heartbeat_factor` times further apart than the base interval, but never more than a third of
the horizon that base interval gives the receivers (so one lost heartbeat expires nobody),
counted from the last one sent (the one already due moves too; it is the one spacing that can
exceed what the last heartbeat declared, and stays within a third of that horizon). A transfer on
a CPU-bound machine would otherwise share its CPU with the heartbeats. The spacing after a
heartbeat that came so late may grow by that much less (`_heartbeat`), and never below
`heartbeat_interval_s`: a transfer that ends (the spacing back to the idle one) and the next
one beginning at once moved a heartbeat to 5 / 3 of what the last one declared, and with the
table growing meanwhile (a network's bring-up) the two after it, growing 1.5 times a beat,
left 5/3 + 1.5 + 2.25 = 5.42 declared intervals silent if both were lost.

Replays are harmless: a heartbeat is taken only if it is newer (run start, then sequence number)
than the last one taken from that peer, however it arrived (gossiped, or sent directly).

Introductions. A peer's data plane serves only peers in its table (`Node.admit_data_peer`), so
one that has not heard our heartbeat yet (it restarted with an empty table, or lost the one we
sent) refuses us until our next one reaches it: up to our spacing, 30 s at the cap. When it
refuses us (`p2pnet.handshake.NotAdmitted`), `introduce(now, peer)` sends it our latest
heartbeat directly (`Send`, after a `Connect` to the addresses its own heartbeat gave, unless it
said nobody can dial it), at most once per `heartbeat_interval_s` per peer, and nothing before
our first heartbeat. The receiver takes it like a gossiped one (the node routes frames by kind;
a copy of one it already took is dropped as a replay), and admits us at our next try. The
heartbeat is the one we last published, unchanged (same sequence number): nothing new is said,
and no wire message was added for it. Peers introduced within the last `heartbeat_interval_s`
are remembered (and no others), so the memory is bounded by the refusals of one interval.

Events (`Emit`): `PeerJoined`, `PeerLeft` (expired or banned), and `PeerChanged` when a known
peer's heartbeat changes its addresses, data address, roles or reachability. The node wakes
whoever waits on the table with each (`Node.wait_for_peers`).

`ClockSkew` (pure, owned by the table as `clock_skew`, fed by the node with every rejected frame)
notices when messages are rejected as stale because of a clock offset, ours most likely, and
words one warning per interval: a wrong clock otherwise looks like a network with no peers.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from p2pnet.config import validated
from p2pnet.core import Connect, Effect, Emit, Publish, Send, SetTimer
from p2pnet.errors import MessageRejected, StaleMessage
from p2pnet.messages import HEARTBEAT_TOPIC, MAX_HEARTBEAT_INTERVAL_MS, Capacity, Heartbeat
from p2pnet.wire import Envelope

TIMER_HEARTBEAT = "peertable/heartbeat"  # publish our next heartbeat
TIMER_EXPIRE = "peertable/expire"  # forget peers silent past their horizon (every heartbeat_interval_s)
# our spacing grows at most this much a heartbeat, so that two heartbeats lost in a row while it
# grows expire nobody: 1 + 1.5 + 1.5^2 = 4.75 declared intervals of silence, within the horizon of
# expiry_s / heartbeat_interval_s (5 by default) of them (see the top)
GROWTH_PER_BEAT = 1.5
MAX_REMEMBERED = 4096  # peers outside the table whose scores and last heartbeats are kept
REPLAY_MEMORY_S = 600.0  # an expired peer's last heartbeat is remembered this long (> the codec's max age, 300 s)


@validated
@dataclass(frozen=True)
class PeerTableConfig:
    heartbeat_interval_s: float = 2.0
    expiry_s: float = 10.0
    target_connections: int = 8
    reject_penalty: float = 1.0
    ban_score: float = -10.0
    ban_s: float = 600.0
    busy_heartbeat_factor: float = 3.0
    max_heard_per_s: float = 5.0
    max_interval_s: float = 30.0

    def check(self) -> dict[str, str]:
        problems = {}
        if not self.heartbeat_interval_s > 0:
            problems["heartbeat_interval_s"] = "must be > 0"
        if not self.expiry_s > self.heartbeat_interval_s:
            problems["expiry_s"] = "must be greater than heartbeat_interval_s"
        if self.target_connections < 1:
            problems["target_connections"] = "must be >= 1"
        if not self.reject_penalty > 0:
            problems["reject_penalty"] = "must be > 0"
        if not self.ban_score < 0:
            problems["ban_score"] = "must be < 0"
        if not self.busy_heartbeat_factor >= 1:
            problems["busy_heartbeat_factor"] = "must be >= 1 (1: the same interval while busy)"
        if not self.max_heard_per_s > 0:
            problems["max_heard_per_s"] = "must be > 0"
        if not self.max_interval_s >= self.heartbeat_interval_s:
            problems["max_interval_s"] = "must be >= heartbeat_interval_s"
        elif self.heartbeat_interval_s > 0 and self.busy_heartbeat_factor >= 1 and \
                self.longest_interval_s() * 1000 > MAX_HEARTBEAT_INTERVAL_MS:
            problems["max_interval_s"] = (f"too long: busy heartbeats would be {self.longest_interval_s():.0f} s apart, "
                                          f"more than a heartbeat can declare ({MAX_HEARTBEAT_INTERVAL_MS // 1000} s)")
        return problems

    def base_interval_s(self, peers_known: int) -> float:
        """Seconds between two of our heartbeats while not busy, with `peers_known` other peers in our
        table: if every peer spaced its own so, each would hear at most `max_heard_per_s` a second."""
        return min(max((peers_known + 1) / self.max_heard_per_s, self.heartbeat_interval_s), self.max_interval_s)

    def horizon_s(self, declared_s: float) -> float:
        """Silence after which a peer whose heartbeat declared `declared_s` between two heartbeats
        (0: undeclared) is forgotten: `expiry_s` at the base spacing, the same number of its own
        intervals when it declares more, its declaration clamped to `max_interval_s`."""
        return max(self.expiry_s, self.expiry_s / self.heartbeat_interval_s * min(declared_s, self.max_interval_s))

    def longest_interval_s(self) -> float:
        """The longest spacing of our heartbeats: busy, with a table at the cap."""
        return max(self.max_interval_s, min(self.max_interval_s * self.busy_heartbeat_factor,
                                            self.horizon_s(self.max_interval_s) / 3))

    def next_cap_s(self, declared_s: float) -> float:
        """The longest spacing after a heartbeat that follows one declaring `declared_s` (never
        less than it): `GROWTH_PER_BEAT` times it, and at most a third of the horizon that
        declaration gives the receivers, so the heartbeats announcing a longer spacing may be lost
        (two in a row with the default horizon, one with any) without their sender being forgotten."""
        return max(declared_s, min(GROWTH_PER_BEAT * declared_s, self.horizon_s(declared_s) / 3))

    def interval_s(self, busy: bool, peers_known: int = 0) -> float:
        """Seconds between two of our heartbeats, while busy or not, with `peers_known` other peers
        in our table. Busy spacing stays within a third of the horizon the base spacing gives."""
        base = self.base_interval_s(peers_known)
        if not busy:
            return base
        return max(base, min(base * self.busy_heartbeat_factor, self.horizon_s(base) / 3))


@dataclass(frozen=True)
class LocalInfo:
    """What this peer advertises about itself."""

    addrs: tuple[str, ...]
    data_addr: str
    roles: tuple[str, ...]
    capacity: Capacity
    reachable: bool | None = None  # what dial-back checks found (see p2pnet.reachability)
    name: str = ""  # display name, shown to others ([peer] display_name)


@dataclass(frozen=True)
class PeerEntry:
    peer_id: str
    addrs: tuple[str, ...]
    data_addr: str
    roles: tuple[str, ...]
    capacity: Capacity
    started_ms: int
    seq: int
    first_seen: float
    last_heard: float
    score: float
    interval_s: float  # the spacing its last heartbeat declared (0: undeclared)
    horizon_s: float  # forgotten after this long silent (`PeerTableConfig.horizon_s` of the above)
    reachable: bool | None = None
    name: str = ""  # the display name it chose (shown, never trusted)

    @property
    def can_serve(self) -> bool:
        """Others have dialled it back: it may be asked to serve (be a relay parent)."""
        return self.reachable is True

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id,
            "addrs": list(self.addrs),
            "data_addr": self.data_addr,
            "roles": list(self.roles),
            "upload_bps": self.capacity.upload_bps,
            "download_bps": self.capacity.download_bps,
            "free_disk_bytes": self.capacity.free_disk_bytes,
            "reachable": self.reachable,
            "name": self.name,
            "last_heard_s_ago": round(now - self.last_heard, 3),
            "interval_s": self.interval_s,
            "horizon_s": self.horizon_s,
            "score": self.score,
        }


@dataclass(frozen=True)
class PeerJoined:
    peer_id: str


class LeftBecause(enum.StrEnum):
    """Why a peer left our table (`PeerLeft.why`)."""

    EXPIRED = "expired"  # no heartbeat from it within its horizon (`PeerEntry.horizon_s`)
    BANNED = "banned"  # its score fell to `ban_score`: what it sent us was rejected too often


@dataclass(frozen=True)
class PeerLeft:
    peer_id: str
    why: LeftBecause


PEER_TABLE_CORE = "peertable"  # the name the node runs the table under: roles carry out its effects as it


@dataclass(frozen=True)
class PeerChanged:
    """A known peer's heartbeat changed how to reach it or what it does (addresses, data
    address, roles, reachability): no join, yet whoever waits for such a peer must look again."""

    peer_id: str


class PeerTable:
    topics = (HEARTBEAT_TOPIC,)
    kinds = (Heartbeat.KIND,)  # type: ignore[attr-defined]

    def __init__(self, config: PeerTableConfig, self_id: str, local: LocalInfo, started_ms: int) -> None:
        self.config = config
        self.self_id = self_id
        self.local = local
        self.started_ms = started_ms
        self._seq = 0
        self._peers: dict[str, PeerEntry] = {}
        self._scores: dict[str, float] = {}  # peers not in the table and not banned: at most MAX_REMEMBERED
        # expired peers' last heartbeat (when forgotten, started_ms, seq), oldest first: a replay of
        # it (a direct frame has no seen-cache; a frame is fresh for the codec's 300 s) is no news
        self._departed: OrderedDict[str, tuple[float, int, int]] = OrderedDict()
        self._banned_until: dict[str, float] = {}
        self._connect_asked: set[str] = set()
        self.busy = False
        self._beat_at: float | None = None  # when our last heartbeat was published
        self._beat_peers = 0  # peers in our table then: the spacing it declared counts them
        # its spacing's most, busy or not: `next_cap_s` of the one before, less what it came late (see the top)
        self._beat_cap_s = math.inf
        self._last_beat: Heartbeat | None = None  # the heartbeat published last (what `introduce` sends;
        # its `interval_ms` is what receivers last heard us declare)
        self._introduced: dict[str, float] = {}  # peer -> when `introduce` sent it ours, oldest first
        self.clock_skew = ClockSkew()

    # -- inputs ---------------------------------------------------------------------------

    def start(self, now: float) -> list[Effect]:
        return self._heartbeat(now) + [SetTimer(now + self.config.heartbeat_interval_s, TIMER_EXPIRE)]

    def on_timer(self, now: float, key: str) -> list[Effect]:
        if key == TIMER_HEARTBEAT:
            return self._heartbeat(now)
        if key == TIMER_EXPIRE:
            return self._expire(now) + [SetTimer(now + self.config.heartbeat_interval_s, TIMER_EXPIRE)]
        return []

    def on_message(self, now: float, envelope: Envelope[Any]) -> list[Effect]:
        beat = envelope.body
        peer = envelope.sender
        if not isinstance(beat, Heartbeat) or peer == self.self_id or self.is_banned(peer, now):
            return []
        known = self._peers.get(peer)
        if known is not None and (beat.started_ms, beat.seq) <= (known.started_ms, known.seq):
            return []  # a replay or a reordered old heartbeat
        departed = self._departed.get(peer) if known is None else None
        if departed is not None and (beat.started_ms, beat.seq) <= departed[1:]:
            return []  # the last heartbeat of a peer that went silent, replayed: it stays gone
        declared_s = beat.interval_ms / 1000
        entry = PeerEntry(
            peer_id=peer,
            addrs=beat.addrs,
            data_addr=beat.data_addr,
            roles=beat.roles,
            capacity=beat.capacity,
            started_ms=beat.started_ms,
            seq=beat.seq,
            first_seen=known.first_seen if known else now,
            last_heard=now,
            score=self._scores.get(peer, 0.0),
            interval_s=declared_s,
            horizon_s=self.config.horizon_s(declared_s),
            reachable=beat.reachable,
            name=beat.name,
        )
        self._peers[peer] = entry
        if known is not None:
            if (known.addrs, known.data_addr, known.roles, known.reachable) != (
                    entry.addrs, entry.data_addr, entry.roles, entry.reachable):
                return [Emit(PeerChanged(peer))]
            return []  # capacity (free disk) changes with nearly every heartbeat: no news
        effects: list[Effect] = [Emit(PeerJoined(peer))]
        if beat.reachable is False:
            return effects  # nobody can dial it (behind NAT): it dials us, we never dial it
        if len(self._connect_asked) < self.config.target_connections and peer not in self._connect_asked:
            self._connect_asked.add(peer)
            effects.append(Connect(peer, beat.addrs))
        return effects

    def on_rejected(self, now: float, peer: str, reason: str) -> list[Effect]:
        return self.penalise(now, peer, self.config.reject_penalty)

    # -- queries and commands for the application -------------------------------------------

    def penalise(self, now: float, peer: str, amount: float) -> list[Effect]:
        if self.is_banned(peer, now):  # (and a ban that has ended starts the peer again from 0, not its old score)
            return []
        score = self._scores.get(peer, 0.0) - amount
        self._scores[peer] = score
        if peer in self._peers:
            self._peers[peer] = replace(self._peers[peer], score=score)
        if score > self.config.ban_score:
            return []
        self._banned_until[peer] = now + self.config.ban_s
        self._connect_asked.discard(peer)
        if self._peers.pop(peer, None) is None:
            return []
        return [Emit(PeerLeft(peer, LeftBecause.BANNED))]

    def is_banned(self, peer: str, now: float) -> bool:
        until = self._banned_until.get(peer)
        if until is None:
            return False
        if now >= until:
            del self._banned_until[peer]
            self._scores[peer] = 0.0
            return False
        return True

    def score(self, peer: str) -> float:
        return self._scores.get(peer, 0.0)

    def get(self, peer: str) -> PeerEntry | None:
        return self._peers.get(peer)

    def peers(self) -> list[PeerEntry]:
        return sorted(self._peers.values(), key=lambda e: e.peer_id)

    def with_role(self, role: str) -> list[PeerEntry]:
        return [e for e in self.peers() if role in e.roles]

    def set_busy(self, busy: bool) -> list[Effect]:
        """Whether a role moves bulk data now: heartbeats are spaced by `spacing_s()` from the last
        one sent, so the heartbeat already due moves too (the returned timer)."""
        self.busy = busy
        if self._beat_at is None:
            return []
        return [SetTimer(self._beat_at + self.spacing_s(), TIMER_HEARTBEAT)]

    def spacing_s(self) -> float:
        """Seconds from our last heartbeat to the next: busy or not, for the table as it was when
        the last one was published (what it declared, unless `set_busy` changed since), and at
        most `PeerTableConfig.next_cap_s` of what the heartbeat before it declared, less the time
        the last one came later than that declaration (see the top)."""
        return min(self.config.interval_s(self.busy, self._beat_peers), self._beat_cap_s)

    def introduce(self, now: float, peer: str) -> list[Effect]:
        """Send our latest heartbeat straight to `peer`, which refused us as unknown (see the top):
        `Send(peer, heartbeat)`, preceded by `Connect(peer, addrs)` when its heartbeat told us
        addresses and did not say it cannot be dialled. Nothing before our first heartbeat, to
        ourselves, to a peer we banned, or to a peer introduced within `heartbeat_interval_s`.
        The effects must be carried out in order (the node does, `Node.introduce`)."""
        horizon = now - self.config.heartbeat_interval_s
        while self._introduced:  # oldest first: forget those past the interval
            oldest, at = next(iter(self._introduced.items()))
            if at > horizon:
                break
            del self._introduced[oldest]
        if self._last_beat is None or peer == self.self_id or peer in self._introduced or self.is_banned(peer, now):
            return []
        self._introduced[peer] = now
        effects: list[Effect] = []
        entry = self._peers.get(peer)
        if entry is not None and entry.addrs and entry.reachable is not False:
            effects.append(Connect(peer, entry.addrs))
        effects.append(Send(peer, self._last_beat))
        return effects

    def set_local(self, local: LocalInfo) -> None:
        """Change what this peer advertises from its next heartbeat on."""
        self.local = local

    # -- internals --------------------------------------------------------------------------

    def _heartbeat(self, now: float) -> list[Effect]:
        self._seq += 1
        if self._last_beat is not None and self._beat_at is not None:  # less what this one is late (see the top)
            declared_s = self._last_beat.interval_ms / 1000
            late_s = max(now - self._beat_at - declared_s, 0.0)
            self._beat_cap_s = max(self.config.next_cap_s(declared_s) - late_s, self.config.heartbeat_interval_s)
        self._beat_at = now
        self._beat_peers = len(self._peers)
        spacing_s = self.spacing_s()
        interval_ms = math.ceil(spacing_s * 1000)
        beat = Heartbeat(
            seq=self._seq,
            started_ms=self.started_ms,
            addrs=self.local.addrs,
            data_addr=self.local.data_addr,
            roles=self.local.roles,
            capacity=self.local.capacity,
            reachable=self.local.reachable,
            name=self.local.name,
            interval_ms=interval_ms,
        )
        self._last_beat = beat
        return [Publish(HEARTBEAT_TOPIC, beat), SetTimer(now + spacing_s, TIMER_HEARTBEAT)]

    def _expire(self, now: float) -> list[Effect]:
        gone = [p for p, e in self._peers.items() if now - e.last_heard > e.horizon_s]
        for peer in gone:
            entry = self._peers.pop(peer)
            self._connect_asked.discard(peer)
            self._departed.pop(peer, None)
            self._departed[peer] = (now, entry.started_ms, entry.seq)
        self._forget_old(now)
        return [Emit(PeerLeft(peer, LeftBecause.EXPIRED)) for peer in gone]

    def _forget_old(self, now: float) -> None:
        """Bound what peers outside the table leave behind: ended bans, scores (a rejected frame
        from each of countless fresh identities), replay memory (REPLAY_MEMORY_S, MAX_REMEMBERED)."""
        for peer in [p for p, until in self._banned_until.items() if now >= until]:
            self.is_banned(peer, now)  # (drops the ban and its score)
        if len(self._scores) > MAX_REMEMBERED:
            for peer in [p for p in self._scores if p not in self._peers and p not in self._banned_until]:
                del self._scores[peer]
                if len(self._scores) <= MAX_REMEMBERED // 2:
                    break
        while self._departed and (len(self._departed) > MAX_REMEMBERED
                                  or now - next(iter(self._departed.values()))[0] > REPLAY_MEMORY_S):
            self._departed.popitem(last=False)


class ClockSkew:
    """Whether our clock looks wrong, from frames rejected as stale (pure: times passed in).

    `observe(now, peer, rejection)` remembers, per peer, the offset of its last stale frame
    (`StaleMessage.age_s`: positive when its timestamp is behind our clock). At most once per
    `interval_s` it returns a warning naming how many peers sent stale frames within `window_s`
    and their median offset; otherwise None. Other rejections are ignored. One peer with a wrong
    clock warns too, but the count tells them apart: many peers mean it is our clock. At most
    `max_peers` peers are remembered (the oldest go first).
    """

    def __init__(self, window_s: float = 60.0, interval_s: float = 60.0, max_peers: int = 1024) -> None:
        self.window_s = window_s
        self.interval_s = interval_s
        self.max_peers = max_peers
        self._recent: dict[str, tuple[float, float]] = {}  # peer -> (when, offset in s), oldest first
        self._warned_at = -math.inf
        self.stale_frames = 0

    def observe(self, now: float, peer: str, rejection: MessageRejected) -> str | None:
        if not isinstance(rejection, StaleMessage):
            return None
        self.stale_frames += 1
        self._recent.pop(peer, None)
        self._recent[peer] = (now, rejection.age_s)
        self._forget_before(now - self.window_s)
        if now - self._warned_at < self.interval_s:
            return None
        self._warned_at = now
        return self._warning()

    def offsets(self) -> dict[str, float]:
        """Each recent peer's last stale offset (s)."""
        return {peer: age for peer, (_, age) in self._recent.items()}

    def _forget_before(self, horizon: float) -> None:
        while self._recent:
            peer, (when, _) = next(iter(self._recent.items()))
            if when >= horizon and len(self._recent) <= self.max_peers:
                return
            del self._recent[peer]

    def _warning(self) -> str:
        ages = sorted(age for _, age in self._recent.values())
        median = ages[len(ages) // 2]
        count = len(ages)
        side = "behind" if median > 0 else "ahead of"
        peers, whose = (f"{count} peers", "they agree") if count > 1 else ("1 peer", "or that peer's is")
        return (f"messages from {peers} are ~{abs(median):.0f} s {side} our clock and are rejected as stale: "
                f"is this machine's clock wrong? ({whose}; check NTP)")
