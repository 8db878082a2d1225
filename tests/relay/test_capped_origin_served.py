"""Which parents are judged on their bytes' time alone (`relay.judging`, `_delivers_too_little`:
`_served_rates`, their long poll left out), and until when: a stripe's root, under an origin that
feeds a stripe under half its planned share, while the origin still feeds us (`_origin_feeds_us`:
while we wait on it in our own stripe, and until our own stripe's end and as long again). A root
under an origin that feeds the stripes at the plan's pace, and a parent that is no root, are
judged on their rate, their waits counted; a root holding its chunks is dropped at the horizon.
The transfer core alone, in virtual time; the worlds of `tests/relay/test_capped_origin_sources.py`
(`_relay`, `_fed_unevenly`)."""

import pytest

from relay.effects import DropReason
from relay.transfer import TransferCore
from tests.relay.test_capped_origin_sources import CHUNK, ORIGIN_BPS, PUBLISHER, RELAY_BPS, _fed_unevenly, _relay


def _fed_evenly(core: TransferCore, origin_bps: float) -> dict[int, float]:
    """When the origin, sending `origin_bps` in all, sends each chunk of version 1 (to its stripe's
    root, or to us in our stripe): every stripe at its share, from 0 s."""
    v = core._versions[1]
    plan = v.plan
    fed_at: dict[int, float] = {}
    for s in range(plan.stripes):
        chunks = [i for i in range(v.count) if plan.stripe_of_chunk[i] == s]
        fed_at |= {index: (n + 1) * CHUNK * plan.stripes / origin_bps for n, index in enumerate(chunks)}
    return fed_at


@pytest.mark.parametrize("slow_root", [None, "held"])
def test_a_root_under_an_origin_feeding_the_stripes_at_the_plans_pace_is_judged_on_its_waits(slow_root):
    """Relays on home links (advertising 4 MB/s: a stripe's planned share 0.55 MB/s a member)
    under an origin that advertises and sends 3 MB/s (0.43 MB/s a stripe, more than half that
    share): no capped origin, so a root that holds each chunk it was fed (50 KB/s, telling the wait
    as its long poll) is judged on its rate, its waits counted, and dropped while the origin still
    feeds us our own stripe (3.9 s; its last chunk there 5.7 s). Judged on its bytes' time there
    (`_served_rates`, whatever the origin's feed) it was kept until the horizon (`_origin_feeds_us`:
    our stripe's end and as long again; dropped at 11.8 s)."""
    core, pending = _relay(ORIGIN_BPS, mib=16, relay_bps=4e6)
    v = core._versions[1]
    plan = v.plan
    me, origin = core.self_id, PUBLISHER.peer_id
    assert ORIGIN_BPS / plan.stripes >= 0.5 * plan.capacity_bps[0] / len(core._members)  # (not capped)
    slow = next(plan.parent[s][me] for s in range(plan.stripes) if plan.parent[s][me] != origin)
    judged_at: dict[str, float] = {}
    drops = _fed_unevenly(core, pending, _fed_evenly(core, ORIGIN_BPS), slow, slow_root, judged_at=judged_at)
    assert [(d.peer, d.why) for d in drops] == ([(slow, DropReason.SLOW)] if slow_root else [])
    if slow_root:
        assert list(judged_at) == [slow] and judged_at[slow] < v.feed.latest[-1][0]  # (our stripe's last chunk)


@pytest.mark.parametrize("slow_parent", [None, "held"])
def test_a_parent_that_is_no_root_is_judged_on_its_waits_under_a_capped_origin(slow_parent):
    """20 relays, 16 stripes, 64 MiB, the origin sending 3 MB/s (advertising 1 GB/s): our parent in
    four stripes is the stripe's second interior member, its root's child, and the origin is our
    parent in our own stripe. One of those parents holds each chunk (20 KB/s, telling the wait as
    its long poll): it waits on no origin's feed, only on a root whose chunks come at the pace of
    the others', so it is judged on its rate, its waits counted, while the origin still feeds us:
    judged slow by its third chunk (9.8 s; our stripe is fed until 18.2 s). Judged on its bytes'
    time as a root is (`_served_rates`) it was kept until the horizon (judged slow at 36.1 s)."""
    core, pending = _relay(RELAY_BPS, mib=64, relays=20)
    v = core._versions[1]
    plan = v.plan
    me, origin = core.self_id, PUBLISHER.peer_id
    slow = plan.parent[0][me]
    assert plan.stripes == 16 and plan.parent[12][me] == origin and plan.parent[0][slow] != origin  # (no root)
    judged_at: dict[str, float] = {}
    _fed_unevenly(core, pending, _fed_evenly(core, ORIGIN_BPS), slow, slow_parent, 2e4, judged_at)
    if slow_parent:
        assert list(judged_at) == [slow] and judged_at[slow] < v.feed.latest[-1][0]  # (our stripe's last chunk)
    else:
        assert judged_at == {}


def test_a_root_holding_its_chunks_under_a_capped_origin_is_kept_until_the_horizon_and_dropped_at_it():
    """The origin sends 3 MB/s (advertising 1 GB/s), 0.43 MB/s a stripe, 16 MiB: our own stripe's
    first chunk comes at 0.15 s and its last at 5.66 s, so the origin feeds us until 11.17 s (its
    last chunk, and as long again: `_origin_feeds_us`). A root holding each chunk it was fed (50
    KB/s: one every 1.31 s) is judged on its bytes' time until then, kept, and dropped at the first
    chunk it sends us after it (11.8 s). Half that window dropped it at 9.2 s; twice it, at 17.0 s."""
    core, pending = _relay(RELAY_BPS, mib=16)
    v = core._versions[1]
    plan = v.plan
    me, origin = core.self_id, PUBLISHER.peer_id
    slow = next(plan.parent[s][me] for s in range(plan.stripes) if plan.parent[s][me] != origin)
    judged_at: dict[str, float] = {}
    drops = _fed_unevenly(core, pending, _fed_evenly(core, ORIGIN_BPS), slow, "held", 5e4, judged_at)
    assert [(d.peer, d.why) for d in drops] == [(slow, DropReason.SLOW)]
    first, end = v.feed.first_at, v.feed.latest[-1][0]
    horizon = end + (end - first)
    assert list(judged_at) == [slow] and horizon < judged_at[slow] <= horizon + CHUNK / 5e4


def test_a_root_is_judged_on_its_bytes_while_the_origin_starves_our_own_stripe():
    """The origin (advertising 1 GB/s, sending 3 MB/s, 16 MiB) sends our own stripe's first chunk
    at 0.5 s and the rest of it only once the others are whole (7.1 s), and another stripe's first
    chunk at 0.5 s and the rest from 2.5 s on, as fast as the others (0.5 MB/s). That stripe's
    root sends us each chunk as soon as it has it. Until 7.1 s we wait on the origin in our own
    stripe, longer than it took to send us what it sent there (one chunk): it still feeds us, so
    that root, timed 2 s late, is judged on its bytes' time and kept. With our wait not counted,
    our stripe's feed read as over at once (as fast as the plan), and that root was dropped at
    its third chunk (2.8 s)."""
    core, pending = _relay(RELAY_BPS, mib=16)
    v = core._versions[1]
    plan = v.plan
    me, origin = core.self_id, PUBLISHER.peer_id
    ours = next(s for s in range(plan.stripes) if plan.parent[s][me] == origin)
    late = next(s for s in range(plan.stripes) if s != ours)
    chunks = [[i for i in range(v.count) if plan.stripe_of_chunk[i] == s] for s in range(plan.stripes)]
    even_bps = ORIGIN_BPS / (plan.stripes - 1)
    fed_at = {index: (n + 1) * CHUNK / even_bps for s in range(plan.stripes) if s not in (ours, late)
              for n, index in enumerate(chunks[s])}
    fed_at |= {index: 0.5 if n == 0 else 2.5 + n * CHUNK / even_bps for n, index in enumerate(chunks[late])}
    others_whole_s = max(fed_at.values())
    fed_at |= {index: 0.5 if n == 0 else others_whole_s + n * CHUNK / ORIGIN_BPS for n, index in enumerate(chunks[ours])}
    judged_at: dict[str, float] = {}
    assert _fed_unevenly(core, pending, fed_at, plan.parent[late][me], None, judged_at=judged_at) == []
    assert judged_at == {}


@pytest.mark.parametrize("relay_bps, capped", [(4e6, False), (8e6, True)])
def test_an_origin_feeding_a_stripe_under_half_its_planned_share_is_capped(relay_bps, capped):
    """The world of the first test here, the relays advertising 4 or 8 MB/s: the origin's 0.43 MB/s
    a stripe is 0.77 or 0.41 of a stripe's planned share a member. Under half of it (8 MB/s) the
    origin is capped: the root holding each chunk it was fed is judged on its bytes' time until the
    horizon (our stripe's last chunk at 5.66 s, and as long again: 11.16 s), and dropped after it
    (11.8 s); over half (4 MB/s), on its rate, its waits counted, while the origin still feeds us
    (3.9 s). With a quarter of the share as the bound, it was dropped at 3.9 s under both."""
    core, pending = _relay(ORIGIN_BPS, mib=16, relay_bps=relay_bps)
    v = core._versions[1]
    plan = v.plan
    me, origin = core.self_id, PUBLISHER.peer_id
    share = plan.capacity_bps[0] / len(core._members)
    assert (ORIGIN_BPS / plan.stripes < 0.5 * share) == capped and ORIGIN_BPS / plan.stripes > 0.25 * share
    slow = next(plan.parent[s][me] for s in range(plan.stripes) if plan.parent[s][me] != origin)
    judged_at: dict[str, float] = {}
    drops = _fed_unevenly(core, pending, _fed_evenly(core, ORIGIN_BPS), slow, "held", judged_at=judged_at)
    assert [(d.peer, d.why) for d in drops] == [(slow, DropReason.SLOW)]
    first, end = v.feed.first_at, v.feed.latest[-1][0]
    assert list(judged_at) == [slow]
    assert judged_at[slow] > end + (end - first) if capped else judged_at[slow] < end


@pytest.mark.parametrize("slow_root", [None, "held"])
def test_a_root_that_is_not_its_stripe_s_only_forwarder_is_judged_on_its_bytes_under_a_capped_origin(slow_root):
    """The 20-relay world above, seen from r2, the root of stripe 7 (the origin its parent there):
    its parent in stripe 1 is that stripe's root, r10, which has a child of its own that forwards
    the stripe too (r17). r10 holds each chunk (20 KB/s, telling the wait as its long poll): a
    root, so under the capped origin it is judged on its bytes' time as a lone root is, until the
    horizon (our stripe's last chunk at 18.18 s, and as long again: 36.0 s), and judged slow after
    it (36.05 s). With only a lone root judged so, it was judged on its waits (9.83 s)."""
    core, pending = _relay(RELAY_BPS, mib=64, me=2, relays=20)
    v = core._versions[1]
    plan = v.plan
    me, origin = core.self_id, PUBLISHER.peer_id
    slow = plan.parent[1][me]
    assert plan.parent[7][me] == origin and plan.parent[1][slow] == origin and len(plan.ranked_interior(1)) == 2
    judged_at: dict[str, float] = {}
    _fed_unevenly(core, pending, _fed_evenly(core, ORIGIN_BPS), slow, slow_root, 2e4, judged_at)
    first, end = v.feed.first_at, v.feed.latest[-1][0]
    if slow_root:
        assert list(judged_at) == [slow] and judged_at[slow] > end + (end - first)
    else:
        assert judged_at == {}
