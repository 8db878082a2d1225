"""The calibration experiment's workers and validators (scripts/calibrate.py runs them).

Owns the prompts (``FORMS`` x ``TOPICS`` for a real model, seeded random ids for the tiny
one), the honest and attacking workers' models (dtype copies, weight noise, another random
init), generation as trainer.rollout does it, split into submissions (``Sub``), the
validator's prefill and per-rollout check (``Checked``), the attacks built by editing honest
submissions, and the catalogue of attacks (``ATTACKS``). It measures; it does not calibrate,
decide or write anything (scripts/calibration_stats.py, scripts/calibration_report.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from verify.check import Forward, check_rollout
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


@torch.no_grad()
def prefill(model, sequences: list[list[int]], *, batch: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(hidden bf16 [T, H], logits fp32 [T, V]) per sequence; up to `batch` sequences of equal
    length share a forward pass (--prefill-batch; verify.daemon prefills one row at a time)."""
    out: list = [None] * len(sequences)
    by_len: dict[int, list[int]] = {}
    for i, s in enumerate(sequences):
        by_len.setdefault(len(s), []).append(i)
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


def prefilled(hidden: torch.Tensor, logits: torch.Tensor) -> Forward:
    """A forward that answers with one sequence's states, computed earlier in a batched prefill."""
    return lambda ids: (hidden, logits)


def validate(model, subs: list[Sub], *, eos: int, tokens: int, vocab: int, exact_ties: bool = True,
             batch: int = 1) -> list[Checked]:
    out = []
    for sub in subs:
        seqs = [sub.prompt + o for o in sub.outputs]
        results = prefill(model, seqs, batch=batch)
        verdicts = []
        for row, output, proofs, (h, lg) in zip(sub.rows, sub.outputs, sub.proofs, results):
            verdicts.append(check_rollout(prefilled(h, lg), sub.prompt, output, proofs,
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


def substituted(subs: list[Sub], worker, setup: Setup, *, batch: int = 1) -> list[Sub]:
    """One generated token per 32-token chunk changed (position 10 of each chunk, never the
    last token); proofs rebuilt from the worker's own prefill of the changed sequence (`batch`
    as in `prefill`)."""
    out = []
    for s in subs:
        outputs = []
        for o in s.outputs:
            o2 = list(o)
            for at in range(10, len(o2) - 1, 32):
                o2[at] = bump(o2[at], setup.vocab)
            outputs.append(o2)
        hidden = prefill(worker, [s.prompt + o for o in outputs], batch=batch)
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


# ----------------------------------------------------------------------------- the attack catalogue


ATTACKS = {"int8": "int8 weights", "int4": "int4 weights", "noise1": "weights + 1% noise",
           "noise5": "weights + 5% noise", "random": "another model (random init)",
           "seed": "another sampling seed", "temp": "temperature 0.7 claimed as 1.0",
           "prompt": "one prompt token changed", "subst": "one token per chunk changed, proofs rebuilt",
           "copied": "proofs copied from another rollout"}
