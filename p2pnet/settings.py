"""Every TOML section and key a peer reads, described once and rendered three ways.

Owns the table of sections (which config class fills which `[section]`), what each key means
(the comment beside the field in its class, else `DESCRIPTIONS` below), and the renderings built
from them: `docs/configuration.md` (`render_reference`), the commented file `p2pnet config init`
writes (`render_init`), and a resolved configuration as TOML (`to_toml`, for `p2pnet config
show`). Types and defaults always come from the classes themselves, and a test fails when the
committed reference differs from `render_reference()` or a key has no description, so the
documentation cannot drift from the code. Regenerate the reference with
`python -m p2pnet.settings > docs/configuration.md`.

This module does no I/O beyond importing the config classes (lazily, so a plain peer does not
load torch) and reading their source for the comments.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import json
import math
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pnet.config import CONFIG_FILE, DATA_DIR_ENV
from p2pnet.roles import ROLE_CONFIGS

SECTIONS: dict[str, str] = {
    "peer": "p2pnet.node:PeerConfig",
    "peertable": "p2pnet.peertable:PeerTableConfig",
    **ROLE_CONFIGS,
}

SUMMARIES = {
    "peer": "The peer itself: where it listens and what it advertises, whom it joins through, its roles, and "
            "the limits on what other peers may send it. Flags of `p2pnet peer start` override these.",
    "peertable": "Heartbeats and the peer table: how often this peer says it is alive, when silent peers are "
                 "forgotten, and how misbehaving peers are scored and banned.",
    "relay": "The relay role (`--role relay`): which publishers' checkpoints to believe, the chunk store on "
             "disk, and the bounds on transfers. Read also by the offline `p2pnet checkpoint` commands.",
    "worker": "The worker role (`p2pnet worker start`): the model it generates rollouts with and the "
              "generation settings, which must equal the trainer's.",
    "validator": "The validator role (`p2pnet validator start`): where models are found, how many "
                 "submissions are checked, and the proof thresholds.",
    "trainer": "The trainer role (`p2pnet trainer start`): the starting model, where checkpoints are written, "
               "the training settings, and how batches are admitted.",
    "diloco": "The diloco role (`--role diloco`, `p2pnet devnet --trainers N`): one trainer peer of a DiLoCo "
              "group: inner steps on its own data shard, pseudo-gradients averaged with the other trainer peers "
              "over the data plane each round, an outer Nesterov step; with `publish`, the global weights go out "
              "through this peer's relay role.",
}

# keys whose class has no comment beside them
DESCRIPTIONS: dict[str, str] = {
    "peer.data_dir": "identity key, stores, logs and control socket (set by --data-dir; default $P2PNET_HOME "
                     "or ~/.p2pnet)",
    "peer.listen": "libp2p listen multiaddr; /ip4/0.0.0.0/tcp/4001 listens on every interface and advertises "
                   "each interface's address",
    "peer.bootstrap": "full multiaddrs (with /p2p/ID) of peers to join through; any one is enough",
    "peer.roles": "roles this peer runs: relay, worker, validator, trainer, diloco",
    "peer.data_port": "data-plane TCP port (0: any free port)",
    "peer.upload_bps": "upload bandwidth to advertise, bytes/s",
    "peer.download_bps": "download bandwidth to advertise, bytes/s",
    "peer.max_message_bytes": "larger gossip or direct messages are rejected",
    "peer.max_message_age_s": "messages older than this are dropped as stale (not scored)",
    "peer.max_future_s": "messages timestamped this far in our future are dropped as stale",
    "peer.send_timeout_s": "a direct message not delivered within this is given up",
    "peer.bootstrap_backoff_max_s": "longest wait between two dials of the bootstrap peers",
    "peer.reachability_interval_s": "how often connected peers are asked to dial us back",
    "peer.metrics_trusted_networks": ("IP networks (192.0.2.0/24, 2001:db8::/48, or one address) of the "
                                      "operator's own scrapers and health checks: of the 64 connections "
                                      "metrics_listen takes at once, strangers may hold at most 56, so these, "
                                      "and loopback always, still get in when strangers in many networks fill "
                                      "the rest; nothing else is granted (8 connections per address, an IPv6 "
                                      "/64 unless a narrower network is written, and every deadline hold for "
                                      "them too); one wider than an IPv4 /8 or an IPv6 /16 (0.0.0.0/0, ::/0 "
                                      "trust everyone) lets strangers in it take that share, and is warned "
                                      "about at start and in `p2pnet peer status`"),
    "relay.tree_fanout": "children per peer when layout is tree",
    "peertable.heartbeat_interval_s": ("seconds between two signed heartbeats in a small network (the shortest "
                                       "spacing; with more peers known, see max_heard_per_s); peers silent past "
                                       "their horizon are looked for this often"),
    "peertable.expiry_s": ("a peer silent this long is forgotten (must exceed heartbeat_interval_s); one whose "
                           "heartbeats declare a longer spacing, after as many of its own intervals "
                           "(expiry_s / heartbeat_interval_s), counting at most max_interval_s each"),
    "peertable.target_connections": "connections kept open to other peers",
    "peertable.reject_penalty": "score lost for each rejected message",
    "peertable.ban_score": "a peer whose score falls to this is banned",
    "peertable.ban_s": "how long a ban lasts",
    "peertable.busy_heartbeat_factor": ("while this peer moves checkpoint chunks, its and GossipSub's heartbeats "
                                        "are this many times further apart (its own at most a third of the silence "
                                        "after which others forget it); 1: no change"),
    "peertable.max_heard_per_s": ("heartbeats are spaced (peers known + 1) / this seconds apart (within "
                                  "heartbeat_interval_s and max_interval_s), so that each peer hears about this "
                                  "many a second (times GossipSub's copies) however large the network"),
    "peertable.max_interval_s": ("the longest spacing of heartbeats, and the most another peer's declared spacing "
                                 "counts for (a dead peer is forgotten after up to expiry_s / heartbeat_interval_s "
                                 "times this); use one value across a network"),
    "validator.model_path": "model folder serving every policy version (or set checkpoint_dir)",
    "validator.checkpoint_dir": "folder of v{version}/ model folders (the trainer's layout)",
    "validator.model_cache": "model versions kept loaded at once",
    "validator.device": "cpu or cuda[:N]",
    "validator.sample_rate": "probability that a submission is checked at all",
    "validator.claim_window_s": "wait this long for lower claims before checking",
    "validator.takeover_after_s": "check a submission ourselves when its drawn validator is silent this long",
    "validator.max_queue": "checks in flight before new ones are dropped",
    "validator.rollouts_per_check": "rows recomputed per check (0: all)",
    "validator.task_seed": "the network's task seed; submissions with another seed are refused (default: any)",
    "validator.max_new_tokens": ("the longest output this validator recomputes (at least the trainer's "
                                 "max_new_tokens); a submission allowing more is refused unchecked"),
    "validator.check_prompts": "refuse submissions whose prompts are not the ones assigned to the worker",
    "validator.one_submission_per_step": "refuse a worker's second submission for the same step",
    "validator.workers": "accept submissions only from these peer ids (default: any)",
    "validator.validators": "the validator set (default: peers advertising the validator role)",
    "validator.ban_after_failures": "failed checks after which a worker is banned",
    "validator.ban_min_validators": "distinct validators that must have failed a worker before it is banned",
    "validator.ban_s": "how long a ban lasts (0: for good)",
    "validator.penalty": "score penalty per failed check",
    "validator.thresholds": "overrides of the proof thresholds: exp_mismatches_max, mant_err_mean_max, "
                            "mant_err_median_max, sign_mismatches_max, max_failing_chunks",
    "validator.version_wait_s": "wait this long for a submission's policy version to arrive",
}


@dataclass(frozen=True)
class Setting:
    """One key of one section: its type in words, its default (`required` when it has none)."""

    section: str
    name: str
    type_name: str
    default: Any
    required: bool
    help: str

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"


def config_class(section: str) -> type:
    module_name, _, attr = SECTIONS[section].partition(":")
    return getattr(importlib.import_module(module_name), attr)


def settings(section: str) -> list[Setting]:
    """The keys of `section`, in the order of their class's fields."""
    cls = config_class(section)
    hints = typing.get_type_hints(cls)
    comments = _inline_comments(cls)
    out = []
    for f in dataclasses.fields(cls):
        factory = f.default_factory
        required = f.default is dataclasses.MISSING and factory is dataclasses.MISSING
        if required:
            default = None
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = factory()  # type: ignore[operator]  # (not MISSING here: mypy cannot narrow that sentinel)
        text = comments.get(f.name) or DESCRIPTIONS.get(f"{section}.{f.name}", "")
        out.append(Setting(section, f.name, type_name(hints[f.name]), default, required, text))
    return out


def undocumented() -> list[str]:
    """Keys with no description, and descriptions of keys that do not exist (both must be empty)."""
    missing, known = [], set()
    for section in SECTIONS:
        for s in settings(section):
            known.add(s.key)
            if not s.help:
                missing.append(s.key)
    return missing + [f"{key} (described, but no such key)" for key in DESCRIPTIONS if key not in known]


def _inline_comments(cls: type) -> dict[str, str]:
    """`name: type = default  # this text` in the class body, by field name."""
    source = textwrap.dedent(inspect.getsource(cls))
    out: dict[str, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.line
        body = line[:token.start[1]]
        if line.startswith("    ") and not line.startswith("     ") and ":" in body:
            name = body.strip().split(":", 1)[0]
            if name.isidentifier():
                out[name] = token.string.lstrip("#").strip()
    return out


def type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        return f"{type_name(inner)} (optional)"
    if origin is tuple:
        return f"list of {type_name(args[0])}s"
    if origin is dict or hint is dict:
        return "table"
    names = {bool: "boolean", int: "integer", float: "float", str: "string", Path: "path"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


# -- TOML -------------------------------------------------------------------------------------


def toml_value(value: Any) -> str:
    """One value as TOML (no None: TOML has no null)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))  # JSON's escapes are TOML basic-string escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def to_toml(sections: dict[str, dict[str, Any]], notes: dict[str, str] | None = None) -> str:
    """Sections of values as a TOML file; None values become comments (`# key: not set`),
    and `notes` (by `section.key`) are appended to their lines as comments."""
    notes = notes or {}
    lines: list[str] = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        for key, value in table.items():
            note = notes.get(f"{name}.{key}")
            if value is None:
                lines.append(f"# {key}: not set" + (f" ({note})" if note else ""))
            else:
                lines.append(f"{key} = {toml_value(value)}" + (f"  # {note}" if note else ""))
        lines.append("")
    return "\n".join(lines)


def render_init() -> str:
    """A configuration file in which every key is present, commented out at its default."""
    out = [
        "# p2pnet configuration: every section and key, commented out at its default.",
        "# Uncomment a [section] line and the keys you change; flags given on the command line win.",
        "# Reference: docs/configuration.md. Resolved values: `p2pnet config show`.",
        "",
    ]
    for section in SECTIONS:
        out += ["# " + line for line in textwrap.wrap(SUMMARIES[section], 94)]
        out.append(f"# [{section}]")
        for s in settings(section):
            if s.key == "peer.data_dir":
                continue  # the file lives in the data directory it would name
            out += [f"#   {line}" for line in textwrap.wrap(s.help, 90)]
            if s.required:
                out.append(f"# {s.name} = ...   # required when the {section} role runs ({s.type_name})")
            elif s.default is None:
                out.append(f"# {s.name} =   # not set by default ({s.type_name})")
            else:
                out.append(f"# {s.name} = {toml_value(s.default)}")
        out.append("")
    return "\n".join(out)


# -- the reference --------------------------------------------------------------------------


def render_reference() -> str:
    """docs/configuration.md."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated from the config classes by `python -m p2pnet.settings > docs/configuration.md`;",
        "     tests/p2pnet/test_settings.py fails when this file differs. Do not edit by hand. -->",
        "",
        f"A peer reads its settings from a TOML file: `--config FILE`, else `{CONFIG_FILE}` in its data",
        f"directory (`--data-dir`, default `${DATA_DIR_ENV}` or `~/.p2pnet`), else every setting is at its",
        "default. Flags given on the command line override the file. `p2pnet config init` writes a",
        "commented file with every key below; `p2pnet config show` prints the values a peer would run",
        "with. Every section present in the file is checked when a peer starts, whether or not its role",
        "runs; an unknown section or key, a wrong type or a value out of range is one error line naming",
        "it (`peertable.heartbeat_interval_s: must be > 0`).",
        "",
        "Sections: " + ", ".join(f"[`[{s}]`](#{s})" for s in SECTIONS) + ".",
        "",
    ]
    for section in SECTIONS:
        out += [f"## [{section}]", "", SUMMARIES[section], "", "| key | type | default | meaning |",
                "| --- | --- | --- | --- |"]
        for s in settings(section):
            default = ("the data directory" if s.key == "peer.data_dir" else "required" if s.required
                       else "not set" if s.default is None else f"`{toml_value(s.default)}`")
            out.append(f"| `{s.name}` | {s.type_name} | {default} | {s.help.replace('|', '/')} |")
        out.append("")
    out += ["## Environment", "",
            "| variable | default | meaning |", "| --- | --- | --- |",
            f"| `{DATA_DIR_ENV}` | not set | the data directory when `--data-dir` is not given |",
            "| `PY_YAMUX_RELEASE_ON_READ` | `0` (set by the peer unless already set) | py-libp2p's yamux "
            "receive credit: `0` batches it (one window update per gossip message instead of three; "
            "idle peers use about 0.74x the CPU), `1` is py-libp2p's own default (see `p2pnet/host.py`) |",
            ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(render_reference(), end="")
