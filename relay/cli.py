"""`p2pnet checkpoint ...`: publish, inspect and fetch checkpoints from the command line.

Each command first asks whether a peer runs with the data directory (it holds `peer.lock`).
If one does, the command goes through its control socket, because that peer owns the store;
if none does, the command takes the lock itself and works on the store offline (a checkpoint
published offline is announced by the peer on its next start).

Control commands (served by the relay role, relay/role.py):

    {"cmd": "checkpoint.publish", "paths": [abs path...], "model": str, "version": int,
     "previous_version": int, "chunk_bytes": int}
        -> {"manifest_id": hex, "version": int, "chunks": int, "total_bytes": int}
    {"cmd": "checkpoint.status"}
        -> ChunkStore.status() plus whatever the role adds (who serves whom)
    {"cmd": "checkpoint.fetch", "version": int, "out_dir": abs path, "timeout_s": float}
        -> progress lines {"progress": {"version", "chunks_have", "chunks_total", "bytes_per_s"}},
           then {"version": int, "files": [abs path...], "total_bytes": int}

Any reply may instead be {"error": "...", "reason": CODE}; it fails the command with one line (exit 2).
`fetch --out` is checked before the peer is asked. This module must not import torch.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import trio

from p2pnet.config import load_toml
from p2pnet.control import CommandRefused
from p2pnet.errors import ConfigError, LocalStateError
from p2pnet.identity import KEY_FILE, Identity, load_or_create_identity
from relay.config import RelayConfig, relay_config
from relay.errors import VersionIncomplete
from relay.store import ChunkStore

LOCK_FILE = "peer.lock"


def register(commands: Any) -> None:
    checkpoint = commands.add_parser("checkpoint", help="publish, inspect and fetch signed checkpoints")
    sub = checkpoint.add_subparsers(title="checkpoint commands", metavar="COMMAND")

    publish = sub.add_parser("publish", help="sign safetensors files as checkpoint VERSION and store its chunks",
                             description="Publish safetensors files as one checkpoint version, signed with the "
                             "data directory's key: through the running peer, or into its store offline.")
    publish.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="safetensors files, in order")
    publish.add_argument("--model", required=True, help="model name recorded in the manifest")
    publish.add_argument("--version", dest="ckpt_version", type=int, required=True, metavar="N")
    publish.add_argument("--previous", type=int, default=-1, metavar="N",
                         help="the version this one follows (default: none)")
    publish.add_argument("--chunk-bytes", type=int, help="chunk size (default from [relay], 4 MiB)")
    publish.add_argument("--timeout-s", type=float, default=600.0, help="give up after this long")
    _common(publish)
    publish.set_defaults(func=cmd_publish)

    status = sub.add_parser("status", help="versions held, progress per version (and who serves whom)")
    _common(status)
    status.set_defaults(func=cmd_status)

    fetch = sub.add_parser("fetch", help="write checkpoint VERSION's files into --out, fetching it if needed")
    fetch.add_argument("fetch_version", type=int, metavar="VERSION")
    fetch.add_argument("--out", type=Path, required=True, help="directory to write the files into")
    fetch.add_argument("--timeout-s", type=float, default=600.0, help="give up after this long")
    _common(fetch)
    fetch.set_defaults(func=cmd_fetch)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, required=True, help="the peer's data directory")
    parser.add_argument("--config", type=Path, help="TOML file; its [relay] section is read")
    parser.add_argument("--trust", action="append", default=[], metavar="PEER_ID",
                        help="also trust manifests signed by this peer id; repeatable")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


# -- commands -----------------------------------------------------------------------------


def cmd_publish(args: argparse.Namespace) -> int:
    paths = [p.resolve() for p in args.paths]
    config = _config(args, chunk_bytes=args.chunk_bytes)
    with _offline(args.data_dir, create=True) as offline:
        if offline:
            identity = load_or_create_identity(args.data_dir)
            store = _open_store(args.data_dir, config.trusting(identity.peer_id))
            signed = store.publish_files(identity, paths, model=args.model, version=args.ckpt_version,
                                         previous_version=args.previous, chunk_bytes=config.chunk_bytes,
                                         now_s=time.time())
            result = {"manifest_id": signed.manifest_id.hex(), "version": signed.version,
                      "chunks": len(signed.manifest.chunk_digests), "total_bytes": signed.manifest.total_bytes,
                      "offline": True}
        else:
            result = _call(args.data_dir, {"cmd": "checkpoint.publish", "paths": [str(p) for p in paths],
                                           "model": args.model, "version": args.ckpt_version,
                                           "previous_version": args.previous, "chunk_bytes": config.chunk_bytes},
                           timeout_s=args.timeout_s)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        where = "into the offline store" if result.get("offline") else "through the running peer"
        print(f"published version {result['version']} {where}: {result['chunks']} chunks, "
              f"{_mb(result['total_bytes'])}, manifest {result['manifest_id'][:16]}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    config = _config(args)
    with _offline(args.data_dir, create=False) as offline:
        if offline:
            status = dict(_open_store(args.data_dir, _trusted(args.data_dir, config)).status(), running=False)
        else:
            status = dict(_call(args.data_dir, {"cmd": "checkpoint.status"}), running=True)
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    state = "served by the running peer" if status["running"] else "offline"
    print(f"checkpoint store {status.get('store', '?')} ({state}): {_mb(status.get('used_bytes', 0))} used "
          f"of {_mb(status.get('budget_bytes', 0))}")
    for row in status.get("versions", []):
        mark = "complete" if row.get("complete") else f"{100 * row['chunks_have'] / max(row['chunks_total'], 1):.0f}%"
        print(f"  v{row['version']:<6} {row.get('model', ''):<16} {mark:>9}  "
              f"{row['chunks_have']}/{row['chunks_total']} chunks  {_mb(row['bytes_have'])} of {_mb(row['total_bytes'])}")
    if not status.get("versions"):
        print("  no versions held")
    if status["running"]:
        _print_traffic(status)
    return 0


def _short(peer: str) -> str:
    return f"...{peer[-8:]}" if len(peer) > 12 else peer


def _print_traffic(status: dict[str, Any]) -> None:
    """Who serves whom, from a running relay's status (the --json output has everything)."""
    for row in status.get("transfers", {}).get("progress", []):
        parents = ", ".join(sorted({_short(p) for p in row.get("parents", []) if p})) or "-"
        rate = f"{row['bytes_per_s'] / 1e6:.1f} MB/s" if row.get("bytes_per_s") else "-"
        role = "published here" if row.get("origin") else f"parents {parents}"
        print(f"  v{row['version']:<6} {role}; fetched {row.get('fetched_chunks', 0)} chunks at {rate}; "
              f"{row.get('holders', 0)} peers hold it complete")
    for label, key in (("fetched from", "fetched_from"), ("serving now", "serving_to"), ("served to", "served_to")):
        counts = status.get(key) or {}
        if counts:
            print(f"  {label}: " + ", ".join(f"{_short(p)} {n} chunks" if key != "serving_to" else
                                             f"{_short(p)} {n}" for p, n in sorted(counts.items())))
    banned = status.get("transfers", {}).get("banned", [])
    if banned:
        print("  banned sources: " + ", ".join(_short(p) for p in banned))
    if status.get("corrupting_chunks"):
        print("  WARNING: this peer corrupts the chunks it serves (test hook P2PNET_TEST_CORRUPT_CHUNKS=1)")


def cmd_fetch(args: argparse.Namespace) -> int:
    config = _config(args)
    out_dir = _output_directory(args.out)
    with _offline(args.data_dir, create=False) as offline:
        if offline:
            store = _open_store(args.data_dir, _trusted(args.data_dir, config))
            signed = store.manifest(args.fetch_version)
            if not store.is_complete(signed):
                held = store.progress(signed)
                raise VersionIncomplete(f"version {args.fetch_version} is incomplete here ({held['chunks_have']}/"
                                        f"{held['chunks_total']} chunks) and no peer is running to fetch the rest; "
                                        f"start one with `p2pnet peer start --role relay --data-dir {args.data_dir}`")
            files = store.export_version(args.fetch_version, out_dir)
            result = {"version": args.fetch_version, "files": [str(p) for p in files],
                      "total_bytes": signed.manifest.total_bytes, "offline": True}
        else:
            bar = _ProgressBar(sys.stderr)
            result = _call(args.data_dir, {"cmd": "checkpoint.fetch", "version": args.fetch_version,
                                           "out_dir": str(out_dir), "timeout_s": args.timeout_s},
                           timeout_s=args.timeout_s + 10, on_progress=bar.update)
            bar.done()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"version {result['version']}: {len(result['files'])} files, {_mb(result['total_bytes'])} in {out_dir}")
        for path in result["files"]:
            print(f"  {path}")
    return 0


# -- helpers ------------------------------------------------------------------------------


def _output_directory(out: Path) -> Path:
    """`--out`, made absolute; a ConfigError now, before any peer is asked, if it cannot be written."""
    out_dir = out.resolve()
    try:
        existing = next(p for p in (out_dir, *out_dir.parents) if p.exists())  # "/" always exists
    except OSError as exc:
        raise ConfigError("--out", f"{out_dir}: {exc.strerror or exc}") from exc
    if existing == out_dir and not out_dir.is_dir():
        raise ConfigError("--out", f"{out_dir} exists and is not a directory")
    if not existing.is_dir():
        raise ConfigError("--out", f"cannot create {out_dir}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError("--out", f"cannot write into {existing}: permission denied")
    return out_dir


@contextlib.contextmanager
def _offline(data_dir: Path, *, create: bool) -> Iterator[bool]:
    """True (holding the data directory's lock) when no peer runs there, else False."""
    if not data_dir.is_dir():
        if not create:
            raise LocalStateError(f"no data directory {data_dir}")
        data_dir.mkdir(parents=True)
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _config(args: argparse.Namespace, **overrides: Any) -> RelayConfig:
    config = relay_config(load_toml(args.config).get("relay"), **overrides)
    return config.trusting(*args.trust) if args.trust else config


def _trusted(data_dir: Path, config: RelayConfig) -> RelayConfig:
    """The config, also trusting the data directory's own key when it has one."""
    key = data_dir / KEY_FILE
    if key.is_file() and key.stat().st_size == 32:
        return config.trusting(Identity(key.read_bytes()).peer_id)
    return config


def _open_store(data_dir: Path, config: RelayConfig) -> ChunkStore:
    return ChunkStore(config.store_root(data_dir), budget_bytes=config.budget_bytes,
                      keep_versions=config.keep_versions, trusted_publishers=config.trusted_publishers,
                      fsync=config.fsync)


def _call(data_dir: Path, request: dict[str, Any], *, timeout_s: float = 30.0,
          on_progress: Any = None) -> dict[str, Any]:
    from p2pnet.control import call

    async def run() -> dict[str, Any]:
        return await call(data_dir, request, on_progress=on_progress, timeout_s=timeout_s)

    reply = trio.run(run)
    if "error" in reply:
        raise CommandRefused(request["cmd"], reply)
    return reply


class _ProgressBar:
    """One self-overwriting line on stderr: chunks held of total, and the download rate."""

    def __init__(self, stream: Any, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.shown = False

    def update(self, progress: dict[str, Any]) -> None:
        have, total = int(progress.get("chunks_have", 0)), max(int(progress.get("chunks_total", 0)), 1)
        filled = int(self.width * have / total)
        rate = float(progress.get("bytes_per_s", 0.0))
        self.stream.write(f"\r  fetch v{progress.get('version', '?')} [{'#' * filled:<{self.width}}] "
                          f"{have}/{total} chunks  {_mb(rate)}/s ")
        self.stream.flush()
        self.shown = True

    def done(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


def _mb(nbytes: float) -> str:
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:.2f} GB"
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{int(nbytes)} B"
