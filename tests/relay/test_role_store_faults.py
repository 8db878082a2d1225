"""The relay role's trio shell when its own store fails it, in virtual time (MockClock): a full
disk backs off and resumes, a chunk found rotten on disk is fetched again (and the version is not
reported complete meanwhile), a garbage-collected version is no longer reported.

The role runs its real core, runner, dispatcher and store; only the network is replaced: every
`Fetch` goes to `Source`, which answers from the publisher's store (when its gate is open). The
role's worker-thread calls run inline (`inline_threads`), so virtual time does not race real
threads and every run is the same.
"""

from __future__ import annotations

import errno
import logging
import math
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import trio
import trio.testing
from safetensors.numpy import save_file

from p2pnet.core import Emit
from p2pnet.driver import CoreRunner
from p2pnet.identity import Identity
from p2pnet.messages import Capacity
from p2pnet.node import Node, PeerNews
from p2pnet.peertable import LocalInfo
from p2pnet.errors import ConfigError, PeerUnavailable
from relay.errors import ChunkMissing, ManifestRejected, StoreFull
from relay.messages import Holding
from relay.metrics import RelayMetrics
from relay.role import RelayRole
import relay.store
from relay.store import ChunkStore
from tests.relay.disk import failing_fsyncs, in_version_folders, rot_chunk

PUBLISHER = Identity.from_seed_text("publisher")
ME = Identity.from_seed_text("relay")
CHUNK = 1024
CHUNKS = 16


@pytest.fixture
def clock():
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture(autouse=True)
def inline_threads(monkeypatch):
    """`trio.to_thread.run_sync` runs the function in the trio thread (after a checkpoint)."""

    async def run_sync(fn, *args, **kwargs):
        await trio.lowlevel.checkpoint()
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)


class FakeNode:
    """What the role uses of a node; records the effects it carries out."""

    def __init__(self, data_dir: Path) -> None:
        self.identity = ME
        self.peer_id = ME.peer_id
        self.config = SimpleNamespace(data_dir=data_dir, upload_bps=10**8)
        self.peertable = SimpleNamespace(penalise=lambda now, peer, amount: [], get=lambda peer: None,
                                         local=SimpleNamespace(capacity=SimpleNamespace(upload_bps=10**8)))
        self.carried: list = []
        self.peer_news = PeerNews()

    wait_for_peers = Node.wait_for_peers  # the real one, woken by `peer_news`

    def carry_out(self, origin: str, effect) -> None:
        self.carried.append(effect)

    def set_busy(self, role: str, busy: bool) -> None:
        self.busy = busy


class Source:
    """The publisher, as the role's upstream for every peer: answers fetches from its store."""

    def __init__(self, role: RelayRole, store: ChunkStore, nursery: trio.Nursery) -> None:
        self.role, self.store, self.nursery = role, store, nursery
        self.downloads: list[tuple[float, int, int]] = []  # (virtual time, version, index)
        self.gate = trio.Event()
        self.gate.set()
        self.answer_at_most: int | None = None  # then every later fetch hangs (a source gone quiet)

    def submit(self, fetch) -> None:
        self.nursery.start_soon(self._answer, fetch)

    async def _answer(self, fetch) -> None:
        await self.gate.wait()
        if self.answer_at_most is not None and len(self.downloads) >= self.answer_at_most:
            await trio.sleep_forever()
        self.downloads.append((trio.current_time(), fetch.version, fetch.index))
        data = self.store.read_chunk(fetch.version, fetch.index)
        await self.role.report_fetched(PUBLISHER.peer_id, fetch, data, 0.01)


def publish(store: ChunkStore, root: Path, version: int, chunks: int = CHUNKS):
    path = root / f"v{version}.safetensors"
    save_file({"w": np.random.default_rng(version).standard_normal(chunks * CHUNK // 4 - 40).astype(np.float32)},
              str(path))
    return store.publish_files(PUBLISHER, [path], model="m", version=version, previous_version=version - 1,
                               chunk_bytes=CHUNK, now_s=time.time())


async def start_shell(role: RelayRole, node: FakeNode, nursery: trio.Nursery) -> None:
    """What `RelayRole._run` starts of the role's shell: its core's runner (carrying effects out
    to `node`), the dispatcher and the teller of fetched chunks."""
    role._token = trio.lowlevel.current_trio_token()
    role._runner = CoreRunner(role._peeler, node, name="relay")
    await nursery.start(role._runner.run)
    nursery.start_soon(role._dispatch)
    nursery.start_soon(role._tell_fetched)


class Harness:
    def __init__(self, tmp_path: Path, **relay) -> None:
        self.origin = ChunkStore(tmp_path / "origin", budget_bytes=10**9, trusted_publishers=[PUBLISHER.peer_id],
                                 fsync=False)
        self.root = tmp_path
        section = {"trusted_publishers": [PUBLISHER.peer_id], "fsync": False, "max_concurrent_downloads": 2,
                   "stall_timeout_s": 30.0, **relay}
        self.node = FakeNode(tmp_path / "relay")
        self.role = RelayRole(self.node, section)
        self.source: Source | None = None

    async def start(self, nursery: trio.Nursery) -> None:
        role = self.role
        await start_shell(role, self.node, nursery)
        nursery.start_soon(role._flusher)
        self.source = Source(role, self.origin, nursery)
        role._upstream = lambda peer, nursery: self.source  # every fetch goes to the publisher's store
        await role._command(lambda now: role.core.set_members(now, {PUBLISHER.peer_id: 1e9}))

    async def announce(self, version: int, chunks: int = CHUNKS):
        signed = publish(self.origin, self.root, version, chunks)
        await self.role._command(lambda now: self.role.core.manifest_frame(now, PUBLISHER.peer_id, signed.frame))
        return signed

    async def until(self, check, limit_s: float) -> float:
        """Virtual seconds until `check()` holds (checked whenever every task is blocked)."""
        start = trio.current_time()
        with trio.fail_after(limit_s):
            while not check():
                await trio.testing.wait_all_tasks_blocked()
                if not check():
                    await trio.sleep(0.1)  # virtual: MockClock jumps
        return trio.current_time() - start

    def complete(self, version: int) -> bool:
        return version in self.role.status()["complete_versions"] and self.role.watcher.is_complete(version)


class FailingPuts:
    """The role's store's `put_chunk` raises OSError(`error`) while `failing` is set."""

    def __init__(self, h: Harness, monkeypatch, error: int, message: str) -> None:
        self.failing = True
        real_put = h.role.store.put_chunk

        def put_chunk(version, index, data, **kwargs):
            if self.failing:
                raise OSError(error, message)
            return real_put(version, index, data, **kwargs)

        monkeypatch.setattr(h.role.store, "put_chunk", put_chunk)


class FullBitmaps:
    """The role's store cannot write a bitmap that names every chunk of its version (the bitmap
    that completes it) while `full` is set: ENOSPC, counted in `failures`."""

    def __init__(self, h: Harness, monkeypatch, full: bool = True) -> None:
        self.full, self.failures = full, 0
        real_save = relay.store.save_bitmap

        def save_bitmap(path, manifest_id, held, count, *, fsync):  # type: ignore[no-untyped-def]
            if self.full and len(set(held)) == count and str(path).startswith(str(h.role.store.root)):
                self.failures += 1
                raise OSError(errno.ENOSPC, "injected: no room for the bitmap")
            real_save(path, manifest_id, held, count, fsync=fsync)

        monkeypatch.setattr(relay.store, "save_bitmap", save_bitmap)


def complete_on_disk(h: Harness, signed) -> bool:
    """Whether a restart would find `signed` complete and sound in the role's store."""
    store = ChunkStore(h.role.store.root, budget_bytes=10**9, trusted_publishers=[PUBLISHER.peer_id])
    try:
        return store.is_complete(signed) and store.verify(signed.version, everything=True) == []
    finally:
        store.close()


def store_full_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "relay.role" and r.levelno >= logging.WARNING and "store full" in r.getMessage()]


async def test_a_full_store_backs_off_says_so_once_per_hold_and_resumes_when_space_returns(tmp_path, clock, caplog):
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path, budget_bytes=3 * CHUNK)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        await h.announce(1)
        await h.until(lambda: h.role.backoff.active, 5)
        start = trio.current_time()
        with trio.move_on_after(300):  # five virtual minutes of a full disk
            await trio.sleep_forever()
        full_downloads = len(h.source.downloads)
        warnings = store_full_warnings(caplog)
        # holds of 1, 2, 4, 8, 16, 32, 60, 60, 60, 60 s: one warning each, not one per chunk
        assert 8 <= len(warnings) <= 11, warnings
        assert "60s" in warnings[-1] and "1s" in warnings[0]
        # only what was already in flight when the store first filled was downloaded: the probes
        # at the end of each hold ask the store for room before downloading anything
        assert full_downloads <= 3 + 2 * 4, h.source.downloads
        assert all(t - start < 1.0 for t, _, _ in h.source.downloads[3:])
        status = h.role.status()["store_backoff"]
        assert status["backing_off"] and status["hold_s"] == 60.0
        assert not h.complete(1)

        h.role.store.budget_bytes = 10**9  # space returns
        waited = await h.until(lambda: h.complete(1), 120)
        assert waited <= 61.0  # at the end of the current hold at the latest
        assert not h.role.status()["store_backoff"]["backing_off"]
        assert [r for r in caplog.records if "room again" in r.getMessage()]
        assert len(store_full_warnings(caplog)) == len(warnings)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("refusal", [ManifestRejected("conflict", "injected: a second manifest for the version"),
                                     OSError(errno.EIO, "injected: the disk fails")])
async def test_a_manifest_the_store_refuses_is_forgotten_in_the_runner_and_none_of_its_chunks_fetched(
        tmp_path, clock, monkeypatch, refusal):
    """The store will not keep version 1's manifest: the core forgets the version, as an input run
    by its runner like every other (whatever it returns is carried out: here a marker the test
    adds), no chunk of it is fetched (the fetches the core asked with the manifest are not sent),
    and the next version is fetched as usual."""
    h = Harness(tmp_path)
    real_add, real_forget = h.role.store.add_manifest, h.role.core.forget
    forgotten_in: list[str] = []

    def add_manifest(signed):
        if signed.version == 1:
            raise refusal
        return real_add(signed)

    def forget(version: int) -> list:
        forgotten_in.append(trio.lowlevel.current_task().name)
        return (real_forget(version) or []) + [Emit(("forgotten", version))]  # (it returned None before)

    monkeypatch.setattr(h.role.store, "add_manifest", add_manifest)
    monkeypatch.setattr(h.role.core, "forget", forget)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        await h.announce(1)
        await h.until(lambda: bool(forgotten_in), 30)
        await trio.testing.wait_all_tasks_blocked()
        assert not h.role.core.knows(1) and 1 not in h.role.status()["complete_versions"]
        assert Emit(("forgotten", 1)) in h.node.carried  # its effects were carried out
        assert len(forgotten_in) == 1 and forgotten_in[0].endswith("CoreRunner.run"), forgotten_in
        await h.announce(2)
        await h.until(lambda: h.complete(2), 30)
        assert {version for _, version, _ in h.source.downloads} == {2}
        assert not h.role.core.knows(1)
        nursery.cancel_scope.cancel()


async def test_a_chunk_rotten_on_disk_is_fetched_again_and_the_version_is_not_complete_meanwhile(tmp_path, clock):
    h = Harness(tmp_path)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        await h.announce(1)
        await h.until(lambda: h.complete(1), 30)
        rot_chunk(h.role.store, 1, 5)
        h.source.gate = trio.Event()  # hold the re-fetch so the gap can be seen
        with pytest.raises(ChunkMissing):
            h.role.store.read_chunk(1, 5)  # a read finds it: dropped, and the role is told
        await h.until(lambda: not h.role.watcher.is_complete(1), 5)
        status = h.role.status()
        assert status["complete_versions"] == [] and not status["versions"][0]["complete"]
        assert h.role.core.progress(trio.current_time(), 1)["chunks_have"] == CHUNKS - 1
        h.node.carried.clear()
        await h.until(lambda: h.role.core.status(trio.current_time())["progress"][0]["in_flight"] == 1, 5)
        with trio.move_on_after(12):  # a few announce intervals: the incomplete version is not announced
            await trio.sleep_forever()
        assert not [e for e in h.node.carried if isinstance(getattr(e, "body", None), Holding)]
        h.source.gate.set()
        await h.until(lambda: h.complete(1), 30)
        assert h.source.downloads[-1][1:] == (1, 5)
        out = tmp_path / "out"
        reply = await h.role._cmd_fetch({"version": 1, "out_dir": str(out)}, lambda progress: None)
        assert Path(reply["files"][0]).read_bytes() == (tmp_path / "v1.safetensors").read_bytes()
        nursery.cancel_scope.cancel()


async def test_checkpoint_fetch_that_finds_a_rotten_chunk_waits_for_it_and_exports_byte_identical_files(
        tmp_path, clock):
    h = Harness(tmp_path)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        await h.announce(1)
        await h.until(lambda: h.complete(1), 30)
        rot_chunk(h.role.store, 1, 0)
        replies: list = []

        async def reply(message) -> None:
            replies.append(message)

        with trio.fail_after(60):
            answer = await h.role._cmd_fetch({"version": 1, "out_dir": str(tmp_path / "out"), "timeout_s": 50},
                                             reply)
        assert Path(answer["files"][0]).read_bytes() == (tmp_path / "v1.safetensors").read_bytes()
        assert h.source.downloads[-1][1:] == (1, 0) and h.complete(1)
        nursery.cancel_scope.cancel()


async def test_a_garbage_collected_version_is_no_longer_reported_or_announced(tmp_path, clock):
    one_version = CHUNKS * CHUNK
    h = Harness(tmp_path, keep_versions=2, budget_bytes=int(2.5 * one_version))
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        for version in (1, 2):
            await h.announce(version)
            await h.until(lambda v=version: h.complete(v), 30)
        assert h.role.status()["complete_versions"] == [1, 2]
        await h.announce(3)  # over budget halfway: collection drops version 1
        await h.until(lambda: h.complete(3), 60)
        status = h.role.status()
        assert status["complete_versions"] == [2, 3] and [v["version"] for v in status["versions"]] == [2, 3]
        assert not h.role.watcher.is_complete(1) and not h.role.core.knows(1)
        h.node.carried.clear()
        with trio.move_on_after(30):
            await trio.sleep_forever()
        announced = {hv.version for e in h.node.carried if isinstance(getattr(e, "body", None), Holding)
                     for hv in e.body.versions}
        assert announced == {2, 3}
        nursery.cancel_scope.cancel()


async def test_a_disk_that_raises_enospc_backs_off_the_same_way(tmp_path, clock, caplog, monkeypatch):
    h = Harness(tmp_path)
    disk = FailingPuts(h, monkeypatch, errno.ENOSPC, "No space left on device")  # e.g. a batched fsync
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        await h.announce(1)
        with trio.move_on_after(30):
            await trio.sleep_forever()
        warnings = store_full_warnings(caplog)
        assert 4 <= len(warnings) <= 6, warnings  # holds of 1, 2, 4, 8, 16 s
        assert len(h.source.downloads) <= 4 * (len(warnings) + 1)  # one window of probes per hold
        disk.failing = False
        await h.until(lambda: h.complete(1), 40)
        assert not h.role.backoff.active
        nursery.cancel_scope.cancel()


def store_failing_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "relay.role" and r.levelno >= logging.WARNING and "store failing" in r.getMessage()]


async def test_a_disk_that_fails_every_put_with_eio_is_paced_not_fed_chunks_at_network_speed(
        tmp_path, clock, caplog, monkeypatch):
    """EIO is not a full disk, but fetching on at network speed into a disk that fails every
    write only burns the network: the same hold (1 s doubling), said once per hold, and the
    disk that works again ends it at the first durable flush."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path)
    disk = FailingPuts(h, monkeypatch, errno.EIO, "Input/output error")
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        h.source.answer_at_most = 200  # without a hold the retries would never let virtual time pass
        await h.announce(1)
        with trio.move_on_after(30):
            await trio.sleep_forever()
        warnings = store_failing_warnings(caplog)
        assert 4 <= len(warnings) <= 6, warnings  # holds of 1, 2, 4, 8, 16 s
        assert "Input/output error" in warnings[0] and not store_full_warnings(caplog)
        assert len(h.source.downloads) <= 4 * (len(warnings) + 1), len(h.source.downloads)  # one window per hold
        assert h.role.status()["store_backoff"]["backing_off"] and not h.complete(1)
        disk.failing = False
        await h.until(lambda: h.complete(1), 40)
        assert not h.role.backoff.active
        assert [r for r in caplog.records if "store takes writes again" in r.getMessage()]
        nursery.cancel_scope.cancel()


async def test_a_background_flush_that_keeps_failing_with_eio_holds_requests_instead_of_refetching(
        tmp_path, clock, caplog, monkeypatch):
    """Every fsync fails with EIO: each failure loses its batch, which is fetched again; without a
    hold that loop runs at network speed. It is paced like a full disk, and completes durable once
    the disk works again."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path, fsync=True, fsync_batch_chunks=4)
    disk = failing_fsyncs(monkeypatch, math.inf, errno.EIO, which=in_version_folders)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        h.source.answer_at_most = 400
        signed = await h.announce(1)
        await h.until(lambda: h.role.backoff.active, 30)
        with trio.move_on_after(30):  # thirty virtual seconds of a failing disk
            await trio.sleep_forever()
        holds = [w.split("requests for ")[1].split("s ")[0] for w in store_failing_warnings(caplog)]
        assert holds[:4] == ["1", "2", "4", "8"] and len(holds) <= 6, holds
        assert len(h.source.downloads) <= 2 * CHUNKS + 4 * len(holds), len(h.source.downloads)
        assert h.role.backoff.active and not h.complete(1)
        disk.failing = False
        await h.until(lambda: h.complete(1), 60)
        assert not h.role.backoff.active
        assert complete_on_disk(h, signed)
        nursery.cancel_scope.cancel()


async def test_checkpoint_wait_answers_once_the_version_is_complete_with_its_folder(tmp_path, clock):
    h = Harness(tmp_path)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        answers: dict = {}

        async def wait(key, version) -> None:
            answers[key] = await h.role._cmd_wait({"version": version, "timeout_s": 100}, None)

        nursery.start_soon(wait, "one", 1)
        nursery.start_soon(wait, "latest", "latest")
        await trio.testing.wait_all_tasks_blocked()
        assert answers == {}  # nothing is complete yet: both wait
        await h.announce(1)
        await h.until(lambda: len(answers) == 2, 30)
        assert answers["one"] == answers["latest"]
        folder = Path(answers["one"]["dir"])
        assert answers["one"]["version"] == 1 and folder.is_dir()
        assert [Path(f).read_bytes() for f in answers["one"]["files"]] == [(tmp_path / "v1.safetensors").read_bytes()]
        with pytest.raises(PeerUnavailable, match="version 7 is unknown here after 5s"):
            await h.role._cmd_wait({"version": 7, "timeout_s": 5}, None)
        with pytest.raises(ConfigError, match="latest"):
            await h.role._cmd_wait({"version": "newest"}, None)
        nursery.cancel_scope.cancel()


async def publish_sharing(h: Harness, tmp_path: Path, version: int):
    """Version `version`: a file every version shares (8 chunks) and one of its own; announced."""
    shared = tmp_path / "frozen.safetensors"
    if not shared.exists():
        save_file({"frozen": np.random.default_rng(9).standard_normal(8 * CHUNK // 4).astype(np.float32)},
                  str(shared))
    folder = tmp_path / f"src{version}"
    folder.mkdir()
    moving = folder / "moving.safetensors"
    save_file({"moving": np.full(4 * CHUNK // 4, version, dtype=np.float32)}, str(moving))
    signed = h.origin.publish_files(PUBLISHER, [shared, moving], model="m", version=version, chunk_bytes=CHUNK,
                                    now_s=time.time(), place="copy")
    await h.role._command(lambda now: h.role.core.manifest_frame(now, PUBLISHER.peer_id, signed.frame))
    return signed


def shared_with(signed, held) -> list[int]:
    """The chunks of `signed` whose digests `held` (a signed manifest) has too."""
    digests = set(held.manifest.chunk_digests)
    return [i for i, d in enumerate(signed.manifest.chunk_digests) if d in digests]


async def test_a_version_that_shares_chunks_with_a_held_one_fetches_only_the_rest(tmp_path, clock):
    h = Harness(tmp_path)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        signed = {}
        for version in (1, 2):
            signed[version] = await publish_sharing(h, tmp_path, version)
            await h.until(lambda v=version: h.complete(v), 30)
        fetched_for_two = [index for _, version, index in h.source.downloads if version == 2]
        reused = shared_with(signed[2], signed[1])
        count = len(signed[2].manifest.chunk_digests)
        assert len(set(signed[2].manifest.chunk_digests)) > 1 and len(reused) >= 8
        assert sorted(fetched_for_two) == [i for i in range(count) if i not in reused]
        out = await h.role._cmd_fetch({"version": 2, "out_dir": str(tmp_path / "out")}, lambda progress: None)
        assert [Path(f).read_bytes() for f in out["files"]] == [p.read_bytes() for p in h.origin.version_files(2)]
        nursery.cancel_scope.cancel()


async def test_a_disk_that_fails_while_shared_chunks_are_copied_keeps_the_version_and_fetches_the_rest(
        tmp_path, clock, caplog, monkeypatch):
    """Copying the chunks a new version shares with a held one, the third put fails with EIO. The
    version is kept (it used to be dropped whole, and nothing fetched it), the two chunks copied
    stay copied, everything else is fetched, and the version completes."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path)
    real_put, puts = h.role.store.put_chunk, []

    def put_chunk(version, index, data, **kwargs):
        puts.append((version, index))
        if puts.count((version, index)) == 1 and [v for v, _ in puts].count(2) == 3:
            raise OSError(errno.EIO, "Input/output error")
        return real_put(version, index, data, **kwargs)

    monkeypatch.setattr(h.role.store, "put_chunk", put_chunk)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        one = await publish_sharing(h, tmp_path, 1)
        await h.until(lambda: h.complete(1), 30)
        two = await publish_sharing(h, tmp_path, 2)
        failed_at = trio.current_time()  # (the copy runs after this: `_dispatch` takes the manifest next)
        await h.until(lambda: h.complete(2), 60)
        reused = shared_with(two, one)
        copied = [i for v, i in puts if v == 2][:2]
        assert copied == reused[:2] and len(reused) >= 8
        fetched_for_two = sorted(index for _, version, index in h.source.downloads if version == 2)
        assert fetched_for_two == [i for i in range(len(two.manifest.chunk_digests)) if i not in copied]
        assert not [r for r in caplog.records if "cannot keep version 2" in r.getMessage()]
        assert [r for r in caplog.records if "copying the chunks it shares with a held version stopped after 2" in r.getMessage()]
        # the failing disk holds new requests, as a failing put does: nothing of version 2 is
        # downloaded (into that disk) before the first hold (1 s) is over
        assert len(store_failing_warnings(caplog)) == 1
        assert all(t >= failed_at + 1.0 for t, version, _ in h.source.downloads if version == 2), h.source.downloads
        nursery.cancel_scope.cancel()


async def test_a_copy_of_shared_chunks_whose_last_bitmap_write_fails_completes_only_once_it_is_durable(
        tmp_path, clock, caplog, monkeypatch):
    """Version 2 is version 1's file again: every chunk is copied, none fetched. The put that
    completes the copy fsyncs, then cannot write the bitmap (a full disk), so the chunks of that
    last batch are held but not durable. The version must not be complete (announced, handed to
    workers) until they are: the core hears `found` only for durable chunks, asks for the others,
    and a flush makes them durable first; the full disk holds requests meanwhile. Nothing is
    downloaded for version 2."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path, fsync=True, fsync_batch_chunks=4)
    shared = tmp_path / "same.safetensors"
    save_file({"w": np.random.default_rng(5).standard_normal(8 * CHUNK // 4).astype(np.float32)}, str(shared))
    disk = FullBitmaps(h, monkeypatch, full=False)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        signed = {}
        for version in (1, 2):
            signed[version] = h.origin.publish_files(PUBLISHER, [shared], model="m", version=version,
                                                     chunk_bytes=CHUNK, now_s=time.time(), place="copy")
            disk.full = version == 2  # (version 1 is durable and complete: its bitmap is not written again)
            await h.role._command(lambda now, v=version: h.role.core.manifest_frame(now, PUBLISHER.peer_id,
                                                                                    signed[v].frame))
            if version == 1:
                await h.until(lambda: h.complete(1), 30)
        two = signed[2]
        assert shared_with(two, signed[1]) == list(range(len(two.manifest.chunk_digests)))
        await h.until(lambda: disk.failures >= 1, 30)  # the copy's last put
        await trio.testing.wait_all_tasks_blocked()
        assert not h.role.watcher.is_complete(2) and 2 not in h.role.core.complete_versions()
        await h.until(lambda: disk.failures >= 2, 60)  # asked for again: a flush first, which fails
        assert h.role.backoff.active and not h.complete(2)
        assert not complete_on_disk(h, two)  # what a restart would believe: not all of it
        disk.full = False
        await h.until(lambda: h.complete(2), 120)
        assert not [index for _, version, index in h.source.downloads if version == 2]
        assert complete_on_disk(h, two)
        nursery.cancel_scope.cancel()


async def test_the_status_shows_what_uploads_deliver_while_every_slot_is_busy(tmp_path, clock):
    h = Harness(tmp_path)
    role = h.role
    assert role.status()["upload_measured_bps"] is None  # nothing measured yet
    role._uploads_full(True)  # every upload slot taken: our upload is the bottleneck
    await trio.sleep(5)
    role.bytes_served = 50_000_000
    assert role.status()["upload_measured_bps"] == 10_000_000
    assert role.status()["upload_limit_bps"] == 10**8


async def test_the_role_sets_its_upload_slots_when_the_core_asks(tmp_path, clock):
    """`ServeAtOnce` from the transfer core reaches the role's serving core through the peeler
    and the dispatcher (the simulator's path is in tests/conformance)."""
    from relay.effects import ServeAtOnce

    h = Harness(tmp_path, max_concurrent_uploads=4)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        serving = h.role._uploads.core
        assert serving.status()["slots"] == 4
        await h.role._command(lambda now: [ServeAtOnce(9)])
        await h.until(lambda: serving.status()["slots"] == 9, 5)
        await h.role._command(lambda now: [ServeAtOnce(0)])
        await h.until(lambda: serving.status()["slots"] == 4, 5)
        nursery.cancel_scope.cancel()


async def test_a_request_for_a_chunk_not_held_is_told_to_the_transfer_core(tmp_path, clock):
    """The role's server tells the core of each request for a chunk it does not hold
    (`TransferCore.asked_for`: the core may fetch it another way), before the request waits."""
    from relay.messages import ChunkRequest, OP_CHUNK

    h = Harness(tmp_path)
    told = []
    real = h.role.core.asked_for
    h.role.core.asked_for = lambda now, version, index: told.append((version, index)) or real(now, version, index)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        request = (ChunkRequest(OP_CHUNK, 1, 7, 3, bytes(32)), False)
        pending, borrower = trio.CapacityLimiter(1), object()
        await pending.acquire_on_behalf_of(borrower)  # as the connection's reader does
        nursery.start_soon(h.role._answer, None, trio.Lock(), "asker", request, pending, trio.CancelScope(),
                           borrower)
        await h.until(lambda: told == [(7, 3)], 5)
        nursery.cancel_scope.cancel()


async def test_a_serve_cancelled_while_paced_gives_its_bytes_back_to_the_upload_budget(tmp_path, clock):
    """A requester that goes away while its chunk waits for our upload budget (`--upload-bps`)
    spent none of it: the next serve is paced as if that one never was (else every cancelled
    request would delay every later one by its size)."""
    from relay.messages import ChunkRequest, OP_CHUNK
    from relay.serving import ByteBudget

    h = Harness(tmp_path)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        signed = await h.announce(1)
        await h.until(lambda: h.complete(1), 30)
        h.role._upload = budget = ByteBudget(CHUNK)  # one chunk a second
        assert budget.reserve(trio.current_time(), CHUNK) == 0.0  # its one second of burst, spent
        start = trio.current_time()
        request = (ChunkRequest(OP_CHUNK, 1, 1, 0, signed.manifest.chunk_digests[0]), False)
        pending, borrower = trio.CapacityLimiter(1), object()
        await pending.acquire_on_behalf_of(borrower)
        with trio.move_on_after(0.5):  # the requester hangs up half way through the wait
            await h.role._answer(None, trio.Lock(), "asker", request, pending, trio.CancelScope(), borrower)
        assert trio.current_time() - start == pytest.approx(0.5)
        assert budget.reserve(trio.current_time(), CHUNK) == pytest.approx(0.5)  # 1.5 s without the refund
        nursery.cancel_scope.cancel()


async def test_uploads_that_deliver_less_than_configured_are_advertised_as_measured(tmp_path, clock):
    h = Harness(tmp_path)  # configured: 100 MB/s
    local = LocalInfo(addrs=(), data_addr="", roles=("relay",), capacity=Capacity(10**8, 10**8, 10**9))
    h.node.peertable = SimpleNamespace(local=local, set_local=lambda info: setattr(h.node.peertable, "local", info))
    role = h.role
    role._advertise_upload()
    assert h.node.peertable.local.capacity.upload_bps == 10**8  # nothing measured: as configured
    role._uploads_full(True)  # every upload slot taken: our upload is the bottleneck
    await trio.sleep(5)
    role.bytes_served = 50_000_000  # 10 MB/s delivered meanwhile
    role._advertise_upload()
    assert h.node.peertable.local.capacity.upload_bps == 10_000_000
    assert role.status()["upload_advertised_bps"] == 10_000_000
    role._uploads_full(False)
    await trio.sleep(40)  # the measure has left the window: the configured figure again
    role._advertise_upload()
    assert h.node.peertable.local.capacity.upload_bps == 10**8


async def test_state_stays_flat_over_a_thousand_versions_and_only_held_ones_are_announced(tmp_path, clock):
    """What each version leaves behind in the role and its transfer core is dropped when the
    store collects it: after 1,000 versions they know what the store keeps, and memory held by
    the role is the same as after the first 200."""
    import gc
    import tracemalloc

    def ours() -> int:
        """Bytes allocated by the project's code and still held (Python's own caches aside)."""
        gc.collect()
        mine = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, f"*/{package}/*") for package in ("relay", "p2pnet")])
        return sum(stat.size for stat in mine.statistics("filename"))

    h = Harness(tmp_path, keep_versions=3)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        tracemalloc.start()
        try:
            for version in range(1, 1001):
                h.origin.collect()  # the publisher keeps a few versions too
                await h.announce(version, chunks=1)
                await h.until(lambda v=version: h.complete(v), 60)
                h.node.carried.clear()  # the fakes' records, not the role's state
                h.source.downloads.clear()
                if version == 200:
                    early = ours()
            late = ours()
        finally:
            tracemalloc.stop()
        core = h.role.core
        assert sorted(core._versions) == [998, 999, 1000]
        assert h.role.status()["complete_versions"] == [998, 999, 1000]
        assert len(h.role.timeline) <= 4 and len(core._manifest_asked) == 0
        # 800 more versions cost nothing that stays (a leak of 64 bytes per version would show;
        # measured: about 20 KiB, objects the manifest decoder leaves that do not grow with versions kept)
        assert late - early < 48 * 1024, (early, late)
        h.node.carried.clear()
        with trio.move_on_after(30):
            await trio.sleep_forever()
        announced = {hv.version for e in h.node.carried if isinstance(getattr(e, "body", None), Holding)
                     for hv in e.body.versions}
        assert announced == {998, 999, 1000}
        nursery.cancel_scope.cancel()


async def test_batches_of_stored_chunks_become_durable_in_the_background_before_the_version_completes(tmp_path, clock):
    h = Harness(tmp_path, fsync=True, fsync_batch_chunks=4)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        h.source.answer_at_most = 6  # then the source goes quiet: the version stays incomplete
        signed = await h.announce(1)
        await h.until(lambda: len(h.source.downloads) == 6, 60)
        await trio.testing.wait_all_tasks_blocked()
        # a crash now: a store opened afresh on the same folder holds the batch the flusher made
        # durable (a put alone would flush only at twice the batch, 8 chunks)
        after = ChunkStore(h.role.store.root, budget_bytes=10**9, trusted_publishers=[PUBLISHER.peer_id])
        durable = set(range(CHUNKS)) - set(after.missing(signed))
        first = {index for _, _, index in h.source.downloads[:4]}
        assert first <= durable and len(durable) <= 6 and not after.is_complete(signed)
        assert not h.complete(1)
        nursery.cancel_scope.cancel()


async def test_chunks_a_failed_fsync_lost_are_fetched_again_and_the_version_completes_durable(
        tmp_path, clock, caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path, fsync=True, fsync_batch_chunks=4)
    failed = failing_fsyncs(monkeypatch, 1, errno.EIO, which=in_version_folders)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        signed = await h.announce(1)
        await h.until(lambda: h.complete(1), 60)
        assert failed.failed == 1
        fetched = [index for _, _, index in h.source.downloads]
        again = sorted({i for i in fetched if fetched.count(i) > 1})
        assert len(again) >= 4 and len(fetched) == CHUNKS + len(again)  # the lost batch, fetched twice
        assert [r for r in caplog.records if "may not be on disk" in r.getMessage() and r.name == "relay.role"]
        assert not h.role.backoff.active  # the hold the failed fsync began ended with the flush that worked
        assert h.role.core.progress(trio.current_time(), 1)["chunks_have"] == CHUNKS
        assert complete_on_disk(h, signed)
        out = await h.role._cmd_fetch({"version": 1, "out_dir": str(tmp_path / "out")}, lambda progress: None)
        assert Path(out["files"][0]).read_bytes() == (tmp_path / "v1.safetensors").read_bytes()
        nursery.cancel_scope.cancel()


async def test_a_background_flush_that_finds_the_disk_full_holds_requests_like_a_full_store(
        tmp_path, clock, caplog, monkeypatch):
    """On a full disk writes into the page cache succeed and the fsync fails: the flush that finds
    it holds requests (1 s, doubling while it stays full), and only a flush that succeeds ends the
    backoff (a chunk stored meanwhile proves nothing)."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path, fsync=True, fsync_batch_chunks=4)
    disk = failing_fsyncs(monkeypatch, math.inf, errno.ENOSPC, which=in_version_folders)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        signed = await h.announce(1)
        await h.until(lambda: h.role.backoff.active, 30)  # fetching pauses instead of every put failing
        with trio.move_on_after(10):  # ten virtual seconds of a full disk
            await trio.sleep_forever()
        warnings = store_full_warnings(caplog)
        holds = [w.split("requests for ")[1].split("s ")[0] for w in warnings]
        assert holds[:3] == ["1", "2", "4"] and len(holds) <= 4, warnings  # once per hold, not per chunk
        assert h.role.backoff.active and not h.complete(1)
        assert not [r for r in caplog.records if "room again" in r.getMessage()]
        disk.failing = False
        await h.until(lambda: h.complete(1), 60)
        assert not h.role.backoff.active
        assert len([r for r in caplog.records if "room again" in r.getMessage()]) == 1
        assert complete_on_disk(h, signed)
        nursery.cancel_scope.cancel()


async def test_a_version_whose_last_bitmap_write_found_the_disk_full_completes_once_it_is_written(
        tmp_path, clock, caplog, monkeypatch):
    """The put that completes a version fsyncs its files, then cannot write the bitmap that says
    so (a full disk): that put fails and requests are held. The chunk stays held, so when the core
    asks for it again nothing is downloaded; the bitmap is written by a flush then, and only then
    does the version complete (a relay that ignored the ask stayed at 15 of 16 chunks for good)."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path, fsync=True, fsync_batch_chunks=4)
    disk = FullBitmaps(h, monkeypatch)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        signed = await h.announce(1)
        await h.until(lambda: disk.failures >= 2, 60)  # the completing put's, then an ask's flush
        assert h.role.backoff.active and not h.complete(1)
        assert not complete_on_disk(h, signed)  # what a restart would believe: not all of it
        disk.full = False
        await h.until(lambda: h.complete(1), 60)
        assert h.role.core.progress(trio.current_time(), 1)["chunks_have"] == CHUNKS
        fetched = [index for _, _, index in h.source.downloads]
        assert sorted(fetched) == list(range(CHUNKS))  # every chunk downloaded once: the last was kept
        assert complete_on_disk(h, signed)
        nursery.cancel_scope.cancel()


async def test_a_hold_started_by_a_failing_disk_keeps_its_cause_when_a_full_store_is_found_inside_it(
        tmp_path, clock, caplog, monkeypatch):
    """A put fails with EIO (a hold for a failing disk starts), then a put already out finds the
    store full inside that hold (no new hold): the hold is still the failing disk's, in the status,
    the health check and the line that ends it; a later hold of its own is the full store's."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path)
    real_put = h.role.store.put_chunk
    faults = [OSError(errno.EIO, "Input/output error"), StoreFull("injected: over budget")]

    def put_chunk(version, index, data, **kwargs):
        if faults:
            raise faults.pop(0)
        return real_put(version, index, data, **kwargs)

    monkeypatch.setattr(h.role.store, "put_chunk", put_chunk)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        h.source.gate = trio.Event()
        await h.announce(1)
        await h.until(lambda: h.role.core.status(trio.current_time())["progress"][0]["in_flight"] >= 2, 5)
        h.source.gate.set()  # the requests already out are answered together: EIO, then a full store
        await h.until(lambda: not faults, 5)
        assert h.role.backoff.failures == 2 and len(store_failing_warnings(caplog)) == 1
        assert not store_full_warnings(caplog)
        status = h.role.status()["store_backoff"]
        assert status["backing_off"] and status["cause"] == "failing" and status["version"] is None, status
        assert "failing" in RelayMetrics(h.node).unhealthy(h.role)
        await h.until(lambda: h.complete(1), 30)
        resumed = [r.getMessage() for r in caplog.records if "fetching resumes" in r.getMessage()]
        assert len(resumed) == 1 and "takes writes again" in resumed[0], resumed
        assert h.role.status()["store_backoff"]["cause"] is None and RelayMetrics(h.node).unhealthy(h.role) is None

        h.role.store.budget_bytes = h.role.store.used_bytes  # now a full store, and nothing else
        await h.announce(2)
        await h.until(lambda: h.role.backoff.active, 5)
        assert h.role.status()["store_backoff"]["cause"] == "full"
        assert "full" in RelayMetrics(h.node).unhealthy(h.role)
        h.role.store.budget_bytes = 10**9
        await h.until(lambda: h.complete(2), 120)
        resumed = [r.getMessage() for r in caplog.records if "fetching resumes" in r.getMessage()]
        assert len(resumed) == 2 and "has room again" in resumed[1], resumed
        nursery.cancel_scope.cancel()


def eio_on_the_last_put(h: Harness, monkeypatch, *, stored_first: bool) -> list[int]:
    """The first put of the chunk that would complete a version fails with EIO; `stored_first`:
    after another put of that chunk (in another thread) stored it and made the version durable.
    Returns the chunk's index, once that put was made."""
    real_put, failed = h.role.store.put_chunk, []

    def put_chunk(version, index, data, **kwargs):
        if not failed and len(h.role.store.missing(h.role.core.signed(version))) == 1:
            failed.append(index)
            if stored_first:
                real_put(version, index, data, **kwargs)
            raise OSError(errno.EIO, "Input/output error")
        return real_put(version, index, data, **kwargs)

    monkeypatch.setattr(h.role.store, "put_chunk", put_chunk)
    return failed


@pytest.mark.parametrize("fsync", [True, False])
async def test_one_eio_on_the_put_of_the_last_chunk_holds_then_the_version_completes_and_the_hold_ends(
        tmp_path, clock, caplog, monkeypatch, fsync):
    """A disk that fails once (the put of the chunk that would complete the version) and then
    works: nothing else is left to store, so only the chunk fetched again after the hold can
    prove the disk; its put (which flushes the whole version) ends the backoff, and the peer is
    healthy again."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path, fsync=fsync, fsync_batch_chunks=4)
    failed = eio_on_the_last_put(h, monkeypatch, stored_first=False)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        signed = await h.announce(1)
        await h.until(lambda: bool(failed), 30)
        assert h.role.backoff.active and h.role.status()["store_backoff"]["cause"] == "failing"
        took = await h.until(lambda: h.complete(1), 30)
        assert took <= 1.5  # fetched again at the end of the first hold (1 s)
        assert not h.role.backoff.active and RelayMetrics(h.node).unhealthy(h.role) is None
        fetched = [index for _, _, index in h.source.downloads]
        assert sorted(fetched) == sorted(list(range(CHUNKS)) + failed)  # only the failed chunk twice
        assert len(store_failing_warnings(caplog)) == 1
        if fsync:
            assert complete_on_disk(h, signed)
        nursery.cancel_scope.cancel()


async def test_a_probe_that_cannot_read_a_failing_disk_keeps_the_hold_a_failing_disk_s(
        tmp_path, clock, caplog, monkeypatch):
    """At the end of a hold for a failing disk a request first asks the store for room; when that
    question itself fails (EIO from statvfs), the next hold is still a failing disk's, not a full
    store's, and the chunk is not downloaded."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path)
    real_room, disk, probes = h.role.store.has_room, FailingPuts(h, monkeypatch, errno.EIO, "Input/output error"), []

    def has_room(nbytes):
        if disk.failing:
            probes.append(nbytes)
            raise OSError(errno.EIO, "Input/output error")
        return real_room(nbytes)

    monkeypatch.setattr(h.role.store, "has_room", has_room)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        await h.announce(1)
        await h.until(lambda: len(probes) >= 3, 30)
        downloaded = len(h.source.downloads)
        with trio.move_on_after(10):
            await trio.sleep_forever()
        assert len(h.source.downloads) == downloaded  # every probe failed: nothing fetched
        assert len(store_failing_warnings(caplog)) >= 3 and not store_full_warnings(caplog)
        assert h.role.status()["store_backoff"]["cause"] == "failing"
        disk.failing = False
        await h.until(lambda: h.complete(1), 60)
        assert not h.role.backoff.active
        nursery.cancel_scope.cancel()


async def test_a_put_that_fails_after_another_put_made_its_chunk_durable_starts_no_hold_that_never_ends(
        tmp_path, clock, caplog, monkeypatch):
    """Two puts of the version's last chunk race (endgame requests to two sources): one fails
    with EIO, the other stores the chunk and flushes the whole version durable before the
    failure reaches the role. That failure proves nothing the durable flush did not disprove;
    held on it, nothing would ever be stored again to end the hold, and the peer would report
    its store failing (/healthz 503) until the next version."""
    caplog.set_level(logging.INFO)
    h = Harness(tmp_path, fsync=True, fsync_batch_chunks=4)
    raced = eio_on_the_last_put(h, monkeypatch, stored_first=True)
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        signed = await h.announce(1)
        await h.until(lambda: h.complete(1), 30)
        assert raced and complete_on_disk(h, signed)
        with trio.move_on_after(120):  # nothing left to fetch or store
            await trio.sleep_forever()
        assert not h.role.backoff.active and RelayMetrics(h.node).unhealthy(h.role) is None
        assert not store_failing_warnings(caplog)
        assert [r for r in caplog.records if "cannot keep chunk" in r.getMessage()]  # the EIO is still told
        nursery.cancel_scope.cancel()
