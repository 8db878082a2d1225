"""The relay role's control commands and its status: what an operator or a script asks of it.

Mixed into `relay.role.RelayRole` (`ControlCommands`), which registers the commands on the
node's control socket, each wrapped by `_refusing_errors` (our named errors, a missing key or a
bad value answer {"error": ...} instead of crashing the command):

- `checkpoint.publish`: sign and store files as a version, then announce it (`RelayRole.publish`).
- `checkpoint.status`: `status()`, the store's, the transfer core's and the serving counters.
- `checkpoint.fetch`: wait until a version (or "latest") is complete here, then export its files
  into `out_dir`, sending progress every 0.5 s while it waits.
- `checkpoint.wait`: wait until a version (or "latest") is complete and durable here; where its
  files are, once every chunk the bitmap only claims since a restart was hashed (a rotten one is
  fetched again first). It costs nothing while it waits (no polling).

Both waits end after `timeout_s` (600 s unless given) with an error saying how far the version
got, or that no trusted publisher's manifest for it has arrived; at once for a version older
than those the store keeps (`keep_versions`), which would never come.

These methods read the role's `store`, `core`, `watcher` (when versions complete), `node` (the
upload we advertise), `backoff`, `corrupt_chunks`, its upstreams (`_upstreams`), upload budget
and meter (`_upload`, `_meter`) and its counters (`timeline`, `fetched_from`, `serving_now`,
`served`, `bytes_served`, `_serving_window`); they call its `publish(...)` and `store_hold(...)`
(the store's hold, `relay.role_store`).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import trio

from p2pnet.errors import ConfigError, P2PNetError, PeerUnavailable
from relay.errors import ChunkMissing, VersionIncomplete, VersionUnknown

if TYPE_CHECKING:
    from relay.loader import VersionWatcher
    from relay.manifest import SignedManifest
    from relay.serving import ByteBudget, UploadMeter
    from relay.store import ChunkStore, StoreBackoff
    from relay.transfer import TransferCore
    from relay.upstream import Upstream

log = logging.getLogger("relay.role")  # the role's logger: its log lines keep their name


class ControlCommands:
    """Control commands and status for `relay.role.RelayRole` (see the module docstring)."""

    # the role's state these methods use (`RelayRole.__init__` sets it)
    node: Any
    store: ChunkStore
    core: TransferCore
    watcher: VersionWatcher
    backoff: StoreBackoff
    corrupt_chunks: bool
    _upstreams: dict[str, Upstream]
    _upload: ByteBudget
    _meter: UploadMeter
    timeline: dict[int, dict[str, float]]
    fetched_from: dict[str, int]
    serving_now: dict[str, int]
    served: dict[str, int]
    bytes_served: int
    _serving_window: tuple[float, float] | None

    if TYPE_CHECKING:  # what these call on the role (`relay.role.RelayRole`)
        def store_hold(self, now: float) -> dict[str, object]: ...

        async def publish(self, paths: list[Path], model: str, version: int, previous_version: int = -1,
                          chunk_bytes: int | None = None, place: str = "link") -> SignedManifest: ...

    async def _cmd_publish(self, request: dict[str, Any], reply: Any) -> dict[str, Any]:
        paths = request.get("paths")
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
            raise ConfigError("paths", "a non-empty list of file paths")
        signed = await self.publish([Path(p) for p in paths], str(request.get("model", "model")),
                                    int(request["version"]), int(request.get("previous_version", -1)),
                                    request.get("chunk_bytes"), str(request.get("place", "link")))
        return {"manifest_id": signed.manifest_id.hex(), "version": signed.version,
                "chunks": len(signed.manifest.chunk_digests), "total_bytes": signed.manifest.total_bytes}

    async def _cmd_status(self, request: dict[str, Any], reply: Any) -> dict[str, Any]:
        return self.status()

    async def _cmd_fetch(self, request: dict[str, Any], reply: Any) -> dict[str, Any]:
        """Wait until the version is complete here, then hand its files out into `out_dir`
        (verified, hard-linked where the filesystem allows)."""
        out_dir = Path(str(request.get("out_dir") or request.get("out") or ""))
        if not out_dir.is_absolute():
            raise ConfigError("out_dir", "an absolute directory path")
        timeout_s = _timeout(request)
        with trio.move_on_after(timeout_s):
            while True:
                version = await self._until_held(request.get("version"), reply)
                try:
                    files = await trio.to_thread.run_sync(self.store.export_version, version, out_dir)
                except (ChunkMissing, VersionIncomplete) as exc:  # rotten on disk: dropped, fetched again
                    log.warning("exporting version %d: %s; waiting until it is complete again", version, exc)
                    continue
                return {"version": version, "files": [str(f) for f in files],
                        "total_bytes": self.store.manifest(version).manifest.total_bytes}
        raise PeerUnavailable(self._not_yet(request.get("version"), timeout_s))

    async def _cmd_wait(self, request: dict[str, Any], reply: Any) -> dict[str, Any]:
        """Block until the version (or, for "latest", any version) is complete and durable here;
        where its files are. Costs nothing while it waits (no polling, no status)."""
        timeout_s = _timeout(request)
        with trio.move_on_after(timeout_s):
            while True:
                version = await self._until_held(request.get("version"), None)
                # what the bitmap only claims since a restart is hashed before anyone is told to open
                # it (nothing to hash for chunks received in this run); a rotten one is fetched again
                try:
                    await trio.to_thread.run_sync(self.store.verify_complete, version)
                except (ChunkMissing, VersionIncomplete) as exc:
                    log.warning("version %d: %s; waiting until it is complete again", version, exc)
                    continue
                except VersionUnknown:  # collected meanwhile
                    continue
                return {"version": version, "dir": str(self.store.version_dir(version)),
                        "files": [str(p) for p in self.store.version_files(version)]}
        raise PeerUnavailable(self._not_yet(request.get("version"), timeout_s))

    async def _until_held(self, wanted: Any, reply: Any) -> int:
        """The version asked for (an int, or "latest": the newest complete one, waiting for a
        first if none), once complete here; progress is sent to `reply` every 0.5 s if given."""
        if wanted != "latest" and (isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 0):
            raise ConfigError("version", 'a version number >= 0, or "latest"')
        while True:
            version = self.watcher.latest if wanted == "latest" else wanted
            if version >= 0 and self._holds(version):
                return version
            if version >= 0 and not self.store.should_fetch(version):  # it would never come: say so now
                raise VersionUnknown(f"version {version} will not be held here: it is older than the "
                                     f"{self.store.keep_versions} newest complete versions this peer keeps "
                                     "([relay] keep_versions), so it is not fetched (or was dropped)")
            if reply is not None and version >= 0 and self.core.knows(version):
                p = self.core.progress(trio.current_time(), version)
                await reply({"progress": {k: p[k] for k in ("version", "chunks_have", "chunks_total",
                                                              "bytes_per_s")}})
            with trio.move_on_after(0.5 if reply is not None else math.inf):
                await self.watcher.wait_change()

    def _not_yet(self, wanted: Any, timeout_s: float) -> str:
        if wanted == "latest":
            return f"no version became complete here within {timeout_s:g}s"
        if self.core.knows(wanted):
            p = self.core.progress(trio.current_time(), wanted)
            return (f"version {wanted} is not complete here after {timeout_s:g}s "
                    f"({p['chunks_have']} of {p['chunks_total']} chunks)")
        return (f"version {wanted} is unknown here after {timeout_s:g}s: no trusted publisher's manifest for it "
                "has arrived (is it published, and is its publisher trusted?)")

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        status = self.store.status()
        status.update(
            complete_versions=self.core.complete_versions(),
            transfers=self.core.status(now),
            fetching_from={p: u.outstanding for p, u in self._upstreams.items() if u.outstanding},
            timeline={str(v): dict(t) for v, t in self.timeline.items()},
            fetched_from=dict(self.fetched_from),
            serving_to=dict(self.serving_now),
            served_to=dict(self.served),
            bytes_served=self.bytes_served,
            upload_limit_bps=self._upload.rate_bps,
            upload_measured_bps=self._meter.rate(now, self.bytes_served),
            upload_advertised_bps=self.node.peertable.local.capacity.upload_bps,
            serving_window_s=round(self._serving_window[1] - self._serving_window[0], 3) if self._serving_window else 0.0,
            corrupting_chunks=self.corrupt_chunks,
            store_backoff=self.store_hold(now),
        )
        return status

    def _holds(self, version: int) -> bool:
        """Complete here: the core has every chunk of `version` and the store still does."""
        signed = self.core.signed(version)
        return self.watcher.is_complete(version) and signed is not None and self.store.is_complete(signed)


def _timeout(request: dict[str, Any]) -> float:
    timeout_s = request.get("timeout_s", 600.0)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ConfigError("timeout_s", "a number of seconds > 0")
    return float(timeout_s)


def _refusing_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A control command that answers {"error": ...} for our named errors instead of crashing."""

    async def command(request: dict[str, Any], reply: Any) -> dict[str, Any]:
        try:
            return await fn(request, reply)
        except KeyError as exc:
            return {"error": f"the request lacks {exc}"}
        except (P2PNetError, TypeError, ValueError) as exc:  # said for a user: no class names
            return {"error": str(exc)}

    return command
