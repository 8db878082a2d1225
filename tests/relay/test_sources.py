"""Substitute parents (`relay.sources.SourceChoice._substitute`): the kept order by rendezvous
score picks exactly the member a plain scan of the stripe's ranked interior picks."""

import math
import random

import blake3

from relay.planner import Membership, plan_broadcast
from relay.transfer import TransferConfig, TransferCore

CONFIG = TransferConfig(stall_timeout_s=2.0, exclude_s=6.0, announce_interval_s=3600.0)


def reference_substitute(core, now, plan, stripe, below, lost=None, skip=None, avoid=(), strict=True):
    """The scan `_substitute` did before it kept an order: every member ranked before `below`,
    one hash each, the first strictly highest score wins."""
    uploads = core._members.uploads
    best, best_score = None, -1.0
    for peer, depth in plan.ranked_interior(stripe):
        if below is not None and (depth, peer) >= below:
            break
        if peer == skip or peer in avoid or not core._usable(now, peer) or \
                (strict and not core._healthy_above(now, plan, stripe, peer, lost)):
            continue
        draw = int.from_bytes(blake3.blake3(f"{core.self_id}/{stripe}/{peer}".encode()).digest(8), "big")
        score = uploads.get(peer, 1.0) / (1 + depth) / -math.log((draw + 1) / (2**64 + 1))
        if score > best_score:
            best, best_score = peer, score
    return best


def _world(rng: random.Random, members: int):
    uploads = {f"p{i:04d}": rng.choice([1e7, 5e7, 1e8, 1e8, 3e8]) for i in range(members)}
    uploads["origin"] = 1e9
    plan = plan_broadcast("origin", 1e9, Membership.of(uploads), rng.choice([40, 200, 400]), 16,
                          salt=rng.randbytes(4), stable=rng.random() < 0.5)
    return uploads, plan


def test_the_kept_order_picks_what_a_scan_of_the_ranked_interior_picks():
    """Random plans, exclusions, bans and arguments; our membership sometimes differs from the
    plan's (members missing from it weigh 1.0, members at upload 0 tie at score 0, and a tie
    goes to the first in ranked order), and changes under a kept order."""
    rng = random.Random(15)
    compared = picked = ties = 0
    for world in range(12):
        uploads, plan = _world(rng, rng.choice([70, 300, 700]))
        peers = sorted(uploads)
        me = rng.choice(peers[:-1])
        core = TransferCore(CONFIG, me, open_frame=lambda frame, now: None, self_upload_bps=uploads[me])
        for phase in range(3):
            view = dict(uploads)
            if phase > 0:  # our membership is not the plan's: zero (ties), drop (weight 1.0), rescale
                for p in rng.sample(peers, len(peers) // 3):
                    view[p] = rng.choice([0.0, 0.0, 2e8]) if rng.random() < 0.7 else view.pop(p)
                view[me] = uploads[me]
            core.set_members(0.0, Membership.of(view))
            core._excluded = {p: rng.uniform(0.0, 20.0) for p in rng.sample(peers, len(peers) // 5)}
            core._banned = set(rng.sample(peers, len(peers) // 50))
            for _ in range(60):
                now = rng.uniform(0.0, 20.0)
                stripe = rng.randrange(plan.stripes)
                ranked = plan.ranked_interior(stripe)
                chain = plan.ancestors(stripe, me)
                if rng.random() < 0.7 and ranked:
                    depth, peer = rng.choice([(d, p) for p, d in ranked] + [(len(chain), me)])
                    below = (depth + rng.choice([0, 0, 1]), peer)
                else:
                    below = None
                lost = rng.choice([None, *chain[:1], *rng.sample(peers, 1)])
                skip = rng.choice([None, *(p for p, _ in ranked[:3])])
                avoid = set(rng.sample(peers, rng.choice([0, 1, 5])))
                strict = rng.random() < 0.6
                args = (now, plan, stripe, below, lost, skip, avoid, strict)
                want = reference_substitute(core, *args)
                assert core._substitute(*args) == want, (world, phase, args)
                compared += 1
                picked += want is not None
                ties += want is not None and view.get(want, 1.0) == 0.0
    assert compared == 12 * 3 * 60 and picked > compared // 2 and ties > 0
