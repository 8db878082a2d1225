"""TOPLOC proofs: build, encode, decode and measure, byte-compatible with ``toploc`` 0.1.6.

Owns: turning the LM-head inputs (last hidden states) of generated tokens into 258-byte
polynomial commitments, and measuring how far a recomputation is from a commitment.
Must not: decide acceptance (that is ``verify.policy``), run a model, or do I/O.

Theory of operation
-------------------
The hidden states of the generated tokens, ``hidden`` [T, H] in bf16, are cut into chunks of
``chunk_tokens`` rows (the last chunk may be shorter; it is proven too, as toploc does). For
each chunk, flattened:

1. take the ``k = min(topk, numel)`` entries of largest absolute value, ties at the k-th
   place broken exactly as toploc's ``flat.abs().topk(k)`` does on CPU (torch's CPU kernel:
   a heap selection for numel >= 64 k, nth_element below; see ``verify.topk``), so proofs
   are byte-identical to toploc's for every chunk, tie-heavy real hidden states included
   (tests/verify/test_toploc_ties.py, a golden file made by toploc 0.1.6). Proofs are always
   built and measured on CPU: a CUDA topk breaks ties otherwise;
2. x = flat index mod m, with m the largest modulus <= 65497 that keeps the k indices
   distinct (searching downward, as toploc's C++ ``ProofPoly.from_points`` does);
3. y = the bf16 bit pattern (u16) reduced mod P = 65497 (only NaN patterns are >= P);
4. the unique polynomial of degree < k through the (x, y) over GF(P), in ascending
   monomial coefficients;
5. bytes = m, then the k coefficients, each u16 big-endian: 2 + 2k bytes (258 for k=128).

Measuring: recompute the hidden states, take the top k again, evaluate the committed
polynomial at (index mod m) and compare with the recomputed bf16 patterns: exponent bits
7-14 (mismatch count), mantissa bits 0-6 (mean and upper median of |difference| over the
entries whose exponents match; ``inf`` when none match, where toploc reports 2**64), and
the sign bit 15 (toploc ignores it; we count it).

Differences from toploc 0.1.6, all deliberate:
- only bf16 input is accepted (toploc silently emits all-zero "null" proofs on errors);
- its Python verify path forgets ``idx % m``; we reduce, as its C++ path does;
- median is the upper median (C++ path), not ``statistics.median`` (Python path);
- a chunk with fewer than ``topk`` entries (hidden size < 128 on a 1-token tail) is proven
  with k = numel points; toploc fails there.

Interpolation and evaluation over GF(P) are ``verify.gf``. Top-k selection is ``verify.topk``.
Where verify.topk uses the C module (``verify/_ctopk.c``; ``verify.topk.ACCELERATOR``), proofs
take their interpolation from it too (Newton's divided differences: the polynomial is unique,
so the same bytes; tests/verify/test_ctopk.py); otherwise from ``verify.gf``. Measures take from it
the committed polynomials' values (``evaluate``: the values ``verify.gf.evaluate`` gives) and each
chunk's statistics (``compare``: the fields ``_stats`` gives from ``_slot_scores``), so the same ChunkStats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from verify import topk as _topk_module
from verify.errors import ProofError
from verify.gf import BELOW_MAX_POINTS, PRIME, evaluate, interpolate, interpolate_below
from verify.topk import tie_sets_chunks as _tie_sets
from verify.topk import topk_chunks as _topk
from verify.topk import topk_of as _topk_of

__all__ = [
    "PRIME",
    "ChunkStats",
    "build_proofs",
    "build_proofs_many",
    "decode_proof",
    "encode_proof",
    "evaluate",
    "find_injective_modulus",
    "interpolate",
    "measure",
    "proof_length",
]

_MAX_TOPK = 4096  # points per proof: float64 exactness in verify.gf needs n * P^2 < 2^53, far below


# --------------------------------------------------------------------------- modulus, bytes


def find_injective_modulus(indices: np.ndarray) -> int:
    """The largest m <= P such that indices mod m are pairwise distinct (toploc's rule)."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if np.unique(idx % PRIME).size == idx.size:
        return PRIME
    return _modulus_below_prime(idx)


def _modulus_below_prime(idx: np.ndarray) -> int:
    """``find_injective_modulus`` for int64 indices known to collide mod P."""
    top, block = PRIME - 1, 4  # P - 1 or P - 2 mostly works already: a small first block
    while top > 0:
        cands = np.arange(top, max(top - block, 0), -1, dtype=np.int64)
        rem = np.sort(idx[None, :] % cands[:, None], axis=1)
        ok = ~np.any(rem[:, 1:] == rem[:, :-1], axis=1)
        if ok.any():
            return int(cands[np.argmax(ok)])
        top, block = top - block, 64
    raise ProofError("no injective modulus exists for these indices")


def proof_length(n_points: int) -> int:
    """Bytes in one encoded proof with n_points coefficients."""
    return 2 + 2 * n_points


def encode_proof(modulus: int, coeffs: np.ndarray) -> bytes:
    """m then the coefficients, each u16 big-endian."""
    coeffs = np.asarray(coeffs, dtype=np.int64)
    if not 1 <= modulus <= PRIME or coeffs.ndim != 1 or np.any((coeffs < 0) | (coeffs >= PRIME)):
        raise ValueError("modulus must be in [1, P] and coefficients in [0, P)")
    words = np.concatenate([np.array([modulus], dtype=np.int64), coeffs])
    return words.astype(">u2").tobytes()


def decode_proof(data: bytes | bytearray | memoryview, n_points: int) -> tuple[int, np.ndarray]:
    """Parse one proof of ``n_points`` coefficients; ProofError if it is malformed.

    ``n_points`` must be an int in [1, 4096] (a proof commits to at least one point); the
    bytes must be exactly ``proof_length(n_points)`` long, with 1 <= m <= P and every
    coefficient < P. Nothing but ProofError escapes, whatever the arguments.
    """
    is_count = isinstance(n_points, (int, np.integer)) and not isinstance(n_points, bool)
    if not is_count or not 1 <= n_points <= _MAX_TOPK:
        raise ProofError(f"a proof has 1 to {_MAX_TOPK} points, not {str(n_points)[:32]}")
    n_points = int(n_points)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProofError(f"proof must be bytes, got {type(data).__name__}")
    try:
        raw = bytes(data)
    except (TypeError, ValueError, BufferError) as exc:  # a memoryview of a non-byte format
        raise ProofError(f"proof is not a byte buffer ({exc})") from exc
    if len(raw) != proof_length(n_points):
        raise ProofError(f"proof has {len(raw)} bytes, expected {proof_length(n_points)}")
    words = np.frombuffer(raw, dtype=">u2").astype(np.int64)
    modulus, coeffs = int(words[0]), words[1:]
    if not 1 <= modulus <= PRIME:
        raise ProofError(f"proof modulus {modulus} outside [1, {PRIME}]")
    if np.any(coeffs >= PRIME):
        raise ProofError(f"proof coefficient outside GF({PRIME})")
    return modulus, coeffs


def _decode_many(proofs: Sequence[bytes], n_points: int) -> tuple[np.ndarray, np.ndarray]:
    """``decode_proof`` for many proofs at once: (moduli [C], coefficients [C, n_points]).
    The same checks and errors, with one buffer parse instead of one per proof."""
    length = proof_length(n_points)
    if any(type(p) is not bytes or len(p) != length for p in proofs):
        for p in proofs:  # the slow path names the first bad proof exactly as decode_proof does
            decode_proof(p, n_points)
    words = np.frombuffer(b"".join(proofs), dtype=">u2").astype(np.int64).reshape(len(proofs), -1)
    moduli, coeffs = words[:, 0], words[:, 1:]
    if np.any((moduli < 1) | (moduli > PRIME)) or np.any(coeffs >= PRIME):
        for p in proofs:
            decode_proof(p, n_points)
    return moduli, coeffs


# --------------------------------------------------------------------------- chunks


def _check_params(chunk_tokens: int, topk: int) -> None:
    if not (isinstance(chunk_tokens, int) and chunk_tokens >= 1):
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    if not (isinstance(topk, int) and 1 <= topk <= _MAX_TOPK):
        raise ValueError(f"topk must be an int in [1, {_MAX_TOPK}], got {topk!r}")


def _check_hidden(hidden: object) -> torch.Tensor:
    if not isinstance(hidden, torch.Tensor):
        raise ProofError(f"hidden states must be a torch.Tensor, got {type(hidden).__name__}")
    if hidden.dtype != torch.bfloat16:
        raise ProofError(f"hidden states must be bfloat16, got {hidden.dtype}")
    if hidden.dim() != 2 or hidden.shape[1] == 0:
        raise ProofError(f"hidden states must be [tokens, hidden_size], got {tuple(hidden.shape)}")
    return hidden.detach().cpu().contiguous()


def _chunk_groups(tokens: int, chunk_tokens: int) -> list[tuple[int, int, int, int]]:
    """(first_chunk, first_row, n_chunks, rows_per_chunk): the full chunks, then the tail."""
    full, tail = divmod(tokens, chunk_tokens)
    groups = [(0, 0, full, chunk_tokens)] if full else []
    if tail:
        groups.append((full, full * chunk_tokens, 1, tail))
    return groups


_PASS_BYTES = 16 << 20  # hidden-state bytes proven per pass (bounds the temporaries)


_ORDER = np.arange(256, dtype=np.uint8)  # slot numbers for _moduli's check of one chunk
_ORDER.flags.writeable = False
_PRIME_ONLY = np.array([PRIME], dtype=np.int64)
_PRIME_ONLY.flags.writeable = False


def _moduli(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """find_injective_modulus per row of idx [C, k], and the points idx mod m: P wherever the
    indices are distinct mod P (always when a chunk has at most P entries), found for all rows
    with one sort (one chunk alone of up to 256 points: by writing each point's slot number
    into a scratch array at the point and reading them back, 2-3x cheaper than the sort).
    The moduli of one chunk alone without a collision are a shared read-only array: not to be
    written to."""
    points = idx % PRIME
    if idx.shape[0] == 1 and idx.shape[1] <= _ORDER.size:  # one chunk alone: no sort
        # slot j is written at point j, then read back: a repeated point reads one value at two
        # slots, so not both of their own (whichever write numpy keeps); others are never read
        order = _ORDER[: idx.shape[1]]
        slots = np.empty(PRIME, dtype=np.uint8)
        slots[points[0]] = order
        if (slots[points[0]] == order).all():
            return _PRIME_ONLY, points
        colliding = [0]
    else:
        rem = np.sort(points, axis=1)
        colliding = np.flatnonzero(np.any(rem[:, 1:] == rem[:, :-1], axis=1))
    moduli = np.full(idx.shape[0], PRIME, dtype=np.int64)
    for row in colliding:
        moduli[row] = _modulus_below_prime(idx[row])
        points[row] = idx[row] % moduli[row]
    return moduli, points


def _prove(selected: tuple[np.ndarray, np.ndarray]) -> list[bytes]:
    """Proofs of chunks from their top-k (flat indices, bf16 bit patterns), each [C, k].

    Few numpy calls, as one chunk alone (a worker proving as it generates) pays each one's
    fixed cost: points (positions mod m) below P - k are clear of the interpolation's fixed
    points, so they go to ``interpolate_below`` without ``interpolate``'s conversions."""
    idx, bits = selected
    count, k = idx.shape
    if (bits & 0x7F80).max(initial=0) == 0x7F80:  # non-finite entries always rank in the top k
        raise ProofError("hidden states contain NaN or infinity")
    # every pattern is now below 0xFF80 < P: the values need no reduction
    words = np.empty((count, k + 1), dtype=">u2")
    top = idx.max(initial=0)
    if top < PRIME:
        words[:, 0], points = PRIME, idx
    else:
        words[:, 0], points = _moduli(idx)
        top = points.max(initial=0)
    if (accelerator := _topk_module.ACCELERATOR) is not None:  # the C module: the same polynomial
        coeffs = np.empty((count, k), dtype=np.int64)
        accelerator.interpolate(np.ascontiguousarray(points), np.ascontiguousarray(bits), coeffs)
        words[:, 1:] = coeffs
    elif k <= BELOW_MAX_POINTS and top < PRIME - k:
        words[:, 1:] = interpolate_below(points, bits, int(top))
    else:
        words[:, 1:] = interpolate(points, bits)
    data = words.tobytes()
    if count == 1:
        return [data]
    size = proof_length(k)
    return [data[i * size : (i + 1) * size] for i in range(count)]


def build_proofs_many(
    hiddens: Sequence[torch.Tensor], *, chunk_tokens: int = 32, topk: int = 128
) -> list[list[bytes]]:
    """``build_proofs`` for many rollouts at once: the same bytes, one list per rollout.

    A worker proves all rows of a generation batch when the batch ends
    (``trainer.rollout.build_row_proofs``): the chunks of every row are stacked and proven
    together (top-k selection, moduli and interpolation each batched over all of them), so
    the fixed cost of each step is paid once per pass instead of once per rollout.
    """
    _check_params(chunk_tokens, topk)
    checked = [_check_hidden(h) for h in hiddens]
    out: list[list[bytes]] = [[b""] * math.ceil(h.shape[0] / chunk_tokens) for h in checked]
    # (rows per chunk, hidden size) -> [(rollout, first chunk, first row, chunk count)]
    groups: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for i, h in enumerate(checked):
        for first, first_row, count, rows in _chunk_groups(h.shape[0], chunk_tokens):
            groups.setdefault((rows, h.shape[1]), []).append((i, first, first_row, count))
    for (rows, width), parts in groups.items():
        per_pass = max(1, _PASS_BYTES // (2 * rows * width))
        pieces = [(i, first + j, first_row + j * rows) for i, first, first_row, count in parts
                  for j in range(count)]  # one entry per chunk
        for start in range(0, len(pieces), per_pass):
            todo = pieces[start : start + per_pass]
            bits = [checked[i][r : r + rows].reshape(1, -1).view(torch.int16).numpy().view(np.uint16)
                    for i, _, r in todo]
            for (i, chunk, _), proof in zip(todo, _prove(_topk_of(bits, topk))):
                out[i][chunk] = proof
    return out


def build_proofs(hidden: torch.Tensor, *, chunk_tokens: int = 32, topk: int = 128) -> list[bytes]:
    """Proofs for ``hidden`` [tokens, hidden_size] bf16: one per chunk of ``chunk_tokens`` rows.

    Raises ProofError for a non-bf16 or non-2-D tensor, or for non-finite values (which no
    honest model produces and which cannot be committed faithfully).
    """
    _check_params(chunk_tokens, topk)
    hidden = _check_hidden(hidden)
    proofs: list[bytes] = []
    for _, first_row, count, rows in _chunk_groups(hidden.shape[0], chunk_tokens):
        proofs.extend(_prove(_topk(hidden, first_row, count, rows, topk)))
    return proofs


@dataclass(frozen=True)
class ChunkStats:
    """How one chunk's recomputation compares with its commitment.

    exp_mismatches: top-k entries whose exponent bits (7-14) differ.
    mant_err_mean / mant_err_median: mean and upper median of |mantissa difference| (bits
      0-6, so in [0, 127]) over the entries whose exponents match; ``inf`` if none match.
    sign_mismatches: top-k entries whose sign bit differs (toploc does not check this).
    """

    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float
    sign_mismatches: int


def _slot_scores(committed: np.ndarray, recomputed: np.ndarray) -> np.ndarray:
    """How well each committed bf16 pattern matches the recomputed one, as one int per slot:
    256 if the exponent bits (7-14) differ, plus twice the mantissa error (bits 0-6), plus 1
    if the sign bit differs. Smaller is better; 0 is a bit-exact match."""
    diff = committed ^ recomputed
    mant_err = np.abs((committed & 0x7F) - (recomputed & 0x7F))
    return (((diff & 0x7F80) != 0).astype(np.int64) << 8) | (mant_err << 1) | ((diff >> 15) & 1)


def _stats(score: np.ndarray) -> list[ChunkStats]:
    """Per-row statistics from the [C, k] slot scores of ``_slot_scores``."""
    match = score < 256
    n_match = np.count_nonzero(match, axis=1)
    exp_mis = score.shape[1] - n_match
    sign_mis = (score & 1).sum(axis=1)
    total = np.where(match, score >> 1, 0).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n_match > 0, total / np.maximum(n_match, 1), np.inf)
    # matched slots sort first, by mantissa error: the upper median is at n_match // 2
    upper = np.take_along_axis(np.sort(score, axis=1), (n_match // 2)[:, None], axis=1)[:, 0] >> 1
    median = np.where(n_match > 0, upper.astype(np.float64), np.inf)
    return [
        ChunkStats(e, mu, md, sg)
        for e, mu, md, sg in zip(exp_mis.tolist(), mean.tolist(), median.tolist(), sign_mis.tolist())
    ]


def _compare(committed: np.ndarray, recomputed: np.ndarray) -> list[ChunkStats]:
    """Per-row statistics of two [C, k] int64 arrays of bf16 bit patterns (by the C module's
    ``compare`` where it is loaded: the same fields as ``_stats`` of ``_slot_scores``)."""
    if (accelerator := _topk_module.ACCELERATOR) is not None:
        fields = accelerator.compare(np.ascontiguousarray(committed), np.ascontiguousarray(recomputed))
        return [ChunkStats(e, mu, md, sg) for e, mu, md, sg in fields]
    return _stats(_slot_scores(committed, recomputed))


def _committed(coeffs: np.ndarray, moduli: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The committed polynomials ([C, n] coefficients) at the recomputed flat positions idx [C, k],
    each row's taken mod its proof's modulus: int64 [C, k] (by the C module's ``evaluate`` where it
    is loaded: the same values as ``verify.gf.evaluate``)."""
    if (accelerator := _topk_module.ACCELERATOR) is not None:
        out = np.empty(idx.shape, dtype=np.int64)
        accelerator.evaluate(coeffs, moduli, np.ascontiguousarray(idx), out)
        return out
    return evaluate(coeffs, idx % moduli[:, None])


_OUTSIDE = 1 << 16  # above every slot score (at most 511)


def _compare_tie_sets(
    committed: np.ndarray, recomputed: np.ndarray, above: np.ndarray, end: np.ndarray, k: int
) -> list[ChunkStats]:
    """``_compare`` where each row's tie at the k-th place is open (``verify.topk``'s tie sets).

    committed / recomputed: [C, k + e] bf16 patterns at the candidate slots; per row, slots
    below ``above`` are always counted, and k - above of the slots above..end-1 (the entries
    equal to the k-th largest |value|) are counted: those the committed polynomial matches
    best (smallest ``_slot_scores``: exponent match, then mantissa error, then sign).
    """
    score = _slot_scores(committed, recomputed)
    if score.shape[1] == k:
        return _stats(score)
    slot = np.arange(score.shape[1])[None, :]
    # counted slots sort first (shifted below 0), then the tied ones by score, then the filler
    order = np.where(slot < above[:, None], score - _OUTSIDE,
                     np.where(slot < end[:, None], score, _OUTSIDE))
    kept = np.sort(order, axis=1)[:, :k]
    return _stats(np.where(kept < 0, kept + _OUTSIDE, kept))


def measure(
    hidden: torch.Tensor,
    proofs: Sequence[bytes],
    *,
    chunk_tokens: int = 32,
    topk: int = 128,
    exact_ties: bool = True,
) -> list[ChunkStats]:
    """Compare recomputed ``hidden`` [tokens, hidden_size] bf16 with committed ``proofs``.

    Ties at the k-th place: when several entries share the k-th largest |value| v, every
    choice of them completes an equally valid top-k set; which one a prover commits is a
    detail of its top-k kernel (toploc's, or ours with the same torch CPU heap; a CUDA topk
    picks others). With ``exact_ties=False`` (open ties) the validator does not reproduce that
    choice: it counts the entries strictly above v, and of the entries equal to v the
    k - (count above) that the committed polynomial matches best (exponent, then mantissa,
    then sign; see ``_compare_tie_sets``). So:
    - an honest proof over the same hidden states measures exactly as under ``exact_ties``:
      the prover's tied entries are among the tie set and the polynomial reproduces them
      bit for bit (score 0, the best), so the statistics are all zero either way;
    - for any proof, the statistics are those of the exact path applied to another valid
      top-k set of the recomputed hidden states: the same entries strictly above v, the
      same number of entries equal to v, each compared with the polynomial at its own
      index. Only which tied entries (equal |value|, so equal up to the sign) are counted
      can differ, in the proof's favour; every other entry is compared exactly as before,
      and a committed value that matches no tied entry still counts as a mismatch. A
      chunk with more than 256 tied entries beyond the k-th place falls back to torch's
      choice (``verify.topk._select_tie_sets``).
    ``exact_ties=True`` (the default) takes torch.topk's choice among the tied entries, as
    toploc's own verify does (its statistics on differing hidden states, test_toploc_ties.py);
    it is slower by one torch.topk or heap replay per tied chunk. The statistics of a proof
    over differing hidden states depend on the rule, so a validator must measure with the rule
    its calibration tables were measured with (``verify.calibration.CalibrationTables
    .exact_ties``); the shipped tables were measured with open ties.

    Raises ProofError when the proofs are malformed or do not fit the hidden states: a
    proof that is not bytes (None included), of the wrong length, with an out-of-range
    modulus or coefficient, or a proof count other than ceil(tokens / chunk_tokens).
    """
    _check_params(chunk_tokens, topk)
    hidden = _check_hidden(hidden)
    if isinstance(proofs, (bytes, bytearray, memoryview, str)) or not isinstance(
        proofs, Sequence
    ):
        raise ProofError(f"proofs must be a sequence of bytes, got {type(proofs).__name__}")
    n_chunks = math.ceil(hidden.shape[0] / chunk_tokens)
    if len(proofs) != n_chunks:
        raise ProofError(f"{len(proofs)} proofs for {n_chunks} chunks")
    stats: list[ChunkStats] = []
    for start, first_row, count, rows in _chunk_groups(hidden.shape[0], chunk_tokens):
        k = min(topk, rows * hidden.shape[1])
        moduli, coeffs = _decode_many(proofs[start : start + count], k)
        if exact_ties:
            idx, bits = _topk(hidden, first_row, count, rows, topk)
            stats.extend(_compare(_committed(coeffs, moduli, idx), bits))
        else:
            idx, bits, above, end = _tie_sets(hidden, first_row, count, rows, topk)
            stats.extend(_compare_tie_sets(_committed(coeffs, moduli, idx), bits, above, end, k))
    return stats
