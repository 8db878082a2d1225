"""The `p2pnet` command line: argument parsing, logging, the `peer` commands and the trio entry
points, nothing else.

Subcommands of other packages (checkpoint, validator, worker, trainer, devnet, sim, model, ...)
register themselves through a `register(subparsers)` function in their own `cli` module; this
module only lists where those live. Every command that starts a peer goes through
`peer_configs` (the data directory's config.toml or --config, then flags, every enabled role's
section checked before anything starts) and `run_peer`, which records what the peer runs with in
the data directory's last-start.toml. Errors that are the user's (`ConfigError`,
`LocalStateError`, `PeerUnavailable`, and `CommandRefused`: an error answer from the running
peer) print one line and exit with status 2, as do usage mistakes; a closed stdout (`p2pnet peer
status | head -1`) ends quietly; anything else is a bug and shows its traceback. `--log-level`,
`-v` and `-q` are accepted before or after any subcommand; every log line has time, level and
source.
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
from p2pnet.cliargs import Parser, add_peer_arguments, command, data_dir_argument, examples, group, json_argument
from p2pnet.config import LAST_START_FILE, default_data_dir
from p2pnet.control import CommandRefused
from p2pnet.errors import ConfigError, LocalStateError, PeerUnavailable

USER_ERRORS = (ConfigError, LocalStateError, PeerUnavailable, CommandRefused)
EXTENSIONS = ("relay.cli", "verify.cli", "trainer.cli", "p2pnet.configcli", "p2pnet.demo", "simulations.cli",
              "p2pnet.labcli", "p2pnet.dashboard")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        getattr(args, "_group", parser).print_help()  # `p2pnet peer` alone lists the peer commands
        return 2
    configure_logging(log_level(args), getattr(args, "log_format", "text"))
    if getattr(args, "data_dir", "") is None:
        args.data_dir = default_data_dir()
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except USER_ERRORS as exc:
        _print_error(exc, args)
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
        for leaf in leaves:
            if not isinstance(leaf, BrokenPipeError):
                _print_error(leaf, args)
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


def log_level(args: argparse.Namespace) -> str:
    """`--log-level` (default warning), one step more verbose per -v and quieter per -q."""
    steps = sum(getattr(args, f"_verbose{depth}", 0) - getattr(args, f"_quiet{depth}", 0) for depth in range(4))
    index = LOG_LEVELS.index(args.log_level) - steps
    return LOG_LEVELS[min(max(index, 0), len(LOG_LEVELS) - 1)]


def configure_logging(level_name: str, log_format: str = "text") -> None:
    """Every logger, libp2p's included (see `p2pnet.host.adopt_libp2p_logging`), and Python's
    warnings, in one format on stderr: time, level, source, message (`json`: one object per
    line, `p2pnet.logformat`). `trace` is `debug` with the chatty third-party loggers let through
    as well."""
    level = logging.DEBUG if level_name == "trace" else getattr(logging, level_name.upper())
    logging.basicConfig(level=level, format=LOG_FORMAT, force=True)
    if log_format == "json":
        from p2pnet.logformat import JsonFormatter

        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
    logging.captureWarnings(True)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if level_name == "trace" else max(level, logging.WARNING))


def _add_log_level(parser: argparse.ArgumentParser, default: Any, depth: int = 0) -> None:
    """`--log-level`, `-v` and `-q` before or after any subcommand: every parser takes them."""
    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-level", default=default, choices=LOG_LEVELS,
                      help="log verbosity on stderr (default: warning); trace is debug with the chatty "
                      "third-party loggers (multiaddr, libp2p internals) let through")
    counted = 0 if depth == 0 else argparse.SUPPRESS  # each depth counts apart: a subparser's copy would win
    logs.add_argument("--log-format", default=default if default is argparse.SUPPRESS else "text",
                      choices=("text", "json"), help="text (default) or json: one JSON object per line with time, "
                      "level, peer_id, role, event, logger and message")
    logs.add_argument("-v", "--verbose", dest=f"_verbose{depth}", action="count", default=counted,
                      help="log more: -v info, -vv debug, -vvv trace")
    logs.add_argument("-q", "--quiet", dest=f"_quiet{depth}", action="count", default=counted,
                      help="log less: -q errors only")
    for action in parser._actions:  # argparse has no public way to list subparsers
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                _add_log_level(sub, argparse.SUPPRESS, depth + 1)


# what `--json` output says an error was, by whose side it is on: the caller's input or settings,
# our own files, a peer (or the running one) that did not answer in time, or a refusal by the peer
ERROR_KINDS = ((ConfigError, "input"), (LocalStateError, "local_state"), (PeerUnavailable, "unavailable"),
               (CommandRefused, "refused"))


def _print_error(exc: BaseException, args: argparse.Namespace | None = None) -> None:
    """One line on stderr, whatever the error's text holds; with `--json`, also one object on
    stdout, {"error": the same line, "kind": ERROR_KINDS'}, so a script reading stdout sees it."""
    line = " ".join(str(exc).split())
    print(f"p2pnet: error: {line}", file=sys.stderr)
    if getattr(args, "json", False):
        kind = next((name for cls, name in ERROR_KINDS if isinstance(exc, cls)), "error")
        print(json.dumps({"error": line, "kind": kind}), flush=True)


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
    parser = Parser(
        prog="p2pnet",
        description="Peer-to-peer weight distribution and verification for decentralized RL training.",
        epilog=examples("""
            p2pnet peer start --role relay          # a peer in ~/.p2pnet (or $P2PNET_HOME)
            p2pnet peer status
            p2pnet COMMAND --help                   # each command's options and an example"""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    sub = group(commands, "peer", "run and inspect a peer", example="""
        p2pnet peer start --data-dir ~/.p2pnet/a --role relay
        p2pnet peer status --data-dir ~/.p2pnet/a""")

    start = command(
        sub, "start", "start a peer and run until SIGINT/SIGTERM",
        description="A libp2p host (Noise, yamux) that gossips signed heartbeats, keeps a peer table and runs "
        "the given roles. It prints its full multiaddr (give it to others as --bootstrap) and stops cleanly on "
        "Ctrl-C. Settings come from the data directory's config.toml (or --config), then these flags. Workers, "
        "trainers and validators have their own commands with the flags they need: `p2pnet worker start`, "
        "`p2pnet trainer start`, `p2pnet validator start`.",
        example="""
        p2pnet peer start --data-dir ~/.p2pnet/a --listen /ip4/0.0.0.0/tcp/4001 --role relay
        p2pnet peer start --data-dir ~/.p2pnet/b --role relay --trust 12D3KooW... \\
            --bootstrap /ip4/192.0.2.10/tcp/4001/p2p/12D3KooW...""")
    add_peer_arguments(start, roles_help="relay, worker, validator or trainer; repeatable (default: none, a plain "
                       "peer); worker and trainer bring the relay role with them")
    start.set_defaults(func=cmd_peer_start)

    status = command(sub, "status", "show a running peer's id, addresses and peer table",
                     example="p2pnet peer status --data-dir ~/.p2pnet/a --json")
    data_dir_argument(status)
    json_argument(status)
    status.set_defaults(func=cmd_peer_status)

    announce = command(sub, "announce", "gossip a signed notice to every peer (a network-wide ping)",
                       example='p2pnet peer announce --data-dir ~/.p2pnet/a "hello"')
    data_dir_argument(announce)
    announce.add_argument("text", help="the notice, up to 1024 characters")
    announce.set_defaults(func=cmd_peer_announce)

    ident = command(sub, "id", "print the peer id of a data directory (creates the key if missing)",
                    example="p2pnet peer id --data-dir ~/.p2pnet/a")
    data_dir_argument(ident)
    ident.set_defaults(func=cmd_peer_id)


# what to run, or which key to set, when a role's required setting is missing
ROLE_COMMANDS = {
    "worker": "p2pnet worker start --model DIR --trust TRAINER_ID",
    "trainer": "p2pnet trainer start --model DIR",
    "validator": "p2pnet validator start --model DIR",
}
NEEDS_RELAY = ("worker", "trainer")  # they get or publish their weights through the relay role


def peer_configs(args: argparse.Namespace, overlay: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 ) -> tuple[Any, Any, dict[str, Any]]:
    """PeerConfig, PeerTableConfig and the remaining TOML sections, from the configuration file
    (--config, else the data directory's config.toml) and the flags; `overlay` lays a role
    command's flags over the sections before they are checked."""
    from p2pnet.config import from_mapping, load_config
    from p2pnet.node import PeerConfig
    from p2pnet.peertable import PeerTableConfig
    from p2pnet.roles import check_sections

    _, sections = load_config(args.data_dir, args.config)
    check_sections(sections)
    roles = list(args.role) or sections.get("peer", {}).get("roles", [])
    if isinstance(roles, list) and any(role in NEEDS_RELAY for role in roles) and "relay" not in roles:
        roles = ["relay", *roles]
    config = from_mapping(
        PeerConfig, sections.get("peer", {}), "peer",
        data_dir=args.data_dir,
        listen=args.listen,
        announce=tuple(args.announce) or None,
        data_announce=args.data_announce,
        data_port=args.data_port,
        bootstrap=tuple(args.bootstrap) or None,
        roles=tuple(roles) if isinstance(roles, list) and roles else None,
        upload_bps=args.upload_bps,
        metrics_listen=getattr(args, "metrics_listen", None),
        display_name=getattr(args, "display_name", None),
    )
    table = from_mapping(
        PeerTableConfig, sections.get("peertable", {}), "peertable",
        heartbeat_interval_s=args.heartbeat_interval_s,
        expiry_s=args.peer_expiry_s,
    )
    sections = with_trust(sections, args.trust)
    sections = with_diloco_trainers(sections, getattr(args, "diloco_trainer", []))
    if overlay is not None:
        sections = overlay(sections)
    check_roles(config.roles, sections)
    return config, table, sections


def start_role(args: argparse.Namespace, role: str,
               section_from_flags: Callable[[argparse.Namespace, dict[str, Any]], dict[str, Any]]) -> int:
    """`p2pnet ROLE start`: `peer start` with ROLE added and ROLE's section filled from the flags
    (`section_from_flags(args, sections)`; a flag given wins over the file)."""
    if role not in args.role:
        args.role = [*args.role, role]
    config, table, sections = peer_configs(args, lambda s: {**s, role: section_from_flags(args, s)})
    return run_peer(config, table, sections)


def with_trust(sections: dict[str, Any], peer_ids: list[str]) -> dict[str, Any]:
    """The sections with `--trust` peer ids added to [relay] trusted_publishers."""
    return _with_peer_ids(sections, "--trust", ("relay", "trusted_publishers"), peer_ids,
                          "give the id a peer prints when it starts")


def with_diloco_trainers(sections: dict[str, Any], values: list[str]) -> dict[str, Any]:
    """The sections with `--diloco-trainer` peer ids (each value one id or several, comma-separated)
    added to [diloco] trainers, the file's first; none given, the sections as they are."""
    peer_ids = [p.strip() for value in values for p in value.split(",") if p.strip()]
    return _with_peer_ids(sections, "--diloco-trainer", ("diloco", "trainers"), peer_ids,
                          "give the base58 id each trainer prints when it starts")


def _with_peer_ids(sections: dict[str, Any], flag: str, where: tuple[str, str], peer_ids: list[str],
                   hint: str) -> dict[str, Any]:
    """The sections with `peer_ids` (checked, each named by `flag` if bad) appended to the list
    `where` = (section, key), after the file's and without repeats."""
    from p2pnet.identity import peer_id_from_str

    for peer in peer_ids:
        try:
            peer_id_from_str(peer)
        except ValueError:
            raise ConfigError(flag, f"{peer!r} is not a peer id; {hint} (12D3KooW...), or "
                              "`p2pnet peer id --data-dir DIR`") from None
    if not peer_ids:
        return sections
    name, key = where
    section = dict(sections.get(name, {}))
    known = list(section.get(key, []))
    section[key] = known + [p for p in dict.fromkeys(peer_ids) if p not in known]
    return {**sections, name: section}


def check_roles(roles: tuple[str, ...], sections: dict[str, Any]) -> None:
    """Each enabled role's section complete, before anything starts; a missing setting names its
    TOML key and the command whose flags set it."""
    from p2pnet.config import from_mapping
    from p2pnet.settings import config_class

    for role in roles:
        section = sections.get(role, {})
        command = f", or start with `{ROLE_COMMANDS[role]}`" if role in ROLE_COMMANDS else ""
        try:
            from_mapping(config_class(role), section, role)
        except ConfigError as exc:
            if exc.problem == "required setting missing":
                key = exc.field.rpartition(".")[2]
                raise ConfigError(exc.field, f"required setting missing for the {role} role; set {key} in the "
                                  f"[{role}] section of the config file (docs/configuration.md){command}") from None
            raise
        if role == "validator" and not (section.get("model_path") or section.get("checkpoint_dir")):
            raise ConfigError("validator.model_path", "the validator needs a model folder; set model_path (or "
                              f"checkpoint_dir) in the [validator] section of the config file{command}")
        _check_folders(role, section)


# the model folders a role reads (a validator's checkpoint_dir may be made later, by a trainer)
ROLE_FOLDERS = {"worker": "model_dir", "trainer": "model_dir", "validator": "model_path"}


def _check_folders(role: str, section: dict[str, Any]) -> None:
    """A role's model folder is one now, not only when it is first used (a worker loads its model
    once the first checkpoint arrives)."""
    key = ROLE_FOLDERS.get(role)
    if key is None or not section.get(key):
        return
    folder = Path(section[key]).expanduser()
    if not (folder / "config.json").is_file():
        what = "is not a model folder (no config.json)" if folder.is_dir() else "does not exist"
        raise ConfigError(f"{role}.{key}", f"{folder} {what}; make a model folder with "
                          "`p2pnet model prepare tiny --out DIR`")


def cmd_peer_start(args: argparse.Namespace) -> int:
    config, table, sections = peer_configs(args)
    return run_peer(config, table, sections)


def run_peer(config: Any, table: Any, sections: dict[str, Any]) -> int:
    """Run one peer in this process until SIGINT/SIGTERM, printing its addresses once it listens."""
    from p2pnet.node import run_node

    def announce(node: Any) -> None:
        record_start(config, table, sections)
        print(f"peer {node.peer_id} started (data dir {config.data_dir})", flush=True)
        for addr in node.host.addrs():
            print(f"listening on {addr}", flush=True)
        print(f"data plane on {node.dataplane.address}; roles: {', '.join(config.roles) or 'none'}", flush=True)
        if node.metrics_url:
            print(f"metrics on {node.metrics_url}/metrics (health {node.metrics_url}/healthz)", flush=True)

    trio.run(serve_until_signal, lambda task_status: run_node(
        config, sections=sections, peertable_config=table, on_ready=announce, task_status=task_status))
    try:
        print("peer stopped", flush=True)
    except BrokenPipeError:
        pass  # whoever read our stdout is gone; the stop itself was clean
    return 0


def record_start(config: Any, table: Any, sections: dict[str, Any]) -> None:
    """Write what this peer runs with, flags included, to the data directory's last-start.toml
    (the offline `p2pnet checkpoint` commands read the trust from it)."""
    from p2pnet.config import to_jsonable
    from p2pnet.files import atomic_write_bytes
    from p2pnet.settings import to_toml

    text = to_toml({"peer": to_jsonable(config), "peertable": to_jsonable(table), **sections})
    header = "# What the last peer started with this data directory ran with (written at its start).\n\n"
    atomic_write_bytes(config.data_dir / LAST_START_FILE, (header + text).encode())


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
    for warning in status.get("warnings", []):
        print(f"WARNING: {warning}")
    print(f"{len(status['peers'])} peers known, {len(status['connected'])} connected, "
          f"heartbeats every {status['heartbeat_interval_s']:.1f}s")
    for p in status["peers"]:
        print(f"  {p['peer_id']}  roles={','.join(p['roles']) or '-'}  up={p['upload_bps'] / 1e6:.0f}MB/s  "
              f"data={p['data_addr']}  reachable={p['reachable']}  heard {p['last_heard_s_ago']:.1f}s ago "
              f"(every {p['interval_s']:.1f}s, forgotten after {p['horizon_s']:.0f}s)  score={p['score']:.1f}")
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
