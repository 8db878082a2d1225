/* torch.topk's positions for rows where torch's CPU kernel runs std::partial_sort (k * 64 <= n),
 * without torch: the same heap, the same comparisons, so the same k positions in the same order.
 *
 * torch's kernel (aten/src/ATen/native/TopKImpl.h, topk_impl_loop) fills a queue of
 * (value, index) pairs and, for the largest k with k * 64 <= n, runs
 *     std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), comp)
 *     comp(x, y) = (isnan(x) && !isnan(y)) || x > y
 * then reads queue[0..k-1]. libstdc++'s partial_sort is __heap_select (__make_heap on the first
 * k, then each later entry i with comp(i, first) replaces the top by __pop_heap(first, middle, i))
 * and __sort_heap. The helpers below are libstdc++'s __push_heap, __adjust_heap, __make_heap and
 * __pop_heap with the same hole moves, the same tail case for an even length and the same
 * comparisons, on keys instead of pairs: key = |bf16| bit pattern (sign cleared), every NaN
 * pattern made 0x7F81, one above infinity, whose integer order is comp's order (NaN above all,
 * NaNs equal). __pop_heap also writes the old top into queue[i]; torch never reads queue[i]
 * again (partial_sort reads each later entry once), so that write is left out.
 *
 * The scan: comp(i, first) is key[i] > key of the top, and that top only grows. So the entries
 * after the first k are read a block at a time: one compare of the whole block with the top
 * (block_above: SSE2 where the compiler targets it, else a loop) marks the entries above the top
 * when the block starts, a superset of those that can enter; a block with none is skipped, and
 * the marked entries are walked in order, each compared with the top as it is then, exactly as
 * the heap would see them. The others cannot enter.
 *
 * topk(bits, k, out, any_order=False): bits a 2-D buffer of 16-bit integers [rows, n] (raw bf16
 * patterns, or keys already made: the key of a key is itself), each row contiguous; out a writable
 * C-contiguous buffer of 64-bit integers [rows, k]. Requires 1 <= k and 64 * k <= n. Positions in
 * torch's order (__sort_heap's). With any_order, each row's set (torch's) comes unsorted, in an
 * order of the module's own: a row found to have unique k largest keys (row_unique: no tie at the
 * k-th place; tried until most rows of the call had a tie) in position order, found without the
 * heap; every other row in the heap's own order, without __sort_heap (proofs and measures need
 * the set only: 0.57 to 0.49 ms for 32 tie-heavy rows of 18,432, measured). STAMP: the build's stamp.
 *
 * interpolate(x, y, out): the proofs' polynomials (verify.toploc._prove), in the same module:
 * per row of C-contiguous 64-bit x (distinct points in [0, P)) and y (>= 0), the coefficients
 * (ascending) of the polynomial of degree < n through them over GF(P = 65497), into out.
 *
 * evaluate(coeffs, moduli, points, out) and compare(committed, recomputed): what
 * verify.toploc.measure does with them (verify.gf.evaluate at points mod m, and the per-chunk
 * statistics of verify.toploc._stats), exactly, in the same module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#ifndef P2PNET_STAMP
#error "build with -DP2PNET_STAMP=\"...\" (verify/accel.py)"
#endif

#define NAN_KEY 0x7F81 /* every NaN: one above infinity (0x7F80) */
#define BLOCK 32       /* entries whose maximum is taken before any of them is compared (32: faster
                          than 16, 64 or 128 on 32 rows of 65,536 and 163,840, measured) */

typedef struct {
    uint16_t key;
    int32_t pos;
} entry;

static inline uint16_t key_of(uint16_t bits) {
    uint16_t key = bits & 0x7FFF;
    return key > NAN_KEY ? NAN_KEY : key;
}

/* std::__push_heap: move the hole up from `hole` towards `top` while comp(parent, value). */
static void push_heap(entry *heap, Py_ssize_t hole, Py_ssize_t top, entry value) {
    Py_ssize_t parent = (hole - 1) / 2;
    while (hole > top && heap[parent].key > value.key) {
        heap[hole] = heap[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    heap[hole] = value;
}

/* std::__adjust_heap: the hole goes down to a leaf along the child comp prefers (the second
 * child unless the first compares above it), then `value` is pushed back up. */
static void adjust_heap(entry *heap, Py_ssize_t hole, Py_ssize_t len, entry value) {
    const Py_ssize_t top = hole;
    Py_ssize_t child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        child -= heap[child].key > heap[child - 1].key; /* no branch: a third faster, measured */
        heap[hole] = heap[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) { /* an even length: a last lone child */
        child = 2 * (child + 1);
        heap[hole] = heap[child - 1];
        hole = child - 1;
    }
    push_heap(heap, hole, top, value);
}

#define PAD_KEY 0xFFFF /* the keys after a heap: above every key, so never a hole's way down */

/* std::__adjust_heap(first, 0, len, value) where heap[1..len-1] is a heap and heap[len..2 len]
 * hold PAD_KEY, top-down and without a branch on the keys (about 5% faster than stopping at the
 * first entry above `value`, measured): the same path (the same child comparisons; with the
 * padding, a node whose only child is len - 1 picks it, as the even-length tail case does, and a
 * node without children picks padding), each path entry no larger than `value` moved up into the
 * hole. __adjust_heap takes the hole to a leaf and __push_heap brings `value` back up past the
 * path entries above it; the path's keys never decrease downwards (padding last), so the entries
 * that stay moved up are exactly those no larger than `value`, a prefix of the path, and `value`
 * goes where the last of them was: the same heap. depth = floor(log2(len)) steps reach every leaf
 * (the deepest node, len - 1, included), the padding at most one step beyond a leaf. */
static inline void replace_top(entry *heap, int depth, entry value) {
    Py_ssize_t node = 0, hole = 0;
    for (int d = 0; d < depth; d++) {
        Py_ssize_t child = 2 * (node + 1);
        child -= heap[child].key > heap[child - 1].key;
        entry next = heap[child];
        Py_ssize_t move = -(Py_ssize_t)(next.key <= value.key); /* all ones where it moves up */
        heap[hole] = next.key <= value.key ? next : heap[hole];
        hole ^= (hole ^ child) & move;
        node = child;
    }
    heap[hole] = value;
}

/* replace_top on two heaps at once, step for step (the same moves as one after the other). */
static inline void replace_top2(entry *heap_a, entry value_a, entry *heap_b, entry value_b, int depth) {
    Py_ssize_t node_a = 0, hole_a = 0, node_b = 0, hole_b = 0;
    for (int d = 0; d < depth; d++) {
        Py_ssize_t child_a = 2 * (node_a + 1), child_b = 2 * (node_b + 1);
        child_a -= heap_a[child_a].key > heap_a[child_a - 1].key;
        child_b -= heap_b[child_b].key > heap_b[child_b - 1].key;
        entry next_a = heap_a[child_a], next_b = heap_b[child_b];
        heap_a[hole_a] = next_a.key <= value_a.key ? next_a : heap_a[hole_a];
        heap_b[hole_b] = next_b.key <= value_b.key ? next_b : heap_b[hole_b];
        hole_a ^= (hole_a ^ child_a) & -(Py_ssize_t)(next_a.key <= value_a.key);
        hole_b ^= (hole_b ^ child_b) & -(Py_ssize_t)(next_b.key <= value_b.key);
        node_a = child_a;
        node_b = child_b;
    }
    heap_a[hole_a] = value_a;
    heap_b[hole_b] = value_b;
}

static int depth_of(Py_ssize_t len) {
    int depth = 0;
    while ((len >>= 1) > 0)
        depth++;
    return depth;
}

/* std::__make_heap over heap[0..len-1]. */
static void make_heap(entry *heap, Py_ssize_t len) {
    if (len < 2)
        return;
    for (Py_ssize_t parent = (len - 2) / 2;; parent--) {
        adjust_heap(heap, parent, len, heap[parent]);
        if (parent == 0)
            return;
    }
}

/* The largest key of bits[0..count-1]: the masked patterns' maximum as int16 (all >= 0). */
static inline uint16_t block_max(const uint16_t *bits, Py_ssize_t count) {
    int16_t most = 0;
    for (Py_ssize_t j = 0; j < count; j++) {
        int16_t key = (int16_t)(bits[j] & 0x7FFF);
        most = key > most ? key : most;
    }
    return key_of((uint16_t)most);
}

/* Bit i set where entry i of bits[0..BLOCK-1] has its sign-cleared pattern above `least`: every
 * entry whose key is above `least` (a key is that pattern or less), maybe more (a NaN pattern
 * above NAN_KEY when least is NAN_KEY), so each marked entry is still compared by its key. */
static inline uint32_t block_above(const uint16_t *bits, uint16_t least) {
#if defined(__SSE2__)
    const __m128i sign = _mm_set1_epi16(0x7FFF), bound = _mm_set1_epi16((int16_t)least);
    uint32_t mask = 0;
    for (int half = 0; half < 2; half++) { /* 16 entries: two compares packed to one byte each */
        const __m128i *at = (const __m128i *)(bits + 16 * half);
        __m128i low = _mm_cmpgt_epi16(_mm_and_si128(_mm_loadu_si128(at), sign), bound);
        __m128i high = _mm_cmpgt_epi16(_mm_and_si128(_mm_loadu_si128(at + 1), sign), bound);
        mask |= (uint32_t)_mm_movemask_epi8(_mm_packs_epi16(low, high)) << (16 * half);
    }
    return mask;
#else
    uint32_t mask = 0;
    for (int i = 0; i < BLOCK; i++)
        mask |= (uint32_t)((bits[i] & 0x7FFF) > least) << i;
    return mask;
#endif
}

/* Entries bits[start..stop-1] in order, each replacing the top when its key is above it
 * (comp(i, first): __pop_heap(first, middle, i)); returns the new top's key. */
static inline uint16_t scan_entries(const uint16_t *bits, Py_ssize_t start, Py_ssize_t stop, entry *heap,
                                    int depth, uint16_t least) {
    for (Py_ssize_t i = start; i < stop; i++) {
        uint16_t key = key_of(bits[i]);
        if (key > least) {
            entry value = {key, (int32_t)i};
            replace_top(heap, depth, value);
            least = heap[0].key;
        }
    }
    return least;
}

/* A row on its way through std::partial_sort's heap: whole blocks from entry k on are checked
 * at once against the top (block_above, or row_unique's maxima where it ran: never less than
 * the block's largest key); the entries marked are walked in order, each compared with the top
 * as it is then. (Taking every block's maximum first, in a pass of its own, was no faster:
 * measured.) */
typedef struct {
    const uint16_t *bits;
    entry *heap;
    const uint16_t *maxima; /* row_unique's block maxima, or NULL */
    Py_ssize_t block;       /* the start of the block being walked */
    uint32_t mask;          /* its marked entries not walked yet */
} row_scan;

/* The heap of the first k entries (__heap_select's __make_heap), the entries up to the first
 * whole block inserted; the scan then stands before that block. */
static void scan_start(row_scan *scan, const uint16_t *bits, Py_ssize_t n, Py_ssize_t k, entry *heap,
                       const uint16_t *maxima, int depth) {
    for (Py_ssize_t i = 0; i < k; i++) {
        heap[i].key = key_of(bits[i]);
        heap[i].pos = (int32_t)i;
    }
    make_heap(heap, k);
    const Py_ssize_t first = (k + BLOCK - 1) / BLOCK * BLOCK; /* k <= first < k + BLOCK <= n: 64 k <= n */
    scan_entries(bits, k, first, heap, depth, heap[0].key);
    *scan = (row_scan){bits, heap, maxima, first - BLOCK, 0};
}

/* The next entry (in order) whose key is above the top, which the caller then inserts; -1 once
 * the whole blocks are walked (the scan then stands at the last, partial block). */
static inline Py_ssize_t scan_next(row_scan *scan, Py_ssize_t n) {
    for (;;) {
        for (; scan->mask != 0; scan->mask &= scan->mask - 1) {
            Py_ssize_t i = scan->block + __builtin_ctz(scan->mask);
            if (key_of(scan->bits[i]) > scan->heap[0].key) { /* comp(i, first) */
                scan->mask &= scan->mask - 1;
                return i;
            }
        }
        scan->block += BLOCK;
        if (scan->block + BLOCK > n)
            return -1;
        const uint16_t least = scan->heap[0].key;
        if (scan->maxima == NULL || scan->maxima[scan->block / BLOCK] > least)
            scan->mask = block_above(scan->bits + scan->block, least);
    }
}

/* The last, partial block, then (unless `sorted` is 0: the set is wanted, not its order)
 * std::__sort_heap; out[0..k-1]. */
static void scan_finish(row_scan *scan, Py_ssize_t n, Py_ssize_t k, int depth, int sorted, int64_t *out) {
    entry *heap = scan->heap;
    scan_entries(scan->bits, scan->block, n, heap, depth, heap[0].key);
    for (Py_ssize_t last = k - 1; sorted && last > 0; last--) { /* __sort_heap: __pop_heap(first, last, last) */
        entry value = heap[last];
        heap[last] = heap[0];
        adjust_heap(heap, 0, last, value);
    }
    for (Py_ssize_t i = 0; i < k; i++)
        out[i] = heap[i].pos;
}

static inline entry entry_at(const row_scan *scan, Py_ssize_t i) {
    return (entry){key_of(scan->bits[i]), (int32_t)i};
}

/* One row: std::partial_sort's heap over the row (__pop_heap(first, middle, i) for each entry i
 * that scan_next finds), then scan_finish. */
static void row_topk(const uint16_t *bits, Py_ssize_t n, Py_ssize_t k, entry *heap, const uint16_t *maxima,
                     int sorted, int64_t *out) {
    const int depth = depth_of(k);
    row_scan scan;
    scan_start(&scan, bits, n, k, heap, maxima, depth);
    for (Py_ssize_t i; (i = scan_next(&scan, n)) >= 0;)
        replace_top(heap, depth, entry_at(&scan, i));
    scan_finish(&scan, n, k, depth, sorted, out);
}

/* row_topk for two rows at once: while both have an entry to insert, the two insertions run in
 * one loop (two independent chains of loads the processor overlaps: each alone waits on its
 * own; 0.50 to 0.43 ms for 32 tie-heavy rows of 18,432, measured), then each row goes on alone. */
static void rows_topk(const uint16_t *bits[2], Py_ssize_t n, Py_ssize_t k, entry *heaps[2], int sorted,
                      int64_t *out[2]) {
    const int depth = depth_of(k);
    row_scan a, b;
    scan_start(&a, bits[0], n, k, heaps[0], NULL, depth);
    scan_start(&b, bits[1], n, k, heaps[1], NULL, depth);
    Py_ssize_t i = scan_next(&a, n), j = scan_next(&b, n);
    while (i >= 0 && j >= 0) {
        replace_top2(heaps[0], entry_at(&a, i), heaps[1], entry_at(&b, j), depth);
        i = scan_next(&a, n);
        j = scan_next(&b, n);
    }
    for (; i >= 0; i = scan_next(&a, n))
        replace_top(heaps[0], depth, entry_at(&a, i));
    for (; j >= 0; j = scan_next(&b, n))
        replace_top(heaps[1], depth, entry_at(&b, j));
    scan_finish(&a, n, k, depth, sorted, out[0]);
    scan_finish(&b, n, k, depth, sorted, out[1]);
}

/* The k-th smallest of a[0..m-1] (q = k - 1), by Hoare's partition (a is reordered). */
static uint16_t select_kth(uint16_t *a, Py_ssize_t m, Py_ssize_t q) {
    Py_ssize_t lo = 0, hi = m - 1;
    while (lo < hi) {
        uint16_t pivot = a[lo + (hi - lo) / 2];
        Py_ssize_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot)
                i++;
            while (a[j] > pivot)
                j--;
            if (i <= j) {
                uint16_t swap = a[i];
                a[i++] = a[j];
                a[j--] = swap;
            }
        }
        if (q <= j)
            hi = j;
        else if (q >= i)
            lo = i;
        else
            return a[q]; /* between the two parts: equal to the pivot */
    }
    return a[q];
}

#define CANDIDATES 4096 /* entries kept for the check without a heap; more: the heap */

/* One row's candidates for its k largest keys, in position order: the entries >= t, t the k-th
 * largest block maximum (k distinct entries reach it, so the k largest are all >= t, and so is
 * every entry equal to the k-th largest); t is found by a histogram of the maxima' high bytes
 * (the exponent) and then of the low bytes in t's bin. Writes every block's maximum to maxima
 * and the candidates' keys and positions; returns their count (at least k), or -1 where there
 * are more than about CANDIDATES (many blocks tied at t). */
static Py_ssize_t row_candidates(const uint16_t *bits, Py_ssize_t n, Py_ssize_t k, uint16_t *maxima,
                                 uint16_t *cand_key, int32_t *cand_pos) {
    Py_ssize_t blocks = 0, counts[256] = {0};
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        uint16_t most = block_max(bits + start, n - start < BLOCK ? n - start : BLOCK);
        maxima[blocks++] = most;
        counts[most >> 8]++;
    }
    Py_ssize_t high = 255, above = 0; /* blocks whose maximum's high byte is above `high` */
    while (above + counts[high] < k) {
        above += counts[high];
        if (--high < 0)
            return -1;
    }
    Py_ssize_t low_counts[256] = {0};
    for (Py_ssize_t b = 0; b < blocks; b++)
        if (maxima[b] >> 8 == high)
            low_counts[maxima[b] & 0xFF]++;
    Py_ssize_t low = 255;
    while (above + low_counts[low] < k)
        above += low_counts[low--]; /* stops at low >= 0: the bin holds k - above maxima or more */
    const uint16_t t = (uint16_t)(high << 8 | low);
    Py_ssize_t m = 0;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        if (maxima[b] < t)
            continue;
        if (m + BLOCK > CANDIDATES)
            return -1;
        Py_ssize_t start = b * BLOCK, stop = n - start < BLOCK ? n : start + BLOCK;
        for (Py_ssize_t i = start; i < stop; i++) { /* no branch: written, kept if >= t */
            uint16_t key = key_of(bits[i]);
            cand_key[m] = key;
            cand_pos[m] = (int32_t)i;
            m += key >= t;
        }
    }
    return m >= k ? m : -1; /* never below k: k blocks reach t */
}

/* The k-th largest of the m candidates' keys (scratch: room for m keys). */
static uint16_t kth_largest(const uint16_t *cand_key, Py_ssize_t m, Py_ssize_t k, uint16_t *scratch) {
    memcpy(scratch, cand_key, (size_t)m * sizeof(uint16_t));
    return select_kth(scratch, m, m - k);
}

/* One row whose k largest keys are unique (the k-th and the (k+1)-th differ): every top-k
 * selection, torch's included, picks that set, so it is written to out in position order
 * (not torch's order) and 1 returned; 0 (out untouched) where the row has a tie at the k-th
 * place or too many candidates (row_candidates). */
static int row_unique(const uint16_t *bits, Py_ssize_t n, Py_ssize_t k, uint16_t *maxima, uint16_t *cand_key,
                      int32_t *cand_pos, uint16_t *scratch, int64_t *out) {
    const Py_ssize_t m = row_candidates(bits, n, k, maxima, cand_key, cand_pos);
    if (m < 0)
        return 0;
    const uint16_t kth = kth_largest(cand_key, m, k, scratch);
    Py_ssize_t reach = 0;
    for (Py_ssize_t j = 0; j < m; j++)
        reach += cand_key[j] >= kth;
    if (reach != k)
        return 0; /* more than k entries reach the k-th largest: a tie, torch's heap decides */
    for (Py_ssize_t j = 0, i = 0; j < m && i < k; j++)
        if (cand_key[j] >= kth)
            out[i++] = cand_pos[j];
    return 1;
}

/* One row's k largest keys with the tie at the k-th place left open (verify.topk's tie sets):
 * out[0..above-1] the entries above the k-th largest key v, out[above..end-1] every entry equal
 * to v, each part in position order, then filler (position 0) up to `width`; returns 1. Where
 * the entries equal to v reach beyond slot `width` - 1, returns 0 (out, above, end untouched);
 * -1 where row_candidates gives up. */
static int row_tie_set(const uint16_t *bits, Py_ssize_t n, Py_ssize_t k, Py_ssize_t width, uint16_t *maxima,
                       uint16_t *cand_key, int32_t *cand_pos, uint16_t *scratch, int64_t *out, int64_t *above,
                       int64_t *end) {
    const Py_ssize_t m = row_candidates(bits, n, k, maxima, cand_key, cand_pos);
    if (m < 0)
        return -1;
    const uint16_t kth = kth_largest(cand_key, m, k, scratch);
    Py_ssize_t over = 0, equal = 0;
    for (Py_ssize_t j = 0; j < m; j++) {
        over += cand_key[j] > kth;
        equal += cand_key[j] == kth;
    }
    if (over + equal > width)
        return 0;
    for (Py_ssize_t j = 0, hi = 0, tie = over; j < m; j++) {
        if (cand_key[j] > kth)
            out[hi++] = cand_pos[j];
        else if (cand_key[j] == kth)
            out[tie++] = cand_pos[j];
    }
    for (Py_ssize_t i = over + equal; i < width; i++)
        out[i] = 0;
    *above = over;
    *end = over + equal;
    return 1;
}

static int is_format(const Py_buffer *view, const char *codes, Py_ssize_t itemsize) {
    if (view->itemsize != itemsize || view->format == NULL)
        return 0;
    const char *f = view->format;
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    return f[0] != '\0' && f[1] == '\0' && strchr(codes, f[0]) != NULL;
}

/* What topk and tie_sets need of their rows: a 2-D buffer of 16-bit integers, each row contiguous
 * and aligned, on torch's heap path (1 <= k, 64 k <= n). 0, or -1 with ValueError set. */
static int check_rows(const Py_buffer *bits, Py_ssize_t k) {
    if (bits->ndim != 2 || !is_format(bits, "Hh", 2) || bits->strides[1] != 2 || ((uintptr_t)bits->buf & 1) ||
        (bits->strides[0] & 1)) {
        PyErr_SetString(PyExc_ValueError, "bits must be 2-D 16-bit integers, each row contiguous and aligned");
        return -1;
    }
    Py_ssize_t n = bits->shape[1];
    if (k < 1 || k > n / 64 || n > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "torch runs its heap only for 1 <= k and 64 k <= n: k=%zd, n=%zd", k, n);
        return -1;
    }
    return 0;
}

/* A heap of k entries, then its padding (PAD_KEY at k..2 k, never written: replace_top); NULL
 * where memory runs out. */
static entry *new_heap(Py_ssize_t k) {
    entry *heap = PyMem_RawMalloc((size_t)(2 * k + 1) * sizeof(entry));
    for (Py_ssize_t i = k; heap != NULL && i <= 2 * k; i++)
        heap[i] = (entry){PAD_KEY, -1};
    return heap;
}

/* Scratch for row_unique and row_tie_set on rows of n: candidates' keys (CANDIDATES * 2 bytes),
 * their positions (* 4), a copy of the keys to select in (* 2), then the block maxima. */
static char *new_spare(Py_ssize_t n) {
    return PyMem_RawMalloc((size_t)(n / BLOCK + 1) * 2 + CANDIDATES * 8);
}

static PyObject *topk(PyObject *self, PyObject *args) {
    PyObject *bits_obj, *out_obj;
    Py_ssize_t k;
    int any_order = 0;
    if (!PyArg_ParseTuple(args, "OnO|p:topk", &bits_obj, &k, &out_obj, &any_order))
        return NULL;
    Py_buffer bits, out;
    if (PyObject_GetBuffer(bits_obj, &bits, PyBUF_RECORDS_RO) < 0)
        return NULL;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&bits);
        return NULL;
    }
    PyObject *result = NULL;
    if (check_rows(&bits, k) < 0)
        goto done;
    Py_ssize_t rows = bits.shape[0], n = bits.shape[1];
    if (out.ndim != 2 || !is_format(&out, "qlQL", 8) || out.shape[0] != rows || out.shape[1] != k ||
        ((uintptr_t)out.buf & 7)) {
        PyErr_Format(PyExc_ValueError, "out must be 64-bit integers [%zd, %zd]", rows, k);
        goto done;
    }
    entry *heaps[2] = {new_heap(k), new_heap(k)};
    char *spare = any_order ? new_spare(n) : NULL;
    if (heaps[0] == NULL || heaps[1] == NULL || (any_order && spare == NULL)) {
        PyMem_RawFree(heaps[0]);
        PyMem_RawFree(heaps[1]);
        PyMem_RawFree(spare);
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    /* rows of one call are alike (chunks of the same rollouts): once most rows tried had a tie,
     * the rest go to the heap without the check (it costs about as much as the heap, measured) */
    Py_ssize_t unique = 0, tied = 0;
    const uint16_t *pending = NULL; /* a row waiting for a second one to go through the heap with */
    int64_t *pending_out = NULL;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const uint16_t *row = (const uint16_t *)((const char *)bits.buf + r * bits.strides[0]);
        int64_t *picked = (int64_t *)out.buf + r * k;
        uint16_t *maxima = any_order && tied <= unique + 2 ? (uint16_t *)(spare + CANDIDATES * 8) : NULL;
        if (maxima != NULL) {
            if (row_unique(row, n, k, maxima, (uint16_t *)spare, (int32_t *)(spare + CANDIDATES * 2),
                           (uint16_t *)(spare + CANDIDATES * 6), picked)) {
                unique++;
                continue;
            }
            tied++;
            row_topk(row, n, k, heaps[0], maxima, !any_order, picked);
        } else if (pending == NULL) { /* the heap, two rows at a time */
            pending = row;
            pending_out = picked;
        } else {
            const uint16_t *pair[2] = {pending, row};
            int64_t *outs[2] = {pending_out, picked};
            rows_topk(pair, n, k, heaps, !any_order, outs);
            pending = NULL;
        }
    }
    if (pending != NULL)
        row_topk(pending, n, k, heaps[0], NULL, !any_order, pending_out);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(spare);
    PyMem_RawFree(heaps[0]);
    PyMem_RawFree(heaps[1]);
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&bits);
    return result;
}

static PyObject *tie_sets(PyObject *self, PyObject *args) {
    PyObject *bits_obj, *out_obj, *above_obj, *end_obj;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "OnOOO:tie_sets", &bits_obj, &k, &out_obj, &above_obj, &end_obj))
        return NULL;
    Py_buffer bits, views[3];
    PyObject *objs[3] = {out_obj, above_obj, end_obj};
    int got = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(bits_obj, &bits, PyBUF_RECORDS_RO) < 0)
        return NULL;
    for (; got < 3; got++)
        if (PyObject_GetBuffer(objs[got], &views[got], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
            goto done;
    if (check_rows(&bits, k) < 0)
        goto done;
    Py_ssize_t rows = bits.shape[0], n = bits.shape[1], width = views[0].ndim == 2 ? views[0].shape[1] : 0;
    int fits = views[0].ndim == 2 && views[0].shape[0] == rows && width >= k;
    for (int v = 0; v < 3; v++)
        fits = fits && is_format(&views[v], "qlQL", 8) && !((uintptr_t)views[v].buf & 7);
    fits = fits && views[1].ndim == 1 && views[1].shape[0] == rows && views[2].ndim == 1 && views[2].shape[0] == rows;
    if (!fits) {
        PyErr_Format(PyExc_ValueError, "out must be 64-bit integers [%zd, k + extra], above and end [%zd]", rows, rows);
        goto done;
    }
    entry *heap = new_heap(k);
    char *spare = new_spare(n);
    if (heap == NULL || spare == NULL) {
        PyMem_RawFree(heap);
        PyMem_RawFree(spare);
        PyErr_NoMemory();
        goto done;
    }
    int found = 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows && found; r++) {
        const uint16_t *row = (const uint16_t *)((const char *)bits.buf + r * bits.strides[0]);
        int64_t *slots = (int64_t *)views[0].buf + r * width, *above = (int64_t *)views[1].buf + r,
                *end = (int64_t *)views[2].buf + r;
        int got_set = row_tie_set(row, n, k, width, (uint16_t *)(spare + CANDIDATES * 8), (uint16_t *)spare,
                                  (int32_t *)(spare + CANDIDATES * 2), (uint16_t *)(spare + CANDIDATES * 6), slots,
                                  above, end);
        if (got_set == 0) { /* a tie set wider than out: torch's set, the tie closed */
            row_topk(row, n, k, heap, NULL, 0, slots);
            for (Py_ssize_t i = k; i < width; i++)
                slots[i] = 0;
            *above = *end = k;
        }
        found = got_set >= 0;
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(spare);
    PyMem_RawFree(heap);
    result = PyBool_FromLong(found);
done:
    while (got > 0)
        PyBuffer_Release(&views[--got]);
    PyBuffer_Release(&bits);
    return result;
}

/* ------------------------------------------------------------------ interpolation over GF(P) */

#define PRIME 65497u
static uint16_t inverse[PRIME]; /* inverse[a] * a = 1 mod P (inverse[0] = 0), made at import */

static void make_inverses(void) {
    inverse[1] = 1;
    for (uint32_t a = 2; a < PRIME; a++) /* P = (P / a) a + P % a, so 1/a = -(P / a) / (P % a) */
        inverse[a] = (uint16_t)(PRIME - (PRIME / a) * inverse[PRIME % a] % PRIME);
}

/* One row: the coefficients (ascending) of the polynomial of degree < n through (x_j, y_j),
 * by Newton's divided differences, then the Newton form expanded from its innermost term. The
 * polynomial is unique, so any correct method gives verify.gf's coefficients. Every residue is
 * below P < 2^16, so a product plus a residue stays below 2^32. `work` holds 2 n. Returns -1
 * where two points are equal (no such polynomial), else 0. */
static int row_interpolate(const int64_t *x, const int64_t *y, Py_ssize_t n, uint32_t *work, int64_t *out) {
    uint32_t *diff = work, *coeff = work + n;
    for (Py_ssize_t i = 0; i < n; i++)
        diff[i] = (uint32_t)((uint64_t)y[i] % PRIME);
    for (Py_ssize_t j = 1; j < n; j++) {
        for (Py_ssize_t i = n - 1; i >= j; i--) {
            int32_t gap = (int32_t)(x[i] - x[i - j]); /* points in [0, P): the difference in (-P, P) */
            gap += gap < 0 ? (int32_t)PRIME : 0;
            if (gap == 0)
                return -1;
            uint32_t rise = diff[i] + (diff[i] < diff[i - 1] ? PRIME : 0) - diff[i - 1];
            diff[i] = rise * (uint32_t)inverse[gap] % PRIME;
        }
    }
    /* p = diff[n-1]; then p = p (t - x_i) + diff[i] for i = n-2 .. 0 */
    coeff[0] = diff[n - 1];
    for (Py_ssize_t i = n - 2, degree = 0; i >= 0; i--, degree++) {
        uint32_t minus_x = (PRIME - (uint32_t)x[i]) % PRIME;
        coeff[degree + 1] = coeff[degree];
        for (Py_ssize_t d = degree; d >= 1; d--)
            coeff[d] = (coeff[d - 1] + minus_x * coeff[d]) % PRIME;
        coeff[0] = (minus_x * coeff[0] + diff[i]) % PRIME;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = coeff[i];
    return 0;
}

static PyObject *interpolate(PyObject *self, PyObject *args) {
    PyObject *x_obj, *y_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OOO:interpolate", &x_obj, &y_obj, &out_obj))
        return NULL;
    Py_buffer x, y, out;
    if (PyObject_GetBuffer(x_obj, &x, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(y_obj, &y, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&y);
        PyBuffer_Release(&x);
        return NULL;
    }
    PyObject *result = NULL;
    if (x.ndim != 2 || y.ndim != 2 || out.ndim != 2 || !is_format(&x, "qlQL", 8) || !is_format(&y, "qlQL", 8) ||
        !is_format(&out, "qlQL", 8) || x.shape[1] < 1 || y.shape[0] != x.shape[0] || y.shape[1] != x.shape[1] ||
        out.shape[0] != x.shape[0] || out.shape[1] != x.shape[1] || (((uintptr_t)x.buf | (uintptr_t)y.buf |
        (uintptr_t)out.buf) & 7)) {
        PyErr_SetString(PyExc_ValueError, "x, y and out must be aligned 64-bit integers [rows, n], n >= 1, one shape");
        goto done;
    }
    Py_ssize_t rows = x.shape[0], n = x.shape[1], bad = -1;
    const int64_t *xs = x.buf, *ys = y.buf;
    for (Py_ssize_t i = 0; i < rows * n; i++)
        if (xs[i] < 0 || xs[i] >= PRIME || ys[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "points must lie in [0, P) and values be >= 0");
            goto done;
        }
    uint32_t *work = PyMem_RawMalloc(2 * (size_t)n * sizeof(uint32_t));
    if (work == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows && bad < 0; r++)
        if (row_interpolate(xs + r * n, ys + r * n, n, work, (int64_t *)out.buf + r * n) < 0)
            bad = r;
    Py_END_ALLOW_THREADS
    PyMem_RawFree(work);
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "row %zd has a repeated point: no polynomial through it", bad);
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&y);
    PyBuffer_Release(&x);
    return result;
}

/* ------------------------------------------------------------------ evaluation and comparison */

#define BABY 16 /* baby steps: x^0 .. x^15, and x^16 for the giant steps */
#define TILE 64 /* points evaluated together (their powers: 17 * 64 doubles) */

/* a mod P for an integer-valued double 0 <= a < 2^31 P (just below 2^47: the quotient fits an int32), exactly: INV_UP is 1 / P rounded up to the
 * next double, so a * INV_UP is never below a / P (q P is a double no larger than the exact product)
 * and stays below floor(a / P) + 1 (its error, below a 2^-51 / P, is under the 1 / P that separates
 * a / P from the next integer when a is not a multiple of P); its integer part (below 2^31) is
 * floor(a / P), and a - floor(a / P) P (integers below 2^53) is exact. No branch: it vectorises. */
static const double INV_UP = 0x1.002705f1e7da6p-16;

static inline double reduce_p(double a) {
    return a - (double)(int32_t)(a * INV_UP) * PRIME;
}

/* The values of each row's polynomial (coefficients c[0..groups * BABY - 1], zeros past its degree)
 * at points mod m, TILE points at a time: the baby steps x^b (b <= 16) by products, then Horner's
 * rule over the groups of BABY coefficients with x^16 (a group's sum of 16 products below 16 P^2 <
 * 2^36, reduced once): exact in doubles, every value an integer below 2^37. The loops run over the
 * tile's points, so the compiler vectorises them. */
static inline __attribute__((always_inline)) void eval_rows_body(const double *c, Py_ssize_t groups,
                                                                 const int64_t *points, Py_ssize_t k, int64_t m,
                                                                 double (*power)[TILE], int64_t *out) {
    for (Py_ssize_t start = 0; start < k; start += TILE) {
        const Py_ssize_t len = k - start < TILE ? k - start : TILE;
        double acc[TILE], res[TILE];
        for (Py_ssize_t j = 0; j < TILE; j++) { /* a tile's unused slots: the point 0 */
            const int64_t point = j < len ? points[start + j] : 0;
            power[0][j] = 1.0;
            power[1][j] = (double)(m == PRIME ? point % PRIME : point % m);
            res[j] = 0.0;
        }
        for (int b = 2; b <= BABY; b++)
            for (Py_ssize_t j = 0; j < TILE; j++)
                power[b][j] = reduce_p(power[b - 1][j] * power[1][j]);
        for (Py_ssize_t g = groups - 1; g >= 0; g--) {
            const double *cg = c + g * BABY;
            for (Py_ssize_t j = 0; j < TILE; j++)
                acc[j] = cg[0];
            for (int b = 1; b < BABY; b++)
                for (Py_ssize_t j = 0; j < TILE; j++)
                    acc[j] += cg[b] * power[b][j];
            for (Py_ssize_t j = 0; j < TILE; j++) /* res x^16 < P^2, plus acc < 16 P^2 */
                res[j] = reduce_p(res[j] * power[BABY][j] + acc[j]);
        }
        for (Py_ssize_t j = 0; j < len; j++)
            out[start + j] = (int64_t)res[j];
    }
}

static void eval_rows_plain(const double *c, Py_ssize_t groups, const int64_t *points, Py_ssize_t k, int64_t m,
                            double (*power)[TILE], int64_t *out) {
    eval_rows_body(c, groups, points, k, m, power, out);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HAS_AVX2_PATH 1
#endif

#ifdef HAS_AVX2_PATH
/* The same code for processors with AVX2 and FMA (four doubles per instruction, and a product and
 * a sum in one: the same exact integers), chosen at run time. */
__attribute__((target("avx2,fma"))) static void eval_rows_avx2(const double *c, Py_ssize_t groups,
                                                               const int64_t *points, Py_ssize_t k, int64_t m,
                                                               double (*power)[TILE], int64_t *out) {
    eval_rows_body(c, groups, points, k, m, power, out);
}
#endif

/* A 2-D buffer of 64-bit integers, each row contiguous (rows may be strided), or a 1-D one (any
 * stride): its entry (r, j). */
static inline int64_t at2(const Py_buffer *view, Py_ssize_t r, Py_ssize_t j) {
    return *(const int64_t *)((const char *)view->buf + r * view->strides[0] + j * 8);
}

static int is_int64s(const Py_buffer *view, int ndim) {
    return view->ndim == ndim && is_format(view, "qlQL", 8) && !((uintptr_t)view->buf & 7) &&
           !(view->strides[0] & 7) && (ndim == 1 || view->strides[1] == 8);
}

static PyObject *evaluate(PyObject *self, PyObject *args) {
    PyObject *objs[4];
    if (!PyArg_ParseTuple(args, "OOOO:evaluate", &objs[0], &objs[1], &objs[2], &objs[3]))
        return NULL;
    Py_buffer views[4]; /* coeffs [rows, n], moduli [rows], points [rows, k], out [rows, k] */
    const int flags[4] = {PyBUF_RECORDS_RO, PyBUF_RECORDS_RO, PyBUF_RECORDS_RO, PyBUF_RECORDS};
    int got = 0;
    PyObject *result = NULL;
    for (; got < 4; got++)
        if (PyObject_GetBuffer(objs[got], &views[got], flags[got]) < 0)
            goto done;
    const Py_buffer *coeffs = &views[0], *moduli = &views[1], *points = &views[2], *out = &views[3];
    if (!is_int64s(coeffs, 2) || !is_int64s(moduli, 1) || !is_int64s(points, 2) || !is_int64s(out, 2) ||
        coeffs->shape[1] < 1 || moduli->shape[0] != coeffs->shape[0] || points->shape[0] != coeffs->shape[0] ||
        out->shape[0] != points->shape[0] || out->shape[1] != points->shape[1]) {
        PyErr_SetString(PyExc_ValueError, "coeffs [rows, n >= 1], moduli [rows], points and out [rows, k] must be "
                                          "aligned 64-bit integers, each row contiguous");
        goto done;
    }
    const Py_ssize_t rows = coeffs->shape[0], n = coeffs->shape[1], k = points->shape[1];
    const Py_ssize_t groups = (n + BABY - 1) / BABY;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const int64_t m = at2(moduli, r, 0);
        int fine = 1 <= m && m <= PRIME;
        for (Py_ssize_t t = 0; t < n; t++)
            fine &= at2(coeffs, r, t) >= 0;
        for (Py_ssize_t j = 0; j < k; j++)
            fine &= at2(points, r, j) >= 0;
        if (!fine) {
            PyErr_SetString(PyExc_ValueError, "moduli must lie in [1, P], coefficients and points be >= 0");
            goto done;
        }
    }
    double *c = PyMem_RawMalloc((size_t)groups * BABY * sizeof(double));
    double(*power)[TILE] = PyMem_RawMalloc((BABY + 1) * sizeof(*power));
    if (c == NULL || power == NULL) {
        PyMem_RawFree(c);
        PyMem_RawFree(power);
        PyErr_NoMemory();
        goto done;
    }
    void (*eval_rows)(const double *, Py_ssize_t, const int64_t *, Py_ssize_t, int64_t, double(*)[TILE],
                      int64_t *) = eval_rows_plain;
#ifdef HAS_AVX2_PATH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        eval_rows = eval_rows_avx2;
#endif
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++) {
        for (Py_ssize_t t = 0; t < groups * BABY; t++)
            c[t] = t < n ? (double)(at2(coeffs, r, t) % PRIME) : 0.0;
        eval_rows(c, groups, (const int64_t *)((const char *)points->buf + r * points->strides[0]), k,
                  at2(moduli, r, 0), power, (int64_t *)((char *)out->buf + r * out->strides[0]));
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(power);
    PyMem_RawFree(c);
    Py_INCREF(Py_None);
    result = Py_None;
done:
    while (got > 0)
        PyBuffer_Release(&views[--got]);
    return result;
}

/* One row of committed and recomputed bf16 patterns (each in [0, 2^16)), as verify.toploc._stats
 * reads them: out = (entries whose exponent bits 7-14 differ, entries whose sign bit 15 differs,
 * the sum of |mantissa difference| (bits 0-6) over the others, the upper median of those
 * differences (the one at index matched / 2 in ascending order), or -1 where none matched);
 * compare turns them into ChunkStats' fields. */
static void row_compare(const int64_t *committed, const int64_t *recomputed, Py_ssize_t k, int64_t *out) {
    Py_ssize_t counts[128] = {0};
    int64_t exp_mismatches = 0, sign_mismatches = 0, total = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        const int64_t a = committed[j], b = recomputed[j], diff = a ^ b;
        const int64_t err = (a & 0x7F) > (b & 0x7F) ? (a & 0x7F) - (b & 0x7F) : (b & 0x7F) - (a & 0x7F);
        sign_mismatches += (diff >> 15) & 1;
        if (diff & 0x7F80) {
            exp_mismatches++;
        } else {
            total += err;
            counts[err]++;
        }
    }
    const Py_ssize_t matched = k - (Py_ssize_t)exp_mismatches;
    int64_t median = -1;
    for (Py_ssize_t err = 0, below = 0; matched > 0 && err < 128; err++) {
        below += counts[err];
        if (below > matched / 2) {
            median = err;
            break;
        }
    }
    out[0] = exp_mismatches;
    out[1] = sign_mismatches;
    out[2] = total;
    out[3] = median;
}

static PyObject *compare(PyObject *self, PyObject *args) {
    PyObject *objs[2];
    if (!PyArg_ParseTuple(args, "OO:compare", &objs[0], &objs[1]))
        return NULL;
    Py_buffer views[2]; /* committed [rows, k], recomputed [rows, k] */
    int got = 0;
    PyObject *result = NULL;
    for (; got < 2; got++)
        if (PyObject_GetBuffer(objs[got], &views[got], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto done;
    const Py_buffer *committed = &views[0], *recomputed = &views[1];
    if (!is_int64s(committed, 2) || !is_int64s(recomputed, 2) || recomputed->shape[0] != committed->shape[0] ||
        recomputed->shape[1] != committed->shape[1] || committed->shape[1] < 1) {
        PyErr_SetString(PyExc_ValueError, "committed and recomputed must be aligned C-contiguous 64-bit integers "
                                          "[rows, k], k >= 1");
        goto done;
    }
    const Py_ssize_t rows = committed->shape[0], k = committed->shape[1];
    const int64_t *a = committed->buf, *b = recomputed->buf;
    for (Py_ssize_t i = 0; i < rows * k; i++)
        if (a[i] < 0 || a[i] > 0xFFFF || b[i] < 0 || b[i] > 0xFFFF) {
            PyErr_SetString(PyExc_ValueError, "bf16 patterns must lie in [0, 2^16)");
            goto done;
        }
    if ((result = PyList_New(rows)) == NULL)
        goto done;
    for (Py_ssize_t r = 0; r < rows; r++) {
        int64_t counts[4];
        row_compare(a + r * k, b + r * k, k, counts);
        const int64_t matched = k - counts[0];
        /* the mean as numpy divides the two int64 counts: each made a double (exact), one division */
        PyObject *row = Py_BuildValue("(LddL)", (long long)counts[0],
                                      matched > 0 ? (double)counts[2] / (double)matched : Py_HUGE_VAL,
                                      matched > 0 ? (double)counts[3] : Py_HUGE_VAL, (long long)counts[1]);
        if (row == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, r, row);
    }
done:
    while (got > 0)
        PyBuffer_Release(&views[--got]);
    return result;
}

static PyMethodDef methods[] = {
    {"topk", topk, METH_VARARGS,
     "topk(bits, k, out, any_order=False): torch.topk(k)'s positions of the largest |bf16| per row [rows, n], "
     "n >= 64 k, into out [rows, k], in torch's order; with any_order, each row's set (torch's) unsorted: rows "
     "found without a tie at the k-th place in position order, the others in the heap's order"},
    {"tie_sets", tie_sets, METH_VARARGS,
     "tie_sets(bits, k, out, above, end): per row [rows, n], n >= 64 k, the entries above the k-th largest |bf16| "
     "then every entry equal to it, each in position order, into out [rows, width]; above, end [rows] where each "
     "part ends; a row whose tie reaches past width: torch's set, above = end = k. False where a row has too "
     "many candidates (nothing usable written)"},
    {"interpolate", interpolate, METH_VARARGS,
     "interpolate(x, y, out): coefficients (ascending) of the polynomial of degree < n through each row's points over GF(65497)"},
    {"evaluate", evaluate, METH_VARARGS,
     "evaluate(coeffs, moduli, points, out): each row's polynomial (ascending coefficients [rows, n]) at its points "
     "[rows, k] mod its modulus [rows], over GF(65497), into out [rows, k]"},
    {"compare", compare, METH_VARARGS,
     "compare(committed, recomputed): per row of bf16 patterns [rows, k], verify.toploc.ChunkStats' fields "
     "(exponent mismatches, mean and upper median of the mantissa errors where exponents match or inf, sign "
     "mismatches) as a list of tuples"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ctopk",
                                    "torch.topk's heap path for |bf16| rows, and interpolation, evaluation and comparison over GF(65497), in C", -1, methods};

PyMODINIT_FUNC PyInit__ctopk(void) {
    make_inverses();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "STAMP", P2PNET_STAMP) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
