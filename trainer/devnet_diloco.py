"""`p2pnet devnet --trainers N` (N > 1): a DiLoCo group of trainer peers on one machine.

Every trainer is a `p2pnet peer start` child with the `diloco` role, in a closed group (`[diloco]
trainers` lists every trainer's peer id, the joiner's too: their keys are made up front); trainer0 also runs the
relay role and publishes each round's global weights (signed with its key, the key every relay
trusts), and `--relays` relay-only peers fetch them as inference workers would. Each trainer
takes `--inner-steps` AdamW steps per round on its own shard of the arithmetic task; `--steps`
counts outer rounds. The devnet prints one line per round (held-out loss of the global weights,
the most bytes any one trainer sent, round time, who contributed) and, with `--json`, writes
`rounds: [{round, loss, bytes_sent, contributors, round_s}]`.

For experiments (`benchmarks/bench_diloco.py`): `kill_at_round` SIGKILLs the last trainer when
the group reaches that round, and `join_at_round` starts one more trainer then, with the relay
role trusting trainer0: it takes the global state through the relay (trainer0 puts the outer
momentum into its next version for it; `trainer.diloco_join`), or directly from a live trainer
when that fails, and takes part in the following rounds. The events then say how each state
was taken (`state_taken`, with `via`) and which versions carried the outer state, of how many
bytes (`outer_state_published`).

With `lab` (root; `p2pnet devnet --lab --trainers N --link-mbit M`) every peer runs on a lab
host of its own (`p2pnet.lab`) whose link is limited to `link_mbit` (or per host by the
profile), and each round also shows the all-reduce's bandwidth lower bound 2 (N-1)/N x S / U:
N the round's contributors, S the bytes of one packed pseudo-gradient, U the slowest trainer
link's rate (TCP goodput through the lab's tbf is about 95.6% of it).

Every child is stopped by its own PID at the end, also on failure or Ctrl-C. Deadlines are per
round (`step_timeout_s`), so a busy machine only has to keep each round under the limit.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pnet.errors import ConfigError, PeerUnavailable
from p2pnet.identity import load_or_create_identity
from p2pnet.localnet import PeerProcess, start_peer
from p2pnet.settings import to_toml


@dataclass(frozen=True)
class DilocoDevnetConfig:
    trainers: int = 2
    inner_steps: int = 20
    rounds: int = 10
    relays: int = 1
    model: str = "tiny"
    encoding: str = "int8"
    inner_lr: float = 3e-3
    batch_size: int = 32
    deadline_s: float = 60.0  # the all-reduce's join and reduce deadline
    step_timeout_s: float = 300.0  # one round, the first one including loading the model
    kill_at_round: int | None = None
    join_at_round: int | None = None
    seed: int = 0
    outer_lr: float = 0.7  # DiLoCo's defaults
    outer_momentum: float = 0.9
    lab: bool = False
    link_mbit: float | None = None  # with lab: every host's upload and download limit
    lab_profile: Path | None = None  # with lab: per-host limits by peer name (trainer0, relay0, ...)

    def __post_init__(self) -> None:
        if not 2 <= self.trainers <= 16:
            raise ConfigError("--trainers", "must be in [2, 16] for DiLoCo (1 is the GRPO devnet)")
        if self.inner_steps < 1 or self.rounds < 1 or not 0 <= self.relays <= 16:
            raise ConfigError("--inner-steps", "inner steps and rounds must be >= 1, relays in [0, 16]")
        if not self.outer_lr > 0:
            raise ConfigError("--outer-lr", "must be above 0")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError("--outer-momentum", "must be in [0, 1)")
        if self.encoding not in ("int8", "fp32"):
            raise ConfigError("--encoding", "must be int8 or fp32")
        if (self.link_mbit is not None or self.lab_profile is not None) and not self.lab:
            raise ConfigError("--link-mbit", "link limits need --lab (peers on loopback share one host)")
        if self.link_mbit is not None and not self.link_mbit > 0:
            raise ConfigError("--link-mbit", "must be above 0")
        for name, value in (("kill_at_round", self.kill_at_round), ("join_at_round", self.join_at_round)):
            if value is not None and not 0 < value < self.rounds:
                raise ConfigError(name, f"must be in [1, {self.rounds - 1}]")


def run_diloco_devnet(config: DilocoDevnetConfig, root: Path) -> dict[str, Any]:
    """Run the group to `config.rounds` rounds and return the summary (also printed)."""
    from trainer.model import TINY_CONFIGS, prepare_model

    started = time.monotonic()
    if config.model not in TINY_CONFIGS and not Path(config.model).is_dir():
        raise ConfigError("--model", f"{config.model!r} is neither a model folder nor one of {sorted(TINY_CONFIGS)}")
    print(f"devnet: DiLoCo with {config.trainers} trainer peers, {config.inner_steps} inner steps per round, "
          f"{config.encoding} pseudo-gradients, under {root}", flush=True)
    model_dir = Path(config.model) if Path(config.model).is_dir() else prepare_model(config.model, root / "model",
                                                                                    seed=config.seed)
    publisher = load_or_create_identity(root / "trainer0").peer_id
    procs: dict[str, PeerProcess] = {}
    stopped = ""
    rows: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    lab_json: dict[str, Any] | None = None
    with ExitStack() as stack:
        lab = stack.enter_context(_open_lab(config, root)) if config.lab else None
        stack.callback(_stop_all, procs)  # before the lab goes down (ExitStack unwinds in reverse)
        try:
            for i in range(config.trainers):
                _start(procs, root, f"trainer{i}", config, model_dir, publisher, min_peers=config.trainers, lab=lab)
            for i in range(config.relays):
                _start_relay(procs, root, f"relay{i}", publisher, lab)
            for proc in procs.values():
                proc.wait_ready(max(60.0, config.step_timeout_s))
            where = ""
            if lab is not None:
                from trainer.devnet import lab_hosts, lab_line

                where = f" on lab hosts ({lab_line(lab)})"
                lab_json = lab_hosts(lab)
            print(f"devnet: {len(procs)} peers up{where}: {', '.join(procs)}", flush=True)
            rows = _follow(procs, config, root, model_dir, publisher, events, started, lab, _link_bps(lab_json))
            _wait_for_relays(procs, config.rounds, config.step_timeout_s)
        except PeerUnavailable as exc:
            stopped = str(exc)
        except KeyboardInterrupt:
            stopped = "interrupted (Ctrl-C or SIGTERM)"
        relays = {name: _relay_versions(proc) for name, proc in procs.items()
                  if name.startswith("relay") and proc.alive()}
    names = {p.peer_id: n for n, p in procs.items()}
    summary = {
        "ok": not stopped and len(rows) == config.rounds, "mode": "diloco", "trainers": config.trainers,
        "inner_steps": config.inner_steps, "encoding": config.encoding, "rounds": rows, "events": events,
        "peers": {n: p.peer_id for n, p in procs.items()}, "relay_versions": relays,
        "wall_s": round(time.monotonic() - started, 2), "lab": lab_json,
    }
    for row in rows:
        row["contributors"] = [names.get(p, p) for p in row["contributors"]]
    if stopped:
        summary["stopped"] = stopped
        (root / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"devnet stopped early: {stopped}; logs in {root}", flush=True)
    return summary


def _open_lab(config: DilocoDevnetConfig, root: Path) -> Any:
    from trainer.devnet import open_lab

    names = [f"trainer{i}" for i in range(config.trainers + (config.join_at_round is not None))]
    names += [f"relay{i}" for i in range(config.relays)]
    return open_lab(names, root, link_mbit=config.link_mbit, lab_profile=config.lab_profile)


def _link_bps(lab_hosts: dict[str, Any] | None) -> float | None:
    """The slowest trainer link's rate in bytes/s (upload or download), None when unlimited."""
    rates = [r for name, h in (lab_hosts or {}).items() if name.startswith("trainer")
             for r in (h["upload_mbit"], h["download_mbit"]) if r]
    return min(rates) * 1e6 / 8 if rates else None


def allreduce_bound_s(contributors: int, values: int, encoding: str, link_bps: float) -> float:
    """The bandwidth lower bound of one all-reduce: each of N peers sends (and receives)
    2 (N-1)/N of the packed vector's S bytes over its link of U bytes/s."""
    from trainer.diloco import Encoding, packed_bytes

    n = max(contributors, 1)
    return 2 * (n - 1) / n * packed_bytes(values, Encoding(encoding)) / link_bps


def _peer_args(lab: Any, name: str) -> tuple[list[str], list[str]]:
    """(extra arguments, command prefix) of a peer: on its lab host, or on loopback."""
    if lab is None:
        return [], []
    from trainer.devnet import lab_peer_args

    return lab_peer_args(lab, name), lab.wrap(name)


def _start(procs: dict[str, PeerProcess], root: Path, name: str, config: DilocoDevnetConfig, model_dir: Path,
           publisher: str, *, min_peers: int, lab: Any = None, joiner: bool = False) -> None:
    roles = ("relay", "diloco") if name == "trainer0" or joiner else ("diloco",)
    # a closed group (`[diloco] trainers`): every trainer peer's identity, the joiner's too, made up front
    group = [load_or_create_identity(root / f"trainer{i}").peer_id
             for i in range(config.trainers + (config.join_at_round is not None))]
    sections: dict[str, Any] = {
        "peer": {"display_name": name},
        "peertable": {"heartbeat_interval_s": 1.0, "expiry_s": 15.0},
        "diloco": {"model_dir": model_dir, "out_dir": root / name / "state", "rounds": config.rounds,
                   "inner_steps": config.inner_steps, "inner_lr": config.inner_lr, "batch_size": config.batch_size,
                   "encoding": config.encoding, "deadline_s": config.deadline_s, "min_peers": min_peers,
                   "publish": name == "trainer0", "outer_lr": config.outer_lr,
                   "outer_momentum": config.outer_momentum, "trainers": group},
    }
    if name == "trainer0" or joiner:  # a joiner takes the global state through its relay role
        sections["relay"] = {"trusted_publishers": [publisher], "chunk_bytes": 256 * 1024, "fsync": False,
                             "announce_interval_s": 1.0}
    data_dir = root / name
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "peer.toml").write_text(to_toml(sections))
    bootstrap = [procs["trainer0"].addr] if "trainer0" in procs else []
    extra, wrap = _peer_args(lab, name)
    start_peer(name, data_dir, roles=roles, bootstrap=bootstrap, log_dir=root, wrap=wrap,
               extra_args=["--config", str(data_dir / "peer.toml"), *extra], into=procs)  # (stopped by `_stop_all`)
    if name == "trainer0":
        procs[name].wait_ready(max(60.0, config.step_timeout_s))


def _start_relay(procs: dict[str, PeerProcess], root: Path, name: str, publisher: str, lab: Any = None) -> None:
    data_dir = root / name
    data_dir.mkdir(parents=True, exist_ok=True)
    sections: dict[str, dict[str, Any]] = {"peer": {"display_name": name},
                                           "peertable": {"heartbeat_interval_s": 1.0, "expiry_s": 15.0},
                                           "relay": {"trusted_publishers": [publisher], "chunk_bytes": 256 * 1024,
                                                     "fsync": False, "announce_interval_s": 1.0}}
    (data_dir / "peer.toml").write_text(to_toml(sections))
    extra, wrap = _peer_args(lab, name)
    start_peer(name, data_dir, roles=("relay",), bootstrap=[procs["trainer0"].addr], log_dir=root,
               wrap=wrap, extra_args=["--config", str(data_dir / "peer.toml"), *extra], into=procs)


def _follow(procs: dict[str, PeerProcess], config: DilocoDevnetConfig, root: Path, model_dir: Path,
            publisher: str, events: list[dict[str, Any]], started: float, lab: Any = None,
            link_bps: float | None = None) -> list[dict[str, Any]]:
    """Print each round as the trainers report it, until every live trainer is done."""
    shown = 0
    round_started = time.monotonic()
    killed: set[str] = set()
    rows: list[dict[str, Any]] = []
    while True:
        statuses = {}
        for name, proc in procs.items():
            if name in killed or not name.startswith("trainer"):
                continue
            if not proc.alive():
                raise PeerUnavailable(f"{name} exited early; see {proc.log_path}")
            statuses[name] = proc.status(timeout_s=30)["role_status"]["diloco"]
        rows = merge_rounds(statuses)
        names = {p.peer_id: n for n, p in procs.items()}
        values = next((s.get("values", 0) for s in statuses.values()), 0)
        for row in rows:
            if link_bps and values:
                row["bound_s"] = round(allreduce_bound_s(len(row["contributors"]), values, config.encoding, link_bps), 4)
        for row in rows[shown:]:
            print(round_line(row, names, config.rounds, time.monotonic() - started), flush=True)
            shown += 1
            round_started = time.monotonic()
        group_round = max((s["round"] for s in statuses.values()), default=0)
        if config.kill_at_round is not None and not killed and group_round >= config.kill_at_round:
            victim = f"trainer{config.trainers - 1}"
            procs[victim].kill()
            killed.add(victim)
            events.append({"event": "killed", "peer": victim, "round": group_round})
            print(f"devnet: killed {victim} (SIGKILL) at round {group_round}", flush=True)
        if config.join_at_round is not None and f"trainer{config.trainers}" not in procs \
                and group_round >= config.join_at_round:
            joiner = f"trainer{config.trainers}"
            _start(procs, root, joiner, config, model_dir, publisher, min_peers=2, lab=lab, joiner=True)
            procs[joiner].wait_ready(max(60.0, config.step_timeout_s))
            events.append({"event": "joined", "peer": joiner, "round": group_round})
            print(f"devnet: started {joiner} at round {group_round}", flush=True)
        if statuses and all(s["done"] for s in statuses.values()):
            for event in state_events(statuses, names):
                events.append(event)
                print(f"devnet: {event}", flush=True)
            return rows
        if time.monotonic() - round_started > config.step_timeout_s:
            raise PeerUnavailable(f"round {shown + 1} of {config.rounds} took longer than {config.step_timeout_s:.0f} s "
                                  "(--step-timeout-s; a busy machine may need more)")
        time.sleep(0.5)


def state_events(statuses: dict[str, dict[str, Any]], names: dict[str, str]) -> list[dict[str, Any]]:
    """How each trainer took a global state (through the relay or directly), and which published
    versions carried the outer state for it, of how many bytes."""
    events: list[dict[str, Any]] = []
    for name, status in sorted(statuses.items()):
        for taken in status.get("fetched", []):
            events.append({"event": "state_taken", "peer": name, "via": taken.get("via", "direct"),
                           "round": taken["round"], "from": names.get(taken["from"], taken["from"])})
        if status.get("with_outer_state"):
            events.append({"event": "outer_state_published", "peer": name, "versions": status["with_outer_state"],
                           "bytes": status["outer_state_bytes"]})
    return events


def merge_rounds(statuses: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per round completed by some trainer: its loss and contributors (the first
    trainer's that has the round: every member applies the same update), the most bytes any
    trainer sent in it, and the longest round time."""
    by_round: dict[int, dict[str, Any]] = {}
    for name in sorted(statuses):
        for row in statuses[name]["history"]:
            merged = by_round.setdefault(row["round"], {"round": row["round"], "loss": row["loss"],
                                                        "contributors": list(row["contributors"]),
                                                        "bytes_sent": 0, "round_s": 0.0, "allreduce_s": 0.0})
            merged["bytes_sent"] = max(merged["bytes_sent"], row["bytes_sent"])
            merged["round_s"] = max(merged["round_s"], row["round_s"])
            merged["allreduce_s"] = max(merged["allreduce_s"], row["allreduce_s"])
    rounds = sorted(by_round)
    contiguous = [r for i, r in enumerate(rounds) if r == rounds[0] + i]
    return [by_round[r] for r in contiguous]


def round_line(row: dict[str, Any], names: dict[str, str], rounds: int, elapsed_s: float) -> str:
    who = ", ".join(names.get(p, p[-6:]) for p in row["contributors"])
    bound = f", bound {row['bound_s']:.2f}s" if "bound_s" in row else ""
    return (f"round {row['round'] + 1:>3}/{rounds}  loss {row['loss']:.4f}  sent {row['bytes_sent'] / 1e3:.1f} kB/peer max  "
            f"round {row['round_s']:.2f}s (all-reduce {row['allreduce_s']:.2f}s{bound})  "
            f"contributors {len(row['contributors'])} [{who}]  t={elapsed_s:.0f}s")


def _wait_for_relays(procs: dict[str, PeerProcess], version: int, timeout_s: float) -> None:
    """Until every relay holds the last published version (what inference workers would load)."""
    deadline = time.monotonic() + timeout_s
    for name, proc in procs.items():
        if name.startswith("relay"):
            while version not in _relay_versions(proc):
                if time.monotonic() > deadline:
                    raise PeerUnavailable(f"{name} did not get version {version} within {timeout_s:.0f} s")
                time.sleep(0.5)
    print(f"devnet: every relay holds version {version}", flush=True)


def _relay_versions(proc: PeerProcess) -> list[int]:
    try:
        relay = proc.status(timeout_s=30)["role_status"].get("relay", {})
    except PeerUnavailable:
        return []
    return sorted(int(v) for v in relay.get("complete_versions", relay.get("versions", [])))


def _stop_all(procs: dict[str, PeerProcess]) -> None:
    print("devnet: stopping peers ...", flush=True)
    for proc in procs.values():
        proc.stop(timeout_s=15)
