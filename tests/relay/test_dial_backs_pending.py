"""A version known before the relays hear each other dialled back (`set_members`' `unconfirmed`):
every other relay is planned at upload 0, so the plan makes the origin our parent in every stripe;
the core asks the origin first only for the chunks of the stripes whose root we are in the plan
with them dialable, keeps the rest until the dial-backs come (the replan asks them of their roots)
or until every chunk of our own stripes is held or asked, with no timer (`relay.requests`,
"Dial-backs pending"). The transfer core alone, on a virtual clock; what it saves a capped trainer
on real links: `tests/relay/test_lab_capped_origin.py` (published early)."""

from __future__ import annotations

from p2pnet.identity import Identity
from p2pnet.wire import Envelope
from relay.effects import Fetch
from relay.manifest import open_manifest
from relay.messages import ManifestAnnounce
from relay.planner import Membership, plan_broadcast
from relay.transfer import TransferConfig, TransferCore
from simulations.broadcast import build_broadcast, fake_manifest
from simulations.world import EPOCH_S

PUBLISHER = Identity.from_seed_text("dial-backs pending")
ORIGIN = PUBLISHER.peer_id
BPS = 1e9
CHUNK = 64 * 1024
RELAYS = [f"r{i}" for i in range(6)]
ALL_SERVING = {ORIGIN: BPS, **dict.fromkeys(RELAYS, BPS)}
NOBODY_SERVING = {ORIGIN: 0.0, **dict.fromkeys(RELAYS, 0.0)}  # as in the lab: nobody dialled back yet, the trainer too


def _announced(pending: dict[str, float] | None) -> tuple[TransferCore, list[Fetch]]:
    """Relay r0's core, told nobody serves (`pending`: whose dial-backs are still to come) and then
    a version of 3 MiB: the core and its first fetches."""
    def opener(frame: bytes, now: float):
        return open_manifest(frame, trusted_publishers={ORIGIN}, now_s=EPOCH_S + now)

    core = TransferCore(TransferConfig(announce_interval_s=3600.0), RELAYS[0], open_frame=opener,
                        self_upload_bps=BPS)
    core.set_members(0.0, NOBODY_SERVING, pending)
    signed = fake_manifest(PUBLISHER, 3 * 2**20, CHUNK)
    effects = core.on_message(0.0, Envelope(ManifestAnnounce.KIND, ORIGIN, b"", 0, ManifestAnnounce(signed.frame), 0))
    return core, [e for e in effects if isinstance(e, Fetch)]


def _own_chunks(core: TransferCore) -> set[int]:
    """The chunks of the stripes whose root r0 is in the plan with every relay dialable."""
    v = core._versions[1]
    hoped = plan_broadcast(ORIGIN, BPS, Membership.of(ALL_SERVING), v.count, core.config.stripes,
                           salt=v.signed.manifest_id, stable=core.config.stable_plan)
    ours = {s for s in range(hoped.stripes) if hoped.ancestors(s, RELAYS[0])[:1] == [ORIGIN]}
    assert ours, "r0 roots a stripe of the plan with every relay dialable"
    return {i for i in range(v.count) if hoped.stripe_of_chunk[i] in ours}


def _answer_all(core: TransferCore, fetches: list[Fetch], now: float) -> tuple[list[Fetch], float]:
    """Answer every fetch, one at a time 10 ms apart, and what each answer asks, until nothing is
    asked: every fetch in the order it was asked, and the time then."""
    asked, queue = list(fetches), list(fetches)
    while queue:
        f = queue.pop(0)
        now += 0.01
        more = [e for e in core.fetched(now, f.peer, f.version, f.index, 0.01) if isinstance(e, Fetch)]
        asked += more
        queue += more
    return asked, now


def test_while_dial_backs_are_pending_the_origin_is_asked_only_for_our_own_stripe():
    """Known not dialable (no dial-backs pending), the first plan asks the origin for a window of
    chunks in every stripe; with every relay's dial-back pending, only for chunks of our own
    stripe of the plan with them dialable (the base code asked the same as for the known-not-
    dialable)."""
    core, told = _announced(None)
    own = _own_chunks(core)
    assert {f.peer for f in told} == {ORIGIN} and {f.index for f in told} - own, "others' chunks asked too"
    core, pending = _announced(dict(ALL_SERVING))
    assert pending and {f.peer for f in pending} == {ORIGIN}
    assert {f.index for f in pending} <= own, "only our own stripe's chunks asked of the origin"


def test_with_no_dial_back_ever_the_rest_is_asked_of_the_origin_once_our_own_stripe_is_all_asked():
    """Dial-backs that never come hold back nothing for longer than our own stripe takes: once each
    of its chunks is held or asked, the origin is asked for the rest, no timer needed, and the
    version completes with every chunk asked once (on the base code the others' chunks were asked
    from the first request on)."""
    core, first = _announced(dict(ALL_SERVING))
    own = _own_chunks(core)
    asked, _ = _answer_all(core, first, 0.0)
    indices = [f.index for f in asked]
    assert {f.peer for f in asked} == {ORIGIN}
    assert sorted(indices) == list(range(core._versions[1].count)), "every chunk, each asked once"
    first_other = next(k for k, i in enumerate(indices) if i not in own)
    assert own <= set(indices[:first_other + 2 * core.config.stripes]), \
        "others' chunks only once our own stripe's were all asked"
    assert core._versions[1].complete and core._versions[1].origin_only is None


def test_when_the_dial_backs_come_the_chunks_kept_are_asked_of_their_roots_not_the_origin():
    """The dial-backs come (the replan): the chunks kept from the origin are asked of the relays that
    root their stripes, and the origin, over the whole version, only for our own stripe (on the
    base code it had been asked for others' chunks before the replan)."""
    core, first = _announced(dict(ALL_SERVING))
    own = _own_chunks(core)
    replanned = [e for e in core.set_members(0.05, ALL_SERVING, {}) if isinstance(e, Fetch)]
    assert {f.peer for f in replanned} - {ORIGIN}, "the other stripes asked of relays"
    asked, _ = _answer_all(core, first + replanned, 0.05)
    assert {f.index for f in asked if f.peer == ORIGIN} <= own
    assert core._versions[1].complete


def test_a_chunk_asked_of_us_meanwhile_is_fetched_whatever_its_stripe():
    """While dial-backs are pending, a chunk a member asks of us (`asked_for`: its request waits at
    us) is fetched from the origin even when the plan with them dialable does not give it us: kept,
    the asker's request waited at us and nothing asked again once the wait ended; with a member whose
    `reachable` flipped every 0.1 s (simulator, 20 relays, origin at 3 MB/s) relays waited on each
    other in a ring for two chunks nobody held, 33.7 s to all instead of 5.5."""
    core, first = _announced(dict(ALL_SERVING))
    own = _own_chunks(core)
    v = core._versions[1]
    asked = {f.index for f in first}
    home = v.plan.home.get(RELAYS[0], -1)
    other = next(i for i in range(v.count) if i not in own and i not in asked and v.plan.stripe_of_chunk[i] != home)
    mine = next(i for i in sorted(own) if i not in asked and v.plan.stripe_of_chunk[i] != home)
    assert home >= 0, "r0 forwards a stripe of the first plan: asked_for applies"
    assert [(e.peer, e.index) for e in core.asked_for(0.01, 1, other) if isinstance(e, Fetch)] == [(ORIGIN, other)]
    assert [(e.peer, e.index) for e in core.asked_for(0.01, 1, mine) if isinstance(e, Fetch)] == [(ORIGIN, mine)]


def test_a_member_whose_dial_back_never_comes_holds_back_no_version_published_later():
    """A stranger among the relay members says in its heartbeats that nobody has dialled it back,
    forever (`reachable` None: others cannot check it), advertising a fast upload; every other
    relay is known dialable and the version is published after that (the simulator's broadcast,
    six relays, origin at 3 MB/s). Roots of the real plan must not keep their home stripe from the
    origin: their children wait for it from them, and each relay's requests budget filled with such
    waits while the chunks of its own stripes were still to ask (before the fix: 4.18 copies from
    the origin, 77 s to all instead of 1.16 copies, 4.9 s; with the stranger known not dialable
    the same 1.16 copies)."""
    sim = build_broadcast(6, 12 * 2**20, upload_bps=(25e6, 25e6), origin_upload_bps=3e6, seed=1,
                          chunk_bytes=CHUNK, config=TransferConfig(announce_interval_s=1.0))
    stranger = sim.peer_ids[-1]
    known = {sim.origin: BPS, **{p: (0.0 if p == stranger else BPS) for p in sim.peer_ids}}
    for peer, core in sim.cores.items():
        sim.world.apply(peer, core.set_members(sim.engine.now, known, {stranger: BPS}))
    sim.publish()
    sim.engine.run(until=600.0, stop=sim.done)
    assert sim.done()
    copies = sim.world.ports[sim.origin].bytes_up / sim.signed.manifest.total_bytes
    assert copies < 1.5, f"the origin sent {copies:.2f} copies"


def test_members_found_not_dialable_end_the_wait_at_once():
    """The pending members' dial-backs fail (their verdict False: planned at 0 as before, pending no
    more): the membership the core plans with does not change, but what it kept from the origin is
    asked of it at once (`_reconsider_origin`), not after our own stripe."""
    core, first = _announced(dict(ALL_SERVING))
    own = _own_chunks(core)
    asked = [e for e in core.set_members(0.01, NOBODY_SERVING, {}) if isinstance(e, Fetch)]
    assert core._versions[1].origin_only is None
    assert {f.index for f in asked} - own, "the others' chunks asked of the origin now"


def test_a_request_unanswered_does_not_hold_the_rest_back():
    """The wait ends once every chunk of our own stripe is held or asked: one of them asked and never
    answered holds back nothing (the version's other chunks are all asked)."""
    core, first = _announced(dict(ALL_SERVING))
    lost, rest = first[0], first[1:]
    asked, _ = _answer_all(core, rest, 0.0)
    assert sorted({f.index for f in asked} | {lost.index}) == list(range(core._versions[1].count))


def test_the_role_tells_the_core_whose_dial_backs_are_pending_ourselves_included():
    """`unconfirmed_uploads`: the relay members whose heartbeat says nobody dialled them back yet
    (`reachable` None), at the upload they advertise, and ourselves while our own verdict is None;
    not those found dialable or not dialable."""
    from types import SimpleNamespace

    from relay.role_members import unconfirmed_uploads

    def entry(peer, reachable):
        return SimpleNamespace(peer_id=peer, reachable=reachable, capacity=SimpleNamespace(upload_bps=5))

    table = SimpleNamespace(local=SimpleNamespace(reachable=None, capacity=SimpleNamespace(upload_bps=7)),
                            with_role=lambda role: [entry("a", None), entry("b", True), entry("c", False)])
    node = SimpleNamespace(peertable=table, peer_id="me")
    assert unconfirmed_uploads(node) == {"a": 5.0, "me": 7.0}
    table.local.reachable = False
    assert unconfirmed_uploads(node) == {"a": 5.0}
