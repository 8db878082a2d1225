"""`RelayRole`: the trio shell that runs the transfer core, serves chunks and fetches them.

What it owns: the store of this peer (what it stores, its durability and faults:
`relay.role_store`, mixed in), one `TransferCore` (driven by a `CoreRunner` that runs in
the role's own nursery, `Node.run_core`, and stops with the role), the data-plane channel
`relay/chunks` (serving: `relay.serving_shell`, mixed in), one `relay.upstream.Upstream` per
source peer (fetching), the control commands `checkpoint.publish|status|fetch|wait` and
`status()` (`relay.commands`, mixed in), the membership the core plans with and what we
advertise of our upload (`relay.role_members`, mixed in), and the `VersionWatcher` that tells
trainers and workers when a version is complete.

Theory of operation. Relay effects (`Fetch`, `FetchManifest`, `DropSource`, `Penalise`,
`ServeAtOnce`) and relay events are peeled off the core's effect list by `_Peeler` and queued,
in order, for the dispatcher task; everything else goes to the node as usual. A `Fetch` goes to
the upstream of its peer, which hands each chunk it receives whole (into one of `STORING_CHUNKS` reused buffers
shared by all upstreams) to `report_fetched` (`relay.role_store`: stored, then told to the core in batches).
While the dispatcher waits on our own disk (keeping a manifest, collecting versions, a full
store's probe), the requests queued behind it wait unsent, and the core is told so
(`_sending_held`): our disk's delay is not blamed on the sources as a stall. A source whose data
plane refuses us as unknown (`NotAdmitted`: it has not heard our heartbeat) is sent our heartbeat
directly (`Node.introduce`), by the upstream for a chunk fetch and by `_fetch_manifest` for a
manifest (the core is told, `not_admitted`, and asks again soon: `relay.manifest_answers`), so it admits
us at the next try rather than after our next heartbeat reaches it. A
source whose own heartbeat has not reached us (we know of it from a `Holding`, or as the
manifest's publisher) is waited for up to `request_timeout_s` (`_data_addr_soon`), then failed
as `no_address`: nobody's fault, asked again soon (`relay.failures`; a manifest ask,
`relay.manifest_answers`). `_fetch_manifest` tells the core of every failed manifest ask, by who is at
fault (unreachable or too slow with its address known, not holding it, a broken answer, besides
the two above) and with the ask's `asked_at`: the core asks another holder that named the
version at once, and holds the failure against the holder as it would a chunk fetch's. An
answer whose status we do not know (a newer peer may add statuses, as `p2pnet.wire`'s rule adds
fields: an old peer cannot tell what one means) is told as such (`manifest_declined`): another
holder is asked, with no verdict on this one; before, it counted as "not held" and excluded it.
Every input of the core, the shell's own included (a manifest the store will not keep is
`forget`, a collected version `collected`), goes through its runner (`_command`), whose effects
are carried out; a `Fetch` of a version the core forgot after asking it (the store refused its
manifest, or collected it) is not sent. A manifest the store refuses for good (another one is
held for its version) the core takes no more (`refuse_manifest`), and follows the held one at
once (before, only from its next announce); one it could not keep for now
(a full store, a failing disk) is only forgotten, and taken again at the next announce.

The server side (`relay.serving_shell`) answers a request once it holds the chunk, in upload
slots (`ServeAtOnce` sets how many), never more than `[peer] upload_bps` a second in all. What
the uploads deliver while every slot is busy is measured (`relay.serving.UploadMeter`); when it
is lower than `upload_bps`, the heartbeat advertises it, and peers plan their next version with it.

Our own store (`relay.role_store`, mixed in): the chunks fetched are stored and made durable
there, in batches, and what the store tells us (chunks rotten or lost, versions collected), a
full or failing disk (new requests held: `StoreBackoff`) and garbage collection are handled there.

Test hook: with the environment variable P2PNET_TEST_CORRUPT_CHUNKS=1 this peer flips a byte in
every chunk it serves (a byzantine relay for the tests). It is read once at start, logged as an
error, and reported in `status()`; nothing else enables it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import trio

from p2pnet.core import Emit
from p2pnet.dataplane import FrameReader, WrongPeer, open_data_stream, send_frame
from p2pnet.errors import MessageRejected, PeerUnavailable
from p2pnet.handshake import NotAdmitted
from p2pnet.peertable import PEER_TABLE_CORE
from relay.config import RelayConfig, relay_config
from relay.commands import ControlCommands, _refusing_errors
from relay.errors import AddressUnknown, ManifestRejected, StoreFull, VersionUnknown
from relay.loader import VersionWatcher
from relay.metrics import BytesByRole
from relay.manifest import MAX_MANIFEST_BYTES, SignedManifest, open_manifest
from relay.messages import (OP_MANIFEST, RESPONSE, STATUS_BUSY, STATUS_OK, STATUS_UNAVAILABLE, ChunkRequest,
                            ChunkResponse, ManifestAnnounce)
from relay.serving import ByteBudget, ServingConfig, UploadMeter
from relay.serving_shell import ChunkServing, _parse_request  # _parse_request: tests import it from here
from relay.uploads import Uploads
from relay.role_members import MemberFollowing, serving_uploads  # serving_uploads: tests import it from here
from relay.role_store import FailingVersion, StoreSide, _trouble_of
from relay.store import ChunkRotten, ChunksLost, ChunkStore, StoreBackoff, StoreTrouble, VersionCollected
from relay.effects import (DropSource, Fetch, FetchFailure, FetchManifest, ManifestAccepted, Penalise, ServeAtOnce,
                           VersionComplete)
from relay.transfer import TransferConfig, TransferCore
from relay.upstream import Buffers, Upstream, read_frame

log = logging.getLogger(__name__)

CHANNEL = "relay/chunks"
CORRUPT_ENV = "P2PNET_TEST_CORRUPT_CHUNKS"
STORING_CHUNKS = 6  # received chunks being hashed and written at once: the chunk buffers this peer holds
WRONG_ADDRESS_PENALTY = 5.0  # advertised a data address that answers as someone else
# the answers to a manifest ask we know the meaning of; any other is a newer peer's (`_fetch_manifest`)
_MANIFEST_STATUSES = frozenset({STATUS_OK, STATUS_UNAVAILABLE, STATUS_BUSY})
_RELAY_EFFECTS = (Fetch, FetchManifest, DropSource, Penalise, ServeAtOnce)


class _Peeler:
    """The core as the node sees it: relay effects and events are diverted to `divert`."""

    def __init__(self, core: TransferCore, divert: Callable[[Any], None]) -> None:
        self.core = core
        self.topics = core.topics
        self.kinds = core.kinds
        self._divert = divert

    def peel(self, effects: list[Any]) -> list[Any]:
        kept = []
        for effect in effects:
            if isinstance(effect, _RELAY_EFFECTS):
                self._divert(effect)
                continue
            if isinstance(effect, Emit) and isinstance(effect.event, (ManifestAccepted, VersionComplete)):
                self._divert(effect.event)
            kept.append(effect)
        return kept

    def start(self, now: float) -> list[Any]:
        return self.peel(self.core.start(now))

    def on_message(self, now: float, envelope: Any) -> list[Any]:
        return self.peel(self.core.on_message(now, envelope))

    def on_timer(self, now: float, key: str) -> list[Any]:
        return self.peel(self.core.on_timer(now, key))

    def on_rejected(self, now: float, peer: str, reason: str) -> list[Any]:
        return self.peel(self.core.on_rejected(now, peer, reason))


class RelayRole(StoreSide, ChunkServing, ControlCommands, MemberFollowing):
    def __init__(self, node: Any, section: dict[str, Any]) -> None:
        self.node = node
        self.config: RelayConfig = relay_config(section).trusting(node.peer_id)
        self.store = ChunkStore(self.config.store_root(node.config.data_dir), budget_bytes=self.config.budget_bytes,
                                keep_versions=self.config.keep_versions,
                                trusted_publishers=self.config.trusted_publishers, fsync=self.config.fsync,
                                fsync_batch_chunks=self.config.fsync_batch_chunks, background_flush=True)
        self.watcher = VersionWatcher(self.store.complete_versions())
        self.corrupt_chunks = os.environ.get(CORRUPT_ENV) == "1"
        if self.corrupt_chunks:
            log.error("%s=1: this peer CORRUPTS every chunk it serves (test hook for byzantine relays)", CORRUPT_ENV)
        trusted = frozenset(self.config.trusted_publishers)
        transfer = TransferConfig(
            stall_timeout_s=self.config.stall_timeout_s, exclude_s=2 * self.config.stall_timeout_s,
            announce_interval_s=self.config.announce_interval_s,
            max_in_flight=2 * self.config.max_concurrent_downloads, layout=self.config.layout,
            tree_fanout=self.config.tree_fanout)
        self.core = TransferCore(
            transfer, node.peer_id,
            open_frame=lambda frame, now: open_manifest(frame, trusted_publishers=trusted, now_s=time.time()),
            self_upload_bps=node.config.upload_bps)
        # What `_dispatch` carries out, in order: the relay effects and events the core diverts
        # (`_Peeler`, inside the core's runner) and the store's events (`_from_store`, from any thread
        # by `run_sync_soon`). No finite size can be proven, and neither producer may wait: the
        # runner must not block on `_dispatch`, which awaits the runner (`_command`), nor a store
        # thread's callback on the trio loop. What limits it is a rate, not a count. `_pump` issues
        # at most `max_in_flight` requests in all, but `asked_for` issues one per chunk of a version
        # in progress past that budget; and while `_dispatch` awaits the disk (`_keep_manifest`
        # copying a version's shared chunks, `_collect`, a full store's probe) the core runs on:
        # peers ask for chunks, and gossip brings new versions (the requests queued here meanwhile
        # are not judged stalled: `_sending_held`). The store adds one event per chunk it drops
        # (found rotten, lost to a failed fsync) and per version it collects.
        self._queue_send, self._queue = trio.open_memory_channel[Any](math.inf)
        self._peeler = _Peeler(self.core, self._divert)
        # per peer, the `DropSource`s the core has emitted (`_divert`, in its runner) that `_dispatch`
        # has not carried out yet: an upstream made meanwhile is dropped already (`report_failed`).
        # An entry lives only while its drops wait in `_queue`.
        self._dropping: dict[str, int] = {}
        self._runner: Any = None
        self._upstreams: dict[str, Upstream] = {}
        self._meter = UploadMeter()
        self._uploads = Uploads(ServingConfig(slots=self.config.max_concurrent_uploads,
                                              wait_limit_s=self.config.request_timeout_s,
                                              linger_factor=self.config.upload_linger), on_full=self._uploads_full)
        self._budgets: dict[str, ByteBudget] = {}  # per peer, when [relay] serve_bytes_per_peer_s is set
        self._upload = ByteBudget(float(node.config.upload_bps))  # everything we serve, together
        # Chunks stored whose fetch the core has not heard of yet (`_tell_fetched` takes all that
        # wait, each round). One answer per request the core has out, and `_pump` keeps at most
        # `max_in_flight` out: that is its size. More answers can come (`asked_for` requests past
        # that budget; answers to requests the core settled without them: asked again elsewhere,
        # `found` in the store, their version forgotten), so a full channel makes `report_fetched`
        # wait, holding its chunk buffer (the upstreams stop reading once every buffer waits),
        # never drop a fetch.
        self._fetched_send, self._fetched = trio.open_memory_channel[tuple[str, Fetch, float, float | None]](
            transfer.max_in_flight)
        self._flush_wanted = trio.Event()  # a batch of stored chunks waits for `_flusher`
        self.buffers = Buffers(STORING_CHUNKS)  # shared by every upstream: memory stays flat
        self._members_changed = trio.Event()
        self.served: dict[str, int] = {}  # peer -> chunks served to it
        self.fetched_from: dict[str, int] = {}  # peer -> chunks fetched from it
        self.serving_now: dict[str, int] = {}
        self.bytes_served = 0
        self.bytes_served_to: dict[str, int] = {}  # peer -> bytes served to it (metrics)
        self.bytes_fetched_from: dict[str, int] = {}  # peer -> verified bytes fetched from it (metrics)
        self.bytes_by_role = BytesByRole(node)  # the same, by the other peer's role then (metrics' counters)
        self.chunk_checks = {"verified": 0, "rejected": 0}  # fetched chunks by digest check (metrics)
        self._serving_window: tuple[float, float] | None = None  # first and last chunk sent (trio clock)
        self._moved_at = -math.inf  # when a chunk was last stored or served (trio clock): see `_busy`
        self.timeline: dict[int, dict[str, float]] = {}  # version -> wall-clock times (status, benchmarks)
        self.backoff = StoreBackoff()  # a full or failing store holds new requests: 1 s doubling to 60 s
        # a put or an fsync found the disk full or failing (the store's `durable_flushes` then): only
        # a flush that makes chunks durable since ends the backoff, not a chunk stored (a write into
        # the page cache)
        self._full_on_flush: int | None = None
        # the version whose files a failing disk would not write as its hold began, held alone, and
        # its chunks stored since: only one of those made durable ends that hold early (`relay.role_store`)
        self._failing: FailingVersion | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self.store.listener = self._from_store

    # -- lifecycle ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        try:
            await self._run(task_status)
        finally:
            with trio.CancelScope(shield=True):  # chunks still waiting for a batched fsync
                await self._flush_store(stopping=True)

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        async with trio.open_nursery() as nursery:
            self.node.dataplane.register(CHANNEL, self._serve)
            self.node.add_gossip_gate(ManifestAnnounce.KIND, self._manifest_gate)  # type: ignore[attr-defined]
            self._runner = await nursery.start(self.node.run_core, self._peeler, "relay")
            nursery.start_soon(self._dispatch)
            nursery.start_soon(self._tell_fetched)
            nursery.start_soon(self._flusher)
            nursery.start_soon(self._uploads.run)
            nursery.start_soon(self._follow_members)
            self.node.on_event(self._on_node_event)
            for signed in self.store.manifests():
                await self._follow(signed)
            for name, fn in (("checkpoint.publish", self._cmd_publish), ("checkpoint.status", self._cmd_status),
                             ("checkpoint.fetch", self._cmd_fetch), ("checkpoint.wait", self._cmd_wait)):
                self.node.control.register(name, _refusing_errors(fn))
            task_status.started()

    async def _command(self, fn: Callable[[float], list[Any]]) -> None:
        await self._runner.command(lambda now: self._peeler.peel(fn(now)))

    async def _follow(self, signed: SignedManifest) -> None:
        """The core follows a manifest our store holds, with the chunks it holds (at startup; the
        one held when the store refuses another for its version, `_keep_manifest`)."""
        missing = set(self.store.missing(signed))
        held = [i for i in range(len(signed.manifest.chunk_digests)) if i not in missing]
        await self._command(partial(self.core.add_version, signed=signed, held=held))

    # -- what trainers and workers use ------------------------------------------------------

    async def publish(self, paths: list[Path], model: str, version: int, previous_version: int = -1,
                      chunk_bytes: int | None = None, place: str = "link") -> SignedManifest:
        """Sign and store `paths` as checkpoint `version` (`place`: how the files come into the
        store, see `ChunkStore.publish_files`), then announce it to the network."""
        signed = await trio.to_thread.run_sync(lambda: self.store.publish_files(
            self.node.identity, [Path(p) for p in paths], model=model, version=version,
            previous_version=previous_version, chunk_bytes=chunk_bytes or self.config.chunk_bytes,
            now_s=time.time(), place=place))
        self._about_to_move()  # peers ask for its chunks as soon as the announce reaches them
        await self._command(lambda now: self.core.publish(now, signed))
        self.watcher.mark_complete(version)
        await self._collect()
        return signed

    async def wait_for_version(self, min_version: int = 0) -> int:
        """Wait until a version >= `min_version` is complete here; returns the oldest such."""
        return await self.watcher.wait_newer(min_version - 1)

    # -- effects --------------------------------------------------------------------------

    async def _dispatch(self) -> None:
        async with trio.open_nursery() as nursery:  # what the core's effects start: upstreams, manifest fetches
            async for item in self._queue:
                if isinstance(item, Fetch):
                    known = self.core.signed(item.version)
                    digests = known.manifest.chunk_digests if known is not None else ()
                    if item.index >= len(digests) or digests[item.index] != item.digest:
                        continue  # forgotten since it was asked (its manifest refused by the store, collected),
                        # or of the manifest the store's replaced (`_keep_manifest`)
                    if self.store.holds(item.version, item.index):
                        nursery.start_soon(self._held_already, item)
                        continue
                    if await self._room_to_fetch(item):  # (else not downloaded, and held on)
                        self._upstream(item.peer, nursery).submit(item)
                elif isinstance(item, ChunkRotten):
                    await self._chunks_lost(item.version, (item.index,), "was corrupt on disk")
                elif isinstance(item, ChunksLost):
                    await self._chunks_lost(item.version, item.indices, "may not be on disk (a failed fsync)")
                elif isinstance(item, VersionCollected):
                    await self._version_collected(item.version)
                elif isinstance(item, FetchManifest):
                    nursery.start_soon(self._fetch_manifest, item)
                elif isinstance(item, DropSource):
                    self._dropping[item.peer] -= 1
                    if not self._dropping[item.peer]:
                        del self._dropping[item.peer]
                    upstream = self._upstreams.pop(item.peer, None)
                    if upstream is not None:
                        upstream.close()
                elif isinstance(item, Penalise):
                    self.penalise(item.peer, item.amount, item.reason)
                elif isinstance(item, ServeAtOnce):
                    self._uploads.set_slots(item.slots)
                elif isinstance(item, ManifestAccepted):
                    self.timeline.setdefault(item.signed.version, {})["manifest_at_s"] = time.time()
                    self._about_to_move()  # its chunks are fetched next
                    async with self._sending_held():
                        await self._keep_manifest(item.signed)
                elif isinstance(item, VersionComplete):
                    self.timeline.setdefault(item.version, {})["complete_at_s"] = time.time()
                    self.watcher.mark_complete(item.version)  # durable: the store flushed it first
                    log.info("version %d complete (%d chunks fetched in %.1fs)", item.version, item.fetched_chunks,
                             item.seconds)
                    async with self._sending_held():
                        await self._collect()

    @asynccontextmanager
    async def _sending_held(self) -> AsyncIterator[None]:
        """`_dispatch` waits on our own disk inside this: the requests queued behind it wait
        unsent, and the core is told so (`sending_held`, `sending_resumed`), so it blames no
        source for stalling meanwhile."""
        await self._command(self.core.sending_held)
        try:
            yield
        finally:
            await self._command(self.core.sending_resumed)

    async def _keep_manifest(self, signed: SignedManifest) -> None:
        """Keep the manifest and create the version's files (before any of its fetches is sent:
        `_dispatch` awaits this); chunks shared with a version we hold are copied, not fetched."""
        try:
            await trio.to_thread.run_sync(self.store.add_manifest, signed)
        except ManifestRejected as exc:  # the publisher signed two manifests for one version: never this one
            log.error("manifest for version %d refused by the store: %s", signed.version, exc)
            await self._command(lambda now: self.core.refuse_manifest(signed.version, signed.manifest_id))
            try:  # the one it holds instead, checked when it was kept: followed now, not at its next announce
                held = self.store.manifest(signed.version)
            except VersionUnknown:
                return  # collected meanwhile
            await self._follow(held)
            return
        except (StoreFull, OSError) as exc:  # may pass: taken again at the next announce
            log.error("cannot keep version %d: %s", signed.version, exc)
            await self._command(lambda now: self.core.forget(signed.version))
            return
        try:
            adopted = await trio.to_thread.run_sync(self.store.adopt_shared, signed.version)
        except (StoreFull, OSError) as exc:  # the version is kept: what was not copied is fetched
            await self._copy_failed(signed, exc)
            return
        if adopted:
            log.info("version %d: %d chunks shared with a held version, copied locally", signed.version,
                     len(adopted))
            for index in adopted:  # requests already waiting for them are answered now
                self._uploads.arrived(signed.version, index)
            await self._command(lambda now: self.core.found(now, signed.version, adopted))

    async def _copy_failed(self, signed: SignedManifest, exc: StoreFull | OSError) -> None:
        """Copying the chunks `signed` shares with a held version stopped: our store is full or
        its disk fails (`exc`). The version is kept. The core hears `found` only for the chunks
        that are durable: the failed put may have left chunks held but not durable (a bitmap it
        could not write), and a version must not complete before it is durable; the core asks for
        the others, and `_held_already` makes them durable first. New requests are held, as a
        failing put holds them, so the rest is not fetched into that disk at network speed."""
        version, count = signed.version, len(signed.manifest.chunk_digests)
        held = [i for i in range(count) if self.store.holds(version, i)]
        durable = [i for i in held if self.store.is_durable(version, i)]
        log.warning("version %d: copying the chunks it shares with a held version stopped after %d: %s; "
                    "the rest is fetched", version, len(held), exc)
        for index in held:  # requests already waiting for them are answered now
            self._uploads.arrived(version, index)
        if isinstance(exc, StoreFull):
            trouble = StoreTrouble.FULL
        else:  # (maybe an fsync's or a bitmap's: only a durable flush ends the hold, as for a put)
            trouble = _trouble_of(exc)
            self._full_on_flush = self.store.durable_flushes
        await self._store_trouble(str(exc), lambda now: self.core.found(now, version, durable), trouble=trouble,
                                  version=version)

    async def _held_already(self, fetch: Fetch) -> None:
        """The core asks for a chunk the store holds: copied from a held version meanwhile (the
        core heard `found`, unless the copy stopped before it was durable: `_copy_failed`), stored
        by another source's put the core has not heard of yet, or kept by a put whose flush failed
        after writing it (the core heard it was not stored, and nothing else would tell it again).
        The core hears `found` (a no-op if it knows) once the chunk is durable, after a flush if
        need be; if that flush fails the ask fails as ours (`store_failed`) and comes again, paced
        by the hold (full or failing) the failure started."""
        if not self.store.is_durable(fetch.version, fetch.index):
            await self._flush_store()
        if self.store.is_durable(fetch.version, fetch.index):
            await self._command(lambda now: self.core.found(now, fetch.version, [fetch.index]))
        else:  # the flush failed, or a failed fsync lost the chunk meanwhile
            await self.report_failed(fetch.peer, fetch, FetchFailure.STORE_FAILED)

    def _divert(self, item: Any) -> None:
        """Queue a relay effect or event for `_dispatch`, inside the core's runner, in the core's
        order; a `DropSource` marks the peer's upstream dropped as it is emitted, and is counted
        until carried out (see `report_failed`)."""
        if isinstance(item, DropSource):
            self._dropping[item.peer] = self._dropping.get(item.peer, 0) + 1
            upstream = self._upstreams.get(item.peer)
            if upstream is not None:
                upstream.dropped = True
        self._queue_send.send_nowait(item)

    def _upstream(self, peer: str, nursery: trio.Nursery) -> Upstream:
        """Our connection to `peer`, started in `nursery` (`_dispatch`'s) if there is none. One
        whose connection has ended stays `peer`'s, and fails what it is handed too, until it has
        reported every request it carried (then it leaves: `upstream_done`): the core applies
        that failure to `peer` as a whole, so it must not meet a newer connection's requests."""
        upstream = self._upstreams.get(peer)
        if upstream is None:
            upstream = Upstream(self, peer)
            upstream.dropped = peer in self._dropping  # (handed only requests that drop took back)
            self._upstreams[peer] = upstream
            nursery.start_soon(upstream.run)
        return upstream

    def upstream_done(self, upstream: Upstream) -> None:
        """`upstream` will report nothing more: the next request for its peer opens a new one.
        It removes only itself (`DropSource` may have put it aside already)."""
        if self._upstreams.get(upstream.peer) is upstream:
            del self._upstreams[upstream.peer]

    def data_addr(self, peer: str) -> str | None:
        entry = self.node.peertable.get(peer)
        return entry.data_addr if entry is not None else None

    def _manifest_gate(self, frame: bytes) -> str | None:
        """A gossiped manifest goes on only if a publisher we trust signed it: checked from its
        header and signature, before its body is decoded (a large manifest costs 0.1 s)."""
        try:
            inner = self.node.codec.decode(frame, time.time()).body.frame
            kind, signer = self.node.codec.precheck(inner)
        except MessageRejected as exc:  # the gate runs only for this kind: the body is a ManifestAnnounce
            return f"not a signed manifest announcement ({exc})"
        if signer not in self.config.trusted_publishers:
            return f"manifest signed by {signer}, whom we do not trust"
        return None

    def penalise(self, peer: str, amount: float, reason: str) -> None:
        """Score `peer` down in the peer table (banned when it repeats); say so once."""
        for effect in self.node.peertable.penalise(trio.current_time(), peer, amount):
            self.node.carry_out(PEER_TABLE_CORE, effect)
        log.warning("penalised %s by %s: %s", peer, amount, reason)

    async def open_stream(self, peer: str) -> trio.SocketStream:
        """A data connection to `peer`'s relay channel, both ends authenticated. An address that
        answers as another peer (WrongPeer, still a PeerUnavailable) costs the peer that
        advertised it. A peer whose heartbeat has not brought us its address within
        `request_timeout_s` raises `AddressUnknown` (the upstream fails its requests as
        `no_address`); a peer the table bans, PeerUnavailable."""
        address = await self._data_addr_soon(peer)
        if address is None and self.node.peertable.is_banned(peer, trio.current_time()):
            raise PeerUnavailable(f"{peer} is banned")
        if address is None:  # nobody's fault yet: the core asks again soon (`no_address`)
            raise AddressUnknown(f"no data address known for {peer} after {self.config.request_timeout_s:g} s: "
                                 "its heartbeat has not reached us yet")
        try:
            return await open_data_stream(address, CHANNEL, codec=self.node.codec, peer=peer)
        except WrongPeer as exc:
            self.penalise(peer, WRONG_ADDRESS_PENALTY, f"its data address is not its own: {exc}")
            raise

    async def _data_addr_soon(self, peer: str) -> str | None:
        """`peer`'s data address, waiting up to `request_timeout_s` for its heartbeat when we have
        heard of it (a Holding, a manifest) before its heartbeat reached our peer table, as a
        peer that just started does. Heartbeats may come further apart than that (up to the peer
        table's `max_interval_s`, 30 s, past 150 peers; more while busy): what fails here fails
        as nobody's fault (`AddressUnknown`, `no_address`), and the core asks again soon."""
        address = self.data_addr(peer)
        if address is not None or self.node.peertable.is_banned(peer, trio.current_time()):
            return address  # a banned peer is not waited for
        table = self.node.peertable
        await self.node.wait_for_peers(lambda: self.data_addr(peer) is not None
                                       or table.is_banned(peer, trio.current_time()), self.config.request_timeout_s)
        return self.data_addr(peer)  # woken by a join, a known peer's new address, or its ban (a ban of
        # a peer the table does not know yet emits nothing: that wait runs to its timeout)

    async def report_failed(self, peer: str, fetch: Fetch, reason: FetchFailure,
                            upstream: Upstream | None = None) -> None:
        """Tell the core that `fetch` failed at `peer` for `reason`. From an `upstream`: not told
        if the core has dropped it (`dropped`: a `DropSource` emitted, carried out or not yet, as
        it was `peer`'s upstream or before it was made: `_divert`, `_upstream`), for every request
        of that upstream was asked before that drop, which took them all back. Told, such a report,
        on its way to the runner as the core dropped `peer` and asked it again (`relay.sources`,
        `_instead_of_origin`, asks a member dropped as slow), took back that newer request and
        passed the old connection's end off as the verdict on `peer`."""
        def failed(now: float) -> list[Any]:
            if upstream is not None and upstream.dropped:  # (read in the runner, after any drop before)
                return []
            return self.core.fetch_failed(now, peer, fetch.version, fetch.index, reason)

        await self._command(failed)

    async def _fetch_manifest(self, ask: FetchManifest) -> None:
        # unknown now: our deadline runs while we wait for its heartbeat, and may end just after
        # the address came, before the holder could answer (`TooSlowError`): no verdict on it
        waited = self.data_addr(ask.peer) is None
        reason: FetchFailure | None = FetchFailure.UNAVAILABLE  # it answered that it does not hold the version
        try:
            with trio.fail_after(self.config.request_timeout_s):
                stream = await self.open_stream(ask.peer)
                async with stream:
                    await send_frame(stream, ChunkRequest(OP_MANIFEST, 0, ask.version, 0, bytes(32)).pack())
                    reader = FrameReader(stream, max_frame_bytes=RESPONSE.size)
                    header = ChunkResponse.unpack(await read_frame(reader))
                    if header.length > MAX_MANIFEST_BYTES:
                        raise ValueError(f"a manifest of {header.length} bytes")
                    frame = await reader.exactly(header.length) if header.status == STATUS_OK else None
                    if header.status not in _MANIFEST_STATUSES:  # a newer peer's: no verdict (`manifest_declined`)
                        reason = None
        except (PeerUnavailable, MessageRejected, trio.TooSlowError, trio.BrokenResourceError, OSError,
                ValueError) as exc:  # (MessageRejected: a frame longer than a response)
            log.info("manifest %d from %s: %s", ask.version, ask.peer, exc)
            frame = None
            if isinstance(exc, NotAdmitted):  # it has not heard us yet: our heartbeat, before the core asks again
                await self.node.introduce(ask.peer)
                reason = FetchFailure.NOT_ADMITTED
            elif isinstance(exc, AddressUnknown) or (isinstance(exc, trio.TooSlowError) and waited):
                # its heartbeat had not reached us (our deadline ended the wait for it, or the
                # exchange the wait left too little time for)
                reason = FetchFailure.NO_ADDRESS
            elif isinstance(exc, (MessageRejected, ValueError)):  # it broke the protocol
                reason = FetchFailure.CORRUPT
            else:  # no connection, or no answer in time with its address known (slow)
                reason = FetchFailure.UNREACHABLE
        if frame is None:  # another holder that named the version is asked at once (`relay.manifest_asks`)
            if reason is None:  # (no verdict on this one)
                await self._command(lambda now: self.core.manifest_declined(now, ask.peer, ask.version, ask.asked_at))
                return
            failure = reason
            await self._command(lambda now: self.core.manifest_failed(now, ask.peer, ask.version, failure,
                                                                         ask.asked_at))
            return
        answer = frame
        await self._command(lambda now: self.core.manifest_answer(now, ask.peer, ask.version, answer, ask.asked_at))
