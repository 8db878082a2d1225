"""Calibrate and test the verification policy: honest stack pairs, attacks, submission-level test.

    PYTHONPATH=. .venv/bin/python scripts/calibrate.py --model /tmp/smol/smollm2 \
        [--prompts 16] [--attack-prompts 8] [--rows 32] [--group 16] [--tokens 64] \
        [--doc docs/calibration.md] [--table verify/calibration_tables.json] [--json results.json]
    PYTHONPATH=. .venv/bin/python scripts/calibrate.py --model tiny --prompts 2 --attack-prompts 1  # smoke run

The experiment, each step real (no figure is assumed):
1. Honest workers, one per dtype (fp32, bf16), generate as trainer.rollout does (KV cache,
   ``--rows`` rows of one prompt per batch, seeded Gumbel sampling) and prove their LM-head
   inputs. Submissions are ``--group`` rollouts of one prompt.
2. Validators, one per dtype, recompute every rollout with one prefill and run the whole
   per-rollout check (verify.check.check_rollout: TOPLOC with the paper's thresholds, the
   sampling replay, termination). Rows of equal length are prefilled in one batch.
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
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from verify.calibration import model_fingerprint, tables_to_json
from verify.check import check_rollout
from verify.policy import (AGGREGATE_STATS, SAME_STACK, PairCalibration, StatCalibration, decide,
                           decide_aggregate, exceed_fractions, kl_upper_bound)
from verify.testing import fake_quantize
from verify.toploc import build_proofs

TEMPERATURE = 1.0
BASE_SEED = 1000
TOPICS = ("a robot who learns to paint", "the ocean at night", "a city under snow", "an old lighthouse",
          "a dragon who is afraid of fire", "the first day of school", "a journey to Mars", "a lost key",
          "a garden in spring", "a train that never stops", "a clockmaker's apprentice", "a quiet library",
          "a storm at sea", "a friendly ghost", "a mountain village", "the last tree on Earth")
FORMS = ("Write a short story about {}.", "Write a poem about {}.", "Describe {} in vivid detail.",
         "Write a diary entry about {}.")


# ----------------------------------------------------------------------------- setup


@dataclass
class Setup:
    base: torch.nn.Module            # fp32 weights
    prompts: list[list[int]]         # honest prompts
    attack_prompts: list[list[int]]  # prompts of generated attacks (disjoint from honest ones)
    change_at: dict[tuple[int, ...], int]  # prompt -> the position the changed-prompt attack edits
    eos: int
    vocab: int
    name: str


def chat_prompts(tok, n: int, offset: int) -> tuple[list[list[int]], dict[tuple[int, ...], int]]:
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


def make_setup(model: str, n_prompts: int, n_attack: int) -> Setup:
    if model == "tiny":
        from verify.testing import tiny_model

        base = tiny_model(dtype=torch.float32)
        rng = np.random.default_rng(0)
        all_prompts = [rng.integers(3, 512, size=int(rng.integers(8, 24))).tolist()
                       for _ in range(n_prompts + n_attack)]
        return Setup(base, all_prompts[:n_prompts], all_prompts[n_prompts:],
                     {tuple(p): len(p) // 2 for p in all_prompts}, eos=2, vocab=512, name="tiny")
    from trainer.model import load_model_dir

    base, tok = load_model_dir(model)
    prompts, change = chat_prompts(tok, n_prompts, 0)
    attack, change2 = chat_prompts(tok, n_attack, n_prompts)
    return Setup(base, prompts, attack, {**change, **change2}, eos=int(tok.eos_id),
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


@torch.no_grad()
def generate(model, prompts: list[list[int]], *, rows: int, group: int, tokens: int, eos: int,
             seed_offset: int = 0, temperature: float = TEMPERATURE) -> list[Sub]:
    """``rows`` rows per prompt in one batch (trainer.rollout.generate_rows), cut into
    submissions of ``group``. The claimed seed is BASE_SEED + prompt index; ``seed_offset``
    makes the worker sample with another one."""
    from trainer.rollout import GenerationConfig, generate_rows

    subs = []
    for i, prompt in enumerate(prompts):
        seed = BASE_SEED + i
        outs = generate_rows(model, [prompt] * rows, list(range(rows)), seed=seed + seed_offset, eos_id=eos,
                             config=GenerationConfig(group_size=max(2, rows), max_new_tokens=tokens,
                                                     temperature=temperature))
        for start in range(0, rows, group):
            part = outs[start:start + group]
            subs.append(Sub(prompt, seed, list(range(start, start + len(part))), [o.output_ids for o in part],
                            [build_proofs(o.hidden) for o in part]))
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

    @property
    def chunk_stats(self) -> list[list]:
        return [list(v.chunk_stats) for v in self.verdicts]


def validate(model, subs: list[Sub], *, eos: int, tokens: int, vocab: int) -> list[Checked]:
    out = []
    for sub in subs:
        seqs = [sub.prompt + o for o in sub.outputs]
        results = prefill(model, seqs)
        verdicts = []
        for row, output, proofs, (h, lg) in zip(sub.rows, sub.outputs, sub.proofs, results):
            verdicts.append(check_rollout(lambda ids, h=h, lg=lg: (h, lg), sub.prompt, output, proofs,
                                          seed=sub.seed, row=row, temperature=sub.temperature,
                                          eos_token_id=eos, max_new_tokens=tokens, vocab_size=vocab))
        out.append(Checked(verdicts))
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
        out.append(Sub(p, s.seed, s.rows, s.outputs, s.proofs))
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
        out.append(Sub(s.prompt, s.seed, s.rows, outputs, proofs))
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
        out.append(Sub(s.prompt, s.seed, s.rows, s.outputs, proofs))
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
        o.subs_chunk_rule += rule
        o.subs_aggregate += not agg
        o.subs_either += rule or not agg
        if o.subs_same_stack is not None:
            other = any(set(v.reasons) - {"toploc_exp", "toploc_mant_mean", "toploc_mant_median", "toploc_sign"}
                        for v in c.verdicts)
            tight = any(not decide(v.chunk_stats, SAME_STACK).accepted for v in c.verdicts)
            o.subs_same_stack += other or tight
    return o


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


def main() -> None:
    ap = argparse.ArgumentParser(description="Calibrate the verification policy and measure detection.")
    ap.add_argument("--model", default="tiny", help="a model folder (p2pnet model prepare smollm2), or 'tiny'")
    ap.add_argument("--prompts", type=int, default=16, help="honest prompts (rows/group submissions each)")
    ap.add_argument("--attack-prompts", type=int, default=8, help="prompts per generated attack")
    ap.add_argument("--rows", type=int, default=32, help="rows generated per prompt in one batch")
    ap.add_argument("--group", type=int, default=16, help="rollouts per submission")
    ap.add_argument("--tokens", type=int, default=64, help="max new tokens per rollout")
    ap.add_argument("--quantile", type=float, default=0.9, help="honest per-chunk quantile used as limit")
    ap.add_argument("--delta", type=float, default=0.01, help="1 - confidence of the honest exceed rate")
    ap.add_argument("--alpha", type=float, default=1e-4, help="false-rejection rate of the submission test")
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
    torch.set_num_threads(1)
    t0 = time.time()

    def say(msg: str) -> None:
        print(f"[{time.time() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True)

    setup = make_setup(args.model, args.prompts, args.attack_prompts)
    gen = dict(rows=args.rows, group=args.group, tokens=args.tokens, eos=setup.eos)
    val = dict(eos=setup.eos, tokens=args.tokens, vocab=setup.vocab)
    models = {"fp32": setup.base.eval(), "bf16": in_dtype(setup.base, torch.bfloat16)}

    honest: dict[str, list[Sub]] = {}
    for w, model in models.items():
        honest[w] = generate(model, setup.prompts, **gen)
        say(f"honest {w} worker: {len(honest[w])} submissions, "
            f"{sum(len(p) for s in honest[w] for p in s.proofs)} chunks")
    checked: dict[tuple[str, str], list[Checked]] = {}
    for w in models:
        for v, vmodel in models.items():
            checked[w, v] = validate(vmodel, honest[w], **val)
            say(f"validated {w} worker with {v} validator")

    pairs, held_out = [], []
    for (w, v), cs in checked.items():
        cal = calibrate_pair(w, v, cs[0::2], args.quantile, args.delta)
        pairs.append(cal)
        held_out.append((cal, decide_all(f"honest {w} worker, {v} validator (held out)", cs[1::2], cal, args.alpha),
                         decide_all("all", cs, cal, args.alpha)))
    cal_by = {(p.worker, p.validator): p for p in pairs}
    meta = {"source": "scripts/calibrate.py", "model": setup.name, "model_config": model_fingerprint(setup.base.config),
            "quantile": args.quantile, "delta": args.delta,
            "tokens": args.tokens, "group": args.group, "torch": torch.__version__,
            "prefill_batch": args.prefill_batch}
    if args.table:
        Path(args.table).write_text(tables_to_json(pairs, meta))
        say(f"wrote {args.table}")

    attacks: list[Outcome] = []
    if not args.skip_attacks:
        worker = models["bf16"]
        claimed = cal_by[stack_key("bf16"), stack_key("fp32")]
        check = models["fp32"]
        bf16 = lambda m: m.to(torch.bfloat16).eval()  # noqa: E731
        generated: dict[str, Callable[[], list[Sub]]] = {
            "int8 weights": lambda: generate(fake_quantize(worker, 8), setup.attack_prompts, **gen),
            "int4 weights": lambda: generate(fake_quantize(worker, 4), setup.attack_prompts, **gen),
            "weights + 1% noise": lambda: generate(bf16(noisy(setup.base, 0.01)), setup.attack_prompts, **gen),
            "weights + 5% noise": lambda: generate(bf16(noisy(setup.base, 0.05)), setup.attack_prompts, **gen),
            "another model (random init)": lambda: generate(bf16(random_init(setup.base)), setup.attack_prompts,
                                                           **gen),
            "another sampling seed": lambda: generate(worker, setup.attack_prompts, seed_offset=7, **gen),
            "temperature 0.7 claimed as 1.0": lambda: generate(worker, setup.attack_prompts, temperature=0.7,
                                                               **gen),
        }
        base_subs = honest["bf16"][1::2]  # held-out honest bf16 submissions, edited
        derived: dict[str, Callable[[], list[Sub]]] = {
            "one prompt token changed": lambda: changed_prompt(base_subs, setup),
            "one token per chunk changed, proofs rebuilt": lambda: substituted(base_subs, worker, setup),
            "proofs copied from another rollout": lambda: copied(base_subs),
        }
        for name, make in {**generated, **derived}.items():
            subs = make()
            attacks.append(decide_all(name, validate(check, subs, **val), claimed, args.alpha))
            say(f"attack {name}: {outcome_row(attacks[-1])}")

    report = render(args, setup, pairs, held_out, attacks, time.time() - t0)
    if args.doc:
        Path(args.doc).write_text(report)
        say(f"wrote {args.doc}")
    else:
        print(report)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "meta": meta, "pairs": json.loads(tables_to_json(pairs, meta))["pairs"],
            "outcomes": [vars(o) | {"reasons": sorted(o.reasons)} for _, o, _ in held_out] +
                        [vars(o) | {"reasons": sorted(o.reasons)} for o in attacks]}, indent=1, default=str))


def render(args, setup: Setup, pairs, held_out, attacks, runtime_s: float) -> str:
    cmd = ("PYTHONPATH=. flock /tmp/p2pnet-cpu.lock .venv/bin/python scripts/calibrate.py "
           f"--model {args.model if args.model == 'tiny' else '/tmp/smol/smollm2'} --prompts {args.prompts} "
           f"--attack-prompts {args.attack_prompts} --rows {args.rows} --group {args.group} --tokens {args.tokens} "
           f"--quantile {args.quantile} --delta {args.delta} --alpha {args.alpha} --prefill-batch {args.prefill_batch} "
           "--doc docs/calibration.md --table verify/calibration_tables.json")
    honest_chunks = sum(o.chunks for _, o, _ in held_out)
    honest_fr = sum(o.subs_either for _, o, _ in held_out)
    lines = [TEXT_HEAD.format(cmd=cmd, model=setup.name, runtime=runtime_s / 60, alpha=args.alpha,
                              quantile=args.quantile, delta=args.delta, group=args.group, tokens=args.tokens,
                              rows=args.rows, prefill_batch=args.prefill_batch),
             "## Honest stack pairs (all chunks; calibration figures from the even-numbered half)", "",
             PAIR_HEAD]
    lines += [pair_row(cal, everything) for cal, _, everything in held_out]
    lines += ["", "## Decisions", "",
              "Held-out honest submissions (odd-numbered half) under the table of their own pair; attacks claim "
              "the bf16 worker's stack (bf16/torch/cpu) and are checked by the fp32 validator (fp32/torch/cpu), "
              "as verify.daemon runs.", "", OUTCOME_HEAD]
    lines += [outcome_row(o) for _, o, _ in held_out]
    lines += [outcome_row(o) for o in attacks]
    lines += ["", f"Honest held-out: {honest_fr} of {sum(o.submissions for _, o, _ in held_out)} submissions "
              f"rejected, over {honest_chunks} chunks.", ""]
    lines += targets(held_out, attacks)
    if attacks:
        lines += ["Reason codes seen per attack:", ""]
        lines += [f"* {o.name}: {', '.join(sorted(o.reasons)) or '-'}" for o in attacks]
        lines.append("")
    lines.append(TEXT_TAIL)
    return "\n".join(lines) + "\n"


def targets(held_out, attacks: list[Outcome]) -> list[str]:
    """Issue 14's targets, judged from the figures above (never assumed)."""
    chunks = sum(o.chunks for _, o, _ in held_out)
    fr = sum(o.subs_either for _, o, _ in held_out)
    out = ["## Targets (issue 14), judged from this run", "",
           f"* 0 false rejections over >= 2,000 honest chunks: {fr} rejected over {chunks} held-out chunks: "
           f"{'met' if fr == 0 and chunks >= 2000 else 'NOT met' + ('' if fr == 0 else ' (false rejections)') + ('' if chunks >= 2000 else ' (too few chunks)')}."]
    for o in attacks:
        need = 0.99 if o.name in ("int8 weights", "weights + 1% noise") else 0.999
        rate = o.subs_either / o.submissions if o.submissions else 0.0
        # with n submissions, a rate >= need is only demonstrated when n is large enough to tell
        enough = o.submissions >= math.ceil(1 / (1 - need))
        verdict = ("met" if rate >= need and enough else
                   f"NOT shown (all rejected, but {o.submissions} submissions cannot show {need:.1%})"
                   if rate >= need else "NOT met")
        out.append(f"* {o.name}: {o.subs_either}/{o.submissions} submissions rejected, target {need:.1%}: {verdict}.")
    return out + [""]


TEXT_HEAD = """# Calibration of the verify policy

Generated by `scripts/calibrate.py` (do not edit by hand; rerun it). Command:

    {cmd}

Model: {model}. Runtime {runtime:.1f} min on one thread. Honest workers generate as
`trainer.rollout.generate_rows` does ({rows} rows of one prompt per batch, KV cache, seeded
sampling at temperature 1.0, up to {tokens} new tokens) and prove their LM-head inputs; a
submission is {group} rollouts of one prompt. Validators recompute each rollout in one prefill
({prefill_batch} row(s) of equal length per batch) and run `verify.check.check_rollout` (TOPLOC per chunk with the
paper's thresholds, the sampling replay, termination). Stack keys are dtype/backend/device.

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
