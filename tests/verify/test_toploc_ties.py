"""Byte equality with toploc 0.1.6 where ties decide the top-k set (tests/fixtures/toploc_ties.json).

toploc takes ``flat.abs().topk(128)``; which of several equal |values| at the 128th place it
keeps is decided by torch's CPU kernel. The fixture was made by the real toploc
(tests/fixtures/make_toploc_ties.py) on tie-heavy inputs: normal hidden states at hidden 4096,
heavy-tailed ones, massive channels, a coarse grid, and real SmolLM2-135M last hidden states.
Every chunk's proof must be byte-equal, and measuring a perturbed copy with ``exact_ties``
(torch's choice among tied entries, as toploc's verify) must give toploc's numbers (the default
tie-set measure is tests/verify/test_toploc_tie_sets.py).
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np
import pytest
import torch

from verify.testing import bf16_gaussian, boundary_tie_free, perturb_bits
from verify.topk import _group_maxima, _heap_topk
from verify.topk import topk_chunks as _topk
from verify.toploc import build_proofs, build_proofs_many, measure

pytestmark = pytest.mark.usefixtures("topk_path")  # with and without verify's C module (conftest)

torch.set_num_threads(1)

FIXTURES = pathlib.Path(__file__).parent.parent / "fixtures"
GOLDEN = json.loads((FIXTURES / "toploc_ties.json").read_text())


def _load(name: str) -> torch.Tensor:
    if name.startswith("smollm2_"):
        stored = np.load(FIXTURES / "smollm2_hidden.npz")[name.removeprefix("smollm2_")]
        return torch.from_numpy(stored.view(np.int16).copy()).view(torch.bfloat16)
    import importlib.util

    spec = importlib.util.spec_from_file_location("maker", FIXTURES / "make_toploc_ties.py")
    maker = importlib.util.module_from_spec(spec)
    source = (FIXTURES / "make_toploc_ties.py").read_text().replace("import toploc\n", "")
    exec(compile(source, str(spec.origin), "exec"), maker.__dict__)
    return maker.synthetic_cases()[name]


CASES = {c["name"]: c for c in GOLDEN["cases"]}


@pytest.fixture(scope="module")
def inputs():
    return {name: _load(name) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_every_chunk_byte_equal_to_toploc(name, inputs):
    case, hidden = CASES[name], inputs[name]
    digest = hashlib.sha256(hidden.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()
    assert digest == case["input_sha256"], "fixture input drifted"
    assert [p.hex() for p in build_proofs(hidden)] == case["proofs_hex"]
    # each chunk proven alone, as a worker proving while it generates (another selection path)
    alone = [build_proofs(hidden[i : i + 32])[0].hex() for i in range(0, hidden.shape[0], 32)]
    assert alone == case["proofs_hex"]


@pytest.mark.parametrize("name", list(CASES))
def test_measure_matches_toploc_on_perturbed_copy(name, inputs):
    case = CASES[name]
    perturbed = perturb_bits(inputs[name], case["perturb_seed"])
    proofs = [bytes.fromhex(h) for h in case["proofs_hex"]]
    ours = [(s.exp_mismatches, s.mant_err_mean, s.mant_err_median)
            for s in measure(perturbed, proofs, exact_ties=True)]
    theirs = case["perturbed_results"]
    assert [o[0] for o in ours] == [t[0] for t in theirs]
    assert np.allclose([o[1:] for o in ours], [t[1:] for t in theirs], rtol=1e-12, atol=0)


def test_fixture_is_tie_heavy(inputs):
    """Most chunks have a tie at the 128th place: the cases test tie breaking, not luck."""
    tied = total = 0
    for hidden in inputs.values():
        for start in range(0, hidden.shape[0], 32):
            total += 1
            tied += not boundary_tie_free(hidden[start : start + 32])
    assert tied >= total * 2 // 3


@pytest.mark.parametrize("hidden_size", [256, 576, 4096])
def test_batched_selection_is_torch_topk_per_chunk(hidden_size):
    """Many chunks selected at once pick, chunk by chunk, what torch.topk picks alone."""
    hidden = bf16_gaussian(hidden_size, 32 * 12 + 5, hidden_size, massive_channels=hidden_size // 256)
    for first_row, count, rows in ((0, 12, 32), (384, 1, 5)):
        idx, _ = _topk(hidden, first_row, count, rows, 128)
        for c in range(count):
            flat = hidden[first_row + c * rows : first_row + (c + 1) * rows].reshape(-1)
            expected = flat.abs().topk(128).indices.numpy()
            assert sorted(idx[c].tolist()) == sorted(expected.tolist())


def test_live_toploc_random_ties():
    toploc = pytest.importorskip("toploc")
    for seed in range(3):
        hidden = bf16_gaussian(100 + seed, 130, 4096)
        theirs = toploc.build_proofs_bytes([hidden[i : i + 1] for i in range(130)], 32, 128, skip_prefill=True)
        assert build_proofs(hidden) == theirs


def _abs_keys(hidden: torch.Tensor, rows: int) -> np.ndarray:
    return hidden.reshape(-1, rows * hidden.shape[1]).view(torch.int16).numpy().view(np.uint16) & np.uint16(0x7FFF)


@pytest.mark.parametrize("hidden_size,rows", [(576, 32), (1000, 32), (1000, 20), (4096, 32), (5120, 7)])
def test_heap_replay_picks_what_torch_topk_picks(hidden_size, rows):
    """_heap_topk runs torch.topk on a short subsequence; on inputs where most chunks have many
    equal |values| at the 128th place (coarse grids, heavy tails) it must pick torch's set."""
    gen = torch.Generator().manual_seed(hidden_size + rows)
    normal = torch.randn(6 * rows, hidden_size, generator=gen)
    for hidden in ((normal * 4).round().to(torch.bfloat16), (normal**3).to(torch.bfloat16),
                   normal.to(torch.bfloat16)):
        keys = _abs_keys(hidden, rows)
        expected = torch.from_numpy(keys.view(np.int16)).view(torch.bfloat16).topk(128, dim=1).indices.numpy()
        padded = np.zeros((keys.shape[0], -(-keys.shape[1] // 2048) * 2048), dtype=np.uint16)
        padded[:, : keys.shape[1]] = keys
        got = _heap_topk(padded, keys.shape[1], 128, _group_maxima(padded))
        assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in expected.tolist()]


def test_build_proofs_many_is_build_proofs_per_rollout(monkeypatch):
    """Proving many rollouts at once (as a worker does when a batch ends) gives each rollout the
    bytes build_proofs gives it alone: lengths with tails, two hidden sizes, several passes."""
    import verify.toploc as toploc_module

    monkeypatch.setattr(toploc_module, "_PASS_BYTES", 5 * 32 * 896 * 2)  # 5 chunks per pass
    hiddens = [bf16_gaussian(7 + i, tokens, size, massive_channels=i % 2)
               for i, (tokens, size) in enumerate([(64, 896), (37, 896), (5, 896), (100, 576), (32, 896),
                                                   (1, 576), (96, 896)])]
    assert build_proofs_many(hiddens) == [build_proofs(h) for h in hiddens]
    assert build_proofs_many([]) == []


def _tie_heavy(hidden_size: int, tokens: int) -> list[torch.Tensor]:
    """Coarse-grid, heavy-tailed and normal bf16 hidden states, and normal ones with NaNs of
    several bit patterns (one chunk with more NaNs than the top k holds)."""
    gen = torch.Generator().manual_seed(hidden_size)
    normal = torch.randn(tokens, hidden_size, generator=gen)
    with_nans = normal.to(torch.bfloat16)
    bits = with_nans.view(torch.int16)
    bits[0, :5] = torch.tensor([0x7FC0, -0x3F, 0x7F81, 0x7FFF, -0x7F], dtype=torch.int16)  # NaNs, both signs
    bits[33:40, 0::2] = 0x7FC1  # rows 33-39: a chunk with 7 * hidden_size NaNs (more than 128)
    bits[33:40, 1::2] = 0x7F81  # of two patterns: torch ranks all NaNs equal
    return [(normal * 4).round().to(torch.bfloat16), (normal**3).to(torch.bfloat16),
            normal.to(torch.bfloat16), with_nans]


@pytest.mark.parametrize("hidden_size", [100, 256, 576, 1000, 2048, 5120])
def test_selection_on_tie_heavy_rows_is_torch_topk_of_abs(hidden_size):
    """Every path (one chunk alone: torch.topk or, from 65,536 entries, the heap replay; many
    chunks with a flat threshold scan, tied rows by torch.topk on int16 keys or by the heap
    replay) picks, chunk by chunk, the set that toploc's ``flat.abs().topk(128)`` picks on the
    bf16 values, NaNs included (hidden 5120: chunks of more than P entries, the replay's bound
    renewed twice)."""
    for hidden in _tie_heavy(hidden_size, 32 * 6 + 7):
        for first_row, count, rows in ((0, 6, 32), (32, 1, 32), (192, 1, 7)):
            idx, bits = _topk(hidden, first_row, count, rows, 128)
            for c in range(count):
                flat = hidden[first_row + c * rows : first_row + (c + 1) * rows].reshape(-1)
                expected = flat.abs().topk(min(128, flat.numel())).indices.numpy()
                assert sorted(idx[c].tolist()) == sorted(expected.tolist())
                assert (bits[c] == flat.view(torch.int16).numpy().view(np.uint16)[idx[c]]).all()


@pytest.mark.parametrize("hidden_size", [576, 2048])
def test_batched_measure_is_measure_per_chunk(hidden_size):
    """Measuring 1,024 tokens at once (batched selection) gives, chunk by chunk, what
    measuring each 32-token chunk alone gives (a single chunk takes another selection path)."""
    hidden = _tie_heavy(hidden_size, 1024)[0]
    proofs = build_proofs(perturb_bits(hidden, 5))
    whole = measure(hidden, proofs)
    alone = [measure(hidden[c * 32 : (c + 1) * 32], [proofs[c]])[0] for c in range(32)]
    assert whole == alone
    assert any(s.exp_mismatches or s.mant_err_mean for s in whole)  # the copy was perturbed


@pytest.mark.parametrize("topk", [1, 2, 17, 64])
def test_small_topk_on_long_tied_rows_is_torch_topk_of_abs(topk):
    """Rows of 65,536 entries (hidden 2,048) with ties, proven with a small topk: the heap replay
    has no later entry to add (every pick is among the first blocks) and still answers as torch."""
    hidden = torch.zeros(64, 2048, dtype=torch.bfloat16)
    hidden[0, 5] = hidden[0, 900] = hidden[20, 1000] = 1.0  # a tie at the top, all in the first rows
    hidden[32:] = _tie_heavy(2048, 32)[0]
    idx, _ = _topk(hidden, 0, 2, 32, topk)
    for c in range(2):
        flat = hidden[c * 32 : (c + 1) * 32].reshape(-1)
        expected = flat.abs().topk(topk).indices.numpy()
        assert sorted(idx[c].tolist()) == sorted(expected.tolist())
    assert len(build_proofs(hidden[:32], topk=topk)) == 1
