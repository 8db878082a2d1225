"""Typed configuration: small frozen dataclasses, validated on construction, filled from TOML.

Every component owns one `Config` dataclass decorated with `@validated`: field types are checked
against their annotations (ints are accepted where floats are wanted, strings where paths are),
then the class's optional `check()` returns `{field: problem}` for values out of range. Any
problem raises `ConfigError` naming the field, prefixed with its TOML section when loaded from a
file: `peer.heartbeat_interval_s: must be > 0`.

It also says where configuration lives: the default data directory (`~/.p2pnet`, or
`$P2PNET_HOME`) and the data directory's own `config.toml`, read when no `--config` is given.

This module must not know which components exist; callers name the section and class.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

from p2pnet.errors import ConfigError

C = TypeVar("C")

DATA_DIR_ENV = "P2PNET_HOME"  # the default data directory, when set
CONFIG_FILE = "config.toml"  # a data directory's own configuration (`p2pnet config init` writes it)
# what the last peer started in a data directory ran with, flags included (written by the CLI
# once the peer runs): the offline `p2pnet checkpoint` commands read the trust from it
LAST_START_FILE = "last-start.toml"


def default_data_dir() -> Path:
    """`$P2PNET_HOME`, else `~/.p2pnet`: the data directory of commands given no `--data-dir`."""
    return Path(os.environ.get(DATA_DIR_ENV) or "~/.p2pnet").expanduser()


def config_path(data_dir: Path, explicit: Path | None) -> Path | None:
    """The TOML file a command reads: `--config` when given, else the data directory's
    `config.toml` when it has one, else none (every setting at its default)."""
    if explicit is not None:
        return explicit
    own = data_dir / CONFIG_FILE
    return own if own.exists() or own.is_symlink() else None


def validated(cls: type[C]) -> type[C]:
    """Class decorator: type-check and range-check a frozen config dataclass on construction."""
    hints = typing.get_type_hints(cls)
    original_init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            coerced = _coerce(f.name, value, hints[f.name])
            if coerced is not value:
                object.__setattr__(self, f.name, coerced)
        check = getattr(self, "check", None)
        if check is not None:
            for name, problem in check().items():
                raise ConfigError(name, _with_value(problem, getattr(self, name, None)))

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


def _with_value(problem: str, value: Any) -> str:
    """The problem and the value it is about, unless the problem already quotes it (a tuple's
    check names its bad item; the whole tuple would print as Python, not as the user wrote it)."""
    if isinstance(value, tuple):
        if any(repr(item) in problem for item in value):
            return problem
        return f"{problem} (got {', '.join(str(item) for item in value) or 'nothing'})"
    return f"{problem} (got {value!r})"


def _coerce(name: str, value: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is float:
        if type(value) is int:
            return float(value)
        if type(value) is float:
            return value
    elif hint is bool or hint is int or hint is str:
        if type(value) is hint:
            return value
    elif hint is Path:
        if isinstance(value, Path):
            return value
        if isinstance(value, str) and value:
            return Path(value)
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if isinstance(value, (list, tuple)):
            items = tuple(_coerce(name, v, args[0]) for v in value)
            return value if isinstance(value, tuple) and all(a is b for a, b in zip(items, value)) else items
    elif origin in (typing.Union, getattr(__import__("types"), "UnionType")) and type(None) in args:
        if value is None:
            return None
        inner = next(a for a in args if a is not type(None))
        return _coerce(name, value, inner)
    else:
        return value  # nested or exotic types are the class's own check()'s business
    raise ConfigError(name, f"expected {_type_name(hint)}, got {type(value).__name__} {value!r}")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)


def from_mapping(cls: type[C], values: Mapping[str, Any], section: str, **overrides: Any) -> C:
    """Build `cls` from a TOML table plus CLI overrides (None means 'not given')."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in values:
        if key not in known:
            raise ConfigError(f"{section}.{key}", f"unknown setting; known: {', '.join(sorted(known))}")
    merged = dict(values)
    merged.update({k: v for k, v in overrides.items() if v is not None})
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in merged and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{section}.{f.name}", "required setting missing")
    try:
        return cls(**merged)
    except ConfigError as exc:
        raise ConfigError(f"{section}.{exc.field}", exc.problem) from None


def load_toml(path: Path | None, field: str = "--config") -> dict[str, Any]:
    """The TOML file as a dict of sections; an empty dict when no file is given. `field` names
    where the path came from in errors (`--config`, or `config file` for a data directory's own)."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(field, f"no such file: {path}") from exc
    except OSError as exc:  # a directory, no permission, an I/O error
        raise ConfigError(field, f"cannot read {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(field, f"{path} is not valid TOML: {exc}") from exc
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(section, "expected a [section] table")
    return data


def load_config(data_dir: Path, explicit: Path | None) -> tuple[Path | None, dict[str, Any]]:
    """(the file read, its sections): `--config`, else the data directory's `config.toml`."""
    path = config_path(data_dir, explicit)
    return path, load_toml(path, "--config" if explicit is not None else "config file")


def to_jsonable(config: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out[f.name] = str(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value
    return out
