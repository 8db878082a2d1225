"""The transfer core's chunk requests: which chunk next, whom to ask, and when not to ask.

Mixed into `relay.transfer.TransferCore` (`Requesting`). A stripe's chain of sources is our parent
in its plan (or a substitute for it, `relay.sources`) and its ancestors (`_chain`). `_pump` issues
requests while each (source, stripe) link's window (`window_per_source`) and the core's in-flight
budget (`max_in_flight`) allow, stripe by stripe; `_issue_one` takes a stripe's next chunk (its
retry queue first, `_next_index`) and asks it of the first usable member of the stripe's chain, else
of a holder of the whole version (`_choose_source`), passing over those we pass over in that stripe
alone (`_passed_over`), parking it for the next tick when nobody is usable; `_note_request` and
`_settle` keep the in-flight and per-source bookkeeping as a request goes out and is answered or
taken back; `_refill` offers what settling frees to every version in progress, newest first, when the
budget kept one from asking (its requests go out then, not on the next tick). While members'
dial-backs are pending (`set_members`' `unconfirmed`), the origin is asked first only for the chunks
the plan with them dialable gives us from it (`_await_dial_backs`, below). `asked_for` fetches a
chunk someone waits for from us down our home stripe's chain at once; `hold_requests` stops new
requests for a while (our store is full or failing), `_hold_ends` says when the tick resumes them.

A forwarder we took in place of the origin (`relay.sources`, `_leave_origin`) gets one request at a
time until we timed a chunk of it (`_window`): it is judged from its first chunk (`relay.judging`,
`_short_of_origin`), and what it sends us before that is its upload taken from the members it feeds
by the plan, every one of them too little if it delivers too little. The lab's 6 relays under an
origin advertising the default (the simulator, `tests/relay/test_origin_advertising_default.py`):
one of them sending 20 KB/s, 38.8 -> 25.7 s; five of them, 251.7 -> 235.3 s (221.2 s with nobody
leaving the origin); the same relays honest, 9.55 s either way.

Dial-backs pending. Members nobody has dialled back yet are planned as leaves (upload 0), so a
version known before their dial-backs come (a trainer publishing as the relays start) is planned
with the origin as our parent in every stripe, and its requests, out before the replan, are served
(nothing takes them back): in the lab (6 relays, a trainer at 24 Mbit/s, 12 MiB published early,
`tests/relay/test_lab_capped_origin.py`) every relay asked the trainer for a window of chunks in
every stripe for the ~3 s until the dial-backs came (2 s of the reachability check's first retry,
0.6 s of dial-back, a heartbeat), the same chunks at each relay, and the trainer sent 1.8-2.3
copies. Meanwhile we ask the origin only for the chunks of the stripes whose root we are in the plan
with those members dialable (at the uploads they advertise): the origin's upload then goes to chunks
nobody else asks it for. An upload advertised by a member nobody dialled back is a claim nobody
checked: once members are dialled back it is hoped at no more than the highest upload one of them
is planned at (`_hope_cap`); uncapped, ten strangers saying forever that nobody dialled them back
and claiming 1e12 B/s rooted nearly every chunk of that plan, so the honest relays had none of their
own to wait on and asked the origin for everything, as with no rule. While nobody is dialled back
there is nothing every relay knows alike to cap a claim at, and each must hope for the same plan as
the others (see `_hope_cap`): the strangers then still take that plan, and the honest relays ask as
with no rule (simulator, 6 honest relays dialled back at 1 s, origin at 3 MB/s: 1.96 copies sent the
honest relays, 1.52 with the strangers known not dialable). A member pending for longer than an
honest dial-back takes (`PENDING_HOPE_S`, from when we were first told it pending) is hoped for no
more, the wait it held ends at our next pump (an answer, or the core's tick): strangers pending
since 20 s before a version cost it nothing (the same world at 100 MB/s: 1.77 copies sent the honest
relays, as with the strangers known not dialable; 1.91 uncapped, 1.96 capped, still hoped for).
The others are kept (`_Version.kept`), save those someone waits for from us: our home stripe's in
the plan we have (kept, each relay's requests budget filled with requests waiting at relays that
kept them, before its own stripes were asked; a stranger saying forever that nobody dialled it back
stalled every later version, simulator 4.9 s -> 77 s), and any asked of us (`asked_for`; kept, the
asker's request waited at us, nothing asked it again when the wait ended, and with a member flipping
every 0.1 s relays waited on each other in a ring, 5.5 s -> 33.7 s), until the dial-backs come (the
replan asks them of their roots) or until every chunk of our own stripes is held or asked, whichever
comes first: no timer, and no member whose verdict never comes holds us longer than the origin takes
to feed our own stripes (a fast origin, soon; stop 51's wait for the dial-backs themselves stalled
relays dialled back one by one, 1.4 s -> 11.2 s in the simulator). A leaf in every stripe of that
plan, and a relay whose own chunks all came, waits for nothing. Lab, with the dial-backs known ~1 s
after the start (`p2pnet.reachability`, `NO_PEERS_RETRY_S`): 1.23-1.37 copies in four runs, 6.1-6.6
s to all (base 1.84-1.98 copies, 8.6-9.2 s, five runs); what is left is what each relay asked before
it knew the others (the first 0.5 s) and is served twice.

These methods read the core's configuration, membership, versions, exclusions, bans and measured
rates, keep `_in_flight` and `_hold_until`, and change a version's requests; they also call the
core's `_substitute`, `_spare_origin` and `_endgame_source` (`relay.sources`), `_pump_swarm`
(`relay.swarm_transfer`), `_arm(now, effects)` and `_newest_first()`. Like the core they do no I/O
and take the time as an argument.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any

from relay.effects import Fetch
from relay.planner import Membership, plan_broadcast, tiebreak
from relay.transfer_state import _requeue, _Source

#: how long a member may be pending (nobody has dialled it back: `set_members`' `unconfirmed`) and still
#: be hoped for (`_await_dial_backs`): an honest relay's dial-back ends within the time its dial-back
#: client waits for an answer (`p2pnet.reachability.ASK_TIMEOUT_S`, 15 s: a relay nobody can dial
#: learns it by then and says so, False); one pending longer says so of itself forever for all we know
PENDING_HOPE_S = 15.0

if TYPE_CHECKING:
    from relay.planner import StripePlan
    from relay.transfer import TransferConfig
    from relay.transfer_state import _Version


class Requesting:
    """Chunk requests for `relay.transfer.TransferCore` (see the module docstring)."""

    # the core's state these methods use (`TransferCore.__init__` sets it)
    config: TransferConfig
    self_id: str
    _members: Membership
    _versions: dict[int, _Version]
    _excluded: dict[str, float]
    _banned: set[str]
    _rates: dict[str, float]
    _samples: dict[str, int]
    _in_flight: int
    _starved: bool  # the in-flight budget, not a window, stopped a pump since (`_refill`)
    _hold_until: float
    _unconfirmed: dict[str, float]
    _pending_since: dict[str, float]

    if TYPE_CHECKING:  # what these call on the core (`relay.transfer.TransferCore` or another of its mixins)
        def _spare_origin(self, now: float, v: _Version, stripe: int, source: str | None,
                          tried: Any) -> str | None: ...
        def _substitute(self, now: float, plan: StripePlan, stripe: int, below: tuple[int, str] | None,
                        lost: str | None = None, skip: str | None = None, avoid: Any = (),
                        strict: bool = True) -> str | None: ...
        def _endgame_source(self, now: float, v: _Version, stripe: int, index: int) -> str | None: ...
        def _pump_swarm(self, now: float, v: _Version, effects: list[Any]) -> None: ...
        def _arm(self, now: float, effects: list[Any]) -> list[Any]: ...
        def _newest_first(self) -> list[_Version]: ...
        def _origin_upload(self, v: _Version) -> float: ...

    # -- issuing requests ---------------------------------------------------------------

    def _chain(self, now: float, plan: StripePlan, stripe: int) -> list[str]:
        """Where to fetch `stripe` from, in order: our parent (or a substitute: `relay.sources`),
        then its ancestors up to the origin."""
        chain = plan.ancestors(stripe, self.self_id)
        if self.self_id == plan.origin:
            return chain
        if chain and (chain[0] == plan.origin or self._usable(now, chain[0])):
            return chain
        pick = self._substitute(now, plan, stripe, (len(chain), self.self_id) if chain else None,
                                chain[0] if chain else None)
        if not chain:  # we joined after the plan
            return [p for p in (pick, plan.origin) if p is not None]
        return [pick] + chain if pick is not None else chain

    def _pump(self, now: float, v: _Version, effects: list[Any], stripe: int | None = None) -> None:
        """Issue requests while windows and the in-flight budget allow; `stripe` first if given.
        The origin holds everything unless a chunk was `lost`; then it fetches it from holders."""
        if v.swarm is not None:
            if not v.complete and now >= self._hold_until and now >= v.hold_until:
                self._pump_swarm(now, v, effects)
            return
        if v.complete or v.plan is None or now < self._hold_until or now < v.hold_until:
            return
        if v.origin_only is not None:
            if now >= v.hope_until:  # a member hoped for has been pending too long: hoped for no more
                self._await_dial_backs(now, v, self._origin_upload(v))
            if v.origin_only is None or self._wait_over(v):
                stripe = None  # the chunks kept from the origin are back in every stripe's queue
        budget = self.config.max_in_flight - self._in_flight
        if stripe is not None and stripe < v.plan.stripes:
            while budget > 0 and self._issue_one(now, v, stripe, effects):
                budget -= 1
            if budget > 0 and not v.starved:
                return  # only that stripe's window opened; the others were not waiting on budget
        v.starved = False
        progress = True
        while budget > 0 and progress:
            progress = False
            for s in range(v.plan.stripes):
                if budget <= 0:
                    break
                if self._issue_one(now, v, s, effects):
                    budget -= 1
                    progress = True
        if budget <= 0:
            v.starved = self._starved = True  # some stripe may still want to issue when the budget frees up

    def _refill(self, now: float, v: _Version | None, effects: list[Any], stripe: int | None = None) -> None:
        """Requests settled (answered, failed or taken back), `v`'s among them: its freed budget
        goes to `v` (`stripe` first, as `_pump`), unless the budget starved a pump (`_starved`)
        while another version is still incomplete: then to every incomplete version, newest
        first, as on the core's tick, so that what one version frees (or no longer needs once
        complete) is not left unused until the tick (`stall_timeout_s / 4`) by a version that
        asked while none was free. O(1) with one version in progress, else O(versions) and a
        pump of each."""
        if self._starved and any(o is not v and not o.complete for o in self._versions.values()):
            self._starved = False  # (each pump that runs out of budget sets it again)
            for other in self._newest_first():
                if not other.complete:
                    self._pump(now, other, effects, stripe if other is v else None)
        elif v is not None:
            self._pump(now, v, effects, stripe)

    def _next_index(self, v: _Version, stripe: int) -> tuple[int | None, bool]:
        """The next chunk of `stripe` to request, and whether it came from the retry queue."""
        have, in_flight = v.have, v.in_flight
        queue = v.retry[stripe]
        while queue:
            index = queue[0]
            if have[index] or index in in_flight:
                queue.popleft()
                continue
            return index, True
        chunks = v.plan.chunks_of_stripe[stripe]  # type: ignore[union-attr]
        pos = v.next_pos[stripe]
        end = len(chunks)
        while pos < end and (have[chunks[pos]] or chunks[pos] in in_flight):
            pos += 1
        v.next_pos[stripe] = pos
        return (chunks[pos], False) if pos < end else (None, False)

    def _issue_one(self, now: float, v: _Version, stripe: int, effects: list[Any]) -> bool:
        """Ask for `stripe`'s next chunk; whether one was asked. Chunks kept from the origin while
        dial-backs are pending (`_await_dial_backs`) are passed on the way."""
        while True:
            issued = self._issue_next(now, v, stripe, effects)
            if issued is not None:
                return issued

    def _issue_next(self, now: float, v: _Version, stripe: int, effects: list[Any]) -> bool | None:
        """`_issue_one` once: True (asked), False (nothing to ask now), None (a chunk kept from the
        origin for now: try the next)."""
        source = None
        if not v.tried:  # nothing failed: the source is the first usable ancestor, whichever the chunk
            first = self._first_usable(now, v.chains[stripe], self._passed_over(now, v, stripe) if v.passed else ())
            source = self._spare_origin(now, v, stripe, first, ())
            if source is not None and v.link_load.get((source, stripe), 0) >= self._window(v, stripe, source):
                return False  # its window is full: no need to look for the next chunk
        index, from_retry = self._next_index(v, stripe)
        if index is None:
            return False
        if source is None:
            source = self._spare_origin(now, v, stripe, self._choose_source(now, v, stripe, index),
                                        v.tried.get(index, ()))
        if source is None:
            if from_retry:
                v.retry[stripe].popleft()  # type: ignore[union-attr]
            else:
                v.next_pos[stripe] += 1
            v.parked.append(index)  # nobody usable now; retried on the next tick
            return False
        if v.holders:  # our source may hold everything and still feed us slowly (`relay.sources`)
            source = self._endgame_source(now, v, stripe, index) or source
        link = (source, stripe)
        load = v.link_load.get(link, 0)
        if load >= self._window(v, stripe, source):
            return False
        if from_retry:
            v.retry[stripe].popleft()  # type: ignore[union-attr]
        else:
            v.next_pos[stripe] += 1
        origin_only = v.origin_only
        if (origin_only is not None and not origin_only[index] and source == v.plan.origin  # type: ignore[union-attr]
                and stripe != v.forwards):  # (our children wait for our home stripe: never kept, see the top)
            v.kept.append(index)
            return None
        self._note_request(now, v, source, index, stripe)
        effects.append(Fetch(source, v.signed.manifest.version, index, v.digests[index], v.size(index),
                             stripe == v.forwards))
        return True

    def _window(self, v: _Version, stripe: int, source: str) -> int:
        """How many requests `source` may have outstanding in `stripe` of `v`: `window_per_source`, but
        one while it is a forwarder we took in place of the origin (`relay.sources`, `_leave_origin`)
        and we have timed none of its chunks yet (see the top): what it sends us before we can judge
        it is one chunk, not a window of them."""
        chain = v.chains[stripe]
        if len(chain) == 2 and chain[0] == source and not self._samples.get(source) and v.plan is not None and \
                chain[1] == v.plan.origin and v.plan.parent[stripe].get(self.self_id) == v.plan.origin:
            return 1
        return self.config.window_per_source

    def _note_request(self, now: float, v: _Version, source: str, index: int, stripe: int) -> None:
        """Chunk `index` is now asked of `source` (for `stripe`, or SWARM): in flight, one more
        request on that link's window, and one more outstanding request on that source, whose
        busy time starts if it was idle."""
        load = v.link_load[(source, stripe)] = v.link_load.get((source, stripe), 0) + 1
        if load == 1:
            v.link_since[(source, stripe)] = now
        v.in_flight[index] = (source, stripe, now)
        self._in_flight += 1
        src = v.sources.get(source)
        if src is None:
            src = v.sources[source] = _Source()
        if src.outstanding == 0:
            src.since = now
        src.outstanding += 1

    def _choose_source(self, now: float, v: _Version, stripe: int, index: int) -> str | None:
        """Who to ask for chunk `index` of `stripe`: the first usable member of its chain, else the
        fastest usable holder we measured, ties drawn per relay (`relay.planner.tiebreak`); None
        when nobody is usable."""
        tried = v.tried.get(index, ())
        if v.passed:
            tried = self._passed_over(now, v, stripe).union(tried)
        peer = self._first_usable(now, v.chains[stripe], tried)
        if peer is not None:
            return peer
        uploads = self._members.uploads  # a member with upload 0 cannot be dialled: never a source
        holders = [p for p in v.holders if p not in tried and self._usable(now, p) and uploads.get(p, 1.0) > 0]
        if holders:  # the fastest we measured; among equals (all never measured, at first) our own
            # draw, not the peer id, which made-up ids could be ground to win at every relay
            salt = f"{self.self_id}/holders".encode()
            return max(holders, key=lambda p: (self._rates.get(p, 0.0), tiebreak(salt, p)))
        return None

    def _first_usable(self, now: float, chain: list[str], tried: Any) -> str | None:
        """The first of `chain` not in `tried` that is usable (`_usable`, inlined: once per chunk)."""
        banned, excluded = self._banned, self._excluded
        for peer in chain:
            if peer in tried or peer == self.self_id or peer in banned:
                continue
            until = excluded.get(peer)
            if until is None or until <= now:
                return peer
        return None

    def _passed_over(self, now: float, v: _Version, stripe: int) -> set[str]:
        """The sources we pass over in `stripe` of `v` alone for now: a link of theirs stalled, or a
        stand-in delivered too little there, while they serve us elsewhere (`relay.failures`,
        `_pass_over`). O(links passed over): few, and only looked at when there are some."""
        return {peer for (peer, s), until in v.passed.items() if s == stripe and until > now}

    def _usable(self, now: float, peer: str) -> bool:
        if peer == self.self_id or peer in self._banned:
            return False
        until = self._excluded.get(peer)
        return until is None or until <= now

    def _settle(self, now: float, v: _Version, index: int, entry: tuple[str, int, float], progress: bool) -> None:
        """Chunk `index`, asked as `entry` (source, stripe, when), is no longer awaited: answered with
        the chunk (`progress`) or not (failed, taken back, or the chunk came another way). O(1)."""
        peer, stripe, asked_at = entry
        del v.in_flight[index]
        self._in_flight -= 1
        if v.swarm is not None:
            v.swarm.asked &= ~(1 << index)
        key = (peer, stripe)
        load = v.link_load[key] - 1
        if load <= 0:
            del v.link_load[key]
            v.link_since.pop(key, None)
            v.link_done.pop(key, None)  # (nothing left out there to have been passed)
        else:
            v.link_load[key] = load
            if progress:
                v.link_since[key] = now
                if asked_at > v.link_done.get(key, -math.inf):
                    v.link_done[key] = asked_at  # what was asked there before this and is still out was passed
        if progress and v.unavailable:
            v.unavailable.pop(key, None)  # it delivers there: its "unavailable" answers were its lag
        src = v.sources[peer]
        src.outstanding -= 1
        if progress:
            src.since = now
            if v.borrowed and key in v.borrowed:  # (a forwarder taken in place of the origin delivered)
                v.borrowed[key] = True

    # -- while members' dial-backs are pending (see the top) ------------------------------

    def _await_dial_backs(self, now: float, v: _Version, origin_upload: float) -> None:
        """Mark what of `v` we ask the origin for while members' dial-backs are pending: the chunks
        of the stripes whose root we are in the plan with them dialable. No wait (None) when none
        is pending, we are the origin or a leaf in every stripe of that plan, or not striped. The
        chunks kept so far go back to their queues (the pump keeps them again if they still are).
        O(members) for the plan, O(chunks) for the marks: once per change of who is pending."""
        _release_kept(v)
        v.origin_only, v.own_left, v.hope_until = None, deque(), math.inf
        plan = v.plan
        if plan is None or self.config.layout != "striped" or self.self_id == plan.origin:
            return
        since, hoped_until = self._pending_since, now - PENDING_HOPE_S
        pending = {p: u for p, u in self._unconfirmed.items()
                   if u > 0 and not self._members.uploads.get(p, 0.0) and since.get(p, now) > hoped_until}
        if not pending:
            return
        cap = self._hope_cap(plan.origin)
        pending = {p: min(u, cap) for p, u in pending.items()}
        hopeful = Membership.of({**self._members.uploads, **pending})
        hoped = plan_broadcast(plan.origin, hopeful.uploads.get(plan.origin, origin_upload), hopeful, v.count,
                               self.config.stripes, salt=v.signed.manifest_id, stable=self.config.stable_plan)
        ours = {s for s in range(hoped.stripes) if hoped.ancestors(s, self.self_id)[:1] == [plan.origin]}
        own = bytearray(s in ours for s in hoped.stripe_of_chunk)
        left = deque(i for i in range(v.count) if own[i] and not v.have[i])
        if left:
            v.origin_only, v.own_left = own, left
            v.hope_until = min(since.get(p, now) for p in pending) + PENDING_HOPE_S

    def _hope_cap(self, origin: str) -> float:
        """The most upload a pending member is hoped at (`_await_dial_backs`): the highest a member
        already dialled back is planned at (`Membership.planned`, the origin left out); none (inf)
        while nobody is. Only from what every relay is told alike, so that all hope for the same
        plan: capped at our own upload while everyone was pending (or at the lowest pending claim,
        for a relay not dialable itself), relays of different uploads hoped for different plans,
        asked the origin for the same chunks and kept others nobody asked (simulator, 36 worlds of
        6-20 relays at 5-80 MB/s dialled back at 1 s or one by one: 149 s to all in all uncapped, 144 s
        capped thus, 191 s capped at ours; `tests/relay/test_dial_backs_pending_claims.py`).
        O(members), once per change of who is pending."""
        return max((u for p, u in self._members.planned.items() if p != origin and u > 0), default=math.inf)

    def _reconsider_origin(self, now: float) -> list[Any]:
        """Whose dial-backs are pending changed, not the plan: what each version in progress asks the
        origin for meanwhile is marked again (`_await_dial_backs`), and what it keeps no more is asked."""
        effects: list[Any] = []
        for v in self._newest_first():
            if not v.complete and v.plan is not None and (v.origin_only is not None or self._unconfirmed):
                self._await_dial_backs(now, v, self._origin_upload(v))
                self._pump(now, v, effects)
        return self._arm(now, effects)

    def _wait_over(self, v: _Version) -> bool:
        """Whether the wait for dial-backs is over for `v` (`_await_dial_backs`): every chunk of our
        own stripes held or asked. If so it ends, and the chunks kept go back to their queues.
        Amortized O(1): `own_left` is passed once."""
        left, have, in_flight = v.own_left, v.have, v.in_flight
        while left and (have[left[0]] or left[0] in in_flight):
            left.popleft()
        if left:
            return False
        v.origin_only = None
        _release_kept(v)
        return True

    # -- commands from the shell: a chunk someone waits for, holds on requests ----------

    def asked_for(self, now: float, version: int, index: int) -> list[Any]:
        """A peer asked us for chunk `index` of `version`, which we do not hold (its request now
        waits for it). We forward only our home stripe, so in the asker's plan the chunk is in
        our home stripe; if ours puts it in another one (views that differ by a few members may
        deal a few chunks to other stripes), fetch it down our home stripe's chain now, flagged
        urgent, instead of as a leaf of the other stripe: that leaf's parent may in turn wait for
        it from us. Nobody on the path the asker expects would fetch it otherwise (measured, 1,023
        equal peers, 64 chunks, each view missing 1%: three chunks held by the origin alone until
        stall and wait limits sent requests elsewhere, everyone done after 60 s instead of 1.2)."""
        v = self._versions.get(version)
        if v is None or v.plan is None or v.complete or not 0 <= index < v.count or v.have[index]:
            return []
        home = v.plan.home.get(self.self_id, -1)
        if home < 0 or v.plan.stripe_of_chunk[index] == home or now < self._hold_until or now < v.hold_until:
            return []
        entry = v.in_flight.get(index)
        if entry is not None and entry[1] == home:
            return []  # already asked down our home stripe's chain
        tried = v.tried.get(index, ())
        source = self._spare_origin(now, v, home, self._first_usable(now, v.chains[home], tried), tried)
        if source is None or (entry is not None and entry[0] == source):
            return []
        effects: list[Any] = []
        if entry is not None:
            self._settle(now, v, index, entry, progress=False)  # its answer, if any, is still taken
        self._note_request(now, v, source, index, home)
        effects.append(Fetch(source, version, index, v.digests[index], v.size(index), True))
        return self._arm(now, effects)

    def hold_requests(self, now: float, until: float, version: int | None = None) -> list[Any]:
        """Issue no new chunk requests before `until`: for any version (our store is full, or its
        disk fails), or only for `version` (the writes of its files fail: the others fetch on).
        Requests already out stay out. An `until` not after `now` lifts the hold at once; lifting
        the hold on every version lifts each version's own too (the store takes writes again)."""
        if version is None:
            self._hold_until = until
            lifted = self._newest_first()
            if until <= now:
                for v in lifted:
                    v.hold_until = until
        else:
            held = self._versions.get(version)
            if held is None:
                return []
            held.hold_until = until
            lifted = [held]
        effects: list[Any] = []
        if until <= now:
            for v in lifted:
                if not v.complete:
                    self._pump(now, v, effects)
        return self._arm(now, effects)

    def _hold_ends(self, now: float) -> float:
        """When the first hold on our requests still on ends (the one on every version, or an
        incomplete version's own; `hold_requests`): a tick then resumes them. inf if none is on."""
        ends = self._hold_until if now < self._hold_until else math.inf
        for v in self._versions.values():
            if now < v.hold_until < ends and not v.complete:
                ends = v.hold_until
        return ends


def _release_kept(v: _Version) -> None:
    """The chunks kept from the origin while dial-backs were pending go back to their stripes'
    queues, each once (a pass over the stripes may keep a chunk twice)."""
    for index in dict.fromkeys(v.kept):
        _requeue(v, index)
    v.kept.clear()
