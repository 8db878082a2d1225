"""`p2pnet validator ...`: start a validator peer, show a running validator's numbers.

`p2pnet validator start` is `p2pnet peer start` with the validator role added and the
`[validator]` TOML section filled from flags (a flag given wins over the file). Argument
parsing only; the role is verify.daemon.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import trio

from p2pnet.errors import PeerUnavailable


def register(commands: Any) -> None:
    validator = commands.add_parser("validator", help="run and inspect a validator peer")
    sub = validator.add_subparsers(title="validator commands", metavar="COMMAND")

    start = sub.add_parser(
        "start", help="start a validator peer and run until SIGINT/SIGTERM",
        description="Start a peer with the validator role: it draws tickets for rollout submissions, "
        "recomputes the ones it is drawn for and publishes signed verdicts.")
    from p2pnet.cli import add_peer_arguments

    add_peer_arguments(start, roles_help="further roles; repeatable")
    start.add_argument("--model", type=Path, dest="model_path", help="model folder serving every policy version")
    start.add_argument("--checkpoint-dir", type=Path, help="folder of v{version}/ model folders")
    start.add_argument("--sample-rate", type=float, help="probability a submission is checked at all (default 1.0)")
    start.add_argument("--claim-window-s", type=float, help="wait this long for lower claims (default 0.5)")
    start.add_argument("--rollouts-per-check", type=int, help="rows recomputed per check (default 0: all)")
    start.add_argument("--task-seed", type=int, help="the network's task seed; other seeds are refused")
    start.add_argument("--max-queue", type=int, help="checks in flight before new ones are dropped (default 16)")
    start.add_argument("--device", help="cpu (default) or cuda[:N]")
    start.add_argument("--allow-worker", action="append", default=[], metavar="PEER_ID",
                       help="accept submissions only from these workers; repeatable")
    start.add_argument("--validator", action="append", default=[], metavar="PEER_ID",
                       help="the configured validator set; repeatable (default: peers advertising the role)")
    start.set_defaults(func=cmd_validator_start)

    status = sub.add_parser("status", help="batches seen, checked, accepted, rejected; time per batch")
    status.add_argument("--data-dir", type=Path, required=True)
    status.add_argument("--json", action="store_true", help="print machine-readable JSON")
    status.set_defaults(func=cmd_validator_status)


def validator_section(args: argparse.Namespace, sections: dict[str, Any]) -> dict[str, Any]:
    """The [validator] section with flags given on the command line laid over it."""
    section = dict(sections.get("validator", {}))
    flags = {
        "model_path": args.model_path, "checkpoint_dir": args.checkpoint_dir, "sample_rate": args.sample_rate,
        "claim_window_s": args.claim_window_s, "rollouts_per_check": args.rollouts_per_check,
        "task_seed": args.task_seed, "max_queue": args.max_queue, "device": args.device,
        "workers": tuple(args.allow_worker) or None, "validators": tuple(args.validator) or None,
    }
    section.update({k: (str(v) if isinstance(v, Path) else v) for k, v in flags.items() if v is not None})
    return section


def cmd_validator_start(args: argparse.Namespace) -> int:
    from p2pnet.cli import peer_configs, run_peer
    from p2pnet.config import from_mapping
    from verify.daemon import ValidatorConfig

    if "validator" not in args.role:
        args.role = [*args.role, "validator"]
    config, table, sections = peer_configs(args)
    sections = {**sections, "validator": validator_section(args, sections)}
    from_mapping(ValidatorConfig, sections["validator"], "validator")  # fail early on bad flags

    return run_peer(config, table, sections)


def cmd_validator_status(args: argparse.Namespace) -> int:
    from p2pnet.control import call

    reply = trio.run(call, args.data_dir, {"cmd": "validator.status"})
    if "error" in reply:
        raise PeerUnavailable(reply["error"])
    if args.json:
        print(json.dumps(reply, indent=2))
        return 0
    s = reply["validator"]
    print(f"validator {reply['peer_id']}  sample rate {s['sample_rate']}  live validators {s['live_validators']}")
    print(f"  batches seen {s['seen']}  selected {s['selected']}  checked {s['checked']}  "
          f"accepted {s['accepted']}  rejected {s['rejected']}  dropped {s['dropped']}")
    print(f"  time per batch {s['check_s_mean']:.3f}s (last {s['check_s_last']:.3f}s)  in flight {s['in_flight']}")
    if s["submissions_rejected"]:
        print(f"  submissions refused: {s['submissions_rejected']}")
    if s["reputation"]["banned"]:
        print(f"  banned workers: {', '.join(s['reputation']['banned'])}")
    return 0
