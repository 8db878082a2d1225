"""A stripe's root is judged against what the origin feeds its stripe (`relay.sources`,
`_stripe_feed_bps`): under an origin whose upload is capped, a root that forwards faster than the
origin feeds it is kept, and one far slower than that is still dropped. The transfer core alone;
`tests/relay/test_capped_origin_processes.py` shows the same with real relay processes."""

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


def _relay(origin_advertised_bps: float = ORIGIN_BPS) -> tuple[TransferCore, list[Fetch]]:
    """One of 7 relays under the capped origin (a stripe each, every root its stripe's only
    forwarder), the origin advertising `origin_advertised_bps`: its core and first fetches of a
    4 MiB version in 64 KiB chunks."""
    relays = [f"r{i}" for i in range(7)]
    members = Membership.of({PUBLISHER.peer_id: origin_advertised_bps, **dict.fromkeys(relays, RELAY_BPS)})

    def opener(frame: bytes, now: float):
        return open_manifest(frame, trusted_publishers={PUBLISHER.peer_id}, now_s=EPOCH_S + now)

    core = TransferCore(CONFIG, relays[0], open_frame=opener, self_upload_bps=RELAY_BPS)
    core.set_members(0.0, members)
    signed = fake_manifest(PUBLISHER, 4 * 2**20, CHUNK)
    announce = Envelope(ManifestAnnounce.KIND, PUBLISHER.peer_id, b"", 0, ManifestAnnounce(signed.frame), 0)
    pending = [e for e in core.on_message(0.0, announce) if isinstance(e, Fetch)]
    plan = core._versions[1].plan
    assert plan.stripes == 7 and all(len(plan.ranked_interior(s)) == 1 for s in range(7))
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
