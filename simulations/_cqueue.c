/* The engine's event queue in C (`simulations.engine`): a binary min-heap of the engine's entry
 * tuples `(time, sequence, handle, callback, args)` ordered by (time, sequence), with the two keys
 * kept as C numbers beside each tuple, so a comparison is two C compares instead of a tuple's
 * rich comparison through two objects elsewhere in memory (the heap was about a tenth of a big
 * run: `heappop`, `PyObject_RichCompare`, `float_richcompare`).
 *
 * The same order as `heapq` on the tuples: sequences are unique (the engine counts them), so
 * (time, sequence) orders every entry and any heap pops them in that one order. A time is taken
 * as a C double (PyFloat_AsDouble: an int above 2**53 would be rounded, so the engine's times are
 * floats) and must not be NaN (ValueError; `Engine.at` refuses it first); a sequence must be an
 * int that fits 64 bits (OverflowError otherwise), as the engine's are. Compiled into `_cfairshare` with `_cfairshare.c` (one module,
 * one stamp: `simulations.fairshare.stamp`). `heappush(queue, entry)` / `heappop(queue)` take the
 * place of heapq's on a `Queue()`; `queue[0]` is the earliest entry; `len(queue)` the count; it cannot be iterated. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

typedef struct { double when; long long sequence; PyObject *entry; } Slot;

typedef struct {
    PyObject_HEAD
    Slot *heap;
    Py_ssize_t n, size;
} Queue;

static inline int earlier(const Slot *a, const Slot *b) {
    return a->when < b->when || (a->when == b->when && a->sequence < b->sequence);
}

static PyObject *queue_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Queue() takes no arguments");
        return NULL;
    }
    Queue *q = (Queue *)type->tp_alloc(type, 0);
    if (q) { q->heap = NULL; q->n = q->size = 0; }
    return (PyObject *)q;
}

static int queue_traverse(Queue *q, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < q->n; i++) Py_VISIT(q->heap[i].entry);
    return 0;
}

static int queue_clear(Queue *q) {
    /* detach the array first (as list_clear does): a decref may run code that pushes here */
    Slot *heap = q->heap;
    Py_ssize_t n = q->n;
    q->heap = NULL;
    q->n = q->size = 0;
    for (Py_ssize_t i = 0; i < n; i++) Py_DECREF(heap[i].entry);
    PyMem_Free(heap);
    return 0;
}

static void queue_dealloc(Queue *q) {
    PyObject_GC_UnTrack(q);
    queue_clear(q);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static Py_ssize_t queue_len(Queue *q) { return q->n; }

/* queue[0] only: a mapping, not a sequence, so iter(queue) and `x in queue` are TypeErrors
 * instead of seeing the earliest entry alone (a heap's array order is no list's anyway) */
static PyObject *queue_item(Queue *q, PyObject *key) {
    Py_ssize_t i = PyIndex_Check(key) ? PyNumber_AsSsize_t(key, PyExc_IndexError) : -1;
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i != 0 || q->n == 0) {
        PyErr_SetString(PyExc_IndexError, q->n ? "a Queue gives only its earliest entry, [0]" : "the queue is empty");
        return NULL;
    }
    Py_INCREF(q->heap[0].entry);
    return q->heap[0].entry;
}

static PyMappingMethods queue_as_mapping = {.mp_length = (lenfunc)queue_len, .mp_subscript = (binaryfunc)queue_item};

PyTypeObject p2pnet_QueueType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "simulations._cfairshare.Queue",
    .tp_basicsize = sizeof(Queue),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "the engine's event queue: a min-heap of (time, sequence, ...) tuples",
    .tp_new = queue_new,
    .tp_dealloc = (destructor)queue_dealloc,
    .tp_traverse = (traverseproc)queue_traverse,
    .tp_clear = (inquiry)queue_clear,
    .tp_as_mapping = &queue_as_mapping,
};

static PyObject *heappush(PyObject *self, PyObject *args) {
    Queue *q;
    PyObject *entry;
    if (!PyArg_ParseTuple(args, "O!O!:heappush", &p2pnet_QueueType, &q, &PyTuple_Type, &entry)) return NULL;
    if (PyTuple_GET_SIZE(entry) < 2) {
        PyErr_SetString(PyExc_ValueError, "a queue entry starts (time, sequence)");
        return NULL;
    }
    Slot s;
    s.when = PyFloat_AsDouble(PyTuple_GET_ITEM(entry, 0));
    if (s.when == -1.0 && PyErr_Occurred()) return NULL;
    if (isnan(s.when)) {
        PyErr_SetString(PyExc_ValueError, "an event at time NaN");
        return NULL;
    }
    s.sequence = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 1));
    if (s.sequence == -1 && PyErr_Occurred()) return NULL;
    if (q->n == q->size) {
        Py_ssize_t size = q->size ? 2 * q->size : 1024;
        Slot *heap = PyMem_Realloc(q->heap, size * sizeof(Slot));
        if (!heap) return PyErr_NoMemory();
        q->heap = heap;
        q->size = size;
    }
    Py_INCREF(entry);
    s.entry = entry;
    Py_ssize_t i = q->n++;  /* sift up */
    while (i > 0) {
        Py_ssize_t parent = (i - 1) >> 1;
        if (!earlier(&s, &q->heap[parent])) break;
        q->heap[i] = q->heap[parent];
        i = parent;
    }
    q->heap[i] = s;
    Py_RETURN_NONE;
}

static PyObject *heappop(PyObject *self, PyObject *arg) {
    if (!Py_IS_TYPE(arg, &p2pnet_QueueType)) {
        PyErr_Format(PyExc_TypeError, "heappop needs a Queue, not %.100s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    Queue *q = (Queue *)arg;
    if (q->n == 0) {
        PyErr_SetString(PyExc_IndexError, "pop from an empty queue");
        return NULL;
    }
    PyObject *top = q->heap[0].entry;  /* the queue's reference passes to the caller */
    Py_ssize_t n = --q->n;
    if (n) {  /* the last slot sinks from the root */
        Slot last = q->heap[n];
        Py_ssize_t i = 0;
        for (;;) {
            Py_ssize_t child = 2 * i + 1;
            if (child >= n) break;
            if (child + 1 < n && earlier(&q->heap[child + 1], &q->heap[child])) child++;
            if (!earlier(&q->heap[child], &last)) break;
            q->heap[i] = q->heap[child];
            i = child;
        }
        q->heap[i] = last;
    }
    return top;
}

PyMethodDef p2pnet_queue_methods[] = {
    {"heappush", heappush, METH_VARARGS, "heappush(queue, (time, sequence, ...)): as heapq.heappush on a Queue"},
    {"heappop", heappop, METH_O, "heappop(queue): the earliest entry, removed, as heapq.heappop on a Queue"},
    {NULL, NULL, 0, NULL},
};
