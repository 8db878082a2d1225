"""The store's promises where they meet the system: a user other than root, files handed out by
link, descriptors closed under a write, garbage collection overlapping reads, exports, puts and
the flush that completes a version, a publish that fails, names the filesystem cannot hold, and
deletions that fail. Each case is driven to the interleaving that broke it (no timing)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from p2pnet.errors import ConfigError
from relay.errors import ChunkMissing, VersionIncomplete
from relay.manifest import MAX_NAME_BYTES, FileEntry
from relay.store import ChunkRotten, VersionCollected
from relay.versionfiles import MAX_OPEN_FILES, VersionFiles, load_bitmap
from tests.relay.disk import rot_chunk
from tests.relay.test_store import CHUNK, NOW, TRAINER, checkpoint, fill, open_store, publish

ROOT = Path(__file__).resolve().parents[2]

AS_A_USER = r"""
import json, os, sys
from pathlib import Path
from relay.errors import ChunkMissing
from tests.relay.disk import rot_chunk
from tests.relay.test_store import fill, open_store, publish
tmp = Path(sys.argv[1])
out = {}
trainer = open_store(tmp / "trainer")
signed = publish(trainer, tmp, 1, place="copy")
out["published_modes"] = sorted({oct(p.stat().st_mode & 0o777) for p in trainer.version_files(1)})
trainer.close()
trainer = open_store(tmp / "trainer")  # a restart: every chunk is only claimed until hashed
out["verified_after_restart"] = all(trainer.ensure_verified(1, i) for i in range(len(signed.manifest.chunk_digests)))
out["exported"] = [p.read_bytes() == q.read_bytes() for p, q in
                   zip(trainer.export_version(1, tmp / "out-trainer"), sorted((tmp / "src1").iterdir()))]
relay = open_store(tmp / "relay")
relay.add_manifest(signed)
fill(relay, trainer, 1, range(len(signed.manifest.chunk_digests)))
exported = relay.export_version(1, tmp / "out-relay")
out["export_modes"] = sorted({oct(p.stat().st_mode & 0o777) for p in exported})
try:
    open(exported[0], "r+b").close()
    out["export_writable"] = True
except PermissionError:
    out["export_writable"] = False
rot_chunk(relay, 1, 0)  # the disk rots a chunk of the complete, read-only version
relay.close()
relay = open_store(tmp / "relay")  # restarted: its files not open for writing any more
try:
    relay.read_chunk(1, 0)  # (hashes it: as serving, an export or a load does)
    out["rotten_found"] = False
except ChunkMissing:
    out["rotten_found"] = True
out["put_again"] = relay.put_chunk(1, 0, trainer.read_chunk(1, 0))
out["repaired"] = relay.read_chunk(1, 0) == trainer.read_chunk(1, 0)
print(json.dumps(out))
"""


def test_a_user_other_than_root_publishes_serves_exports_and_repairs_read_only_versions(tmp_path):
    """Complete versions' files are mode 0444, which root ignores and every other user meets:
    reading them (after a restart, to verify, to export) must not ask for write access, and a
    rotten chunk of one is written again. Run without root's override where the tests are root."""
    command = [sys.executable, "-c", AS_A_USER, str(tmp_path)]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv (util-linux) is needed to drop root's file-mode override")
        caps = "-dac_override,-dac_read_search"
        command = [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}", *command]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"published_modes": ["0o444"], "verified_after_restart": True, "exported": [True] * 3,
                    "export_modes": ["0o444"], "export_writable": False, "rotten_found": True,
                    "put_again": True, "repaired": True}


def test_an_exported_version_is_a_read_only_link(tmp_path):
    source = open_store(tmp_path / "source")
    signed = publish(source, tmp_path, 1)
    relay = open_store(tmp_path / "relay")
    relay.add_manifest(signed)
    fill(relay, source, 1, range(len(signed.manifest.chunk_digests)))
    for stored, exported in zip(relay.version_files(1), relay.export_version(1, tmp_path / "out")):
        assert os.stat(stored).st_ino == os.stat(exported).st_ino
        assert exported.stat().st_mode & 0o777 == 0o444


def test_a_write_whose_file_was_closed_meanwhile_is_still_fsynced(tmp_path, monkeypatch):
    """A version of more files than stay open: while a put writes into file 0, other threads open
    enough files to close file 0's shared descriptor, unmarked then (the write is not done). The
    flush that makes the chunk durable must fsync file 0 all the same."""
    paths = []
    for i in range(MAX_OPEN_FILES + 2):
        path = tmp_path / "src" / f"shard-{i:03d}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(CHUNK))
        paths.append(path)
    source = open_store(tmp_path / "source")
    signed = source.publish_files(TRAINER, paths, model="m", version=1, chunk_bytes=CHUNK, now_s=NOW, place="copy")
    data = source.read_chunk(1, 0)
    sink = open_store(tmp_path / "sink", fsync=True, fsync_batch_chunks=1)
    sink.add_manifest(signed)
    files = sink._versions[1].files
    target = os.stat(files.paths[0]).st_ino
    real_pwrite, real_fsync = os.pwrite, os.fsync
    fsynced_after_write: list[int] = []
    written = []

    def pwrite(fd, view, offset):
        if os.fstat(fd).st_ino == target and not written:
            for j in range(1, MAX_OPEN_FILES + 1):  # other puts open 64 other files: file 0 is evicted
                os.close(files._own_fd(j))
            assert 0 not in files._fds
        n = real_pwrite(fd, view, offset)
        written.append(os.fstat(fd).st_ino)
        return n

    def fsync(fd):
        if written:
            fsynced_after_write.append(os.fstat(fd).st_ino)
        return real_fsync(fd)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "fsync", fsync)
    assert sink.put_chunk(1, 0, data) is True
    assert sink.is_durable(1, 0) and load_bitmap(sink._bitmap_path(signed), signed.manifest_id, len(paths)) == {0}
    assert target in fsynced_after_write


def test_a_read_that_meets_garbage_collection_is_no_rot(tmp_path, monkeypatch):
    store = open_store(tmp_path / "s", keep_versions=1)
    events = []
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    store.close()
    store = open_store(tmp_path / "s", keep_versions=1)  # restarted: version 1's chunks unverified
    store.listener = events.append
    version_one = store._versions[1].files
    real_read = VersionFiles.read_chunk

    def collected_as_it_reads(self, index):
        if self is version_one:
            store.collect()  # another thread's collection, as the read begins
        return real_read(self, index)

    monkeypatch.setattr(VersionFiles, "read_chunk", collected_as_it_reads)
    assert store.ensure_verified(1, 0) is False
    with pytest.raises(ChunkMissing, match="not in the store"):
        store.read_chunk(1, 0)
    assert events == [VersionCollected(1)]  # no ChunkRotten
    assert store.used_bytes == store.manifest(2).manifest.total_bytes
    assert not [p for p in (tmp_path / "s" / "versions").iterdir() if p.name.startswith("000000000001")]


def test_a_version_being_exported_is_not_collected_under_it(tmp_path, monkeypatch):
    import relay.store_whole

    store = open_store(tmp_path / "s", keep_versions=1)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    real_place = relay.store_whole.place_file
    calls = []

    def collecting(src, dst, how, *, fsync):
        calls.append(store.collect())  # the relay collects after another version completed
        return real_place(src, dst, how, fsync=fsync)

    monkeypatch.setattr(relay.store_whole, "place_file", collecting)
    exported = store.export_version(1, tmp_path / "out")
    assert [p.name for p in exported] == [f.name for f in store.manifest(1).manifest.files]
    assert all(c["dropped_versions"] == [] for c in calls)
    monkeypatch.setattr(relay.store_whole, "place_file", real_place)
    assert store.collect()["dropped_versions"] == [1]  # once handed out, it goes
    assert [p.read_bytes() for p in exported] == [p.read_bytes() for p in sorted((tmp_path / "src1").iterdir())]


def test_a_put_that_meets_garbage_collection_is_refused_not_a_disk_failure(tmp_path):
    source = open_store(tmp_path / "source")
    s1, s2, s3 = (publish(source, tmp_path, v) for v in (1, 2, 3))
    relay = open_store(tmp_path / "relay", keep_versions=1)
    relay.add_manifest(s2)  # downloading
    for signed in (s1, s3):
        relay.add_manifest(signed)
        fill(relay, source, signed.version, range(len(signed.manifest.chunk_digests)))
    files = relay._versions[2].files
    real_write = files.write_chunk

    def collected_as_it_writes(index, data):
        relay.collect()  # version 3 is complete: version 2 goes
        return real_write(index, data)

    files.write_chunk = collected_as_it_writes  # type: ignore[method-assign]
    assert relay.put_chunk(2, 0, source.read_chunk(2, 0)) is False
    assert relay.versions() == [3]


def test_a_version_counts_as_complete_for_collection_only_once_durable(tmp_path):
    """The put that completes version 2 flushes; if collection during that flush took version 2
    as complete it dropped version 1, and a failed flush then left no complete version."""
    source = open_store(tmp_path / "source")
    s1, s2 = publish(source, tmp_path, 1), publish(source, tmp_path, 2)
    relay = open_store(tmp_path / "relay", keep_versions=1, fsync=True, fsync_batch_chunks=100,
                       background_flush=True)
    relay.add_manifest(s1)
    fill(relay, source, 1, range(len(s1.manifest.chunk_digests)))
    relay.add_manifest(s2)
    last = len(s2.manifest.chunk_digests) - 1
    fill(relay, source, 2, range(last))
    files = relay._versions[2].files
    during = []

    def failing_sync():
        during.append(relay.collect()["dropped_versions"])
        files.sync_failures += 1
        raise OSError(errno.EIO, "injected: the disk failed the flush")

    files.sync = failing_sync  # type: ignore[method-assign]
    with pytest.raises(OSError, match="injected"):
        relay.put_chunk(2, last, source.read_chunk(2, last))
    assert during == [[]]
    assert relay.complete_versions() == [1] and relay.versions() == [1, 2]


@pytest.mark.parametrize("place", ["link", "move"])
def test_a_failed_publish_leaves_the_trainers_files_as_they_were(tmp_path, place):
    store = open_store(tmp_path / "store")
    paths = checkpoint(tmp_path / "src", 1)
    paths[1].write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")  # a .safetensors file that is not one
    for path in paths:
        os.chmod(path, 0o640)
    before = [(p.read_bytes(), os.stat(p).st_ino) for p in paths]
    with pytest.raises(ConfigError, match="not a safetensors file") as refused:
        store.publish_files(TRAINER, paths, model="m", version=1, chunk_bytes=CHUNK, now_s=NOW, place=place)
    assert str(refused.value).startswith(f"{paths[1]}: not a safetensors file: ")  # the user's path, not ours
    assert [(p.read_bytes(), os.stat(p).st_ino) for p in paths] == before
    assert [p.stat().st_mode & 0o777 for p in paths] == [0o640] * 3
    assert list((tmp_path / "store" / "versions").iterdir()) == []


def test_a_move_across_filesystems_deletes_the_sources_only_once_the_version_is_kept(tmp_path):
    other = Path("/dev/shm")
    if not other.is_dir() or os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second filesystem (/dev/shm)")
    src = Path(tempfile.mkdtemp(dir=other, prefix="p2pnet-test-"))
    try:
        paths = checkpoint(src, 1)
        good = paths[1].read_bytes()
        paths[1].write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
        store = open_store(tmp_path / "store")
        with pytest.raises(ConfigError, match="not a safetensors file"):
            store.publish_files(TRAINER, paths, model="m", version=1, chunk_bytes=CHUNK, now_s=NOW, place="move")
        assert all(p.exists() for p in paths)
        paths[1].write_bytes(good)
        before = [p.read_bytes() for p in paths]
        store.publish_files(TRAINER, paths, model="m", version=1, chunk_bytes=CHUNK, now_s=NOW, place="move")
        assert not any(p.exists() for p in paths)
        store.close()
        store = open_store(tmp_path / "store")
        assert [p.read_bytes() for p in store.version_files(1)] == before
    finally:
        shutil.rmtree(src)


def test_file_names_are_limited_in_bytes_not_characters():
    FileEntry("é" * (MAX_NAME_BYTES // 2), 1, 0, ())
    with pytest.raises(ValueError, match="UTF-8 bytes"):
        FileEntry("é" * (MAX_NAME_BYTES // 2 + 1), 1, 0, ())


def test_a_version_whose_files_cannot_be_made_neither_stays_nor_stops_a_restart(tmp_path, monkeypatch, caplog):
    source = open_store(tmp_path / "source")
    s1, s2 = publish(source, tmp_path, 1), publish(source, tmp_path, 2)
    relay = open_store(tmp_path / "relay")
    real_create = VersionFiles.create

    def too_long(self):
        raise OSError(errno.ENAMETOOLONG, "File name too long")

    monkeypatch.setattr(VersionFiles, "create", too_long)
    with pytest.raises(OSError):
        relay.add_manifest(s1)
    assert list((tmp_path / "relay" / "manifests").iterdir()) == []  # nothing left to trip a restart
    monkeypatch.setattr(VersionFiles, "create", real_create)
    relay.add_manifest(s1)
    relay.add_manifest(s2)
    relay.close()
    monkeypatch.setattr(VersionFiles, "create", lambda self: too_long(self) if "000000000001" in str(self.folder)
                        else real_create(self))
    with caplog.at_level(logging.ERROR, logger="relay.store"):
        relay = open_store(tmp_path / "relay")
    assert relay.versions() == [2]
    assert "skipping stored version 1" in caplog.text


def test_garbage_collection_reports_what_it_could_not_delete(tmp_path, monkeypatch, caplog):
    store = open_store(tmp_path / "s", keep_versions=1)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    real_unlink = os.unlink

    def failing_unlink(path, *args, **kwargs):
        if str(path).endswith(".safetensors") and kwargs.get("dir_fd") is not None:  # rmtree's deletions
            raise OSError(errno.EIO, "injected: Input/output error")
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", failing_unlink)
    with caplog.at_level(logging.ERROR, logger="relay.versionfiles"):
        summary = store.collect()
    assert summary == {"dropped_versions": [1], "freed_bytes": 0, "left_on_disk": [1]}
    assert "could not delete" in caplog.text and "injected" in caplog.text
    monkeypatch.setattr(os, "unlink", real_unlink)
    store.close()
    open_store(tmp_path / "s", keep_versions=1)  # the next start sweeps what no manifest names
    assert not [p for p in (tmp_path / "s" / "versions").iterdir() if p.name.startswith("000000000001")]


def test_rot_found_while_the_disk_is_full_is_still_dropped_and_told(tmp_path, monkeypatch, caplog):
    """The bitmap cannot be rewritten (no space): the chunk is still dropped and the owner told
    (so it is fetched again), the failure logged; the old bitmap's claim is hashed at a start."""
    import relay.store

    store = open_store(tmp_path / "s")
    events = []
    store.listener = events.append
    publish(store, tmp_path, 1)
    rot_chunk(store, 1, 2)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "injected: No space left on device")

    monkeypatch.setattr(relay.store, "save_bitmap", full)
    with caplog.at_level(logging.ERROR, logger="relay.store"), pytest.raises(ChunkMissing, match="corrupt on disk"):
        store.read_chunk(1, 2)
    assert events == [ChunkRotten(1, 2)] and not store.holds(1, 2)
    assert "dropping rotten chunk 2 from its bitmap failed" in caplog.text


@pytest.mark.parametrize("failing", ["_write_manifest", "_save_bitmap"])
def test_a_publish_that_fails_as_it_keeps_the_version_keeps_nothing(tmp_path, failing):
    """The manifest or the bitmap cannot be written: no version half kept (counted complete,
    blocking a retry, letting collection drop the one before), the trainer's files as they were."""
    store = open_store(tmp_path / "s", keep_versions=1, fsync=True)
    publish(store, tmp_path, 1)
    paths = checkpoint(tmp_path / "src2", 2)
    for path in paths:
        os.chmod(path, 0o640)
    real = getattr(store, failing)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, f"injected: {failing} failed")

    setattr(store, failing, no_space)
    with pytest.raises(OSError, match="injected"):
        store.publish_files(TRAINER, paths, model="m", version=2, chunk_bytes=CHUNK, now_s=NOW)
    setattr(store, failing, real)
    assert store.versions() == [1] and store.complete_versions() == [1]
    assert [p.stat().st_mode & 0o777 for p in paths] == [0o640] * 3
    assert sorted(p.name[:12] for p in (tmp_path / "s" / "versions").iterdir()) == ["000000000001"] * 2
    assert [p.name[:12] for p in (tmp_path / "s" / "manifests").iterdir()] == ["000000000001"]
    store.publish_files(TRAINER, paths, model="m", version=2, chunk_bytes=CHUNK, now_s=NOW)  # a retry works
    assert store.complete_versions() == [1, 2]


def test_an_export_refuses_a_version_that_lost_a_chunk_while_it_was_hashed(tmp_path):
    """After a restart every chunk is only claimed; serving finds one rotten and drops it between
    the export's completeness check and its hashing, which then no longer sees it: the export
    must not hand the version out (the loader and `checkpoint wait` share the same check)."""
    store = open_store(tmp_path / "s")
    publish(store, tmp_path, 1)
    store.close()
    store = open_store(tmp_path / "s")
    real_verify = store.verify

    def serving_first(version, *, everything=False):
        rot_chunk(store, 1, 2)
        assert store.ensure_verified(1, 2) is False  # the serving thread drops it
        return real_verify(version, everything=everything)

    store.verify = serving_first  # type: ignore[method-assign]
    with pytest.raises(VersionIncomplete, match="lacks 1 of"):
        store.export_version(1, tmp_path / "out")
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
