"""`p2pnet sim ...`: run a simulated scenario or a parameter sweep and write its results.

    p2pnet sim list
    p2pnet sim run SCENARIO [--peers N] [--seed S] [--set NAME=VALUE ...] [--out DIR]
    p2pnet sim sweep SCENARIO --param NAME=V1,V2,... [--param ...] [--seeds K] [--peers N] --out DIR

Argument parsing only; the work is in `simulations.run`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from p2pnet.errors import ConfigError


def register(commands: Any) -> None:
    from simulations.scenarios import SCENARIOS

    sim = commands.add_parser("sim", help="simulate the network in virtual time (scenarios, sweeps)")
    sub = sim.add_subparsers(title="sim commands", metavar="COMMAND")
    names = ", ".join(SCENARIOS)

    listing = sub.add_parser("list", help="list the scenarios")
    listing.set_defaults(func=cmd_list)

    run = sub.add_parser("run", help="run one scenario; write results.json, a CSV table and a plot",
                         description=f"Scenarios: {names}.")
    run.add_argument("scenario", metavar="SCENARIO")
    run.add_argument("--peers", type=int, help="relays (broadcast), cheaters (audit) or workers (inference_wait)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                     help="override a scenario field, dotted for nested ones (churn.departures=0.1); repeatable")
    run.add_argument("--out", type=Path, default=Path("sim-out"), help="output directory (default: sim-out)")
    run.set_defaults(func=cmd_run)

    sweep = sub.add_parser("sweep", help="run a scenario over parameter values and seeds",
                           description=f"Scenarios: {names}. Writes sweep.csv, sweep.json and sweep.png.")
    sweep.add_argument("scenario", metavar="SCENARIO")
    sweep.add_argument("--param", action="append", default=[], metavar="NAME=V1,V2,...",
                       help="a field and its values; repeatable (the cartesian product is run)")
    sweep.add_argument("--seeds", type=int, default=1, help="seeds 0..K-1 per combination (default 1)")
    sweep.add_argument("--peers", type=int)
    sweep.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a fixed override")
    sweep.add_argument("--out", type=Path, required=True)
    sweep.set_defaults(func=cmd_sweep)


def _overrides(specs: list[str]) -> dict[str, str]:
    out = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name:
            raise ConfigError("--set", f"expected NAME=VALUE, got {spec!r}")
        out[name.strip()] = value.strip()
    return out


def _output_dir(path: Path) -> Path:
    """Create `--out` now, so a path we cannot write fails before the simulation runs."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError("--out", f"{path} exists and is not a directory") from None
    except OSError as exc:
        raise ConfigError("--out", f"cannot create {path}: {exc.strerror or exc}") from exc
    if not path.is_dir():
        raise ConfigError("--out", f"{path} exists and is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError("--out", f"{path} is not writable by this user")
    return path


def cmd_list(args: argparse.Namespace) -> int:
    from simulations.scenarios import SCENARIOS

    for name, make in SCENARIOS.items():
        print(f"{name:>15}  {(make.__doc__ or '').strip().splitlines()[0]}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from simulations.run import run_scenario, write_outputs
    from simulations.scenarios import scenario, with_params

    if args.peers is not None and args.peers < 1:
        raise ConfigError("--peers", "must be >= 1")
    config = with_params(scenario(args.scenario, args.peers, args.seed), _overrides(args.set))
    _output_dir(args.out)
    result = run_scenario(config)
    written = write_outputs(result, args.out)
    metric = result.main_metric
    print(f"{config.name} seed {args.seed}: {metric} = {result.summary.get(metric)}  "
          f"({result.summary.get('wall_s', 0):.1f}s wall)")
    for path in written:
        print(f"wrote {path}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from simulations.run import parse_params, sweep

    if args.seeds < 1:
        raise ConfigError("--seeds", "must be >= 1")
    params = parse_params(args.param)
    _output_dir(args.out)
    rows = sweep(args.scenario, params, seeds=args.seeds, peers=args.peers, fixed=_overrides(args.set),
                 out_dir=args.out, progress=sys.stderr)
    print(f"{len(rows)} runs; wrote {args.out / 'sweep.csv'}, {args.out / 'sweep.json'}"
          + (f", {args.out / 'sweep.png'}" if params else ""))
    return 0
