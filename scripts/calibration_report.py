"""The calibration experiment's markdown report (docs/calibration.md), written by scripts/calibrate.py.

Owns the report's text: the fixed parts (``TEXT_HEAD``, ``TEXT_TAIL``), the table rows of
pairs and outcomes, the targets table and its verdicts (``targets``, ``TARGET_99``), and how a
run's command line is quoted. It formats figures measured and bounded elsewhere
(scripts/calibration_stats.py); it computes no new ones and writes no file.
"""

from __future__ import annotations

import shlex

from scripts.calibration_experiment import Setup
from scripts.calibration_stats import Outcome, lower_95, prompt_counts, prompt_spread
from verify.policy import PairCalibration


# ----------------------------------------------------------------------------- report


def pct(n: int, d: int) -> str:
    return f"{n}/{d} ({100.0 * n / d:.1f}%)" if d else "-"


def outcome_row(o: Outcome) -> str:
    same = "-" if o.subs_same_stack is None else pct(o.subs_same_stack, o.submissions)
    return (f"| {o.name} | {o.submissions} | {o.rollouts} | {o.chunks} | {pct(o.chunks_failing, o.chunks)} | "
            f"{pct(o.rollouts_rejected, o.rollouts)} | {pct(o.subs_chunk_rule, o.submissions)} | "
            f"{pct(o.subs_aggregate, o.submissions)} | {pct(o.subs_either, o.submissions)} | {same} |")


OUTCOME_HEAD = ("| condition | submissions | rollouts | chunks | chunks over paper thresholds | rollouts rejected "
                "(check_rollout) | submissions rejected: per-chunk rule | submission-level test | either | "
                "same_stack preset |\n|---|---|---|---|---|---|---|---|---|---|")


def pair_row(cal: PairCalibration, o: Outcome) -> str:
    mm, ex = cal.stat("mant_err_mean"), cal.stat("exp_mismatches")
    return (f"| {cal.worker} | {cal.validator} | {cal.honest_chunks} / {cal.honest_rollouts} | "
            f"{'yes' if cal.bit_exact else 'no'} | {o.worst.get('exp_mismatches', 0):.0f} | "
            f"{o.worst.get('mant_err_mean', 0):.2f} | {o.worst.get('mant_err_median', 0):.1f} | "
            f"{o.worst.get('sign_mismatches', 0):.0f} | {mm.limit:.3f} / {mm.exceed_rate:.3f} | "
            f"{ex.limit:.0f} / {ex.exceed_rate:.3f} |")


PAIR_HEAD = ("| worker stack | validator stack | calibration chunks / rollouts | bit-exact | worst exp | worst mant "
             "mean | worst mant median | worst sign | mant mean: limit / exceed rate | exp: limit / exceed rate |\n"
             "|---|---|---|---|---|---|---|---|---|---|")


TARGET_99 = ("int8 weights", "weights + 1% noise")  # the 99% attacks; every other one 99.9%


def command_line(argv: list[str]) -> str:
    shown = ["/tmp/smol/smollm2" if i > 0 and argv[i - 1] == "--model" and a != "tiny" else a
             for i, a in enumerate(argv)]
    return "PYTHONPATH=. flock /tmp/p2pnet-cpu.lock .venv/bin/python scripts/calibrate.py " + shlex.join(shown)


def render(args, setup: Setup, pairs, held_out, attacks, runs: list[dict], bounds: dict) -> str:
    cmds = "\n".join(f"    {r.get('command') or command_line(r['argv'])}" for r in runs)
    runtime_s = sum(r["runtime_s"] for r in runs)
    honest_chunks = sum(o.chunks for _, o, _ in held_out)
    honest_fr = sum(o.subs_either for _, o, _ in held_out)
    lines = [TEXT_HEAD.format(cmds=cmds, model=setup.name, runtime=runtime_s / 60, alpha=args.alpha,
                              quantile=args.quantile, delta=args.delta, group=args.group, tokens=args.tokens,
                              rows=args.rows, prefill_batch=args.prefill_batch, ties=args.ties),
             "## Honest stack pairs (calibration figures from the even-numbered half)", "",
             PAIR_HEAD]
    lines += [pair_row(cal, everything) for cal, _, everything in held_out]
    if args.tables:
        lines += ["", f"Tables from `{args.tables}`; honest rows from `{args.honest_from}` (worst figures over the "
                  "held-out half); the first command above made both."]
    lines += ["", "## Decisions", "",
              "Held-out honest submissions (odd-numbered half) under the table of their own pair; attacks claim "
              "the bf16 worker's stack (bf16/torch/cpu) and are checked by the fp32 validator (fp32/torch/cpu), "
              "as verify.daemon runs.", "", OUTCOME_HEAD]
    lines += [outcome_row(o) for _, o, _ in held_out]
    lines += [outcome_row(o) for o in attacks]
    lines += ["", f"Honest held-out: {honest_fr} of {sum(o.submissions for _, o, _ in held_out)} submissions "
              f"rejected, over {honest_chunks} chunks.", ""]
    lines += targets(held_out, attacks, bounds, args.bound_delta)
    if attacks:
        lines += ["Reason codes seen per attack:", ""]
        lines += [f"* {o.name}: {', '.join(sorted(o.reasons)) or '-'}" for o in attacks]
        lines.append("")
    lines.append(TEXT_TAIL)
    return "\n".join(lines) + "\n"


def targets(held_out, attacks: list[Outcome], bounds: dict, bound_delta: float) -> list[str]:
    """Issue 14's targets in one table, judged from the figures above (never assumed)."""
    chunks = sum(o.chunks for _, o, _ in held_out)
    subs = sum(o.submissions for _, o, _ in held_out)
    fr = sum(o.subs_either for _, o, _ in held_out)
    honest_ok = "met" if fr == 0 and chunks >= 2000 else (
        "NOT met" + ("" if fr == 0 else " (false rejections)") + ("" if chunks >= 2000 else " (too few chunks)"))
    out = ["## Targets (issue 14), judged from these runs", "",
           f"Escape bound: an upper bound, at confidence 1 - {bound_delta:g}, on the chance that a "
           "submission of this attack is accepted, computed from its measured rollouts (scripts/calibration_stats.py "
           "`escape_bound`: the chance that all rollouts pass check_rollout, and Chernoff and binomial-tail "
           "bounds on the submission test). It is a bound from a model, not a count: it takes a submission's "
           "rollouts as independent draws from the attack's measured rollouts, pooled over prompts. 'Prompt "
           "spread' checks that model: the lowest per-prompt mean exceed fraction (mantissa mean) and the "
           "highest per-prompt share of rollouts passing check_rollout. 'Counts alone' is the one-sided 95% "
           "lower bound on the rejection rate that the counts give without any model, with the submission "
           "as the unit and with the prompt as the unit (a prompt counts as rejected when all of its "
           "submissions were; submissions of one prompt are not independent draws); 'met by counts' needs "
           "both.", "",
           "| condition | prompts | submissions | rollouts | chunks | submissions rejected | rejection rate, "
           "95% lower bound from counts alone: submissions / prompts | prompt spread | escape bound | target | "
           "verdict |",
           "|---|---|---|---|---|---|---|---|---|---|---|",
           f"| honest, all held-out pairs | - | {subs} | {sum(o.rollouts for _, o, _ in held_out)} | {chunks} | "
           f"{fr} | - | - | - | 0 rejected over >= 2,000 chunks | {honest_ok} |"]
    for o in attacks:
        need = 0.99 if o.name in TARGET_99 else 0.999
        rate = o.subs_either / o.submissions if o.submissions else 0.0
        bound = bounds.get(o.name, 1.0)
        prompts = len({r["prompt"] for r in o.records}) if o.records else "-"
        by_prompt = lower_95(*prompt_counts(o)) if o.records else 0.0
        if rate < need:
            verdict = "NOT met"
        elif min(lower_95(o.subs_either, o.submissions), by_prompt) >= need:
            verdict = "met by counts"
        elif bound <= 1 - need:
            verdict = "every one rejected; the rate shown by the escape bound (a model), not by counts"
        else:
            verdict = "NOT shown (too few submissions, escape bound above target)"
        out.append(f"| {o.name} | {prompts} | {o.submissions} | {o.rollouts} | {o.chunks} | "
                   f"{pct(o.subs_either, o.submissions)} | {lower_95(o.subs_either, o.submissions):.1%} / "
                   f"{by_prompt:.1%} | "
                   f"{prompt_spread(o)} | {bound:.2g} | >= {need:.1%} | {verdict} |")
    return out + [""]


TEXT_HEAD = """# Calibration of the verify policy

Generated by `scripts/calibrate.py` (do not edit by hand; rerun it). Commands (the report is
the last one, which merges the JSON of the others):

{cmds}

Model: {model}. Runtime {runtime:.1f} min on one thread (all runs). Honest workers generate as
`trainer.rollout.generate_rows` does ({rows} rows of one prompt per batch, KV cache, seeded
sampling at temperature 1.0, up to {tokens} new tokens) and prove their LM-head inputs; a
submission is {group} rollouts of one prompt. Validators recompute each rollout in one prefill
({prefill_batch} row(s) of equal length per batch) and run `verify.check.check_rollout` (TOPLOC per chunk with the
paper's thresholds, the sampling replay, termination). Stack keys are dtype/backend/device.
Ties at the 128th place: **{ties}** (`verify.toploc.measure`; "exact" is torch's choice, as
toploc's verify; "open" counts the tied entries the proof matches best). The tables carry this
rule (`ties`) and a validator measures with it.

The submission-level test (`verify.policy.decide_aggregate`, alpha = {alpha}) pools each
statistic (mantissa-error mean, exponent mismatches) over a submission's checked chunks: a
chunk *exceeds* when its statistic is above the pair's `limit` (the {quantile} quantile of
honest chunks in the calibration half), each rollout contributes its fraction of exceeding
chunks, and the submission is rejected when R KL(mean fraction || exceed rate) >= ln(2 / alpha),
with `exceed rate` an upper confidence bound (level 1 - {delta}) on the honest fraction. By
Chernoff's bound an honest submission is rejected with probability at most alpha (plus the
chance, at most {delta}, that the calibration half underestimated the rate), for any rollout
length. The tables are shipped as `verify/calibration_tables.json`.
"""

TEXT_TAIL = """## How to read this

* "bit-exact": every calibration chunk measured 0 in every statistic. Only such pairs may use
  the `same_stack` preset (`verify.policy.SAME_STACK`: at most 2 exponent and 2 sign
  mismatches, mantissa mean and median at most 1.0); `verify.daemon` refuses to start with it
  unless its own stack has a bit-exact pair in the shipped table, and applies it only to
  submissions whose declared stack forms a bit-exact pair with its own (others get the paper's
  thresholds plus the submission-level test).
* "either" is what the validator decides: a submission is rejected when any checked rollout
  fails `check_rollout` or the submission-level test rejects it.
* The tables are per stack pair *and per model*: honest noise depends on the model (the tiny
  test model and SmolLM2 differ), so a network serving another model reruns this script on it
  and points `validator.calibration_file` at the result. Pairs not in the table (a GPU worker,
  vLLM) are uncalibrated: the submission-level test does not run for them (the validator's
  status counts them) and only the per-chunk thresholds apply.
* Validators prefill `--prefill-batch` rows of equal length at once; the daemon prefills one
  row at a time, and batching can change the rounding of fp32 results.

## Per-chunk defaults

`verify.policy.Thresholds()` keeps the TOPLOC paper's limits (38 exponent mismatches of 128,
mantissa mean 10, median 8; 24 sign mismatches, ours): they must hold for GPU workers checked
by other hardware, whose honest noise is unmeasured here and, per the paper, far larger than
the CPU pairs above. The submission-level test is what catches small shifts on the measured
pairs; tightening the per-chunk limits instead would reject honest outliers one chunk at a time.
The sampling replay margin (`verify.sampling.DEFAULT_MARGIN = 1.0`) and termination check are
kept; the attacks they catch show up above as `sampling_mismatch` and `bad_termination`. A final
EOS below `min_eos_prob` (1e-4), which an honest worker samples with probability up to 1e-4 a
token, ends a rollout legitimately when the replay shows it was the seeded sample: its deficit
is at most `DEFAULT_SEEDED_EOS_DEFICIT = 0.5`, not the margin's 1.0. At a position where EOS has
probability p, a cheater finds it that close with probability p e^0.5 / (1 - p + p e^0.5), at
most 1.65x an honest worker's p. Honest deficits measured by earlier runs of this script on CPU
at temperature 1: at most 0.37 (tiny model, fp32 validator against a bf16 worker) and 0.135
(SmolLM2); they are logit noise divided by the temperature, and unmeasured for GPU workers.
Runs before 2026-12-05 counted every such EOS as `bad_termination`.
"""
