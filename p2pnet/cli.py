"""The `p2pnet` command line: argument parsing and the trio entry points, nothing else.

Subcommands of other packages (checkpoint, validator, devnet, sim, model) register themselves
through a `register(subparsers)` function in their own `cli` module; this module only lists
where those live. Errors that are the user's (`ConfigError`, `LocalStateError`,
`PeerUnavailable`, and `CommandRefused`: an error answer from the running peer) print one line
and exit with status 2; a closed stdout (`p2pnet peer status | head -1`) ends quietly; anything
else is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

import trio

from p2pnet import __version__
from p2pnet.control import CommandRefused
from p2pnet.errors import ConfigError, LocalStateError, PeerUnavailable

USER_ERRORS = (ConfigError, LocalStateError, PeerUnavailable, CommandRefused)
EXTENSIONS = ("p2pnet.demo", "relay.cli", "verify.cli", "trainer.cli", "simulations.cli", "p2pnet.labcli")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    configure_logging(args.log_level)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except USER_ERRORS as exc:
        _print_error(exc)
        return 2
    except BrokenPipeError:
        return _stdout_gone()
    except BaseExceptionGroup as group:  # trio nurseries wrap errors raised inside them
        ours, rest = group.split(USER_ERRORS + (BrokenPipeError,))
        if ours is None or rest is not None:
            raise
        leaves = _leaves(ours)
        if all(isinstance(exc, BrokenPipeError) for exc in leaves):
            return _stdout_gone()
        for exc in leaves:
            if not isinstance(exc, BrokenPipeError):
                _print_error(exc)
        return 2
    except KeyboardInterrupt:
        return 130


LOG_LEVELS = ("trace", "debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# third-party loggers that drown everything else at DEBUG (measured: `multiaddr` wrote 99% of
# 4,242 lines in 12 s of one peer; with it quiet, yamux, noise and pubsub (which dumps whole
# protobufs over several lines) wrote 90% of the rest); they stay at WARNING unless `trace`
CHATTY_LOGGERS = ("multiaddr", "libp2p.stream_muxer", "libp2p.security", "libp2p.pubsub",
                  "libp2p.protocol_muxer", "libp2p.network.stream")


def configure_logging(level_name: str) -> None:
    """Every logger, libp2p's included (see `p2pnet.host.adopt_libp2p_logging`), in one format on
    stderr. `trace` is `debug` with the chatty third-party loggers let through as well."""
    level = logging.DEBUG if level_name == "trace" else getattr(logging, level_name.upper())
    logging.basicConfig(level=level, format=LOG_FORMAT, force=True)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if level_name == "trace" else max(level, logging.WARNING))


def _add_log_level(parser: argparse.ArgumentParser, default: Any) -> None:
    """`--log-level` before or after the subcommand: every parser takes it."""
    parser.add_argument("--log-level", default=default, choices=LOG_LEVELS,
                        help="log verbosity on stderr (default: warning); trace also shows the chatty "
                        f"third-party loggers ({', '.join(CHATTY_LOGGERS)}) that debug keeps at WARNING")
    for action in parser._actions:  # argparse has no public way to list subparsers
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                _add_log_level(sub, argparse.SUPPRESS)


def _print_error(exc: BaseException) -> None:
    """One line on stderr, whatever the error's text holds."""
    print(f"p2pnet: error: {' '.join(str(exc).split())}", file=sys.stderr)


def _stdout_gone() -> int:
    """Whoever read our output (`| head -1`) has gone: stop quietly, with nothing left to flush."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())  # what is still buffered goes nowhere at exit
    finally:
        os.close(devnull)
    return 0


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2pnet",
        description="Peer-to-peer weight distribution and verification for decentralized RL training.",
    )
    parser.add_argument("--version", action="version", version=f"p2pnet {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    _register_peer(commands)
    for module_name in EXTENSIONS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # that package has no CLI (yet)
            raise
        module.register(commands)
    _add_log_level(parser, "warning")
    return parser


def _register_peer(commands: Any) -> None:
    peer = commands.add_parser("peer", help="run and inspect a peer")
    sub = peer.add_subparsers(title="peer commands", metavar="COMMAND")

    start = sub.add_parser(
        "start",
        help="start a peer and run until SIGINT/SIGTERM",
        description="Start a peer: a libp2p host (Noise, yamux) that gossips signed heartbeats, keeps a "
        "peer table and runs the given roles. Prints its full multiaddr; stops cleanly on Ctrl-C.",
    )
    add_peer_arguments(start, roles_help="relay, worker, validator or trainer; repeatable (default: none, a plain peer)")
    start.set_defaults(func=cmd_peer_start)

    status = sub.add_parser("status", help="show a running peer's id, addresses and peer table")
    status.add_argument("--data-dir", type=Path, required=True)
    status.add_argument("--json", action="store_true", help="print machine-readable JSON")
    status.set_defaults(func=cmd_peer_status)

    announce = sub.add_parser("announce", help="gossip a signed notice to every peer (a network-wide ping)")
    announce.add_argument("--data-dir", type=Path, required=True)
    announce.add_argument("text", help="up to 1024 characters")
    announce.set_defaults(func=cmd_peer_announce)

    ident = sub.add_parser("id", help="print the peer id of a data directory (creates the key if missing)")
    ident.add_argument("--data-dir", type=Path, required=True)
    ident.set_defaults(func=cmd_peer_id)


def add_peer_arguments(start: argparse.ArgumentParser, *, roles_help: str) -> None:
    """The flags every command that starts a peer takes (`peer start`, `validator start`)."""
    start.add_argument("--data-dir", type=Path, required=True, help="identity key, state and control socket live here")
    start.add_argument("--listen", help="libp2p listen multiaddr (default /ip4/127.0.0.1/tcp/0; /ip4/0.0.0.0/tcp/4001 "
                       "listens on every interface and advertises each interface's address, never 0.0.0.0)")
    start.add_argument("--announce", action="append", default=[], metavar="MULTIADDR",
                       help="advertise this libp2p address instead of the listen addresses (a public IP, a "
                       "forwarded port); repeatable; [peer] announce in TOML")
    start.add_argument("--data-announce", metavar="HOST:PORT",
                       help="advertise this data-plane address instead of the bound one (a forwarded port)")
    start.add_argument("--data-port", type=int, help="data-plane TCP port (default 0: any free port); it binds the "
                       "listen address's IP")
    start.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                       help="full multiaddr (with /p2p/ID) of a peer to join through; repeatable, any one is enough; "
                       "retried with backoff for as long as the peer runs, and again whenever it has no connections")
    start.add_argument("--role", action="append", default=[], metavar="NAME", help=roles_help)
    start.add_argument("--config", type=Path, help="TOML file with [peer], [peertable] and per-role sections")
    start.add_argument("--heartbeat-interval-s", type=float, help="seconds between heartbeats (default 2)")
    start.add_argument("--peer-expiry-s", type=float, help="forget peers silent this long (default 10)")
    start.add_argument("--upload-bps", type=int, help="upload bandwidth to advertise, bytes/s")


def peer_configs(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """PeerConfig, PeerTableConfig and the remaining TOML sections, from --config and flags."""
    from p2pnet.config import from_mapping, load_toml
    from p2pnet.node import PeerConfig
    from p2pnet.peertable import PeerTableConfig
    from p2pnet.roles import check_sections

    sections = load_toml(args.config)
    check_sections(sections)
    config = from_mapping(
        PeerConfig, sections.get("peer", {}), "peer",
        data_dir=args.data_dir,
        listen=args.listen,
        announce=tuple(args.announce) or None,
        data_announce=args.data_announce,
        data_port=args.data_port,
        bootstrap=tuple(args.bootstrap) or None,
        roles=tuple(args.role) or None,
        upload_bps=args.upload_bps,
    )
    table = from_mapping(
        PeerTableConfig, sections.get("peertable", {}), "peertable",
        heartbeat_interval_s=args.heartbeat_interval_s,
        expiry_s=args.peer_expiry_s,
    )
    return config, table, sections


def cmd_peer_start(args: argparse.Namespace) -> int:
    config, table, sections = peer_configs(args)
    return run_peer(config, table, sections)


def run_peer(config: Any, table: Any, sections: dict[str, Any]) -> int:
    """Run one peer in this process until SIGINT/SIGTERM, printing its addresses once it listens."""
    from p2pnet.node import run_node

    def announce(node: Any) -> None:
        print(f"peer {node.peer_id} started (data dir {config.data_dir})", flush=True)
        for addr in node.host.addrs():
            print(f"listening on {addr}", flush=True)
        print(f"data plane on {node.dataplane.address}; roles: {', '.join(config.roles) or 'none'}", flush=True)

    trio.run(serve_until_signal, lambda task_status: run_node(
        config, sections=sections, peertable_config=table, on_ready=announce, task_status=task_status))
    try:
        print("peer stopped", flush=True)
    except BrokenPipeError:
        pass  # whoever read our stdout is gone; the stop itself was clean
    return 0


async def serve_until_signal(start: Callable[..., Any]) -> None:
    """Run `start` (a task_status-style function) until SIGINT or SIGTERM, then cancel it."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(start)
            async for signum in signals:
                print(f"received {signal.Signals(signum).name}, stopping", flush=True)
                nursery.cancel_scope.cancel()
                break


def cmd_peer_status(args: argparse.Namespace) -> int:
    from p2pnet.control import call

    status = trio.run(call, args.data_dir, {"cmd": "status"})
    if "error" in status:
        raise PeerUnavailable(status["error"])
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    reachable = {True: "yes", False: "no (others cannot dial it)", None: "unknown"}[status.get("reachable")]
    print(f"peer {status['peer_id']}  up {status['uptime_s']:.0f}s  roles: {', '.join(status['roles']) or 'none'}")
    print(f"advertised (listening on {', '.join(status['listen_addrs'])}):")
    for addr in status["addrs"]:
        print(f"  {addr}")
    print(f"data plane {status['data_addr']} (bound {status['data_listen']})  reachable: {reachable}")
    print(f"{len(status['peers'])} peers known, {len(status['connected'])} connected")
    for p in status["peers"]:
        print(f"  {p['peer_id']}  roles={','.join(p['roles']) or '-'}  up={p['upload_bps'] / 1e6:.0f}MB/s  "
              f"data={p['data_addr']}  reachable={p['reachable']}  heard {p['last_heard_s_ago']:.1f}s ago  "
              f"score={p['score']:.1f}")
    return 0


def cmd_peer_announce(args: argparse.Namespace) -> int:
    from p2pnet.control import call

    reply = trio.run(call, args.data_dir, {"cmd": "announce", "text": args.text})
    if "error" in reply:
        raise ConfigError("text", reply["error"])
    print(reply["notice_id"])
    return 0


def cmd_peer_id(args: argparse.Namespace) -> int:
    from p2pnet.identity import load_or_create_identity

    print(load_or_create_identity(args.data_dir).peer_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
