"""A stripe's root is judged against what the origin feeds its stripe (`relay.judging`,
`_stripe_feed_bps`): under an origin whose upload is capped, a root that forwards faster than the
origin feeds it is kept, and one far slower than that is still dropped; so too under an origin
that advertises the default and sends its first chunks within a burst, judged by what it sent
of our own stripe over time, while a slow root under a fast origin is dropped. The transfer core
alone; `tests/relay/test_capped_origin_processes.py` shows the same with real relay processes."""

import heapq

import pytest

from p2pnet.identity import Identity
from p2pnet.wire import Envelope
from relay.effects import DropReason, Fetch, SourceDropped
from relay.manifest import open_manifest
from relay.messages import ManifestAnnounce
from relay.planner import Membership
from relay.transfer import TransferConfig, TransferCore
from simulations.broadcast import fake_manifest
from simulations.world import EPOCH_S

PUBLISHER = Identity.from_seed_text("capped origin")
ORIGIN_BPS = 3e6  # a home uplink (`--upload-bps`)
RELAY_BPS = 1e9  # what relays that do not know their upload advertise
CHUNK = 64 * 1024
CONFIG = TransferConfig(stall_timeout_s=3.0, exclude_s=60.0, announce_interval_s=3600.0)


def _relay(origin_advertised_bps: float = ORIGIN_BPS, me: int = 0, mib: int = 4, relays: int = 7,
           relay_bps: float = RELAY_BPS, config: TransferConfig = CONFIG) -> tuple[TransferCore, list[Fetch]]:
    """Relay `me` of `relays` (7: a stripe each, every root its stripe's only forwarder), each
    advertising `relay_bps`, under the origin advertising `origin_advertised_bps`: its core and
    first fetches of a `mib` MiB version in 64 KiB chunks."""
    names = [f"r{i}" for i in range(relays)]
    members = Membership.of({PUBLISHER.peer_id: origin_advertised_bps, **dict.fromkeys(names, relay_bps)})

    def opener(frame: bytes, now: float):
        return open_manifest(frame, trusted_publishers={PUBLISHER.peer_id}, now_s=EPOCH_S + now)

    core = TransferCore(config, names[me], open_frame=opener, self_upload_bps=relay_bps)
    core.set_members(0.0, members)
    signed = fake_manifest(PUBLISHER, mib * 2**20, CHUNK)
    announce = Envelope(ManifestAnnounce.KIND, PUBLISHER.peer_id, b"", 0, ManifestAnnounce(signed.frame), 0)
    pending = [e for e in core.on_message(0.0, announce) if isinstance(e, Fetch)]
    plan = core._versions[1].plan
    assert relays != 7 or plan.stripes == 7 and all(len(plan.ranked_interior(s)) == 1 for s in range(7))
    return core, pending


@pytest.mark.parametrize("advertised_bps", [ORIGIN_BPS, RELAY_BPS])
@pytest.mark.parametrize("lagging_bps, dropped", [(1.3e6, False), (4e4, True)])
def test_a_root_is_judged_against_what_the_capped_origin_feeds_its_stripe(lagging_bps, dropped, advertised_bps):
    """Every chunk of every stripe leaves the origin at 3 MB/s over 7 stripes, 0.43 MB/s a
    stripe; one root delivers us each chunk at `lagging_bps` (its long poll beyond our other
    sources'), the others at 65 MB/s (their bytes on a fast link). At 1.3 MB/s, three times what
    its stripe is fed, it was dropped against the plan's rate for the stripe (the root's 1 GB/s
    advertised upload in it), and the origin, its only replacement, served that stripe to us
    too: real relays under a 3 MB/s origin dropped nearly every root, and the origin served 2.3
    copies. Now kept; a root delivering under a tenth of the feed is still dropped. The same
    when the origin advertises the default 1 GB/s (it has not measured its upload yet): we time
    the origin's chunks to us, as it feeds our own stripe."""
    core, pending = _relay(advertised_bps)
    plan = core._versions[1].plan
    me = core.self_id
    lagging = next(plan.parent[s][me] for s in range(plan.stripes) if plan.parent[s][me] != PUBLISHER.peer_id)
    per_chunk = {p: CHUNK / 65e6 for p in core._members.uploads}
    per_chunk[lagging] = CHUNK / lagging_bps
    per_chunk[PUBLISHER.peer_id] = CHUNK / (ORIGIN_BPS / plan.stripes)  # (its pacing: the queue it reports)
    drops: list[SourceDropped] = []
    t = 0.0
    while pending:
        fetch = pending.pop(0)
        t += 0.01
        out = core.fetched(t, fetch.peer, 1, fetch.index, per_chunk[fetch.peer], 0.0)
        drops += [e.event for e in out if isinstance(getattr(e, "event", None), SourceDropped)]
        pending += [e for e in out if isinstance(e, Fetch)]
    assert core._versions[1].complete
    assert [(d.peer, d.why) for d in drops] == ([(lagging, DropReason.SLOW)] if dropped else [])


@pytest.mark.parametrize("origin_sends_bps, lagging_bps, dropped", [
    (ORIGIN_BPS, 5e6, False),  # the capped origin feeds every stripe 0.43 MB/s: the root forwards all it gets
    (ORIGIN_BPS, 4e4, True),  # a root under a tenth of that feed
    (RELAY_BPS, 5e6, True),  # under an origin that sends what it advertises, a root at 5 MB/s among 65 MB/s
])
def test_a_root_is_judged_against_what_an_origin_advertising_the_default_sent_us(origin_sends_bps, lagging_bps,
                                                                                  dropped):
    """The origin advertises the default 1 GB/s (it has not measured its upload yet) and times as
    fast: each of its chunks takes a millisecond's bytes and, within its burst, no queue, so the
    rate we measure of it (a window of requests) says nothing of its uplink. Each source answers
    our requests one after another, in time at what it is fed; our clock times each chunk at its
    bytes (65 MB/s; the lagging root's `lagging_bps`: the noise real relays logged, 4.5 MB/s to
    1.4 GB/s). Real relays under such an origin on a 3 MB/s uplink (7 of them, 24 MiB) dropped a
    root 1-3 times each in its first version, every drop judged against the plan's share of the
    stripe (`_short_of_plan`) with the origin timed at 50 MB/s to 1.2 GB/s over 4-12 chunks: 1.50
    copies from the origin and 11.9 s instead of 1.00 and 7.8 s. Now the feed is also what the
    origin sent us of our own stripe over the time it took (`_count_feed`): kept at 5 MB/s, while
    a root at 40 KB/s is dropped, and one at 5 MB/s under an origin that sends at 1 GB/s too."""
    core, pending = _relay(RELAY_BPS)
    plan = core._versions[1].plan
    me, origin = core.self_id, PUBLISHER.peer_id
    lagging = next(plan.parent[s][me] for s in range(plan.stripes) if plan.parent[s][me] != origin)
    fed_bps = min(origin_sends_bps / plan.stripes, 65e6)  # each stripe, as the origin sends it to its root
    sends = {p: CHUNK / fed_bps for p in core._members.uploads}  # each answer's time, one after another
    sends[lagging] = CHUNK / min(fed_bps, lagging_bps)
    timed = {p: CHUNK / 65e6 for p in core._members.uploads}  # what our clock makes of its bytes
    timed[lagging], timed[origin] = CHUNK / lagging_bps, CHUNK / 1e9
    free = dict.fromkeys(sends, 0.0)
    due: list[tuple[float, int, str, int]] = []

    def ask(now: float, fetches: list[Fetch]) -> None:
        for fetch in fetches:
            free[fetch.peer] = max(free[fetch.peer], now) + sends[fetch.peer]
            heapq.heappush(due, (free[fetch.peer], fetch.index, fetch.peer, fetch.index))

    ask(0.0, pending)
    drops: list[SourceDropped] = []
    while due:
        t, _, peer, index = heapq.heappop(due)
        out = core.fetched(t, peer, 1, index, timed[peer], 0.0)
        drops += [e.event for e in out if isinstance(getattr(e, "event", None), SourceDropped)]
        ask(t, [e for e in out if isinstance(e, Fetch)])
    assert core._versions[1].complete
    assert [(d.peer, d.why) for d in drops] == ([(lagging, DropReason.SLOW)] if dropped else [])


def _serve(core: TransferCore, pending: list[Fetch], sends_bps: dict[str, float], timed_bps: dict[str, float],
           late_s: dict[str, float], burst_chunks: int = 0,
           replan: tuple[float, Membership, dict[str, float]] | None = None,
           drop_times: list[float] | None = None) -> list[SourceDropped]:
    """Answer the core's fetches of version 1 until it holds every chunk: each source answers our
    requests of each stripe one after another, each `late_s` late at first, its first
    `burst_chunks` there at once (its burst) and then at `sends_bps` (what it is fed), while our
    clock times each chunk's bytes at `timed_bps`; `replan`: when the membership changes, to
    what, and how our clock times sources from then on. The drops as slow, in order (and their
    times, into `drop_times`)."""
    stripe_of = core._versions[1].plan.stripe_of_chunk
    free: dict[tuple[str, int], float] = {}
    answered: dict[tuple[str, int], int] = {}
    due: list[tuple[float, int, str]] = []

    def ask(now: float, fetches: list[Fetch]) -> None:
        for fetch in fetches:
            link = (fetch.peer, stripe_of[fetch.index])
            answered[link] = answered.get(link, 0) + 1
            step = 1e-4 if answered[link] <= burst_chunks else CHUNK / sends_bps[fetch.peer]
            free[link] = max(free.get(link, late_s.get(fetch.peer, 0.0)), now) + step
            heapq.heappush(due, (free[link], fetch.index, fetch.peer))

    ask(0.0, pending)
    drops: list[SourceDropped] = []
    while due:
        t, index, peer = heapq.heappop(due)
        if replan is not None and t >= replan[0]:
            out = core.set_members(t, replan[1])
            timed_bps = {**timed_bps, **replan[2]}
            replan, stripe_of = None, core._versions[1].plan.stripe_of_chunk
            ask(t, [e for e in out if isinstance(e, Fetch)])
        out = core.fetched(t, peer, 1, index, CHUNK / timed_bps[peer], 0.0)
        dropped = [e.event for e in out if isinstance(getattr(e, "event", None), SourceDropped)]
        drops += dropped
        if drop_times is not None:
            drop_times += [t] * len(dropped)
        ask(t, [e for e in out if isinstance(e, Fetch)])
    assert core._versions[1].complete
    return drops


@pytest.mark.parametrize("origin_sends_bps, lagging_bps, late_s, burst_s, dropped", [
    (ORIGIN_BPS, 5e6, 0.0, 1.0, False),  # a capped origin's first second sent at once: its feed is no faster
    (ORIGIN_BPS, 5e6, 1.0, 1.0, False),
    (ORIGIN_BPS, 1.3e6, 5.0, 1.0, False),
    (ORIGIN_BPS, 4e4, 1.0, 1.0, True),
    (RELAY_BPS, 5e6, 1.0, 0.0, True),  # every first answer a second late: the origin sends fast once it does
    (RELAY_BPS, 1e6, 5.0, 0.0, True),
    (RELAY_BPS, 1e6, 1.0, 1.0, True),
])
def test_the_feed_is_timed_from_the_origin_s_first_chunk_and_its_burst_left_out(origin_sends_bps, lagging_bps, late_s,
                                                                                 burst_s, dropped):
    """The origin advertises the default 1 GB/s, every source's first answer to us comes `late_s`
    late (our dials; a held send) and the origin sends each root its first `burst_s` seconds of
    its stripe at once (an uplink's burst, as our upload budget's: `relay.serving.ByteBudget`).
    Timed from taking the version in, the late start read as a slow feed, and a root at 1-5 MB/s
    among roots at 65 MB/s under an origin sending 1 GB/s was kept; timed from our first
    request's arrival, a capped origin's burst read 2.7-3.3 MB/s for a stripe fed at 0.43 and
    real relays dropped roots again (11.1 s, 1.41 copies). Now the late start is left out (timed
    from the origin's first chunk) and so is the burst (counted as a second of the feed, until
    the latest chunks came past it: then they time the feed)."""
    core, pending = _relay(RELAY_BPS)
    plan = core._versions[1].plan
    me, origin = core.self_id, PUBLISHER.peer_id
    lagging = next(plan.parent[s][me] for s in range(plan.stripes) if plan.parent[s][me] != origin)
    fed_bps = min(origin_sends_bps / plan.stripes, 65e6)
    sends = {p: fed_bps for p in core._members.uploads}
    sends[lagging] = min(fed_bps, lagging_bps)
    timed = {p: 65e6 for p in core._members.uploads}
    timed[lagging], timed[origin] = lagging_bps, 1e9
    burst = int(burst_s * fed_bps / CHUNK) if lagging_bps >= fed_bps else 0  # (a root slower than its feed has none)
    drops = _serve(core, pending, sends, timed, dict.fromkeys(sends, late_s), burst)
    assert [(d.peer, d.why) for d in drops] == ([(lagging, DropReason.SLOW)] if dropped else [])


@pytest.mark.parametrize("lagging_bps, dropped", [(1e5, True), (1.3e5, False)])
def test_past_the_origin_s_first_second_its_feed_is_timed_by_its_latest_chunks(lagging_bps, dropped):
    """The origin (advertising 1 GB/s) sends each stripe 0.43 MB/s with no burst, 16 MiB; a root
    keeps pace with it, but our clock times its chunks at `lagging_bps`. All the origin sent us
    over a second more than it took reads 0.36 MB/s at most, and kept a root at 0.1 MB/s (a
    window of requests under half the feed): past the first second the latest chunks time it."""
    core, pending = _relay(RELAY_BPS, mib=16)
    plan = core._versions[1].plan
    me, origin = core.self_id, PUBLISHER.peer_id
    lagging = next(plan.parent[s][me] for s in range(plan.stripes) if plan.parent[s][me] != origin)
    sends = {p: ORIGIN_BPS / plan.stripes for p in core._members.uploads}
    timed = {p: 65e6 for p in core._members.uploads}
    timed[origin], timed[lagging] = 1e9, lagging_bps
    drops = _serve(core, pending, sends, timed, {})
    assert [(d.peer, d.why) for d in drops] == ([(lagging, DropReason.SLOW)] if dropped else [])


@pytest.mark.parametrize("late_s, dropped", [(0.0, False), (3.0, True), (5.0, True)])
def test_the_feed_no_longer_excuses_a_root_once_our_stripe_is_long_whole(late_s, dropped):
    """The origin sends us our own stripe at 0.43 MB/s (9 chunks, whole after 1.4 s) and the
    other roots forward theirs at 65 MB/s; one root delivers us at 1 MB/s, from the start or
    `late_s` late. While our stripe is fed, that is twice its feed: kept. Once the origin sent
    us our last chunk longer ago than it took to send them all (1.2 s: from 2.6 s on), the other
    stripes are in the network too and nothing waits on the feed: judged against the plan,
    dropped (at 3 s, done by 3.6 s: kept with twice that time). The feed
    figure was kept to the end, and a root of the `--symmetric` world (1,000 relays) kept a
    parent at 12.72 MB/s against half of its 15 s old feed figure, 11.98, not of the plan's 12.88."""
    core, pending = _relay(RELAY_BPS)
    plan = core._versions[1].plan
    me, origin = core.self_id, PUBLISHER.peer_id
    lagging = next(plan.parent[s][me] for s in range(plan.stripes) if plan.parent[s][me] != origin)
    sends = {p: 65e6 for p in core._members.uploads}
    sends[origin], sends[lagging] = ORIGIN_BPS / plan.stripes, 1e6
    timed = {p: 65e6 for p in core._members.uploads}
    timed[origin], timed[lagging] = 1e9, 1e6
    drops = _serve(core, pending, sends, timed, {lagging: late_s})
    assert [(d.peer, d.why) for d in drops] == ([(lagging, DropReason.SLOW)] if dropped else [])


@pytest.mark.parametrize("lagging_bps, dropped", [(1.6e5, False), (4e4, True)])
def test_the_feed_of_a_relay_the_origin_feeds_two_stripes_is_per_stripe(lagging_bps, dropped):
    """The origin advertises 4 GB/s and sends 3 MB/s: 0.43 MB/s a stripe. It is our planned
    parent in two stripes (ours and one more, as a leaf), so it sends us 0.86 MB/s in all, but
    each stripe is fed half of that. A root our clock times at 0.16 MB/s (16 MiB; its long poll
    beyond our other sources') delivers a window of requests at more than half of its stripe's
    feed: kept; against both stripes' sum it was dropped. One at 40 KB/s is dropped."""
    core, pending = _relay(4e9, me=5, mib=16)
    plan = core._versions[1].plan
    me, origin = core.self_id, PUBLISHER.peer_id
    assert [s for s in range(plan.stripes) if plan.parent[s][me] == origin] == [0, 1]
    lagging = plan.parent[2][me]
    sends = {p: ORIGIN_BPS / plan.stripes for p in core._members.uploads}
    timed = {p: 65e6 for p in core._members.uploads}
    timed[origin], timed[lagging] = 1e9, lagging_bps
    drops = _serve(core, pending, sends, timed, {})
    assert [(d.peer, d.why) for d in drops] == ([(lagging, DropReason.SLOW)] if dropped else [])


@pytest.mark.parametrize("origin_late_s", [0.0, 2.0])
def test_a_root_is_not_judged_against_the_plan_while_the_origin_has_sent_us_nothing(origin_late_s):
    """The origin (advertising 1 GB/s, sending 3 MB/s) answers us `origin_late_s` late, while the
    other roots forward their stripes as the origin feeds them, one of them timed at 1.3 MB/s by
    our clock (three times its feed, a tenth of the others). Before the origin sent us anything
    we cannot tell its feed: the root is not judged against the plan meanwhile (it was dropped),
    and then kept against the feed."""
    core, pending = _relay(RELAY_BPS)
    plan = core._versions[1].plan
    me, origin = core.self_id, PUBLISHER.peer_id
    lagging = next(plan.parent[s][me] for s in range(plan.stripes) if plan.parent[s][me] != origin)
    sends = {p: ORIGIN_BPS / plan.stripes for p in core._members.uploads}
    timed = {p: 65e6 for p in core._members.uploads}
    timed[origin], timed[lagging] = 1e9, 1.3e6
    assert _serve(core, pending, sends, timed, {origin: origin_late_s}) == []


def test_chunks_the_origin_sends_us_in_place_of_a_dropped_root_are_no_feed():
    """Under the origin sending 3 MB/s (advertising 1 GB/s; 0.43 MB/s a stripe, 16 MiB), a root
    our clock times at 40 KB/s is dropped and the origin, its only replacement, sends us that
    stripe too. Those chunks are not its feed of our own stripe: another root, timed at 0.16
    MB/s, is kept, where counting them as our stripe's (0.86 MB/s) dropped it."""
    core, pending = _relay(RELAY_BPS, mib=16)
    plan = core._versions[1].plan
    me, origin = core.self_id, PUBLISHER.peer_id
    slow, lagging = [plan.parent[s][me] for s in range(plan.stripes) if plan.parent[s][me] != origin][:2]
    sends = {p: ORIGIN_BPS / plan.stripes for p in core._members.uploads}
    sends[slow] = 4e4
    timed = {p: 65e6 for p in core._members.uploads}
    timed[origin], timed[slow], timed[lagging] = 1e9, 4e4, 1.6e5
    drops = _serve(core, pending, sends, timed, {})
    assert [(d.peer, d.why) for d in drops] == [(slow, DropReason.SLOW)]


def test_a_replan_counts_the_feed_afresh():
    """A relay leaves at 1.5 s (16 MiB, the origin sending 3 MB/s and advertising 1 GB/s): the
    replan deals 6 stripes, and the origin feeds us our stripe under another number. From then
    on our clock times a root at 40 KB/s: dropped while our stripe is still fed. With the
    chunks of the new plan's stripe counted on the old plan's count, the figure read as none
    until the origin's feed ended, and the root was dropped only then."""
    core, pending = _relay(RELAY_BPS, mib=16)
    members, origin = core._members, PUBLISHER.peer_id
    sends = {p: ORIGIN_BPS / 6 for p in members.uploads}
    timed = {p: 65e6 for p in members.uploads}
    timed[origin] = 1e9
    left = Membership.of({p: u for p, u in members.uploads.items() if p != "r6"})
    times: list[float] = []
    drops = _serve(core, pending, sends, timed, {}, replan=(1.5, left, {"r2": 4e4}), drop_times=times)
    plan = core._versions[1].plan
    assert plan.stripes == 6 and plan.parent[0][core.self_id] == "r2"
    assert [(d.peer, d.why) for d in drops] == [("r2", DropReason.SLOW)]
    assert times[0] < core._versions[1].feed.latest[-1][0]  # (the origin's last chunk of our stripe)


def test_the_origin_serving_us_a_dropped_root_s_stripe_keeps_no_stale_feed():
    """The origin sends us our own stripe at 0.43 MB/s (whole after 1.4 s); a root our clock
    times at 40 KB/s is dropped at 4.9 s and the origin, its only replacement, serves us that
    stripe until 6.1 s. Another root delivers us at 1 MB/s from 5 s on, while the origin serves
    that stripe: our own stripe's feed is long over (we wait on none of it), so that root is judged
    against the plan and dropped (5.2 s); with the origin's requests in any stripe counted as
    waiting on the feed, its 0.43 MB/s excused it to the end."""
    core, pending = _relay(RELAY_BPS)
    plan = core._versions[1].plan
    me, origin = core.self_id, PUBLISHER.peer_id
    slow, lagging = [plan.parent[s][me] for s in range(plan.stripes) if plan.parent[s][me] != origin][:2]
    sends = {p: 65e6 for p in core._members.uploads}
    sends[origin], sends[slow], sends[lagging] = ORIGIN_BPS / plan.stripes, 4e4, 1e6
    timed = {p: 65e6 for p in core._members.uploads}
    timed[origin], timed[slow], timed[lagging] = 1e9, 4e4, 1e6
    drops = _serve(core, pending, sends, timed, {lagging: 5.0})
    assert [(d.peer, d.why) for d in drops] == [(slow, DropReason.SLOW), (lagging, DropReason.SLOW)]


def _fed_unevenly(core: TransferCore, pending: list[Fetch], fed_at: dict[int, float], slow: str,
                  slow_root: str | None, held_bps: float = 5e4,
                  judged_at: dict[str, float] | None = None) -> list[SourceDropped]:
    """Serve version 1 to `core` (its first fetches `pending`) on fast links, the origin having
    sent each chunk (to its root, or to us in our stripe) at `fed_at[index]`: every root forwards
    a chunk as soon as it has it (its bytes at 65 MB/s), so the time beyond that is its long poll
    on the origin, which its report of its queue leaves out. Parent `slow` instead sends its bytes
    at 40 KB/s (`slow_root` "bytes": its own uplink), or holds each chunk it was fed and sends us
    one every 1.3 s (`held_bps`, 50 KB/s, "held"), telling the wait as its long poll. The sources
    dropped (and into `judged_at`, when each was first judged slow, requests outstanding at it or
    not)."""
    origin = PUBLISHER.peer_id
    due: list[tuple[float, int, str, float, float]] = []
    sent = dict.fromkeys(core._members.uploads, 0.0)  # when each source last sent us a chunk

    def ask(now: float, fetches: list[Fetch]) -> None:
        for fetch in fetches:
            at = max(now, fed_at[fetch.index])
            if slow_root == "held" and fetch.peer == slow:
                at = sent[slow] = max(at, sent[slow] + CHUNK / held_bps)
            bytes_s = CHUNK / (4e4 if slow_root == "bytes" and fetch.peer == slow else 65e6)
            unexplained = 0.0 if fetch.peer == origin else at - now  # (the origin's pace: its upload slot)
            elapsed = bytes_s + (at - now if fetch.peer == origin else 0.0)
            heapq.heappush(due, (at + bytes_s, fetch.index, fetch.peer, elapsed, unexplained))

    ask(0.0, pending)
    drops: list[SourceDropped] = []
    while due:
        t, index, peer, elapsed, unexplained = heapq.heappop(due)
        out = core.fetched(t, peer, 1, index, elapsed, unexplained)
        drops += [e.event for e in out if isinstance(getattr(e, "event", None), SourceDropped)]
        if judged_at is not None and peer in core._slow:
            judged_at.setdefault(peer, t)
        ask(t, [e for e in out if isinstance(e, Fetch)])
    assert core._versions[1].complete
    return drops


@pytest.mark.parametrize("ours_fast, slow_root", [(False, None), (False, "bytes"), (False, "held"), (True, None)])
def test_an_origin_feeding_its_stripes_unevenly_has_no_honest_root_dropped(ours_fast, slow_root):
    """The origin (advertising 1 GB/s, sending 3 MB/s, 16 MiB) splits its uplink unevenly, as a
    trainer under a tbf did in the lab (`tests/relay/test_lab_capped_origin.py`): three stripes
    at 0.8 MB/s each until they are whole (3 s), the other four, our own among them, at 0.15 MB/s;
    then our own stripe at 1.5 MB/s and the other three at 0.5 MB/s each. Judged against what the
    origin sent us of our own stripe lately (1.5 MB/s), the roots of the three stripes it still
    fed at 0.5 were dropped as slow once the fast ones were whole, and the origin served their
    stripes to us; now no root is dropped. So too where our own stripe is a fourth fast one
    (`ours_fast`: whole by 3 s, and from 6 s the figure is none, the rest judged against the
    plan). A root slow in its bytes, or holding its chunks (`_fed_unevenly`), is still dropped:
    its stripe's feed keeps pace with the other slow stripes', and its wait beyond theirs counts."""
    core, pending = _relay(RELAY_BPS, mib=16)
    v = core._versions[1]
    plan = v.plan
    me, origin = core.self_id, PUBLISHER.peer_id
    ours = next(s for s in range(plan.stripes) if plan.parent[s][me] == origin)
    fast = ([ours] if ours_fast else []) + [s for s in range(plan.stripes) if s != ours][:3]
    slow = plan.parent[next(s for s in range(plan.stripes) if s != ours and s not in fast)][me]
    chunks = [[i for i in range(v.count) if plan.stripe_of_chunk[i] == s] for s in range(plan.stripes)]
    whole_s = max(len(chunks[s]) for s in fast) * CHUNK / 0.8e6
    fed_at: dict[int, float] = {}
    for s in range(plan.stripes):
        t = 0.0
        for index in chunks[s]:
            bps = 0.8e6 if s in fast else 0.15e6 if t < whole_s else 1.5e6 if s == ours else 0.5e6
            t += CHUNK / bps
            fed_at[index] = t
    drops = _fed_unevenly(core, pending, fed_at, slow, slow_root)
    assert [(d.peer, d.why) for d in drops] == ([(slow, DropReason.SLOW)] if slow_root else [])


@pytest.mark.parametrize("slow_root", [None, "held"])
def test_a_stripe_the_origin_starves_while_it_feeds_the_others_has_its_root_kept(slow_root):
    """The origin (advertising 1 GB/s, sending 3 MB/s, 16 MiB) sends one stripe's first chunk at
    0.5 s and the rest of it only once the other six are whole (4.9 s, at 0.5 MB/s each), then at
    its whole 3 MB/s (whole by 5.7 s), as a trainer under a tbf did in the lab
    (`tests/relay/test_lab_capped_origin.py`: a stripe's root had its second chunk at 4.2 s, the
    others theirs by 0.3 s). Its children time each chunk of it 4 s late, no root we know of waits
    as long, and its root was dropped on the base code and excused only as far as our other
    roots' waits (or twice them); now, while the origin still feeds us (our own stripe's end and
    as long again: `relay.judging`, `_origin_feeds_us`), a root is judged on what it served when
    it had the chunk (`_served_rates`), and it is kept. A root that holds each chunk it was fed
    (`_fed_unevenly`, "held", 50 KB/s) is kept as long, and dropped after: its waits count then."""
    core, pending = _relay(RELAY_BPS, mib=16)
    v = core._versions[1]
    plan = v.plan
    me, origin = core.self_id, PUBLISHER.peer_id
    starved = next(s for s in range(plan.stripes) if plan.parent[s][me] != origin)
    chunks = [[i for i in range(v.count) if plan.stripe_of_chunk[i] == s] for s in range(plan.stripes)]
    even_bps = ORIGIN_BPS / (plan.stripes - 1)
    fed_at = {index: (n + 1) * CHUNK / even_bps for s in range(plan.stripes) if s != starved
              for n, index in enumerate(chunks[s])}
    others_whole_s = max(fed_at.values())
    fed_at |= {index: 0.5 if n == 0 else others_whole_s + n * CHUNK / ORIGIN_BPS for n, index in enumerate(chunks[starved])}
    slow = plan.parent[starved][me]
    drops = _fed_unevenly(core, pending, fed_at, slow, slow_root)
    assert [(d.peer, d.why) for d in drops] == ([(slow, DropReason.SLOW)] if slow_root else [])
