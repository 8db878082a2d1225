"""The per-peer transfer core: which chunks to fetch, from whom, and what to do when a source fails.

A pure core (see `p2pnet.core`): no I/O, no clock, no randomness. The relay role (real world)
and `simulations.dataplane` (virtual time) both drive it and carry out its effects.

Theory of operation. A version becomes known through a `ManifestAnnounce` (gossip), a
`FetchManifest` answer, `publish` (we are the origin) or `add_version` (reloaded from our
store at startup); the manifest is believed only if the injected `open_frame` accepts it
(signature by a trusted publisher). Its origin is the manifest's publisher. From the current
membership (`set_members`: relay peers and their advertised upload) the planner builds striped
trees; for each stripe we pull that stripe's chunks, in order, from our parent in that tree,
keeping `window_per_source` requests outstanding per (source, stripe) and at most
`max_in_flight` in all. A source answers a request for a chunk it does not hold yet as soon as
it holds it (the shell long-polls), so each chunk is forwarded as soon as it is verified
(cut-through) and no per-chunk have-messages are needed. Both shells tell the core of each
request for a chunk we do not hold (`asked_for`): we forward only our home stripe, so the asker
has that chunk in our home stripe; views that differ by a few members can deal a chunk to
different stripes, and ours then fetches it down our home stripe's chain at once, urgent,
instead of as a leaf of another stripe, whose parent may wait for it from us.

Failures (a corrupt chunk, an unreachable or refusing source, a source whose heartbeat, and
with it its data address, has not reached us yet, a chunk not there in time, a stall, and our
own full or failing store), by who is at fault, and what each costs the source:
`relay.failures` (mixed into the core).

Our store changes under us, too: `lost` (a held chunk was found corrupt on disk, or lost to a
failed fsync, and deleted)
makes the version incomplete again (no longer announced) and fetches the chunk again, from
holders if we are the origin; `collected` (garbage collection dropped a version) forgets the
version and refuses it, and any older version we do not know, from then on.

Candidates for a chunk of stripe s, in order: our parent in s, its ancestors up to the origin,
then peers that announced `Holding` the whole version (fastest measured first; those never
measured in an order each relay draws for itself, `_choose_source`, so that no id can be made up
to come first everywhere). Announcing
`Holding` and learning holders: `relay.announce`; asking a holder of an unknown version for its
manifest: `relay.manifest_asks`, and what its answer does: `relay.manifest_answers` (all mixed
into the core).
In the endgame (`relay.sources`) the fastest measured holder is asked before our parent, even
when the parent holds the whole version too.

Issuing requests (the chains of sources, windows and budget, whom to ask, `asked_for` and holds
on requests): `relay.requests` (mixed into the core).

Reattaching orphans, keeping the origin for what only it has and the endgame: `relay.sources`;
judging parents by measured delivery (slow): `relay.judging` (both mixed into the core).

The "swarm" layout (a baseline, `relay.swarm`) has no plan: peers send their chunk bitmaps
(`HaveChunks`) to their neighbours and pull any chunk from any neighbour known to hold it,
rarest first (`relay.swarm_transfer`, mixed into the core).

Membership and plans (`set_members`, replanning a version, the origin's planned upload, members
not dialled back yet): `relay.replanning` (mixed into the core).

Per-chunk work is O(stripes) (pointer per stripe, cached ancestor chains): no O(N) per event. The
bookkeeping per version and per source (`_Version`, `_Source`): `relay.transfer_state`; the
settings (`TransferConfig`): `relay.transfer_config`; the read-only queries (`has`, `progress`,
`status`, ...): `relay.transfer_queries` (mixed into the core).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Any, Callable, Iterable

from p2pnet.core import Emit, Publish, SetTimer
from p2pnet.wire import Envelope
from relay.announce import Announcing
from relay.effects import DropReason, DropSource, ManifestAccepted, ServeAtOnce
from relay.errors import ManifestRejected
from relay.failures import FailureHandling
from relay.judging import SourceJudgement
from relay.manifest import SignedManifest, chunk_range
from relay.manifest_answers import ManifestAnswers
from relay.manifest_asks import ManifestAsks, _Ask, _Others
from relay.messages import HOLDING_TOPIC, MANIFEST_TOPIC, HaveChunks, Holding, ManifestAnnounce
from relay.planner import Membership, StripePlan
from relay.replanning import Replanning
from relay.requests import Requesting
from relay.sources import SourceChoice
from relay.swarm_transfer import SWARM, TIMER_HAVE, SwarmTransfer
from relay.transfer_config import LAYOUTS as LAYOUTS, TransferConfig  # (both importable from here as before)
from relay.transfer_queries import Reporting
from relay.transfer_state import _requeue, _Version

TIMER_TICK = "relay/tick"
RATE_EWMA = 0.3


OpenFrame = Callable[[bytes, float], SignedManifest]


class TransferCore(Replanning, Requesting, SourceChoice, SourceJudgement, FailureHandling, Announcing, ManifestAsks,
                   ManifestAnswers, SwarmTransfer, Reporting):
    """One peer's relay transfers. Inputs are the core contract plus the commands below (and
    `fetch_failed`, `relay.failures`)."""

    topics = (MANIFEST_TOPIC, HOLDING_TOPIC)
    kinds = (ManifestAnnounce.KIND, Holding.KIND, HaveChunks.KIND)  # type: ignore[attr-defined]

    def __init__(self, config: TransferConfig, self_id: str, *, open_frame: OpenFrame,
                 self_upload_bps: float, held: Callable[[bytes], bool] = lambda digest: False) -> None:
        self.config = config
        self.self_id = self_id
        self._open = open_frame
        self._held = held
        self._self_upload = float(self_upload_bps)
        self._members = Membership.of({self_id: self_upload_bps})
        self._unconfirmed: dict[str, float] = {}  # members not dialled back yet, at the upload they advertise
        self._pending_since: dict[str, float] = {}  # when each of them was first told us pending
        self._versions: dict[int, _Version] = {}
        self._excluded: dict[str, float] = {}
        self._refused: dict[str, int] = {}  # source -> `not_admitted` refusals in a row
        self._unaddressed: dict[str, float] = {}  # source -> when its first `no_address` in a row came
        self._slow: set[str] = set()  # excluded only for delivering too little: alive, asked before the origin
        self._banned: set[str] = set()
        self._ban_order: deque[str] = deque()  # `_banned`, first banned first (`relay.failures`, `MAX_BANNED`)
        self._draw_orders: dict[StripePlan, Any] = {}  # `SourceChoice._by_draw`: substitutes by score, per plan
        self._rates: dict[str, float] = {}  # peer -> bytes/s its chunks moved at (EWMA)
        self._served_rates: dict[str, float] = {}  # the same, its long poll left out (`relay.judging`)
        self._samples: dict[str, int] = {}  # peer -> chunks timed
        self._waits: dict[str, float] = {}  # peer -> seconds its answers took beyond what it reported (EWMA)
        self._manifest_asked: dict[int, _Ask] = {}  # version -> its ask in flight or failed (`relay.manifest_asks`)
        self._manifest_again: dict[int, tuple[float, str]] = {}  # asks to make again (`relay.manifest_asks`)
        self._manifest_others: dict[int, _Others] = {}  # other holders to ask (`relay.manifest_asks`)
        self._manifest_failed_at: dict[str, float] = {}  # when an ask of a peer last failed (`relay.manifest_answers`)
        self._member_since: dict[str, float] = {}  # member -> since when, in our membership (`relay.manifest_asks`)
        self._manifest_excused: dict[str, int] = {}  # one failure of theirs held against nobody (`relay.manifest_answers`)
        self._member_recalled: dict[str, float] = {}  # members before our restart (`relay.manifest_asks`)
        self._recalled_until = self._heard_at = self._heard_before = -math.inf  # (`relay.manifest_asks`)
        self._refused_manifests: OrderedDict[bytes, int] = OrderedDict()  # our store refused (`relay.manifest_answers`)
        self._tick_at: float | None = None
        self._in_flight = 0  # requests outstanding over all versions
        self._starved = False  # the in-flight budget stopped a pump since (`relay.requests`, `_refill`)
        self._tick_s = config.stall_timeout_s / 4  # stall checks while transfers run
        self._last_announce = -float("inf")
        self._hold_until = -float("inf")  # no new requests before this (our store is full or failing; a
        # version's own hold, when only its files' writes fail: `_Version.hold_until`)
        self._held_since: float | None = None  # the shell holds our requests unsent since (`sending_held`)
        self._at_once = 0  # the upload slots we last asked the shell for (`ServeAtOnce`; 0: as configured)
        self._collected_through = -1  # versions up to this one were garbage-collected: never again
        self.rejected_manifests = 0
        self._neighbours: frozenset[str] = frozenset()  # the swarm layout: whom we tell what we hold
        self._have_at: float | None = None  # the swarm layout: when our bitmaps next go out
        self._have_sent = -float("inf")

    # -- core contract --------------------------------------------------------------------

    def start(self, now: float) -> list[Any]:
        return self._arm(now, [])

    def on_message(self, now: float, envelope: Envelope[Any]) -> list[Any]:
        body = envelope.body
        self._hear(now)
        if isinstance(body, ManifestAnnounce):
            return self.manifest_frame(now, envelope.sender, body.frame)
        if isinstance(body, Holding):
            return self._on_holding(now, envelope.sender, body)
        if isinstance(body, HaveChunks):
            return self._on_have(now, envelope.sender, body)
        return []

    def on_timer(self, now: float, key: str) -> list[Any]:
        effects: list[Any] = []
        if key == TIMER_HAVE:
            self._have_at = None
            self._send_haves(now, effects)
            return effects
        if key != TIMER_TICK:
            return []
        self._tick_at = None
        if self._manifest_again:
            self._ask_again(now, effects)
        self._starved = False  # (every version in progress is pumped below)
        for v in self._newest_first():
            if not v.complete:
                self._check_stalls(now, v, effects)
                if v.parked:
                    for index in v.parked:
                        v.tried.pop(index, None)
                        _requeue(v, index)
                    v.parked.clear()
                self._pump(now, v, effects)
        if now - self._last_announce >= self.config.announce_interval_s:
            self._last_announce = now
            if self._my_turn_to_announce(now):
                self._announce(now, effects)
        return self._arm(now, effects)

    def on_rejected(self, now: float, peer: str, reason: str) -> list[Any]:
        return []  # the peer table scores rejected frames; nothing relay-specific to do

    # -- commands from the shell ------------------------------------------------------------

    def _rated_as_stand_in(self, v: _Version, stripe: int, peer: str, rate: float) -> bool:
        """Count a chunk `peer` delivered us at `rate` in `stripe` towards its delivery there
        (`_Version.link_rates`, an EWMA as `_rates`) if it is neither our source in the stripe's
        chain nor the origin (a stand-in of a lost lone root, `relay.sources`, or a holder or
        member asked instead): its rate per peer mixes in the stripe where it is our parent, so
        one that serves that stripe well and this one slowly is judged here on this one's alone
        (`relay.judging`, `_short_as_stand_in`). Whether it was counted."""
        chain = v.chains[stripe]
        if not chain or chain[0] == peer or v.plan is None or peer == v.plan.origin:
            return False
        old = v.link_rates.get((peer, stripe))
        v.link_rates[(peer, stripe)] = (rate, 1) if old is None else \
            ((1 - RATE_EWMA) * old[0] + RATE_EWMA * rate, old[1] + 1)
        return True

    def publish(self, now: float, signed: SignedManifest) -> list[Any]:
        """We published `signed` and hold every chunk: announce it and serve it."""
        effects: list[Any] = []
        v = self._admit(now, signed, effects, held=range(len(signed.manifest.chunk_digests)))
        if v is None:
            return effects
        v.is_origin = True
        effects.append(Publish(MANIFEST_TOPIC, ManifestAnnounce(signed.frame)))
        self._announce(now, effects)
        self._last_announce = now
        return self._arm(now, effects)

    def add_version(self, now: float, signed: SignedManifest, held: Iterable[int]) -> list[Any]:
        """A manifest from our own store (already checked), with the chunk indices we hold."""
        effects: list[Any] = []
        v = self._admit(now, signed, effects, held=held)
        if v is not None and not v.complete:
            self._pump(now, v, effects)
        return self._arm(now, effects)

    def manifest_frame(self, now: float, sender: str, frame: bytes) -> list[Any]:
        """A manifest frame from gossip or a `FetchManifest` answer; believed only if it opens (and
        not one our store refused: `relay.manifest_asks`)."""
        effects: list[Any] = []
        self._take_manifest(now, sender, frame, effects)
        return self._arm(now, effects) if effects else []  # (nothing changed: no tick to move)

    def _take_manifest(self, now: float, sender: str, frame: bytes,
                       effects: list[Any]) -> SignedManifest | ManifestRejected | None:
        """`manifest_frame`'s work, less arming the timer: what `frame` opened as, or why it did not
        open (None: a manifest our store refused, not opened)."""
        if self._refused_frame(frame):
            return None
        try:
            signed = self._open(frame, now)
        except ManifestRejected as exc:
            self.rejected_manifests += 1
            return exc
        if signed.version in self._versions:
            return signed  # already known (or a conflicting one from an equivocating publisher)
        v = self._admit(now, signed, effects, held=None)
        if v is not None:
            asked = self._drop_asks(signed.version)
            if asked is not None and asked.peer == sender and asked.holds_all:
                v.holders.add(sender)  # it answered our FetchManifest because it holds the version
            if v.complete:  # every chunk was already here (content shared with an older version)
                self._completed(now, v, effects)
            else:
                self._pump(now, v, effects)
        return signed

    def fetched(self, now: float, peer: str, version: int, index: int, elapsed_s: float,
                unexplained_s: float | None = None) -> list[Any]:
        """The shell stored chunk `index` of `version`, verified, from `peer`; `elapsed_s`: its
        bytes' time plus the queue time `peer` reported; `unexplained_s`: how much longer the
        answer took, by the shell's clock, from when the request was its to send (not while it
        held our sends on our disk, nor while it dialled `peer`) until the answer began (not
        while it stored it): `peer`'s long poll, by its word (`relay.judging`, `_unexcused_s`).
        None: timed from our ask to `now`, a shell with no such delays (the simulator's).
        A request for that chunk still out at another source (the chunk was asked again there after
        `peer` was dropped or passed over, and `peer`'s answer, received whole by then, was stored
        all the same: `relay.upstream`) is no longer awaited: it is settled here, and its answer,
        if one comes, is taken as any late answer. What settling frees goes to the versions in
        progress (`relay.requests`, `_refill`), not only to `version`."""
        self._hear(now)
        v = self._versions.get(version)
        if v is None:
            return []
        entry = v.in_flight.get(index)
        stripe = None
        if self._refused:
            self._refused.pop(peer, None)
        if self._unaddressed:
            self._unaddressed.pop(peer, None)
        if entry is not None and entry[0] == peer:
            self._settle(now, v, index, entry, progress=True)
            stripe = entry[1]
        elif entry is not None:  # asked again elsewhere: no longer awaited there (see above)
            self._settle(now, v, index, entry, progress=False)
        size = v.size(index)
        effects: list[Any] = []
        served_s = elapsed_s  # (its long poll left out: `relay.judging`, `_served_rates`)
        if stripe is not None:  # asked of it and not taken back: our clock timed it too
            if unexplained_s is None:  # (from our ask)
                unexplained_s = now - entry[2] - elapsed_s  # type: ignore[index]
            elapsed_s += self._unexcused_s(v, stripe, peer, unexplained_s)
            self._count_feed(now, v, stripe, peer, size)
        if elapsed_s > 0:
            rate = size / elapsed_s
            for rates, sample in ((self._rates, rate), (self._served_rates, size / served_s if served_s > 0 else rate)):
                old = rates.get(peer)
                rates[peer] = sample if old is None else (1 - RATE_EWMA) * old + RATE_EWMA * sample
            self._samples[peer] = self._samples.get(peer, 0) + 1
            # (a stripe of an older plan is no longer ours to judge when the replan has fewer)
            if stripe is not None and stripe != SWARM and stripe < len(v.chains) and \
                    self._delivers_too_little(now, v, stripe, peer):
                moved = any(e[0] == peer and v.plan.stripe_of_chunk[i] != stripe  # type: ignore[union-attr]
                            for i, e in v.in_flight.items())
                self._exclude(now, peer, DropReason.SLOW, effects)  # its children borrow substitutes
                effects.append(DropSource(peer))
                if moved:  # a chunk of another stripe asked of it (`asked_for`) went back to that
                    stripe = None  # stripe's queue: pump them all (pumping all on every drop: 1% missed 1.06x -> 1.09x)
            elif stripe is not None and peer == v.signed.publisher:
                self._leave_origin(now, v)  # where it delivers too little, forwarders feed us instead
            elif stripe is not None and stripe != SWARM and stripe < len(v.chains) and \
                    self._rated_as_stand_in(v, stripe, peer, rate) and self._short_as_stand_in(now, v, stripe, peer):
                self._pass_over(now, v, peer, stripe, DropReason.SLOW, effects)  # our parent elsewhere: kept there
        if not v.have[index]:
            v.have[index] = 1
            v.have_count += 1
            v.fetched_chunks += 1
            v.fetched_bytes += size
            if v.tried:
                v.tried.pop(index, None)
            if v.reasked:
                v.reasked.pop(index, None)
            if v.swarm is not None:
                self._gained(now, v, 1 << index, effects)
            if v.complete:
                self._completed(now, v, effects)
        self._refill(now, v, effects, stripe)  # (nothing of `v` once it is complete: `_pump`)
        return self._arm(now, effects)

    def found(self, now: float, version: int, indices: Iterable[int]) -> list[Any]:
        """Our store now holds these chunks of `version` without fetching them (it copied them
        from a version it holds that shares them, or the shell found one it was about to ask for
        already stored); requests for them still out are forgotten (the shell does not send those
        it has not sent yet). Also for a chunk we had heard of: a source dropped with that chunk
        received whole had it told after we asked another source for it again, whose request the
        shell then found held and did not send (unsettled, it would count in flight for good)."""
        v = self._versions.get(version)
        if v is None:
            return []
        for index in indices:
            if not 0 <= index < v.count:
                continue
            if not v.have[index]:
                v.have[index] = 1
                v.have_count += 1
                v.tried.pop(index, None)
            entry = v.in_flight.get(index)
            if entry is not None:  # asked for before the store found it: no longer awaited
                self._settle(now, v, index, entry, progress=False)
        effects: list[Any] = []
        if v.swarm is not None:
            self._gained(now, v, sum(1 << i for i in range(v.count) if v.have[i]) & ~v.swarm.mine, effects)
        if v.complete and v.completed_at is None:
            self._completed(now, v, effects)
        self._refill(now, v, effects)
        return self._arm(now, effects)

    def forget(self, version: int) -> list[Any]:
        """Our store dropped `version`, or would not keep it: stop fetching and announcing it, and
        forget its asks (`relay.manifest_asks`). An input like any other (the role runs it in the
        core's runner); no effects today."""
        self._drop_asks(version)
        v = self._versions.pop(version, None)
        if v is not None:
            self._in_flight -= len(v.in_flight)
        return []

    def collected(self, version: int) -> list[Any]:
        """Garbage collection dropped `version`: forget it, and never take it (or an older
        version we do not know) again, or we would fetch what the next collection drops."""
        effects = self.forget(version)
        self._collected_through = max(self._collected_through, version)
        return effects

    def lost(self, now: float, version: int, index: int) -> list[Any]:
        """Our store no longer holds chunk `index` of `version` (it was corrupt on disk, or a
        failed fsync lost it, and it has been deleted): the version is incomplete (and not
        announced) until it is fetched again."""
        v = self._versions.get(version)
        if v is None or not 0 <= index < v.count or not v.have[index]:
            return []
        v.have[index] = 0
        v.have_count -= 1
        v.completed_at = None
        if v.swarm is not None:
            v.swarm.mine &= ~(1 << index)
        v.tried.pop(index, None)
        _requeue(v, index)
        effects: list[Any] = []
        self._pump(now, v, effects)
        return self._arm(now, effects)

    # -- internals: admission and planning (the queries: `relay.transfer_queries`) ----------

    def _admit(self, now: float, signed: SignedManifest, effects: list[Any],
               held: Iterable[int] | None) -> _Version | None:
        if signed.version in self._versions or signed.version <= self._collected_through:
            return None
        digests = signed.manifest.chunk_digests
        have = bytearray(len(digests))
        if held is None:
            held = [i for i, d in enumerate(digests) if self._held(d)]
        for i in held:
            have[i] = 1
        last = len(digests) - 1
        v = _Version(signed, len(digests), have, sum(have), now, digests, signed.manifest.chunk_bytes,
                     _size(signed, last) if last >= 0 else 0)
        self._versions[signed.version] = v
        effects.append(Emit(ManifestAccepted(signed)))
        self._replan(now, v)
        if v.swarm is not None:
            self._gained(now, v, 0, effects)  # tell our neighbours we take part (and what we hold)
        if v.complete:
            v.completed_at = now
        return v

    # -- internals: the tick and upload slots ---------------------------------------------

    def _slots_wanted(self) -> int:
        """Upload slots to serve all our children at once (0: as configured): the widest child set
        over the versions we hold, in plans of small fan-outs (`ServeAtOnce`); 0 once they are
        forgotten. O(versions), and the versions kept are few."""
        return max((v.plan.fanout[v.forwards].get(self.self_id, 0) for v in self._versions.values()
                    if v.plan is not None and v.forwards >= 0 and v.plan.small_fanouts), default=0)

    def _arm(self, now: float, effects: list[Any]) -> list[Any]:
        """Keep one tick pending: soon while transfers run, at the announce interval otherwise,
        and when a hold on requests ends or a manifest is to be asked for again; ask for the
        upload slots our versions want (`ServeAtOnce`) when that changed."""
        wanted = self._slots_wanted()
        if wanted != self._at_once:
            self._at_once = wanted
            effects.append(ServeAtOnce(wanted))
        hold_ends = min(self._hold_ends(now), self._asks_due_at())
        soon = min(now + self._tick_s, hold_ends)
        if self._tick_at is not None and self._tick_at > now and self._tick_at <= soon:
            return effects  # a tick soon enough is already pending
        if not self._versions and not self._manifest_again:
            return effects
        busy = any(not v.complete for v in self._versions.values())
        interval = min(self.config.announce_interval_s, self._tick_s) if busy else self.config.announce_interval_s
        at = min(now + interval, hold_ends)
        if self._tick_at is None or at < self._tick_at - 1e-9 or self._tick_at <= now:
            self._tick_at = at
            effects.append(SetTimer(at, TIMER_TICK))
        return effects

    def _newest_first(self) -> list[_Version]:
        return [self._versions[n] for n in sorted(self._versions, reverse=True)]


def _size(signed: SignedManifest, index: int) -> int:
    start, end = chunk_range(signed.manifest, index)
    return end - start
