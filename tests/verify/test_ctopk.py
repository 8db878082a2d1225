"""The C top-k (`verify/_ctopk.c`) picks torch.topk's positions, in torch's order, on rows where
torch's CPU kernel runs its heap (n >= 64 k), its interpolation gives verify.gf's coefficients
(so proofs are the same bytes), its evaluation and comparison give verify.gf's values and
verify.toploc's per-chunk counts (so measures are the same ChunkStats), and `verify.topk` uses it
only when built from this tree and not turned off.

Built here into a temporary folder with this interpreter's compiler (`verify.accel`), so the test
runs wherever a run could use it. The reference is what toploc runs: ``bits.view(bfloat16).abs()
.topk(k)``, on tie-heavy rows (bf16 of normal values at a small scale, rows of a handful of
values), with zeros, infinities and NaNs of several patterns and signs. The same rows tell apart
mutants of the C source (libstdc++'s heap with one detail changed), so they do exercise the
details replicated.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import verify
from p2pnet import cbuild
from verify import accel, gf, topk, toploc

torch.set_num_threads(1)


def _build(directory: Path, source: str | None = None, with_stamp: str | None = None) -> Any:
    """The module built into `directory` (from `source`, a mutated copy of the C text, if given)."""
    if (reason := cbuild.unbuildable(accel.PLATFORMS)) is not None:
        pytest.skip(reason)
    if source is not None:
        (directory / accel.SOURCE.name).write_text(source)
        path = cbuild.build([directory / accel.SOURCE.name], accel.MODULE, directory, "mutant", accel.FLAGS,
                            accel.PLATFORMS)
    else:
        path = accel.build(directory, with_stamp)
    return cbuild.import_file(path, accel.MODULE)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _build(tmp_path_factory.mktemp("ctopk"))


def _bits(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _rows(rng: np.random.Generator, rows: int, n: int, kind: int) -> np.ndarray:
    """uint16 bf16 patterns [rows, n] of one of six kinds (five tie-heavy)."""
    shape = (rows, n)
    if kind == 0:  # bf16 of normal values at a small scale: few distinct |values| at the top
        return _bits(rng.standard_normal(shape) * 1e-3)
    if kind == 1:  # a handful of values, both signs, zeros
        return _bits(rng.choice([0.0, -0.0, 1.0, -1.0, 2.0, 0.5, -2.0], size=shape))
    if kind == 2:  # quarter steps of normal values: long ties across the whole row
        return _bits(np.round(rng.standard_normal(shape) * 4) / 4)
    if kind == 3:  # infinities and NaNs of every sign and several payloads among normal values
        bits = _bits(rng.standard_normal(shape))
        for pattern, count in ((0x7F80, 40), (0xFF80, 40), (0x7FC0, 20), (0xFFC0, 10), (0x7F81, 5), (0xFFFF, 5)):
            bits[np.arange(rows)[:, None], rng.integers(0, n, (rows, count))] = pattern
        return bits
    if kind == 4:  # mostly zeros, a few ties above them
        values = np.zeros(shape)
        values[np.arange(rows)[:, None], rng.integers(0, n, (rows, 200))] = rng.choice([1.0, -1.0, 3.0], (rows, 200))
        return _bits(values)
    values = rng.standard_normal(shape)  # massive channels, as real LM-head inputs have: few ties at the top
    values[:, :: n // 16] *= 30.0
    return _bits(values)


def _torch(bits: np.ndarray, k: int) -> np.ndarray:
    """toploc's choice: torch.topk of the |bf16| values (NaN compared as NaN, not as a pattern)."""
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).abs().topk(k, dim=1).indices.numpy()


def _cases() -> list[tuple[np.ndarray, int]]:
    """About 3,800 rows: n from 8,192 (64 k) to 163,840 (32 tokens at hidden 5120), k = 128 and
    a few small k (an odd heap length, a heap of one)."""
    rng = np.random.default_rng(14)
    cases = []
    for n, rows in ((8192, 200), (8193, 100), (12345, 100), (65536, 30), (163840, 10)):
        for kind in range(6):
            cases.append((_rows(rng, rows, n, kind), 128))
    for k in (1, 2, 3, 77, 127):
        for kind in range(6):
            cases.append((_rows(rng, 40, 64 * k + int(rng.integers(0, 500)), kind), k))
    return cases


CASES = _cases()


def _mismatches(module: Any, any_order: bool = False) -> int:
    """Rows whose positions differ from torch.topk's (with ``any_order``: whose sets differ). Each
    case's first row goes alone and the rest (an odd count) after it: the heap takes rows two at
    a time, so both calls end with a row that goes through it alone."""
    bad = 0
    for bits, k in [(part, k) for whole, k in CASES for part in (whole[:1], whole[1:])]:
        assert bits.shape[0] % 2 == 1
        out = np.empty((bits.shape[0], k), dtype=np.int64)
        module.topk(bits, k, out, any_order)
        expected = _torch(bits, k)
        if any_order:
            out, expected = np.sort(out, axis=1), np.sort(expected, axis=1)
        bad += int((out != expected).any(axis=1).sum())
    return bad


def test_positions_and_order_are_torch_topks(built: Any) -> None:
    assert sum(bits.shape[0] for bits, _ in CASES) > 3000
    assert _mismatches(built) == 0


MUTANTS = {  # one detail of libstdc++'s partial_sort each
    "no even-length tail case": [("if ((len & 1) == 0 && child == (len - 2) / 2) {", "if (0) {")],
    "comp(i, first) as >=": [("if (key > least) {", "if (key >= least) {"),
                             ("_mm_set1_epi16((int16_t)least)", "_mm_set1_epi16((int16_t)(least - 1))"),
                             ("(bits[i] & 0x7FFF) > least)", "(bits[i] & 0x7FFF) >= least)"),
                             ("> scan->heap[0].key) { /* comp(i, first) */", ">= scan->heap[0].key) { /* comp(i, first) */"),
                             ("maxima[scan->block / BLOCK] > least)", "maxima[scan->block / BLOCK] >= least)")],
    "the other child on equal keys": [("child -= heap[child].key > heap[child - 1].key;",
                                       "child -= heap[child].key >= heap[child - 1].key;")],
    "push up past equal keys": [("heap[parent].key > value.key", "heap[parent].key >= value.key")],
    # the scan's insertions (replace_top: __adjust_heap from the top, path first, no branch on keys)
    "an insertion stops at an equal key": [("(next.key <= value.key)", "(next.key < value.key)"),
                                             ("next.key <= value.key ? next", "next.key < value.key ? next")],
    "an insertion's hole can go into the padding": [("#define PAD_KEY 0xFFFF", "#define PAD_KEY 0x0000")],
    "an insertion's path a step short": [("while ((len >>= 1) > 0)", "while ((len >>= 1) > 1)")],
    "no NaN key": [("return key > NAN_KEY ? NAN_KEY : key;", "return key;")],
    # the scan's blocks (block_above: the entries of a whole block above the top, as one mask)
    "a block's second half unmarked": [("for (int half = 0; half < 2; half++)", "for (int half = 0; half < 1; half++)")],
    "the entries before the first whole block unread": [("scan_entries(bits, k, first, heap, depth, heap[0].key);", "")],
    "the last, partial block unread": [("scan_entries(scan->bits, scan->block, n, heap, depth, heap[0].key);", "")],
    "a marked entry entering uncompared": [("if (key_of(scan->bits[i]) > scan->heap[0].key) {", "if (1) {")],
    # two rows' insertions in one loop (replace_top2)
    "a paired insertion stops at an equal key": [("next_a.key <= value_a.key", "next_a.key < value_a.key")],
    "a paired insertion takes the other child on equal keys": [
        ("child_b -= heap_b[child_b].key > heap_b[child_b - 1].key;",
         "child_b -= heap_b[child_b].key >= heap_b[child_b - 1].key;")],
    # the row left over from the pairs goes through the heap alone
    "the last, odd row unsorted": [("row_topk(pending, n, k, heaps[0], NULL, !any_order, pending_out);",
                                    "row_topk(pending, n, k, heaps[0], NULL, 0, pending_out);")],
    "the last, odd row left out": [("row_topk(pending, n, k, heaps[0], NULL, !any_order, pending_out);",
                                    "(void)pending_out;")],
}


ANY_ORDER_MUTANTS = {  # the check for rows without a tie (any_order)
    "a tie taken for none": [("if (reach != k)", "if (reach < k)")],
    "the k-th largest left out": [("        if (cand_key[j] >= kth)\n", "        if (cand_key[j] > kth)\n")],
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS) + sorted(ANY_ORDER_MUTANTS))
def test_the_rows_tell_a_mutant_apart(mutant: str, tmp_path: Path) -> None:
    source = accel.SOURCE.read_text()
    for old, new in {**MUTANTS, **ANY_ORDER_MUTANTS}[mutant]:
        assert source.count(old) >= 1, old  # every copy of the rule (the child rule is in two places)
        source = source.replace(old, new)
    assert _mismatches(_build(tmp_path, source), any_order=mutant in ANY_ORDER_MUTANTS) > 0


def test_the_portable_scan_is_torchs_too(tmp_path: Path) -> None:
    """Built without the SSE2 block check (as on a machine without it): the same positions."""
    source = accel.SOURCE.read_text()
    assert source.count("#if defined(__SSE2__)") == 2  # the header and block_above
    assert _mismatches(_build(tmp_path, source.replace("#if defined(__SSE2__)", "#if 0"))) == 0


def test_any_order_gives_torchs_sets(built: Any) -> None:
    """With any_order, every row holds torch's set (the order is the module's own: position
    order where the row has no tie at the k-th place, the heap's where it has), rows with a
    tie at the k-th place and rows without alike, and both kinds occur."""
    tied = untied = 0
    for bits, k in CASES:
        out = np.empty((bits.shape[0], k), dtype=np.int64)
        built.topk(bits, k, out, True)
        expected = _torch(bits, k)
        assert np.array_equal(np.sort(out, axis=1), np.sort(expected, axis=1))
        keys = -np.sort(-np.minimum(bits & 0x7FFF, 0x7F81).astype(np.int32), axis=1)
        tie = keys[:, k - 1] == keys[:, k]
        tied, untied = tied + int(tie.sum()), untied + int((~tie).sum())
    assert tied > 100 and untied > 100


def _tie_edges() -> list[tuple[np.ndarray, int]]:
    """Rows whose tie at the k-th place ends at slot k + extra - 1, k + extra (the widest left
    open: extra = verify.topk._TIE_EXTRA_MAX) and k + extra + 1 (closed: torch's set), with 0,
    60 or 127 entries above it, the entries above and tied packed (few candidates) at the row's
    start or ending in its last, partial block."""
    rng = np.random.default_rng(5)
    k, n, extra = 128, 8192 + 17, topk._TIE_EXTRA_MAX
    rows = []
    for end in (k + extra - 1, k + extra, k + extra + 1):
        for above in (0, 60, 127):
            for start in (0, n - end):
                row = rng.integers(0x1000, 0x1010, n).astype(np.uint16)  # below the tie
                run = np.r_[0x5000 + rng.permutation(above), np.full(end - above, 0x4000)].astype(np.uint16)
                row[start : start + end] = run[rng.permutation(end)] | (rng.integers(0, 2, end) << 15).astype(np.uint16)
                rows.append(row)
    return [(np.stack(rows), k)]


TIE_EDGES = _tie_edges()


def _tie_set_mismatches(module: Any) -> tuple[int, int, int]:
    """(rows whose tie sets differ from verify.topk's numpy path, rows compared, rows with a tie
    open beyond the k-th place) over CASES and TIE_EDGES; cases the module gives up on (too many
    candidates) go to the numpy path and are left out."""
    bad = compared = open_ties = 0
    for bits, k in CASES + TIE_EDGES:
        idx = np.empty((bits.shape[0], k + topk._TIE_EXTRA_MAX), dtype=np.int64)
        above, end = np.empty(bits.shape[0], dtype=np.int64), np.empty(bits.shape[0], dtype=np.int64)
        if not module.tie_sets(bits, k, idx, above, end):
            continue
        keys = topk._abs_keys(*bits.shape)
        topk._abs(bits, out=keys[:, : bits.shape[1]])
        ref, ref_above, ref_end = topk._select_tie_sets(keys, bits.shape[1], k)
        for r in range(bits.shape[0]):
            a, e = ref_above[r], ref_end[r]
            same = above[r] == a and end[r] == e
            for lo, hi in ((0, a), (a, e)):  # each part as a set (the numpy path orders by key first)
                same = same and np.array_equal(np.sort(idx[r, lo:hi]), np.sort(ref[r, lo:hi]))
            if a == e == k:  # torch's set where the tie set is too wide
                same = same and np.array_equal(np.sort(idx[r, :k]), np.sort(_torch(bits[r : r + 1], k)[0]))
            bad += not same
        compared += bits.shape[0]
        open_ties += int((ref_end > k).sum())
    return bad, compared, open_ties


def test_tie_sets_are_verify_topks(built: Any) -> None:
    """tie_sets gives the numpy path's tie sets (the same entries above the tie, the same tied
    entries, torch's set where the tie is too wide to leave open) on the tie-heavy rows."""
    bad, compared, open_ties = _tie_set_mismatches(built)
    assert bad == 0
    assert compared > 3000 and open_ties > 1000


TIE_SET_MUTANTS = {
    "the tied entries' positions lost": [("out[tie++] = cand_pos[j];", "out[tie++] = 0;")],
    "the tie counted above": [("over += cand_key[j] > kth;", "over += cand_key[j] >= kth;")],
    "a wide tie not closed": [("*above = *end = k;", "*above = 0, *end = k;")],
    "a tie set as wide as allowed closed": [("if (over + equal > width)", "if (over + equal >= width)")],
}


@pytest.mark.parametrize("mutant", sorted(TIE_SET_MUTANTS))
def test_the_rows_tell_a_tie_set_mutant_apart(mutant: str, tmp_path: Path) -> None:
    source = accel.SOURCE.read_text()
    for old, new in TIE_SET_MUTANTS[mutant]:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    assert _tie_set_mismatches(_build(tmp_path, source))[0] > 0


def test_tie_sets_chunks_copy_rows_not_contiguous(built: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One-row chunks of a transposed hidden state have a stride between their entries, which the
    C module refuses: verify.topk hands it a copy (as ``_heap_rows`` does) and answers as the numpy
    path does (review: tie_sets_chunks raised ValueError there, where topk_chunks answers)."""
    bits = _rows(np.random.default_rng(9), 8192, 4, 0)  # [8192, 4]: the transpose's rows are columns
    hidden = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).t()
    assert hidden.stride() == (1, 4)
    spare = [np.empty(4, dtype=np.int64) for _ in range(2)]
    assert built.tie_sets(np.ascontiguousarray(bits.T), 128, np.empty((4, 384), dtype=np.int64), *spare)  # C answers
    monkeypatch.setattr(topk, "ACCELERATOR", built)
    idx, _, above, end = topk.tie_sets_chunks(hidden, 0, 4, 1, 128)
    monkeypatch.setattr(topk, "ACCELERATOR", None)
    ref, _, ref_above, ref_end = topk.tie_sets_chunks(hidden, 0, 4, 1, 128)
    assert np.array_equal(above, ref_above) and np.array_equal(end, ref_end)
    for r in range(4):
        for lo, hi in ((0, above[r]), (above[r], end[r])):
            assert np.array_equal(np.sort(idx[r, lo:hi]), np.sort(ref[r, lo:hi]))


def test_rows_torch_would_not_heap_are_refused(built: Any) -> None:
    bits = _rows(np.random.default_rng(1), 2, 8191, 0)
    with pytest.raises(ValueError, match="64 k <= n"):
        built.topk(bits, 128, np.empty((2, 128), dtype=np.int64))
    with pytest.raises(ValueError, match="out must be"):
        built.topk(bits, 64, np.empty((2, 128), dtype=np.int64))
    ends = [np.empty(2, dtype=np.int64) for _ in range(2)]
    with pytest.raises(ValueError, match="64 k <= n"):
        built.tie_sets(bits, 128, np.empty((2, 384), dtype=np.int64), *ends)
    with pytest.raises(ValueError, match="out must be"):  # narrower than k
        built.tie_sets(bits, 64, np.empty((2, 63), dtype=np.int64), *ends)
    with pytest.raises(ValueError, match="out must be"):  # above and end one per row
        built.tie_sets(bits, 64, np.empty((2, 64), dtype=np.int64), np.empty(3, dtype=np.int64), ends[1])


def test_unaligned_buffers_are_refused_not_read(built: Any) -> None:
    """A 16-bit (or 64-bit) array at an odd address would be read with unaligned loads
    (undefined behaviour in C): refused; verify.topk never passes one."""
    raw = np.zeros(2 * 8192 * 2 + 1, dtype=np.uint8)
    bits = raw[1:].view(np.uint16).reshape(2, 8192)  # one byte off
    assert bits.ctypes.data % 2 == 1
    with pytest.raises(ValueError, match="aligned"):
        built.topk(bits, 128, np.empty((2, 128), dtype=np.int64))
    wide = np.zeros(8 * 4 + 4, dtype=np.uint8)[4:].view(np.int64).reshape(1, 4)
    with pytest.raises(ValueError, match="aligned"):
        built.interpolate(wide, np.ones((1, 4), dtype=np.int64), np.empty((1, 4), dtype=np.int64))


def test_topk_uses_a_build_only_with_the_trees_stamp(built: Any, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def install(module: Any) -> Any:  # as if `make install` had put it in the package
        monkeypatch.setitem(sys.modules, "verify._ctopk", module)
        monkeypatch.setattr(verify, "_ctopk", module, raising=False)
        return cbuild.load("verify", "_ctopk", accel.stamp, "P2PNET_VERIFY_PURE", "make install")

    monkeypatch.delenv("P2PNET_VERIFY_PURE", raising=False)
    assert built.STAMP == accel.stamp()
    assert install(built) is built
    with pytest.warns(RuntimeWarning, match="built from another"):
        assert install(_build(tmp_path, with_stamp="0" * 64)) is None
    monkeypatch.setenv("P2PNET_VERIFY_PURE", "1")
    assert install(built) is None


@pytest.mark.parametrize("parts", [[(1, 65536)], [(1, 8192)], [(3, 65536), (2, 65536)], [(4, 4096)]])
def test_topk_of_is_the_same_with_and_without_the_module(built: Any, parts: list[tuple[int, int]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """One chunk alone, several parts, and rows below 64 k (torch.topk either way): torch's sets
    (one chunk alone: in torch's order), the same entries and bit patterns as the numpy path."""
    rng = np.random.default_rng(7)
    arrays = [_rows(rng, rows, n, kind) for kind in (0, 3) for rows, n in parts]
    for group in (arrays[: len(parts)], arrays[len(parts):]):
        monkeypatch.setattr(topk, "ACCELERATOR", built)
        with_c = topk.topk_of(group, 128)
        monkeypatch.setattr(topk, "ACCELERATOR", None)
        without = topk.topk_of(group, 128)
        expected = np.concatenate([_torch(p, 128) for p in group])
        if group[0].shape[1] >= 64 * 128 and expected.shape[0] == 1:  # one chunk alone: torch's order
            assert np.array_equal(with_c[0], expected)
        assert np.array_equal(np.sort(with_c[0], axis=1), np.sort(expected, axis=1))  # torch's sets
        for idx, bits in (with_c, without):  # the numpy path's order is its own: the same sets
            order = np.argsort(idx, axis=1)
            idx[:], bits[:] = np.take_along_axis(idx, order, axis=1), np.take_along_axis(bits, order, axis=1)
        assert np.array_equal(with_c[0], without[0]) and np.array_equal(with_c[1], without[1])


def _distinct(rng: np.random.Generator, n: int, low: int, high: int) -> np.ndarray:
    return low + rng.choice(high - low, n, replace=False)


def _point_sets(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Rows of n distinct points in GF(P) for each of verify.gf's paths: all below P - n (the
    fixed points P-n..P-1), one among P-n..P-1 (the fixed points P-2n..P-n-1), points among both
    (moved by a gap and shifted back), anywhere, and packed at the top of the field."""
    p = gf.PRIME
    sets = [_distinct(rng, n, 0, p - n), np.r_[p - 1 - rng.integers(n), _distinct(rng, n - 1, 0, p - 2 * n)],
            _distinct(rng, n, p - 3 * n, p), _distinct(rng, n, 0, p), p - 1 - rng.permutation(n)]
    return [np.unique(s)[rng.permutation(n)] if np.unique(s).size == n else _distinct(rng, n, 0, p) for s in sets]


@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 127, 128, 255, 256, 300])
def test_interpolation_is_verify_gfs(built: Any, n: int) -> None:
    """The same coefficients as verify.gf over many random point sets of every path (and beyond
    256 points, gf's product tree), rows one by one and batched, values up to 0xFF7F."""
    rng = np.random.default_rng(n)
    rows = [s for _ in range(40 if n <= 128 else 8) for s in _point_sets(rng, n)]
    x = np.stack(rows).astype(np.int64)
    y = rng.integers(0, 0xFF80, x.shape, dtype=np.int64)
    out = np.empty_like(x)
    built.interpolate(x, y, out)
    assert np.array_equal(out, gf.interpolate(x, y))
    one = np.empty((1, n), dtype=np.int64)
    for r in range(0, x.shape[0], 7):
        built.interpolate(x[r : r + 1], y[r : r + 1], one)
        assert np.array_equal(one[0], gf.interpolate(x[r], y[r]))
    if n > 1:
        x[0, 1] = x[0, 0]
        with pytest.raises(ValueError, match="repeated point"):
            built.interpolate(x, y, out)


@pytest.mark.parametrize("width", [65536, 131072, 163840])
def test_proofs_are_the_same_bytes_with_and_without_the_module(built: Any, width: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """verify.toploc._prove's bytes with the C interpolation and with verify.gf's, one chunk alone
    and batched: positions below P (m = P), beyond P but distinct mod P, and colliding mod P (a
    smaller modulus: toploc's downward search), shifted and unshifted point sets alike."""
    rng = np.random.default_rng(width)
    idx = np.stack([_distinct(rng, 128, 0, width) for _ in range(60)]).astype(np.int64)
    if width > gf.PRIME:  # force collisions mod P in a third of the rows
        idx[::3, 1] = idx[::3, 0] % gf.PRIME + gf.PRIME
        idx[::3, 0] %= gf.PRIME
        idx[1::6, :8] = gf.PRIME - 1 - np.arange(8)  # points at the top of the field
    assert all(np.unique(r).size == 128 for r in idx)
    bits = rng.integers(0, 0x7F80, idx.shape, dtype=np.int64) | rng.integers(0, 2, idx.shape) << 15
    for rows in [slice(r, r + 1) for r in range(0, 60, 5)] + [slice(0, 60)]:
        monkeypatch.setattr(topk, "ACCELERATOR", built)
        with_c = toploc._prove((idx[rows], bits[rows]))
        monkeypatch.setattr(topk, "ACCELERATOR", None)
        assert with_c == toploc._prove((idx[rows], bits[rows]))


# ------------------------------------------------------------------ measuring: evaluation and comparison


def _evaluation_cases(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(coefficients [R, n], moduli [R], points [R, k]) for verify.toploc.measure's evaluation: random
    polynomials, the largest coefficients and zeros, coefficients beyond P (the C function's
    contract: any >= 0, reduced as verify.gf reduces them), moduli P (a proof over fewer than P entries),
    smaller and 1, points beyond P and at the top of the field, and polynomials with roots at their
    own points (through zeros: every value there a multiple of P before its last reduction)."""
    rows, p = 24, gf.PRIME
    coeffs = rng.integers(0, p, (rows, n))
    coeffs[0], coeffs[1] = p - 1, 0
    coeffs[2] = rng.integers(p, 1 << 62, n)
    moduli = rng.integers(1, p + 1, rows)
    moduli[::2], moduli[3] = p, 1
    points = rng.integers(0, 4 * p, (rows, k))
    points[5] = p - 1 - np.arange(k) % p
    for r in range(6, 12):  # zero at the row's first min(n, k) points (distinct, below P)
        x = _distinct(rng, n, 0, p)
        y = rng.integers(0, p, n)
        y[: min(n, k)] = 0
        coeffs[r] = gf.interpolate(x, y)
        points[r, : min(n, k)], moduli[r] = x[: min(n, k)], p
    return coeffs, moduli, points


def _evaluation_mismatches(module: Any) -> int:
    """Rows whose values differ from verify.gf.evaluate's at points mod m, over whole and partial
    groups of 16 coefficients and tiles of 64 points, the coefficients and moduli also read from
    one [R, n + 1] array as verify.toploc._decode_many gives them (strided rows and column)."""
    rng = np.random.default_rng(21)
    bad = 0
    for n, k in ((1, 1), (15, 3), (16, 64), (17, 65), (128, 128), (128, 384), (300, 129)):
        coeffs, moduli, points = _evaluation_cases(rng, n, k)
        expected = gf.evaluate(coeffs, points % moduli[:, None])
        assert (expected[6:12, : min(n, k)] == 0).all()
        words = np.concatenate([moduli[:, None], coeffs], axis=1)
        for c, m in ((coeffs, moduli), (words[:, 1:], words[:, 0])):
            out = np.empty(points.shape, dtype=np.int64)
            module.evaluate(c, m, points, out)
            bad += int((out != expected).any(axis=1).sum())
    return bad


def test_evaluation_is_verify_gfs(built: Any) -> None:
    assert _evaluation_mismatches(built) == 0


def test_the_evaluation_without_avx2_is_the_same(tmp_path: Path) -> None:
    """Built without the AVX2 and FMA copy (as for a processor without them): the same values."""
    source = accel.SOURCE.read_text()
    assert source.count("#define HAS_AVX2_PATH 1") == 1
    assert _evaluation_mismatches(_build(tmp_path, source.replace("#define HAS_AVX2_PATH 1", ""))) == 0


def _comparison_cases(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """(committed, recomputed) int64 bf16 patterns [R, k]: tie-heavy and massive-channel rows
    (``_rows``) against themselves, with signs flipped, mantissas moved, exponents changed in some
    or all slots, and committed values as an evaluation gives them (any residue below P); k even and odd."""
    cases = []
    for kind in range(6):
        for k in (128, 127, 17):
            recomputed = _rows(rng, 40, k, kind).astype(np.int64)
            committed = recomputed.copy()
            committed[1] ^= 0x8000  # every sign
            committed[2] ^= rng.integers(0, 8, k)  # mantissa errors
            committed[3] ^= (rng.integers(0, 2, k) << 9)  # some exponents
            committed[4] ^= 0x0100  # every exponent
            committed[5:10] ^= rng.integers(0, 0x10000, (5, k))
            committed[10:15] = rng.integers(0, gf.PRIME, (5, k))
            committed[15:] ^= rng.integers(0, 2, (25, k)) * rng.integers(0, 0x10000, (25, k))
            cases.append((committed, recomputed))
    return cases


def _comparison_mismatches(module: Any) -> int:
    """Rows whose ChunkStats fields differ from verify.toploc._stats of its slot scores (the
    floats bit for bit: the same divisions; inf where no exponent matches)."""
    bad = 0
    for committed, recomputed in _comparison_cases(np.random.default_rng(22)):
        expected = [(s.exp_mismatches, s.mant_err_mean, s.mant_err_median, s.sign_mismatches)
                    for s in toploc._stats(toploc._slot_scores(committed, recomputed))]
        got = module.compare(committed, recomputed)
        assert len(got) == len(expected)
        bad += sum(a != b or type(a[1]) is not float for a, b in zip(got, expected))
    return bad


def test_comparison_is_verify_toplocs(built: Any) -> None:
    assert _comparison_mismatches(built) == 0


MEASURE_MUTANTS = {  # one detail of the evaluation or the comparison each
    "the quotient rounded, not floored": ([("(int32_t)(a * INV_UP)", "(int32_t)(a * INV_UP + 0.5)")],
                                          _evaluation_mismatches),
    "a group's last coefficient left out": ([("for (int b = 1; b < BABY; b++)", "for (int b = 1; b < BABY - 1; b++)")],
                                            _evaluation_mismatches),
    "the coefficients not reduced mod P": ([("(double)(at2(coeffs, r, t) % PRIME)", "(double)at2(coeffs, r, t)")],
                                          _evaluation_mismatches),
    "the modulus ignored": ([("point % PRIME : point % m", "point % PRIME : point % PRIME")], _evaluation_mismatches),
    "a tile's last point unread": ([("const int64_t point = j < len ?", "const int64_t point = j < len - 1 ?")],
                                   _evaluation_mismatches),
    "the lower median": ([("if (below > matched / 2) {", "if (below > (matched - 1) / 2) {")], _comparison_mismatches),
    "a mismatched exponent's mantissa counted": ([("            total += err;\n", ""),
                                                  ("sign_mismatches += (diff >> 15) & 1;",
                                                   "sign_mismatches += (diff >> 15) & 1;\n        total += err;")],
                                                 _comparison_mismatches),
    "the sign counted only with the exponent": ([("sign_mismatches += (diff >> 15) & 1;",
                                                  "sign_mismatches += ((diff >> 15) & 1) && !(diff & 0x7F80);")],
                                                _comparison_mismatches),
}


@pytest.mark.parametrize("mutant", sorted(MEASURE_MUTANTS))
def test_the_cases_tell_a_measure_mutant_apart(mutant: str, tmp_path: Path) -> None:
    edits, mismatches = MEASURE_MUTANTS[mutant]
    source = accel.SOURCE.read_text()
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    assert mismatches(_build(tmp_path, source)) > 0


def test_evaluation_and_comparison_refuse_what_they_cannot_read(built: Any) -> None:
    rows = np.zeros((2, 4), dtype=np.int64)
    with pytest.raises(ValueError, match="moduli must lie"):
        built.evaluate(rows, np.array([0, 1]), rows, np.empty((2, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="moduli must lie"):
        built.evaluate(rows, np.array([1, 1]), rows - 1, np.empty((2, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="coeffs"):
        built.evaluate(rows, np.array([1, 1]), rows, np.empty((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="coeffs"):
        built.evaluate(rows.astype(np.int32), np.array([1, 1]), rows, np.empty((2, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="bf16 patterns"):
        built.compare(rows + 0x10000, rows)
    with pytest.raises(ValueError, match="committed and recomputed"):
        built.compare(rows, rows[:, :3].copy())


@pytest.mark.parametrize("hidden_size,massive", [(576, 0), (896, 0), (896, 8), (2048, 0)])
def test_measures_are_the_same_with_and_without_the_module(built: Any, hidden_size: int, massive: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """verify.toploc.measure, exact and open ties, with the module (its top-k, evaluation and
    comparison) and without it: the same ChunkStats, honest (all zero) and over hidden states moved
    a little, a lot and replaced, a 20-token tail chunk included."""
    from verify.testing import bf16_gaussian

    hidden = bf16_gaussian(hidden_size, 180, hidden_size, massive_channels=massive)
    proofs = toploc.build_proofs(hidden)
    noise = torch.from_numpy(np.random.default_rng(hidden_size).standard_normal(tuple(hidden.shape)))
    for scale in (0.0, 1e-2, 1e-1, 1.0):
        moved = (hidden.double() + scale * noise).to(torch.bfloat16)
        for exact in (True, False):
            monkeypatch.setattr(topk, "ACCELERATOR", built)
            with_c = toploc.measure(moved, proofs, exact_ties=exact)
            monkeypatch.setattr(topk, "ACCELERATOR", None)
            assert with_c == toploc.measure(moved, proofs, exact_ties=exact)
            if scale in (0.0, 1.0):  # honest: all zero; replaced: not (smaller moves may leave the top k as it was)
                assert (scale == 0) == all(s == toploc.ChunkStats(0, 0.0, 0.0, 0) for s in with_c)
