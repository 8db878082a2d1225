"""`p2pnet config ...`: show a data directory's resolved configuration, write a commented one.

`config show` prints every section a peer started with that data directory (and no flags) would
run with: the file's values over the defaults, checked as a peer start checks them, as TOML or
JSON. `config init` writes `config.toml` into the data directory with every key commented out at
its default (`p2pnet.settings.render_init`). Argument parsing and printing only.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from p2pnet.cliargs import command, data_dir_argument, group, json_argument, path
from p2pnet.config import CONFIG_FILE, from_mapping, load_config, to_jsonable
from p2pnet.errors import ConfigError, LocalStateError


def register(commands: Any) -> None:
    sub = group(commands, "config", "show or write a data directory's configuration", example="""
        p2pnet config init --data-dir ~/.p2pnet/a
        p2pnet config show --data-dir ~/.p2pnet/a""")

    show = command(sub, "show", "print the configuration a peer in this data directory would run with",
                   description="Every section and key: the configuration file's values (--config, else the "
                   "data directory's config.toml) over the defaults, checked as `p2pnet peer start` checks "
                   "them. Flags given to `peer start` would still override these.",
                   example="p2pnet config show --data-dir ~/.p2pnet/a --json")
    data_dir_argument(show)
    show.add_argument("--config", type=path, metavar="FILE", help="show this file's configuration instead")
    json_argument(show)
    show.set_defaults(func=cmd_show)

    init = command(sub, "init", f"write a commented {CONFIG_FILE} with every key into the data directory",
                   description="Every section and key is written commented out at its default; uncomment what "
                   "you change. Reference of every key: docs/configuration.md.",
                   example="p2pnet config init --data-dir ~/.p2pnet/a\np2pnet config init --print > peer.toml")
    data_dir_argument(init)
    init.add_argument("--force", action="store_true", help=f"replace an existing {CONFIG_FILE}")
    init.add_argument("--print", dest="to_stdout", action="store_true",
                      help="print the file instead of writing it")
    init.set_defaults(func=cmd_init)


def resolved(sections: dict[str, Any], data_dir: Any) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every section's keys at their resolved values, and notes on required keys not set."""
    from p2pnet.roles import check_sections
    from p2pnet.settings import SECTIONS, config_class, settings

    check_sections(sections)
    out: dict[str, dict[str, Any]] = {}
    notes: dict[str, str] = {}
    for name in SECTIONS:
        given = sections.get(name, {})
        extra = {"data_dir": data_dir} if name == "peer" else {}
        keys = settings(name)
        missing = [s for s in keys if s.required and s.name not in given and s.name not in extra]
        if missing:  # a role section that is not usable yet: what is set, and what is still needed
            values = {s.name: given.get(s.name, None if s.required else s.default) for s in keys}
            for s in missing:
                notes[s.key] = f"required when the {name} role runs"
        else:
            values = to_jsonable(from_mapping(config_class(name), given, name, **extra))
        out[name] = {k: (str(v) if hasattr(v, "__fspath__") else list(v) if isinstance(v, tuple) else v)
                     for k, v in values.items()}
    return out, notes


def cmd_show(args: argparse.Namespace) -> int:
    from p2pnet.settings import to_toml

    source, sections = load_config(args.data_dir, args.config)
    values, notes = resolved(sections, args.data_dir)
    if args.json:
        print(json.dumps({"file": str(source) if source else None, "sections": values}, indent=2))
        return 0
    origin = f"{source} over the defaults" if source else f"defaults (no {args.data_dir / CONFIG_FILE})"
    print(f"# configuration of data directory {args.data_dir}: {origin}\n")
    print(to_toml(values, notes), end="")
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    from p2pnet.files import atomic_write_bytes
    from p2pnet.identity import ensure_data_dir
    from p2pnet.settings import render_init

    text = render_init()
    if args.to_stdout:
        sys.stdout.write(text)
        return 0
    target = args.data_dir / CONFIG_FILE
    if (target.exists() or target.is_symlink()) and not args.force:
        raise ConfigError("config init", f"{target} already exists; edit it, or pass --force to replace it")
    ensure_data_dir(args.data_dir)
    try:
        atomic_write_bytes(target, text.encode())
    except OSError as exc:
        raise LocalStateError(f"cannot write {target}: {exc.strerror or exc}") from exc
    print(f"wrote {target}: every key commented out at its default; `p2pnet config show` prints what is in effect")
    return 0
