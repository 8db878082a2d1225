"""verify.toploc: field algebra on hand-checked vectors, encoding, build/measure, rejection."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verify.errors import ProofError
from verify.policy import decide
from verify.testing import bf16_test_tensor, perturb_bits
from verify.toploc import (
    PRIME,
    ChunkStats,
    build_proofs,
    decode_proof,
    encode_proof,
    evaluate,
    find_injective_modulus,
    interpolate,
    measure,
    proof_length,
)

pytestmark = pytest.mark.usefixtures("topk_path")  # with and without verify's C module (conftest)

torch.set_num_threads(1)


# ----------------------------------------------------------------- hand-checked algebra


def test_interpolate_three_points_by_hand():
    # Through (1,2), (2,3), (3,6): divided differences 2; 1, 3; 1  ->  p(t) = t^2 - 2t + 3,
    # and -2 = 65495 in GF(65497).
    assert interpolate(np.array([1, 2, 3]), np.array([2, 3, 6])).tolist() == [3, 65495, 1]


def test_interpolate_needs_a_modular_inverse():
    # Through (0,0), (2,1): slope 1/2 = (65497 + 1) / 2 = 32749, since 2 * 32749 = 65498 = 1.
    assert interpolate(np.array([0, 2]), np.array([0, 1])).tolist() == [0, 32749]


def test_interpolate_four_points_by_hand():
    # p(t) = t^3 + 5 through x = 0, 1, 2, 65496 (= -1): y = 5, 6, 13, -1 + 5 = 4.
    coeffs = interpolate(np.array([0, 1, 2, 65496]), np.array([5, 6, 13, 4]))
    assert coeffs.tolist() == [5, 0, 0, 1]


def test_evaluate_by_hand():
    # 3 + 65495 t + t^2 at t = 4: 3 - 8 + 16 = 11; at t = 65497 + 1 (= 1 after reduction): 2.
    assert evaluate(np.array([3, 65495, 1]), np.array([4, 1])).tolist() == [11, 2]


def test_y_values_above_the_prime_are_reduced():
    # bf16 patterns >= 65497 (NaNs) wrap: 65500 -> 3.
    assert interpolate(np.array([7]), np.array([65500])).tolist() == [3]


def test_interpolation_round_trip_batched():
    rng = np.random.default_rng(0)
    x = np.stack([rng.choice(PRIME, 128, replace=False) for _ in range(4)])
    y = rng.integers(0, 1 << 16, size=(4, 128))
    coeffs = interpolate(x, y)
    assert coeffs.shape == (4, 128)
    assert (evaluate(coeffs, x) == y % PRIME).all()


def test_injective_modulus():
    assert find_injective_modulus(np.array([1, 2, 3])) == PRIME
    # 0 and 65497 collide mod 65497; mod 65496 they are 0 and 1.
    assert find_injective_modulus(np.array([0, PRIME])) == PRIME - 1
    # 0, 65497, 130992 reduce to 0,0,0 mod 65497; 0,1,0 mod 65496; 0,2,2 mod 65495;
    # 0,3,4 mod 65494: the first injective one.
    assert find_injective_modulus(np.array([0, PRIME, 2 * (PRIME - 1)])) == PRIME - 3


# ----------------------------------------------------------------- encoding


def test_encode_decode_round_trip():
    coeffs = np.arange(128) * 511 % PRIME
    blob = encode_proof(65000, coeffs)
    assert len(blob) == proof_length(128) == 258
    assert blob[:2] == (65000).to_bytes(2, "big")
    m, back = decode_proof(blob, 128)
    assert m == 65000 and back.tolist() == coeffs.tolist()


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\x00" * 257,
        b"\x00" * 259,
        b"\x00\x00" + b"\x00" * 256,  # modulus 0 (toploc's null proof)
        (65498).to_bytes(2, "big") + b"\x00" * 256,  # modulus above P
        (65497).to_bytes(2, "big") + b"\xff\xff" + b"\x00" * 254,  # coefficient >= P
    ],
)
def test_decode_rejects_malformed(blob):
    with pytest.raises(ProofError):
        decode_proof(blob, 128)


def test_decode_rejects_non_bytes():
    with pytest.raises(ProofError):
        decode_proof(None, 128)  # type: ignore[arg-type]


# ----------------------------------------------------------------- build / measure


def test_build_shapes_and_partial_tail():
    hidden = bf16_test_tensor(5, 70, 256)
    proofs = build_proofs(hidden)
    assert [len(p) for p in proofs] == [258, 258, 258]  # 32 + 32 + 6 tokens
    assert build_proofs(hidden[:0]) == []
    # A 1-token tail of a tiny hidden size has fewer than 128 entries: k = 64.
    small = bf16_test_tensor(6, 33, 64)
    assert [len(p) for p in build_proofs(small)] == [258, 2 + 2 * 64]


def test_honest_measure_is_exact_and_perturbation_is_seen():
    hidden = bf16_test_tensor(7, 64, 512)
    proofs = build_proofs(hidden)
    assert measure(hidden, proofs) == [ChunkStats(0, 0.0, 0.0, 0)] * 2
    noisy = measure(perturb_bits(hidden, 8), proofs)
    assert all(0 < s.mant_err_mean <= 3 for s in noisy)
    assert decide(noisy).accepted


def test_measure_detects_other_hidden_states():
    proofs = build_proofs(bf16_test_tensor(9, 32, 512))
    stats = measure(bf16_test_tensor(10, 32, 512), proofs)
    assert stats[0].exp_mismatches > 100
    assert not decide(stats).accepted


def test_sign_flip_is_counted():
    hidden = bf16_test_tensor(11, 32, 256)
    stats = measure(-hidden, build_proofs(hidden))
    assert stats[0].sign_mismatches == 128 and stats[0].exp_mismatches == 0
    assert not decide(stats).accepted


def test_dtype_and_shape_rejected():
    hidden = bf16_test_tensor(12, 32, 256)
    proofs = build_proofs(hidden)
    for bad in (hidden.float(), hidden.half(), hidden.reshape(-1), hidden[None]):
        with pytest.raises(ProofError):
            build_proofs(bad)
        with pytest.raises(ProofError):
            measure(bad, proofs)
    with pytest.raises(ProofError):
        build_proofs(hidden.tolist())  # type: ignore[arg-type]


def test_non_finite_hidden_rejected_by_build():
    hidden = bf16_test_tensor(13, 32, 256).clone()
    hidden[3, 5] = float("nan")
    with pytest.raises(ProofError):
        build_proofs(hidden)


def test_proof_count_and_none_rejected():
    hidden = bf16_test_tensor(14, 40, 256)
    proofs = build_proofs(hidden)
    for bad in (proofs[:1], proofs + proofs[:1], [proofs[0], None], [], proofs[0], None):
        with pytest.raises(ProofError):
            measure(hidden, bad)  # type: ignore[arg-type]
    with pytest.raises(ProofError):  # a full-chunk proof where the 8-token tail expects 258
        measure(hidden[:33], [proofs[0], proofs[1][:100]])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=300), min_size=0, max_size=3))
def test_random_proof_bytes_never_crash_never_pass(blobs):
    hidden = bf16_test_tensor(15, 64, 256)
    try:
        stats = measure(hidden, blobs)
    except ProofError:
        return
    assert not decide(stats).accepted


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, PRIME - 1), min_size=128, max_size=128), st.integers(1, PRIME))
def test_fabricated_well_formed_proofs_are_rejected(coeffs, modulus):
    hidden = bf16_test_tensor(16, 32, 256)
    stats = measure(hidden, [encode_proof(modulus, np.array(coeffs))])
    assert not decide(stats).accepted


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_product_tree_is_the_product_of_the_linear_factors(batch):
    """M(t) = prod (t - x_j) from the batched tree (skewed sums for small levels, the FFT for
    large ones) equals the product taken one factor at a time; largest values included."""
    from verify.gf import _product_tree

    rng = np.random.default_rng(batch)
    x = np.stack([rng.choice(PRIME, 128, replace=False) for _ in range(batch)]).astype(np.int64)
    x[0, :8] = np.arange(PRIME - 8, PRIME)  # factors (t - x) with -x mod P small and large
    expected = np.zeros((batch, 129), dtype=object)
    expected[:, 0] = 1
    for j in range(128):  # multiply by (t - x_j): shift up, subtract x_j times
        shifted = np.zeros_like(expected)
        shifted[:, 1:] = expected[:, :-1]
        expected = (shifted - expected * x[:, j : j + 1].astype(object)) % PRIME
    assert (_product_tree(x) == expected.astype(np.int64)).all()


@pytest.mark.parametrize("n,batch", [(1, 2), (5, 3), (128, 1), (128, 9), (256, 2)])
def test_roots_from_fixed_points_equal_the_product_tree(n, batch):
    """M(t) from its values at t = 0..n-1 (discrete logarithms, inverse Vandermonde) equals the
    product tree's, also where some x_j lies among those t (a zero factor) or next to P."""
    from verify.gf import _product_tree, _roots_fixed

    rng = np.random.default_rng(n * 10 + batch)
    x = np.stack([rng.choice(PRIME, n, replace=False) for _ in range(batch)]).astype(np.int64)
    x[0, 0] = n - 1  # M(n-1) = 0
    if n > 2:
        x[-1, :2] = [0, PRIME - 1]
    assert (_roots_fixed(x) == _product_tree(x)).all()
    y = rng.integers(0, PRIME, x.shape)
    assert (evaluate(interpolate(x, y), x) == y).all()


@pytest.mark.parametrize("n,batch", [(1, 2), (5, 3), (128, 1), (128, 9), (256, 2)])
def test_cauchy_interpolation_equals_the_roots_path(n, batch):
    """Interpolation from the fixed points P-n..P-1 (``_interpolate_cauchy``) gives the
    coefficients the product-tree path gives: points at 0, at P-n-1 (the largest it takes),
    and a batch where some rows hold a point among the fixed points (those rows take the
    other path, the rest this one)."""
    from verify.gf import _interpolate_cauchy, _interpolate_with, _product_tree

    rng = np.random.default_rng(n * 10 + batch + 1)
    x = np.stack([rng.choice(PRIME - n, n, replace=False) for _ in range(batch)]).astype(np.int64)
    x[0, 0] = PRIME - n - 1
    if n > 2:
        x[-1, :2] = [0, 1]
    y = rng.integers(0, PRIME, x.shape)
    expected = _interpolate_with(_product_tree(x), x, y)
    assert (_interpolate_cauchy(x, y) == expected).all()
    assert (interpolate(x, y) == expected).all()
    mixed = x.copy()
    mixed[0, -1] = PRIME - 1  # a fixed point: row 0 must take the other path
    mixed_y = y.copy()
    assert (interpolate(mixed, mixed_y) == _interpolate_with(_product_tree(mixed), mixed, mixed_y)).all()
    assert (evaluate(interpolate(mixed, mixed_y), mixed) == mixed_y).all()


@pytest.mark.parametrize("n,batch", [(1, 2), (5, 3), (128, 1), (128, 9), (256, 3)])
def test_points_among_the_fixed_points_are_moved_and_shifted_back(n, batch):
    """Rows with a point among P-n..P-1 and one among P-2n..P-n-1 (both sets of fixed points)
    are interpolated at x - s (``_gap_shifts``) and shifted back (``_taylor_shift``): the
    product-tree path's coefficients, for one row alone (its own branch), mixed batches, points
    at 0 and P-1, and n = 256 points spread evenly (no gap wider than n: the roots path) beside
    rows that have one. (n = 1: one point, among P-n..P-1 only.)"""
    from verify.gf import _interpolate_with, _product_tree

    rng = np.random.default_rng(n * 100 + batch)
    x = np.stack([1 + rng.choice(PRIME - n - 1, n, replace=False) for _ in range(batch)]).astype(np.int64)
    x[:, 0] = PRIME - 1 - np.arange(batch)  # every row holds a fixed point
    if n > 1:
        x[:, -1] = PRIME - n - 1 - np.arange(batch)  # and one of the second set
    if n > 2:
        x[0, 1] = 0
    if n == 256:
        x[-1] = np.arange(n) * PRIME // n  # gaps of 255 and 256: none wider than n
        assert np.diff(np.append(x[-1], PRIME)).max() <= n
        assert ((x[-1] >= PRIME - 2 * n) & (x[-1] < PRIME - n)).any()
    y = rng.integers(0, PRIME, x.shape)
    for rows in (slice(0, 1), slice(None)):
        expected = _interpolate_with(_product_tree(x[rows]), x[rows], y[rows])
        assert (interpolate(x[rows], y[rows]) == expected).all()
    mixed = x.copy()
    mixed[1:, 0] = 7  # the other rows fit the fixed points
    expected = _interpolate_with(_product_tree(mixed), mixed, y)
    assert (interpolate(mixed, y) == expected).all()
    assert (evaluate(interpolate(mixed, y), mixed) == y % PRIME).all()


@pytest.mark.parametrize("n,batch", [(1, 1), (5, 3), (128, 1), (128, 6), (256, 3)])
def test_points_among_the_fixed_points_take_the_second_set(n, batch, monkeypatch):
    """Rows with a point among P-n..P-1 but none among P-2n..P-n-1 are interpolated from the
    fixed points P-2n..P-n-1 (``_interpolate_cauchy`` with offset 2n, whose Cauchy windows wrap
    round P for the points above them): the product-tree path's coefficients, for one row
    alone and for batches mixing such rows with rows below P - n and rows that hold a point
    of both sets; points at 0, P-2n-1, P-n and P-1; a point at either edge of P-2n..P-n-1 keeps
    a row off the second set."""
    import verify.gf as gf_module
    from verify.gf import _interpolate_with, _product_tree

    offsets, real = [], gf_module._interpolate_cauchy
    monkeypatch.setattr(gf_module, "_interpolate_cauchy",
                        lambda x, y, offset=0: offsets.append((offset, x.shape[0])) or real(x, y, offset))
    rng = np.random.default_rng(n * 7 + batch)
    x = np.stack([rng.choice(PRIME - 2 * n, n, replace=False) for _ in range(batch)]).astype(np.int64)
    x[:, 0] = PRIME - 1 - np.arange(batch)  # among P-n..P-1
    if n > 2:
        x[0, 1:4] = [0, PRIME - 2 * n - 1, PRIME - n]
    y = rng.integers(0, PRIME, x.shape)
    for rows in (slice(0, 1), slice(None)):
        offsets.clear()
        expected = _interpolate_with(_product_tree(x[rows]), x[rows], y[rows])
        assert (interpolate(x[rows], y[rows]) == expected).all()
        assert offsets == [(2 * n, x[rows].shape[0])]
    if batch > 2:
        mixed = x.copy()
        mixed[1, 0] = 7  # below P - n: the first set
        mixed[-1, -1] = PRIME - n - 1  # a point of each set: moved and shifted back
        offsets.clear()
        expected = _interpolate_with(_product_tree(mixed), mixed, y)
        assert (interpolate(mixed, y) == expected).all()
        assert (2 * n, batch - 2) in offsets
        assert (evaluate(interpolate(mixed, y), mixed) == y % PRIME).all()
    if n > 1:  # the second set's edges: a point at P-2n or at P-n-1 is one of its own
        for low in (PRIME - 2 * n, PRIME - n - 1):
            edge = x[:1].copy()
            edge[0, -1] = low
            offsets.clear()
            assert (interpolate(edge, y[:1]) == _interpolate_with(_product_tree(edge), edge, y[:1])).all()
            assert all(offset != 2 * n for offset, _ in offsets)


@pytest.mark.parametrize("k", [1, 2, 128, 256, 300])
def test_moduli_of_one_chunk_and_of_many_are_find_injective_modulus(k):
    """``_moduli`` (one chunk alone: slot numbers written at the points and read back; many: one
    sort) gives each row find_injective_modulus and the points mod it: rows distinct mod P, rows
    whose positions collide mod P once (first and last point, or two in the middle) or many
    times, one chunk alone and in a batch."""
    from verify.toploc import _moduli

    rng = np.random.default_rng(k)
    rows = [rng.choice(3 * PRIME, k, replace=False) for _ in range(4)]
    for row in rows:
        while np.unique(row % PRIME).size < k:  # start from rows distinct mod P
            row[:] = rng.choice(3 * PRIME, k, replace=False)
    def twin(i):  # another position with the same residue mod P
        return i % PRIME + PRIME * ((i // PRIME + 1) % 3)

    if k > 1:
        rows[1][-1] = twin(rows[1][0])  # first and last collide
        rows[2][k // 2] = twin(rows[2][k // 2 - 1])
        rows[3][: k // 2] = twin(rows[3][k // 2 : 2 * (k // 2)])  # many collisions
    idx = np.stack(rows).astype(np.int64)
    expected = [find_injective_modulus(r) for r in idx]
    if k > 1:
        assert expected[0] == PRIME and all(m < PRIME for m in expected[1:])
    for rows_of in ([slice(i, i + 1) for i in range(4)] + [slice(None)]):
        moduli, points = _moduli(idx[rows_of])
        assert moduli.tolist() == expected[rows_of]
        assert (points == idx[rows_of] % moduli[:, None]).all()


def test_float_reduction_mod_p_is_exact():
    """_reduce (mod P in float64 by the floor of a correctly rounded division) equals int64 %
    on random integers below 2^53 and right at, below and above multiples of P."""
    from verify.gf import _reduce

    rng = np.random.default_rng(3)
    multiples = rng.integers(0, 2**53 // PRIME, 20_000) * PRIME
    values = np.concatenate([rng.integers(0, 2**53, 100_000), multiples, multiples + 1,
                             np.maximum(multiples - 1, 0), [0, PRIME - 1, PRIME, 2**53 - 1]])
    assert (_reduce(values.astype(np.float64)).astype(np.int64) == values % PRIME).all()


def test_interpolate_below_matches_interpolate_and_refuses_what_it_cannot_take():
    from verify.gf import PRIME, interpolate, interpolate_below

    rng = np.random.default_rng(11)
    x = np.stack([rng.choice(PRIME - 128, 128, replace=False) for _ in range(3)]).astype(np.int64)
    y = rng.integers(0, 1 << 16, x.shape).astype(np.int64)
    assert np.array_equal(interpolate_below(x, y, int(x.max())), interpolate(x, y))
    near = x.copy()
    near[0, 0] = PRIME - 1  # among the fixed points: only interpolate takes it
    with pytest.raises(ValueError, match="below P - n"):
        interpolate_below(near, y, int(near.max()))
    with pytest.raises(ValueError, match="int64"):
        interpolate_below(x.astype(np.int32), y, int(x.max()))
    with pytest.raises(ValueError, match="int64"):
        interpolate_below(x, y.astype(np.uint16), int(x.max()))
