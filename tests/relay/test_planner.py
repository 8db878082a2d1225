"""The striped-tree planner: every member reachable in every stripe, balanced, deterministic."""

import random

import pytest

from relay.planner import Membership, lower_bound_s, plan_broadcast, plan_tree

ORIGIN = "origin"


def members(n: int, seed: int = 0, low: float = 12.5e6, high: float = 1.25e9) -> Membership:
    rng = random.Random(seed)
    uploads = {f"p{i:04d}": rng.uniform(low, high) for i in range(n)}
    uploads[ORIGIN] = 1.25e9
    return Membership.of(uploads)


@pytest.mark.parametrize("n,stripes,chunks", [(1, 8, 10), (5, 16, 40), (60, 8, 200), (300, 16, 64), (7, 4, 2)])
def test_every_member_has_a_parent_chain_to_the_origin_in_every_stripe(n, stripes, chunks):
    m = members(n)
    plan = plan_broadcast(ORIGIN, 1.25e9, m, chunks, stripes)
    peers = [p for p in m.uploads if p != ORIGIN]
    assert plan.stripes == max(1, min(stripes, n, chunks))
    for s in range(plan.stripes):
        assert set(plan.parent[s]) == set(peers)
        for p in peers:
            chain = plan.ancestors(s, p)
            assert chain[-1] == ORIGIN and p not in chain and len(chain) == len(set(chain))
        # fan-outs are respected
        counts: dict[str, int] = {}
        for parent in plan.parent[s].values():
            counts[parent] = counts.get(parent, 0) + 1
        assert all(counts[q] <= plan.fanout[s][q] for q in counts)


def test_each_member_forwards_in_at_most_one_stripe_and_parents_feed_children_at_the_stripe_rate():
    m = members(200, seed=3)
    plan = plan_broadcast(ORIGIN, 1.25e9, m, 256, 8)
    for p in m.uploads:
        if p == ORIGIN:
            continue
        forwarding = [s for s in range(plan.stripes) if plan.fanout[s].get(p, 0) > 0]
        assert forwarding in ([], [plan.home[p]])
    for s in range(plan.stripes):
        rate = plan.capacity_bps[s] / 200
        for p, f in plan.fanout[s].items():
            if f and p != ORIGIN:
                assert m.uploads[p] / f >= 0.8 * rate  # nobody is a slow parent
    caps = plan.capacity_bps
    assert max(caps) / min(caps) < 1.05  # LPT balances the stripes


def test_chunks_are_dealt_once_each_in_proportion_to_stripe_capacity():
    m = members(50, seed=1)
    plan = plan_broadcast(ORIGIN, 1.25e9, m, 400, 8)
    dealt = sorted(i for chunks in plan.chunks_of_stripe for i in chunks)
    assert dealt == list(range(400))
    total = sum(plan.capacity_bps)
    for s, chunks in enumerate(plan.chunks_of_stripe):
        assert abs(len(chunks) - 400 * plan.capacity_bps[s] / total) <= 1.5


def test_plans_are_deterministic_cached_and_depend_on_the_salt():
    a = plan_broadcast(ORIGIN, 1e9, members(40), 100, 8, salt=b"x")
    b = plan_broadcast(ORIGIN, 1e9, members(40), 100, 8, salt=b"x")
    assert a is b  # same membership contents: one plan, computed once
    uploads = {f"p{i}": 1e8 for i in range(40)} | {ORIGIN: 1e9}  # ties are broken by the salt
    c = plan_broadcast(ORIGIN, 1e9, Membership.of(uploads), 100, 8, salt=b"x")
    d = plan_broadcast(ORIGIN, 1e9, Membership.of(uploads), 100, 8, salt=b"y")
    assert c.home != d.home


def test_tree_baseline_has_fixed_fanout_and_star_is_flat():
    m = members(30)
    tree = plan_tree(ORIGIN, m, 10, 4)
    fan: dict[str, int] = {}
    for parent in tree.parent[0].values():
        fan[parent] = fan.get(parent, 0) + 1
    assert max(fan.values()) <= 4 and tree.stripes == 1
    star = plan_tree(ORIGIN, m, 10, 31)
    assert set(star.parent[0].values()) == {ORIGIN}


def test_lower_bound_is_the_larger_of_origin_and_aggregate_limits():
    assert lower_bound_s(1000, 10.0, [10.0] * 4) == pytest.approx(max(100, 4 * 1000 / 50))
    assert lower_bound_s(1000, 1.0, [1000.0] * 2) == pytest.approx(1000)
    assert lower_bound_s(1000, 1.0, []) == 0.0


def test_ranked_interior_lists_each_stripes_interior_by_depth_then_id():
    m = members(300, seed=4)
    plan = plan_broadcast(ORIGIN, 1.25e9, m, 64, 16)
    for s in range(plan.stripes):
        ranked = plan.ranked_interior(s)
        assert [p for p, _ in ranked] and sorted(p for p, _ in ranked) == plan.interior(s)
        assert all(d == plan.depth(s, p) for p, d in ranked)
        assert [(d, p) for p, d in ranked] == sorted((d, p) for p, d in ranked)


def test_members_that_cannot_be_dialled_are_never_parents():
    """Unreachable peers (behind NAT) are members with upload 0 (relay.role.serving_uploads):
    they get every chunk but no children, in every stripe."""
    uploads = {f"p{i}": 1e6 * (i + 1) for i in range(40)}
    nat = {f"p{i}" for i in range(0, 40, 3)}
    members = Membership.of({"origin": 5e6, **{p: (0.0 if p in nat else u) for p, u in uploads.items()}})
    plan = plan_broadcast("origin", 5e6, members, chunk_count=64, stripes=8)
    for s in range(plan.stripes):
        parents = set(plan.parent[s].values())
        assert not parents & nat
        assert set(plan.parent[s]) == set(uploads)  # everyone still gets the stripe
    alone = plan_broadcast("origin", 5e6, Membership.of({"origin": 5e6, "a": 0.0, "b": 0.0}), 8, 4)
    assert all(set(p.values()) == {"origin"} for p in alone.parent)  # nobody dialable: a star from the origin


def homogeneous(n: int) -> Membership:
    return Membership.of({ORIGIN: 1.25e8, **{f"p{i:04d}": 1.25e8 for i in range(n)}})


def test_stable_plans_use_fewer_stripes_when_chunks_per_stripe_would_be_few():
    m = homogeneous(1023)  # members alone would allow 16 stripes
    assert [plan_broadcast(ORIGIN, 1.25e8, m, c, 16, stable=True).stripes for c in (23, 64, 191, 192)] == \
        [1, 4, 8, 16]  # at least 12 chunks per stripe
    assert plan_broadcast(ORIGIN, 1.25e9, members(1000), 239, 16, stable=True).stripes == 16  # 15 chunks each


def test_stable_stripes_whose_fan_outs_waste_capacity_get_fewer_chunks():
    plan = plan_broadcast(ORIGIN, 1.25e8, homogeneous(1023), 64, 4, stable=True)
    assert sorted(i for chunks in plan.chunks_of_stripe for i in chunks) == list(range(64))
    widest = []
    for s in range(plan.stripes):
        counts: dict[str, int] = {}
        for parent in plan.parent[s].values():
            if parent != ORIGIN:
                counts[parent] = counts.get(parent, 0) + 1
        widest.append(max(counts.values()))
    # hashed home stripes: some have too few members for fan-out 4 and need 5 (each chunk then
    # takes 5 chunk times per hop there, not 4); they get fewer chunks
    assert sorted(set(widest)) == [4, 5]
    assert max(len(plan.chunks_of_stripe[s]) for s in range(4) if widest[s] == 5) < \
        min(len(plan.chunks_of_stripe[s]) for s in range(4) if widest[s] == 4)
    # fast members feeding dozens waste almost nothing: every stripe alike, equal shares
    mixed = plan_broadcast(ORIGIN, 1.25e9, members(1000, seed=2), 239, 16, stable=True)
    assert {len(c) for c in mixed.chunks_of_stripe} == {14, 15}


def test_views_that_each_miss_a_hundredth_agree_on_every_chunk_of_a_homogeneous_plan():
    """Equal uploads, 1,023 members, 256 chunks in 16 stripes: every stripe weighs the same, so
    two views that each miss a different 1% put every chunk in the same stripe (a rule that dealt
    chunks by fan-out moved 9 of 256 on average and cost 25x the optimum, review 6), while a
    forwarder there still serves all its children at once (`small_fanouts`)."""
    import random

    rng = random.Random(1)
    full = {ORIGIN: 1.25e8, **{f"p{i:04d}": 1.25e8 for i in range(1023)}}
    ids = [p for p in full if p != ORIGIN]
    plans = [plan_broadcast(ORIGIN, 1.25e8, Membership.of({p: u for p, u in full.items() if p not in gone}), 256, 16,
                            stable=True) for gone in (set(rng.sample(ids, 10)) for _ in range(6))]
    assert all(p.stripes == 16 and p.small_fanouts for p in plans)
    assert {p.stripe_of_chunk for p in plans} == {plans[0].stripe_of_chunk}


@pytest.mark.parametrize("n,chunks", [(293, 96), (364, 128), (429, 200), (1023, 64)])
def test_one_member_more_or_less_never_reshuffles_a_stable_plan(n, chunks):
    """Views on either side of a stripe's fan-out threshold (one member decides whether it wastes
    capacity) still agree on all but a few chunks per stripe: the weights change stripe by
    stripe and every stable plan deals chunks the same way."""
    full = {ORIGIN: 1.25e8, **{f"p{i:04d}": 1.25e8 for i in range(n)}}
    a = plan_broadcast(ORIGIN, 1.25e8, Membership.of(full), chunks, 16, stable=True)
    for gone in [f"p{i:04d}" for i in range(0, n, max(1, n // 12))] + ["p0218"]:
        if gone not in full:
            continue
        b = plan_broadcast(ORIGIN, 1.25e8, Membership.of({p: u for p, u in full.items() if p != gone}),
                           chunks, 16, stable=True)
        if a.stripes != b.stripes:
            continue
        moved = sum(x != y for x, y in zip(a.stripe_of_chunk, b.stripe_of_chunk))
        assert moved <= max(2 * a.stripes, chunks // 8), (gone, moved)  # was most of them


def test_stable_chunk_stripes_barely_move_when_one_member_is_missing_from_a_view():
    full = homogeneous(1023)
    a = plan_broadcast(ORIGIN, 1.25e8, full, 64, 16, stable=True)
    assert len({len(c) for c in a.chunks_of_stripe}) > 1  # weighted: not chunk i in stripe i mod K
    assert sorted(a.stripe_of_chunk[:16]) != sorted(a.stripe_of_chunk[16:32])  # nor in runs
    for gone in ("p0123", "p0500", "p0999"):
        missing = Membership.of({p: u for p, u in full.uploads.items() if p != gone})
        b = plan_broadcast(ORIGIN, 1.25e8, missing, 64, 16, stable=True)
        assert a.stripes == b.stripes and dict(a.home) == {**b.home, gone: a.home[gone]}
        moved = sum(x != y for x, y in zip(a.stripe_of_chunk, b.stripe_of_chunk))
        assert moved <= 4  # a few of 64: a stripe boundary moves by the change in the counts before it


def test_a_membership_serves_as_another_when_only_figures_differ():
    """`Membership.serves_as` (kept per pair): the same members, and the same of them with an
    upload > 0; asked twice, either way round, the same answer."""
    base = Membership.of({"a": 1e8, "b": 2e8, "c": 0.0})
    cases = [(Membership.of({"a": 5e8, "b": 1e6, "c": 0.0}), True),
             (Membership.of({"a": 1e8, "b": 0.0, "c": 0.0}), False),
             (Membership.of({"a": 1e8, "b": 2e8, "c": 1e8}), False),
             (Membership.of({"a": 1e8, "b": 2e8}), False),
             (Membership.of({"a": 1e8, "b": 2e8, "c": 0.0, "d": 0.0}), False)]
    for other, same in cases * 2:
        assert base.serves_as(other) is same and other.serves_as(base) is same


@pytest.mark.parametrize("stable", [False, True])
def test_stable_plans_give_the_slowest_leaves_the_shallowest_free_slots(stable):
    # a relay's download grows with its upload: the slowest need every stripe fed from the start
    # by parents that hold it early, not the deepest, slowest interior members' late copies. Plans
    # dealt by capacity (under 64 members, the striped-v1 baseline) keep the fastest leaves first:
    # there the rule made striped-v1 1.7x slower
    m = members(2000, seed=5, low=12.5e6, high=1.25e9)
    plan = plan_broadcast(ORIGIN, 1.25e9, m, 256, 16, stable=stable)
    for s in range(plan.stripes):
        leaves = sorted((m.uploads[p], p) for p in plan.parent[s] if plan.home[p] != s)
        if not stable:
            leaves.reverse()
        depths = [plan.depth(s, p) for _, p in leaves]
        assert depths == sorted(depths) and depths[0] < depths[-1]
        first_parent, last_parent = plan.parent[s][leaves[0][1]], plan.parent[s][leaves[-1][1]]
        assert m.uploads[first_parent] > m.uploads[last_parent]


@pytest.mark.parametrize("n", [64, 96, 128])
def test_the_origins_spare_slots_go_to_the_fastest_leaves(n):
    # with a fast origin a stable plan's origin has slots left after the interior members; a slow
    # leaf there would drain an origin slot at its own download's pace in every stripe. (Planned
    # at most at the cap times the median, the origin has spare slots only where few members
    # serve: here 30% of them, the others advertise no upload)
    rng = random.Random(3)
    m = Membership.of({f"p{i:04d}": rng.uniform(12.5e6, 1.25e8) if i < 0.3 * n else 0.0 for i in range(n)}
                      | {ORIGIN: 5e9})
    plan = plan_broadcast(ORIGIN, 5e9, m, 256, 16, stable=True)
    spared = 0
    for s in range(plan.stripes):
        leaves = {p: m.uploads[p] for p in plan.parent[s] if plan.home[p] != s}
        under_origin = [u for p, u in leaves.items() if plan.parent[s][p] == ORIGIN]
        others = [u for p, u in leaves.items() if plan.parent[s][p] != ORIGIN]
        spared += len(under_origin)
        if under_origin and others:
            assert min(under_origin) >= max(others)  # (equal only among those advertising 0)
    assert spared  # the case exists at these sizes


@pytest.mark.parametrize("upload", [float("nan"), float("inf"), -1.0])
def test_a_membership_refuses_an_upload_no_peer_can_have(upload):
    with pytest.raises(ValueError, match="p1"):
        Membership.of({"p0": 1e6, "p1": upload})
