"""`p2pnet devnet`: the whole training network on one machine, as separate peer processes.

One trainer (roles trainer + relay), relays, workers (worker + relay) and validators (validator +
relay) start as `p2pnet peer start` children on loopback, all bootstrapped from the trainer and
all trusting only the trainer's key for checkpoints. The devnet shows live progress from the
trainer's status (step, reward, checkpoint propagation, batches accepted and rejected, peers),
then prints a summary table, writes a reward-curve PNG and, with `--json`, a machine-readable
summary. Byzantine workers (`--byzantine N`) substitute generated tokens on purpose; the
summary shows whether they were caught, banned, and kept out of training. Every child is
stopped by its own PID when the devnet ends, also on Ctrl-C or failure.

With `--lab` (root) every peer runs on a host of its own in a network lab (`p2pnet.lab`:
network namespaces on one switch), listening on 0.0.0.0, with real bandwidth limits on its
link (`--link-mbit`, or per host from `--lab-profile`, whose `[[host]]` names are the devnet's
peer names: trainer, relay0, validator0, worker0, ...; a host may sit behind NAT with `nat`).
Each peer advertises its link's upload, and the lab is removed when the devnet ends.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from p2pnet.errors import ConfigError, PeerUnavailable
from p2pnet.identity import load_or_create_identity
from p2pnet.localnet import PeerProcess, start_peer


@dataclass(frozen=True)
class DevnetConfig:
    steps: int = 30
    workers: int = 3
    validators: int = 1
    relays: int = 1
    byzantine: int = 1
    model: str = "tiny"
    seed: int = 0
    timeout_s: float = 900.0
    prompts_per_batch: int = 16
    group_size: int = 8
    max_new_tokens: int = 3
    lr: float = 3e-3
    lab: bool = False
    link_mbit: float | None = None  # with lab: every host's upload and download limit
    lab_profile: Path | None = None  # with lab: per-host limits (and NAT) by peer name

    def __post_init__(self) -> None:
        checks = {
            "--steps": self.steps >= 1, "--workers": 1 <= self.workers <= 16,
            "--validators": 1 <= self.validators <= 8, "--relays": 0 <= self.relays <= 16,
            "--byzantine": 0 <= self.byzantine < self.workers, "--timeout-s": self.timeout_s > 0,
            "--prompts-per-batch": self.prompts_per_batch >= 1, "--group-size": self.group_size >= 2,
            "--max-new-tokens": self.max_new_tokens >= 1, "--lr": 0 < self.lr < 1,
            "--link-mbit": self.link_mbit is None or self.link_mbit > 0,
        }
        if (self.link_mbit is not None or self.lab_profile is not None) and not self.lab:
            raise ConfigError("--link-mbit", "link limits need --lab (peers on loopback share one host)")
        for flag, ok in checks.items():
            if not ok:
                raise ConfigError(flag, "out of range (workers 1-16, validators 1-8, relays 0-16, "
                                        "byzantine fewer than workers, steps >= 1, group size >= 2, 0 < lr < 1)")


def register(commands) -> None:
    devnet = commands.add_parser(
        "devnet", help="run a whole training network on this machine (trainer, relays, workers, validators)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    devnet.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    devnet.add_argument("--workers", type=int, default=3, help="rollout workers, byzantine included (default 3)")
    devnet.add_argument("--validators", type=int, default=1, help="validators (default 1)")
    devnet.add_argument("--relays", type=int, default=1, help="relay-only peers (default 1)")
    devnet.add_argument("--byzantine", type=int, default=1, help="workers that cheat on purpose (default 1)")
    devnet.add_argument("--model", default="tiny",
                        help="tiny, micro, small, or the path of a model folder (`p2pnet model prepare smollm2`)")
    devnet.add_argument("--seed", type=int, default=0, help="task seed of the network")
    devnet.add_argument("--prompts-per-batch", type=int, default=16, help="prompts per worker batch (default 16)")
    devnet.add_argument("--group-size", type=int, default=8, help="samples per prompt (default 8)")
    devnet.add_argument("--max-new-tokens", type=int, default=3, help="generated tokens at most (default 3)")
    devnet.add_argument("--json", type=Path, help="write a machine-readable summary here")
    devnet.add_argument("--out", type=Path, help="keep data dirs, logs and the reward plot here (default: temporary)")
    devnet.add_argument("--lr", type=float, default=3e-3,
                        help="trainer learning rate (default 3e-3, for the tiny model; SmolLM2 wants ~1e-5)")
    devnet.add_argument("--timeout-s", type=float, default=900.0, help="give up after this long")
    devnet.add_argument("--lab", action="store_true",
                        help="run every peer on a host of its own (network namespaces, root only) over real links")
    devnet.add_argument("--link-mbit", type=float, metavar="M",
                        help="with --lab: every host's upload and download limit in Mbit/s (default: unlimited)")
    devnet.add_argument("--lab-profile", type=Path, metavar="FILE",
                        help="with --lab: a TOML file of [[host]] tables (name = a devnet peer name such as "
                        "worker0, upload_mbit, download_mbit, nat = group) overriding --link-mbit per host")
    devnet.set_defaults(func=cmd_devnet)


def cmd_devnet(args: argparse.Namespace) -> int:
    config = DevnetConfig(steps=args.steps, workers=args.workers, validators=args.validators, relays=args.relays,
                          byzantine=args.byzantine, model=args.model, seed=args.seed, timeout_s=args.timeout_s,
                          prompts_per_batch=args.prompts_per_batch, group_size=args.group_size,
                          max_new_tokens=args.max_new_tokens, lr=args.lr, lab=args.lab, link_mbit=args.link_mbit,
                          lab_profile=args.lab_profile)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        summary = run_devnet(config, args.out)
    else:
        with tempfile.TemporaryDirectory(prefix="p2pnet-devnet-") as tmp:
            summary = run_devnet(config, Path(tmp), plot_to=Path.cwd() / "devnet-reward.png")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
        print(f"summary written to {args.json}")
    return 0 if summary["ok"] else 1


def _toml(sections: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        for key, value in table.items():
            lines.append(f"{key} = {json.dumps(str(value) if isinstance(value, Path) else value)}")
        lines.append("")
    return "\n".join(lines)


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
    return prepare_model(config.model, root / "model", seed=config.seed), config.model


def _stop_on_sigterm() -> None:
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # unwinds through run_devnet's finally, which stops every child

    signal.signal(signal.SIGTERM, handler)


def run_devnet(config: DevnetConfig, root: Path, plot_to: Path | None = None,
               observe: Callable[[dict[str, PeerProcess]], None] | None = None) -> dict[str, Any]:
    """Run the devnet to `config.steps` steps. `observe(procs)`, if given, is called on every poll of
    the trainer's status and once more after the last step, while every peer still runs
    (benchmarks read the peers' statuses there)."""
    _stop_on_sigterm()
    started = time.monotonic()
    print(f"devnet: preparing model {config.model} under {root}", flush=True)
    model_dir, model_name = _prepare_model(config, root)
    trainer_id = load_or_create_identity(root / "trainer").peer_id
    common = {
        "relay": {"trusted_publishers": [trainer_id], "chunk_bytes": 256 * 1024, "announce_interval_s": 1.0,
                  "stall_timeout_s": 10.0, "fsync": False},
        "peertable": {"heartbeat_interval_s": 1.0, "expiry_s": 15.0},
    }
    task = {"task_seed": config.seed, "prompts_per_batch": config.prompts_per_batch, "group_size": config.group_size,
            "max_new_tokens": config.max_new_tokens}
    plan: list[tuple[str, tuple[str, ...], dict[str, dict[str, Any]]]] = [
        ("trainer", ("relay", "trainer"), {"trainer": {"model_dir": model_dir, "out_dir": root / "trainer" / "ckpt",
                                                       "model_name": model_name, "steps": config.steps,
                                                       "lr": config.lr, **task}}),
    ]
    plan += [(f"relay{i}", ("relay",), {}) for i in range(config.relays)]
    plan += [(f"validator{i}", ("relay", "validator"),
              {"validator": {"model_path": model_dir, "sample_rate": 1.0, "task_seed": config.seed}})
             for i in range(config.validators)]
    byzantine_names = {f"worker{i}" for i in range(config.byzantine)}
    plan += [(f"worker{i}", ("relay", "worker"),
              {"worker": {"model_dir": model_dir, "model_name": model_name, **task,
                          "byzantine": "substitute_tokens" if f"worker{i}" in byzantine_names else ""}})
             for i in range(config.workers)]
    procs: dict[str, PeerProcess] = {}
    with ExitStack() as stack:
        lab = stack.enter_context(_open_lab(config, [name for name, _, _ in plan], root)) if config.lab else None
        try:
            for name, roles, sections in plan:
                data_dir = root / name
                data_dir.mkdir(parents=True, exist_ok=True)
                (data_dir / "peer.toml").write_text(_toml({**common, **sections}))
                bootstrap = [procs["trainer"].addr] if "trainer" in procs else []
                extra = ["--config", str(data_dir / "peer.toml")]
                if lab is not None:
                    extra += ["--listen", "/ip4/0.0.0.0/tcp/0", *_lab_upload_args(lab, name)]
                procs[name] = start_peer(name, data_dir, roles=roles, bootstrap=bootstrap, extra_args=extra,
                                         log_dir=root, wrap=lab.wrap(name) if lab is not None else ())
                if name == "trainer":
                    procs[name].wait_ready(60)
            for proc in procs.values():
                proc.wait_ready(60)
            where = f" on lab hosts ({_lab_line(lab)})" if lab is not None else ""
            lab_hosts = {h.name: {"ip": h.ip, "upload_mbit": h.upload_mbit, "download_mbit": h.download_mbit,
                                  "nat": h.nat} for h in lab.hosts.values()} if lab is not None else None
            print(f"devnet: {len(procs)} peers up{where}: " + ", ".join(procs), flush=True)
            status = _follow(procs, config, started, observe)
            ids = {name: p.peer_id for name, p in procs.items()}
            validators = {name: procs[name].status().get("role_status", {}).get("validator", {})
                          for name in procs if name.startswith("validator")}
        finally:
            print("devnet: stopping peers ...", flush=True)
            codes = {name: proc.stop(timeout_s=15) for name, proc in procs.items()}
    summary = _summarise(status, ids, byzantine_names, codes, validators, time.monotonic() - started)
    summary["lab"] = lab_hosts
    _print_summary(summary)
    plot = plot_to or root / "reward.png"
    _plot(summary, plot)
    summary["reward_plot"] = str(plot)
    print(f"reward curve: {plot}")
    return summary


def _open_lab(config: DevnetConfig, names: list[str], root: Path) -> Any:
    """A lab with one host per devnet peer, limits from the profile, else --link-mbit."""
    import secrets

    from p2pnet.lab import HostSpec, Lab, LabSpec
    from p2pnet.labcli import load_profile

    profile = {h.name: h for h in load_profile(config.lab_profile)} if config.lab_profile else {}
    unknown = sorted(set(profile) - set(names))
    if unknown:
        raise ConfigError("--lab-profile", f"host {unknown[0]!r} is not a devnet peer (peers: {', '.join(names)})")
    hosts = tuple(profile.get(name) or HostSpec(name, config.link_mbit, config.link_mbit) for name in names)
    return Lab.up(LabSpec(hosts, f"d{secrets.token_hex(4)}"), root / "lab")


def _lab_upload_args(lab: Any, name: str) -> list[str]:
    """Advertise the host's real upload limit, so relays plan with what the link gives."""
    upload_mbit = lab.host(name).upload_mbit
    return ["--upload-bps", str(int(upload_mbit * 1e6 / 8))] if upload_mbit else []


def _lab_line(lab: Any) -> str:
    limits = {(h.upload_mbit, h.download_mbit) for h in lab.hosts.values()}
    nat = sum(1 for h in lab.hosts.values() if h.nat)
    text = ", ".join(f"{u or 'unlimited'}/{d or 'unlimited'} Mbit/s up/down" for u, d in sorted(limits, key=str))
    return text + (f", {nat} behind NAT" if nat else "")


def _follow(procs: dict[str, PeerProcess], config: DevnetConfig, started: float,
            observe: Callable[[dict[str, PeerProcess]], None] | None = None) -> dict[str, Any]:
    trainer = procs["trainer"]
    deadline = started + config.timeout_s
    shown = 0
    while True:
        for name, proc in procs.items():
            if not proc.alive():
                raise PeerUnavailable(f"{name} exited early; see {proc.log_path}")
        status = trainer.status(timeout_s=30)
        role = status["role_status"]["trainer"]
        names = {p.peer_id: name for name, p in procs.items()}
        for row in role["history"][shown:]:
            print(_progress_line(row, role, names, config.steps, len(status["peers"]) + 1,
                                 time.monotonic() - started), flush=True)
            shown += 1
        if observe is not None:
            observe(procs)
        if role["done"]:
            time.sleep(2.0)  # let the last version propagate before the final read
            if observe is not None:
                observe(procs)
            return trainer.status(timeout_s=30)["role_status"]["trainer"]
        if time.monotonic() > deadline:
            raise PeerUnavailable(f"devnet did not finish {config.steps} steps within {config.timeout_s}s")
        time.sleep(0.5)


def _progress_line(row: dict[str, Any], role: dict[str, Any], names: dict[str, str], steps: int, peers: int,
                   elapsed_s: float) -> str:
    """One live line: step, reward, how fast the step's checkpoint spread, per-worker verdicts."""
    spread = row.get("propagation_s")  # of the version this step's batches were generated with
    spread_text = f"v{row['step']} reached all workers in {spread:.2f}s" if spread is not None else "-"
    workers = ", ".join(
        f"{names.get(w['peer_id'], w['peer_id'][-6:])} {w['accepted']}ok/{w['rejected']}bad"
        + (" BANNED" if w["banned"] else "") for w in role["workers"])
    return (f"step {row['step'] + 1:>3}/{steps}  reward {row['reward_mean']:.3f}  {spread_text}  "
            f"[{workers}]  peers {peers}  t={elapsed_s:.0f}s")


def _summarise(status: dict[str, Any], ids: dict[str, str], byzantine: set[str], codes: dict[str, int],
               validators: dict[str, Any], wall_s: float) -> dict[str, Any]:
    by_id = {w["peer_id"]: w for w in status["workers"]}
    workers = []
    for name, peer_id in ids.items():
        if not name.startswith("worker"):
            continue
        w = by_id.get(peer_id, {})
        workers.append({"name": name, "peer_id": peer_id, "byzantine": name in byzantine,
                        "submitted": w.get("submitted", 0), "accepted": w.get("accepted", 0),
                        "rejected": w.get("rejected", 0), "banned": w.get("banned", False),
                        "trained_batches": w.get("trained_batches", 0)})
    steps = [{"step": h["step"], "reward_mean": h["reward_mean"], "accuracy": h["accuracy"],
              "propagation_s": h.get("propagation_s"), "accepted_batches": h["accepted_batches"],
              "rejected_batches": h["rejected_batches"], "trained_batches": h["batches"], "train_s": h["train_s"]}
             for h in status["history"] if h["trained"]]
    caught = all(w["banned"] and w["trained_batches"] == 0 for w in workers if w["byzantine"])
    return {"ok": bool(steps) and caught and all(c == 0 for c in codes.values()), "wall_s": round(wall_s, 1),
            "steps": steps, "workers": workers, "validators": validators, "exit_codes": codes,
            "byzantine_caught": caught}


def _print_summary(summary: dict[str, Any]) -> None:
    steps = summary["steps"]
    print("\nstep  reward  accuracy  propagation_s  accepted  rejected")
    for s in steps:
        prop = "-" if s["propagation_s"] is None else f"{s['propagation_s']:.2f}"
        print(f"{s['step'] + 1:>4}  {s['reward_mean']:.3f}   {s['accuracy']:.3f}     {prop:>9}      "
              f"{s['accepted_batches']:>4}      {s['rejected_batches']:>4}")
    print("\nworker    byzantine  submitted  accepted  rejected  banned  trained")
    for w in summary["workers"]:
        print(f"{w['name']:<9} {str(w['byzantine']):<9}  {w['submitted']:>9}  {w['accepted']:>8}  "
              f"{w['rejected']:>8}  {str(w['banned']):<6}  {w['trained_batches']:>7}")
    if len(steps) >= 2:
        k = max(1, len(steps) // 4)
        first = sum(s["reward_mean"] for s in steps[:k]) / k
        last = sum(s["reward_mean"] for s in steps[-k:]) / k
        print(f"\nreward mean: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
    print(f"byzantine workers caught and kept out of training: {summary['byzantine_caught']}; "
          f"wall {summary['wall_s']:.0f}s")


def _plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = summary["steps"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s["step"] + 1 for s in steps], [s["reward_mean"] for s in steps], marker="o", label="reward mean")
    ax.set_xlabel("training step")
    ax.set_ylabel("reward (exact answers)")
    ax.set_title("p2pnet devnet: GRPO on verified batches")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(0)
