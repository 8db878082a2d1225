"""Versioned checkpoints of the learner: atomic folders, a background writer, resume.

Owns the layout `out_dir/v{version}/`: a standard model folder (config, generation config,
tokenizer, sharded safetensors in the compute dtype: `models.folder`), loadable as it is by
`AutoModelForCausalLM.from_pretrained`, with `optimizer.pt` (the optimizer state and, when the
compute dtype is not float32, the float32 master weights) and `trainer_state.json` beside it.
`published_files` is the model folder alone: what workers fetch, never the optimizer state.
Each version is written into a hidden temporary folder, fsynced and renamed, so
a version folder exists only when complete; finding the latest complete version;
pruning old ones, and the optimizer state of all but the newest few (it is as large as
two copies of the weights, and only the newest is needed to resume); and `CheckpointWriter`, a single background thread with a bounded
queue so that writing version n overlaps the training of version n+1.

Theory: the caller snapshots (copies) weights and optimizer state on its own thread,
which is fast, and hands the copies to the writer; the live model can then change
freely. The queue is bounded (`max_pending`): if the disk falls behind, `submit`
blocks rather than holding unbounded copies in memory. A crash at any point leaves
either the old set of complete versions or the old set plus the new one, never a
torn version: temporary folders (`.v*.tmp*`) are ignored and removed on resume.

Must not: know about GRPO or rollouts, or open sockets.
"""

from __future__ import annotations

import io
import json
import os
import queue
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from models.folder import (CONFIG_FILE, DEFAULT_SHARD_BYTES, ModelFolderError, model_files, weight_files,
                           write_model_folder)
from p2pnet.files import atomic_write_bytes, fsync_dir

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
_VERSION_DIR = re.compile(r"v(\d+)")


class CheckpointError(RuntimeError):
    """Our own checkpoint could not be written or read (disk full, corrupted folder)."""


def version_dir(out_dir: str | os.PathLike[str], version: int) -> Path:
    return Path(out_dir) / f"v{version}"


def is_complete(folder: Path) -> bool:
    """A finished version folder (its optimizer state may have been pruned: `prune_optimizer_states`)."""
    if not all((folder / f).is_file() for f in (CONFIG_FILE, STATE_FILE)):
        return False
    try:
        weight_files(folder)
    except ModelFolderError:
        return False
    return True


def published_files(folder: Path) -> list[Path]:
    """The files of a version that workers fetch: the model folder, without optimizer or trainer state."""
    return model_files(folder)


def complete_versions(out_dir: str | os.PathLike[str]) -> list[int]:
    """Complete versions present in out_dir, ascending; temporary and torn folders are skipped."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = []
    for child in out.iterdir():
        m = _VERSION_DIR.fullmatch(child.name)
        if m and child.is_dir() and is_complete(child):
            found.append(int(m.group(1)))
    return sorted(found)


def latest_version(out_dir: str | os.PathLike[str]) -> int | None:
    versions = complete_versions(out_dir)
    return versions[-1] if versions else None


def remove_temporaries(out_dir: str | os.PathLike[str]) -> None:
    """Delete leftovers of interrupted writes (hidden `.v*` folders)."""
    out = Path(out_dir)
    if out.is_dir():
        for child in out.iterdir():
            if child.name.startswith(".v") and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)


@dataclass(frozen=True)
class Snapshot:
    """Everything one version holds, already copied off the live model and optimizer.

    `shell` is a weightless copy of the architecture whose config says the compute dtype
    (`models.folder.skeleton`); `weights` are in that dtype; `optimizer_state` is what
    `optimizer.pt` holds (the optimizer's state dict, and the float32 master weights when they
    differ from `weights`), or None when the optimizer state is checkpointed elsewhere (the
    sharded learner's, `trainer.sharded`): the folder then has no `optimizer.pt`."""

    version: int
    shell: Any
    tokenizer: Any
    weights: Mapping[str, torch.Tensor]
    optimizer_state: Mapping[str, Any] | None  # None: kept elsewhere (a sharded learner's DCP checkpoint)
    trainer_state: Mapping[str, Any]
    max_shard_bytes: int = DEFAULT_SHARD_BYTES


def write_version(out_dir: str | os.PathLike[str], snap: Snapshot) -> Path:
    """Write one complete version folder atomically; returns its final path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = version_dir(out, snap.version)
    tmp = Path(tempfile.mkdtemp(prefix=f".v{snap.version}.tmp", dir=out))
    os.chmod(tmp, 0o755)
    try:
        write_model_folder(tmp, snap.shell, snap.tokenizer, snap.weights, max_shard_bytes=snap.max_shard_bytes)
        if snap.optimizer_state is not None:
            buf = io.BytesIO()
            torch.save(dict(snap.optimizer_state), buf)
            atomic_write_bytes(tmp / OPTIMIZER_FILE, buf.getvalue())
        state = dict(snap.trainer_state, version=snap.version)
        atomic_write_bytes(tmp / STATE_FILE, json.dumps(state, sort_keys=True).encode())
        fsync_dir(tmp)
        if final.exists():  # a torn folder of this number from an older layout: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_version(out_dir: str | os.PathLike[str], version: int) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(optimizer state, trainer state) of a complete version; the optimizer state is None when
    it was pruned."""
    folder = version_dir(out_dir, version)
    if not is_complete(folder):
        raise CheckpointError(f"{folder} is not a complete version")
    optim_path = folder / OPTIMIZER_FILE
    optim = torch.load(optim_path, map_location="cpu", weights_only=True) if optim_path.is_file() else None
    state = json.loads((folder / STATE_FILE).read_text())
    return optim, state


def trained_keys(out_dir: str | os.PathLike[str], version: int) -> set[tuple[str, int]]:
    """The (worker, step) keys the learner had trained by `version` and still remembers (its
    `seen`, in the async window): empty for a version not on disk, or one without them."""
    try:
        state = json.loads((version_dir(out_dir, version) / STATE_FILE).read_text())
        return {(str(worker), int(step)) for worker, step in state.get("seen", [])}
    except (OSError, ValueError, TypeError, AttributeError):
        return set()


def prune(out_dir: str | os.PathLike[str], keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete versions (0 keeps everything)."""
    if keep_last <= 0:
        return
    for v in complete_versions(out_dir)[:-keep_last]:
        shutil.rmtree(version_dir(out_dir, v), ignore_errors=True)


def prune_optimizer_states(out_dir: str | os.PathLike[str], keep: int) -> None:
    """Delete `optimizer.pt` from all but the newest `keep` complete versions (0 keeps every one).
    The newest version is written, with its optimizer state, before any older one loses its own."""
    if keep <= 0:
        return
    for v in complete_versions(out_dir)[:-keep]:
        (version_dir(out_dir, v) / OPTIMIZER_FILE).unlink(missing_ok=True)


class CheckpointWriter:
    """One daemon thread writing snapshots in order; `flush()` waits and re-raises its error.

    `on_saved(version, path)` runs on the writer thread after each version is complete
    (the place to announce a new checkpoint); it must be quick and thread-safe.
    """

    def __init__(self, out_dir: str | os.PathLike[str], *, max_pending: int = 1, keep_last: int = 3,
                 keep_optimizer_states: int = 1, on_saved: Callable[[int, Path], None] | None = None) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self.out_dir = Path(out_dir)
        self.keep_last = keep_last
        self.keep_optimizer_states = keep_optimizer_states
        self.on_saved = on_saved
        self.last_saved: int | None = None
        self.last_write_s: float = 0.0
        self._queue: queue.Queue[Snapshot | None] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, snap: Snapshot) -> None:
        """Queue a snapshot; blocks only while `max_pending` earlier ones are still waiting."""
        self._raise_if_failed()
        self._queue.put(snap)

    def flush(self) -> None:
        """Return once every submitted snapshot is on disk; raise if a write failed."""
        self._queue.join()
        self._raise_if_failed()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise CheckpointError("writing a checkpoint failed") from self._error

    def _run(self) -> None:
        import time

        while True:
            snap = self._queue.get()
            try:
                if snap is None:
                    return
                if self._error is None:
                    t0 = time.perf_counter()
                    path = write_version(self.out_dir, snap)
                    prune(self.out_dir, self.keep_last)
                    prune_optimizer_states(self.out_dir, self.keep_optimizer_states)
                    self.last_write_s = time.perf_counter() - t0
                    self.last_saved = snap.version
                    if self.on_saved is not None:
                        self.on_saved(snap.version, path)
            except BaseException as exc:  # kept and re-raised on the caller's thread
                self._error = exc
            finally:
                self._queue.task_done()
