"""Calibrate TOPLOC thresholds and the sampling margin, on the tiny Llama or a real model folder.

    PYTHONPATH=. .venv/bin/python scripts/calibrate.py [--rollouts 8] [--tokens 96]
    PYTHONPATH=. .venv/bin/python scripts/calibrate.py --model /tmp/smol/smollm2 --rollouts 4 --tokens 64

Without ``--model``: the tiny random-init Llama of verify/testing.py and random-token prompts.
With ``--model PATH`` (a trainer.model folder, e.g. SmolLM2-135M-Instruct from
``p2pnet model prepare smollm2``): its weights and tokenizer, and chat-formatted open-ended
prompts so that rollouts run to the token limit.

Honest runs: a bf16 worker decodes token by token with a KV cache (batch 1, one thread,
eager attention) and proves the LM-head inputs; validators recompute in one prefill under
varied conditions (batch 1/4, 1/2 threads, eager/sdpa attention, bf16/fp32 weights). With
``--model`` the fp32 validators use the folder's own fp32 weights (the worker's bf16 weights
are a rounding of them), and one more block measures the devnet's own setting: an fp32 worker
generating a group of rows in one batch (trainer.rollout.generate_rows) against fp32 and bf16
validators.
Attacks: another model (tiny: another init seed; --model: a copy with Gaussian noise of
``--noise`` times each tensor's std), int8 and int4 fake-quantized weights, another sampling
seed, a changed prompt token, a changed generated token, a truncated output, fabricated
proofs, proofs copied from another rollout. For each condition the script prints the worst
chunk statistics (honest: maximum over all chunks; attack: the per-rollout maximum, then the
minimum of that over rollouts, i.e. the attack's best case), the range of the mantissa mean
over every chunk (where a separation from honest noise shows), the largest sampling deficit,
and how many rollouts ``check_rollout`` accepted under the default thresholds.
Prints a markdown table; docs/calibration.md holds a copy and the reasoning.
"""

from __future__ import annotations

import argparse
import copy
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from verify.check import check_rollout
from verify.policy import Thresholds
from verify.sampling import replay_check
from verify.testing import TinyModelConfig, fake_quantize, generate, make_forward, tiny_model
from verify.toploc import PRIME, build_proofs, encode_proof

TEMPERATURE = 1.0
SEED = 7
CHAT_PROMPTS = (
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works.",
    "Give me three tips for learning a new language.",
    "Describe the city of Paris to someone who has never been there.",
    "What are the benefits of regular exercise?",
    "Write a poem about the ocean.",
    "How does a computer store numbers?",
    "Summarize the plot of a detective novel of your choice.",
)


def perturbed(model, rel_std: float, seed: int = 1):
    """A copy with N(0, (rel_std * std(tensor))^2) added to every weight: "another model"."""
    p = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in p.parameters():  # tied tensors are visited once
            w = param.float()
            noise = torch.randn(w.shape, generator=gen) * (rel_std * float(w.std()))
            param.copy_(w + noise)
    return p


def variant(model, dtype, attn: str):
    """A copy of ``model`` in ``dtype`` with attention implementation ``attn``."""
    m = copy.deepcopy(model).to(dtype)
    m.set_attn_implementation(attn)
    return m.eval()


def batched_forward(model, batch: int, threads: int):
    """A validator forward that runs ``batch`` copies of the sequence and ``threads`` threads."""
    @torch.no_grad()
    def forward(ids):
        torch.set_num_threads(threads)
        try:
            x = torch.tensor([list(ids)] * batch, dtype=torch.long)
            h = model.model(input_ids=x, use_cache=False).last_hidden_state
            return h[0].to(torch.bfloat16), model.lm_head(h[0]).float()
        finally:
            torch.set_num_threads(1)
    return forward


def summarize(name, verdicts, honest: bool):
    per = []
    for v in verdicts:
        if not v.chunk_stats:
            per.append((0, 0.0, 0.0, 0))
            continue
        per.append((max(s.exp_mismatches for s in v.chunk_stats),
                    max(s.mant_err_mean for s in v.chunk_stats),
                    max(s.mant_err_median for s in v.chunk_stats),
                    max(s.sign_mismatches for s in v.chunk_stats)))
    arr = np.array(per, dtype=np.float64)
    worst = arr.max(axis=0) if honest else arr.min(axis=0)
    deficits = [v.sampling.max_deficit for v in verdicts if v.sampling is not None]
    reasons = sorted({r for v in verdicts for r in v.reasons})
    accepted = sum(v.accepted for v in verdicts)
    means = [s.mant_err_mean for v in verdicts for s in v.chunk_stats]
    spread = f"{min(means):.2f}-{max(means):.2f}" if means else "-"
    # honest: the largest deficit anywhere; attack: its best rollout's largest deficit
    dmax = (max(deficits) if honest else min(deficits)) if deficits else float("nan")
    return (f"| {name} | {worst[0]:.0f} | {worst[1]:.2f} | {worst[2]:.1f} | {worst[3]:.0f} | "
            f"{spread} | {dmax:.3f} | {accepted}/{len(verdicts)} | {', '.join(reasons) or '-'} |")


@dataclass
class Setup:
    """What differs between the tiny model and a real model folder."""

    worker: torch.nn.Module             # bf16, eager: the honest worker
    base: torch.nn.Module               # the reference weights fp32 validators use
    prompts: list[list[int]]
    change_at: list[int]                # per prompt: the position the changed-prompt attack edits
    eos: int
    vocab: int
    other_models: dict[str, Callable[[], torch.nn.Module]]
    devnet_block: bool                  # also measure the devnet's fp32 batched worker


def tiny_setup(n: int) -> Setup:
    worker = tiny_model(dtype=torch.bfloat16)
    # fp32 validators: the worker's (bf16-rounded) weights in a model built in fp32, so
    # non-persistent buffers such as the rotary inv_freq stay exact fp32
    base = tiny_model(dtype=torch.float32)
    base.load_state_dict({k: v.float() for k, v in worker.state_dict().items()})
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, size=int(rng.integers(8, 40))).tolist() for _ in range(n)]
    return Setup(worker=worker, base=base, prompts=prompts, change_at=[len(p) // 2 for p in prompts],
                 eos=2, vocab=512, devnet_block=False,
                 other_models={"another model (other init seed)":
                               lambda: tiny_model(TinyModelConfig(seed=1), dtype=torch.bfloat16)})


def folder_setup(path: str, n: int, noise: list[float]) -> Setup:
    from trainer.model import load_model_dir

    base, tok = load_model_dir(path)  # fp32 as saved
    base.set_attn_implementation("eager")
    worker = variant(base, torch.bfloat16, "eager")
    prompts, change_at = [], []
    for text in (CHAT_PROMPTS * (n // len(CHAT_PROMPTS) + 1))[:n]:
        ids = tok.hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
        ids = [int(i) for i in ids]
        n_user = len(tok.encode(text))
        # the template ends <|im_end|> \n <|im_start|> assistant \n: edit the middle of the user text
        prompts.append(ids)
        change_at.append(len(ids) - 5 - (n_user + 1) // 2)
    others = {f"another model (weights + {100 * s:g}% Gaussian noise)":
              (lambda s=s: perturbed(base, s).to(torch.bfloat16)) for s in noise}
    return Setup(worker=worker, base=base, prompts=prompts, change_at=change_at, eos=tok.eos_id,
                 vocab=int(base.config.vocab_size), other_models=others, devnet_block=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a model folder (trainer.model format); default: tiny")
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--noise", type=float, nargs="*", default=[0.01],
                    help="--model only: relative noise levels of the 'another model' attack")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    setup = folder_setup(args.model, args.rollouts, args.noise) if args.model else tiny_setup(args.rollouts)
    worker, eos, vocab, prompts = setup.worker, setup.eos, setup.vocab, setup.prompts

    def bump(token: int) -> int:  # another token id, never a special one below 3
        return 3 + (token - 2) % (vocab - 3)

    def rollouts(model, seed=SEED):
        out = []
        for row, prompt in enumerate(prompts):
            g = generate(model, prompt, seed=seed, row=row, max_new_tokens=args.tokens,
                         temperature=TEMPERATURE, eos_token_id=eos)
            out.append((prompt, g.output_ids, build_proofs(g.hidden)))
        return out

    honest = rollouts(worker)
    ref_fwd = make_forward(worker)
    n_tok = sum(len(o) for _, o, _ in honest)
    print(f"# honest rollouts: {len(honest)}, {n_tok} tokens, "
          f"{sum(len(pr) for _, _, pr in honest)} chunks ({time.time() - t0:.0f} s)", flush=True)

    def check_all(items, fwd=ref_fwd, seed=SEED):
        return [check_rollout(fwd, p, o, pr, seed=seed, row=row, temperature=TEMPERATURE,
                              eos_token_id=eos, max_new_tokens=args.tokens)
                for row, (p, o, pr) in enumerate(items)]

    header = ("| condition | exp mismatches | mant mean | mant median | sign | mant mean, all chunks | "
              "max sampling deficit | accepted | reasons |\n|---|---|---|---|---|---|---|---|---|")
    lines = ["**Honest** (worst chunk over all rollouts)", "", header]
    validators: dict[str, Callable[[], Callable]] = {
        "bf16, batch 1, 1 thread, eager (as worker)": lambda: ref_fwd,
        "bf16, batch 4": lambda: batched_forward(worker, 4, 1),
        "bf16, 2 threads": lambda: batched_forward(worker, 1, 2),
        "bf16, batch 4, 2 threads": lambda: batched_forward(worker, 4, 2),
        "bf16, sdpa": lambda: make_forward(variant(worker, torch.bfloat16, "sdpa")),
        "fp32 validator, eager": lambda: make_forward(variant(setup.base, torch.float32, "eager")),
        "fp32 validator, sdpa, batch 4": lambda: batched_forward(
            variant(setup.base, torch.float32, "sdpa"), 4, 1),
    }
    noisiest = None
    for name, make in validators.items():
        fwd = make()
        lines.append(summarize(name, check_all(honest, fwd), honest=True))
        if name.startswith("fp32 validator, sdpa"):
            noisiest = fwd
        print(lines[-1], flush=True)
    gc.collect()

    if setup.devnet_block:
        lines += _devnet_block(setup, args.tokens, header)
        print("\n".join(lines[-6:]), flush=True)

    lines += ["", "**Attacks** (each statistic: the attack's best rollout)", "", header]
    attacks: dict[str, Callable[[], list]] = {
        name: (lambda make=make: rollouts(make())) for name, make in setup.other_models.items()}
    attacks.update({
        "int8 weights (fake quant)": lambda: rollouts(fake_quantize(worker, 8)),
        "int4 weights (fake quant)": lambda: rollouts(fake_quantize(worker, 4)),
        "another sampling seed": lambda: rollouts(worker, seed=SEED + 1),
    })
    changed_prompt, changed_token, truncated, fabricated, copied = [], [], [], [], []
    for i, (p, o, pr) in enumerate(honest):
        q = list(p)
        q[setup.change_at[i]] = bump(q[setup.change_at[i]])
        changed_prompt.append((q, o, pr))
        o2 = list(o)
        j = min(10, len(o2) - 2)
        o2[j] = bump(o2[j])
        changed_token.append((p, o2, pr))
        cut = max(1, len(o) - 20)
        truncated.append((p, o[:cut], build_proofs(ref_fwd(p + o)[0][len(p) - 1:len(p) - 1 + cut])))
        frng = np.random.default_rng(i)
        fabricated.append((p, o, [encode_proof(PRIME, frng.integers(0, PRIME, 128))
                                  if len(x) == 258 else x for x in pr]))
        donor = honest[(i + 1) % len(honest)][2]
        copied.append((p, o, (donor * 4)[: len(pr)]))
    attacks.update({
        "changed prompt token": lambda: changed_prompt,
        "changed generated token (position 10)": lambda: changed_token,
        "truncated output (last 20 tokens dropped)": lambda: truncated,
        "fabricated proofs (random coefficients)": lambda: fabricated,
        "proofs copied from another rollout": lambda: copied,
    })
    for name, make in attacks.items():
        lines.append(summarize(name, check_all(make()), honest=False))
        print(lines[-1], flush=True)
        gc.collect()

    # Sampling margin: honest deficits under the noisiest validator vs a substituted token.
    honest_def, sub_def = [], []
    for row, (p, o, _) in enumerate(honest):
        logits = noisiest(p + o)[1][len(p) - 1:len(p) - 1 + len(o)]
        honest_def.append(replay_check(logits, o, seed=SEED, row=row,
                                       temperature=TEMPERATURE).max_deficit)
        for j in range(0, len(o), 7):
            o2 = list(o)
            o2[j] = bump(o2[j])
            rep = replay_check(logits, o2, seed=SEED, row=row, temperature=TEMPERATURE)
            sub_def.append(rep.max_deficit)  # = the deficit at j: the rest is honest
    lines += ["", f"sampling deficit: honest max {max(honest_def):.4f}; "
              f"one substituted token: min {min(sub_def):.3f}, median {float(np.median(sub_def)):.3f}",
              "", f"thresholds: {Thresholds()}", f"runtime {time.time() - t0:.0f} s"]
    print("\n".join(lines))


def _devnet_block(setup: Setup, tokens: int, header: str) -> list[str]:
    """The devnet's setting: an fp32 sdpa worker samples a group of rows of one prompt in one
    batch (trainer.rollout.generate_rows, as WorkerRole does); validators prefill one row."""
    from trainer.rollout import GenerationConfig, generate_rows

    worker = variant(setup.base, torch.float32, "sdpa")
    prompt, group = setup.prompts[0], 4
    outs = generate_rows(worker, [prompt] * group, list(range(group)), seed=SEED, eos_id=setup.eos,
                         config=GenerationConfig(group_size=group, max_new_tokens=tokens,
                                                 temperature=TEMPERATURE))
    items = [(prompt, o.output_ids, build_proofs(o.hidden)) for o in outs]
    lines = ["", f"**Honest, devnet setting** (fp32 sdpa worker, {group} rows of one prompt in one batch "
             "with trainer.rollout.generate_rows; worst chunk)", "", header]
    for name, fwd in {
        "fp32 sdpa validator, batch 1 (as verify.daemon)": make_forward(worker),
        "fp32 eager validator": make_forward(variant(setup.base, torch.float32, "eager")),
        "bf16 eager validator": make_forward(setup.worker),
    }.items():
        verdicts = [check_rollout(fwd, p, o, pr, seed=SEED, row=row, temperature=TEMPERATURE,
                                  eos_token_id=setup.eos, max_new_tokens=tokens)
                    for row, (p, o, pr) in enumerate(items)]
        lines.append(summarize(name, verdicts, honest=True))
    return lines


if __name__ == "__main__":
    main()
