"""`p2pnet sim ...`: run a simulated scenario or a parameter sweep and write its results.

    p2pnet sim list
    p2pnet sim run SCENARIO [--peers N] [--seed S] [--set NAME=VALUE ...] [--out DIR]
    p2pnet sim sweep SCENARIO --param NAME=V1,V2,... [--param ...] [--seeds K] [--peers N] --out DIR

Argument parsing only; the work is in `simulations.run`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from p2pnet.cliargs import command, group, output_dir
from p2pnet.cliargs import path as path_arg
from p2pnet.errors import ConfigError


def register(commands: Any) -> None:
    from simulations.scenarios import SCENARIOS

    sub = group(commands, "sim", "simulate the network in virtual time (scenarios, sweeps)", example="""
        p2pnet sim list
        p2pnet sim run broadcast --peers 1000 --seed 1 --out runs/broadcast""")
    names = ", ".join(SCENARIOS)

    listing = command(sub, "list", "list the scenarios", example="p2pnet sim list")
    listing.set_defaults(func=cmd_list)

    run = command(sub, "run", "run one scenario; write results.json, a CSV table and a plot",
                  description=f"Scenarios: {names}. A broadcast prints its time against the lower bound.",
                  example="p2pnet sim run broadcast --peers 1000 --seed 1 --out runs/broadcast\n"
                  "p2pnet sim run broadcast --peers 200 --set churn.departures=0.1")
    run.add_argument("scenario", metavar="SCENARIO", help=f"one of {names}")
    run.add_argument("--peers", type=int, metavar="N",
                     help="relays (broadcast), cheaters (audit) or workers (inference_wait)")
    run.add_argument("--seed", type=int, default=0, help="random seed; a run is replayed exactly by its seed (default 0)")
    run.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                     help="override a scenario field, dotted for nested ones (churn.departures=0.1); repeatable")
    run.add_argument("--out", type=path_arg, default=Path("sim-out"), metavar="DIR",
                     help="output directory (default: sim-out)")
    world = run.add_argument_group("the broadcast's world (shorthands for --set; default: the scenario's)")
    world.add_argument("--view-miss", type=float, metavar="FRACTION",
                       help="each relay's membership misses this share of the others (0: exact, agreeing views)")
    world.add_argument("--slow-fraction", type=float, metavar="F",
                       help="this share of relays deliver 1/K of the upload they advertise (see --slow-factor)")
    world.add_argument("--slow-factor", type=float, metavar="K", help="how much slower the slow relays are (K >= 1)")
    world.add_argument("--symmetric", action="store_true", help="download = upload (default: download <= 4x upload)")
    world.add_argument("--layout", choices=sorted(LAYOUT_STRATEGY),
                       help="how the relays are organised: striped trees (default), one tree, a star, or a "
                            "BitTorrent-style swarm (rarest-first pulls from neighbours that sent their bitmaps)")
    run.set_defaults(func=cmd_run)

    sweep = command(sub, "sweep", "run a scenario over parameter values and seeds",
                    description=f"Scenarios: {names}. Writes sweep.csv, sweep.json and sweep.png.",
                    example="p2pnet sim sweep broadcast --param peers=10,100,1000 --seeds 3 --out runs/sweep")
    sweep.add_argument("scenario", metavar="SCENARIO", help=f"one of {names}")
    sweep.add_argument("--param", action="append", default=[], metavar="NAME=V1,V2,...",
                       help="a field and its values; repeatable (the cartesian product is run)")
    sweep.add_argument("--seeds", type=int, default=1, metavar="K", help="seeds 0..K-1 per combination (default 1)")
    sweep.add_argument("--peers", type=int, metavar="N", help="as for `sim run`, when not swept")
    sweep.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                       help="a fixed override, as for `sim run`; repeatable")
    sweep.add_argument("--out", type=path_arg, required=True, metavar="DIR", help="output directory")
    sweep.set_defaults(func=cmd_sweep)


#: `--layout` names -> the scenario's strategy field
LAYOUT_STRATEGY = {"striped": "relay", "tree": "tree4", "star": "star", "swarm": "swarm"}


def _world_overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.view_miss is not None:
        if not 0.0 <= args.view_miss < 1.0:
            raise ConfigError("--view-miss", "must lie in [0, 1)")
        out["view_miss"] = args.view_miss
    if args.slow_fraction is not None:
        if not 0.0 <= args.slow_fraction <= 1.0:
            raise ConfigError("--slow-fraction", "must lie in [0, 1]")
        out["slow_fraction"] = args.slow_fraction
    if args.slow_factor is not None:
        if not args.slow_factor >= 1.0:
            raise ConfigError("--slow-factor", "must be >= 1")
        out["slow_factor"] = args.slow_factor
    if args.symmetric:
        out["download_ratio"] = 1.0
    if args.layout is not None:
        out["strategy"] = LAYOUT_STRATEGY[args.layout]
    return out


def _overrides(specs: list[str]) -> dict[str, str]:
    out = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name:
            raise ConfigError("--set", f"expected NAME=VALUE, got {spec!r}")
        out[name.strip()] = value.strip()
    return out


def cmd_list(args: argparse.Namespace) -> int:
    from simulations.scenarios import SCENARIOS

    for name, make in SCENARIOS.items():
        print(f"{name:>15}  {(make.__doc__ or '').strip().splitlines()[0]}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from simulations.run import run_scenario, write_outputs
    from simulations.scenarios import BroadcastScenario, scenario, with_params

    if args.peers is not None and args.peers < 1:
        raise ConfigError("--peers", "must be >= 1")
    config = scenario(args.scenario, args.peers, args.seed)
    world = _world_overrides(args)
    if world and not isinstance(config, BroadcastScenario):
        raise ConfigError("--view-miss/--slow-*/--symmetric/--layout", f"only for broadcast scenarios, not {args.scenario}")
    config = with_params(with_params(config, world), _overrides(args.set))
    output_dir(args.out)
    result = run_scenario(config)
    written = write_outputs(result, args.out)
    metric = result.main_metric
    print(f"{config.name} seed {args.seed}: {metric} = {result.summary.get(metric)}  "
          f"({result.summary.get('wall_s', 0):.1f}s wall)")
    bound, ratio = result.summary.get("lower_bound_s"), result.summary.get("ratio")
    if bound is not None and ratio is not None:
        print(f"  {ratio:.2f}x the lower bound ({bound:.3f} s: max(S/U_origin, N*S/(U_origin + sum of uploads), "
              f"S/min(download)))")
    copies = result.summary.get("origin_upload_copies")
    if copies is not None:
        print(f"  the origin uploaded {copies:.2f} copies of the checkpoint")
    for path in written:
        print(f"wrote {path}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from simulations.run import parse_params, sweep

    if args.seeds < 1:
        raise ConfigError("--seeds", "must be >= 1")
    params = parse_params(args.param)
    output_dir(args.out)
    rows = sweep(args.scenario, params, seeds=args.seeds, peers=args.peers, fixed=_overrides(args.set),
                 out_dir=args.out, progress=sys.stderr)
    print(f"{len(rows)} runs; wrote {args.out / 'sweep.csv'}, {args.out / 'sweep.json'}"
          + (f", {args.out / 'sweep.png'}" if params else ""))
    return 0
