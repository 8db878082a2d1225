"""What the transfer core does when a source fails us: exclude, ban, and fetch elsewhere.

Mixed into `relay.transfer.TransferCore` (`FailureHandling`): the shell's `fetch_failed`, the
stall check on the core's tick, and the exclusions and bans they lead to, which move the
source's outstanding chunks back to their stripes' retry queues (`_release_peer`). A parent
that `fetched` finds delivering too little (`relay.sources`) is excluded here too, as `slow`.

Failures (`relay.effects.FetchFailure`; the exclusions they lead to, `DropReason`), by who is at
fault:

- `corrupt`: the source served bytes that do not hash to the digest. It is banned (never asked
  again) and penalised through a `Penalise` effect; the chunk is fetched elsewhere.
- `unreachable`: the connection failed, was reset, or ended inside a chunk (a killed peer).
  The source is excluded for `exclude_s`; its outstanding chunks are fetched elsewhere.
- `not_admitted`: the source closed the connection after our hello: it has not heard our
  heartbeat yet (its data plane serves only peers in its table; the shell has just sent it ours
  directly, `Node.introduce`, so it knows us by the next try). It is alive and in our plan,
  so it is excluded for `not_admitted_s` only, without substitutes: its chunks go up its
  stripes' chains to its ancestors meanwhile, and come back to it once it knows us. A source
  that refuses us `NOT_ADMITTED_TRIES` times in a row (it banned us, or dropped us from its
  table) is treated as unreachable from then on.
- `no_address`: the shell has no data address for the source: its heartbeat has not reached
  our peer table, even after the shell waited for it (`request_timeout_s`). Membership comes
  from the peer table, so every member has one; but the manifest's publisher (the origin, in
  every chain) and a peer that sent `Holding` can be known before their heartbeat, and past
  `max_heard_per_s * max_interval_s` peers (150 by default) heartbeats are 30 s apart (up to
  50 s while busy). So a new relay, or one that just heard of a holder, excluded an alive
  source (the origin at worst) for `exclude_s` as unreachable. Nobody is at fault yet: it is
  excluded for `not_admitted_s` only, without substitutes, its chunks may be asked of it
  again, and it stays a holder, for `NO_ADDRESS_GRACE_S` from its first `no_address` in a row
  (past the longest spacing of an honest peer's heartbeats). Then it counts as unreachable, as
  a refusing source does after `NOT_ADMITTED_TRIES`, until it serves us or joins our membership
  (its heartbeat came): each try costs the shell's wait for the chunks handed to it, and a
  `Holding` needs no heartbeat, so a peer that sends one and never a heartbeat (any number of
  made-up identities can), or a holder that left the network before we asked it, would
  otherwise hold those chunks, and that much of `max_in_flight`, 10 s of every 12 (the
  defaults) for as long as it stays a holder, which it would forever; as unreachable, 10 s of
  every 70, and no holder until its next `Holding`.
- `unavailable`: the source answered that it does not hold the chunk (after its wait limit).
  The chunk is retried at the next candidate; the source stays usable for other chunks. Our
  parent in the chunk's stripe is asked again first, twice (`relay.sources`: it is behind, and
  its ancestors, which feed it, are not to be asked in its place). A source that had told us
  it holds the whole version (`Holding`) is no longer counted among its holders: the answer
  contradicts that (it lost the chunk, or its claim was false); its next `Holding` counts again.
  But a parent that answers so `UNAVAILABLE_PASS` x `window_per_source` times in a row in a
  stripe, with no chunk delivered there in between (a whole window's chunks, each asked of it as
  often as a parent is), is passed over in that stripe (`_pass_over`, `UNAVAILABLE`), as a stalled
  link is: one that answered every request "unavailable" at once was never dropped, and every
  chunk of its stripe went, after its answers, up its chain to the origin (`_unavailable_too_often`).
  An honest parent that is behind answers so only after its wait limit (10 s by default) and
  delivers what it gets: it reaches the count only after three wait limits of delivering nothing.
- stall (detected here on the tick): a source with requests outstanding and no completion for
  `stall_timeout_s` is excluded like an unreachable one, and told to the shell (`DropSource`) so it
  closes the connection. A source that serves us in several stripes is judged per (source, stripe)
  too: one whose requests in one stripe complete nothing for `stall_timeout_s` while it serves us in
  another is passed over in that stripe alone, for `exclude_s`, and stays usable (and its connection
  open) for the others (`_pass_over`; told as `SourcePassedOver`, not as a drop). A stand-in of a
  lost lone root (`relay.sources`) is our parent in its own stripe, so judged per source it was never dropped for withholding the lost one,
  and the lost stripe waited on it for as long as it kept serving its own. The origin is never
  passed over (nobody else holds every chunk). Time the shell held our requests unsent does not
  count: while its dispatcher waits on our own disk (`sending_held` ... `sending_resumed`) no source
  is judged stalled, and each source's clock then moves on by the time held (one whose requests were
  all issued meanwhile starts afresh): our disk's slowness is not theirs.
- withheld (on the tick too): a request outstanding for `stall_timeout_s` at a source that has
  answered a request asked no earlier on the same (source, stripe) link is held back: settled, its
  chunk asked elsewhere, and the source not asked for that chunk again (`tried`), though it stays
  usable for the others (`_check_withheld`). Stalls are judged by a link's last completion, so a
  source that withheld one chunk and answered the others kept that chunk until it had nothing else
  to answer. Not the origin's requests (nobody else holds every chunk).
- `store_full`: ours: the chunk arrived but our store had no room. Nobody is blamed; the chunk
  is fetched again later. The shell also calls `hold_requests` to stop new requests for a while.
- `store_failed`: ours: the chunk arrived but our disk failed to keep it (an I/O error, or a
  failed fsync lost it before we heard it was stored). Nobody is blamed; it is fetched again,
  and the shell holds new requests as for `store_full` (a failing disk is not fed at network
  speed), of that version alone when only its files' writes fail (`hold_requests`' `version`).

Bans are remembered for `MAX_BANNED` peers at once, the first banned forgotten first: each ban
needs a connection that proved its peer id and an ask of ours, but any number of made-up
identities may each serve one answer of garbage (a manifest ask of a made-up version is enough),
so the set must not grow without bound. Forgetting the oldest ban un-bans a peer only after
`MAX_BANNED` others were banned since, and gains it no more than any new identity has: one more
answer, which bans it again (and the peer table, penalised, ignores its heartbeats for `ban_s`).

A parent that only stalled is not replaced by a sibling but by its ancestors: a stall is a
silent failure (a hung peer, a partition) that may hold the substitute too, unseen by us, and
each wrong pick costs another `stall_timeout_s` (measured in the simulator: substituting after
stalls made hangs and partitions slower). Only where that chain falls through to the origin,
which is not our parent, do members ranked before us stand in first (`relay.sources`): that
kept the origin's upload for what only it has, and did not slow hangs or partitions (review
runs at 10 GB: 20% partitioned 275 -> 226 s, hangs the same time with fewer origin copies).

A forwarder we took in place of the origin (`relay.sources`, `_leave_origin`) that we then drop
(stalled, slow, unreachable, corrupt) or pass over in its stripe is forsaken there (`_forsake`):
our chain is the plan's again (the origin), and it is not taken in the origin's place again in
this plan, so the next origin chunk may pick another forwarder. Dropped as stalled, the chain kept
it in front of the origin (a stall borrows no substitute, above), and when its exclusion ended we
asked it again and waited another `stall_timeout_s` on it: the lab's 6 relays under an origin
advertising the default, the stripe's forwarder sending 1 byte/s, 192 MiB: each of the 4 members
that had left the origin for it dropped it twice (at 31 s and 122 s), 142.0 s; now once,
122.3 s. A refusal or a missing address (nobody at fault yet) keeps it. One that stalled or was
unreachable after it delivered us a chunk there since we took it (a blip of its link or of its
own feed, a reset connection) is excused once (`_Version.borrowed`): our chain is the origin's
while it is excluded, it may be taken again when its exclusion ends, and it is forsaken if it
fails so again before it delivers another. Forsaken at once, a member took the stripe from the
capped origin for the rest of the plan: the same world (simulator), the answers of an honest
forwarder to its 4 borrowers lost 3 s in (stall timeout 5 s, exclusions 10 s, 192 MiB): 74.0 s
and 1.10 origin copies, 113.3 s and 1.69 forsaken at once; now 74.0 s, 1.10 again.

These methods keep the core's exclusions (`_excluded`, `_slow`, `_refused`, `_unaddressed`) and
bans (`_banned`, `_ban_order`), rebuild a version's chains where a dropped peer was our parent,
and release its requests through the core's `_settle`; they also call its `_chain`, `_pump`,
`_arm` and `_ask_parent_again` (`relay.sources`). Like the core they do no I/O and take the time
as an argument.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any

from p2pnet.core import Emit
from relay.effects import DropReason, DropSource, FetchFailure, Penalise, SourceDropped, SourcePassedOver
from relay.sources import PARENT_REASKS
from relay.transfer_state import _requeue

if TYPE_CHECKING:
    from relay.planner import StripePlan
    from relay.transfer import TransferConfig
    from relay.transfer_state import _Version

NOT_ADMITTED_TRIES = 3  # refusals in a row (each after `not_admitted_s`) before a source counts as unreachable
# seconds from a source's first `no_address` in a row after which it counts as unreachable: past the longest
# spacing of an honest peer's heartbeats (50 s: busy, its table at the cap, `PeerTableConfig.longest_interval_s`),
# so an honest source's address comes first (about 6 tries with the role's 10 s wait, `request_timeout_s`)
NO_ADDRESS_GRACE_S = 60.0
MAX_UNADDRESSED = 1024  # sources remembered without an address at once (anyone may send `Holding`): oldest go first
MAX_BANNED = 4096  # peers remembered as banned at once (each served us garbage): the first banned is forgotten first
# "unavailable" answers in a row, per request a link's window holds (`window_per_source`), after which our source
# in a stripe that delivered us nothing there in between is passed over there: every chunk of a window asked of it
# as often as a parent is (`relay.sources.PARENT_REASKS`, plus the first ask). An honest parent answers so only
# after its wait limit (`ServingConfig.wait_limit_s`, 10 s): that many take it 3 wait limits of delivering nothing
UNAVAILABLE_PASS = PARENT_REASKS + 1
# failures after which the source may be asked for the chunk again: ours, a refusal (it will know us
# soon) and a missing address (we will know it soon)
_ASK_AGAIN = frozenset({FetchFailure.STORE_FULL, FetchFailure.STORE_FAILED, FetchFailure.NOT_ADMITTED,
                        FetchFailure.NO_ADDRESS})
# drops that borrow no substitute parent: a stall (its ancestors feed us instead), a refusal and a
# missing address (see the top)
_NO_SUBSTITUTES = frozenset({DropReason.STALLED, DropReason.NOT_ADMITTED, DropReason.NO_ADDRESS})
# drops for `not_admitted_s` only (`exclude_s` for the others): nobody is at fault yet
_BRIEF = frozenset({DropReason.NOT_ADMITTED, DropReason.NO_ADDRESS})
# failures of a forwarder taken in place of the origin that may be passing (a blip, a reset connection): not
# forsaken for them if it delivered us a chunk since we took it (`_forsake`)
_EXCUSED = frozenset({DropReason.STALLED, DropReason.UNREACHABLE})


class FailureHandling:
    """Failed sources for `relay.transfer.TransferCore` (see the module docstring)."""

    # the core's state these methods use (`TransferCore.__init__` sets it)
    config: TransferConfig
    self_id: str
    _versions: dict[int, _Version]
    _excluded: dict[str, float]
    _refused: dict[str, int]
    _unaddressed: dict[str, float]
    _slow: set[str]
    _banned: set[str]
    _ban_order: deque[str]  # `_banned`, first banned first
    _held_since: float | None  # the shell holds our requests unsent since then (`sending_held`)

    if TYPE_CHECKING:  # what these call on the core (`relay.transfer.TransferCore` or another of its mixins)
        def _settle(self, now: float, v: _Version, index: int, entry: tuple[str, int, float],
                    progress: bool) -> None: ...
        def _ask_parent_again(self, v: _Version, index: int, peer: str) -> bool: ...
        def _pump(self, now: float, v: _Version, effects: list[Any], stripe: int | None = None) -> None: ...
        def _refill(self, now: float, v: _Version | None, effects: list[Any], stripe: int | None = None) -> None: ...
        def _arm(self, now: float, effects: list[Any]) -> list[Any]: ...
        def _chain(self, now: float, plan: StripePlan, stripe: int) -> list[str]: ...

    def fetch_failed(self, now: float, peer: str, version: int, index: int, reason: FetchFailure) -> list[Any]:
        """A fetch from `peer` failed: `corrupt`, `unreachable`, `not_admitted`, `no_address`,
        `unavailable`, or ours, `store_full` or `store_failed` (see the top)."""
        v = self._versions.get(version)
        effects: list[Any] = []
        if reason is FetchFailure.CORRUPT:
            self._ban(now, peer, effects)
        elif reason is FetchFailure.NOT_ADMITTED and self._excluded.get(peer, 0.0) <= now:  # one refusal, not per fetch
            self._refused[peer] = refusals = self._refused.get(peer, 0) + 1
            why = DropReason.NOT_ADMITTED if refusals < NOT_ADMITTED_TRIES else DropReason.UNREACHABLE
            self._exclude(now, peer, why, effects)
        elif reason is FetchFailure.NO_ADDRESS and self._excluded.get(peer, 0.0) <= now:  # one a try, as refusals
            brief = self._unaddressed_for(now, peer) < NO_ADDRESS_GRACE_S
            self._exclude(now, peer, DropReason.NO_ADDRESS if brief else DropReason.UNREACHABLE, effects)
        elif reason is FetchFailure.UNREACHABLE:
            self._exclude(now, peer, DropReason.UNREACHABLE, effects)
        if v is None:
            return effects
        if reason is FetchFailure.UNAVAILABLE:
            v.holders.discard(peer)  # it said it held the whole version; this chunk says otherwise
        entry = v.in_flight.get(index)
        if entry is not None and entry[0] == peer:
            self._settle(now, v, index, entry, progress=False)
            if not v.have[index]:
                if reason is FetchFailure.UNAVAILABLE and not self._unavailable_too_often(now, v, entry, effects) \
                        and self._ask_parent_again(v, index, peer):
                    pass  # our parent is alive and behind: asking its ancestors would slow it more
                elif reason not in _ASK_AGAIN:  # not to be asked for this chunk again
                    v.tried.setdefault(index, set()).add(peer)
                _requeue(v, index)
        self._refill(now, v, effects)  # (what settling freed: `relay.requests`)
        return self._arm(now, effects)

    def sending_held(self, now: float) -> list[Any]:
        """The shell stops carrying out our effects for a while: its dispatcher waits on our own
        disk (keeping a manifest, collecting versions, asking a full store for room), and the
        requests we issue meanwhile wait unsent. No source is judged stalled until
        `sending_resumed`: our disk's delay is nobody else's fault."""
        if self._held_since is None:
            self._held_since = now
        return []

    def sending_resumed(self, now: float) -> list[Any]:
        """The shell carries out our effects again (see `sending_held`): each source's stall
        clock moves on by the time held, and starts now for one whose outstanding requests were
        all issued meanwhile (they are sent only now)."""
        since, self._held_since = self._held_since, None
        if since is None:
            return []
        for v in self._versions.values():
            for src in v.sources.values():
                if src.outstanding > 0:
                    src.since = now if src.since >= since else src.since + (now - since)
            for link, at in v.link_since.items():  # (only links with requests out are kept)
                v.link_since[link] = now if at >= since else at + (now - since)
            for index, (peer, stripe, at) in v.in_flight.items():  # (each request's age: `_check_withheld`)
                v.in_flight[index] = (peer, stripe, now if at >= since else at + (now - since))
            for link, at in v.link_done.items():
                v.link_done[link] = now if at >= since else at + (now - since)
        return []

    def _check_stalls(self, now: float, v: _Version, effects: list[Any]) -> None:
        if self._held_since is not None:
            return  # (`sending_held`)
        horizon = now - self.config.stall_timeout_s
        stalled = [p for p, s in v.sources.items() if s.outstanding > 0 and s.since < horizon]
        for peer in stalled:
            self._exclude(now, peer, DropReason.STALLED, effects)
            effects.append(DropSource(peer))
        origin = v.plan.origin if v.plan is not None else None
        links = [link for link, since in v.link_since.items() if since < horizon and link[0] != origin]
        for peer, stripe in links:  # the source made progress in another stripe (or it stalled above)
            if (peer, stripe) in v.link_since:
                self._pass_over(now, v, peer, stripe, DropReason.STALLED, effects)
        if v.link_done and v.plan is not None:
            self._check_withheld(now, v, horizon, origin)

    def _check_withheld(self, now: float, v: _Version, horizon: float, origin: str | None) -> None:
        """Requests asked before `horizon` (`stall_timeout_s` ago) of a source that has since
        answered a request asked no earlier on the same link (`_Version.link_done`) are held back:
        each is settled, its chunk goes back to its stripe's retry queue, and the source is not
        asked for that chunk again (`tried`; see the top). Not the origin's (nobody else holds
        every chunk), nor the swarm layout's (no stripes; `v.plan` is None there). O(requests
        out), on the tick."""
        done = v.link_done
        held_back = [(i, e) for i, e in v.in_flight.items()
                     if e[2] < horizon and e[0] != origin and done.get((e[0], e[1]), -math.inf) >= e[2]]
        for index, entry in held_back:
            self._settle(now, v, index, entry, progress=False)
            v.tried.setdefault(index, set()).add(entry[0])
            _requeue(v, index)

    def _unavailable_too_often(self, now: float, v: _Version, entry: tuple[str, int, float],
                               effects: list[Any]) -> bool:
        """Count an "unavailable" answer to `entry` (source, stripe, when asked) if that source is
        the head of our chain in the stripe (the one `relay.sources`' `_ask_parent_again` asks
        again); at `UNAVAILABLE_PASS` x `window_per_source` of them with no chunk delivered there
        in between (`_settle` forgets the count on a delivery, a replan forgets them all), pass it
        over in the stripe (`_pass_over`, `UNAVAILABLE`) and say so (True). See the top."""
        peer, stripe, _ = entry
        plan = v.plan
        if plan is None or peer == plan.origin or not 0 <= stripe < len(v.chains) or \
                v.chains[stripe][:1] != [peer]:
            return False
        key = (peer, stripe)
        count = v.unavailable[key] = v.unavailable.get(key, 0) + 1
        if count < UNAVAILABLE_PASS * self.config.window_per_source:
            return False
        del v.unavailable[key]
        self._pass_over(now, v, peer, stripe, DropReason.UNAVAILABLE, effects, told=True)
        return True

    def _pass_over(self, now: float, v: _Version, peer: str, stripe: int, why: DropReason,
                   effects: list[Any], told: bool = False) -> None:
        """Stop asking `peer` for `stripe`'s chunks of `v` for `exclude_s`, in that stripe alone:
        it serves us in another stripe (a stand-in is our parent in its own), where it stays
        usable, but stalled here (`why`: `STALLED`) or, as a stand-in, delivers too little here
        (`SLOW`, `relay.judging`). Its requests in that stripe go back to the retry queue and the
        stripe's next source is picked as if it were dropped (`relay.requests`, `_passed_over`):
        for a lost lone root's stripe, the next earlier child, then the origin (see the top).
        Told (`SourcePassedOver`) if it had requests there, or if `told` (one that answered
        "unavailable" too often has none left out)."""
        v.passed[(peer, stripe)] = now + self.config.exclude_s
        v.link_since.pop((peer, stripe), None)
        v.link_rates.pop((peer, stripe), None)
        kept = v.spare.get(stripe)
        if kept is not None and kept[0] == peer:
            del v.spare[stripe]
        if v.plan is not None and 0 <= stripe < len(v.chains) and v.chains[stripe] and v.chains[stripe][0] == peer:
            self._forsake(v, stripe, why)  # (not a swarm request's link, nor a stripe of an older plan)
        mine = [(i, e) for i, e in v.in_flight.items() if e[0] == peer and e[1] == stripe]
        for index, entry in mine:
            self._settle(now, v, index, entry, progress=False)
            _requeue(v, index)
        if mine or told:  # (not `SourceDropped`: it is not dropped, and nobody counts it as dropped)
            effects.append(Emit(SourcePassedOver(peer, v.version, stripe, why)))

    def _forsake(self, v: _Version, stripe: int, why: DropReason) -> None:
        """If the head of our chain in `stripe` of `v` is a forwarder we took in place of the origin
        (`relay.sources`, `_leave_origin`), which we now drop or pass over there for `why`: the chain
        is the plan's again (the origin), and that forwarder is not taken in the origin's place there
        again in this plan (`_Version.forsaken`; see the top), unless it stalled or was unreachable
        after it delivered us a chunk there since we took it (`_Version.borrowed`): that is excused
        once, and it may be taken again when its exclusion ends. Else nothing."""
        plan, chain = v.plan, v.chains[stripe]
        assert plan is not None
        if chain[1:] != [plan.origin] or plan.parent[stripe].get(self.self_id) != plan.origin:
            return
        link = (chain[0], stripe)
        if why not in _EXCUSED or not v.borrowed.get(link):  # (excused: `_leave_origin` resets its flag
            v.borrowed.pop(link, None)                       # when it takes it again, so it must deliver
            v.forsaken.add(link)                             # again before another failure is excused)
        v.chains[stripe] = chain[1:]

    def _unaddressed_for(self, now: float, peer: str) -> float:
        """Seconds since `peer`'s first `no_address` in a row (0: this is it, remembered now; past
        `MAX_UNADDRESSED` the oldest is forgotten). `fetched` and `set_members` forget it: it
        served us, or its heartbeat came."""
        since = self._unaddressed.get(peer)
        if since is None:
            if len(self._unaddressed) >= MAX_UNADDRESSED:
                del self._unaddressed[next(iter(self._unaddressed))]
            since = self._unaddressed[peer] = now
        return now - since

    def _exclude(self, now: float, peer: str, why: DropReason, effects: list[Any]) -> None:
        config = self.config
        until = now + (config.not_admitted_s if why in _BRIEF else config.exclude_s)
        self._excluded[peer] = max(until, self._excluded.get(peer, until))  # a late refusal never shortens an exclusion
        if why is DropReason.SLOW:
            self._slow.add(peer)
        else:
            self._slow.discard(peer)
        self._release_peer(now, peer, why, effects)

    def _ban(self, now: float, peer: str, effects: list[Any], what: str = "corrupt chunk") -> None:
        if peer not in self._banned:
            if len(self._ban_order) >= MAX_BANNED:  # (see the top: a flood of identities cannot grow it)
                self._banned.discard(self._ban_order.popleft())
            self._banned.add(peer)
            self._ban_order.append(peer)
            effects.append(Penalise(peer, self.config.corrupt_penalty, what))
            effects.append(DropSource(peer))
        self._release_peer(now, peer, DropReason.CORRUPT, effects)

    def _release_peer(self, now: float, peer: str, why: DropReason, effects: list[Any]) -> None:
        """Move every chunk outstanding at `peer` back to its stripe's retry queue, and (unless it
        only stalled, has not admitted us yet or has no address yet, see the top) borrow a
        substitute parent in each stripe where `peer` was the one we fetched from. It is no longer
        a holder of any version, unless we only lack its address."""
        for v in self._versions.values():
            if not v.complete and v.plan is not None:
                for s, chain in enumerate(v.chains):
                    if not chain or chain[0] != peer:
                        continue
                    if why not in _BRIEF:
                        self._forsake(v, s, why)  # (a forwarder in the origin's place: the chain is the origin's now)
                    if why not in _NO_SUBSTITUTES and v.chains[s][0] == peer:
                        v.chains[s] = self._chain(now, v.plan, s)
            mine = [(i, e) for i, e in v.in_flight.items() if e[0] == peer]
            for index, entry in mine:
                self._settle(now, v, index, entry, progress=False)
                _requeue(v, index)
            if mine:
                effects.append(Emit(SourceDropped(peer, v.version, why)))
            if why is not DropReason.NO_ADDRESS:  # (its `Holding`, which made it one, is all we heard
                v.holders.discard(peer)           # of it, and comes rarely at scale: `relay.announce`)
