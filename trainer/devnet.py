"""`p2pnet devnet`: the whole training network on one machine, as separate peer processes.

One trainer (roles trainer + relay), relays, workers (worker + relay) and validators (validator +
relay) start as `p2pnet peer start` children on loopback, all bootstrapped from the trainer and
all trusting only the trainer's key for checkpoints. The devnet shows live progress from the
trainer's status (step, reward, checkpoint propagation, batches accepted and rejected, peers),
then prints a summary table, writes a reward-curve PNG and, with `--json`, a machine-readable
summary. Byzantine workers (`--byzantine N`) substitute generated tokens on purpose; the
summary shows whether they were caught, banned, and kept out of training. Every child is
stopped by its own PID when the devnet ends, also on Ctrl-C or failure.

Deadlines are per step (`step_timeout_s`: the time allowed for one training step, the first
one including model loading), so a longer devnet gets proportionally longer, and a busy
machine only has to keep each step under the limit. When the devnet stops early (a step
too slow, a peer exited, Ctrl-C), the summary so far, the reward plot and every peer's log
are kept (`DevnetStopped` says where). Disk: the trainer keeps `keep_last` checkpoint
versions, only the newest with optimizer state, and every relay keeps `keep_last` versions;
the size on disk is reported at the end.

With `--lab` (root) every peer runs on a host of its own in a network lab (`p2pnet.lab`:
network namespaces on one switch), listening on 0.0.0.0, with real bandwidth limits on its
link (`--link-mbit`, or per host from `--lab-profile`, whose `[[host]]` names are the devnet's
peer names: trainer, relay0, validator0, worker0, ...; a host may sit behind NAT with `nat`).
Each peer advertises its link's upload, and the lab is removed when the devnet ends. The
DiLoCo devnet (`--trainers` above 1, `trainer.devnet_diloco`) runs on lab hosts the same way.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from p2pnet.cliargs import command, output_dir, path
from p2pnet.errors import ConfigError, PeerUnavailable
from p2pnet.identity import load_or_create_identity
from p2pnet.localnet import PeerProcess, start_peer
from p2pnet.settings import to_toml
from trainer.devnet_report import (disk_usage, honest_rejections, plot_rewards, print_summary, progress_line,
                                   summarise)

ASYNC_LEVEL = 2  # the trainer's and workers' default (trainer.roles)


class DevnetStopped(Exception):
    """The devnet ended before its last step; `summary` is what it had done by then (also
    written, with the plot, into the devnet's folder beside the logs)."""

    def __init__(self, reason: str, summary: dict[str, Any], interrupted: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.summary = summary
        self.interrupted = interrupted


@dataclass(frozen=True)
class DevnetConfig:
    steps: int = 30
    workers: int = 3
    validators: int = 1
    relays: int = 1
    byzantine: int = 1
    model: str = "tiny"
    tasks: str = "arithmetic"  # task families, comma-separated (tasks.prompts.TaskConfig.from_spec)
    seed: int = 0
    step_timeout_s: float = 300.0  # one training step (the first one includes loading the model)
    timeout_s: float | None = None  # the whole devnet, when given
    keep_last: int = ASYNC_LEVEL + 1  # checkpoint versions kept by the trainer and by every relay
    prompts_per_batch: int = 16
    group_size: int = 8
    max_new_tokens: int = 3
    lr: float = 3e-3
    lab: bool = False
    link_mbit: float | None = None  # with lab: every host's upload and download limit
    lab_profile: Path | None = None  # with lab: per-host limits (and NAT) by peer name
    trainer_ranks: int = 1  # the trainer's learner processes (FSDP2 ranks under torchrun when above 1)

    def __post_init__(self) -> None:
        checks = {
            "--steps": self.steps >= 1, "--workers": 1 <= self.workers <= 16,
            "--validators": 1 <= self.validators <= 8, "--relays": 0 <= self.relays <= 16,
            "--byzantine": 0 <= self.byzantine < self.workers,
            "--timeout-s": self.timeout_s is None or self.timeout_s > 0, "--step-timeout-s": self.step_timeout_s > 0,
            "--keep-last": self.keep_last > ASYNC_LEVEL,
            "--prompts-per-batch": self.prompts_per_batch >= 1, "--group-size": self.group_size >= 2,
            "--max-new-tokens": self.max_new_tokens >= 1, "--lr": 0 < self.lr < 1,
            "--link-mbit": self.link_mbit is None or self.link_mbit > 0,
            "--trainer-ranks": 1 <= self.trainer_ranks <= 8,
        }
        from tasks.prompts import check_spec

        if check_spec(self.tasks):
            raise ConfigError("--tasks", check_spec(self.tasks))
        if (self.link_mbit is not None or self.lab_profile is not None) and not self.lab:
            raise ConfigError("--link-mbit", "link limits need --lab (peers on loopback share one host)")
        for flag, ok in checks.items():
            if not ok:
                raise ConfigError(flag, "out of range (workers 1-16, validators 1-8, relays 0-16, "
                                        "byzantine fewer than workers, trainer ranks 1-8, steps >= 1, group size >= 2, 0 < lr < 1, "
                                        f"keep-last > {ASYNC_LEVEL}, timeouts > 0)")


def register(commands) -> None:
    devnet = command(
        commands, "devnet", "run a whole training network on this machine (trainer, relays, workers, validators)",
        description="Every peer is a separate process on loopback: a trainer publishes signed checkpoints, relays "
        "pass them on, workers generate rollouts with TOPLOC proofs (--byzantine of them cheat on purpose), "
        "validators check them, and the trainer learns only from accepted batches. Live progress per step, then "
        "a summary table, a reward plot and the size on disk. Each step must finish within --step-timeout-s; "
        "when the devnet stops early (too slow, a peer failed, Ctrl-C) the summary so far, the plot and every "
        "peer's log are kept and the message says where. With --lab (root), every peer runs on a host of its "
        "own with real bandwidth limits.",
        example="""
        p2pnet devnet --steps 40 --workers 4 --byzantine 1 --validators 2 --json summary.json
        p2pnet devnet --model models/smollm2 --steps 3 --workers 1 --byzantine 0 --lr 1e-5 --out runs/smollm2""")
    net = devnet.add_argument_group("network")
    net.add_argument("--workers", type=int, metavar="N", default=3, help="rollout workers, byzantine included (default 3)")
    net.add_argument("--byzantine", type=int, metavar="N", default=1, help="workers that cheat on purpose (default 1)")
    net.add_argument("--validators", type=int, metavar="N", default=1, help="validators (default 1)")
    net.add_argument("--relays", type=int, metavar="N", default=1, help="relay-only peers (default 1)")
    training = devnet.add_argument_group("training")
    training.add_argument("--steps", type=int, metavar="N", default=30,
                          help="training steps (default 30); with --trainers above 1, outer DiLoCo rounds")
    training.add_argument("--trainers", type=int, metavar="N", default=1,
                          help="trainer peers (default 1: one GRPO trainer fed by workers). Above 1: a DiLoCo group "
                          "that averages int8 pseudo-gradients over the data plane each round; trainer0 publishes "
                          "the global weights through the relays (workers and validators are not started)")
    training.add_argument("--inner-steps", type=int, metavar="H", default=20,
                          help="with --trainers above 1: inner AdamW steps per round on each trainer (default 20)")
    training.add_argument("--encoding", choices=("int8", "fp32"), default="int8",
                          help="with --trainers above 1: how pseudo-gradients travel (default int8)")
    training.add_argument("--outer-lr", type=float, default=0.7, metavar="LR",
                          help="with --trainers above 1: outer Nesterov lr (default 0.7, DiLoCo's; the tiny model "
                          "with 20 inner steps learns better at 0.5 with --outer-momentum 0, see BENCHMARKS.md)")
    training.add_argument("--outer-momentum", type=float, default=0.9, metavar="M",
                          help="with --trainers above 1: outer Nesterov momentum (default 0.9, DiLoCo's)")
    training.add_argument("--model", default="tiny", metavar="NAME|DIR",
                          help="tiny, micro, small, or the path of a model folder (`p2pnet model prepare smollm2`)")
    training.add_argument("--seed", type=int, metavar="N", default=0, help="task seed of the network (default 0)")
    training.add_argument("--tasks", default="arithmetic", metavar="FAMILIES",
                          help="task families, comma-separated: arithmetic, word_problems (default arithmetic; "
                          "a tiny model gets a tokenizer with letters when word problems are drawn)")
    training.add_argument("--prompts-per-batch", type=int, metavar="N", default=16, help="prompts per worker batch (default 16)")
    training.add_argument("--group-size", type=int, metavar="N", default=8, help="samples per prompt (default 8)")
    training.add_argument("--max-new-tokens", type=int, metavar="N", default=3, help="generated tokens at most (default 3)")
    training.add_argument("--lr", type=float, default=3e-3, metavar="LR",
                          help="trainer learning rate (default 3e-3, for the tiny model; SmolLM2 wants ~1e-5)")
    training.add_argument("--trainer-ranks", type=int, default=1, metavar="N",
                          help="the trainer's learner processes, FSDP2 ranks under torchrun (default 1, at most 8)")
    output = devnet.add_argument_group("time, disk and output")
    output.add_argument("--step-timeout-s", type=float, default=300.0, metavar="S",
                        help="stop when one training step takes longer than this (default 300; the first step "
                        "includes loading the model)")
    output.add_argument("--timeout-s", type=float, metavar="S", help="also stop after this long in all (default: none)")
    output.add_argument("--keep-last", type=int, default=ASYNC_LEVEL + 1, metavar="N",
                        help=f"checkpoint versions kept by the trainer and by each relay (default {ASYNC_LEVEL + 1}; "
                        "only the newest keeps optimizer state)")
    output.add_argument("--out", type=path, metavar="DIR",
                        help="keep data dirs, logs, summary and reward plot here (default: a temporary folder, "
                        "removed at the end; kept as ./devnet-stopped-TIME when the devnet stops early)")
    output.add_argument("--json", type=path, metavar="FILE", help="write a machine-readable summary here")
    lab = devnet.add_argument_group("lab (root)")
    lab.add_argument("--lab", action="store_true",
                     help="run every peer on a host of its own (network namespaces, root only) over real links")
    lab.add_argument("--link-mbit", type=float, metavar="M",
                     help="with --lab: every host's upload and download limit in Mbit/s (default: unlimited)")
    lab.add_argument("--lab-profile", type=path, metavar="FILE",
                     help="with --lab: a TOML file of [[host]] tables (name = a devnet peer name such as "
                     "worker0, upload_mbit, download_mbit, nat = group) overriding --link-mbit per host")
    devnet.set_defaults(func=cmd_devnet)


def cmd_devnet(args: argparse.Namespace) -> int:
    if args.trainers != 1:
        return _cmd_diloco(args)
    config = DevnetConfig(steps=args.steps, workers=args.workers, validators=args.validators, relays=args.relays,
                          byzantine=args.byzantine, model=args.model, tasks=args.tasks, seed=args.seed,
                          step_timeout_s=args.step_timeout_s, timeout_s=args.timeout_s, keep_last=args.keep_last,
                          prompts_per_batch=args.prompts_per_batch, group_size=args.group_size,
                          max_new_tokens=args.max_new_tokens, lr=args.lr, lab=args.lab, link_mbit=args.link_mbit,
                          lab_profile=args.lab_profile, trainer_ranks=args.trainer_ranks)
    with ExitStack() as stack:
        if args.out is not None:
            root, plot_to = output_dir(args.out), None
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="p2pnet-devnet-")))
            plot_to = Path.cwd() / "devnet-reward.png"
        try:
            summary = run_devnet(config, root, plot_to=plot_to)
        except DevnetStopped as stop:
            kept = args.out or keep_for_inspection(root, Path.cwd() / time.strftime("devnet-stopped-%Y%m%d-%H%M%S"))
            if args.json is not None:
                args.json.write_text(json.dumps(stop.summary, indent=2))
            message = (f"devnet stopped: {stop.reason}; the summary so far, the reward plot and every peer's log "
                       f"are in {kept}")
            if stop.interrupted:
                print(message, file=sys.stderr, flush=True)
                return 130
            raise PeerUnavailable(message) from None
        if args.out is None and honest_rejections(summary):  # the logs say why; a temporary root would lose them
            kept = keep_for_inspection(root, Path.cwd() / time.strftime("devnet-rejections-%Y%m%d-%H%M%S"),
                                       summary)
            print(f"the validators' reasons are in the logs kept in {kept}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
        print(f"summary written to {args.json}")
    return 0 if summary["ok"] else 1


def _cmd_diloco(args: argparse.Namespace) -> int:
    from trainer.devnet_diloco import DilocoDevnetConfig, run_diloco_devnet

    config = DilocoDevnetConfig(trainers=args.trainers, inner_steps=args.inner_steps, rounds=args.steps,
                                relays=args.relays, model=args.model, encoding=args.encoding,
                                step_timeout_s=args.step_timeout_s, seed=args.seed, lab=args.lab,
                                link_mbit=args.link_mbit, lab_profile=args.lab_profile, outer_lr=args.outer_lr,
                                outer_momentum=args.outer_momentum)
    with ExitStack() as stack:
        root = output_dir(args.out) if args.out is not None else Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="p2pnet-diloco-")))
        summary = run_diloco_devnet(config, root)
        kept = args.out
        if summary.get("stopped") and kept is None:
            kept = keep_for_inspection(root, Path.cwd() / time.strftime("devnet-stopped-%Y%m%d-%H%M%S"))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
        print(f"summary written to {args.json}")
    if summary.get("stopped"):
        raise PeerUnavailable(f"devnet stopped: {summary['stopped']}; the summary so far and every peer's log "
                              f"are in {kept}")
    return 0 if summary["ok"] else 1


def keep_for_inspection(root: Path, kept: Path, summary: dict[str, Any] | None = None) -> Path:
    """Copy what a stopped devnet leaves worth reading (logs, summary, plot), not its data, to `kept`;
    also a devnet that ran to the end but saw an honest worker's batch rejected (with its `summary`)."""
    if summary is not None:
        (root / "summary.json").write_text(json.dumps(summary, indent=2))
    kept.mkdir(parents=True, exist_ok=True)
    for item in [*root.glob("*.log"), root / "summary.json", root / "reward.png"]:
        if item.is_file():
            shutil.copy2(item, kept / item.name)
    return kept


def _prepare_model(config: DevnetConfig, root: Path) -> tuple[Path, str]:
    candidate = Path(config.model)
    if candidate.is_dir():
        return candidate.resolve(), candidate.name
    from trainer.model import prepare_model

    from trainer.model import TINY_CONFIGS

    if config.model == "smollm2":
        raise ConfigError("--model", "run `p2pnet model prepare smollm2 --out DIR` once, then pass --model DIR")
    if config.model not in TINY_CONFIGS:
        raise ConfigError("--model", f"{config.model!r} is neither a model folder nor one of {sorted(TINY_CONFIGS)}")
    text = "word_problems" in config.tasks
    return prepare_model(config.model, root / "model", seed=config.seed, text=text), config.model


def _stop_on_sigterm() -> None:
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # unwinds through run_devnet's finally, which stops every child

    signal.signal(signal.SIGTERM, handler)


def run_devnet(config: DevnetConfig, root: Path, plot_to: Path | None = None,
               observe: Callable[[dict[str, PeerProcess]], None] | None = None) -> dict[str, Any]:
    """Run the devnet to `config.steps` steps. `observe(procs)`, if given, is called on every poll of
    the trainer's status and once more after the last step, while every peer still runs
    (benchmarks read the peers' statuses there). Raises DevnetStopped, after printing and writing
    the summary so far, when it ends early."""
    _stop_on_sigterm()
    started = time.monotonic()
    print(f"devnet: preparing model {config.model} under {root}", flush=True)
    model_dir, model_name = _prepare_model(config, root)
    plan, byzantine_names = _plan(config, root, model_dir, model_name)
    procs: dict[str, PeerProcess] = {}
    seen: dict[str, Any] = {"trainer": {"history": [], "workers": []}, "validators": {}, "lab": None}
    stopped, interrupted = "", False
    with ExitStack() as stack:
        lab = stack.enter_context(open_lab([name for name, _, _ in plan], root, link_mbit=config.link_mbit,
                                           lab_profile=config.lab_profile)) if config.lab else None
        try:
            _start_peers(plan, procs, root, lab, seen, ready_timeout_s=max(60.0, config.step_timeout_s))
            _follow(procs, config, time.monotonic(), observe, seen)
            seen["validators"] = {name: procs[name].status().get("role_status", {}).get("validator", {})
                                  for name in procs if name.startswith("validator")}
        except PeerUnavailable as exc:
            stopped = str(exc)
        except KeyboardInterrupt:
            stopped, interrupted = "interrupted (Ctrl-C or SIGTERM)", True
        finally:
            print("devnet: stopping peers ...", flush=True)
            codes = {name: proc.stop(timeout_s=15) for name, proc in procs.items()}
    ids = {name: p.peer_id for name, p in procs.items()}
    summary = summarise(seen["trainer"], ids, byzantine_names, codes, seen["validators"], time.monotonic() - started)
    summary["lab"] = seen["lab"]
    names = {p.peer_id: name for name, p in procs.items()}
    summary["leaderboard"] = [dict(row, devnet_name=names.get(row["peer_id"], ""))
                              for row in seen["trainer"].get("leaderboard", [])]
    summary["metrics_urls"] = seen.get("metrics_urls", {})
    summary["disk"] = disk_usage(root)
    if stopped:
        summary.update(ok=False, stopped=stopped)
        print(f"\ndevnet stopped early: {stopped}. What it did until then:", flush=True)
    print_summary(summary, config.byzantine)
    plot = plot_to if plot_to is not None and not stopped else root / "reward.png"
    plot_rewards(summary, plot)
    summary["reward_plot"] = str(plot)
    if stopped:
        (root / "summary.json").write_text(json.dumps(summary, indent=2))
        raise DevnetStopped(stopped, summary, interrupted)
    print(f"reward curve: {plot}")
    return summary


def _plan(config: DevnetConfig, root: Path, model_dir: Path, model_name: str) -> tuple[list[Any], set[str]]:
    """(name, roles, TOML sections) of every peer, trainer first; and the byzantine workers' names."""
    trainer_id = load_or_create_identity(root / "trainer").peer_id
    common = {
        "relay": {"trusted_publishers": [trainer_id], "chunk_bytes": 256 * 1024, "announce_interval_s": 1.0,
                  "stall_timeout_s": 10.0, "fsync": False, "keep_versions": config.keep_last},
        "peertable": {"heartbeat_interval_s": 1.0, "expiry_s": 15.0},
    }
    task = {"task_seed": config.seed, "tasks": config.tasks, "prompts_per_batch": config.prompts_per_batch, "group_size": config.group_size,
            "max_new_tokens": config.max_new_tokens}
    plan: list[tuple[str, tuple[str, ...], dict[str, dict[str, Any]]]] = [
        ("trainer", ("relay", "trainer"), {"trainer": {"model_dir": model_dir, "out_dir": root / "trainer" / "ckpt",
                                                       "model_name": model_name, "steps": config.steps,
                                                       "lr": config.lr, "keep_last": config.keep_last,
                                                       "ranks": config.trainer_ranks, **task}}),
    ]
    plan += [(f"relay{i}", ("relay",), {}) for i in range(config.relays)]
    plan += [(f"validator{i}", ("relay", "validator"),
              {"validator": {"model_path": model_dir, "sample_rate": 1.0, "task_seed": config.seed,
                             "tasks": config.tasks}})
             for i in range(config.validators)]
    byzantine_names = {f"worker{i}" for i in range(config.byzantine)}
    plan += [(f"worker{i}", ("relay", "worker"),
              {"worker": {"model_dir": model_dir, "model_name": model_name, **task,
                          "byzantine": "substitute_tokens" if f"worker{i}" in byzantine_names else ""}})
             for i in range(config.workers)]
    return [(name, roles, {**common, **sections}) for name, roles, sections in plan], byzantine_names


def _start_peers(plan: list[Any], procs: dict[str, PeerProcess], root: Path, lab: Any, seen: dict[str, Any],
                 ready_timeout_s: float) -> None:
    """Start every peer of the plan (the trainer first: the others bootstrap from it) and wait
    until each listens; a busy machine gets as long as one step for it."""
    for name, roles, sections in plan:
        data_dir = root / name
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "peer.toml").write_text(to_toml({"peer": {"display_name": name}, **sections}))
        bootstrap = [procs["trainer"].addr] if "trainer" in procs else []
        extra = ["--config", str(data_dir / "peer.toml")]
        if lab is None:
            extra += ["--metrics-listen", "127.0.0.1:0"]  # /metrics, /healthz and the dashboard of each peer
        if lab is not None:
            extra += lab_peer_args(lab, name)
        start_peer(name, data_dir, roles=roles, bootstrap=bootstrap, extra_args=extra, log_dir=root,
                   wrap=lab.wrap(name) if lab is not None else (), into=procs)  # stopped on the way out, Ctrl-C too
        if name == "trainer":
            procs[name].wait_ready(ready_timeout_s)
    for proc in procs.values():
        proc.wait_ready(ready_timeout_s)
    where = f" on lab hosts ({lab_line(lab)})" if lab is not None else ""
    if lab is not None:
        seen["lab"] = lab_hosts(lab)
    print(f"devnet: {len(procs)} peers up{where}: " + ", ".join(procs), flush=True)
    if lab is None:
        seen["metrics_urls"] = {name: proc.status().get("metrics_url", "") for name, proc in procs.items()}
        print(f"devnet: dashboard on {seen['metrics_urls']['trainer']}/ (metrics of every peer at its /metrics)",
              flush=True)



def open_lab(names: list[str], root: Path, *, link_mbit: float | None, lab_profile: Path | None) -> Any:
    """A lab with one host per devnet peer, limits from the profile, else `link_mbit`."""
    import secrets

    from p2pnet.lab import HostSpec, Lab, LabSpec
    from p2pnet.labcli import load_profile

    profile = {h.name: h for h in load_profile(lab_profile)} if lab_profile else {}
    unknown = sorted(set(profile) - set(names))
    if unknown:
        raise ConfigError("--lab-profile", f"host {unknown[0]!r} is not a devnet peer (peers: {', '.join(names)})")
    hosts = tuple(profile.get(name) or HostSpec(name, link_mbit, link_mbit) for name in names)
    return Lab.up(LabSpec(hosts, f"d{secrets.token_hex(4)}"), root / "lab")


def lab_peer_args(lab: Any, name: str) -> list[str]:
    """What a peer on lab host `name` is started with: listen on every address of its host, and
    advertise its link's upload."""
    return ["--listen", "/ip4/0.0.0.0/tcp/0", *_lab_upload_args(lab, name)]


def _lab_upload_args(lab: Any, name: str) -> list[str]:
    """Advertise the host's real upload limit, so relays plan with what the link gives."""
    upload_mbit = lab.host(name).upload_mbit
    return ["--upload-bps", str(int(upload_mbit * 1e6 / 8))] if upload_mbit else []


def lab_hosts(lab: Any) -> dict[str, dict[str, Any]]:
    """The lab's hosts as the devnet's JSON summary gives them."""
    return {h.name: {"ip": h.ip, "upload_mbit": h.upload_mbit, "download_mbit": h.download_mbit, "nat": h.nat}
            for h in lab.hosts.values()}


def lab_line(lab: Any) -> str:
    limits = {(h.upload_mbit, h.download_mbit) for h in lab.hosts.values()}
    nat = sum(1 for h in lab.hosts.values() if h.nat)
    text = ", ".join(f"{u or 'unlimited'}/{d or 'unlimited'} Mbit/s up/down" for u, d in sorted(limits, key=str))
    return text + (f", {nat} behind NAT" if nat else "")


def _follow(procs: dict[str, PeerProcess], config: DevnetConfig, started: float,
            observe: Callable[[dict[str, PeerProcess]], None] | None, seen: dict[str, Any]) -> None:
    """Print each step as the trainer reports it, until it is done; `seen["trainer"]` holds its
    last status. PeerUnavailable when a peer exits or a step takes longer than step_timeout_s."""
    trainer = procs["trainer"]
    shown = 0
    step_started = started
    while True:
        for name, proc in procs.items():
            if not proc.alive():
                raise PeerUnavailable(f"{name} exited early; see {proc.log_path}")
        status = trainer.status(timeout_s=30)
        role = seen["trainer"] = status["role_status"]["trainer"]
        names = {p.peer_id: name for name, p in procs.items()}
        for row in role["history"][shown:]:
            print(progress_line(row, role, names, config.steps, len(status["peers"]) + 1,
                                 time.monotonic() - started), flush=True)
            shown += 1
            step_started = time.monotonic()
        if observe is not None:
            observe(procs)
        if role["done"]:
            time.sleep(2.0)  # let the last version propagate before the final read
            if observe is not None:
                observe(procs)
            seen["trainer"] = trainer.status(timeout_s=30)["role_status"]["trainer"]
            return
        now = time.monotonic()
        if now - step_started > config.step_timeout_s:
            raise PeerUnavailable(f"step {shown + 1} of {config.steps} took longer than {config.step_timeout_s:.0f} s "
                                  "(--step-timeout-s; a busy machine may need more)")
        if config.timeout_s is not None and now - started > config.timeout_s:
            raise PeerUnavailable(f"{shown} of {config.steps} steps done after {config.timeout_s:.0f} s (--timeout-s)")
        time.sleep(0.5)
