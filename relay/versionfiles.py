"""One checkpoint version on disk as its own files: where each chunk lies in them, chunk writes
and reads at their offsets, and the crash-safe bitmap of the chunks that are durable there.

A version's files are the manifest's files, by their manifest names, in one folder; each is
created at its full size (sparse: the disk holds only what has been written) and chunks are
written into them at their offsets, a chunk that straddles two files in two parts. Nothing in
the folder says which chunks are good: that is the bitmap, a separate file written only after
the data it covers was fsynced (`save_bitmap`: temp name, fsync, rename, fsync the folder), so
after a crash the bitmap never claims a chunk whose bytes were not on disk. A complete version's
folder is an ordinary folder of its files (safetensors, tokenizer, config, ...) that any loader
opens directly.

`VersionFiles` keeps the files open (at most `MAX_OPEN_FILES` per version, least recently used
closed first) for `os.pwrite`/`os.pread` from several threads (each on a duplicate of its own,
which an eviction cannot close under it); it tracks which files have writes not yet fsynced (a
file closed meanwhile is opened again to be fsynced: fsync covers the file, not the descriptor),
and counts the fsyncs that failed (`sync_failures`): on Linux a failed fsync may have dropped the
dirty pages it was to write, and a later fsync then succeeds without them, so whatever was
written before a failure must be written again. A file is opened for reading only until it is
written: a complete version's files are read-only (mode 0444, `make_read_only`), which a user
other than root cannot open for writing; a write into one (a rotten chunk fetched again) gives
its owner the write bit back first. It knows nothing of hashes, budgets or trust:
the store (`relay.store`) decides what is written and what the bitmap says. `place_file` brings a
file in or hands one out without copying its bytes where the filesystem allows (hard link,
reflink), with a kernel-side copy as the fallback.

This module must not do network I/O and must not import torch.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import logging
import os
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from p2pnet.files import fsync_dir
from relay.manifest import Manifest, chunk_range

log = logging.getLogger(__name__)

MAX_OPEN_FILES = 64
BITMAP_MAGIC = b"p2pnet-have-1\n"
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # what a full disk raises (as OSError.errno)
FICLONE = 0x40049409  # linux/fs.h: share a file's blocks (a reflink) where the filesystem can
PLACE_MODES = ("link", "move", "copy")


@dataclass(frozen=True, slots=True)
class Segment:
    """`length` bytes at `offset` of file number `file` of the version: part (or all) of a chunk."""

    file: int
    offset: int
    length: int


def chunk_segments(manifest: Manifest, starts: list[int], index: int) -> list[Segment]:
    """The pieces of chunk `index` in the version's files; `starts` are the files' offsets."""
    start, end = chunk_range(manifest, index)
    out = []
    i = bisect.bisect_right(starts, start) - 1
    while start < end:
        entry = manifest.files[i]
        file_end = entry.offset + entry.size
        if file_end > start:
            take = min(end, file_end) - start
            out.append(Segment(i, start - entry.offset, take))
            start += take
        i += 1
    return out


class VersionFiles:
    """The open files of one version folder (thread-safe)."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        self.folder = Path(folder)
        self.manifest = manifest
        self.paths = [self.folder / entry.name for entry in manifest.files]
        self._starts = [entry.offset for entry in manifest.files]
        self._fds: OrderedDict[int, tuple[int, bool]] = OrderedDict()  # file -> (descriptor, writable)
        self._dirty: set[int] = set()
        self._lock = threading.Lock()
        self.sync_failures = 0  # fsyncs that failed (`sync`, or closing a file to stay under MAX_OPEN_FILES)

    # -- creating -------------------------------------------------------------------------

    def create(self) -> bool:
        """Make every file exist at its full size (existing bytes kept); True if all already did."""
        self.folder.mkdir(parents=True, exist_ok=True)
        intact = True
        for path, entry in zip(self.paths, self.manifest.files):
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                size = -1
            if size == entry.size:
                continue
            intact = False
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, entry.size)
            finally:
                os.close(fd)
        return intact

    def segments(self, index: int) -> list[Segment]:
        return chunk_segments(self.manifest, self._starts, index)

    # -- chunk bytes ----------------------------------------------------------------------

    def write_chunk(self, index: int, data: bytes | bytearray | memoryview) -> None:
        """Write chunk `index` at its offsets (not fsynced: see `sync`)."""
        view = memoryview(data)
        at = 0
        for seg in self.segments(index):
            fd = self._own_fd(seg.file, write=True)
            try:
                part = view[at:at + seg.length]
                done = 0
                while done < seg.length:
                    done += os.pwrite(fd, part[done:], seg.offset + done)
            finally:
                os.close(fd)
            at += seg.length
            with self._lock:
                self._dirty.add(seg.file)

    def read_chunk(self, index: int) -> bytes:
        """Chunk `index` as it is on disk (unverified)."""
        parts = []
        for seg in self.segments(index):
            fd = self._own_fd(seg.file)
            try:
                data = os.pread(fd, seg.length, seg.offset)
            finally:
                os.close(fd)
            if len(data) != seg.length:
                raise OSError(errno.EIO, f"{self.paths[seg.file]} is shorter than its manifest says")
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _fd_locked(self, file: int, write: bool) -> int:
        """The shared open descriptor of file number `file` (writable if `write`), kept for the
        next use (under `_lock`; another thread may close it once the lock is let go: read and
        write with `_own_fd`)."""
        entry = self._fds.get(file)
        if entry is not None and (entry[1] or not write):
            self._fds.move_to_end(file)
            return entry[0]
        fd = _open_writable(self.paths[file]) if write else os.open(self.paths[file], os.O_RDONLY)
        if entry is not None:
            os.close(entry[0])  # read-only: nothing of ours to fsync
        self._fds[file] = (fd, write)
        self._fds.move_to_end(file)
        while len(self._fds) > MAX_OPEN_FILES:
            old, (old_fd, _) = self._fds.popitem(last=False)
            try:
                if old in self._dirty:  # its writes must not lose their fsync
                    self._dirty.discard(old)
                    os.fsync(old_fd)
            except OSError:
                self.sync_failures += 1  # the owner drops what was written since its last sync
                raise
            finally:
                os.close(old_fd)
        return fd

    def _own_fd(self, file: int, write: bool = False) -> int:
        """A duplicate of file number `file`'s shared descriptor, the caller's to close: another
        thread opening a file may close the shared one (at most MAX_OPEN_FILES stay open) while we
        read or write, and the OS then reuses its number for another file (a chunk written into the
        wrong file; a read failing as EBADF, and the chunk taken for rotten)."""
        with self._lock:
            return os.dup(self._fd_locked(file, write))

    def sync(self) -> None:
        """fsync every file written since the last sync."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            # duplicates: an eviction may close (and the OS reuse) the original while we fsync
            fds = {f: os.dup(self._fds[f][0]) for f in dirty if f in self._fds}
        synced = set()
        try:
            for file in sorted(dirty):
                # a file closed since its write is opened again: an eviction fsyncs a file only if
                # its write was marked dirty by then, and a write marks it only once it is done
                fd = fds[file] if file in fds else fds.setdefault(file, os.open(self.paths[file], os.O_RDONLY))
                os.fsync(fd)
                synced.add(file)
        except OSError:
            with self._lock:  # the file that failed and those not tried yet: the next sync fsyncs them
                self._dirty |= dirty - synced
                self.sync_failures += 1
            raise
        finally:
            for fd in fds.values():
                os.close(fd)

    def make_read_only(self) -> None:
        """Mode 0444 on every file: a complete version is never written again, and a hard link
        handed out (`checkpoint fetch --out`) cannot be edited in place by accident."""
        for path in self.paths:
            os.chmod(path, 0o444)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = [fd for fd, _ in self._fds.values()], OrderedDict()
            self._dirty.clear()
        for fd in fds:
            os.close(fd)


def _open_writable(path: Path) -> int:
    """`path` opened for reading and writing; a read-only file (a complete version's, `make_read_only`)
    gets its owner's write bit back first, where the mode, not root, decides."""
    try:
        return os.open(path, os.O_RDWR)
    except PermissionError:
        os.chmod(path, os.stat(path).st_mode & 0o7777 | 0o200)
        return os.open(path, os.O_RDWR)


# -- the bitmap of durable chunks -------------------------------------------------------------


def save_bitmap(path: Path, manifest_id: bytes, held: Iterable[int], count: int, *, fsync: bool) -> None:
    """Record `held` (chunk indices of a version of `count` chunks) crash-safely at `path`."""
    bits = bytearray((count + 7) // 8)
    for i in held:
        bits[i // 8] |= 0x80 >> (i % 8)
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        with open(tmp, "wb", buffering=0) as fh:
            fh.write(BITMAP_MAGIC + manifest_id + bytes(bits))
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def load_bitmap(path: Path, manifest_id: bytes, count: int) -> set[int]:
    """The chunk indices a bitmap written by `save_bitmap` records; empty if it is missing, for
    another manifest, or malformed (then everything is fetched again, never believed)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return set()
    head = len(BITMAP_MAGIC) + len(manifest_id)
    if raw[:head] != BITMAP_MAGIC + manifest_id or len(raw) != head + (count + 7) // 8:
        return set()
    bits = raw[head:]
    return {i for i in range(count) if bits[i // 8] & (0x80 >> (i % 8))}


# -- bringing files in and handing them out -------------------------------------------------------


def place_file(src: Path, dst: Path, how: str, *, fsync: bool) -> str:
    """Put `src`'s bytes at the new name `dst`, `src` left as it is: by hard link (`link`) or
    copy (`copy`); a link that the filesystems refuse becomes a reflink, else a copy. The
    result is fsynced when `fsync` (a link of a file already on disk costs little). Returns how
    it was done: "link" or "copy"."""
    try:
        if how != "link":
            raise OSError(errno.EXDEV, "a copy was asked for")
        os.link(src, dst)
        done = "link"
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP):
            raise  # EPERM: a kernel that refuses links to others' files (fs.protected_hardlinks)
        _copy(src, dst)
        done = "copy"
    if fsync:
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return done


def _copy(src: Path, dst: Path) -> None:
    """A reflink where the filesystem shares blocks (btrfs, xfs), else a kernel-side copy
    (`copy_file_range`), else a plain one."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
            return
        except OSError:
            pass
        size = os.fstat(fin.fileno()).st_size
        done = 0
        try:
            while done < size:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), size - done, done, done)
                if n == 0:
                    raise OSError(errno.EIO, f"{src} shrank while being copied")
                done += n
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) or done:
                raise
            shutil.copyfileobj(fin, fout, 8 << 20)


def remove_path(path: Path) -> bool:
    """Delete a file or a folder tree. What cannot be deleted is logged as an error of our disk
    and left (the caller goes on: the store's own leftovers, not the user's data); False then."""
    failures: list[str] = []

    def failed(_func: object, target: str, exc_info: tuple) -> None:
        failures.append(f"{target}: {exc_info[1]}")

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, onerror=failed)
    else:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            failures.append(f"{path}: {exc}")
    for failure in failures[:8]:
        log.error("could not delete %s; it stays on disk", failure)
    if len(failures) > 8:
        log.error("... and %d more under %s", len(failures) - 8, path)
    return not failures
