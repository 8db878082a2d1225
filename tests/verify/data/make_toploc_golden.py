"""Regenerate toploc_golden.json from the real toploc 0.1.6 (run by hand, not by pytest).

    PYTHONPATH=. .venv/bin/python tests/verify/data/make_toploc_golden.py

Inputs come from verify.testing.bf16_test_tensor (Philox bits, platform-independent); only
seeds whose chunks have no tie at the top-k boundary are kept, so the top-k set is unique
and byte equality is well defined. For each case the file stores toploc's proofs and
toploc's verification results against a bit-perturbed copy of the input.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import torch

import toploc
from verify.testing import bf16_test_tensor, boundary_tie_free, perturb_bits

SHAPES = [(70, 256), (32, 512), (5, 256), (64, 896)]


def main() -> None:
    torch.set_num_threads(1)
    cases = []
    seed = 1
    for tokens, hidden in SHAPES:
        while True:
            x = bf16_test_tensor(seed, tokens, hidden)
            y = perturb_bits(x, seed + 1000)
            seed += 1
            if boundary_tie_free(x) and boundary_tie_free(y):
                break
        proofs = toploc.build_proofs_bytes(
            [x[i : i + 1] for i in range(tokens)], 32, 128, skip_prefill=True
        )
        results = toploc.verify_proofs_bytes(y, proofs, 32, 128, skip_prefill=True)
        cases.append({
            "seed": seed - 1,
            "tokens": tokens,
            "hidden": hidden,
            "input_sha256": hashlib.sha256(x.view(torch.int16).numpy().tobytes()).hexdigest(),
            "perturb_seed": seed - 1 + 1000,
            "proofs_hex": [p.hex() for p in proofs],
            "perturbed_results": [
                [r.exp_mismatches, r.mant_err_mean, r.mant_err_median] for r in results
            ],
        })
    out = {"toploc_version": toploc.__version__, "chunk_tokens": 32, "topk": 128, "cases": cases}
    path = pathlib.Path(__file__).with_name("toploc_golden.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
