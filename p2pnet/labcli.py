"""`p2pnet lab ...`: build, inspect, use and remove a network lab from the command line (root).

    p2pnet lab up --dir DIR --hosts N [--upload-mbit X] [--download-mbit Y] [--nat-hosts K] [--id ID]
    p2pnet lab up --dir DIR --profile FILE.toml [--id ID]
    p2pnet lab status --dir DIR [--json]
    p2pnet lab exec --dir DIR HOST -- CMD...
    p2pnet lab down --dir DIR

With --hosts, hosts are named h1..hN and the last K sit each behind its own NAT router (group
natJ). A profile lists hosts as `[[host]]` tables: name, upload_mbit, download_mbit, nat (hosts
naming one group share a router). A lab made here is persistent: it stays until `lab down`.
Argument parsing and printing only; the work is in `p2pnet.lab`.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

from p2pnet.cliargs import command, group
from p2pnet.errors import ConfigError
from p2pnet.lab import HostSpec, Lab, LabSpec

PROFILE_KEYS = ("name", "upload_mbit", "download_mbit", "nat")


def register(commands: Any) -> None:
    sub = group(commands, "lab", "real hosts on this machine: network namespaces with bandwidth limits and NAT "
                "(root)", example="""
        sudo p2pnet lab up --dir /tmp/lab --hosts 4 --upload-mbit 100
        sudo p2pnet lab down --dir /tmp/lab""")

    up = command(sub, "up", "build a lab and print its hosts and addresses",
                 description="Hosts (network namespaces) on one switch, with tbf bandwidth limits and NAT "
                 "routers. It stays until `p2pnet lab down`.",
                 example="sudo p2pnet lab up --dir /tmp/lab --hosts 4 --upload-mbit 100 --download-mbit 400 "
                 "--nat-hosts 1")
    up.add_argument("--dir", type=Path, required=True, help="the lab's state directory (lab.json)")
    shape = up.add_mutually_exclusive_group(required=True)
    shape.add_argument("--hosts", type=int, metavar="N", help="N hosts named h1..hN")
    shape.add_argument("--profile", type=Path, metavar="FILE", help="TOML file of [[host]] tables")
    up.add_argument("--upload-mbit", type=float, metavar="X", help="with --hosts: every host's upload limit")
    up.add_argument("--download-mbit", type=float, metavar="Y", help="with --hosts: every host's download limit")
    up.add_argument("--nat-hosts", type=int, default=0, metavar="K",
                    help="with --hosts: the last K hosts each sit behind their own NAT router")
    up.add_argument("--id", dest="lab_id", help="lab id, [a-z0-9]{1,16} (default: random)")
    up.add_argument("--json", action="store_true", help="print machine-readable JSON")
    up.set_defaults(func=cmd_up)

    status = command(sub, "status", "show a lab's hosts, addresses and whether they are up",
                     example="sudo p2pnet lab status --dir /tmp/lab")
    status.add_argument("--dir", type=Path, required=True, help="the lab's state directory")
    status.add_argument("--json", action="store_true", help="print machine-readable JSON")
    status.set_defaults(func=cmd_status)

    down = command(sub, "down", "stop every process in a lab and remove it", example="sudo p2pnet lab down --dir /tmp/lab")
    down.add_argument("--dir", type=Path, required=True, help="the lab's state directory")
    down.set_defaults(func=cmd_down)

    run = command(sub, "exec", "run a command inside one host; exits with its status",
                  example="sudo p2pnet lab exec --dir /tmp/lab h1 -- ip addr")
    run.add_argument("--dir", type=Path, required=True, help="the lab's state directory")
    run.add_argument("host", metavar="HOST", help="a host name (h1, ... or a profile's name)")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD...", help="the command and its arguments")
    run.set_defaults(func=cmd_exec)


def load_profile(path: Path) -> tuple[HostSpec, ...]:
    """The hosts of a TOML profile: `[[host]]` tables with name, upload_mbit, download_mbit, nat."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError("--profile", f"no such file: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--profile", f"{path} is not valid TOML: {exc}") from exc
    tables = data.get("host")
    unknown = sorted(set(data) - {"host"})
    if unknown:
        raise ConfigError(unknown[0], f"unknown table in {path}; a profile holds only [[host]] tables")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ConfigError("host", f"{path} needs at least one [[host]] table")
    hosts = []
    for i, table in enumerate(tables):
        extra = sorted(set(table) - set(PROFILE_KEYS))
        if extra:
            raise ConfigError(f"host[{i}].{extra[0]}", f"unknown setting; known: {', '.join(PROFILE_KEYS)}")
        if "name" not in table:
            raise ConfigError(f"host[{i}].name", "missing")
        try:
            hosts.append(HostSpec(**table))
        except ConfigError as exc:
            raise ConfigError(f"host[{i}] ({exc.field})", exc.problem) from None
    return tuple(hosts)


def hosts_from_counts(n: int, *, upload_mbit: float | None = None, download_mbit: float | None = None,
                      nat_hosts: int = 0) -> tuple[HostSpec, ...]:
    """h1..hN with the same limits; the last `nat_hosts` each behind their own router natJ."""
    if not 1 <= n <= 900:
        raise ConfigError("--hosts", f"must be in [1, 900] (got {n})")
    if not 0 <= nat_hosts <= n:
        raise ConfigError("--nat-hosts", f"must be in [0, --hosts] (got {nat_hosts})")
    first_nat = n - nat_hosts
    return tuple(
        HostSpec(f"h{i + 1}", upload_mbit, download_mbit, f"nat{i - first_nat + 1}" if i >= first_nat else None)
        for i in range(n)
    )


def cmd_up(args: argparse.Namespace) -> int:
    if args.profile is not None:
        for flag, value in (("--upload-mbit", args.upload_mbit), ("--download-mbit", args.download_mbit),
                            ("--nat-hosts", args.nat_hosts or None)):
            if value is not None:
                raise ConfigError(flag, "goes with --hosts; a profile sets limits per host")
        hosts = load_profile(args.profile)
    else:
        hosts = hosts_from_counts(args.hosts, upload_mbit=args.upload_mbit, download_mbit=args.download_mbit,
                                  nat_hosts=args.nat_hosts)
    lab = Lab.up(LabSpec(hosts, args.lab_id or secrets.token_hex(3)), args.dir, persistent=True)
    _print(lab.status(), args.json)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    _print(Lab.load(args.dir).status(), args.json)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    lab = Lab.load(args.dir)
    lab.down()
    print(f"lab {lab.lab_id} is down")
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise ConfigError("CMD", "give the command to run after --")
    lab = Lab.load(args.dir)
    code = subprocess.run([*lab.wrap(args.host), *argv], check=False).returncode
    return code if code >= 0 else 128 - code


def _print(status: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(status, indent=2))
        return
    owner = "persistent" if status["owner_pid"] is None else f"owned by pid {status['owner_pid']}"
    state = "up" if status["up"] else "partly or wholly gone"
    print(f"lab {status['lab_id']}: {len(status['hosts'])} hosts, {state} ({owner}; {status['state_dir']})")
    rows = [("HOST", "IP", "SEEN AS", "NAT", "UP MBIT", "DOWN MBIT", "PROCS", "NETNS")]
    for h in status["hosts"]:
        rows.append((h["name"], h["ip"], h["public_ip"], h["nat"] or "-", _mbit(h["upload_mbit"]),
                     _mbit(h["download_mbit"]), str(h["processes"]) if h["up"] else "gone", h["netns"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    sys.stdout.flush()


def _mbit(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
