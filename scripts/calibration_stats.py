"""The calibration experiment's statistics (scripts/calibrate.py runs them on measured verdicts).

Owns the per-pair calibration (``calibrate_pair``: limits and exceed-rate bounds from honest
chunks), the decisions over a set of submissions (``Outcome``, ``decide_all``: per-chunk rule,
submission-level test, same_stack preset), the bounds the report judges attacks by
(``escape_bound`` and its parts, ``lower_95`` and ``prompt_counts`` from counts alone,
``prompt_spread``), and merging outcomes of earlier runs (``outcome_from_json``, ``combine``).
Pure functions of figures: no model runs here and nothing is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from scripts.calibration_experiment import Checked
from verify.policy import (AGGREGATE_STATS, SAME_STACK, PairCalibration, StatCalibration, decide,
                           decide_aggregate, exceed_fractions, kl_bernoulli, kl_upper_bound)


# ----------------------------------------------------------------------------- calibration and decisions


def stack_key(dtype: str) -> str:
    return f"{dtype}/torch/cpu"


def calibrate_pair(worker: str, validator: str, checked: list[Checked], quantile: float,
                   delta: float) -> PairCalibration:
    rollouts = [r for c in checked for r in c.chunk_stats if r]
    chunks = [s for r in rollouts for s in r]
    stats = []
    for name in AGGREGATE_STATS:
        values = np.array([float(getattr(s, name)) for s in chunks])
        limit = float(np.quantile(values, quantile, method="higher"))
        provisional = StatCalibration(limit, 0.5)
        fractions = exceed_fractions(rollouts, name, provisional)
        rate = kl_upper_bound(float(np.mean(fractions)), len(fractions), delta)
        stats.append((name, StatCalibration(limit, min(max(rate, 1e-9), 1 - 1e-9))))
    exact = all(s.exp_mismatches == 0 and s.mant_err_mean == 0 and s.sign_mismatches == 0 for s in chunks)
    return PairCalibration(stack_key(worker), stack_key(validator), exact, tuple(stats), len(chunks), len(rollouts))


@dataclass
class Outcome:
    """Decisions over a set of submissions."""

    name: str
    submissions: int = 0
    rollouts: int = 0
    chunks: int = 0
    chunks_failing: int = 0        # per-chunk thresholds (paper)
    rollouts_rejected: int = 0     # check_rollout (paper thresholds, replay, termination)
    subs_chunk_rule: int = 0       # any rollout rejected
    subs_aggregate: int = 0        # the submission-level test alone
    subs_either: int = 0
    subs_same_stack: int | None = None  # per-chunk rule with SAME_STACK thresholds, where bit-exact
    reasons: set = field(default_factory=set)
    worst: dict = field(default_factory=dict)
    # per submission: prompt id, per-rollout check_rollout verdicts and exceed fractions, decisions
    records: list = field(default_factory=list)


def decide_all(name: str, checked: list[Checked], cal: PairCalibration | None, alpha: float) -> Outcome:
    o = Outcome(name)
    if cal is not None and cal.bit_exact:
        o.subs_same_stack = 0
    for c in checked:
        o.submissions += 1
        o.rollouts += len(c.verdicts)
        rule = any(not v.accepted for v in c.verdicts)
        o.rollouts_rejected += sum(not v.accepted for v in c.verdicts)
        for v in c.verdicts:
            o.reasons.update(v.reasons)
            o.chunks += len(v.chunk_stats)
            o.chunks_failing += len(decide(v.chunk_stats).failures)
            for s in v.chunk_stats:
                for stat in ("exp_mismatches", "mant_err_mean", "mant_err_median", "sign_mismatches"):
                    o.worst[stat] = max(o.worst.get(stat, 0.0), float(getattr(s, stat)))
        agg = decide_aggregate(c.chunk_stats, cal, alpha).accepted if cal is not None else True
        o.records.append({
            "prompt": c.prompt_id, "accepted": [bool(v.accepted) for v in c.verdicts],
            "chunks": [len(v.chunk_stats) for v in c.verdicts],
            "fractions": {} if cal is None else {
                name: exceed_fractions([v.chunk_stats for v in c.verdicts], name, cal.stat(name))
                for name in AGGREGATE_STATS},
            "chunk_rule": bool(rule), "aggregate": not agg})
        o.subs_chunk_rule += rule
        o.subs_aggregate += not agg
        o.subs_either += rule or not agg
        if o.subs_same_stack is not None:
            other = any(set(v.reasons) - {"toploc_exp", "toploc_mant_mean", "toploc_mant_median", "toploc_sign"}
                        for v in c.verdicts)
            tight = any(not decide(v.chunk_stats, SAME_STACK).accepted for v in c.verdicts)
            o.subs_same_stack += other or tight
    return o


# ----------------------------------------------------------------------------- bounds


def kl_lower_bound(mean: float, n: int, delta: float) -> float:
    """Lower confidence bound (level 1 - delta) on the expectation of n independent [0, 1] samples."""
    return 1.0 - kl_upper_bound(1.0 - mean, n, delta)


def aggregate_cut(rate: float, rollouts: int, alpha: float) -> float:
    """The smallest mean exceed fraction at which decide_aggregate rejects ``rollouts`` rollouts
    (inf when even 1.0 is not enough)."""
    limit = math.log(len(AGGREGATE_STATS) / alpha)
    if rollouts * kl_bernoulli(1.0, rate) < limit:
        return math.inf
    lo, hi = rate, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if rollouts * kl_bernoulli(mid, rate) >= limit else (mid, hi)
    return hi


def binomial_tail(n: int, at_least: int, p: float) -> float:
    """P(X >= at_least) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, j) * p**j * (1.0 - p) ** (n - j) for j in range(max(at_least, 0), n + 1))


LOW_LEVELS = (1.0, 0.75, 0.5)  # exceed-fraction levels of the binomial-tail bound


def escape_bound(o: Outcome, cal: PairCalibration | None, alpha: float, group: int, delta: float) -> float:
    """An upper bound, at confidence 1 - delta, on the chance that a submission of ``group``
    rollouts of this attack is accepted, from its rollouts pooled over prompts.

    Model: a submission's rollouts are independent draws from the attack's measured rollouts
    (the prompt effect is taken as negligible; ``prompt_spread`` shows how far prompts
    differ). A submission escapes only if every rollout passes check_rollout and the
    submission test lets its mean exceed fraction (per statistic) stay below ``cut``, the
    smallest mean it rejects. Bounds, the smallest taken: q^group, q an upper confidence
    bound on a rollout passing; Chernoff, exp(-group KL(cut || mu)) with mu a lower
    confidence bound on a rollout's mean exceed fraction; and a binomial tail: with p an
    upper confidence bound on a rollout's fraction being below h, the mean stays below cut
    only if more than group (1 - cut / h) rollouts are below h. Confidence is split over
    every bound taken.
    """
    accepted = [a for r in o.records for a in r["accepted"]]
    if not accepted:
        return 1.0
    per_test = delta / (1 + len(AGGREGATE_STATS) * (1 + len(LOW_LEVELS)))
    bound = kl_upper_bound(sum(accepted) / len(accepted), len(accepted), per_test) ** group
    if cal is None:
        return bound
    for name in AGGREGATE_STATS:
        fractions = [f for r in o.records for f in r["fractions"].get(name, [])]
        if not fractions:
            continue
        cut = aggregate_cut(cal.stat(name).exceed_rate, group, alpha)
        if cut > 1.0:
            continue
        mu = kl_lower_bound(sum(fractions) / len(fractions), len(fractions), per_test)
        if mu > cut:
            bound = min(bound, math.exp(-group * kl_bernoulli(cut, mu)))
        for level in LOW_LEVELS:
            if level <= cut:
                continue
            low = kl_upper_bound(sum(f < level for f in fractions) / len(fractions), len(fractions), per_test)
            bound = min(bound, binomial_tail(group, math.floor(group * (1.0 - cut / level)) + 1, low))
    return bound


def prompt_spread(o: Outcome) -> str:
    """Across prompts: the lowest mean exceed fraction (mantissa mean) and the highest share
    of rollouts passing check_rollout."""
    by: dict[int, list[dict]] = {}
    for rec in o.records:
        by.setdefault(rec["prompt"], []).append(rec)
    if not by:
        return "-"
    low = min((sum(f for r in recs for f in r["fractions"].get("mant_err_mean", [])) /
               max(1, sum(len(r["fractions"].get("mant_err_mean", [])) for r in recs))) for recs in by.values())
    high = max(sum(a for r in recs for a in r["accepted"]) / max(1, sum(len(r["accepted"]) for r in recs))
               for recs in by.values())
    return f"{low:.2f} / {high:.2f}"


# ----------------------------------------------------------------------------- counts alone


def lower_95(rejected: int, n: int) -> float:
    """One-sided 95% lower confidence bound on a rejection rate from counts alone (Clopper-Pearson)."""
    if n == 0:
        return 0.0
    if rejected == n:
        return 0.05 ** (1.0 / n)
    return kl_lower_bound(rejected / n, n, 0.05)  # Chernoff form: conservative


def prompt_counts(o: Outcome) -> tuple[int, int]:
    """(prompts all of whose submissions were rejected, prompts measured): the count with the
    prompt as the unit, since submissions of one prompt share it and are not independent."""
    by: dict[int, bool] = {}
    for r in o.records:
        by[r["prompt"]] = by.get(r["prompt"], True) and bool(r["chunk_rule"] or r["aggregate"])
    return sum(by.values()), len(by)


# ----------------------------------------------------------------------------- merging earlier runs


def outcome_from_json(raw: dict) -> Outcome:
    known = set(Outcome.__dataclass_fields__)
    return Outcome(**{k: v for k, v in raw.items() if k in known} | {"reasons": set(raw.get("reasons", ()))})


def combine(into: Outcome, more: Outcome, source: str) -> None:
    """Add ``more``'s submissions to ``into`` (the same attack measured on other prompts). Refuses
    when a prompt is in both: submissions of one prompt are not independent draws, and the
    count bounds and prompt spread treat prompts as the population unit."""
    both = {r["prompt"] for r in into.records} & {r["prompt"] for r in more.records}
    if both:
        raise SystemExit(f"--merge {source}: '{into.name}' was already measured on prompts {sorted(both)[:5]}; "
                         "a later run takes new ones with --attack-offset")
    for name in ("submissions", "rollouts", "chunks", "chunks_failing", "rollouts_rejected", "subs_chunk_rule",
                 "subs_aggregate", "subs_either"):
        setattr(into, name, getattr(into, name) + getattr(more, name))
    if into.subs_same_stack is not None or more.subs_same_stack is not None:
        into.subs_same_stack = (into.subs_same_stack or 0) + (more.subs_same_stack or 0)
    into.reasons |= more.reasons
    into.worst = {k: max(into.worst.get(k, 0.0), more.worst.get(k, 0.0)) for k in into.worst | more.worst}
    into.records += more.records

