"""`RelayConfig`: the `[relay]` TOML section, validated on construction.

Read by the relay role and by `p2pnet checkpoint ...`. Units are in the names. The store lives
in `<data dir>/<store_dir>`.

This module must not do I/O beyond resolving paths.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from p2pnet.config import from_mapping, validated
from p2pnet.identity import peer_id_from_str
from relay.manifest import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES
from relay.serving import ServingConfig, linger_problems

GIB = 1024**3


@validated
@dataclass(frozen=True)
class RelayConfig:
    trusted_publishers: tuple[str, ...] = ()  # base58 peer ids whose manifests we believe
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # chunk size when we publish
    budget_bytes: int = 64 * GIB  # disk the store may use (each version counted whole)
    keep_versions: int = 3  # complete versions kept by garbage collection
    max_concurrent_uploads: int = 16  # chunks we serve at once (window-limited links need several)
    upload_linger: float = 1.5  # a chunk served this many times our typical serving time frees its upload slot (0: off)
    max_concurrent_downloads: int = 8  # chunks we fetch at once
    stall_timeout_s: float = 30.0  # a transfer that moves no byte this long is abandoned
    request_timeout_s: float = 10.0  # a chunk request unanswered this long is retried elsewhere
    send_timeout_s: float = 30.0  # a requester that takes nothing of an answer this long is cut off
    idle_timeout_s: float = 120.0  # a data connection with nothing asked or owed this long is closed (we close ours at half of it)
    serve_bytes_per_peer_s: int = 0  # 0: no cap; else bytes a second served to one peer at most
    announce_interval_s: float = 5.0  # how often we gossip what we hold
    store_dir: str = "relay"  # under the data directory
    fsync: bool = True  # fsync chunks and directories (off only for simulations/benchmarks)
    fsync_batch_chunks: int = 8  # chunks written per fsync of files and bitmap, in the background (a crash loses about twice this at most; a version's last chunk: fsynced before it counts); smaller batches leave fewer dirty pages for the last flush of a version to wait on
    layout: str = "striped"  # "tree" (one tree of tree_fanout) and "star" are baselines for benchmarks
    tree_fanout: int = 4

    def check(self) -> dict[str, str]:
        problems = {}
        for peer in self.trusted_publishers:
            try:
                peer_id_from_str(peer)
            except ValueError:
                problems["trusted_publishers"] = f"{peer!r} is not an Ed25519 peer id"
        if not 1024 <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            problems["chunk_bytes"] = f"must be in [1024, {MAX_CHUNK_BYTES}]"
        if self.budget_bytes <= 0:
            problems["budget_bytes"] = "must be > 0"
        for name in ("keep_versions", "max_concurrent_uploads", "max_concurrent_downloads", "fsync_batch_chunks"):
            if getattr(self, name) < 1:
                problems[name] = "must be >= 1"
        for name in ("stall_timeout_s", "request_timeout_s", "announce_interval_s", "send_timeout_s",
                     "idle_timeout_s"):
            if not getattr(self, name) > 0:
                problems[name] = "must be > 0"
        problem = linger_problems(self.upload_linger, ServingConfig.linger_cap).get("linger_factor")
        if problem:
            problems["upload_linger"] = problem
        if self.serve_bytes_per_peer_s < 0:
            problems["serve_bytes_per_peer_s"] = "must be >= 0 (0: no cap)"
        if self.layout not in ("striped", "tree", "star"):
            problems["layout"] = "must be striped, tree or star"
        if self.tree_fanout < 1:
            problems["tree_fanout"] = "must be >= 1"
        if not self.store_dir or self.store_dir.startswith(("/", ".")) or "/" in self.store_dir:
            problems["store_dir"] = "must be a plain directory name"
        return problems

    def store_root(self, data_dir: Path) -> Path:
        return Path(data_dir) / self.store_dir

    def trusting(self, *peer_ids: str) -> RelayConfig:
        """This config with more trusted publishers (a trainer trusts its own key)."""
        extra = tuple(p for p in peer_ids if p not in self.trusted_publishers)
        return replace(self, trusted_publishers=self.trusted_publishers + extra)


def relay_config(section: Mapping[str, Any] | None, **overrides: Any) -> RelayConfig:
    """RelayConfig from a `[relay]` TOML table plus CLI overrides (None = not given)."""
    return from_mapping(RelayConfig, section or {}, "relay", **overrides)
