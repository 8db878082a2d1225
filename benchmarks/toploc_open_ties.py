"""How much the open-tie measure (verify.toploc.measure(..., exact_ties=False)) differs from torch's choice.

    PYTHONPATH=. .venv/bin/python benchmarks/toploc_open_ties.py

On honest proofs both measure 0. On perturbed copies (``verify.testing.perturb_bits``, a stand-in
for another stack's hidden states) of tie-heavy inputs, prints per input: chunks, chunks whose
statistics differ, the mean exponent mismatches and mean mantissa error per chunk with open ties
and with torch's choice (``exact_ties=True``), the largest drop in exponent mismatches, and the
chunks where open ties gave more exponent mismatches (the rule makes that impossible: 0).
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch

from verify.testing import bf16_gaussian, perturb_bits
from verify.toploc import build_proofs, measure

FIXTURE = pathlib.Path(__file__).parent.parent / "tests" / "fixtures" / "smollm2_hidden.npz"


def compare(name: str, hidden: torch.Tensor, seed: int = 5) -> None:
    proofs = build_proofs(hidden)
    perturbed = perturb_bits(hidden, seed)
    open_ties = measure(perturbed, proofs, exact_ties=False)
    exact = measure(perturbed, proofs, exact_ties=True)
    eo = np.array([s.exp_mismatches for s in open_ties])
    ee = np.array([s.exp_mismatches for s in exact])
    mo = np.array([s.mant_err_mean for s in open_ties])
    me = np.array([s.mant_err_mean for s in exact])
    print(f"{name}: chunks {len(open_ties)}, differing {sum(a != b for a, b in zip(open_ties, exact))}, "
          f"exp mean open {eo.mean():.3f} exact {ee.mean():.3f}, mant mean open {mo.mean():.4f} "
          f"exact {me.mean():.4f}, max exp drop {(ee - eo).max()}, open > exact exp {(eo > ee).sum()}")


def main() -> None:
    torch.set_num_threads(1)
    compare("normal, hidden 576", bf16_gaussian(1, 32 * 256, 576))
    compare("normal, hidden 2048", bf16_gaussian(2, 32 * 64, 2048))
    compare("massive channels, hidden 896", bf16_gaussian(3, 32 * 128, 896, massive_channels=8))
    stored = np.load(FIXTURE)
    real = np.concatenate([stored["rollout0"], stored["rollout1"]]).view(np.int16).copy()
    compare("SmolLM2-135M last hidden states", torch.from_numpy(real).view(torch.bfloat16))


if __name__ == "__main__":
    main()
