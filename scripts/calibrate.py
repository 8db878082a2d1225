"""Calibrate and test the verification policy: honest stack pairs, attacks, submission-level test.

    PYTHONPATH=. .venv/bin/python scripts/calibrate.py --model /tmp/smol/smollm2 \
        [--prompts 16] [--attack-prompts 8] [--rows 32] [--group 16] [--tokens 64] \
        [--ties exact|open] [--doc docs/calibration.md] [--table verify/calibration_tables.json] \
        [--json results.json]
    PYTHONPATH=. .venv/bin/python scripts/calibrate.py --model tiny --prompts 2 --attack-prompts 1  # smoke run

The experiment, each step real (no figure is assumed):
1. Honest workers, one per dtype (fp32, bf16), generate as trainer.rollout does (KV cache,
   ``--rows`` rows of one prompt per batch, seeded Gumbel sampling) and prove their LM-head
   inputs. Submissions are ``--group`` rollouts of one prompt.
2. Validators, one per dtype, recompute every rollout with one prefill and run the whole
   per-rollout check (verify.check.check_rollout: TOPLOC with the paper's thresholds, the
   sampling replay, termination). Rows of equal length are prefilled in one batch. TOPLOC
   treats entries tied at the 128th place by ``--ties`` (verify.toploc.measure: "exact" is
   torch's choice, as toploc; "open" counts the tied entries the proof matches best, ~3x
   faster); the rule is written into the tables (``ties``) and the report, and a validator
   measures with its tables' rule (verify.daemon).
3. Honest submissions are split in two: even ones calibrate, odd ones are held out. From the
   calibration half, per (worker stack, validator stack) pair: the ``--quantile`` of each
   pooled statistic over chunks (its ``limit``), and a KL upper confidence bound (level
   1 - ``--delta``) on an honest rollout's fraction of chunks above it. A pair is bit-exact
   when every calibration chunk measured 0 in every statistic. These tables are written to
   ``--table`` (shipped as verify/calibration_tables.json).
4. Held-out honest submissions and attack submissions are decided three ways: the per-chunk
   rule (any rejected rollout rejects), the submission-level test (verify.policy
   .decide_aggregate at ``--alpha``), and both. Attacks claim the bf16 worker's stack and are
   checked by the fp32 validator (what verify.daemon runs).
Attacks: int8 and int4 weights (per-channel fake quantization), Gaussian weight noise of 1%
and 5% of each tensor's std, another model (random init, same architecture), another
sampling seed, temperature 0.7 claimed as 1.0, one prompt token changed, one generated token
per chunk changed (proofs rebuilt from the worker's own prefill), proofs copied from another
rollout of the same submission.

Everything runs on one torch thread; wrap it in ``flock /tmp/p2pnet-cpu.lock`` on a shared
machine. Progress goes to stderr; ``--doc`` gets the full markdown report.

This file parses the command line and runs the steps in order; the experiment is in
scripts/calibration_experiment.py, its statistics in scripts/calibration_stats.py, the report
in scripts/calibration_report.py (imported as ``scripts.*``: run it from the repository root
with ``PYTHONPATH=.``, as above).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from scripts.calibration_experiment import (ATTACKS, Checked, Setup, Sub, changed_prompt, copied,
                                            generate, in_dtype, make_setup, noisy, random_init, substituted,
                                            validate)
from scripts.calibration_report import outcome_row, render, targets
from scripts.calibration_stats import (Outcome, aggregate_cut, binomial_tail, calibrate_pair, combine, decide_all,
                                       escape_bound, lower_95, outcome_from_json, prompt_counts, stack_key)
from verify.calibration import TIES, load_tables, model_fingerprint, tables_to_json
from verify.policy import PairCalibration
from verify.testing import fake_quantize

# tests/verify/test_calibrate_script.py loads this file and uses these names from it
__all__ = ["Outcome", "aggregate_cut", "binomial_tail", "combine", "escape_bound", "lower_95", "main", "make_setup",
           "prompt_counts", "targets"]


def build_parser() -> argparse.ArgumentParser:
    """Every flag of the script (the usage lines of the docstring above)."""
    ap = argparse.ArgumentParser(description="Calibrate the verification policy and measure detection.")
    ap.add_argument("--model", default="tiny", help="a model folder (p2pnet model prepare smollm2), or 'tiny'")
    ap.add_argument("--prompts", type=int, default=16, help="honest prompts (rows/group submissions each)")
    ap.add_argument("--attack-prompts", type=int, default=8, help="prompts per generated attack")
    ap.add_argument("--attack-offset", type=int, default=0,
                    help="skip this many attack prompts (a later run adds submissions on new prompts; "
                         "--merge adds its outcomes to an earlier run's)")
    ap.add_argument("--rows", type=int, default=32, help="rows generated per prompt in one batch")
    ap.add_argument("--group", type=int, default=16, help="rollouts per submission")
    ap.add_argument("--tokens", type=int, default=64, help="max new tokens per rollout")
    ap.add_argument("--quantile", type=float, default=0.9, help="honest per-chunk quantile used as limit")
    ap.add_argument("--delta", type=float, default=0.01, help="1 - confidence of the honest exceed rate")
    ap.add_argument("--alpha", type=float, default=1e-4, help="false-rejection rate of the submission test")
    ap.add_argument("--bound-delta", type=float, default=1e-3,
                    help="1 - confidence of the per-attack escape bounds (see escape_bound)")
    ap.add_argument("--attacks", default=",".join(ATTACKS),
                    help=f"comma-separated attacks to run, of: {', '.join(ATTACKS)}")
    ap.add_argument("--tables", default=None,
                    help="use these calibration tables and skip the honest runs (detection only)")
    ap.add_argument("--honest-from", default=None,
                    help="with --tables: a --json file of the run that made the tables, for the honest rows")
    ap.add_argument("--honest-command", default=None,
                    help="with --honest-from: the command of that run, quoted in the report")
    ap.add_argument("--honest-runtime-min", type=float, default=0.0,
                    help="with --honest-from: that run's runtime in minutes, added to the report's total")
    ap.add_argument("--merge", nargs="*", default=[],
                    help="--json files of earlier detection runs (same tables) whose attacks join the report")
    ap.add_argument("--ties", choices=TIES, default=None,
                    help="how TOPLOC treats entries tied at the 128th place, written into the tables: 'exact' "
                         "(torch's choice, as toploc; the default) or 'open' (the tied entries the proof matches "
                         "best; ~3x faster verify). With --tables: the tables' rule")
    ap.add_argument("--doc", default=None, help="write the markdown report here (docs/calibration.md)")
    ap.add_argument("--table", default=None, help="write calibration tables here (verify/calibration_tables.json)")
    ap.add_argument("--json", default=None, help="write every figure as JSON here")
    ap.add_argument("--skip-attacks", action="store_true", help="honest runs and tables only")
    ap.add_argument("--prefill-batch", type=int, default=1,
                    help="rows per validator prefill (1: as verify.daemon; more is faster but may round differently)")
    return ap


def chosen_attacks(args: argparse.Namespace) -> list[str]:
    """The keys named by --attacks, as written (parse_args refuses unknown ones)."""
    return [a.strip() for a in args.attacks.split(",") if a.strip()]


def parse_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The command line, checked; ``args.ties`` is the tie rule this run measures with."""
    args = ap.parse_args()
    if args.prefill_batch < 1:
        ap.error("--prefill-batch must be at least 1")
    if args.rows % args.group:
        ap.error("--rows must be a multiple of --group")
    if unknown := [a for a in chosen_attacks(args) if a not in ATTACKS]:
        ap.error(f"unknown attacks {unknown}; choose from {', '.join(ATTACKS)}")
    if args.table and args.tables:
        ap.error("--table writes tables from honest runs, which --tables skips")
    ties = args.ties or "exact"
    if args.tables:
        table_ties = load_tables(args.tables).ties
        if args.ties not in (None, table_ties):
            ap.error(f"{args.tables} was measured with ties = {table_ties}, not {args.ties}")
        ties = table_ties
    for path in args.merge + ([args.honest_from] if args.honest_from else []):
        if (other := json.loads(Path(path).read_text())["meta"].get("ties", "exact")) != ties:
            ap.error(f"{path} was measured with ties = {other}, not {ties}")
    args.ties = ties
    return args


@dataclass(frozen=True)
class Run:
    """What every stage of one run shares: its arguments, prompts and models, the keyword
    arguments of generate (honest, attack) and validate, the tables' meta, and its start time."""

    args: argparse.Namespace
    setup: Setup
    models: dict[str, torch.nn.Module]  # "fp32", "bf16"
    gen: dict
    agen: dict
    val: dict
    meta: dict
    t0: float

    def say(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:6.0f} s] {msg}", file=sys.stderr, flush=True)


def start(args: argparse.Namespace) -> Run:
    """One torch thread, the clock started, the prompts and the fp32 and bf16 models built."""
    torch.set_num_threads(1)
    t0 = time.time()
    setup = make_setup(args.model, args.prompts, args.attack_prompts, args.attack_offset)
    if args.tables:  # attack prompts stay the ones after the honest prompts of the table's run
        setup.prompts = []
    gen = dict(rows=args.rows, group=args.group, tokens=args.tokens, eos=setup.eos)
    agen = gen | {"first": setup.attack_first}  # attack prompts keep their numbers across runs
    val = dict(eos=setup.eos, tokens=args.tokens, vocab=setup.vocab, exact_ties=args.ties == "exact",
               batch=args.prefill_batch)
    models = {"fp32": setup.base.eval(), "bf16": in_dtype(setup.base, torch.bfloat16)}
    meta = {"source": "scripts/calibrate.py", "model": setup.name, "model_config": model_fingerprint(setup.base.config),
            "quantile": args.quantile, "delta": args.delta,
            "tokens": args.tokens, "group": args.group, "torch": torch.__version__,
            "prefill_batch": args.prefill_batch, "ties": args.ties}
    return Run(args, setup, models, gen, agen, val, meta, t0)


def honest_from_tables(ap: argparse.ArgumentParser, run: Run) -> tuple[list, list]:
    """--tables: the tables' pairs and (--honest-from) the honest rows of the run that made them."""
    args, held_out = run.args, []
    tables = load_tables(args.tables)
    if not tables.applies_to(run.setup.base.config):
        ap.error(f"{args.tables} was measured on {tables.meta.get('model')}, not on this model")
    pairs = list(tables.pairs.values())
    if args.honest_from:
        old = json.loads(Path(args.honest_from).read_text())
        honest_rows = [outcome_from_json(o) for o in old["outcomes"] if o["name"].startswith("honest")]
        held_out = [(cal, o, o) for cal, o in zip(pairs, honest_rows)]
    return pairs, held_out


def run_honest(run: Run) -> tuple[dict[str, list[Sub]], list, list]:
    """Honest submissions of each worker, checked by each validator; per pair, the tables from the
    even half and the decisions on the odd (held-out) half and on all; --table written."""
    args, honest, pairs, held_out = run.args, {}, [], []
    for w, model in run.models.items():
        honest[w] = generate(model, run.setup.prompts, **run.gen)
        run.say(f"honest {w} worker: {len(honest[w])} submissions, "
                f"{sum(len(p) for s in honest[w] for p in s.proofs)} chunks")
    checked: dict[tuple[str, str], list[Checked]] = {}
    for w in run.models:
        for v, vmodel in run.models.items():
            checked[w, v] = validate(vmodel, honest[w], **run.val)
            run.say(f"validated {w} worker with {v} validator")
    for (w, v), cs in checked.items():
        cal = calibrate_pair(w, v, cs[0::2], args.quantile, args.delta)
        pairs.append(cal)
        held_out.append((cal, decide_all(f"honest {w} worker, {v} validator (held out)", cs[1::2], cal,
                                         args.alpha), decide_all("all", cs, cal, args.alpha)))
    if args.table:
        Path(args.table).write_text(tables_to_json(pairs, run.meta))
        run.say(f"wrote {args.table}")
    return honest, pairs, held_out


def attack_builders(run: Run, honest: dict[str, list[Sub]]) -> dict[str, Callable[[], list[Sub]]]:
    """Per attack key, what makes its submissions: generated by an attacking worker, or
    (prompt, subst, copied) edited from honest bf16 submissions."""
    setup, agen = run.setup, run.agen
    worker = run.models["bf16"]
    bf16 = lambda m: m.to(torch.bfloat16).eval()  # noqa: E731
    generated: dict[str, Callable[[], list[Sub]]] = {
        "int8": lambda: generate(fake_quantize(worker, 8), setup.attack_prompts, **agen),
        "int4": lambda: generate(fake_quantize(worker, 4), setup.attack_prompts, **agen),
        "noise1": lambda: generate(bf16(noisy(setup.base, 0.01)), setup.attack_prompts, **agen),
        "noise5": lambda: generate(bf16(noisy(setup.base, 0.05)), setup.attack_prompts, **agen),
        "random": lambda: generate(bf16(random_init(setup.base)), setup.attack_prompts, **agen),
        "seed": lambda: generate(worker, setup.attack_prompts, seed_offset=7, **agen),
        "temp": lambda: generate(worker, setup.attack_prompts, temperature=0.7, **agen),
    }
    base: list[list[Sub]] = []

    def base_subs() -> list[Sub]:
        """Honest bf16 submissions to edit: the held-out half, or (--tables) the attack prompts'."""
        if not base:
            base.append(honest["bf16"][1::2] if honest else generate(worker, setup.attack_prompts, **agen))
        return base[0]

    derived: dict[str, Callable[[], list[Sub]]] = {
        "prompt": lambda: changed_prompt(base_subs(), setup),
        "subst": lambda: substituted(base_subs(), worker, setup, batch=run.args.prefill_batch),
        "copied": lambda: copied(base_subs()),
    }
    return {**generated, **derived}


def run_attacks(run: Run, honest: dict[str, list[Sub]], claimed: PairCalibration | None) -> list[Outcome]:
    """The chosen attacks, in ATTACKS order, claiming the bf16 stack and checked by the fp32 validator."""
    args, attacks = run.args, []
    builders = attack_builders(run, honest)
    check = run.models["fp32"]
    chosen = chosen_attacks(args)
    for key in ATTACKS:
        if key not in chosen:
            continue
        subs = builders[key]()
        attacks.append(decide_all(ATTACKS[key], validate(check, subs, **run.val), claimed, args.alpha))
        run.say(f"attack {ATTACKS[key]}: {outcome_row(attacks[-1])}")
    return attacks


def merge_runs(run: Run, attacks: list[Outcome]) -> list[dict]:
    """The runs the report stands on (--honest-command, --merge's, this one); --merge's attacks
    join ``attacks``."""
    args, runs = run.args, []
    if args.honest_command:  # the run that wrote the tables and the honest rows
        runs.append({"command": args.honest_command, "runtime_s": 60.0 * args.honest_runtime_min})
    for path in args.merge:
        old = json.loads(Path(path).read_text())
        runs += [r for r in old["meta"].get("runs", []) if "command" not in r]
        for raw in old["outcomes"]:
            if raw["name"].startswith("honest"):
                continue
            same = [o for o in attacks if o.name == raw["name"]]
            if same:
                combine(same[0], outcome_from_json(raw), path)
            else:
                attacks.append(outcome_from_json(raw))
    runs.append({"argv": sys.argv[1:], "runtime_s": time.time() - run.t0})
    return runs


def write_outputs(run: Run, pairs: list, held_out: list, attacks: list[Outcome], runs: list[dict],
                  claimed: PairCalibration | None) -> None:
    """Attacks in ATTACKS order with their escape bounds; the report to --doc (or stdout), every
    figure to --json."""
    args = run.args
    order = list(ATTACKS.values())
    attacks.sort(key=lambda o: order.index(o.name) if o.name in order else len(order))
    bounds = {o.name: escape_bound(o, claimed, args.alpha, args.group, args.bound_delta) for o in attacks}
    report = render(args, run.setup, pairs, held_out, attacks, runs, bounds)
    if args.doc:
        Path(args.doc).write_text(report)
        run.say(f"wrote {args.doc}")
    else:
        print(report)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "meta": run.meta | {"runs": runs, "alpha": args.alpha, "bound_delta": args.bound_delta},
            "pairs": json.loads(tables_to_json(pairs, run.meta))["pairs"],
            "outcomes": [vars(o) | {"reasons": sorted(o.reasons)} for _, o, _ in held_out] +
                        [vars(o) | {"reasons": sorted(o.reasons), "escape_bound": bounds[o.name]} for o in attacks]},
            indent=None, default=str))


def main() -> None:
    ap = build_parser()
    run = start(parse_args(ap))
    honest: dict[str, list[Sub]] = {}
    if run.args.tables:
        pairs, held_out = honest_from_tables(ap, run)
    else:
        honest, pairs, held_out = run_honest(run)
    cal_by = {(p.worker, p.validator): p for p in pairs}
    claimed = cal_by.get((stack_key("bf16"), stack_key("fp32")))
    attacks = [] if run.args.skip_attacks else run_attacks(run, honest, claimed)
    runs = merge_runs(run, attacks)
    write_outputs(run, pairs, held_out, attacks, runs, claimed)


if __name__ == "__main__":
    main()
