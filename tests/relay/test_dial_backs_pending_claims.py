"""Strangers among the relay members that nobody has dialled back, forever, claiming a huge upload
(their heartbeats' `reachable` None, `Capacity.upload_bps` up to 2^64 - 1): once members are dialled
back, the plan with the pending members dialable (`relay.requests`, "Dial-backs pending") hopes each
of them at no more than the highest upload a dialled-back member is planned at (`_hope_cap`).
Uncapped, ten such strangers claiming 1e12 B/s rooted nearly every chunk of that plan, so the honest
relays had no stripe of their own to wait on and asked the origin for everything, as with no rule at
all. While nobody is dialled back no cap: every relay must hope for the same plan, and only the
claims are known alike (capped at each relay's own upload, relays of different uploads hoped for
different plans). A member pending for longer than an honest dial-back takes (`PENDING_HOPE_S`) is
hoped for no more. The transfer core alone on a virtual clock, and the simulator's broadcast
(virtual time)."""

from __future__ import annotations

from p2pnet.core import SetTimer
from p2pnet.identity import Identity
from p2pnet.wire import Envelope
from relay.effects import Fetch
from relay.manifest import chunk_count, open_manifest
from relay.messages import ManifestAnnounce
from relay.planner import Membership, plan_broadcast
from relay.requests import PENDING_HOPE_S
from relay.transfer import TIMER_TICK, TransferConfig, TransferCore
from simulations.broadcast import build_broadcast, fake_manifest
from simulations.world import EPOCH_S

PUBLISHER = Identity.from_seed_text("strangers claiming much")
ORIGIN = PUBLISHER.peer_id
BPS = 1e9
CLAIM = 1e12
CHUNK = 64 * 1024
RELAYS = [f"r{i}" for i in range(6)]
STRANGERS = [f"s{i}" for i in range(10)]


def _announced(serving: dict[str, float], pending: dict[str, float]) -> tuple[TransferCore, list[Fetch]]:
    """Relay r0's core, told who serves (the strangers at 0) and whose dial-backs are pending, then a
    version of 12 MiB: the core and its first fetches."""
    def opener(frame: bytes, now: float):
        return open_manifest(frame, trusted_publishers={ORIGIN}, now_s=EPOCH_S + now)

    core = TransferCore(TransferConfig(announce_interval_s=3600.0), RELAYS[0], open_frame=opener,
                        self_upload_bps=BPS)
    core.set_members(0.0, {**serving, **dict.fromkeys(STRANGERS, 0.0)}, pending)
    signed = fake_manifest(PUBLISHER, 12 * 2**20, CHUNK)
    effects = core.on_message(0.0, Envelope(ManifestAnnounce.KIND, ORIGIN, b"", 0, ManifestAnnounce(signed.frame), 0))
    return core, [e for e in effects if isinstance(e, Fetch)]


def _own(core: TransferCore, hoped: dict[str, float], relay: str = RELAYS[0]) -> bytearray:
    """Which chunks `relay` (r0) takes from the origin in the plan of the members `hoped` (every one
    dialable)."""
    v = core._versions[1]
    plan = plan_broadcast(ORIGIN, hoped[ORIGIN], Membership.of(hoped), v.count, core.config.stripes,
                          salt=v.signed.manifest_id, stable=core.config.stable_plan)
    ours = {s for s in range(plan.stripes) if plan.ancestors(s, relay)[:1] == [ORIGIN]}
    return bytearray(plan.stripe_of_chunk[i] in ours for i in range(v.count))


UPLOADS = dict(zip(RELAYS, (5e6, 10e6, 20e6, 40e6, 60e6, 80e6)))


def test_while_everyone_is_pending_every_relay_hopes_for_the_plan_of_the_claims_as_told():
    """Nobody dialled back yet (a version published as the relays start), relays of different uploads
    each advertising its own: every relay, slow or fast, hopes for the plan of the claims as every
    relay is told them, so their own stripes are those of one plan. (Capped at each relay's own
    upload, the slower relays hoped for plans of their own, asked the origin for chunks the faster
    ones asked it for too and kept others nobody asked: see the simulator test below.)"""
    nobody = {ORIGIN: 0.0, **dict.fromkeys(RELAYS, 0.0)}
    claims = {ORIGIN: BPS, **UPLOADS}
    for relay in RELAYS:
        core = _relay_core(relay, nobody, claims)
        _announce(core, 0.0)
        own = _own(core, {**nobody, **dict.fromkeys(STRANGERS, 0.0), **claims}, relay)
        assert core._versions[1].origin_only == own and any(own), relay


def test_a_low_pending_claim_lowers_nobody_else_s_hope():
    """One stranger claims 1 B/s, nobody dialled back yet, and we are not dialable ourselves (a leaf,
    not pending): the others are hoped at their claims, not at the lowest one (that would plan every
    pending member below the origin's share, and our own stripes of that plan with them)."""
    nobody = {ORIGIN: 0.0, **dict.fromkeys(RELAYS, 0.0)}
    others = {ORIGIN: BPS, **dict.fromkeys(RELAYS[1:], BPS)}
    low = {STRANGERS[0]: 1.0}
    core, _ = _announced(nobody, {**others, **low})
    known = {**nobody, **dict.fromkeys(STRANGERS, 0.0)}
    own = _own(core, {**known, **others, **low})
    assert core._versions[1].origin_only == own and any(own)
    assert own != _own(core, {**known, **others, **dict.fromkeys(RELAYS[1:], 1.0), **low}), \
        "the lowest claim makes another plan"


def test_not_dialable_ourselves_with_nobody_dialled_back_we_still_wait_for_the_pending():
    """Our own dial-back failed (we are a leaf, not pending) and nobody is dialled back yet: the pending
    members are hoped at their claims, and we keep from the origin the chunks they will root (capped
    at nothing, at 0, they would be leaves too and we would ask the origin for all)."""
    nobody = {ORIGIN: 0.0, **dict.fromkeys(RELAYS, 0.0)}
    others = {ORIGIN: BPS, **dict.fromkeys(RELAYS[1:], BPS)}
    core, first = _announced(nobody, others)
    v = core._versions[1]
    assert v.origin_only is not None and v.kept, "the others' chunks kept from the origin"
    assert all(v.origin_only[f.index] for f in first if f.peer == ORIGIN)


def test_once_members_are_dialled_back_a_huge_claim_counts_no_more_than_the_fastest_of_them():
    """The honest relays dialled back (r1 twice as fast as the others), ten strangers pending forever
    claiming 1e12 B/s, the origin faster than all: the strangers are hoped at the fastest dialled-back
    relay's upload, not the origin's, not ours, not their claim."""
    serving = {ORIGIN: 4 * BPS, **dict.fromkeys(RELAYS, BPS), RELAYS[1]: 2 * BPS}
    core, first = _announced(serving, dict.fromkeys(STRANGERS, CLAIM))
    like_them, first_like_them = _announced(serving, dict.fromkeys(STRANGERS, 2 * BPS))
    own = _own(core, {**serving, **dict.fromkeys(STRANGERS, 2 * BPS)})
    assert any(own), "r0 roots a stripe of the plan with the strangers dialable at the fastest relay's upload"
    for other in (4 * BPS, BPS):  # the origin's upload, ours: another plan
        assert _own(core, {**serving, **dict.fromkeys(STRANGERS, other)}) != own
    assert core._versions[1].origin_only == own == like_them._versions[1].origin_only
    assert [(f.peer, f.index) for f in first] == [(f.peer, f.index) for f in first_like_them]


def test_a_dialled_back_member_claiming_much_lifts_the_pending_no_further_than_the_plans_ceiling():
    """A dialled-back member (a liar dialable but claiming 100 times the others) is planned at
    `ADVERTISED_CAP` times the lower median (`Membership.planned`), and so are the strangers it may
    bring pending with it, not at its claim: r0 still has a chunk of its own to wait on (at the
    liar's claim, none)."""
    serving = {ORIGIN: BPS, **dict.fromkeys(RELAYS, BPS), RELAYS[1]: 100 * BPS}
    core, _ = _announced(serving, dict.fromkeys(STRANGERS, CLAIM))
    ceiling = core._members.planned[RELAYS[1]]
    assert ceiling < 100 * BPS
    own = _own(core, {**serving, **dict.fromkeys(STRANGERS, ceiling)})
    assert core._versions[1].origin_only == own and any(own)
    assert not any(_own(core, {**serving, **dict.fromkeys(STRANGERS, 100 * BPS)}))


def test_relays_of_different_uploads_pending_together_publish_early_as_fast_as_uncapped():
    """The simulator's broadcast, 12 relays of uploads drawn from 5-80 MB/s, each advertising its own,
    all dialled back at 1 s, a version of 12 MiB published at once from an origin sending (and
    advertising) 3 MB/s: the origin sends 1.307 copies (uncapped, as here), 1.781 with every pending
    member hoped at no more than each relay's own upload (each relay hoped for another plan)."""
    sim = build_broadcast(12, 12 * 2**20, upload_bps=(5e6, 80e6), origin_upload_bps=3e6, seed=1,
                          chunk_bytes=CHUNK, config=TransferConfig(announce_interval_s=1.0))
    claims = {p: sim.uploads[p] for p in sim.peer_ids}

    def tell(back: bool) -> None:
        members = {sim.origin: 3e6, **(claims if back else dict.fromkeys(sim.peer_ids, 0.0))}
        for peer, core in sim.cores.items():
            sim.world.apply(peer, core.set_members(sim.engine.now, members, {} if back else claims))
    tell(False)
    sim.engine.at(1.0, tell, True)
    sim.publish()
    sim.engine.run(until=600.0, stop=sim.done)
    assert sim.done()
    copies = sim.world.ports[sim.origin].bytes_up / sim.signed.manifest.total_bytes
    assert copies < 1.5, f"the origin sent {copies:.3f} copies"


def _core(serving: dict[str, float], pending: dict[str, float], now: float = 0.0) -> TransferCore:
    return _relay_core(RELAYS[0], serving, pending, now)


def _relay_core(relay: str, serving: dict[str, float], pending: dict[str, float], now: float = 0.0) -> TransferCore:
    """`relay`'s core (its own upload as `UPLOADS` says, else `BPS`), told who serves (the strangers
    at 0) and whose dial-backs are pending."""
    def opener(frame: bytes, now: float):
        return open_manifest(frame, trusted_publishers={ORIGIN}, now_s=EPOCH_S + now)

    core = TransferCore(TransferConfig(announce_interval_s=3600.0), relay, open_frame=opener,
                        self_upload_bps=UPLOADS.get(relay, BPS))
    core.set_members(now, {**serving, **dict.fromkeys(STRANGERS, 0.0)}, pending)
    return core


def _announce(core: TransferCore, now: float) -> list[Fetch]:
    signed = fake_manifest(PUBLISHER, 12 * 2**20, CHUNK)
    effects = core.on_message(now, Envelope(ManifestAnnounce.KIND, ORIGIN, b"", 0, ManifestAnnounce(signed.frame), 0))
    return [e for e in effects if isinstance(e, Fetch)]


SERVING = {ORIGIN: BPS, **dict.fromkeys(RELAYS, BPS)}


def test_members_pending_for_longer_than_an_honest_dial_back_takes_are_hoped_for_no_more():
    """Strangers pending since long before the version (`PENDING_HOPE_S`, told again on the way as
    the role's membership poll does): the version is planned and asked as if they were known not
    dialable; pending for less, they are hoped for (a wait, as before)."""
    late = PENDING_HOPE_S + 1.0
    told = _core(SERVING, dict.fromkeys(STRANGERS, BPS))
    told.set_members(late / 2, {**SERVING, **dict.fromkeys(STRANGERS, 0.0)}, dict.fromkeys(STRANGERS, BPS))
    untold = _core(SERVING, {})
    first, first_untold = _announce(told, late), _announce(untold, late)
    assert told._versions[1].origin_only is None
    assert [(f.peer, f.index) for f in first] == [(f.peer, f.index) for f in first_untold]
    recent = _core(SERVING, dict.fromkeys(STRANGERS, BPS), now=late - 1.0)
    _announce(recent, late)
    assert recent._versions[1].origin_only is not None, "pending for 1 s: hoped for"


def test_a_wait_on_members_that_stay_pending_ends_when_they_have_been_pending_too_long():
    """A version published as the strangers became pending waits on them; the first answer after
    they have been pending for `PENDING_HOPE_S` ends the wait: the chunks kept are asked of the
    origin then, with nothing else happening (no new membership)."""
    core = _core(SERVING, dict.fromkeys(STRANGERS, BPS))
    first = _announce(core, 0.0)
    v = core._versions[1]
    assert v.origin_only is not None and v.kept, "a wait, chunks kept from the origin"
    kept = set(v.kept)
    f = first[0]
    later = [e for e in core.fetched(PENDING_HOPE_S - 0.01, f.peer, f.version, f.index, 0.01) if isinstance(e, Fetch)]
    assert v.origin_only is not None, "still hoped for just before"
    f = later[0] if later else first[1]
    after = [e for e in core.fetched(PENDING_HOPE_S, f.peer, f.version, f.index, 0.01) if isinstance(e, Fetch)]
    assert v.origin_only is None and not v.kept
    assert {e.index for e in after if e.peer == ORIGIN} & kept, "a chunk kept is asked of the origin now"


def test_a_wait_on_members_that_stay_pending_ends_at_a_tick_when_no_answer_comes():
    """As above, but no chunk is answered at all (the origin's link stalled): the core's own tick,
    armed while a transfer runs, pumps the version, and the first tick once the strangers have been
    pending for `PENDING_HOPE_S` ends the wait. The wait cannot outlive the limit by more than a tick."""
    core = _core(SERVING, dict.fromkeys(STRANGERS, BPS))
    effects = core.on_message(0.0, Envelope(ManifestAnnounce.KIND, ORIGIN, b"", 0,
                                            ManifestAnnounce(fake_manifest(PUBLISHER, 12 * 2**20, CHUNK).frame), 0))
    v = core._versions[1]
    assert v.origin_only is not None and v.kept
    ticks = 0
    while v.origin_only is not None:
        at = max(e.at for e in effects if isinstance(e, SetTimer) and e.key == TIMER_TICK)
        assert at <= PENDING_HOPE_S + core._tick_s, "a tick armed within a tick of the limit"
        effects = core.on_timer(at, TIMER_TICK)
        ticks += 1
        assert (v.origin_only is None) == (at >= PENDING_HOPE_S), at
    assert ticks > 1 and not v.kept


def test_the_member_pending_longest_is_the_first_hoped_for_no_more():
    """One stranger pending since 0, nine since 10 s, a version at 10 s: at the tick at
    `PENDING_HOPE_S` the first is hoped for no more and the wait goes on for the nine alone (their
    own limit is 10 s later), not for all ten until the last of them is too old."""
    core = _core(SERVING, {STRANGERS[0]: BPS})
    core.set_members(10.0, {**SERVING, **dict.fromkeys(STRANGERS, 0.0)}, dict.fromkeys(STRANGERS, BPS))
    _announce(core, 10.0)
    v = core._versions[1]
    known = {**SERVING, **dict.fromkeys(STRANGERS, 0.0)}
    assert v.origin_only == _own(core, {**known, **dict.fromkeys(STRANGERS, BPS)})
    core.on_timer(PENDING_HOPE_S, TIMER_TICK)
    nine = _own(core, {**known, **dict.fromkeys(STRANGERS[1:], BPS)})
    assert nine != _own(core, {**known, **dict.fromkeys(STRANGERS, BPS)})
    assert v.origin_only == nine and v.hope_until == 10.0 + PENDING_HOPE_S


def test_a_member_pending_again_after_a_verdict_is_hoped_for_afresh():
    """A stranger pending, then known (not dialable), then pending again much later (say it
    restarted): its pending time counts from the last time, so a version then waits on it again."""
    core = _core(SERVING, dict.fromkeys(STRANGERS, BPS))
    core.set_members(1.0, {**SERVING, **dict.fromkeys(STRANGERS, 0.0)}, {})
    again = 2 * PENDING_HOPE_S
    core.set_members(again, {**SERVING, **dict.fromkeys(STRANGERS, 0.0)}, dict.fromkeys(STRANGERS, BPS))
    _announce(core, again + 1.0)
    assert core._versions[1].origin_only is not None


def test_strangers_pending_since_long_before_a_version_cost_it_nothing():
    """The simulator's broadcast, 6 honest relays dialled back and 10 strangers pending claiming
    1e12 B/s, told 20 s before a version of 12 MiB is published from an origin sending 100 MB/s: the
    same as with the strangers known not dialable (1.771 copies sent the honest relays; 1.911 with
    the claims uncapped, 1.964 capped and still hoped for)."""
    def world(pending: bool) -> tuple[float, float]:
        sim = build_broadcast(16, 12 * 2**20, upload_bps=(25e6, 25e6), origin_upload_bps=100e6, seed=1,
                              chunk_bytes=CHUNK, config=TransferConfig(announce_interval_s=1.0))
        honest, strangers = sim.peer_ids[:6], sim.peer_ids[6:]
        from_origin = [0]
        for peer in honest:
            core = sim.cores[peer]

            def fetched(now, source, version, index, elapsed_s, unexplained_s=None, _inner=core.fetched):
                from_origin[0] += source == sim.origin
                return _inner(now, source, version, index, elapsed_s, unexplained_s)
            core.fetched = fetched  # type: ignore[method-assign]
        known = {sim.origin: BPS, **dict.fromkeys(honest, BPS), **dict.fromkeys(strangers, 0.0)}
        for peer, core in sim.cores.items():
            sim.world.apply(peer, core.set_members(0.0, known, dict.fromkeys(strangers, CLAIM) if pending else {}))
        sim.engine.run(until=20.0)
        sim.publish()
        sim.engine.run(until=600.0, stop=sim.done)
        assert sim.done()
        return from_origin[0] / chunk_count(sim.signed.manifest), max(sim.completed[p] for p in honest)
    assert world(True) == world(False)
