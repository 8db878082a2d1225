"""Sources that answer and still withhold: one chunk held back while the others are answered, and
a parent that answers "unavailable" at once to everything (`relay.failures`); an honest parent
that is behind keeps its children."""

import heapq
from collections import Counter

from p2pnet.core import Emit
from p2pnet.identity import Identity
from p2pnet.wire import Envelope
from relay.effects import DropReason, Fetch, FetchFailure, SourceDropped, SourcePassedOver
from relay.failures import UNAVAILABLE_PASS
from relay.manifest import open_manifest
from relay.messages import ManifestAnnounce
from relay.sources import stand_in_key
from relay.transfer import TransferConfig, TransferCore
from simulations.broadcast import fake_manifest
from simulations.world import EPOCH_S

PUBLISHER = Identity.from_seed_text("publisher")
FAST = TransferConfig(stall_timeout_s=2.0, exclude_s=6.0, announce_interval_s=3600.0)
RELAYS = {f"m{i}": 1e8 for i in range(8)}
TICK_S = 0.5


def opener(frame: bytes, now: float):
    return open_manifest(frame, trusted_publishers={PUBLISHER.peer_id}, now_s=EPOCH_S + now)


def fetches(effects) -> list[Fetch]:
    return [e for e in effects if isinstance(e, Fetch)]


def started(me: str, signed) -> tuple[TransferCore, list[Fetch]]:
    c = TransferCore(FAST, me, open_frame=opener, self_upload_bps=1e8)
    c.set_members(0.0, {PUBLISHER.peer_id: 1e8, me: 1e8, **RELAYS})
    body = ManifestAnnounce(signed.frame)
    return c, fetches(c.on_message(0.0, Envelope(body.KIND, PUBLISHER.peer_id, b"", 0, body, 0)))


def run(c: TransferCore, first: list[Fetch], answer, until_s: float = 120.0) -> tuple[float, list, list]:
    """Drive `c` in virtual time: `answer(t, fetch)` says what becomes of each request (None: it is
    never answered; else (delay, failure or None for the chunk)); ticks every `TICK_S`. The time
    the version completed, every (time, fetch) asked, and the events the core emitted."""
    queue: list = []
    asked: list = []
    events: list = []
    seq = 0

    def push(t: float, effects) -> None:
        nonlocal seq
        events.extend(e.event for e in effects if isinstance(e, Emit))
        for f in fetches(effects):
            asked.append((t, f))
            what = answer(t, f)
            if what is not None:
                seq += 1
                heapq.heappush(queue, (t + what[0], seq, f, what[1]))

    push(0.0, first)
    t, tick = 0.0, TICK_S
    while not c.complete_versions() and t < until_s:
        if queue and queue[0][0] <= tick:
            t, _, f, failure = heapq.heappop(queue)
            if failure is None:
                push(t, c.fetched(t, f.peer, f.version, f.index, 0.01, 0.0))
            else:
                push(t, c.fetch_failed(t, f.peer, f.version, f.index, failure))
        else:
            t, tick = tick, tick + TICK_S
            push(t, c.on_timer(t, "relay/tick"))
    return t, asked, events


def test_a_chunk_a_source_withholds_while_it_answers_the_others_is_asked_elsewhere_after_a_stall():
    """A source answers every request in 1.5 s (inside the stall timeout, 2 s) but one, which it
    never answers. Judged by its link's last completion it never stalled, and the chunk waited
    for as long as it had other requests to answer (44 s here); now the request is held back a
    stall timeout after it was asked (at the first tick past it), the chunk is asked of another
    source, and the withholding one is not dropped: it is still asked for other chunks."""
    c, first = started("me", fake_manifest(PUBLISHER, 64 * 2**20, 2**20))
    withheld = next(f for f in first if f.peer != PUBLISHER.peer_id)
    liar = withheld.peer
    done_at, asked, _ = run(c, first, lambda t, f: None if (f.peer, f.index) == (liar, withheld.index) else (1.5, None))
    assert c.complete_versions() == [1]
    again = [(t, f.peer) for t, f in asked if f.index == withheld.index][1:]
    assert again and again[0][0] <= FAST.stall_timeout_s + TICK_S and again[0][1] != liar
    assert all(peer != liar for _, peer in again)
    assert any(f.peer == liar and t > again[0][0] for t, f in asked)  # still a source for the rest
    assert liar not in c.status(done_at)["excluded"]


def _liar_and_stripe(signed) -> tuple[str, str, int, str]:
    """A name for us, our parent in one stripe (the stripe's lone root), that stripe, and the
    root's child drawn to stand in for it before us (`relay.sources`, `_stand_in`)."""
    for k in range(50):
        me = f"me{k}"
        c, first = started(me, signed)
        plan = c._versions[1].plan
        for f in first:
            stripe = plan.stripe_of_chunk[f.index]
            if f.peer == PUBLISHER.peer_id or [p for p, _ in plan.ranked_interior(stripe)] != [f.peer]:
                continue
            order = sorted(stand_in_key(signed.manifest_id, p) for p in plan.children(stripe, f.peer))
            if order[0][1] != me:
                return me, f.peer, stripe, order[0][1]
    raise AssertionError("no such world")


def test_a_parent_that_answers_unavailable_at_once_to_everything_is_passed_over_in_its_stripe():
    """Our parent in one stripe (its lone root) answers every request "unavailable" at once and
    never sends a byte. Before, every chunk of the stripe was asked of it three times and then of
    the origin, for the whole version. Now, after a window's chunks each failed as often as a
    parent is asked again (`UNAVAILABLE_PASS`), it is passed over in that stripe, so the child
    drawn to stand in for a lost root feeds us that stripe and the origin is spared."""
    signed = fake_manifest(PUBLISHER, 256 * 2**20, 2**20)
    me, liar, stripe, stand_in = _liar_and_stripe(signed)
    c, first = started(me, signed)
    plan = c._versions[1].plan
    served = Counter()

    def answer(t: float, f: Fetch):
        if f.peer == liar:
            return 0.01, FetchFailure.UNAVAILABLE
        if plan.stripe_of_chunk[f.index] == stripe:
            served[f.peer] += 1
        return 0.3, None

    done_at, _, events = run(c, first, answer)
    assert c.complete_versions() == [1]
    assert served[stand_in] > served[PUBLISHER.peer_id]
    assert served[PUBLISHER.peer_id] <= 2  # the chunks it failed before it was passed over, at most
    assert SourcePassedOver(liar, 1, stripe, DropReason.UNAVAILABLE) in events
    assert liar not in c.status(done_at)["excluded"]  # passed over in that stripe alone


def test_a_parent_behind_that_answers_unavailable_and_then_delivers_stays_our_parent():
    """An honest parent that is itself downloading answers "unavailable" when a chunk did not
    reach it within its wait limit, and delivers it when asked again: it is never passed over,
    and every chunk of its stripe comes from it, however many chunks it was late with."""
    signed = fake_manifest(PUBLISHER, 256 * 2**20, 2**20)
    me, parent, stripe, _ = _liar_and_stripe(signed)
    c, first = started(me, signed)
    plan = c._versions[1].plan
    late = set()
    served = Counter()

    def answer(t: float, f: Fetch):
        if f.peer == parent and f.index not in late:
            late.add(f.index)
            return FAST.stall_timeout_s / 2, FetchFailure.UNAVAILABLE  # (its wait limit, before our stall timeout)
        if plan.stripe_of_chunk[f.index] == stripe:
            served[f.peer] += 1
        return 0.3, None

    _, _, events = run(c, first, answer, until_s=600.0)
    assert c.complete_versions() == [1]
    assert len(late) >= UNAVAILABLE_PASS * FAST.window_per_source  # more than a liar is allowed
    assert served == Counter({parent: len(plan.chunks_of_stripe[stripe])})
    assert not any(isinstance(e, (SourcePassedOver, SourceDropped)) for e in events)
