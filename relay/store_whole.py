"""The ways a whole checkpoint version enters the store or leaves it.

Mixed into `relay.store.ChunkStore` (`WholeVersions`). `publish_files` is the trainer's side: its
files are brought in (hard-linked, or copied: `relay.versionfiles.place_file`) to a temp folder
under `versions/`, made read-only, hashed once in one read to build and sign the manifest,
renamed into place and fsynced, and the version is kept complete (manifest, bitmap of every
chunk); a `move` deletes the trainer's names only then, so a crash or a failure before leaves
them as they were (a failed publish gives linked files their mode back). `verify` re-hashes a version's unverified chunks (or all of them: before a load or an
export), side by side on a few threads. `export_version` is what `checkpoint fetch --out` hands
out: the whole version re-hashed first (`verify`), then its files hard-linked (a reflink or a
copy across filesystems) into the caller's folder, each under its name atomically, so a user
gets verified bytes without a second copy on disk.

These methods read the store's `root`, `_fsync` and versions (`_versions`), add the published
version to them (and its bytes to `_used_bytes`, its reservation to `_reserved_bytes`) under its
`_lock`, and call its `_held`, `read_chunk`, `versions`, `_reserve`, `version_dir_of`,
`_write_manifest`, `_save_bitmap` and `_bitmap_path`. No network I/O.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

from p2pnet.errors import ConfigError
from p2pnet.files import fsync_dir
from relay.errors import ChunkMissing, NotSafetensors, VersionIncomplete
from relay.manifest import DEFAULT_CHUNK_BYTES, SignedManifest, build_manifest, side_by_side, sign_manifest
from relay.store_records import MANIFEST_SUFFIX, TMP_PREFIX, _name, _Version
from relay.versionfiles import PLACE_MODES, VersionFiles, place_file, remove_path

if TYPE_CHECKING:
    from p2pnet.identity import Identity


class WholeVersions:
    """Publishing and exporting whole versions for `relay.store.ChunkStore` (see the module
    docstring)."""

    # the store's state these methods use (`ChunkStore.__init__` sets it)
    root: Path
    _fsync: bool
    _lock: threading.RLock
    _versions: dict[int, _Version]
    _used_bytes: int
    _reserved_bytes: int

    if TYPE_CHECKING:  # what these call on the store (`relay.store.ChunkStore` or another of its mixins)
        def _held(self, version: int) -> _Version: ...
        def read_chunk(self, version: int, index: int) -> bytes: ...
        def versions(self) -> list[int]: ...
        def _reserve(self, nbytes: int, *, incoming: bool = False) -> None: ...
        def version_dir_of(self, signed: SignedManifest) -> Path: ...
        def _write_manifest(self, signed: SignedManifest) -> None: ...
        def _save_bitmap(self, held: _Version, durable: set[int]) -> None: ...
        def _bitmap_path(self, signed: SignedManifest) -> Path: ...

    def verify(self, version: int, *, everything: bool = False) -> list[int]:
        """Hash the version's unverified chunks (with `everything`, all it holds), side by side
        (`relay.manifest.side_by_side`); those that no longer match are dropped (and told).
        Returns their indices, in order."""
        held = self._held(version)
        with self._lock:
            todo = sorted(held.have if everything else held.unverified)

        def rotten(index: int) -> bool:  # (its bytes are dropped at once: a thread holds one chunk at most)
            try:
                self.read_chunk(version, index)
            except ChunkMissing:
                return True
            return False

        return [index for index, bad in zip(todo, side_by_side(rotten, todo)) if bad]

    def verify_all(self) -> list[tuple[int, int]]:
        """Re-hash every chunk held; drop and return (version, index) of those that no longer match."""
        return [(v, i) for v in self.versions() for i in self.verify(v, everything=True)]

    def export_version(self, version: int, out_dir: Path) -> list[Path]:
        """The version's files, byte-identical, in `out_dir`: re-hashed, then hard-linked (a
        reflink or a copy across filesystems), each under its name atomically. ChunkMissing if
        a chunk was found rotten (it is dropped and told), VersionIncomplete if not all held."""
        with self.pinned(version) as held:  # garbage collection leaves it alone until its files are handed out
            return self._export(held, out_dir)

    @contextlib.contextmanager
    def pinned(self, version: int) -> Iterator[_Version]:
        """Garbage collection leaves the version (its files, manifest and bitmap) alone while
        this holds: an export or a load reading its files. VersionUnknown if it is not held."""
        with self._lock:
            held = self._held(version)
            held.pins += 1
        try:
            yield held
        finally:
            with self._lock:
                held.pins -= 1

    def verify_complete(self, version: int, *, everything: bool = False) -> None:
        """That the version is complete here and its chunks good, before anyone is handed its
        files: the unverified chunks are hashed (with `everything`, all of them). ChunkMissing if
        one was rotten (dropped and told), VersionIncomplete if the version is not complete,
        before the hashing or after it: a chunk another thread dropped meanwhile (serving found it
        rotten) is one the hashing no longer sees."""
        held = self._held(version)

        def incomplete() -> VersionIncomplete:
            return VersionIncomplete(f"checkpoint version {version} lacks {held.count - len(held.have)} of "
                                     f"{held.count} chunks")

        if not held.complete:
            raise incomplete()
        rotten = self.verify(version, everything=everything)
        if rotten:
            raise ChunkMissing(f"checkpoint version {version}: {len(rotten)} chunk(s) were corrupt on disk "
                               "and dropped (a running peer fetches them again)")
        if not held.complete:
            raise incomplete()

    def _export(self, held: _Version, out_dir: Path) -> list[Path]:
        self.verify_complete(held.signed.version, everything=True)
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        held.files.make_read_only()  # a hard link handed out shares the store's file: not to be edited in place
        paths = []
        for src in held.files.paths:
            dst = out_dir / src.name
            tmp = out_dir / f"{TMP_PREFIX}{src.name}.{os.getpid()}.{threading.get_ident()}"
            try:
                place_file(src, tmp, "link", fsync=self._fsync)
                os.replace(tmp, dst)
            finally:
                tmp.unlink(missing_ok=True)
            paths.append(dst)
        if self._fsync:
            fsync_dir(out_dir)
        return paths

    def publish_files(
        self,
        identity: Identity,
        paths: Sequence[Path],
        *,
        model: str,
        version: int,
        previous_version: int = -1,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        now_s: float,
        place: str = "link",
    ) -> SignedManifest:
        """The trainer's side: bring the files in (`place`: hard `link` them, falling back to a
        reflink or copy across filesystems; `move` them: the same, and the trainer's names deleted
        once the version is kept; or `copy` them), hash them once to build and sign the
        manifest, make them durable and read-only, keep it all. A publish that fails leaves the
        trainer's files as they were (names and modes).

        Linked files share their inode with the caller's: they become read-only (mode 0444),
        so the published bytes cannot be edited in place; write a new file for the next version.
        """
        if place not in PLACE_MODES:
            raise ConfigError("place", f"must be one of {', '.join(PLACE_MODES)}")
        if version in self._versions:
            raise ConfigError("version", f"version {version} is already published in {self.root}")
        sources = [Path(p) for p in paths]
        for src in sources:
            if not src.is_file():
                raise ConfigError(str(src), "no such file to publish" if not src.exists() else "not a regular file")
        if len({src.name for src in sources}) != len(sources):
            raise ConfigError("checkpoint", "two files to publish have the same name")
        reserved = sum(src.stat().st_size for src in sources)
        self._reserve(reserved, incoming=True)
        stage = self.root / "versions" / f"{TMP_PREFIX}publish-{version}-{os.getpid()}"
        placed: list[tuple[Path, Path, str, int]] = []  # source, staged, how it came, the source's mode
        folder, held = stage, None  # where the files are now; the version once kept
        try:
            stage.mkdir()
            for src in sources:  # a move is a link (or copy) now and the source's removal once all is kept:
                mode = os.stat(src).st_mode & 0o7777  # a crash before then leaves the trainer's files where they were
                how = place_file(src, stage / src.name, "copy" if place == "copy" else "link", fsync=self._fsync)
                placed.append((src, stage / src.name, how, mode))
            staged = [dst for _, dst, _, _ in placed]
            for path in staged:
                os.chmod(path, 0o444)  # before hashing: an edit in place after this fails
            try:
                manifest = build_manifest(staged, model=model, version=version,
                                          previous_version=previous_version, chunk_bytes=chunk_bytes,
                                          now_ms=int(now_s * 1000))
            except NotSafetensors as exc:  # named by the trainer's path, not the store's temp one
                named = {str(dst): src for src, dst, _, _ in placed}
                if exc.field not in named:
                    raise
                raise NotSafetensors(named[exc.field], exc.problem.removeprefix("not a safetensors file: ")) from None
            except ValueError as exc:
                raise ConfigError("checkpoint", str(exc)) from exc
            signed = sign_manifest(identity, manifest, now_s)
            final = self.version_dir_of(signed)
            os.replace(stage, final)
            folder = final
            if self._fsync:
                fsync_dir(final)
                fsync_dir(final.parent)
            with self._lock:
                self._write_manifest(signed)
                held = _Version(signed, VersionFiles(final, manifest), have=set(range(len(manifest.chunk_digests))))
                self._versions[version] = held
                self._used_bytes += manifest.total_bytes
            self._save_bitmap(held, held.have)
        except BaseException:
            if held is not None:  # kept but not durably (its bitmap): not kept at all
                with self._lock:
                    if self._versions.get(version) is held:
                        del self._versions[version]
                        self._used_bytes -= held.signed.manifest.total_bytes
                    held.files.close()
                remove_path(self.root / "manifests" / (_name(held.signed) + MANIFEST_SUFFIX))
                remove_path(self._bitmap_path(held.signed))
            self._give_back([(src, folder / dst.name, how, mode) for src, dst, how, mode in placed])
            remove_path(folder)
            raise
        finally:
            with self._lock:
                self._reserved_bytes -= reserved
        if place == "move":  # kept for good (manifest and bitmap durable): the trainer's names go
            for src, _, _, _ in placed:
                src.unlink()
            if self._fsync:
                for parent in {src.parent for src in sources}:
                    fsync_dir(parent)
        return signed

    @staticmethod
    def _give_back(placed: list[tuple[Path, Path, str, int]]) -> None:
        """A publish failed: the trainer's files as they were. Linked ones get their mode back
        (they share the inode made read-only); copies left their sources untouched."""
        for _, dst, how, mode in placed:
            if how == "link":
                os.chmod(dst, mode)
