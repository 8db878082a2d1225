"""Strangers among the relay members that nobody has dialled back, forever, claiming a huge upload
(their heartbeats' `reachable` None, `Capacity.upload_bps` up to 2^64 - 1): the plan with the pending
members dialable (`relay.requests`, "Dial-backs pending") hopes each of them at no more than the
highest upload a member already dialled back is planned at, or the lowest pending claim (ours among
them while we are pending too), `_hope_cap`. Uncapped, ten such strangers claiming 1e12 B/s rooted
nearly every chunk of that plan, so the honest relays had no stripe of their own to wait on and asked
the origin for everything, as with no rule at all; and a member pending for longer than an honest
dial-back takes (`PENDING_HOPE_S`) is hoped for no more. The transfer core alone on a virtual clock,
and the simulator's broadcast (virtual time)."""

from __future__ import annotations

from p2pnet.identity import Identity
from p2pnet.wire import Envelope
from relay.effects import Fetch
from relay.manifest import chunk_count, open_manifest
from relay.messages import ManifestAnnounce
from relay.planner import Membership, plan_broadcast
from relay.requests import PENDING_HOPE_S
from relay.transfer import TransferConfig, TransferCore
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


def _own(core: TransferCore, hoped: dict[str, float]) -> bytearray:
    """Which chunks r0 roots in the plan of the members `hoped` (every one dialable)."""
    v = core._versions[1]
    plan = plan_broadcast(ORIGIN, hoped[ORIGIN], Membership.of(hoped), v.count, core.config.stripes,
                          salt=v.signed.manifest_id, stable=core.config.stable_plan)
    ours = {s for s in range(plan.stripes) if plan.ancestors(s, RELAYS[0])[:1] == [ORIGIN]}
    return bytearray(plan.stripe_of_chunk[i] in ours for i in range(v.count))


def test_while_everyone_is_pending_a_huge_claim_counts_no_more_than_our_own():
    """Nobody dialled back yet (a version published as the relays start): ten strangers claiming
    1e12 B/s are hoped at the lowest pending claim, ours, and r0 asks the origin first only for its
    own stripe of that plan, as if they claimed what we do. (Uncapped, they rooted nearly every chunk,
    r0 none: no wait, and its first requests asked the origin for others' chunks.)"""
    nobody = {ORIGIN: 0.0, **dict.fromkeys(RELAYS, 0.0)}
    honest = {ORIGIN: BPS, **dict.fromkeys(RELAYS, BPS)}
    core, first = _announced(nobody, {**honest, **dict.fromkeys(STRANGERS, CLAIM)})
    like_us, first_like_us = _announced(nobody, {**honest, **dict.fromkeys(STRANGERS, BPS)})
    own = _own(core, {**honest, **dict.fromkeys(STRANGERS, BPS)})
    v = core._versions[1]
    assert v.origin_only == own and any(own), "the wait is on, for our own stripe of the capped plan"
    assert first and {f.peer for f in first} == {ORIGIN} and all(own[f.index] for f in first)
    assert [(f.peer, f.index) for f in first] == [(f.peer, f.index) for f in first_like_us]
    assert like_us._versions[1].origin_only == own


def test_a_low_pending_claim_lowers_nobody_else_s_hope():
    """One stranger claims 1 B/s, nine 1e12 B/s, nobody dialled back yet: the nine are hoped at our
    upload, not at the lowest claim (that would plan every pending member, us too, below the origin's
    share)."""
    nobody = {ORIGIN: 0.0, **dict.fromkeys(RELAYS, 0.0)}
    honest = {ORIGIN: BPS, **dict.fromkeys(RELAYS, BPS)}
    low = {STRANGERS[0]: 1.0}
    core, first = _announced(nobody, {**honest, **dict.fromkeys(STRANGERS, CLAIM), **low})
    like_us, first_like_us = _announced(nobody, {**honest, **dict.fromkeys(STRANGERS, BPS), **low})
    assert first and [(f.peer, f.index) for f in first] == [(f.peer, f.index) for f in first_like_us]
    lowest, first_lowest = _announced(nobody, {**honest, **dict.fromkeys(STRANGERS, 1.0)})
    assert [f.index for f in first] != [f.index for f in first_lowest], "the lowest claim makes another plan"


def test_not_dialable_ourselves_with_nobody_dialled_back_we_still_wait_for_the_pending():
    """Our own dial-back failed (we are a leaf, not pending) and nobody is dialled back yet: the pending
    members are hoped at the lowest of their claims, and we keep from the origin the chunks they will
    root (as before the cap: capped at nothing, they were hoped at 0 and we asked the origin for all)."""
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


def test_strangers_claiming_much_forever_cost_the_honest_relays_little_of_an_early_publish():
    """The simulator's broadcast, 6 honest relays and 10 strangers pending forever claiming 1e12 B/s
    (every relay a real core told the same), the honest ones dialled back at 1 s, a version of 12 MiB
    published at once from an origin sending 3 MB/s: the origin sends the honest relays 1.61 copies
    (with the strangers' claims uncapped 1.97, as the honest relays kept nothing back before their
    dial-backs came; with the strangers known not dialable 1.52). The last honest relay is done at
    14.7 s either way (11.0 s with the strangers known not dialable): what the strangers ask of the
    origin for themselves is not the honest relays' to decide, and once the honest relays are
    dialled back the strangers, hoped at their upload, still root 10 of the 16 stripes of the plan
    hoped for."""
    sim = build_broadcast(16, 12 * 2**20, upload_bps=(25e6, 25e6), origin_upload_bps=3e6, seed=1,
                          chunk_bytes=CHUNK, config=TransferConfig(announce_interval_s=1.0))
    honest, strangers = sim.peer_ids[:6], sim.peer_ids[6:]
    from_origin = [0]
    for peer in honest:
        core = sim.cores[peer]

        def fetched(now, source, version, index, elapsed_s, unexplained_s=None, _inner=core.fetched):
            from_origin[0] += source == sim.origin
            return _inner(now, source, version, index, elapsed_s, unexplained_s)
        core.fetched = fetched  # type: ignore[method-assign]

    def tell(members, pending):
        for peer, core in sim.cores.items():
            sim.world.apply(peer, core.set_members(sim.engine.now, members, pending))
    claims = dict.fromkeys(strangers, CLAIM)
    tell({sim.origin: BPS, **dict.fromkeys(sim.peer_ids, 0.0)}, {**dict.fromkeys(honest, BPS), **claims})
    sim.engine.at(1.0, tell, {sim.origin: BPS, **dict.fromkeys(honest, BPS), **dict.fromkeys(strangers, 0.0)}, claims)
    sim.publish()
    sim.engine.run(until=600.0, stop=sim.done)
    assert sim.done()
    copies = from_origin[0] / chunk_count(sim.signed.manifest)
    assert copies < 1.75, f"the origin sent the honest relays {copies:.3f} copies"


def _core(serving: dict[str, float], pending: dict[str, float], now: float = 0.0) -> TransferCore:
    def opener(frame: bytes, now: float):
        return open_manifest(frame, trusted_publishers={ORIGIN}, now_s=EPOCH_S + now)

    core = TransferCore(TransferConfig(announce_interval_s=3600.0), RELAYS[0], open_frame=opener,
                        self_upload_bps=BPS)
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
