"""The relay role's serving side: one requester's data connection, each of its requests answered.

Mixed into `relay.role.RelayRole` (`ChunkServing`), which registers `_serve` for the data-plane
channel `relay/chunks` (`relay.role.CHANNEL`): a connection authenticated by the data plane
carries up to `MAX_REQUESTS_PER_CONNECTION` requests at once, each a manifest (`OP_MANIFEST`) or
a chunk, answered in any order as soon as we can (`_answer`, `_respond`).

The server side answers a request once it holds the chunk (waiting up to `request_timeout_s`
for it to arrive: this is how chunks are forwarded as soon as they are verified; but "unavailable"
at once to the peer we have asked for that chunk ourselves, `ServingCore.ask`), serving at
most `max_concurrent_uploads` at once (more when the core asks for them with `ServeAtOnce`:
all our children, in a plan of small fan-outs; a chunk served for `upload_linger` times our
typical serving time stops holding its slot: a slow downloader does not hold up the others),
requests flagged urgent (the requester forwards that
stripe) first (`relay.serving.ServingCore`, the same core the simulator drives, through
`relay.uploads`), each chunk sent from its file by `os.sendfile` (the page cache
is the cache), never more than `[peer] upload_bps` (`--upload-bps`) a second in all: a token
bucket with one second of burst, paid before a chunk is sent. A requester that stops reading
the answers is penalised (`STALLED_READER_PENALTY`) and its connection closed.

These methods read the role's `config`, `store`, `core` and `corrupt_chunks` (the test hook
that flips a byte in every chunk served: see `relay.role`), queue for upload slots in its
`_uploads`, pace with its byte budgets (`_budgets` per peer, `_upload` for all we serve), and
keep its serving counters (`served`, `serving_now`, `bytes_served`, `bytes_served_to`,
`_serving_window`, `_moved_at`); they call its `_command(fn)` (the core asked for a chunk we do
not hold) and `penalise(peer, amount, reason)`. Their log lines go to the role's logger.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable

import trio

from p2pnet.dataplane import send_file, send_frame
from p2pnet.errors import MessageRejected, PeerUnavailable
from relay.errors import ChunkMissing, VersionUnknown
from relay.manifest import chunk_size
from relay.metrics import BytesByRole
from relay.messages import MAX_QUEUED_US, OP_MANIFEST, STATUS_OK, STATUS_UNAVAILABLE, ChunkRequest, ChunkResponse
from relay.serving import ByteBudget
from relay.upstream import OP_URGENT

if TYPE_CHECKING:
    from pathlib import Path

    from p2pnet.dataplane import FrameReader
    from relay.config import RelayConfig
    from relay.store import ChunkStore
    from relay.transfer import TransferCore
    from relay.uploads import Uploads

log = logging.getLogger("relay.role")  # the role's logger: its log lines keep their name

MAX_REQUESTS_PER_CONNECTION = 256
STALLED_READER_PENALTY = 3.0  # asked for chunks and stopped reading the answers


class ChunkServing:
    """Serving chunks and manifests for `relay.role.RelayRole` (see the module docstring)."""

    # the role's state these methods use (`RelayRole.__init__` sets it)
    config: RelayConfig
    store: ChunkStore
    core: TransferCore
    corrupt_chunks: bool
    _uploads: Uploads
    _budgets: dict[str, ByteBudget]
    _upload: ByteBudget
    served: dict[str, int]
    serving_now: dict[str, int]
    bytes_served: int
    bytes_served_to: dict[str, int]
    bytes_by_role: BytesByRole
    _serving_window: tuple[float, float] | None
    _moved_at: float

    if TYPE_CHECKING:  # what these call on the role (`relay.role.RelayRole`)
        async def _command(self, fn: Callable[[float], list[Any]]) -> None: ...
        def penalise(self, peer: str, amount: float, reason: str) -> None: ...

    async def _serve(self, stream: trio.SocketStream, reader: FrameReader, client: str) -> None:
        """One requester's connection (`client`, authenticated by the data plane): answer each
        request when we can, in any order. A connection with nothing asked and nothing owed for
        `idle_timeout_s` is closed (a requester closes its own first, at half of its bound; one
        that asks as we close asks again on a new connection: `relay.upstream`); so is one whose
        requester stops reading (see `_respond`)."""
        send_lock = trio.Lock()
        pending = trio.CapacityLimiter(MAX_REQUESTS_PER_CONNECTION)
        async with trio.open_nursery() as nursery:
            try:
                while True:
                    with trio.move_on_after(self.config.idle_timeout_s) as idle:
                        frame = await reader.frame()
                    if idle.cancelled_caught:
                        if pending.borrowed_tokens:
                            continue  # we still owe answers: not idle
                        log.info("closing the idle data connection of %s", client)
                        break
                    if frame is None:
                        break  # the requester hung up: drop what it still waits for
                    request = _parse_request(frame)
                    # a borrower of its own per request: a requester that sends one twice (equal
                    # frames, equal keys) must not meet trio's refusal of a second token to one borrower
                    borrower = object()
                    await pending.acquire_on_behalf_of(borrower)
                    nursery.start_soon(self._answer, stream, send_lock, client, request, pending,
                                       nursery.cancel_scope, borrower)
            except ValueError as exc:
                log.info("garbage chunk request from %s: %s", client, exc)
            except (PeerUnavailable, MessageRejected, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                log.info("chunk requests from %s ended: %s", client, exc)
            finally:
                nursery.cancel_scope.cancel()

    async def _answer(self, stream: trio.SocketStream, send_lock: trio.Lock, client: str,
                      request: tuple[ChunkRequest, bool], pending: trio.CapacityLimiter,
                      connection: trio.CancelScope, borrower: object) -> None:
        req, urgent = request
        reserved: list[tuple[ByteBudget, int]] = []  # bytes paced for and not sent yet: refunded on the way out
        try:
            if req.op == OP_MANIFEST:
                try:
                    frame: bytes | None = self.store.manifest(req.version).frame
                except VersionUnknown:
                    frame = None
                await self._respond(stream, send_lock, req.request_id, frame)
                return
            held = self.store.holds(req.version, req.index)
            if not held:  # the core decides whether to fetch it another way (`TransferCore.asked_for`)
                await self._command(lambda now: self.core.asked_for(now, req.version, req.index))
                held = self.store.holds(req.version, req.index)
            # whom we asked for it ourselves (after `asked_for`, which may have asked again elsewhere): if
            # `client`, it is refused at once, or each of us would wait on the other (`ServingCore.ask`)
            asked_of = None if held else self.core.asking(req.version, req.index)
            if self.config.serve_bytes_per_peer_s and held:  # a peer's budget is spent waiting, not holding a slot
                budget = self._budgets.setdefault(client, ByteBudget(self.config.serve_bytes_per_peer_s))
                nbytes = self._size_of(req)
                reserved.append((budget, nbytes))
                await trio.sleep(budget.reserve(trio.current_time(), nbytes))
            async with self._uploads.turn(client, req.version, req.index, urgent, held, asked_of) as queued_s:
                if queued_s is None or not self._matches(req.version, req.index, req.digest):
                    await self._respond(stream, send_lock, req.request_id, None)  # not here in time, or not this
                    return
                size = self._size_of(req)
                self.serving_now[client] = self.serving_now.get(client, 0) + 1
                try:
                    reserved.append((self._upload, size))
                    paced_s = self._upload.reserve(trio.current_time(), size)
                    await trio.sleep(paced_s)
                    queued_s += paced_s  # our upload budget is our slowness too: the requester times it
                    if not await self._verified(req.version, req.index):
                        raise ChunkMissing(f"chunk {req.index} of version {req.version} was rotten")
                    if self.corrupt_chunks:
                        data = await trio.to_thread.run_sync(self.store.read_chunk, req.version, req.index)
                        await self._respond(stream, send_lock, req.request_id, bytes([data[0] ^ 0xFF]) + data[1:],
                                            queued_s=queued_s, reserved=reserved)
                    else:
                        await self._respond(stream, send_lock, req.request_id,
                                            self.store.segments(req.version, req.index), size, queued_s, reserved)
                    self.served[client] = self.served.get(client, 0) + 1
                    self.bytes_served += size
                    self.bytes_served_to[client] = self.bytes_served_to.get(client, 0) + size
                    self.bytes_by_role.add(self.bytes_by_role.served, client, size)
                    now = self._moved_at = trio.current_time()
                    self._serving_window = (self._serving_window or (now, now))[0], now
                except (ChunkMissing, VersionUnknown, FileNotFoundError):  # rotten, or collected meanwhile
                    await self._respond(stream, send_lock, req.request_id, None)
                finally:
                    self.serving_now[client] -= 1
                    if not self.serving_now[client]:
                        del self.serving_now[client]
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("chunk answers to %s ended: %s", client, exc)
            connection.cancel()
        except trio.TooSlowError:
            self.penalise(client, STALLED_READER_PENALTY,
                          f"took nothing of an answer for {self.config.send_timeout_s}s (holding an upload slot)")
            connection.cancel()
        except OSError as exc:  # our disk: the requester asks elsewhere
            log.error("serving chunk %d of version %d: %s", req.index, req.version, exc)
            connection.cancel()
        finally:
            for budget, nbytes in reserved:
                budget.refund(nbytes)
            pending.release_on_behalf_of(borrower)

    def _matches(self, version: int, index: int, digest: bytes) -> bool:
        """Whether we hold chunk `index` of `version` and it is the one asked for (by digest)."""
        try:
            signed = self.store.manifest(version)
        except VersionUnknown:
            return False
        return 0 <= index < len(signed.manifest.chunk_digests) and signed.manifest.chunk_digests[index] == digest \
            and self.store.holds(version, index)

    def _size_of(self, req: ChunkRequest) -> int:
        try:
            return chunk_size(self.store.manifest(req.version).manifest, req.index)
        except (VersionUnknown, IndexError, ValueError):
            return 0

    async def _verified(self, version: int, index: int) -> bool:
        """Held and good: a chunk only claimed by the bitmap since a restart is hashed first."""
        if self.store.is_verified(version, index):
            return True
        return await trio.to_thread.run_sync(self.store.ensure_verified, version, index)

    async def _respond(self, stream: trio.SocketStream, send_lock: trio.Lock, request_id: int,
                       payload: bytes | list[tuple[Path, int, int]] | None, length: int = 0,
                       queued_s: float = 0.0, reserved: list[tuple[ByteBudget, int]] | None = None) -> None:
        """Send one answer: `payload` bytes, the file pieces a chunk lies in (sent by the kernel,
        `length` bytes in all), or None for "unavailable"; `queued_s` (how long it waited for our
        upload) goes in the header. TooSlowError if the requester does not take the header
        within `send_timeout_s`, or then takes nothing of the chunk for that long (a reader that
        stops reading must not hold a slot; one reading slowly on a slow link, sharing our upload
        with many, is served). `reserved` (the
        budget paced for it, refunded by the caller if it is still there) is emptied as the
        header goes out: from then on those bytes are spent."""
        if payload is None:
            status, length = STATUS_UNAVAILABLE, 0
        else:
            status, length = STATUS_OK, (len(payload) if isinstance(payload, bytes) else length)
        fds: list[tuple[int, int, int]] = []
        try:
            for path, offset, count in payload if isinstance(payload, list) else ():
                fds.append((os.open(path, os.O_RDONLY), offset, count))  # before the header: it may be gone
            async with send_lock:
                with trio.fail_after(self.config.send_timeout_s):
                    queued_us = min(MAX_QUEUED_US, max(0, round(queued_s * 1e6)))
                    if reserved is not None:
                        reserved.clear()
                    await send_frame(stream, ChunkResponse(request_id, status, length, queued_us).pack())
                    if isinstance(payload, bytes):
                        await stream.send_all(payload)
                for fd, offset, count in fds:  # a chunk's bytes: however slowly, as long as they move
                    await send_file(stream, fd, offset, count, idle_s=self.config.send_timeout_s)
        finally:
            for fd, _, _ in fds:
                os.close(fd)


def _parse_request(frame: bytes) -> tuple[ChunkRequest, bool]:
    if frame and frame[0] & OP_URGENT:
        return ChunkRequest.unpack(bytes([frame[0] & ~OP_URGENT & 0xFF]) + frame[1:]), True
    return ChunkRequest.unpack(frame), False
