"""Calibrate TOPLOC thresholds and the sampling margin on a tiny random-init Llama.

    PYTHONPATH=. .venv/bin/python scripts/calibrate.py [--rollouts 8] [--tokens 96]

Honest runs: a bf16 worker decodes token by token with a KV cache (batch 1, one thread,
eager attention) and proves the LM-head inputs; validators recompute in one prefill under
varied conditions (batch 1/4, 1/2 threads, eager/sdpa attention, bf16/fp32 weights).
Attacks: another model, int8 and int4 fake-quantized weights, another sampling seed, a
changed prompt token, a changed generated token, a truncated output, fabricated proofs,
proofs copied from another rollout. For each condition the script prints the worst chunk
statistics (honest: maximum over all chunks; attack: the per-rollout maximum, then the
minimum of that over rollouts, i.e. the attack's best case), the largest sampling deficit,
and how many rollouts ``check_rollout`` accepted under the default thresholds.
Prints a markdown table; docs/calibration.md holds a copy and the reasoning.
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np
import torch

from verify.check import check_rollout
from verify.policy import Thresholds
from verify.sampling import replay_check
from verify.testing import TinyModelConfig, generate, make_forward, tiny_model
from verify.toploc import PRIME, build_proofs, encode_proof

EOS = 2
TEMPERATURE = 1.0


def fake_quantize(model, bits: int):
    """Symmetric per-output-channel round-to-nearest of every Linear weight (not the norms)."""
    q = copy.deepcopy(model)
    levels = (1 << (bits - 1)) - 1
    with torch.no_grad():
        for mod in q.modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight.float()
                scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / levels
                mod.weight.copy_((w / scale).round().clamp(-levels, levels) * scale)
    return q


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


def retyped(model, dtype, attn: str):
    m = tiny_model(TinyModelConfig(attn_implementation=attn), dtype=dtype)
    m.load_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()})
    return m.eval()


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
    # honest: the largest deficit anywhere; attack: its best rollout's largest deficit
    dmax = (max(deficits) if honest else min(deficits)) if deficits else float("nan")
    return (f"| {name} | {worst[0]:.0f} | {worst[1]:.2f} | {worst[2]:.1f} | {worst[3]:.0f} | "
            f"{dmax:.3f} | {accepted}/{len(verdicts)} | {', '.join(reasons) or '-'} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    worker = tiny_model(dtype=torch.bfloat16)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, size=int(rng.integers(8, 40))).tolist()
               for _ in range(args.rollouts)]

    def rollouts(model, seed=7):
        out = []
        for row, prompt in enumerate(prompts):
            g = generate(model, prompt, seed=seed, row=row, max_new_tokens=args.tokens,
                         temperature=TEMPERATURE, eos_token_id=EOS)
            out.append((prompt, g.output_ids, build_proofs(g.hidden)))
        return out

    honest = rollouts(worker)
    ref_fwd = make_forward(worker)

    def check_all(items, fwd=ref_fwd):
        return [check_rollout(fwd, p, o, pr, seed=7, row=row, temperature=TEMPERATURE,
                              eos_token_id=EOS, max_new_tokens=args.tokens)
                for row, (p, o, pr) in enumerate(items)]

    header = ("| condition | exp mismatches | mant mean | mant median | sign | "
              "max sampling deficit | accepted | reasons |\n|---|---|---|---|---|---|---|---|")
    lines = ["**Honest** (worst chunk over all rollouts)", "", header]
    validators = {
        "bf16, batch 1, 1 thread, eager (as worker)": ref_fwd,
        "bf16, batch 4": batched_forward(worker, 4, 1),
        "bf16, 2 threads": batched_forward(worker, 1, 2),
        "bf16, batch 4, 2 threads": batched_forward(worker, 4, 2),
        "bf16, sdpa": make_forward(retyped(worker, torch.bfloat16, "sdpa")),
        "fp32 validator, eager": make_forward(retyped(worker, torch.float32, "eager")),
        "fp32 validator, sdpa, batch 4": batched_forward(
            retyped(worker, torch.float32, "sdpa"), 4, 1),
    }
    for name, fwd in validators.items():
        lines.append(summarize(name, check_all(honest, fwd), honest=True))

    lines += ["", "**Attacks** (each statistic: the attack's best rollout)", "", header]
    other = tiny_model(TinyModelConfig(seed=1), dtype=torch.bfloat16)
    attacks = {
        "another model (other init seed)": rollouts(other),
        "int8 weights (fake quant)": rollouts(fake_quantize(worker, 8)),
        "int4 weights (fake quant)": rollouts(fake_quantize(worker, 4)),
        "another sampling seed": rollouts(worker, seed=8),
    }
    changed_prompt, changed_token, truncated, fabricated, copied = [], [], [], [], []
    for i, (p, o, pr) in enumerate(honest):
        q = list(p)
        q[len(q) // 2] = 3 + (q[len(q) // 2] - 2) % 509
        changed_prompt.append((q, o, pr))
        o2 = list(o)
        j = min(10, len(o2) - 2)
        o2[j] = 3 + (o2[j] - 2) % 509
        changed_token.append((p, o2, pr))
        cut = max(1, len(o) - 20)
        truncated.append((p, o[:cut], build_proofs(ref_fwd(p + o)[0][len(p) - 1:len(p) - 1 + cut])))
        frng = np.random.default_rng(i)
        fabricated.append((p, o, [encode_proof(PRIME, frng.integers(0, PRIME, 128))
                                  if len(x) == 258 else x for x in pr]))
        donor = honest[(i + 1) % len(honest)][2]
        copied.append((p, o, (donor * 4)[: len(pr)]))
    attacks.update({
        "changed prompt token": changed_prompt,
        "changed generated token (position 10)": changed_token,
        "truncated output (last 20 tokens dropped)": truncated,
        "fabricated proofs (random coefficients)": fabricated,
        "proofs copied from another rollout": copied,
    })
    for name, items in attacks.items():
        lines.append(summarize(name, check_all(items), honest=False))

    # Sampling margin: honest deficits under the noisiest validator vs a substituted token.
    fwd = validators["fp32 validator, sdpa, batch 4"]
    honest_def, sub_def = [], []
    for row, (p, o, _) in enumerate(honest):
        logits = fwd(p + o)[1][len(p) - 1:len(p) - 1 + len(o)]
        honest_def.append(replay_check(logits, o, seed=7, row=row,
                                       temperature=TEMPERATURE).max_deficit)
        for j in range(0, len(o), 7):
            o2 = list(o)
            o2[j] = 3 + (o2[j] - 2) % 509
            rep = replay_check(logits, o2, seed=7, row=row, temperature=TEMPERATURE)
            sub_def.append(rep.max_deficit)  # = the deficit at j: the rest is honest
    lines += ["", f"sampling deficit: honest max {max(honest_def):.4f}; "
              f"one substituted token: min {min(sub_def):.3f}, median {float(np.median(sub_def)):.3f}",
              "", f"thresholds: {Thresholds()}", f"runtime {time.time() - t0:.0f} s"]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
