"""Building blocks every package's command line uses, so that all commands read alike.

Owns the shape of a command's help (a one-line summary, an optional longer description, grouped
options and an `example:` epilog, laid out as written), the `--data-dir` argument with its
default (`$P2PNET_HOME`, else `~/.p2pnet`), and the flags of every command that starts a peer
(`peer start`, `worker start`, `trainer start`, `validator start`); and `output_dir`, which
makes a command's output folder before its work starts, so a path that cannot be written fails
first, in one line. Nothing here runs a peer or reads a file.
"""

from __future__ import annotations

import argparse
import os
import textwrap
import typing
from pathlib import Path
from typing import Any

from p2pnet.config import DATA_DIR_ENV
from p2pnet.errors import ConfigError

WIDTH = 92


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage mistakes are one line too: what is wrong, where help is.
    Subcommands' parsers are of the same class (argparse makes them so)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def _paragraphs(text: str) -> str:
    return "\n\n".join(textwrap.fill(" ".join(p.split()), WIDTH) for p in text.strip().split("\n\n"))


def command(sub: Any, name: str, summary: str, *, example: str, description: str = "") -> argparse.ArgumentParser:
    """A subcommand whose help opens with `summary`, then `description`, and ends with `example`
    (one or more command lines, shown as written)."""
    text = summary[0].upper() + summary[1:] + "."
    if description:
        text += "\n\n" + _paragraphs(description)
    return sub.add_parser(name, help=summary, description=text, epilog=examples(example),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def group(commands: Any, name: str, summary: str, *, example: str, description: str = "") -> Any:
    """A command with subcommands (`p2pnet peer`); given alone, it prints its own help, listing them.
    Returns the subparsers object to add its commands to."""
    parser = command(commands, name, summary, example=example, description=description)
    parser.set_defaults(_group=parser)
    return parser.add_subparsers(title=f"{name} commands", metavar="COMMAND")


def examples(text: str) -> str:
    lines = textwrap.dedent(text.strip("\n")).rstrip().splitlines()
    return "example:\n" + "\n".join(f"  {line}" for line in lines)


def path(text: str) -> Path:
    """A path argument, with `~` expanded (a quoted `~/x` is meant as the user's home too)."""
    return Path(text).expanduser()


def data_dir_argument(parser: Any, help: str = "the peer's data directory") -> None:
    parser.add_argument("--data-dir", type=path, default=None, metavar="DIR",
                        help=f"{help} (default: ${DATA_DIR_ENV}, else ~/.p2pnet)")


def json_argument(parser: Any) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def add_peer_arguments(start: argparse.ArgumentParser, *, roles_help: str) -> None:
    """The flags of every command that starts a peer, in groups; `--config` and `--data-dir` first."""
    where = start.add_argument_group("data and configuration")
    data_dir_argument(where, "identity key, stores, logs and control socket live here")
    where.add_argument("--config", type=path, metavar="FILE",
                       help="TOML file with [peer], [peertable] and per-role sections (default: config.toml in "
                       "the data directory, when there is one); flags override it; keys: docs/configuration.md")
    net = start.add_argument_group("network")
    net.add_argument("--listen", metavar="MULTIADDR",
                     help="libp2p listen multiaddr (default /ip4/127.0.0.1/tcp/0; /ip4/0.0.0.0/tcp/4001 "
                     "listens on every interface and advertises each interface's address, never 0.0.0.0)")
    net.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                     help="full multiaddr (with /p2p/ID) of a peer to join through; repeatable, any one is enough; "
                     "retried with backoff for as long as the peer runs, and again whenever it has no connections")
    net.add_argument("--announce", action="append", default=[], metavar="MULTIADDR",
                     help="advertise this libp2p address instead of the listen addresses (a public IP, a "
                     "forwarded port); repeatable; [peer] announce in TOML")
    net.add_argument("--data-port", type=int, metavar="PORT",
                     help="data-plane TCP port (default 0: any free port); it binds the listen address's IP")
    net.add_argument("--data-announce", metavar="HOST:PORT",
                     help="advertise this data-plane address instead of the bound one (a forwarded port)")
    net.add_argument("--metrics-listen", metavar="HOST:PORT",
                     help="serve Prometheus /metrics, /healthz and the dashboard page on this address (port 0 picks "
                     "one; default: off); [peer] metrics_listen in TOML")
    net.add_argument("--display-name", metavar="TEXT",
                     help="a name shown beside this peer's id on dashboards and leaderboards (at most 64 characters; "
                     "never trusted for anything); [peer] display_name in TOML")
    roles = start.add_argument_group("roles and trust")
    roles.add_argument("--role", action="append", default=[], metavar="NAME", help=roles_help)
    roles.add_argument("--trust", action="append", default=[], metavar="PEER_ID",
                       help="believe checkpoints signed by this peer id (a trainer's); repeatable; adds to "
                       "[relay] trusted_publishers")
    roles.add_argument("--diloco-trainer", action="append", default=[], metavar="PEER_IDS",
                       help="close the DiLoCo group (--role diloco) to these trainer peers, given by their base58 "
                       "peer ids (12D3KooW..., this peer's own among them), comma-separated or repeated; a trainer "
                       "refuses the DiLoCo connections of any other peer and never invites, waits for or takes the "
                       "state from one; adds to [diloco] trainers; none given and none in the file: an open group, "
                       "where any peer whose heartbeat claims the diloco role takes part")
    timing = start.add_argument_group("timing and limits")
    timing.add_argument("--heartbeat-interval-s", type=float, metavar="S",
                        help="seconds between heartbeats (default 2)")
    timing.add_argument("--peer-expiry-s", type=float, metavar="S", help="forget peers silent this long (default 10)")
    timing.add_argument("--upload-bps", type=int, metavar="BYTES",
                        help="upload bandwidth to advertise, bytes/s (default 1e9)")


def output_dir(folder: Path, flag: str = "--out") -> Path:
    """Create `folder` (and its parents) now; ConfigError naming `flag` when it cannot be made or
    written (a file in the way, no permission)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(flag, f"{folder} exists and is not a directory; choose another") from None
    except OSError as exc:
        raise ConfigError(flag, f"cannot create {folder}: {exc.strerror or exc}") from exc
    if not folder.is_dir():
        raise ConfigError(flag, f"{folder} exists and is not a directory; choose another")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(flag, f"{folder} is not writable by this user; choose another")
    return folder
