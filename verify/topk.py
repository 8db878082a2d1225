"""Which k entries of a TOPLOC chunk are committed: the k largest |bf16| values, ties at the
k-th place broken exactly as toploc's ``flat.abs().topk(k)`` breaks them on CPU.

Owns: top-k selection over many chunks at once (bit patterns in, flat positions out), and the
choice between the C module (``verify/_ctopk.c``, built by ``verify.accel``) and numpy
(``ACCELERATOR``; ``verify.toploc`` takes the proofs' interpolation, and its measures' evaluation and
per-chunk statistics, from the same module).
Must not: build or measure proofs (``verify.toploc``), run a model, or do I/O.

Where the C module is built (``make install``; on Linux, where torch runs libstdc++'s heap),
from this tree (its stamp) and not turned off (``P2PNET_VERIFY_PURE=1``): every row on torch's
heap path (n >= 64 k: 32 tokens at hidden 256 and more for k = 128) is selected by it, one
chunk alone or many, tied or not: it runs torch's own heap (libstdc++'s partial_sort, the same
comparisons) over the whole row, skipping blocks no entry of which can enter, so its positions
are torch.topk's (one chunk alone: in torch's order). Many chunks at once (proofs and measures
need the set, not its order) come in an order of the module's own (tied rows in the heap's,
unsorted), and first try each row without the heap: where its k-th and (k+1)-th largest differ
the set is unique and comes in position order (about a third faster to verify with massive
channels, measured; the C module stops trying within a call once most rows had a tie). Rows
shorter than 64 k run torch.topk (its nth_element is not replicated). Everything below is the
path without the C module, unchanged: the same sets.

Which of several equal |values| torch.topk keeps is a property of its CPU kernel: for a
row of n entries it runs std::partial_sort (a heap) when k * 64 <= n and std::nth_element
below. One chunk alone shorter than 65,536 entries runs torch.topk itself; one chunk alone
from 65,536 entries (32 tokens at hidden 2,048 and more) replays torch's heap on a short
subsequence (``_heap_topk``) straight away, tied or not, and skips torch.topk where the
subsequence has no tie at the k-th place (``_untied_top``). Otherwise all
chunks are selected together: a threshold per chunk from group maxima, one flat scan for the
entries above it, one sort; chunks without a tie at the k-th place have a unique answer
there; tied chunks take torch's answer, the heap one replayed in rows of at least 32,768
entries, else torch.topk on the whole rows.
torch.topk always runs on the keys as int16 (``_torch_topk``).
A validator measuring with open ties (``verify.toploc.measure(..., exact_ties=False)``, when
its calibration tables were measured so) does not need torch's choice among tied entries:
``tie_sets_chunks`` returns, per chunk, the entries above the tie value and every entry equal
to it, from the same candidates, with no torch.topk or heap replay (by the C module's
``tie_sets`` where it is loaded and rows are at least 64 k long: the same sets; a verify with
open ties 1.3-1.5x faster at hidden 576-896 and 1.5-2.5x at 4096-5120, measured A/B).
Exactness is checked against toploc 0.1.6 itself (tests/verify/test_toploc_ties.py) and
against torch.topk on tie-heavy rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from p2pnet import cbuild
from verify.accel import stamp

_GROUP = 16  # entries per group: a group's maximum bounds its members
_SPREAD = 128  # a group's members lie 128 apart inside one block
_BLOCK = _GROUP * _SPREAD  # keys are padded to whole blocks of 2048 entries
_INF = 0x7F80  # |bf16| pattern of infinity; above it, NaNs
_HEAD_BLOCKS = 3  # blocks the heap replay keeps whole (6,144 entries; torch reads 64 k = 8,192 anyway)
_BOUND_STEP = 4  # the heap replay's bound is renewed after blocks 3 and 12 (``_BOUND_LAST``), not
_BOUND_LAST = 12  # after 3, 6, 12, 24, 48: two partitions instead of five at hidden 5120, for ~1,000-1,400
# later entries instead of ~600; up to 2,048 fit in the 8,192 torch reads in any case (review: 2,082 at
# hidden 8192 with massive channels: a longer subsequence is slower, never wrong)
_HEAP_RATIO = 64  # torch's CPU topk takes std::partial_sort (a heap) when k * 64 <= n
_DIRECT_BELOW = 65536  # one chunk shorter than this runs torch.topk itself (measured: faster below;
# from 65,536 entries one chunk alone replays torch's heap on a subsequence, tied or not)
_NUMPY_MAXIMA_UPTO = 65536  # one chunk alone this wide takes its group maxima by numpy (measured in the
# bench, locked A/B: ~4% faster at hidden 2048, where toploc's call has just evicted the caches; mixed at 4096-5120)
_REPLAY_FROM = 32768  # tied rows this long replay the heap on a subsequence (measured: 28,672 entries
# faster with torch.topk on the whole row, 65,536 faster replayed)
_TIE_EXTRA_MAX = 256  # tie-set entries beyond the k-th place kept open when measuring; more: torch's set
# the built C module (None: not built, stale, or P2PNET_VERIFY_PURE=1), looked up once per process
ACCELERATOR = cbuild.load("verify", "_ctopk", stamp, "P2PNET_VERIFY_PURE", "make install")


def _runs_in_c(n: int, k: int) -> bool:
    """Whether the C module selects rows of ``n`` entries: it is loaded and torch would run its
    heap there (n >= 64 k)."""
    return ACCELERATOR is not None and n >= _HEAP_RATIO * k


def _rows_for_c(rows: np.ndarray) -> np.ndarray:
    """``rows`` [C, n] as the C module takes them, each row contiguous: a copy where a row's
    entries are strided (one-row chunks of a transposed tensor)."""
    return rows if rows.strides[1] == rows.itemsize else np.ascontiguousarray(rows)


def _heap_rows(rows: np.ndarray, k: int, any_order: bool = False) -> np.ndarray | None:
    """torch.topk's positions [C, k] for ``rows`` (uint16 bit patterns or keys [C, n]) by the C
    module, where it selects them (``_runs_in_c``); else None. In torch's order; with
    ``any_order``, torch's set in an order of the module's own: rows without a tie at the k-th
    place (whose set every top-k selection picks) in position order, found without the heap, the
    others in the heap's order, unsorted (both faster)."""
    if not _runs_in_c(rows.shape[1], k):
        return None
    out = np.empty((rows.shape[0], k), dtype=np.int64)
    ACCELERATOR.topk(_rows_for_c(rows), k, out, any_order)
    return out


def _torch_topk(keys: np.ndarray, k: int) -> np.ndarray:
    """torch.topk's positions of the k largest keys per row (what toploc picks), [C, k].

    Run on the keys as int16: torch's CPU kernel takes the same path (heap or nth_element,
    by row length and k alone) and makes the same comparisons as on the |bf16| values, since
    for non-negative patterns integer order and equality are those of |value| (NaNs, which
    torch ranks above all and equal among themselves, are one pattern here: ``_abs``); it
    is 20-30% faster than on bf16 (measured, rows of 8,192 to 131,072 entries).
    """
    picked = _heap_rows(keys, k)  # the C module where it is loaded (the same positions)
    if picked is not None:
        return picked
    return torch.from_numpy(np.ascontiguousarray(keys).view(np.int16)).topk(k, dim=1).indices.numpy()


def _abs(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """|bf16| bit patterns (sign cleared), every NaN pattern made one (0x7F81): their integer
    order is torch's order of the |values|, NaN above everything and equal to NaN."""
    keys = np.bitwise_and(bits, np.uint16(0x7FFF), out=out)
    if keys.max(initial=0) > _INF:
        np.minimum(keys, np.uint16(_INF + 1), out=keys)
    return keys


def _abs_keys(rows: int, n: int) -> np.ndarray:
    """An empty key array [rows, n rounded up to whole blocks], its padding zeroed (a zero never
    outranks a real entry: keys are compared strictly or filtered to positions < n)."""
    width = -(-n // _BLOCK) * _BLOCK
    keys = np.empty((rows, width), dtype=np.uint16)
    keys[:, n:] = 0
    return keys


def _group_maxima(keys: np.ndarray) -> np.ndarray:
    """Maximum of each group [C, width / 16]: group b * 128 + j holds entries b * 2048 + j + 128 i.
    Taken by torch on the keys as int16 (all >= 0): 4x faster than numpy's strided max here."""
    rows, width = keys.shape
    as_int16 = torch.from_numpy(keys.view(np.int16)).view(rows, width // _BLOCK, _GROUP, _SPREAD)
    return as_int16.amax(dim=2).view(rows, -1).numpy().view(np.uint16)


def _group_maxima_np(keys: np.ndarray) -> np.ndarray:
    """``_group_maxima`` by numpy: four halving maxima over the 16 members of each group."""
    rows, width = keys.shape
    v = keys.reshape(rows * (width // _BLOCK), _GROUP, _SPREAD)
    v = np.maximum(v[:, :8], v[:, 8:])
    v = np.maximum(v[:, :4], v[:, 4:])
    v = np.maximum(v[:, :2], v[:, 2:])
    return np.maximum(v[:, 0], v[:, 1]).reshape(rows, -1)


def _heap_topk(keys: np.ndarray, n: int, k: int, maxima: np.ndarray, untied_first: bool = False) -> np.ndarray:
    """torch.topk's positions for rows of ``keys`` [R, n padded] (n >= 64 k), from a short subsequence.

    torch runs std::partial_sort here: a heap of the first k entries, then each later entry
    replaces the heap's least one if it is strictly larger (the heap then holds the k largest
    values seen so far, so its least value before entry i is the k-th largest of entries
    0..i-1). An entry no larger than that never touches the heap. So running torch.topk on a
    subsequence, in the original order, that keeps the first k entries and every entry that
    can enter, padded with zeros to 64 k entries so torch again takes the heap path (zeros
    never enter: keys are >= 0), replays the same heap and picks the same entries. torch
    reads 64 k entries in any case, so the subsequence keeps the first ``_HEAD_BLOCKS``
    blocks whole (6,144 entries), then the entries of each later block above a lower bound
    of the heap's least value there: the k-th largest of the group maxima of the blocks
    before it (k distinct earlier entries at least that large), taken after blocks 3 and 12
    (``_BOUND_LAST``). The later entries are found with one flat scan and scattered into place.
    With ``untied_first`` (one chunk alone, not known to be tied), a row without a tie at the
    subsequence's k-th place takes its k largest (``_untied_top``) without torch.topk.
    """
    rows, width = keys.shape
    blocks = width // _BLOCK
    head = min(blocks, _HEAD_BLOCKS)
    start = head * _BLOCK
    later = np.empty((rows, width - start), dtype=bool)
    done = head
    while done < blocks:  # one flat comparison per stretch of blocks sharing a bound
        seen = done * _SPREAD  # group maxima before block ``done``
        upto = _BOUND_STEP * done if done < _BOUND_LAST else blocks
        bound = np.partition(maxima[:, :seen], seen - k, axis=1)[:, seen - k, None]
        out = later[:, (done - head) * _BLOCK : (upto - head) * _BLOCK]
        np.greater(keys[:, done * _BLOCK : upto * _BLOCK], bound, out=out)
        done = upto
    if rows == 1:  # one chunk alone: no scatter
        flat = np.flatnonzero(later)
        flat += start
        sub = np.zeros((1, max(_HEAP_RATIO * k, start + flat.size)), dtype=keys.dtype)
        sub[0, :start] = keys[0, :start]
        sub[0, start : start + flat.size] = keys[0].take(flat)
        unique = _untied_top(sub[0, : start + flat.size], k, maxima) if untied_first else None
        if unique is not None:
            moved = unique >= start
            unique[moved] = flat.take(unique[moved] - start)
            return unique[None, :]
        picked = _torch_topk(sub, k)
        moved = picked >= start  # never a padding zero: the heap holds k real entries, zeros never enter
        picked[moved] = flat.take(picked[moved] - start)
        return picked
    row, offset = np.divmod(np.flatnonzero(later), width - start)
    counts = np.bincount(row, minlength=rows)
    slot = start + np.arange(row.size) - np.repeat(np.cumsum(counts) - counts, counts)
    sub_width = max(_HEAP_RATIO * k, start + counts.max(initial=0))
    sub = np.zeros((rows, sub_width), dtype=keys.dtype)
    sub[:, :start] = keys[:, :start]
    sub[row, slot] = keys[row, start + offset]
    # where each later slot came from (one column at least: with k <= 96 and nothing later above
    # the bound there is no later slot, and every pick is in the head)
    origin = np.zeros((rows, max(sub_width - start, 1)), dtype=np.int64)
    origin[row, slot - start] = start + offset
    picked = _torch_topk(sub, k)
    later_pick = np.take_along_axis(origin, np.maximum(picked - start, 0), axis=1)
    return np.where(picked < start, picked, later_pick)


def _untied_top(sub: np.ndarray, k: int, maxima: np.ndarray) -> np.ndarray | None:
    """Slots of ``sub`` (one chunk's subsequence in ``_heap_topk``, no padding) holding its k
    largest keys when they are unique (no tie at its k-th place), else None.

    torch.topk on the subsequence picks what it picks on the whole chunk (``_heap_topk``), and
    any top-k selection of a row without a tie at the k-th place picks the same set, so where
    the subsequence has no such tie its k largest are torch's answer without running it (most
    chunks with massive channels; tie-heavy chunks mostly have the tie). They are found among
    its entries >= t, t the k-th largest of the maxima of 16 group maxima (k distinct entries
    of the chunk reach t): when at least k entries of the subsequence do, its k largest are
    among them."""
    level = maxima[0]
    if level.size // _GROUP >= k:
        level = level.reshape(_GROUP, -1).max(axis=0)
    if level.size < k:
        return None
    thresh = np.partition(level, level.size - k)[level.size - k]
    slots = np.flatnonzero(sub >= thresh)
    if slots.size < k:
        return None
    cand = sub.take(slots)
    ordered = np.sort(cand)  # a few hundred entries: cheaper than a partition and a count
    kth = ordered[-k]
    if slots.size > k and ordered[-k - 1] == kth:
        return None
    return slots[cand >= kth]


def _candidates(keys: np.ndarray, n: int, k: int):
    """Every entry that can be in a row's top k, sorted by row, then key descending, then position.

    keys: uint16 [C, n padded to whole blocks] (``_abs_keys``), the |bf16| bit patterns
    (their integer order is the order of |value|, as torch compares them). A threshold t per
    row is the k-th largest group maximum (of maxima of 16 maxima in rows of 32,768 entries or
    more; k distinct entries reach it either way, so every top-k entry is >= t, and so is
    every entry equal to the k-th largest); the entries >= t (a few hundred per row) are found
    with one flat scan of all rows and sorted as one int64 record each (row, inverted key,
    position: one stable sort, 3x faster than an argsort and three gathers, measured).
    Returns (maxima, records, shift, starts, counts): the group maxima, the sorted records
    (row << (shift + 15) | (0x7FFF - key) << shift | position, with shift the bit length of
    n), and per row where its run of records starts and how long it is.
    """
    rows, width = keys.shape
    maxima = _group_maxima(keys)
    level = maxima  # width / 16 >= 128 >= k for k <= 128; more points read every entry
    if level.shape[1] // _GROUP >= k:  # long rows: maxima of 16 maxima (a cheaper partition)
        level = level.reshape(rows, _GROUP, -1).max(axis=1)
    groups = level.shape[1]
    if groups >= k:
        thresh = np.partition(level, groups - k, axis=1)[:, groups - k]
    else:
        thresh = np.zeros(rows, dtype=keys.dtype)
    flat = np.flatnonzero(keys >= thresh[:, None])
    row, pos = np.divmod(flat, width)
    key = keys.reshape(-1)[flat].astype(np.int64)
    if not thresh.all():  # a zero threshold lets the zero padding in: drop it
        real = pos < n
        row, pos, key = row[real], pos[real], key[real]
    shift = int(n).bit_length()
    if shift + 15 + int(rows).bit_length() > 63:
        raise ValueError(f"{rows} chunks of {n} entries do not fit one int64 record each")
    records = np.sort((row << (shift + 15)) | ((0x7FFF - key) << shift) | pos, kind="stable")
    counts = np.bincount(row, minlength=rows)
    starts = np.cumsum(counts) - counts
    return maxima, records, shift, starts, counts


def _select_topk(keys: np.ndarray, n: int, k: int) -> np.ndarray:
    """Positions of the k largest ``keys`` per row, ties broken as toploc's torch.topk: [C, k].

    The candidates come from ``_candidates``. Where the k-th and (k+1)-th largest differ the
    set is unique. Rows with a tie at the k-th place take torch.topk's choice, which depends
    on its CPU kernel: a heap for n >= 64 k, replayed on a short subsequence by ``_heap_topk``
    when rows are long (measured faster from 32,768 entries), else torch.topk on the whole rows.
    """
    maxima, records, shift, starts, counts = _candidates(keys, n, k)
    chosen = np.take(records, starts[:, None] + np.arange(k)[None, :]) & ((1 << shift) - 1)
    # a tie at the k-th place: the entry just below the top k (if any) has the same key
    after = starts + k
    below = np.take(records, np.minimum(after, records.size - 1)) >> shift
    tied = (counts > k) & (below == records[after - 1] >> shift)
    if tied.any():
        if n >= _REPLAY_FROM and n >= _HEAP_RATIO * k and k <= _SPREAD:  # block 0 must hold the first k
            chosen[tied] = _heap_topk(keys[tied], n, k, maxima[tied])
        else:
            chosen[tied] = _torch_topk(keys[tied, :n], k)
    return chosen


def _select_tie_sets(keys: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The k largest ``keys`` per row with the tie at the k-th place left open (for measuring).

    Returns (positions [C, k + e], above [C], end [C]): per row, slots 0..above-1 hold the
    entries strictly larger than the k-th largest key v, slots above..end-1 every entry equal
    to v (the tie set), in position order; later slots are filler. Every choice of k - above
    slots from the tie set, with the slots above, is a top-k set of the row (without a tie
    at the k-th place, end = k and the choice is all of them). A row whose tie set has more
    than ``_TIE_EXTRA_MAX`` entries beyond the k-th place (near-constant chunks) gets
    torch.topk's set instead (above = end = k), so the width stays bounded.
    """
    _, records, shift, starts, _ = _candidates(keys, n, k)
    tie = records[starts + k - 1] >> shift  # (row, inverted key) of each row's k-th entry
    above = np.searchsorted(records, tie << shift) - starts
    end = np.searchsorted(records, (tie + 1) << shift) - starts
    wide = end - k > _TIE_EXTRA_MAX
    if wide.any():
        above[wide] = end[wide] = k
    extra = int((end - k).max())
    slots = np.minimum(starts[:, None] + np.arange(k + extra)[None, :], records.size - 1)
    chosen = np.take(records, slots) & ((1 << shift) - 1)
    if wide.any():
        chosen[wide, :k] = _torch_topk(keys[wide, :n], k)
    return chosen, above, end


def topk_chunks(hidden: torch.Tensor, first_row: int, count: int, rows: int, topk: int):
    """Top-|value| entries of ``count`` chunks of ``rows`` rows, starting at ``first_row``.

    Returns (flat indices int64 [count, k], bf16 bit patterns int64 [count, k]).
    """
    return topk_of([_chunk_patterns(hidden, first_row, count, rows)], topk)


def _chunk_patterns(hidden: torch.Tensor, first_row: int, count: int, rows: int) -> np.ndarray:
    """The bf16 bit patterns of ``count`` chunks of ``rows`` rows from ``first_row``: uint16 [count, n]."""
    patterns = hidden.view(torch.int16).numpy().view(np.uint16)  # numpy slicing: cheaper than torch's
    return patterns[first_row : first_row + count * rows].reshape(count, -1)


def tie_sets_chunks(hidden: torch.Tensor, first_row: int, count: int, rows: int, topk: int):
    """``topk_chunks`` with each chunk's tie at the k-th place left open (``_select_tie_sets``).

    Returns (flat indices int64 [count, k + e], bf16 bit patterns int64 [count, k + e],
    above [count], end [count]).
    """
    bits16 = _chunk_patterns(hidden, first_row, count, rows)
    n = bits16.shape[1]
    k = min(topk, n)
    if (found := _tie_sets_c(bits16, k)) is not None:
        idx, above, end = found
    else:
        keys = _abs_keys(count, n)
        _abs(bits16, out=keys[:, :n])
        idx, above, end = _select_tie_sets(keys, n, k)
    return idx, np.take_along_axis(bits16, idx, axis=1).astype(np.int64), above, end


def _tie_sets_c(bits16: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``_select_tie_sets``' answer by the C module (its ``tie_sets``), from the bit patterns
    [C, n]: the same entries above the tie and the same tie set per row, each part in position
    order, or torch's set where the tie set is wider than ``_TIE_EXTRA_MAX`` beyond the k-th
    place; None where the module is not loaded, rows are shorter than 64 k, or a row has too
    many candidates for it (then the numpy path answers)."""
    if not _runs_in_c(bits16.shape[1], k):
        return None
    rows = bits16.shape[0]
    out = np.empty((rows, k + _TIE_EXTRA_MAX), dtype=np.int64)
    above, end = np.empty(rows, dtype=np.int64), np.empty(rows, dtype=np.int64)
    if not ACCELERATOR.tie_sets(_rows_for_c(bits16), k, out, above, end):
        return None
    return out[:, : max(int(end.max(initial=k)), k)], above, end


def topk_of(parts: Sequence[np.ndarray], topk: int) -> tuple[np.ndarray, np.ndarray]:
    """``topk_chunks`` over chunks given as uint16 bit-pattern arrays [c_i, n] (one n for all)."""
    n = parts[0].shape[1]
    k = min(topk, n)
    if _runs_in_c(n, k):  # torch's heap, run by the C module
        # many chunks (proofs, measures: their sets matter, not the order): rows without a tie
        # found without the heap; one chunk alone: the heap (the check costs about as much there)
        many = len(parts) > 1 or parts[0].shape[0] > 1
        idx = np.concatenate([_heap_rows(p, k, any_order=many) for p in parts])
    elif n < _DIRECT_BELOW and len(parts) == 1 and parts[0].shape[0] == 1:
        # one short chunk alone (32 tokens at hidden sizes up to 2,047): torch.topk itself is
        # faster than the selection below, and toploc's answer by construction
        idx = _torch_topk(_abs(parts[0]), k)
        return idx, parts[0].reshape(-1).take(idx).astype(np.int64)
    elif len(parts) == 1 and parts[0].shape[0] == 1 and k <= _SPREAD:
        # one long chunk alone: torch's heap replayed on a subsequence, tied or not (no
        # candidates, no tie check: cheaper than both where there is a tie, as near where not)
        keys = _abs_keys(1, n)
        np.bitwise_and(parts[0], np.uint16(0x7FFF), out=keys[:, :n])
        maxima_of = _group_maxima_np if keys.shape[1] <= _NUMPY_MAXIMA_UPTO else _group_maxima
        maxima = maxima_of(keys)
        if maxima.max() > _INF:  # NaNs: made one pattern (``_abs``), the maxima taken again
            _abs(parts[0], out=keys[:, :n])
            maxima = maxima_of(keys)
        idx = _heap_topk(keys, n, k, maxima, untied_first=True)
        return idx, parts[0].reshape(-1).take(idx).astype(np.int64)
    else:
        keys = _abs_keys(sum(p.shape[0] for p in parts), n)
        start = 0
        for p in parts:  # the sign mask doubles as the copy into one padded array
            _abs(p, out=keys[start : start + p.shape[0], :n])
            start += p.shape[0]
        idx = _select_topk(keys, n, k)
    bits = np.empty(idx.shape, dtype=np.int64)
    start = 0
    for p in parts:
        stop = start + p.shape[0]
        bits[start:stop] = np.take_along_axis(p, idx[start:stop], axis=1)
        start = stop
    return idx, bits
