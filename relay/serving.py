"""The serving policy, with no sockets: who gets our upload next, byte budgets and the meter
of what our uploads really deliver. The relay role (real world) and `simulations.dataplane`
(virtual time) both drive `ServingCore`: no serving decision lives only in one of them.

`ServingCore`: at most `slots` chunks served at once (set with `set_slots` when the transfer
core asks, `relay.effects.ServeAtOnce`: every child at once where fan-outs are small, since a
child beyond the slots gets each chunk a whole transfer late), at most `per_peer` to one requester,
urgent requests (the requester forwards that stripe) first, then round robin across peers; a
request for a chunk not held yet waits for it (long poll) up to `wait_limit_s`, unless its
requester is the peer we asked for that chunk ourselves: then it is refused at once, or the two
of us would wait on each other until a wait limit (`ask`). Once urgent
requests hold every slot but one, a waiting request that is not urgent (and under its
`per_peer`) goes before them; no slot is left idle for it, and with one slot urgent requests
keep it. Why: a fast member high in its home stripe feeds dozens of children, most of them
forwarders, and served its leaves only once those were done; with the leaves attached slowest
first (`relay.planner`), those leaves are the slowest downloaders, which need every stripe from
the start (1,000 relays, 1 GB: exact views 1.09x the bound -> 1.08x, 10% of relays at a tenth
of their upload 1.15x -> 1.11x; see BENCHMARKS.md; a share of the slots per requester instead
gave 1.05x and 1.18x). A requester
that forwards gets its urgent chunks one at a time (`urgent_per_peer`): two chunks sent to it at
once would each arrive at half the rate, and it can forward neither until it holds it, so every
hop of its stripe's tree would take twice as long (measured, homogeneous N = 1,023: 64 chunks
1.55x the optimum with two at once, 1.22x with one).
A serve that has lasted `linger_factor` times our typical serving time (the 25th percentile of
the last `LINGER_SAMPLES` serves, lingering ones included, once there are
`LINGER_MIN_SAMPLES`) lingers: it stops holding its slot and goes on sending, and the next
queued request gets the slot; at most `linger_cap` x the slots linger at once (past that a long
serve keeps its slot as before). Why: a receiver with a small download (home links download
at most a few times their small upload) takes a chunk many times longer than the rest of our
children; with 16 slots a fast parent of a few such receivers had every slot held by them for
12-15 s a chunk, and everyone else waited in its queue (2,000 relays, 10 GB, exact views: the
last relays completed at 1.13-1.29x their own S/download). Measured (seed 1, BENCHMARKS.md):
2,000 relays, 10 GB, exact views 1.156x the bound -> 1.049x; but with 10% of relays at a tenth
of their upload 1.22x -> 1.37x and 6.0 -> 15.9 origin copies. Lingering serves are timed too:
timing only the serves that kept their slot, a source whose own upload is the bottleneck kept
the short typical time of its first serves, its later serves (sharing its upload with more)
all lingered up to the cap, 48 chunks at once each at a third of the rate: 1.54x there (1.012x
exact). 64 slots instead gave 1.010x there but cost 3x
the simulator's time and made worlds with unlimited downloads slower (a source splits its upload
over more chunks at once and each arrives later); there every chunk of a source takes about as
long, so none lingers and those worlds are unchanged. A lingering serve still counts against
its requester's `per_peer` and `urgent_per_peer` (a slow receiver gets no more chunks at once),
not as an urgent request holding a slot (`_urgent_hold_all_but_one`). `full` counts the slots
only: a slot freed by a lingering serve is free (a request would be served at once, and what
keeps that chunk going is its receiver, not our upload).
`ByteBudget`: a token bucket (one second of burst) for bytes served, to one peer or to all;
bytes reserved for a serve that never sent its first byte are refunded.
`UploadMeter`: bytes sent while every upload slot was taken (`ServingCore.full`), over that
time, in a sliding window: when the slots are all busy our upload is the bottleneck, so that rate
(lingering serves' bytes included) is what we can deliver; the relay advertises it instead of its
configured `upload_bps` when it is lower.

Everything here is pure (the caller passes the time). This module must not do I/O.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Hashable

from p2pnet.config import validated

LINGER_SAMPLES = 64  # completed serves the typical serving time is taken from
LINGER_MIN_SAMPLES = 8  # no serve lingers before we have timed this many


@validated
@dataclass(frozen=True)
class ServingConfig:
    """`slots`: chunks served at once; `per_peer`: of them to one requester at most (0: half the
    slots); `urgent_per_peer`: of those, urgent ones (the requester forwards them) at most (0:
    `per_peer`); the requester's next urgent chunk waits in our queue, so no round trip is lost
    between two; `wait_limit_s`: how long a request for a chunk we do not hold yet waits for it
    before it is answered "unavailable" (the requester then asks elsewhere).
    `linger_factor`: a chunk served for longer than this many times our typical serving time
    (the 25th percentile of our last `LINGER_SAMPLES` completed serves, once we have
    `LINGER_MIN_SAMPLES`) stops holding its slot and goes on sending: a slow downloader no longer
    keeps our other requesters waiting (0: off; below 1 most serves would stop holding their
    slot, so the slots would no longer bound anything). `linger_cap`: at most this many times
    the slots such lingering serves at once (each is still a flow our upload is shared with;
    at the cap, a long serve keeps its slot as before)."""

    slots: int = 16
    per_peer: int = 0
    urgent_per_peer: int = 1
    wait_limit_s: float = 10.0
    linger_factor: float = 1.5
    linger_cap: int = 2

    def check(self) -> dict[str, str]:
        problems = {}
        if self.slots < 1:
            problems["slots"] = "must be >= 1"
        if self.per_peer < 0:
            problems["per_peer"] = "must be >= 0 (0: half the slots)"
        if self.urgent_per_peer < 0:
            problems["urgent_per_peer"] = "must be >= 0 (0: per_peer)"
        if not self.wait_limit_s > 0:
            problems["wait_limit_s"] = "must be > 0"
        problems.update(linger_problems(self.linger_factor, self.linger_cap))
        return problems


def linger_problems(factor: float, cap: int) -> dict[str, str]:
    """What is wrong with a linger factor and cap, keyed `linger_factor` / `linger_cap` (the
    relay's and the simulator's settings report them under their own names)."""
    problems = {}
    if not (factor == 0 or 1.0 <= factor < float("inf")):
        problems["linger_factor"] = "must be 0 (off) or in [1, inf): below 1 a typical serve would linger"
    if not 1 <= cap <= 16:
        problems["linger_cap"] = "must be in [1, 16] (times the slots)"
    return problems


@dataclass(frozen=True, slots=True)
class Serve:
    """Send the chunk asked for by `token` now (it holds an upload slot until `done`).
    `queued_s`: how long it waited for a slot after we held the chunk (the long poll's wait for
    the chunk itself is not counted). The shell tells the requester in the answer's header, so
    that a requester times our delivery with our queue in it: a relay with more children than
    its upload can feed serves each chunk fast but each child rarely."""

    token: Hashable
    queued_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer `token` "unavailable": the chunk did not arrive within the wait limit."""

    token: Hashable


@dataclass(slots=True)
class _Serving:
    """A request being served: it holds a slot until `done`, or until it lingers."""

    token: Hashable
    peer: str
    urgent: bool
    start: float
    lingering: bool = False
    over: bool = False  # `done` was called (its entry in `_order` is skipped)


@dataclass(slots=True)
class _Ask:
    token: Hashable
    peer: str
    urgent: bool
    key: tuple[int, int]
    deadline: float
    ready_at: float = 0.0  # when we held the chunk and the ask joined the queue


class ServingCore:
    """Who gets our upload next: a pure core (no I/O, no clock; the caller passes `now`).

    A request (`ask`) for a chunk we hold joins the queue; one for a chunk we do not hold yet
    waits for it (`arrived`) up to `wait_limit_s` (`expire` refuses the late ones), so a
    child is answered as soon as we verified the chunk (cut-through); one from the peer we asked
    for that chunk ourselves is refused at once (no two peers wait on each other). Queued requests get
    slots urgent first (the requester forwards that chunk's stripe to others) until urgent ones
    hold every slot but one, then a waiting request that is not urgent first
    (`_urgent_hold_all_but_one`), round robin across peers, first come first served within a
    peer, and one peer holds at most `per_peer` slots, at most `urgent_per_peer` of them for
    urgent requests. `done` frees a slot; `drop_peer` forgets a requester that went away.
    Every method returns the `Serve` / `Refuse` actions for the shell to carry out.
    `full` says whether every slot is taken (our upload is the bottleneck then)."""

    def __init__(self, config: ServingConfig | None = None) -> None:
        self.config = config or ServingConfig()
        self.per_peer = self.config.per_peer or max(1, self.config.slots // 2)
        self.urgent_per_peer = min(self.per_peer, self.config.urgent_per_peer or self.per_peer)
        self.free = self.config.slots
        self.slots = self.config.slots  # `set_slots` may raise it
        self._serving: dict[Hashable, _Serving] = {}  # token -> its serve, until `done` (lingering or not)
        self._order: deque[_Serving] = deque()  # serves holding a slot in start order (and skipped ones)
        self._lingering = 0  # serves that stopped holding a slot (`linger_factor`)
        self._lingering_urgent = 0  # of them, urgent ones
        self._recent: deque[float] = deque()  # durations of the last LINGER_SAMPLES serves, lingering or not
        self._sorted: list[float] = []  # the same, sorted (the typical time is a percentile of them)
        self._linger_after: float | None = None  # linger_factor x the typical serving time, once known
        self._linger_limit = self.config.linger_cap * self.slots
        self._held_urgent: dict[str, int] = {}  # peer -> slots it holds for urgent requests
        self._held: dict[str, int] = {}  # peer -> slots it holds
        self._queues: tuple[OrderedDict[str, deque[_Ask]], ...] = (OrderedDict(), OrderedDict())  # urgent, normal
        self._queued: dict[Hashable, _Ask] = {}
        self._waiting: dict[tuple[int, int], dict[Hashable, _Ask]] = {}  # chunk -> its waiting asks, by token
        self._waiting_for: dict[Hashable, tuple[int, int]] = {}  # token -> the chunk it waits for (`cancel`)
        self._deadlines: deque[_Ask] = deque()  # waiting asks in deadline order (one wait limit for all)

    @property
    def full(self) -> bool:
        return self.free <= 0

    def ask(self, now: float, token: Hashable, peer: str, version: int, index: int, urgent: bool,
            held: bool, asked_of: str | None = None) -> list[Serve | Refuse]:
        """`peer` asks for chunk `index` of `version` (`held`: we hold it). `asked_of`: the peer
        our own request for that chunk is outstanding with (`relay.transfer.TransferCore.asking`;
        None: none). A request for a chunk we do not hold waits for it, unless its requester is
        that very peer: then it is refused at once, since each of us would wait on the other until
        a wait limit (plans made before and after a membership change can put the chunk in
        different stripes, each of us a leaf of the other's; seen in the lab: 30 s lost to one
        chunk). The requester asks the next candidate, and the chunk comes to us from wherever
        it gets it (our own request is still waiting there)."""
        ask = _Ask(token, peer, urgent, (version, index), now + self.config.wait_limit_s, now)
        if not held and asked_of == peer:
            return [Refuse(token)]
        if not held:
            self._waiting.setdefault(ask.key, {})[token] = ask
            self._waiting_for[token] = ask.key
            self._deadlines.append(ask)
            return []
        self._enqueue(ask)
        return self._grant(now)

    def arrived(self, now: float, version: int, index: int) -> list[Serve | Refuse]:
        """We now hold chunk `index` of `version`: the requests waiting for it are queued."""
        waiting = self._waiting.pop((version, index), None)
        if not waiting:
            return []
        for ask in waiting.values():
            self._waiting_for.pop(ask.token, None)
            ask.deadline = -1.0  # no longer waiting (its entry in `_deadlines` is skipped)
            ask.ready_at = now
            self._enqueue(ask)
        return self._grant(now)

    def done(self, now: float, token: Hashable) -> list[Serve | Refuse]:
        """The answer to `token` was sent (or failed): its slot is free."""
        serve = self._serving.pop(token, None)
        if serve is None:
            return []
        serve.over = True
        if serve.lingering:
            self._lingering -= 1
            self._lingering_urgent -= serve.urgent
        else:
            self.free += 1
        if self.config.linger_factor:  # lingering serves too: else a source whose own upload is
            self._sample(now - serve.start)  # the bottleneck keeps a typical time from before its serves piled up
        _decrement(self._held, serve.peer)
        if serve.urgent:
            _decrement(self._held_urgent, serve.peer)
        return self._grant(now)

    def set_slots(self, now: float, slots: int) -> list[Serve | Refuse]:
        """Serve up to max(`slots`, the configured slots) chunks at once from now on: raises or
        lowers the slots (`relay.effects.ServeAtOnce`; 0 goes back to the configured ones). Below
        the number being served, `free` goes negative and nothing more is granted until it is
        positive again (`full` holds meanwhile)."""
        slots = max(self.config.slots, slots)
        self.free += slots - self.slots
        self.slots = slots
        self._linger_limit = self.config.linger_cap * slots
        return self._grant(now)

    def cancel(self, token: Hashable) -> None:
        """Forget a request that is queued or waiting (its requester is gone); a request being
        served is ended with `done`."""
        ask = self._queued.pop(token, None)
        if ask is not None:
            queues = self._queues[0 if ask.urgent else 1]
            mine = queues.get(ask.peer)
            if mine is not None:
                mine.remove(ask)
                if not mine:
                    del queues[ask.peer]
            return
        key = self._waiting_for.pop(token, None)  # (by index: a connection's close cancels thousands)
        if key is not None:
            asks = self._waiting[key]
            asks.pop(token).deadline = -1.0
            if not asks:
                del self._waiting[key]

    def drop_peer(self, peer: str) -> list[Hashable]:
        """Forget every request of `peer` that is queued or waiting; their tokens."""
        dropped = []
        for queues in self._queues:
            for ask in queues.pop(peer, ()):
                self._queued.pop(ask.token, None)
                dropped.append(ask.token)
        for key in list(self._waiting):
            kept = {}
            for token, ask in self._waiting[key].items():
                if ask.peer == peer:
                    ask.deadline = -1.0
                    dropped.append(token)
                    del self._waiting_for[token]
                else:
                    kept[token] = ask
            if kept:
                self._waiting[key] = kept
            else:
                del self._waiting[key]
        return dropped

    def clear(self) -> list[Hashable]:
        """Forget every request queued or waiting (we stopped or crashed); their tokens. Those
        being served keep their slots until `done`."""
        tokens = list(self._queued) + list(self._waiting_for)
        for queues in self._queues:
            queues.clear()
        self._queued.clear()
        self._waiting.clear()
        self._waiting_for.clear()
        self._deadlines.clear()
        return tokens

    def requesters(self) -> set[str]:
        """Peers with a request queued or waiting here."""
        return {a.peer for a in self._queued.values()} | {a.peer for asks in self._waiting.values() for a in asks.values()}

    def expire(self, now: float) -> list[Serve | Refuse]:
        """Refuse the waiting requests whose wait limit has passed; serves that have lasted
        `linger_factor` times the typical serving time stop holding their slot (queued requests
        get them)."""
        out: list[Serve | Refuse] = []
        deadlines = self._deadlines
        while deadlines and deadlines[0].deadline <= now:
            ask = deadlines.popleft()
            if ask.deadline < 0:
                continue  # answered or forgotten meanwhile
            asks = self._waiting.get(ask.key)
            if asks is not None:
                del asks[ask.token]
                del self._waiting_for[ask.token]
                if not asks:
                    del self._waiting[ask.key]
            out.append(Refuse(ask.token))
        if self._order and self._linger_after is not None:
            out.extend(self._grant(now))  # `_grant` releases the serves due first
        return out

    def next_deadline(self, releases: bool = True) -> float | None:
        """When `expire` next has something to do: the earliest waiting request's wait limit or
        the next serve's release from its slot (None: neither). `releases` False leaves the
        releases out: a release that comes due is also made by the next call that grants slots,
        so a shell that does not watch `full` (the simulator) needs its time only while
        requests are queued."""
        deadlines = self._deadlines
        while deadlines and deadlines[0].deadline < 0:
            deadlines.popleft()
        out = deadlines[0].deadline if deadlines else None
        if releases:
            release = self._next_release()
            if release is not None and (out is None or release < out):
                out = release
        return out

    @property
    def queued(self) -> int:
        """Requests for chunks we hold that wait for a slot."""
        return len(self._queued)

    def status(self) -> dict[str, int]:
        """`serving`: chunks being sent, `lingering` of them without a slot."""
        return {"slots": self.slots, "serving": len(self._serving), "lingering": self._lingering,
                "queued": len(self._queued), "waiting": sum(len(a) for a in self._waiting.values())}

    def _sample(self, seconds: float) -> None:
        """Keep the duration of a finished serve (lingering or not); the typical serving time
        is the 25th percentile of the last LINGER_SAMPLES (kept sorted: a bisect per serve)."""
        recent, ordered = self._recent, self._sorted
        if len(recent) == LINGER_SAMPLES:
            del ordered[bisect_left(ordered, recent.popleft())]
        recent.append(seconds)
        insort(ordered, seconds)
        if len(ordered) >= LINGER_MIN_SAMPLES:
            self._linger_after = self.config.linger_factor * ordered[len(ordered) // 4]

    def _next_release(self) -> float | None:
        """When the oldest serve holding a slot lingers (None: none can, not yet or at the cap)."""
        if self._linger_after is None or self._lingering >= self._linger_limit:
            return None
        oldest = self._oldest_holder()
        return oldest.start + self._linger_after if oldest is not None else None

    def _oldest_holder(self) -> _Serving | None:
        """The serve that has held its slot longest (finished ones are dropped from the front)."""
        order = self._order
        while order and order[0].over:
            order.popleft()
        return order[0] if order else None

    def _release(self, now: float) -> None:
        """Serves held longer than `_linger_after` stop holding their slot, oldest first, up to
        the cap."""
        after = self._linger_after
        if after is None:
            return
        while self._lingering < self._linger_limit:
            serve = self._oldest_holder()
            if serve is None or serve.start + after > now:
                return
            self._order.popleft()
            serve.lingering = True
            self._lingering += 1
            self._lingering_urgent += serve.urgent
            self.free += 1

    def _enqueue(self, ask: _Ask) -> None:
        queues = self._queues[0 if ask.urgent else 1]
        mine = queues.get(ask.peer)
        if mine is None:
            mine = queues[ask.peer] = deque()
        mine.append(ask)
        self._queued[ask.token] = ask

    def _grant(self, now: float) -> list[Serve | Refuse]:
        if self._order:
            self._release(now)  # (nothing without a linger time)
        out: list[Serve | Refuse] = []
        while self.free > 0:
            ask = self._next()
            if ask is None:
                break
            self.free -= 1
            self._held[ask.peer] = self._held.get(ask.peer, 0) + 1
            if ask.urgent:
                self._held_urgent[ask.peer] = self._held_urgent.get(ask.peer, 0) + 1
            serve = self._serving[ask.token] = _Serving(ask.token, ask.peer, ask.urgent, now)
            if self.config.linger_factor:
                order = self._order
                order.append(serve)
                if len(order) > 4 * self.slots + 64:  # finished serves behind a long one (at the cap nothing pops them)
                    self._order = deque(s for s in order if not s.over)
            out.append(Serve(ask.token, max(0.0, now - ask.ready_at)))
        return out

    def _next(self) -> _Ask | None:
        """The first queued ask, urgent first (but see `_urgent_hold_all_but_one`), round robin
        across peers under their cap."""
        urgent_cap = self.urgent_per_peer
        order = zip(self._queues, (True, False))
        if self._queues[0] and self._queues[1] and self._urgent_hold_all_but_one():
            order = zip(reversed(self._queues), (False, True))
        for queues, urgent in order:
            for peer in queues:
                if self._held.get(peer, 0) >= self.per_peer or \
                        (urgent and self._held_urgent.get(peer, 0) >= urgent_cap):
                    continue
                mine = queues.pop(peer)  # round robin: this peer goes to the back
                ask = mine.popleft()
                if mine:
                    queues[peer] = mine
                del self._queued[ask.token]
                return ask
        return None

    def _urgent_hold_all_but_one(self) -> bool:
        """Whether urgent requests hold every slot but one already (with one slot, that one):
        then a waiting request that is not urgent goes first, so that a forwarder with more
        children that forward than slots (a fast member high in its home stripe) does not starve
        its leaves."""
        return sum(self._held_urgent.values()) - self._lingering_urgent >= max(1, self.slots - 1)


def _decrement(counts: dict[str, int], peer: str) -> None:
    left = counts[peer] - 1
    if left:
        counts[peer] = left
    else:
        del counts[peer]


class ByteBudget:
    """Bytes served to one peer per second at most: a token bucket of `rate_bps` with one second
    of burst. `reserve(now, n)` takes `n` bytes and says how long to wait before sending them
    (0 while within budget). Pure: the caller sleeps."""

    def __init__(self, rate_bps: float) -> None:
        self.rate_bps = rate_bps
        self._tokens = rate_bps
        self._at = 0.0

    def reserve(self, now: float, nbytes: int) -> float:
        self._tokens = min(self.rate_bps, self._tokens + (now - self._at) * self.rate_bps)
        self._at = now
        self._tokens -= nbytes
        return max(0.0, -self._tokens / self.rate_bps)

    def refund(self, nbytes: int) -> None:
        """Give back bytes reserved but never sent (the serve was cancelled or refused before its
        first byte); else those bytes would delay every later serve."""
        self._tokens = min(self.rate_bps, self._tokens + nbytes)


class UploadMeter:
    """The rate our uploads deliver while they are the bottleneck (see the module docstring).

    `full(now, sent)` and `not_full(now, sent)` mark the times every slot became taken and one
    became free again, with the bytes sent so far; `rate(now, sent)` is bytes over seconds of
    such stretches within the last `window_s`, or None with less than `min_full_s` of them."""

    def __init__(self, window_s: float = 30.0, min_full_s: float = 2.0) -> None:
        self.window_s = window_s
        self.min_full_s = min_full_s
        self._since: tuple[float, int] | None = None
        self._stretches: deque[tuple[float, float, int]] = deque()  # (end, seconds, bytes)

    def full(self, now: float, sent: int) -> None:
        if self._since is None:
            self._since = (now, sent)

    def not_full(self, now: float, sent: int) -> None:
        if self._since is not None:
            start, at = self._since
            self._stretches.append((now, now - start, sent - at))
            self._since = None

    def rate(self, now: float, sent: int) -> float | None:
        while self._stretches and self._stretches[0][0] < now - self.window_s:
            self._stretches.popleft()
        seconds = sum(s for _, s, _ in self._stretches)
        nbytes = sum(b for _, _, b in self._stretches)
        if self._since is not None:
            seconds += now - self._since[0]
            nbytes += sent - self._since[1]
        return nbytes / seconds if seconds >= self.min_full_s else None
