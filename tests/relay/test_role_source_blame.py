"""The relay role blames a source only for what the source did, in virtual time (MockClock).

A source the transfer core drops (`DropSource`) has its connection closed, and the requests it
still had out, written or not, are not reported: the core took them back as it dropped it.
Reporting them (as `unreachable`) passed the core's verdict off as another: a source dropped as
slow (alive, asked before the origin) was taken out of the core's slow set.

While the role's dispatcher waits on our own disk (keeping a manifest, collecting old versions,
asking a full store for room), the requests queued behind it wait unsent; the core is told, and
drops no source as stalled for that time, and a source that really stalls is still dropped once
the wait is over, a stall later.

The role runs its real core, runner, dispatcher and store (`Harness`); sources answer from the
publisher's store in their own names at once (`PeerSource`), but for one slow source in the first
test: a real `relay.upstream.Upstream` over an in-memory connection to a scripted server that takes
one request at a time (so the rest wait unwritten, as behind a full TCP window) and answers each
after a while.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

import numpy as np
import trio
import trio.testing
from safetensors.numpy import save_file

from p2pnet.core import Emit
from p2pnet.dataplane import FrameReader, send_frame
from relay.effects import DropReason, SourceDropped
from relay.messages import STATUS_OK, ChunkResponse
from relay.role import RelayRole, _parse_request
from relay.upstream import Upstream
from tests.relay.test_role_fetched_channel import PeerSource
from tests.relay.test_role_store_faults import (  # noqa: F401 (fixtures)
    CHUNK, PUBLISHER, Harness, clock, inline_threads)

CHUNKS = 256
STAMP_S = 1.7e9 + 3  # when version 1 is signed: a plan that suits (`announce_stamped`; at +0, +2 or +7 none of
# our parents but the origin could be replaced, and none would be dropped as slow)
MEMBERS = {f"12D3KooWmember{i}": 1e8 for i in range(31)}  # enough that our parents have ancestors or stand-ins
SLOW_ANSWER_S = 2.0  # virtual: each of the slow source's answers waited this long in its queue


class SlowServer:
    """A source's end of a data connection: reads one request at a time, answers it after
    `SLOW_ANSWER_S` (saying it queued that long) from the publisher's store. Our writes of the
    requests it has not read yet wait (a lockstep stream: a full TCP window)."""

    def __init__(self, store) -> None:
        self.store = store
        self.answered = 0

    async def serve(self, requests: trio.abc.ReceiveStream, answers: trio.abc.SendStream) -> None:
        reader = FrameReader(requests, max_frame_bytes=4096)
        while (frame := await reader.frame()) is not None:
            request, _ = _parse_request(frame)
            await trio.sleep(SLOW_ANSWER_S)
            data = self.store.read_chunk(request.version, request.index)
            await send_frame(answers, ChunkResponse(request.request_id, STATUS_OK, len(data),
                                                    queued_us=int(SLOW_ANSWER_S * 1e6)).pack())
            await answers.send_all(data)
            self.answered += 1


class SlowParent:
    """Which peer is slow: the first member other than the origin (of `among`) that is our parent
    in a stripe of version 1 and that someone could take over from, chosen when first asked and kept."""

    def __init__(self, h: Harness, among: Collection[str] = MEMBERS) -> None:
        self.h, self.among = h, among
        self.peer: str | None = None
        self.stripe = -1

    def __call__(self) -> str:
        if self.peer is None:
            core = self.h.role.core
            v = core._versions[1]
            self.stripe = next(stripe for stripe, chain in enumerate(v.chains)
                               if chain[0] in self.among and core._replaceable(0.0, v.plan, stripe, chain[0]))
            self.peer = v.chains[self.stripe][0]
        return self.peer


async def announce_stamped(h: Harness, version: int, chunks: int) -> None:
    """Publish `version` at a fixed time and tell the role of it: the same manifest each run, so
    the same plan (one where our parents have ancestors or stand-ins besides the origin)."""
    path = h.root / f"v{version}.safetensors"
    save_file({"w": np.random.default_rng(version).standard_normal(chunks * CHUNK // 4 - 40).astype(np.float32)},
              str(path))
    signed = h.origin.publish_files(PUBLISHER, [path], model="m", version=version, previous_version=version - 1,
                                    chunk_bytes=CHUNK, now_s=STAMP_S)
    await h.role._command(lambda now: h.role.core.manifest_frame(now, PUBLISHER.peer_id, signed.frame))


async def start_with_a_slow_source(h: Harness, nursery: trio.Nursery) -> tuple[SlowServer, SlowParent]:
    """Start `h`: our parent in one stripe of version 1 (`SlowParent`) is fetched from over a real
    `Upstream` to a `SlowServer`; every other source answers at once (`PeerSource`)."""
    role = h.role
    server, slow = SlowServer(h.origin), SlowParent(h)

    async def open_stream(peer: str) -> trio.abc.Stream:
        assert peer == slow()
        to_server, from_us = trio.testing.lockstep_stream_one_way_pair()
        to_us, from_server = trio.testing.memory_stream_one_way_pair()
        nursery.start_soon(server.serve, from_us, to_us)
        return trio.StapledStream(to_server, from_server)

    role.open_stream = open_stream
    await h.start(nursery)
    others = PeerSource(role, h.origin, nursery)
    real = RelayRole._upstream.__get__(role)  # the role's own: one `Upstream` per peer, closed by `DropSource`
    role._upstream = lambda peer, nursery: real(peer, nursery) if peer == slow() else others
    await role._command(lambda now: role.core.set_members(now, {PUBLISHER.peer_id: 1e8, **MEMBERS}))
    return server, slow


async def start_with_members(h: Harness, nursery: trio.Nursery, kind: type[PeerSource] = PeerSource) -> PeerSource:
    """Start `h` with `MEMBERS`; every source answers in its own name (`kind`: at once, `PeerSource`)."""
    await h.start(nursery)
    h.source = source = kind(h.role, h.origin, nursery)
    h.role._upstream = lambda peer, nursery: source
    await h.role._command(lambda now: h.role.core.set_members(now, {PUBLISHER.peer_id: 1e8, **MEMBERS}))
    return source


def drops(h: Harness, peer: str) -> list[DropReason]:
    """Why the core dropped `peer`, in order (its `SourceDropped` events)."""
    return [e.event.why for e in h.node.carried
            if isinstance(e, Emit) and isinstance(e.event, SourceDropped) and e.event.peer == peer]


async def test_a_source_dropped_as_slow_with_requests_unwritten_stays_slow_and_no_chunk_is_lost(
        tmp_path, clock, monkeypatch):
    h = Harness(tmp_path, max_concurrent_downloads=8)
    core = h.role.core
    # four requests out per (source, stripe): the slow source, our parent in one stripe, has more
    # out than the one it reads and the one being written, as behind a full TCP window
    core.config = replace(core.config, window_per_source=4)
    unwritten_at_close: list[int] = []
    real_close = Upstream.close

    def close(upstream: Upstream) -> None:
        unwritten_at_close.append(upstream._receive.statistics().current_buffer_used)
        real_close(upstream)

    monkeypatch.setattr(Upstream, "close", close)
    async with trio.open_nursery() as nursery:
        server, parent = await start_with_a_slow_source(h, nursery)
        await announce_stamped(h, 1, CHUNKS)
        slow = parent()
        await h.until(lambda: h.complete(1), 600)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()

    assert drops(h, slow) == [DropReason.SLOW]  # dropped as slow, and for nothing else since
    assert unwritten_at_close and unwritten_at_close[0] > 0  # requests waited unwritten when it was dropped
    assert server.answered >= 3
    assert slow in core._slow  # alive: asked before the origin where a stand-in is wanted
    v = core._versions[1]
    assert core._instead_of_origin(trio.current_time(), v, parent.stripe, ()) == slow
    assert all(h.role.store.holds(1, i) for i in range(CHUNKS))
    assert core.progress(trio.current_time(), 1)["in_flight"] == 0


async def test_sources_are_not_dropped_as_stalled_while_our_dispatcher_waits_on_our_disk(tmp_path, clock):
    h = Harness(tmp_path, max_concurrent_downloads=8)
    stall_s = h.role.core.config.stall_timeout_s
    real_keep = h.role._keep_manifest

    async def slow_keep(signed) -> None:  # our disk takes its time over the new version's files
        await trio.sleep(3 * stall_s)
        await real_keep(signed)

    h.role._keep_manifest = slow_keep
    async with trio.open_nursery() as nursery:
        source = await start_with_members(h, nursery)
        await h.announce(1, chunks=64)  # its requests queue behind the manifest being kept
        took = await h.until(lambda: h.complete(1), 600)
        nursery.cancel_scope.cancel()

    assert took >= 3 * stall_s  # (the requests were held that long)
    dropped = [e.event for e in h.node.carried if isinstance(e, Emit) and isinstance(e.event, SourceDropped)]
    assert dropped == []
    assert h.role.core.status(trio.current_time())["excluded"] == []
    assert sorted(i for _, _, i in source.downloads) == list(range(64))  # each chunk asked once, of whom it was


def stall_drops(h: Harness) -> list[SourceDropped]:
    return [e.event for e in h.node.carried
            if isinstance(e, Emit) and isinstance(e.event, SourceDropped) and e.event.why is DropReason.STALLED]


async def test_sources_are_not_dropped_as_stalled_while_our_dispatcher_collects_old_versions(tmp_path, clock):
    """The requests for a new version queue behind the collection the last completed version
    started (our disk): nobody is blamed for that wait."""
    h = Harness(tmp_path, max_concurrent_downloads=8)
    stall_s = h.role.core.config.stall_timeout_s
    real_collect, collecting = h.role._collect, trio.Event()

    async def slow_collect() -> None:  # our disk takes its time deleting what is no longer kept
        collecting.set()
        await trio.sleep(3 * stall_s)
        await real_collect()

    h.role._collect = slow_collect
    async with trio.open_nursery() as nursery:
        source = await start_with_members(h, nursery)
        await h.announce(1, chunks=16)
        await collecting.wait()  # version 1 is complete; its collection runs
        await h.announce(2, chunks=64)  # its requests queue behind the collection
        took = await h.until(lambda: h.complete(2), 600)
        nursery.cancel_scope.cancel()

    assert took >= 2 * stall_s  # (the requests were held that long)
    assert stall_drops(h) == [] and h.role.core.status(trio.current_time())["excluded"] == []
    assert sorted(i for _, v, i in source.downloads if v == 2) == list(range(64))  # each chunk asked once


async def test_sources_are_not_dropped_as_stalled_while_a_full_store_is_asked_for_room(tmp_path, clock):
    """At the end of a full store's hold, the first request asks the store for room (our disk)
    before it is sent; the requests queued behind that question are not judged stalled."""
    h = Harness(tmp_path, budget_bytes=3 * CHUNK)
    stall_s = h.role.core.config.stall_timeout_s
    real_probe, probed = h.role._no_room_for, []

    async def slow_probe(nbytes: int):
        if trio.current_time() >= h.role.backoff.until and not probed:  # the store is asked (not a request
            probed.append(trio.current_time())                          # issued just before the hold)
            await trio.sleep(3 * stall_s)
        return await real_probe(nbytes)

    h.role._no_room_for = slow_probe
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        await h.announce(1)
        await h.until(lambda: h.role.backoff.active, 5)
        h.role.store.budget_bytes = 10**9  # space returns: the probe will find room
        await h.until(lambda: h.complete(1), 600)
        nursery.cancel_scope.cancel()

    assert probed  # (the probe was slow)
    assert stall_drops(h) == [] and h.role.core.status(trio.current_time())["excluded"] == []


class HangingSource(PeerSource):
    """A `PeerSource` but for one peer (the first other than the publisher asked for a chunk of
    version 2), which never answers for version 2: a source that really stalls."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.hung: str | None = None

    async def _answer(self, fetch) -> None:
        if fetch.version == 2:
            if self.hung is None and fetch.peer != PUBLISHER.peer_id:
                self.hung = fetch.peer
            if fetch.peer == self.hung:
                await trio.sleep_forever()
        await super()._answer(fetch)


async def test_a_source_that_really_stalls_across_a_hold_is_still_dropped_once_the_hold_ends(tmp_path, clock):
    """While our dispatcher collects old versions (our disk) no source is judged; once that is done,
    a source of the version in progress that never answered is dropped as stalled, a stall after."""
    h = Harness(tmp_path, max_concurrent_downloads=8)
    stall_s = h.role.core.config.stall_timeout_s
    real_collect, held = h.role._collect, []

    async def slow_collect() -> None:  # our disk takes its time once: version 1 completed, version 2 is fetched
        start = trio.current_time()
        if not held:
            await trio.sleep(3 * stall_s)
        await real_collect()
        held.append((start, trio.current_time()))

    h.role._collect = slow_collect
    async with trio.open_nursery() as nursery:
        source = await start_with_members(h, nursery, HangingSource)
        source.gate = trio.Event()  # no answer before both versions are asked for
        await h.announce(1, chunks=4)  # (a few: version 2 is asked for within the in-flight budget too)
        await announce_stamped(h, 2, 64)
        await h.until(lambda: source.hung is not None, 5)
        source.gate.set()
        await h.until(lambda: stall_drops(h), 600)
        dropped_at = trio.current_time()
        await h.until(lambda: h.complete(2), 600)
        nursery.cancel_scope.cancel()

    assert {d.peer for d in stall_drops(h)} == {source.hung}
    (hold_started, hold_ended), *_ = held
    assert hold_ended - hold_started >= 3 * stall_s  # (held that long: past a stall)
    # judged again once the hold ended: within a stall and a tick (stall_timeout_s / 4) after it
    assert hold_ended <= dropped_at <= hold_ended + 1.25 * stall_s + 0.1
    assert h.role.core._held_since is None


ANSWER_S = 0.05  # virtual: each `PromptServer` answer waits this long for an upload slot, and says so


class PromptServer:
    """Every source's end of its data connection: reads each request as it comes and answers it
    after `ANSWER_S`, saying it queued that long (an honest source with every chunk: no long
    poll), from the publisher's store. Each answer is told to `answered`."""

    def __init__(self, store) -> None:
        self.store = store
        self.answered = 0

    async def serve(self, requests: trio.abc.ReceiveStream, answers: trio.abc.SendStream) -> None:
        reader, lock = FrameReader(requests, max_frame_bytes=4096), trio.Lock()
        async with trio.open_nursery() as nursery:
            while (frame := await reader.frame()) is not None:
                nursery.start_soon(self._answer, answers, lock, _parse_request(frame)[0])

    async def _answer(self, answers: trio.abc.SendStream, lock: trio.Lock, request) -> None:
        await trio.sleep(ANSWER_S)
        data = self.store.read_chunk(request.version, request.index)
        async with lock:
            await send_frame(answers, ChunkResponse(request.request_id, STATUS_OK, len(data),
                                                    queued_us=int(ANSWER_S * 1e6)).pack())
            await answers.send_all(data)
        self.answered += 1



async def start_with_prompt_sources(h: Harness, nursery: trio.Nursery, dial_s: Callable[[str], float],
                                    members: Mapping[str, float] = MEMBERS) -> PromptServer:
    """Start `h` with `members`: each source fetched from over the role's own `Upstream` (one
    per peer, closed by `DropSource`) to a `PromptServer`, its connection open `dial_s(peer)`
    after it was asked for (the address, the connect, the handshake)."""
    server = PromptServer(h.origin)

    async def open_stream(peer: str) -> trio.abc.Stream:
        await trio.sleep(dial_s(peer))
        to_server, from_us = trio.testing.memory_stream_one_way_pair()
        to_us, from_server = trio.testing.memory_stream_one_way_pair()
        nursery.start_soon(server.serve, from_us, to_us)
        return trio.StapledStream(to_server, from_server)

    h.role.open_stream = open_stream
    await h.start(nursery)
    h.role._upstream = RelayRole._upstream.__get__(h.role)  # (`Harness.start` put its `Source` there)
    await h.role._command(lambda now: h.role.core.set_members(now, {PUBLISHER.peer_id: 1e8, **members}))
    return server


async def test_a_source_is_not_dropped_as_slow_for_the_time_we_took_to_connect_to_it(tmp_path, clock):
    """Our sources are timed from our ask too (`relay.judging`, `_unexcused_s`): each chunk's
    wait beyond what its source reports counts against it past our other sources' such waits.
    Our parent in one stripe (`SlowParent`) takes `100 * ANSWER_S` to connect to (its address
    came late, a long path): every request we had asked of it waited that long by the core's
    clock, our other sources' waits none, and it was dropped as slow for our connecting. The
    upstream starts each request's clock once the connection is open; answers as prompt as the
    others' are the others' pace."""
    h = Harness(tmp_path, max_concurrent_downloads=8)
    parent = SlowParent(h)
    async with trio.open_nursery() as nursery:
        server = await start_with_prompt_sources(h, nursery, lambda peer: 100 * ANSWER_S if peer == parent() else 0.0)
        await announce_stamped(h, 1, CHUNKS)
        await h.until(lambda: h.complete(1), 600)
        nursery.cancel_scope.cancel()

    core = h.role.core
    assert core._samples[parent()] >= 3 and server.answered >= CHUNKS  # (judged: chunks timed, and enough of them)
    assert sum(core._samples.get(p, 0) >= 3 for p in MEMBERS if p != parent()) >= 3  # (against 3 others at least)
    assert drops(h, parent()) == []


CAPPED = {p: 2.0**64 - 1 for p in list(MEMBERS)[::2]}  # 16 members that advertise more than they know of their link


async def test_a_parent_whose_claim_the_plan_capped_is_not_dropped_as_slow_for_the_time_we_took_to_connect_to_it(
        tmp_path, clock):
    """As above, with our slow-to-connect parent one of 16 members whose claims the plan capped
    (honest relays that advertise more upload than they have, as one left at the default
    `upload_bps` may among slower ones): such a parent, delivering far under what the plan gave
    each of its children, is judged against half of our fastest source too (`relay.sources`,
    `_short_of_claim`), and the wait for its connection is no part of its delivery (with the
    upstream's clock started at our ask, or with no fastest-source guard, it was dropped)."""
    h = Harness(tmp_path, max_concurrent_downloads=8)
    parent = SlowParent(h, among=CAPPED)
    async with trio.open_nursery() as nursery:
        server = await start_with_prompt_sources(h, nursery, lambda peer: 100 * ANSWER_S if peer == parent() else 0.0,
                                                 members={**MEMBERS, **CAPPED})
        await announce_stamped(h, 1, CHUNKS)
        await h.until(lambda: h.complete(1), 600)
        nursery.cancel_scope.cancel()

    core = h.role.core
    assert core._members.planned[parent()] < CAPPED[parent()]  # (its claim capped)
    assert core._samples[parent()] >= 3 and server.answered >= CHUNKS  # (judged: chunks timed, and enough of them)
    assert drops(h, parent()) == []
