"""Byte compatibility with toploc 0.1.6.

The golden file (tests/verify/data/toploc_golden.json, made by make_toploc_golden.py from
the real package) runs everywhere; the live tests run only where toploc is importable.
The golden inputs have no tie at the top-k boundary; tie-heavy inputs are in
tests/verify/test_toploc_ties.py.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import pytest
import torch

from verify.testing import bf16_test_tensor, boundary_tie_free, perturb_bits
from verify.toploc import build_proofs, measure

pytestmark = pytest.mark.usefixtures("topk_path")  # with and without verify's C module (conftest)

torch.set_num_threads(1)

GOLDEN = json.loads(
    (pathlib.Path(__file__).parent / "data" / "toploc_golden.json").read_text()
)


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: f"{c['tokens']}x{c['hidden']}")
def test_golden_proofs_match_toploc(case):
    hidden = bf16_test_tensor(case["seed"], case["tokens"], case["hidden"])
    digest = hashlib.sha256(hidden.view(torch.int16).numpy().tobytes()).hexdigest()
    assert digest == case["input_sha256"], "test-input generator drifted"
    assert [p.hex() for p in build_proofs(hidden)] == case["proofs_hex"]


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: f"{c['tokens']}x{c['hidden']}")
def test_golden_measure_matches_toploc(case):
    hidden = bf16_test_tensor(case["seed"], case["tokens"], case["hidden"])
    perturbed = perturb_bits(hidden, case["perturb_seed"])
    proofs = [bytes.fromhex(h) for h in case["proofs_hex"]]
    ours = [[s.exp_mismatches, s.mant_err_mean, s.mant_err_median]
            for s in measure(perturbed, proofs)]
    assert ours == case["perturbed_results"]


def _live_cases():
    out, seed = [], 100
    while len(out) < 4:
        x = bf16_test_tensor(seed, 45, 384)
        if boundary_tie_free(x):
            out.append(x)
        seed += 1
    return out


def test_live_bytes_equal_and_cross_acceptance():
    toploc = pytest.importorskip("toploc")
    for hidden in _live_cases():
        rows = [hidden[i : i + 1] for i in range(hidden.shape[0])]
        theirs = toploc.build_proofs_bytes(rows, 32, 128, skip_prefill=True)
        ours = build_proofs(hidden)
        assert ours == theirs
        their_view = toploc.verify_proofs_bytes(hidden, ours, 32, 128, skip_prefill=True)
        assert [r.exp_mismatches for r in their_view] == [0] * len(ours)
        assert all(s.exp_mismatches == 0 for s in measure(hidden, theirs))


def test_live_ties_byte_equal_and_exact_cross_verification():
    """With ties at the boundary both sides still pick the same set: equal bytes, and each
    side verifies the other's proofs with zero error."""
    toploc = pytest.importorskip("toploc")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(70, 512, generator=g).to(torch.bfloat16)
    theirs = toploc.build_proofs_bytes([hidden[i : i + 1] for i in range(70)], 32, 128,
                                       skip_prefill=True)
    ours = build_proofs(hidden)
    assert ours == theirs
    results = toploc.verify_proofs_bytes(hidden, ours, 32, 128, skip_prefill=True)
    assert [r.exp_mismatches for r in results] == [0] * len(ours)
    assert all(s.exp_mismatches == 0 and s.mant_err_mean == 0 for s in measure(hidden, theirs))
