"""`p2pnet checkpoint ...`: publish, inspect, fetch and wait for checkpoints from the command line.

Each command first asks whether a peer runs with the data directory (it holds `peer.lock`).
If one does, the command goes through its control socket, because that peer owns the store;
if none does, the command takes the lock itself and works on the store offline (a checkpoint
published offline is announced by the peer on its next start). Offline, the `[relay]` section
comes from the data directory's configuration, and the publishers trusted are the ones the last
peer started there trusted (`last-start.toml`, its `--trust` flags included), its own key and
`--trust`: what that peer stored is believed again.

Control commands (served by the relay role: relay/commands.py, mixed into relay/role.py):

    {"cmd": "checkpoint.publish", "paths": [abs path...], "model": str, "version": int,
     "previous_version": int, "chunk_bytes": int}
        -> {"manifest_id": hex, "version": int, "chunks": int, "total_bytes": int}
    {"cmd": "checkpoint.status"}
        -> ChunkStore.status() plus whatever the role adds (who serves whom)
    {"cmd": "checkpoint.fetch", "version": int, "out_dir": abs path, "timeout_s": float}
        -> progress lines {"progress": {"version", "chunks_have", "chunks_total", "bytes_per_s"}},
           then {"version": int, "files": [abs path...], "total_bytes": int}
    {"cmd": "checkpoint.wait", "version": int | "latest", "timeout_s": float}
        -> {"version": int, "dir": str, "files": [str...]} once the version is complete and durable

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

from p2pnet.cliargs import command, data_dir_argument, group, json_argument, path
from p2pnet.config import LAST_START_FILE, load_config, load_toml
from p2pnet.control import CommandRefused
from p2pnet.errors import ConfigError, LocalStateError
from p2pnet.settings import SECTIONS
from p2pnet.identity import KEY_FILE, Identity, ensure_data_dir, load_or_create_identity
from relay.config import RelayConfig, relay_config
from relay.errors import VersionIncomplete
from relay.store import ChunkStore

LOCK_FILE = "peer.lock"


def register(commands: Any) -> None:
    sub = group(commands, "checkpoint", "publish, inspect, fetch and wait for signed checkpoints", example="""
        p2pnet checkpoint publish model.safetensors --model my-model --version 7
        p2pnet checkpoint fetch latest --out ./weights""")

    publish = command(sub, "publish", "sign files as checkpoint VERSION and keep them in the store",
                      description="The files are signed with the data directory's key: through the running "
                      "peer, which announces the version at once, or into its store offline (announced on the "
                      "peer's next start). Peers believe it only if they trust this key (--trust PEER_ID, or "
                      "[relay] trusted_publishers). Files named *.safetensors are checked and indexed; any "
                      "other file (tokenizer, config) travels as it is. By default the files are hard-linked "
                      "into the store (no copy) and become read-only: write each version to new files.",
                      example="p2pnet checkpoint publish model.safetensors --data-dir ~/.p2pnet/a --model my-model "
                      "--version 7")
    publish.add_argument("paths", nargs="+", type=path, metavar="PATH",
                         help="the version's files, in order (safetensors weights and anything else); a folder "
                         "stands for the files directly in it, by name, hidden ones left out")
    publish.add_argument("--place", choices=("link", "move", "copy"), default="link",
                         help="how the files enter the store: hard link (default; a copy across filesystems), "
                         "move (the same, then the names given are deleted once the version is kept), or copy")
    publish.add_argument("--model", required=True, help="model name recorded in the manifest")
    publish.add_argument("--version", dest="ckpt_version", type=int, required=True, metavar="N",
                         help="the checkpoint version (a training step; newer versions have larger numbers)")
    publish.add_argument("--previous", type=int, default=-1, metavar="N",
                         help="the version this one follows (default: none)")
    publish.add_argument("--chunk-bytes", type=int, metavar="BYTES", help="chunk size (default from [relay], 8 MiB)")
    publish.add_argument("--timeout-s", type=float, default=600.0, metavar="S",
                         help="give up after this long (default 600)")
    _common(publish)
    publish.set_defaults(func=cmd_publish)

    status = command(sub, "status", "versions held, progress per version (and who serves whom)",
                     description="Through the running peer when one runs with the data directory, else from its "
                     "store on disk.", example="p2pnet checkpoint status --data-dir ~/.p2pnet/b --json")
    _common(status)
    status.set_defaults(func=cmd_status)

    fetch = command(sub, "fetch", "write checkpoint VERSION's files into --out, fetching it if needed",
                    description="Through the running peer (with a progress bar), which fetches the version from "
                    "the network if it does not hold it yet; offline, only a version held complete. `latest` is "
                    "the newest version complete in the peer (the first to complete, if none is yet). The "
                    "files are hard links of the verified files in the store (read-only; a copy across "
                    "filesystems).",
                    example="p2pnet checkpoint fetch 7 --data-dir ~/.p2pnet/b --out ./v7\n"
                    "p2pnet checkpoint fetch latest --out ./weights")
    fetch.add_argument("fetch_version", type=version_arg, metavar="VERSION", help="a version number, or latest")
    fetch.add_argument("--out", type=path, required=True, metavar="DIR",
                       help="directory to write the files into (created if needed; files of the same names there "
                       "are replaced, others left)")
    fetch.add_argument("--timeout-s", type=float, default=600.0, metavar="S",
                       help="give up after this long (default 600)")
    _common(fetch)
    fetch.set_defaults(func=cmd_fetch)

    wait = command(sub, "wait", "block until checkpoint VERSION is complete and durable in the running peer",
                   description="Cheap to leave running: the peer answers once it holds every chunk of the version "
                   "on disk, verified (after a restart, what its record only claims is hashed first). Prints the "
                   "version, the folder holding its files and the files (ordinary files that any loader opens; "
                   "kept until garbage collection drops the version). `latest` is the newest version complete "
                   "in the peer, or the first to complete. Exit status 2 when the timeout passes first, or at "
                   "once for a version older than those the peer keeps ([relay] keep_versions).",
                   example="p2pnet checkpoint wait 7 --data-dir ~/.p2pnet/b --timeout-s 60\n"
                   "p2pnet checkpoint wait latest --json")
    wait.add_argument("wait_version", type=version_arg, metavar="VERSION", help="a version number, or latest")
    wait.add_argument("--timeout-s", type=float, default=600.0, metavar="S",
                      help="give up after this long (default 600)")
    data_dir_argument(wait)
    json_argument(wait)
    wait.set_defaults(func=cmd_wait)


def version_arg(text: str) -> int | str:
    """A checkpoint version: a number >= 0, or `latest`."""
    if text == "latest":
        return text
    try:
        version = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a version number nor latest") from None
    if version < 0:
        raise argparse.ArgumentTypeError("versions are >= 0")
    return version


def _common(parser: argparse.ArgumentParser) -> None:
    data_dir_argument(parser)
    parser.add_argument("--config", type=path, metavar="FILE",
                        help="TOML file whose [relay] section is read (default: the data directory's config.toml)")
    parser.add_argument("--trust", action="append", default=[], metavar="PEER_ID",
                        help="also trust manifests signed by this peer id; repeatable")
    json_argument(parser)


# -- commands -----------------------------------------------------------------------------


def publish_paths(given: list[Path]) -> list[Path]:
    """The files to publish, absolute: a folder stands for the files directly in it, by name (a
    model folder: weights, config, tokenizer), its hidden ones left out; a folder inside it is
    refused (a version's files are one flat folder), as is a folder with nothing to publish."""
    paths: list[Path] = []
    for item in given:
        item = item.resolve()
        if not item.is_dir():
            paths.append(item)  # (a missing file is the store's to refuse, by name)
            continue
        inside = sorted(p for p in item.iterdir() if not p.name.startswith("."))
        nested = [p.name for p in inside if p.is_dir()]
        if nested:
            raise ConfigError(str(item), f"holds the folder {nested[0]!r}: a version's files are one flat folder; "
                                         "name the files to publish one by one")
        if not inside:
            raise ConfigError(str(item), "holds no file to publish (hidden files are left out)")
        paths.extend(inside)
    return paths


def cmd_publish(args: argparse.Namespace) -> int:
    paths = publish_paths(args.paths)
    config = _config(args, chunk_bytes=args.chunk_bytes)
    with _offline(args.data_dir, create=True) as offline:
        if offline:
            identity = load_or_create_identity(args.data_dir)
            store = _open_store(args.data_dir, config.trusting(identity.peer_id))
            signed = store.publish_files(identity, paths, model=args.model, version=args.ckpt_version,
                                         previous_version=args.previous, chunk_bytes=config.chunk_bytes,
                                         now_s=time.time(), place=args.place)
            result: dict[str, Any] = {"manifest_id": signed.manifest_id.hex(), "version": signed.version,
                      "chunks": len(signed.manifest.chunk_digests), "total_bytes": signed.manifest.total_bytes,
                      "offline": True}
        else:
            result = _call(args.data_dir, {"cmd": "checkpoint.publish", "paths": [str(p) for p in paths],
                                           "model": args.model, "version": args.ckpt_version,
                                           "previous_version": args.previous, "chunk_bytes": config.chunk_bytes,
                                           "place": args.place},
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
            status: dict[str, Any] = dict(_open_store(args.data_dir, config).status(), running=False)
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
            store = _open_store(args.data_dir, config)
            version = _newest_held(store) if args.fetch_version == "latest" else args.fetch_version
            signed = store.manifest(version)
            if not store.is_complete(signed):
                held = store.progress(signed)
                raise VersionIncomplete(f"version {version} is incomplete here ({held['chunks_have']}/"
                                        f"{held['chunks_total']} chunks) and no peer is running to fetch the rest; "
                                        f"start one with `p2pnet peer start --role relay --data-dir {args.data_dir}`")
            files = store.export_version(version, out_dir)
            result: dict[str, Any] = {"version": version, "files": [str(p) for p in files],
                      "total_bytes": signed.manifest.total_bytes, "offline": True}
        else:
            version, remaining = args.fetch_version, args.timeout_s
            if version == "latest":  # the newest version the peer knows of, once it holds it
                started = time.monotonic()
                version = _call_waiting(args.data_dir, {"cmd": "checkpoint.wait", "version": "latest",
                                                        "timeout_s": args.timeout_s}, args.timeout_s)["version"]
                remaining = max(args.timeout_s - (time.monotonic() - started), 1.0)
            bar = _ProgressBar(sys.stderr)
            try:
                result = _call_waiting(args.data_dir, {"cmd": "checkpoint.fetch", "version": version,
                                                       "out_dir": str(out_dir), "timeout_s": remaining},
                                       remaining, on_progress=bar.update)
            finally:  # an error goes on a line of its own
                bar.done()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"version {result['version']}: {len(result['files'])} files, {_mb(result['total_bytes'])} in {out_dir}")
        for name in result["files"]:
            print(f"  {name}")
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    """Control command (relay/commands.py): {"cmd": "checkpoint.wait", "version": int | "latest",
    "timeout_s": float} -> {"version": int, "dir": str, "files": [str, ...]} once the version
    is complete and durable, or an error answer."""
    result = _call_waiting(args.data_dir, {"cmd": "checkpoint.wait", "version": args.wait_version,
                                           "timeout_s": args.timeout_s}, args.timeout_s)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"version {result['version']} is complete in {result['dir']}")
        for name in result.get("files", []):
            print(f"  {name}")
    return 0


def _newest_held(store: ChunkStore) -> int:
    complete = [row["version"] for row in store.status()["versions"] if row.get("complete")]
    if not complete:
        raise LocalStateError(f"no complete version is held in {store.root}; start a peer to fetch one")
    return max(complete)


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
    if create:
        ensure_data_dir(data_dir)
    elif not data_dir.exists():
        raise LocalStateError(f"no data directory {data_dir}: give the --data-dir of a peer (nothing was "
                              "ever stored here)")
    elif not data_dir.is_dir():
        raise LocalStateError(f"data directory {data_dir} is not a directory; choose another --data-dir")
    try:
        fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise LocalStateError(f"cannot open {data_dir / LOCK_FILE}: {exc.strerror or exc}; is {data_dir} "
                              "another user's data directory?") from exc
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
    """[relay] from the configuration file (--config, else the data directory's config.toml),
    trusting also what the last peer started here trusted (its --trust flags), the data
    directory's own key, and --trust."""
    _, sections = load_config(args.data_dir, args.config)
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:  # a typo'd [relay] would silently leave every setting at its default
        raise ConfigError(unknown[0], f"unknown section [{unknown[0]}]; known: "
                          + ", ".join(f"[{name}]" for name in SECTIONS))
    config = relay_config(sections.get("relay"), **overrides)
    last = _last_start_trust(args.data_dir)
    own = _own_peer_id(args.data_dir)
    return config.trusting(*last, *([own] if own else []), *args.trust)


def _last_start_trust(data_dir: Path) -> list[str]:
    path = data_dir / LAST_START_FILE
    if not path.is_file():
        return []
    try:
        trusted = load_toml(path, LAST_START_FILE).get("relay", {}).get("trusted_publishers", [])
    except ConfigError:
        return []  # a record we cannot read trusts nobody; the peer's own start rewrites it
    return [p for p in trusted if isinstance(p, str)]


def _own_peer_id(data_dir: Path) -> str | None:
    key = data_dir / KEY_FILE
    try:
        if key.is_file() and key.stat().st_size == 32:
            return Identity(key.read_bytes()).peer_id
    except OSError:
        return None
    return None


def _open_store(data_dir: Path, config: RelayConfig) -> ChunkStore:
    return ChunkStore(config.store_root(data_dir), budget_bytes=config.budget_bytes,
                      keep_versions=config.keep_versions, trusted_publishers=config.trusted_publishers,
                      fsync=config.fsync)


def _call(data_dir: Path, request: dict[str, Any], *, timeout_s: float = 30.0,
          on_progress: Any = None) -> dict[str, Any]:
    from p2pnet.control import call

    async def run() -> dict[str, Any]:
        return await call(data_dir, request, on_progress=on_progress, timeout_s=timeout_s)

    return _checked(data_dir, request, trio.run(run))


def _checked(data_dir: Path, request: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
    """The reply, or CommandRefused saying what to do about its error."""
    if "error" not in reply:
        return reply
    if reply.get("reason") == "unknown_command":
        if "checkpoint.status" in str(reply["error"]):
            fix = f"the peer running with {data_dir} is older than this command; restart it"
        else:
            fix = f"the peer running with {data_dir} has no relay role; stop it and start it again with --role relay"
        reply = {**reply, "error": fix}
    raise CommandRefused(request["cmd"], reply)


def _call_waiting(data_dir: Path, request: dict[str, Any], timeout_s: float, *, on_progress: Any = None,
                  note_after_s: float = 3.0) -> dict[str, Any]:
    """`_call` for a request that may wait for the network (`timeout_s` is the peer's own limit):
    a line on stderr says what it waits for when the peer has shown no progress after
    `note_after_s`, so a long wait is never silent."""
    from p2pnet.control import call

    shown: list[bool] = []
    if request["cmd"] == "checkpoint.fetch":
        what = f"waiting for version {request['version']}: no peer has offered it yet"
    else:
        what = f"waiting until version {request['version']} is complete in the peer"

    def progress(update: dict[str, Any]) -> None:
        shown.append(True)
        if on_progress is not None:
            on_progress(update)

    async def note() -> None:
        await trio.sleep(note_after_s)
        if not shown:
            print(f"{what} (giving up after {timeout_s:.0f} s; --timeout-s to change)", file=sys.stderr, flush=True)

    async def run() -> dict[str, Any]:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(note)
            reply = await call(data_dir, request, on_progress=progress, timeout_s=timeout_s + 10)
            nursery.cancel_scope.cancel()
            return reply

    return _checked(data_dir, request, trio.run(run))


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
