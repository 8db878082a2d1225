"""`p2pnet validator ...`: start a validator peer, show a running validator's numbers.

`p2pnet validator start` is `p2pnet peer start` with the validator role added and the
`[validator]` TOML section filled from flags (a flag given wins over the file). Argument parsing
only; the role is verify.daemon.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import trio

from p2pnet.cliargs import add_peer_arguments, command, data_dir_argument, group, json_argument, path
from p2pnet.errors import PeerUnavailable


def register(commands: Any) -> None:
    sub = group(commands, "validator", "run and inspect a validator peer", example="""
        p2pnet validator start --data-dir ~/.p2pnet/v --model models/tiny --role relay --trust TRAINER_ID
        p2pnet validator status --data-dir ~/.p2pnet/v""")

    start = command(
        sub, "start", "start a validator peer and run until SIGINT/SIGTERM",
        description="A peer with the validator role: it draws tickets for rollout submissions, recomputes the "
        "ones it is drawn for and publishes signed verdicts. With --role relay it checks each submission with the "
        "policy version it names, fetched from the network (--trust the trainer); without it, --model serves "
        "every version. Flags given here win over the [validator] section of the configuration file.",
        example="""
        p2pnet validator start --data-dir ~/.p2pnet/v --model models/tiny --role relay --trust 12D3KooW... \\
            --bootstrap /ip4/192.0.2.10/tcp/4001/p2p/12D3KooW...""")
    add_peer_arguments(start, roles_help="further roles; repeatable")
    checks = start.add_argument_group("validator ([validator] in TOML)")
    checks.add_argument("--model", type=path, dest="model_path", metavar="DIR",
                        help="model folder serving every policy version (or --checkpoint-dir)")
    checks.add_argument("--checkpoint-dir", type=path, metavar="DIR", help="folder of v{version}/ model folders")
    checks.add_argument("--sample-rate", type=float, metavar="P",
                        help="probability a submission is checked at all (default 1.0)")
    checks.add_argument("--claim-window-s", type=float, metavar="S",
                        help="wait this long for lower claims (default 0.5)")
    checks.add_argument("--rollouts-per-check", type=int, metavar="N", help="rows recomputed per check (default 0: all)")
    checks.add_argument("--task-seed", type=int, metavar="SEED", help="the network's task seed; other seeds are refused")
    checks.add_argument("--max-queue", type=int, metavar="N",
                        help="checks in flight before new ones are dropped (default 16)")
    checks.add_argument("--device", help="cpu (default) or cuda[:N]")
    checks.add_argument("--allow-worker", action="append", default=[], metavar="PEER_ID",
                        help="accept submissions only from these workers; repeatable")
    checks.add_argument("--validator", action="append", default=[], metavar="PEER_ID",
                        help="the configured validator set; repeatable (default: peers advertising the role)")
    start.set_defaults(func=cmd_validator_start)

    status = command(sub, "status", "batches seen, checked, accepted, rejected; time per batch",
                     example="p2pnet validator status --data-dir ~/.p2pnet/v --json")
    data_dir_argument(status)
    json_argument(status)
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
    from p2pnet.cli import start_role

    return start_role(args, "validator", validator_section)


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
