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
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from verify.calibration import TIES, load_tables, model_fingerprint, tables_to_json
from verify.check import check_rollout
from verify.policy import (AGGREGATE_STATS, SAME_STACK, PairCalibration, StatCalibration, decide,
                           decide_aggregate, exceed_fractions, kl_bernoulli, kl_upper_bound)
from verify.testing import fake_quantize
from verify.toploc import build_proofs

TEMPERATURE = 1.0
BASE_SEED = 1000
TOPICS = ("a robot who learns to paint", "the ocean at night", "a city under snow", "an old lighthouse",
          "a dragon who is afraid of fire", "the first day of school", "a journey to Mars", "a lost key",
          "a garden in spring", "a train that never stops", "a clockmaker's apprentice", "a quiet library",
          "a storm at sea", "a friendly ghost", "a mountain village", "the last tree on Earth")
FORMS = ("Write a short story about {}.", "Write a poem about {}.", "Describe {} in vivid detail.",
         "Write a diary entry about {}.", "Write a letter about {}.", "Write a song about {}.",
         "Explain {} to a child.", "Write a news report about {}.", "Write a fable about {}.",
         "Write a speech about {}.", "Write a dialogue about {}.", "Write a riddle about {}.",
         "Write a haiku about {}.", "Write a travel guide about {}.", "Write a recipe inspired by {}.",
         "Write a bedtime story about {}.", "Write a limerick about {}.", "Write a review of a film about {}.",
         "Write a museum label about {}.", "Write a weather forecast about {}.")
# prompt i: FORMS[i // 16], so prompts stay the same whatever forms are appended (the shipped table
# rests on 0-15, the detection runs on 16-315); every prompt is distinct up to len(FORMS) * 16


# ----------------------------------------------------------------------------- setup


@dataclass
class Setup:
    base: torch.nn.Module            # fp32 weights
    prompts: list[list[int]]         # honest prompts
    attack_prompts: list[list[int]]  # prompts of generated attacks (disjoint from honest ones)
    attack_first: int                # attack prompt number of attack_prompts[0] (--attack-offset)
    change_at: dict[tuple[int, ...], int]  # prompt -> the position the changed-prompt attack edits
    eos: int
    vocab: int
    name: str


def chat_prompts(tok, n: int, offset: int) -> tuple[list[list[int]], dict[tuple[int, ...], int]]:
    if offset + n > len(FORMS) * len(TOPICS):
        raise SystemExit(f"prompts {offset}..{offset + n - 1} asked for, but only {len(FORMS) * len(TOPICS)} "
                         "distinct prompts exist (scripts/calibrate.py FORMS x TOPICS)")
    prompts, change_at = [], {}
    for i in range(offset, offset + n):
        text = FORMS[i // len(TOPICS) % len(FORMS)].format(TOPICS[i % len(TOPICS)])
        ids = [int(t) for t in tok.hf.apply_chat_template([{"role": "user", "content": text}],
                                                          add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"]]
        n_user = len(tok.encode(text))
        prompts.append(ids)
        change_at[tuple(ids)] = len(ids) - 5 - (n_user + 1) // 2  # the middle of the user's text
    return prompts, change_at


def make_setup(model: str, n_prompts: int, n_attack: int, attack_offset: int = 0) -> Setup:
    """Honest prompts 0..n_prompts-1, then attack prompts from n_prompts + attack_offset on."""
    if model == "tiny":
        from verify.testing import tiny_model

        base = tiny_model(dtype=torch.float32)
        rng = np.random.default_rng(0)
        all_prompts = [rng.integers(3, 512, size=int(rng.integers(8, 24))).tolist()
                       for _ in range(n_prompts + attack_offset + n_attack)]
        return Setup(base, all_prompts[:n_prompts], all_prompts[n_prompts + attack_offset:], attack_offset,
                     {tuple(p): len(p) // 2 for p in all_prompts}, eos=2, vocab=512, name="tiny")
    from trainer.model import load_model_dir

    base, tok = load_model_dir(model)
    prompts, change = chat_prompts(tok, n_prompts, 0)
    attack, change2 = chat_prompts(tok, n_attack, n_prompts + attack_offset)
    return Setup(base, prompts, attack, attack_offset, {**change, **change2}, eos=int(tok.eos_id),
                 vocab=int(base.config.vocab_size), name=Path(model).name)


def in_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    return copy.deepcopy(model).to(dtype).eval()


def noisy(model: torch.nn.Module, rel_std: float, seed: int = 1) -> torch.nn.Module:
    """A copy with N(0, (rel_std * std(tensor))^2) added to every weight."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in out.parameters():  # tied tensors are visited once
            w = param.float()
            param.copy_(w + torch.randn(w.shape, generator=gen) * (rel_std * float(w.std())))
    return out


def random_init(model: torch.nn.Module, seed: int = 5) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(model.config).eval()


# ----------------------------------------------------------------------------- generation


@dataclass
class Sub:
    """One submission: ``group`` rollouts of one prompt; ``seed`` is the claimed sampling seed."""

    prompt: list[int]
    seed: int
    rows: list[int]
    outputs: list[list[int]]
    proofs: list[list[bytes]]
    temperature: float = TEMPERATURE
    prompt_id: int = 0  # prompt number in its list (honest or attack): the population unit for bounds


@torch.no_grad()
def generate(model, prompts: list[list[int]], *, rows: int, group: int, tokens: int, eos: int,
             seed_offset: int = 0, temperature: float = TEMPERATURE, first: int = 0) -> list[Sub]:
    """``rows`` rows per prompt in one batch (trainer.rollout.generate_rows), cut into
    submissions of ``group``. Prompt i is numbered first + i; the claimed seed is BASE_SEED +
    that number; ``seed_offset`` makes the worker sample with another one."""
    from trainer.rollout import GenerationConfig, generate_rows

    subs = []
    for i, prompt in enumerate(prompts, start=first):
        seed = BASE_SEED + i
        outs = generate_rows(model, [prompt] * rows, list(range(rows)), seed=seed + seed_offset, eos_id=eos,
                             config=GenerationConfig(group_size=max(2, rows), max_new_tokens=tokens,
                                                     temperature=temperature))
        for start in range(0, rows, group):
            part = outs[start:start + group]
            subs.append(Sub(prompt, seed, list(range(start, start + len(part))), [o.output_ids for o in part],
                            [build_proofs(o.hidden) for o in part], temperature=TEMPERATURE, prompt_id=i))
    return subs


# ----------------------------------------------------------------------------- validation


PREFILL_BATCH = [1]  # rows per validator prefill (--prefill-batch); verify.daemon uses 1


@torch.no_grad()
def prefill(model, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(hidden bf16 [T, H], logits fp32 [T, V]) per sequence; equal lengths may share a batch."""
    out: list = [None] * len(sequences)
    by_len: dict[int, list[int]] = {}
    for i, s in enumerate(sequences):
        by_len.setdefault(len(s), []).append(i)
    batch = PREFILL_BATCH[0]
    for idx in by_len.values():
        for start in range(0, len(idx), batch):
            part = idx[start:start + batch]
            x = torch.tensor([sequences[i] for i in part], dtype=torch.long)
            h = model.model(input_ids=x, use_cache=False).last_hidden_state
            logits = model.lm_head(h).float()
            for j, i in enumerate(part):
                out[i] = (h[j].to(torch.bfloat16), logits[j])
    return out


@dataclass
class Checked:
    """A submission's per-rollout verdicts under the paper's thresholds."""

    verdicts: list
    prompt_id: int = 0

    @property
    def chunk_stats(self) -> list[list]:
        return [list(v.chunk_stats) for v in self.verdicts]


def validate(model, subs: list[Sub], *, eos: int, tokens: int, vocab: int, exact_ties: bool = True) -> list[Checked]:
    out = []
    for sub in subs:
        seqs = [sub.prompt + o for o in sub.outputs]
        results = prefill(model, seqs)
        verdicts = []
        for row, output, proofs, (h, lg) in zip(sub.rows, sub.outputs, sub.proofs, results):
            verdicts.append(check_rollout(lambda ids, h=h, lg=lg: (h, lg), sub.prompt, output, proofs,
                                          seed=sub.seed, row=row, temperature=sub.temperature,
                                          eos_token_id=eos, max_new_tokens=tokens, vocab_size=vocab,
                                          exact_ties=exact_ties))
        out.append(Checked(verdicts, sub.prompt_id))
    return out


# ----------------------------------------------------------------------------- attacks built from honest data


def bump(token: int, vocab: int) -> int:
    return 3 + (token - 2) % (vocab - 3)


def changed_prompt(subs: list[Sub], setup: Setup) -> list[Sub]:
    out = []
    for s in subs:
        p = list(s.prompt)
        at = setup.change_at[tuple(s.prompt)]
        p[at] = bump(p[at], setup.vocab)
        out.append(Sub(p, s.seed, s.rows, s.outputs, s.proofs, prompt_id=s.prompt_id))
    return out


def substituted(subs: list[Sub], worker, setup: Setup) -> list[Sub]:
    """One generated token per 32-token chunk changed (position 10 of each chunk, never the
    last token); proofs rebuilt from the worker's own prefill of the changed sequence."""
    out = []
    for s in subs:
        outputs = []
        for o in s.outputs:
            o2 = list(o)
            for at in range(10, len(o2) - 1, 32):
                o2[at] = bump(o2[at], setup.vocab)
            outputs.append(o2)
        hidden = prefill(worker, [s.prompt + o for o in outputs])
        proofs = [build_proofs(h[len(s.prompt) - 1:len(s.prompt) - 1 + len(o)]) for (h, _), o in zip(hidden, outputs)]
        out.append(Sub(s.prompt, s.seed, s.rows, outputs, proofs, prompt_id=s.prompt_id))
    return out


def copied(subs: list[Sub]) -> list[Sub]:
    """Each rollout carries the proofs of the next rollout of its submission (cycled to fit)."""
    out = []
    for s in subs:
        proofs = []
        for i, o in enumerate(s.outputs):
            donor = s.proofs[(i + 1) % len(s.proofs)]
            need = -(-len(o) // 32)
            proofs.append([donor[j % len(donor)] for j in range(need)])
        out.append(Sub(s.prompt, s.seed, s.rows, s.outputs, proofs, prompt_id=s.prompt_id))
    return out


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
    for name in AGGREGATE_STATS if cal is not None else ():
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


ATTACKS = {"int8": "int8 weights", "int4": "int4 weights", "noise1": "weights + 1% noise",
           "noise5": "weights + 5% noise", "random": "another model (random init)",
           "seed": "another sampling seed", "temp": "temperature 0.7 claimed as 1.0",
           "prompt": "one prompt token changed", "subst": "one token per chunk changed, proofs rebuilt",
           "copied": "proofs copied from another rollout"}
DERIVED = ("prompt", "subst", "copied")  # built from honest bf16 submissions
TARGET_99 = ("int8 weights", "weights + 1% noise")  # the 99% attacks; every other one 99.9%


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


def main() -> None:
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
    args = ap.parse_args()
    PREFILL_BATCH[0] = max(1, args.prefill_batch)
    if args.rows % args.group:
        ap.error("--rows must be a multiple of --group")
    chosen = [a.strip() for a in args.attacks.split(",") if a.strip()]
    if unknown := [a for a in chosen if a not in ATTACKS]:
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
    torch.set_num_threads(1)
    t0 = time.time()

    def say(msg: str) -> None:
        print(f"[{time.time() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True)

    setup = make_setup(args.model, args.prompts, args.attack_prompts, args.attack_offset)
    if args.tables:  # attack prompts stay the ones after the honest prompts of the table's run
        setup.prompts = []
    gen = dict(rows=args.rows, group=args.group, tokens=args.tokens, eos=setup.eos)
    agen = gen | {"first": setup.attack_first}  # attack prompts keep their numbers across runs
    val = dict(eos=setup.eos, tokens=args.tokens, vocab=setup.vocab, exact_ties=ties == "exact")
    models = {"fp32": setup.base.eval(), "bf16": in_dtype(setup.base, torch.bfloat16)}
    meta = {"source": "scripts/calibrate.py", "model": setup.name, "model_config": model_fingerprint(setup.base.config),
            "quantile": args.quantile, "delta": args.delta,
            "tokens": args.tokens, "group": args.group, "torch": torch.__version__,
            "prefill_batch": args.prefill_batch, "ties": ties}

    honest: dict[str, list[Sub]] = {}
    pairs, held_out = [], []
    if args.tables:
        tables = load_tables(args.tables)
        if not tables.applies_to(setup.base.config):
            ap.error(f"{args.tables} was measured on {tables.meta.get('model')}, not on this model")
        pairs = list(tables.pairs.values())
        if args.honest_from:
            old = json.loads(Path(args.honest_from).read_text())
            honest_rows = [outcome_from_json(o) for o in old["outcomes"] if o["name"].startswith("honest")]
            held_out = [(cal, o, o) for cal, o in zip(pairs, honest_rows)]
    else:
        for w, model in models.items():
            honest[w] = generate(model, setup.prompts, **gen)
            say(f"honest {w} worker: {len(honest[w])} submissions, "
                f"{sum(len(p) for s in honest[w] for p in s.proofs)} chunks")
        checked: dict[tuple[str, str], list[Checked]] = {}
        for w in models:
            for v, vmodel in models.items():
                checked[w, v] = validate(vmodel, honest[w], **val)
                say(f"validated {w} worker with {v} validator")
        for (w, v), cs in checked.items():
            cal = calibrate_pair(w, v, cs[0::2], args.quantile, args.delta)
            pairs.append(cal)
            held_out.append((cal, decide_all(f"honest {w} worker, {v} validator (held out)", cs[1::2], cal,
                                             args.alpha), decide_all("all", cs, cal, args.alpha)))
        if args.table:
            Path(args.table).write_text(tables_to_json(pairs, meta))
            say(f"wrote {args.table}")
    cal_by = {(p.worker, p.validator): p for p in pairs}
    claimed = cal_by.get((stack_key("bf16"), stack_key("fp32")))

    attacks: list[Outcome] = []
    if not args.skip_attacks:
        worker = models["bf16"]
        check = models["fp32"]
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
            "subst": lambda: substituted(base_subs(), worker, setup),
            "copied": lambda: copied(base_subs()),
        }
        for key in ATTACKS:
            if key not in chosen:
                continue
            subs = {**generated, **derived}[key]()
            attacks.append(decide_all(ATTACKS[key], validate(check, subs, **val), claimed, args.alpha))
            say(f"attack {ATTACKS[key]}: {outcome_row(attacks[-1])}")

    runs = []
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
    runs.append({"argv": sys.argv[1:], "runtime_s": time.time() - t0})
    order = list(ATTACKS.values())
    attacks.sort(key=lambda o: order.index(o.name) if o.name in order else len(order))
    bounds = {o.name: escape_bound(o, claimed, args.alpha, args.group, args.bound_delta) for o in attacks}
    report = render(args, setup, pairs, held_out, attacks, runs, bounds)
    if args.doc:
        Path(args.doc).write_text(report)
        say(f"wrote {args.doc}")
    else:
        print(report)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "meta": meta | {"runs": runs, "alpha": args.alpha, "bound_delta": args.bound_delta},
            "pairs": json.loads(tables_to_json(pairs, meta))["pairs"],
            "outcomes": [vars(o) | {"reasons": sorted(o.reasons)} for _, o, _ in held_out] +
                        [vars(o) | {"reasons": sorted(o.reasons), "escape_bound": bounds[o.name]} for o in attacks]},
            indent=None, default=str))


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


def targets(held_out, attacks: list[Outcome], bounds: dict, bound_delta: float) -> list[str]:
    """Issue 14's targets in one table, judged from the figures above (never assumed)."""
    chunks = sum(o.chunks for _, o, _ in held_out)
    subs = sum(o.submissions for _, o, _ in held_out)
    fr = sum(o.subs_either for _, o, _ in held_out)
    honest_ok = "met" if fr == 0 and chunks >= 2000 else (
        "NOT met" + ("" if fr == 0 else " (false rejections)") + ("" if chunks >= 2000 else " (too few chunks)"))
    out = ["## Targets (issue 14), judged from these runs", "",
           f"Escape bound: an upper bound, at confidence 1 - {bound_delta:g}, on the chance that a "
           "submission of this attack is accepted, computed from its measured rollouts (scripts/calibrate.py "
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
unchanged; the attacks they catch show up above as `sampling_mismatch` and `bad_termination`.
"""


if __name__ == "__main__":
    main()
