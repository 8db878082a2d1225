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
 * after the first k are read a block at a time; a block whose largest key is no larger than the
 * current top holds no entry that enters (its maximum is a vectorisable loop), and only the
 * other blocks are walked in order, exactly as the heap would see them: their entries above the
 * top when the block starts (a list made without branches) are each compared with the top as it
 * is then, the others cannot enter.
 *
 * topk(bits, k, out): bits a 2-D buffer of 16-bit integers [rows, n] (raw bf16 patterns, or keys
 * already made: the key of a key is itself), each row contiguous; out a writable C-contiguous
 * buffer of 64-bit integers [rows, k]. Requires 1 <= k and 64 * k <= n. STAMP: the build's stamp.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* One row: std::partial_sort's heap over the row, then std::__sort_heap; out[0..k-1]. (Taking
 * every block's maximum first, in a pass of its own, was no faster: measured.) */
static void row_topk(const uint16_t *bits, Py_ssize_t n, Py_ssize_t k, entry *heap, int64_t *out) {
    for (Py_ssize_t i = 0; i < k; i++) {
        heap[i].key = key_of(bits[i]);
        heap[i].pos = (int32_t)i;
    }
    make_heap(heap, k); /* __heap_select */
    uint16_t least = heap[0].key;
    for (Py_ssize_t start = k; start < n; start += BLOCK) {
        Py_ssize_t count = n - start < BLOCK ? n - start : BLOCK, found = 0;
        if (block_max(bits + start, count) <= least)
            continue; /* no entry here is above the top, which only grows: none enters */
        int32_t above[BLOCK]; /* the block's entries above the top now, in order (no branch) */
        for (Py_ssize_t i = 0; i < count; i++) {
            above[found] = (int32_t)i;
            found += key_of(bits[start + i]) > least;
        }
        for (Py_ssize_t j = 0; j < found; j++) {
            Py_ssize_t i = start + above[j];
            uint16_t key = key_of(bits[i]);
            if (key > least) { /* comp(i, first): __pop_heap(first, middle, i) */
                entry value = {key, (int32_t)i};
                adjust_heap(heap, 0, k, value);
                least = heap[0].key;
            }
        }
    }
    for (Py_ssize_t last = k - 1; last > 0; last--) { /* __sort_heap: __pop_heap(first, last, last) */
        entry value = heap[last];
        heap[last] = heap[0];
        adjust_heap(heap, 0, last, value);
    }
    for (Py_ssize_t i = 0; i < k; i++)
        out[i] = heap[i].pos;
}

static int is_format(const Py_buffer *view, const char *codes, Py_ssize_t itemsize) {
    if (view->itemsize != itemsize || view->format == NULL)
        return 0;
    const char *f = view->format;
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    return f[0] != '\0' && f[1] == '\0' && strchr(codes, f[0]) != NULL;
}

static PyObject *topk(PyObject *self, PyObject *args) {
    PyObject *bits_obj, *out_obj;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "OnO:topk", &bits_obj, &k, &out_obj))
        return NULL;
    Py_buffer bits, out;
    if (PyObject_GetBuffer(bits_obj, &bits, PyBUF_RECORDS_RO) < 0)
        return NULL;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&bits);
        return NULL;
    }
    PyObject *result = NULL;
    if (bits.ndim != 2 || !is_format(&bits, "Hh", 2) || bits.strides[1] != 2) {
        PyErr_SetString(PyExc_ValueError, "bits must be 2-D 16-bit integers, each row contiguous");
        goto done;
    }
    Py_ssize_t rows = bits.shape[0], n = bits.shape[1];
    if (out.ndim != 2 || !is_format(&out, "qlQL", 8) || out.shape[0] != rows || out.shape[1] != k) {
        PyErr_Format(PyExc_ValueError, "out must be 64-bit integers [%zd, %zd]", rows, k);
        goto done;
    }
    if (k < 1 || k > n / 64 || n > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "torch runs its heap only for 1 <= k and 64 k <= n: k=%zd, n=%zd", k, n);
        goto done;
    }
    entry *heap = PyMem_RawMalloc((size_t)k * sizeof(entry));
    if (heap == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++)
        row_topk((const uint16_t *)((const char *)bits.buf + r * bits.strides[0]), n, k, heap,
                 (int64_t *)out.buf + r * k);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(heap);
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&bits);
    return result;
}

static PyMethodDef methods[] = {
    {"topk", topk, METH_VARARGS,
     "topk(bits, k, out): torch.topk(k)'s positions of the largest |bf16| per row [rows, n], n >= 64 k, into out [rows, k]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ctopk",
                                    "torch.topk's heap path for |bf16| rows, replayed in C", -1, methods};

PyMODINIT_FUNC PyInit__ctopk(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "STAMP", P2PNET_STAMP) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
