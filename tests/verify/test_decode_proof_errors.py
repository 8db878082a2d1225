"""decode_proof raises only ProofError, whatever the bytes and whatever the point count."""

import numpy as np
import pytest

from verify.errors import ProofError
from verify.toploc import PRIME, decode_proof, encode_proof


@pytest.mark.parametrize("n_points", [0, -1, -2, -(2**40), 4097, 10**30, True, False, 1.5, None, "128",
                                      float("nan")])
def test_a_point_count_outside_one_to_4096_is_a_proof_error(n_points):
    for data in (b"", b"\x00\x01", b"\x00\x01" * 129):
        with pytest.raises(ProofError, match="points"):
            decode_proof(data, n_points)


@pytest.mark.parametrize("data", [None, "ab", [1, 2], 3.5, bytearray(b"\x00\x01"),
                                  memoryview(np.zeros(2, dtype=np.uint16))])
def test_odd_data_is_a_proof_error(data):
    with pytest.raises(ProofError):
        decode_proof(data, 1)


def test_numpy_point_counts_are_fine():
    blob = encode_proof(7, np.array([1, 2, 3]))
    modulus, coeffs = decode_proof(blob, np.int64(3))
    assert modulus == 7 and coeffs.tolist() == [1, 2, 3]


def test_mutated_proofs_raise_only_proof_errors():
    rng = np.random.default_rng(5)
    accepted = 0
    for _ in range(3000):
        k = int(rng.integers(1, 200))
        blob = bytearray(encode_proof(int(rng.integers(1, PRIME + 1)), rng.integers(0, PRIME, k)))
        for _ in range(rng.integers(1, 4)):
            op = rng.integers(3)
            if op == 0 and blob:
                blob[rng.integers(len(blob))] = rng.integers(256)
            elif op == 1:
                del blob[rng.integers(len(blob) + 1):]
            else:
                blob += rng.bytes(rng.integers(1, 4))
        try:
            modulus, coeffs = decode_proof(bytes(blob), k + int(rng.integers(-1, 2)))
        except ProofError:
            continue
        accepted += 1
        assert 1 <= modulus <= PRIME and len(coeffs) >= 1 and (coeffs < PRIME).all()
    assert 0 < accepted < 3000
