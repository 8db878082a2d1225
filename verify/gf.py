"""Polynomials over GF(65497), batched with numpy: interpolation through points and evaluation.

Owns the field arithmetic behind TOPLOC proofs (``verify.toploc``): the unique polynomial of
degree < n through n points (ascending coefficients), its values at other points, and the
tables both use. Must not: know about hidden states, proofs' bytes, or torch.
(Where the verifier's C module is built, ``verify.toploc`` interpolates its proofs and evaluates
the committed polynomials there instead: ``verify/_ctopk.c``, the same polynomials and values; this
module is then the fallback.)

How it is fast (no per-element Python loops): up to 256 points all below P - n (every
chunk of at most P - 256 entries, the usual case), interpolation goes through the values
at the fixed points P-n..P-1 (``_interpolate_cauchy``): every quantity it needs comes from
the Cauchy matrix 1 / (t_u - x_j), read as one window of an inverse table per point, and
from logarithm windows, then one product with the cached inverse Vandermonde matrix of the
fixed points. Rows with a point among P-n..P-1 (about 22% of the chunks of more than P
entries when the indices spread uniformly; rare with massive channels) take the fixed
points P-2n..P-n-1 instead when none of theirs is there (about 78% of them); the others are
interpolated at x - s, s ending a gap wider than n between the points, and shifted back
(``_taylor_shift``: one product with a binomial table). Otherwise (more than
256 points, or no such gap) it is done in Lagrange form with matrix products. With
M(t) = prod_j (t - x_j), the coefficients are
``c_k = sum_t M[k+1+t] * S_t`` with ``S_t = sum_i a_i x_i^t`` and ``a_i = y_i / M'(x_i)``:
S, M'(x_i) and every evaluation use baby-step/giant-step powers (x^t = (x^B)^g * x^b,
B = 16; looked up in tables of every x in GF(P) for the usual 128 points) and small matrix
products; c is a Hankel matrix of M times S. All entries are < P, so float64 products are
exact (n * P^2 < 2^53). M comes from its values at t = 0..n-1 (``_roots_fixed``: each value
a product of n factors, summed as discrete logarithms read from one window of a log table
per point, then one product with the cached inverse Vandermonde matrix of 0..n-1), for up to
256 points; from a batched product tree (``_product_tree``) beyond. Every step
is batched over chunks, and ``build_proofs_many`` batches the chunks of many rollouts (a
worker's generation batch), so fixed numpy costs are paid once per batch.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

PRIME = 65497  # the field GF(P); also the largest modulus tried
_BABY = 16  # baby-step width for evaluation


def _inverse_table() -> np.ndarray:
    """inv[a] = a^(P-2) mod P for every a in GF(P) (inv[0] = 0), by vectorised Fermat."""
    base = np.arange(PRIME, dtype=np.int64)
    result = np.ones(PRIME, dtype=np.int64)
    exponent = PRIME - 2
    while exponent:
        if exponent & 1:
            result = result * base % PRIME
        base = base * base % PRIME
        exponent >>= 1
    return result


_INV = _inverse_table()


# --------------------------------------------------------------------------- field algebra


def _powers(x: np.ndarray, n: int) -> np.ndarray:
    """x^t mod P for t in [0, n): shape x.shape + (n,), by doubling."""
    out = np.ones(x.shape + (n,), dtype=np.int64)
    if n > 1:
        out[..., 1] = x
    filled = min(n, 2)
    while filled < n:
        step = min(filled, n - filled)
        x_filled = out[..., filled - 1] * x % PRIME  # x^filled
        out[..., filled : filled + step] = out[..., :step] * x_filled[..., None] % PRIME
        filled += step
    return out


_TABLE_GIANT = 8  # giant steps kept in the power tables: covers n <= 16 * 8 = 128 points
_POWER_TABLES: list[np.ndarray] = []


def _power_table() -> np.ndarray:
    """x^b (b < 16), then x^(16 g) (g < 8), for every x in GF(P), as one uint16 table [P, 24]
    (3 MiB, built on first use in a few ms): a table lookup replaces the repeated modular
    products of ``_powers`` for the usual 128 points, one row (48 bytes) per point."""
    if not _POWER_TABLES:
        x = np.arange(PRIME, dtype=np.int64)
        baby = _powers(x, _BABY + 1)
        giant = _powers(baby[:, _BABY], _TABLE_GIANT)
        _POWER_TABLES.append(np.concatenate([baby[:, :_BABY], giant], axis=1).astype(np.uint16))
    return _POWER_TABLES[0]


def _bsgs_tables(x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Baby steps x^b (b < B) and giant steps (x^B)^g (g < G), with B*G >= n. x in [0, P)."""
    baby = min(_BABY, n)
    giant = -(-n // baby)
    if baby == _BABY and giant <= _TABLE_GIANT:
        # np.take: 6-8x faster than table[x] for a 2-D x (measured)
        rows = np.take(_power_table(), x, axis=0).astype(np.float64)
        return rows[..., :_BABY], rows[..., _BABY : _BABY + giant]
    small = _powers(x, baby + 1)
    return small[..., :baby], _powers(small[..., baby], giant)


def _windows(arr: np.ndarray, width: int) -> np.ndarray:
    """Read-only view [..., len - width + 1, width] with out[..., i, j] = arr[..., i + j]."""
    *lead, length = arr.shape
    strides = arr.strides
    return as_strided(
        arr,
        shape=(*lead, length - width + 1, width),
        strides=(*strides, strides[-1]),
        writeable=False,
    )


def _fft_convolve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact integer convolution of the last axes of a and b ([..., L] each, entries in
    [0, P)) -> [..., 2L-1], by a float64 FFT, checked: every result must lie within 1/4 of
    an integer (the FFT's rounding error is about 1e-4 here: sums below L P^2 < 2^39), or
    the exact matrix product of sliding windows is used instead."""
    length = a.shape[-1]
    size = 1 << (2 * length - 2).bit_length()
    conv = np.fft.irfft(np.fft.rfft(a, size) * np.fft.rfft(b, size), size)[..., : 2 * length - 1]
    rounded = np.rint(conv)
    if np.abs(conv - rounded).max(initial=0.0) < 0.25:
        return rounded
    padded = np.zeros(b.shape[:-1] + (3 * length - 2,), dtype=np.float64)  # pragma: no cover
    padded[..., length - 1 : 2 * length - 1] = b
    return np.matmul(_windows(padded, length), a[..., ::-1, None])[..., 0]


_SKEW_MAX = 1 << 16  # outer-product entries per level below which skewed sums beat the FFT's call overhead


def _product_tree(x: np.ndarray) -> np.ndarray:
    """Coefficients (ascending, length n+1) of prod_j (t - x_j), batched: [C, n] -> [C, n+1].

    Neighbouring factors are multiplied level by level (n/2 products of linear factors, then
    n/4 of quadratics, ...), all chunks and pairs of a level at once, in float64 (every
    product and sum of a level stays an integer below 2^53, so it is exact; one reduction
    per level, in int64: np.fmod is about 30x slower). Levels with few coefficients in all
    (low levels; every level of one chunk) convolve by summing the diagonals of outer
    products; larger ones by a checked float64 FFT (``_fft_convolve``).
    """
    batch, n = x.shape
    width = 1 << max(0, (n - 1).bit_length())
    polys = np.zeros((batch, width, 2), dtype=np.float64)
    polys[:, :, 0] = 1.0  # padding factors are the constant 1
    polys[:, :n, 0] = (-x) % PRIME
    polys[:, :n, 1] = 1.0
    while polys.shape[1] > 1:  # multiply neighbours
        a, b = polys[:, 0::2], polys[:, 1::2]
        length = a.shape[2]
        if length <= 5 or a.size * length <= _SKEW_MAX:  # out[i + j] += a[i] b[j]: skewed outer product
            pairs = a.shape[:2]
            skew = np.zeros(pairs + (length, 2 * length), dtype=np.float64)
            skew[..., :length] = a[..., :, None] * b[..., None, :]
            rows = skew.reshape(pairs + (2 * length * length,))[..., : length * (2 * length - 1)]
            conv = rows.reshape(pairs + (length, 2 * length - 1)).sum(axis=2)
        else:
            conv = _fft_convolve(a, b)
        polys = (conv.astype(np.int64) % PRIME).astype(np.float64)  # np.fmod is ~30x slower
    return polys[:, 0, : n + 1].astype(np.int64)


_GENERATOR = 7  # a primitive root mod P: 7^((P-1)/q) != 1 for each prime q | P-1 = 2^3 * 3 * 2729
_FIXED_MAX = 256  # point counts up to this get M(t) from its values at t = 0..n-1
_ZERO_LOG = 1 << 30  # the "logarithm" of 0: any sum that includes it marks a product of 0
_LOG_TABLES: list[tuple[np.ndarray, np.ndarray]] = []
_FIXED_INVERSE: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _log_tables() -> tuple[np.ndarray, np.ndarray]:
    """(exp [P-1], log [P + 256]): exp[e] = g^e; log[u] = e with g^e = u mod P, or _ZERO_LOG
    where u mod P = 0 (the table runs 256 past P so that u = s + j needs no reduction)."""
    if not _LOG_TABLES:
        exp = _powers(np.array([_GENERATOR], dtype=np.int64), PRIME - 1)[0]
        log = np.full(PRIME + _FIXED_MAX, _ZERO_LOG, dtype=np.int32)
        log[exp] = np.arange(PRIME - 1, dtype=np.int32)
        log[PRIME:] = log[: _FIXED_MAX]
        _LOG_TABLES.append((exp, log))
    return _LOG_TABLES[0]


def _fixed_inverse(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(W^T [n, n] float64, t^n mod P for t = 0..n-1, log windows): the coefficients
    (ascending) of the polynomial of degree < n that takes values v at t = 0..n-1 are W @ v
    mod P (W is the inverse Vandermonde matrix of 0..n-1, built once per n by interpolating
    the unit vectors with the product tree); the windows are the read-only view [P + 1, n]
    of the log table with row s holding log[s .. s+n-1] (row P - x starts at log(-x))."""
    if n not in _FIXED_INVERSE:
        points = np.broadcast_to(np.arange(n, dtype=np.int64), (n, n))
        lagrange = _interpolate_with(_product_tree(points), points, np.eye(n, dtype=np.int64))
        log = _log_tables()[1]
        windows = as_strided(log, shape=(PRIME + 1, n), strides=(log.strides[0], log.strides[0]), writeable=False)
        _FIXED_INVERSE[n] = (lagrange.astype(np.float64), _powers(points[0], n + 1)[:, n], windows)
    return _FIXED_INVERSE[n]


def _roots_fixed(x: np.ndarray) -> np.ndarray:
    """prod_j (t - x_j) as in ``_product_tree`` ([C, n] -> [C, n+1]), for n <= 256, from its
    values at t = 0..n-1: M(t) = g^(sum_j log(t - x_j)), the logarithms of t + (-x_j mod P)
    for all t read as one window of the log table per x_j; then M(t) - t^n has degree < n
    and the fixed inverse Vandermonde matrix gives its coefficients."""
    batch, n = x.shape
    exp = _log_tables()[0]
    inverse_t, t_to_n, windows = _fixed_inverse(n)
    sums = windows[PRIME - x].sum(axis=1, dtype=np.int64)  # [C, n]: sum over j for each t
    values = np.where(sums >= _ZERO_LOG, 0, exp[sums % (PRIME - 1)])
    values = (values - t_to_n) % PRIME
    roots = np.empty((batch, n + 1), dtype=np.int64)
    roots[:, :n] = np.matmul(values.astype(np.float64), inverse_t).astype(np.int64) % PRIME
    roots[:, n] = 1
    return roots


def _reduce(a: np.ndarray) -> np.ndarray:
    """a mod P for a float64 array of non-negative integers below 2^53, in place, in float64:
    a / P is correctly rounded, so its floor is the exact quotient (a true quotient that is
    not an integer lies at least 1/P from one, far beyond the rounding error). 4-6x faster
    than converting to int64 for ``%``."""
    quotient = np.floor(a / PRIME)
    quotient *= PRIME
    a -= quotient
    return a


def _eval_tables(coeffs: np.ndarray, small: np.ndarray, big: np.ndarray) -> np.ndarray:
    """sum_t c_t x^t with x^(B*g + b) = big[g] * small[b]; coeffs [C, n] -> [C, k]."""
    batch, n = coeffs.shape
    baby, giant = small.shape[-1], big.shape[-1]
    padded = np.zeros((batch, giant * baby), dtype=np.int64)
    padded[:, :n] = coeffs
    # [C, baby, giant], contiguous: the batched product is 2x faster on it (measured)
    blocks = np.ascontiguousarray(padded.reshape(batch, giant, baby).swapaxes(1, 2), dtype=np.float64)
    inner = _reduce(np.matmul(small.astype(np.float64, copy=False), blocks))  # [C, k, giant]
    # sum_g inner * big: each product < P^2, the sum of <= 4096 / 16 of them < 2^53: exact
    out = _reduce(np.einsum("ckg,ckg->ck", inner, big.astype(np.float64, copy=False)))
    return out.astype(np.int64)


def interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients (ascending) of the polynomial of degree < n through (x, y) over GF(P).

    x: int [n] or [C, n], distinct within a row (the caller's duty: not every path checks, and
    repeated points give a wrong polynomial rather than an error), in [0, P). y: int, same shape (any
    non-negative values; reduced mod P). Returns int64 of the same shape.
    """
    x = np.asarray(x, dtype=np.int64)
    y = np.asarray(y, dtype=np.int64) % PRIME
    single = x.ndim == 1
    if single:
        x, y = x[None], y[None]
    n = x.shape[1]
    if n > _FIXED_MAX:
        coeffs = _interpolate_with(_product_tree(x), x, y)
    else:
        fits = x.max(axis=1, initial=0) < PRIME - n  # no point among the fixed points P-n..P-1
        if fits.all():
            coeffs = _interpolate_cauchy(x, y)
        elif x.shape[0] == 1:  # one chunk (a worker proving as it generates): no scatter
            coeffs = _interpolate_moved(x, y)
        else:
            coeffs = np.empty_like(x)
            if fits.any():
                coeffs[fits] = _interpolate_cauchy(x[fits], y[fits])
            coeffs[~fits] = _interpolate_moved(x[~fits], y[~fits])
    return coeffs[0] if single else coeffs


BELOW_MAX_POINTS = _FIXED_MAX  # the most points per row ``interpolate_below`` takes


def interpolate_below(x: np.ndarray, y: np.ndarray, top: int) -> np.ndarray:
    """``interpolate`` for int64 x, y [C, n] with n <= BELOW_MAX_POINTS, distinct non-negative
    x of largest value ``top`` (the caller's, already computed) below P - n, and every y below
    P: the proofs of ``verify.toploc`` call it without ``interpolate``'s conversions and scans
    (a few microseconds of a ~100 us proof). Raises ValueError when the dtypes, n or ``top``
    break that; distinctness and the bounds of y are the caller's duty."""
    n = x.shape[-1]
    if x.dtype != np.int64 or y.dtype != np.int64 or n > BELOW_MAX_POINTS or not 0 <= top < PRIME - n:
        raise ValueError(f"interpolate_below takes int64 points below P - n (n <= {BELOW_MAX_POINTS}); "
                         f"got {x.dtype}/{y.dtype}, n = {n}, largest point {top}")
    return _interpolate_cauchy(x, y)


def _interpolate_moved(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``interpolate`` for rows with a point among P-n..P-1 (n <= 256): rows with none among
    P-2n..P-n-1 (most: about 78% of them for 128 points spread uniformly) take
    ``_interpolate_cauchy`` with those fixed points instead; for the others the points moved by
    s (``_gap_shifts``) all lie below P - n, so ``_interpolate_cauchy`` takes them, and the
    polynomial through (x_j - s, y_j) shifted back by s (``_taylor_shift``) is the one through
    (x_j, y_j) (measured about 1.3x faster than ``_roots_fixed`` + ``_interpolate_with``, one chunk);
    rows without a gap wider than n (only for n > 128, and only for evenly spread points)
    take ``_roots_fixed`` + ``_interpolate_with``."""
    n = x.shape[1]
    second = ~((x >= PRIME - 2 * n) & (x < PRIME - n)).any(axis=1)  # none among P-2n..P-n-1
    if second.all():
        return _interpolate_cauchy(x, y, 2 * n)
    if second.any():
        coeffs = np.empty_like(x)
        coeffs[second] = _interpolate_cauchy(x[second], y[second], 2 * n)
        coeffs[~second] = _interpolate_moved(x[~second], y[~second])
        return coeffs
    shift, gap = _gap_shifts(x)
    wide = gap > n
    if wide.all():
        s = shift[:, None]
        return _taylor_shift(_interpolate_cauchy((x - s) % PRIME, y), s)
    coeffs = np.empty_like(x)
    if wide.any():
        s = shift[wide, None]
        coeffs[wide] = _taylor_shift(_interpolate_cauchy((x[wide] - s) % PRIME, y[wide]), s)
    rest = ~wide
    coeffs[rest] = _interpolate_with(_roots_fixed(x[rest]), x[rest], y[rest])
    return coeffs


def _gap_shifts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x [C, n] (distinct points in GF(P)), the point s that ends the widest gap
    between neighbours on the circle Z/P, and that gap: every x_j - s mod P is then at most
    P - gap (the point before s is gap below it), so below P - n when gap > n; some gap
    is at least P / n (511 for 128 points)."""
    ordered = np.sort(x, axis=1)
    gaps = np.empty_like(ordered)
    np.subtract(ordered[:, 1:], ordered[:, :-1], out=gaps[:, 1:])
    gaps[:, 0] = ordered[:, 0] + PRIME - ordered[:, -1]  # from the largest point round to the smallest
    rows, widest = np.arange(x.shape[0]), gaps.argmax(axis=1)
    return ordered[rows, widest], gaps[rows, widest]


_BINOMIALS: dict[int, np.ndarray] = {}


def _taylor_shift(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Coefficients of p(z) = q(z - s) from those of q, [C, n] with s [C, 1] in (0, P): so that
    the polynomial through (x_j - s, y_j) gives the one through (x_j, y_j).
    p_j = sum_i q_i C(i, j) a^(i-j) = a^-j sum_i (q_i a^i) C(i, j) with a = -s: one product
    with the cached binomials mod P (float64 sums of n < 2^53 / P^2 products: exact), the
    powers of a from the log tables."""
    n = q.shape[1]
    if n not in _BINOMIALS:
        table = np.zeros((n, n), dtype=np.int64)  # table[i, j] = C(i, j) mod P, Pascal's rule
        table[:, 0] = 1
        for i in range(1, n):
            table[i, 1:] = (table[i - 1, 1:] + table[i - 1, :-1]) % PRIME
        _BINOMIALS[n] = table.astype(np.float64)
    exp, log = _log_tables()
    up = exp[np.arange(n, dtype=np.int64) * log[PRIME - s] % (PRIME - 1)]  # a^i, a = -s mod P (never 0)
    scaled = (q * up % PRIME).astype(np.float64)
    return _reduce(np.matmul(scaled, _BINOMIALS[n])).astype(np.int64) * _INV[up] % PRIME


_CAUCHY: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}


def _cauchy_tables(n: int, offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For the fixed points t_u = P - offset + u (u < n; offset n or 2n): (W [n, n] float64, the
    coefficients of the Lagrange basis polynomials of the t_u as rows; w [n], w_u = 1 /
    prod_{v != u} (t_u - t_v) = 1 / prod_{v != u} (u - v); the windows [P + 1, n] of the log
    table and of a float64 table of inverses, row s holding entries s .. s+n-1; -1 / T(x) for
    every x outside the t_u, T as in ``_interpolate_cauchy``). Built once per (n, offset)."""
    if (n, offset) not in _CAUCHY:
        points = np.broadcast_to(np.arange(PRIME - offset, PRIME - offset + n, dtype=np.int64), (n, n))
        lagrange = _interpolate_with(_product_tree(points), points, np.eye(n, dtype=np.int64))
        fact = [1]
        for i in range(1, n):
            fact.append(fact[-1] * i % PRIME)
        weights = np.array([pow(fact[u] * fact[n - 1 - u] * (-1) ** (n - 1 - u), PRIME - 2, PRIME)
                            for u in range(n)], dtype=np.int64)
        log, inverse = _float_tables()
        # -1 / T(x) with T(x) = prod_u (x - t_u) = prod_{s=offset-n+1..offset} (x + s) = (x + offset)! /
        # (x + offset - n)! below the t_u, and the same with x + s - P above them (one gather per chunk
        # instead of six operations on the log factorials; 0 at the t_u, where T(x) = 0)
        exp, log_fact = _log_tables()[0], _log_factorials()
        below, above = np.arange(PRIME - offset), np.arange(PRIME - offset + n, PRIME)
        log_t = np.concatenate([log_fact[below + offset] - log_fact[below + offset - n],
                                log_fact[above + offset - PRIME] - log_fact[above + offset - n - PRIME]])
        inv_t = np.zeros(PRIME, dtype=np.uint16)  # 128 KiB
        inv_t[np.concatenate([below, above])] = PRIME - _INV[exp[log_t % (PRIME - 1)]]  # -1 / T(x)
        _CAUCHY[n, offset] = (lagrange.astype(np.float64), weights, _windows_of(log, n), _windows_of(inverse, n),
                              inv_t)
    return _CAUCHY[n, offset]


_FLOAT_TABLES: list[tuple[np.ndarray, np.ndarray]] = []


def _float_tables() -> tuple[np.ndarray, np.ndarray]:
    """The log table and the table of inverses as float64, extended so that every window row of
    ``_cauchy_tables`` fits; built once, shared by the windows of every n."""
    if not _FLOAT_TABLES:
        log = _log_tables()[1].astype(np.float64)  # P + 256 entries
        inverse = np.concatenate([_INV, _INV[:_FIXED_MAX + 1]]).astype(np.float64)
        _FLOAT_TABLES.append((log, inverse))
    return _FLOAT_TABLES[0]


_LOG_FACTORIALS: list[np.ndarray] = []


def _log_factorials() -> np.ndarray:
    """log(m!) for m in [0, P), as int64 sums of discrete logarithms (not reduced)."""
    if not _LOG_FACTORIALS:
        log = _log_tables()[1]
        _LOG_FACTORIALS.append(np.concatenate([[0], np.cumsum(log[1:PRIME], dtype=np.int64)]))
    return _LOG_FACTORIALS[0]


def _windows_of(table: np.ndarray, n: int) -> np.ndarray:
    """Read-only view [P + 1, n] of a table of at least P + n entries: row s is table[s : s+n]."""
    step = table.strides[0]
    return as_strided(table, shape=(PRIME + 1, n), strides=(step, step), writeable=False)


_ONES = np.ones((1, 1, _FIXED_MAX))
_ONES.flags.writeable = False


def _interpolate_cauchy(x: np.ndarray, y: np.ndarray, offset: int = 0) -> np.ndarray:
    """``interpolate`` for [C, n] points, n <= 256, none among the fixed points t_u = P - offset
    + u (u < n; offset n, the default, or 2n), y reduced: from the values of the polynomial f
    at the t_u, then c = f(t) @ W.

    Every quantity comes from one matrix, the Cauchy matrix I[j, u] = 1 / (t_u - x_j): row j
    is one window of the inverse table (t_u - x_j = P - offset - x_j + u mod P, never 0), as the logs
    of t_u - x_j are one window of the log table. With M(t) = prod_j (t - x_j) and
    T(z) = prod_u (z - t_u):
    M(t_u) = g^(sum_j log(t_u - x_j)); M'(t_u) = M(t_u) sum_j I[j, u]; M' has degree < n, so
    by Lagrange at the t_u, M'(x_j) = -T(x_j) sum_u I[j, u] M'(t_u) w_u, with T(x_j) =
    prod_{s=offset-n+1..offset} (x_j + s) (its inverse read from a table per n and offset); then
    a_j = y_j / M'(x_j) and
    f(t_u) = M(t_u) sum_j a_j I[j, u]. Products and sums of at most 256 entries below P stay
    below 2^53 in float64: exact. Two window gathers and three small matrix products, no
    power tables (measured 25% faster than ``_roots_fixed`` + ``_interpolate_with`` for one
    chunk of 128 points, 10% for 32 chunks)."""
    n = x.shape[1]
    offset = offset or n
    lagrange, weights, log_windows, inverse_windows, inv_t = _cauchy_tables(n, offset)
    exp = _log_tables()[0]
    start = (PRIME - offset) - x  # t_u - x_j = start_j + u (mod P: points above the t_u wrap round)
    if offset != n:
        start %= PRIME
    ones = _ONES[:, :, :n]  # sums over j as matrix products (2-3x faster than .sum(axis=1) here)
    log_m = np.matmul(ones, log_windows[start])[:, 0].astype(np.int64)  # sum_j log(t_u - x_j) < 2^31
    m_t = exp[log_m % (PRIME - 1)]  # M(t_u), [C, n]
    cauchy = inverse_windows[start]  # [C, j, u]
    inv_sum = np.matmul(ones, cauchy)[:, 0].astype(np.int64)  # < n P: not reduced
    scaled = m_t * inv_sum * weights % PRIME  # M'(t_u) w_u (products below n P^3 < 2^63: one reduction)
    sums = np.matmul(cauchy, scaled[..., None].astype(np.float64))[..., 0].astype(np.int64) % PRIME
    # y_j / M'(x_j) = -y_j / (T(x_j) sums_j), -1 / T(x_j) from its table
    a = y * inv_t[x] * _INV[sums] % PRIME  # below P^3
    f = m_t * np.matmul(a[:, None, :].astype(np.float64), cauchy)[:, 0].astype(np.int64) % PRIME  # < n P^3
    return np.matmul(f.astype(np.float64), lagrange).astype(np.int64) % PRIME


def _interpolate_with(roots: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``interpolate`` for [C, n] points, given M(t) = prod_j (t - x_j) as ``roots`` [C, n+1]."""
    batch, n = x.shape
    deriv = roots[:, 1:] * np.arange(1, n + 1, dtype=np.int64) % PRIME  # M'(t), [C, n]
    small, big = _bsgs_tables(x, n)
    weights = _INV[_eval_tables(deriv, small, big)]  # 1 / M'(x_i)
    if np.any(weights == 0):
        raise ValueError("interpolation points must be distinct mod P")
    a = y * weights % PRIME
    # S_t = sum_i a_i x_i^t for t = B*g + b: (a * x^b)^T @ (x^B)^g.
    scaled = (small * a[..., None] % PRIME).astype(np.float64)
    sums = np.matmul(np.swapaxes(scaled, 1, 2), big.astype(np.float64))  # [C, B, G]
    sums = sums.astype(np.int64) % PRIME
    s = np.swapaxes(sums, 1, 2).reshape(batch, -1)[:, :n].astype(np.float64)
    # c_k = sum_t M[k+1+t] S_t: a Hankel matrix of M times S (for one chunk, a correlation).
    if batch == 1:
        return np.correlate(roots[0, 1:].astype(np.float64), s[0], "full")[None, n - 1 :].astype(np.int64) % PRIME
    shifted = np.zeros((batch, 2 * n - 1), dtype=np.float64)
    shifted[:, :n] = roots[:, 1:]
    return np.matmul(_windows(shifted, n), s[..., None])[..., 0].astype(np.int64) % PRIME


def evaluate(coeffs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Evaluate polynomials (ascending coefficients) at points, mod P.

    coeffs: [n] or [C, n]; x: [k] or [C, k] (reduced mod P here). Baby-step / giant-step:
    x^(B*g + b) = (x^B)^g * x^b, so the work is one small matrix product per batch.
    """
    coeffs = np.asarray(coeffs, dtype=np.int64) % PRIME
    x = np.asarray(x, dtype=np.int64) % PRIME
    single = coeffs.ndim == 1
    if single:
        coeffs, x = coeffs[None], x[None]
    small, big = _bsgs_tables(x, coeffs.shape[1])
    out = _eval_tables(coeffs, small, big)
    return out[0] if single else out
