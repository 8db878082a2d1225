/* `simulations.fairshare.share` in C: the same progressive filling, the same float operations in
 * the same order, so a run is byte for byte the run the Python function gives (tests/simulations/
 * test_sim_fairshare_accel.py replays broadcasts with both and compares their outputs).
 *
 * Why: `share` is half of a big run's time (2,000 relays, 10 GB: 715,598 calls over about 25
 * flows each), all of it per-flow Python bytecode. Built by `python -m simulations.accel` (or
 * `make sim-accel`) with -ffp-contract=off (no fused multiply-add: every product and sum is
 * rounded as Python rounds it); `simulations.fairshare` uses it when it is built and the
 * interpreter's float `sum()` adds in order (CPython before 3.12; 3.12 compensates), else the
 * Python function. Keep the two in step: a change to one is a change to the other.
 *
 * Differences that change no result: the per-call scratch (which flows share which resource,
 * limits, levels) lives in C arrays instead of the flows' and ports' scratch fields, and a flow
 * of a full resource is found by scanning the call's flows in order (the order `use[3]` has).
 * The module state (interned names, the learnt slot layouts, g_limit for qsort) is static: calls are
 * serialised by the GIL. The module also carries the engine's event queue (`_cqueue.c`, compiled in). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* the build's stamp (simulations.fairshare.stamp(), passed by simulations.accel): the simulator
 * uses this module only while it matches the tree's */
#ifndef P2PNET_STAMP
#error "build with simulations.accel (python -m simulations.accel), which passes -DP2PNET_STAMP"
#endif

static PyObject *s_now, *s_at, *s_retime, *s_cancel, *minus_one;

/* A flow's or a port's fields, read and written at their slots' offsets where the object is of
 * the class this module learnt (`_Flow`, `_Port`: __slots__ classes with plain attribute access),
 * else through PyObject_GetAttr / SetAttr; the same values either way (a slot written here is
 * written as its member descriptor writes it). The class is learnt, and checked unchanged since
 * (its version tag), at the start of every call, from the first flow and its ports; any other
 * object takes the attribute path. A class changed by Python code that this call itself runs
 * (engine.at, a finalizer) keeps its learnt slots until the next call: the slots still exist in
 * the object, so this can change no memory, only which access a contrived class sees. */
enum { F_SRC, F_DST, F_CAP, F_RATE, F_HANDLE, F_REMAINING, F_SINCE, F_N };
enum { P_UP, P_DOWN, P_UPLOAD_BPS, P_DOWNLOAD_BPS, P_UP_LOAD, P_DOWN_LOAD, P_N };
#define MAX_FIELDS 8
typedef struct {
    PyTypeObject *type;  /* the learnt class (a strong reference), NULL: none */
    unsigned int tag;  /* its tp_version_tag when learnt: a class changed since has another */
    int n;
    PyObject *names[MAX_FIELDS];
    Py_ssize_t off[MAX_FIELDS];
} Layout;
static Layout L_flow = {.n = F_N}, L_port = {.n = P_N};

/* learn `type`'s slots for lay's fields: every one a writable object slot (a member descriptor
 * T_OBJECT_EX) found by the class's own lookup, plain getattr/setattr; else lay learns nothing
 * and every object of that class takes the attribute path */
static void learn(Layout *lay, PyTypeObject *type) {
    if (lay->type == type && (type->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) && type->tp_version_tag == lay->tag)
        return;
    Py_CLEAR(lay->type);
    if (type->tp_getattro != PyObject_GenericGetAttr || type->tp_setattro != PyObject_GenericSetAttr) return;
    for (int k = 0; k < lay->n; k++) {
        PyObject *d = _PyType_Lookup(type, lay->names[k]);  /* borrowed; gives the class a version tag */
        if (!d || !Py_IS_TYPE(d, &PyMemberDescr_Type)) return;
        /* a descriptor of another class (put in this one's dict) has that class's offsets */
        if (!PyType_IsSubtype(type, PyDescr_TYPE(d))) return;
        PyMemberDef *member = ((PyMemberDescrObject *)d)->d_member;
        if (member->type != T_OBJECT_EX || (member->flags & READONLY)) return;
        lay->off[k] = member->offset;
    }
    if (!(type->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)) return;
    Py_INCREF(type);
    lay->type = type;
    lay->tag = type->tp_version_tag;
}

/* where o's field k lives when o is of lay's learnt class, else NULL */
static inline PyObject **slot_of(PyObject *o, const Layout *lay, int k) {
    return Py_TYPE(o) == lay->type ? (PyObject **)((char *)o + lay->off[k]) : NULL;
}

/* o's field k: a new reference, NULL with AttributeError when unset */
static PyObject *geto(PyObject *o, const Layout *lay, int k) {
    PyObject **p = slot_of(o, lay, k);
    if (!p) return PyObject_GetAttr(o, lay->names[k]);
    if (!*p) {
        PyErr_Format(PyExc_AttributeError, "'%.100s' object has no attribute '%U'", Py_TYPE(o)->tp_name, lay->names[k]);
        return NULL;
    }
    Py_INCREF(*p);
    return *p;
}

/* v as a double, consuming v (a new reference, or NULL with an exception set) */
static int take_double(PyObject *v, double *out) {
    if (!v) return -1;
    double d = PyFloat_AsDouble(v);
    Py_DECREF(v);
    if (d == -1.0 && PyErr_Occurred()) return -1;
    *out = d;
    return 0;
}

static int getd(PyObject *o, const Layout *lay, int k, double *out) {
    PyObject **p = slot_of(o, lay, k);
    if (p && *p && PyFloat_CheckExact(*p)) {
        *out = PyFloat_AS_DOUBLE(*p);
        return 0;
    }
    return take_double(geto(o, lay, k), out);
}

static int seto(PyObject *o, const Layout *lay, int k, PyObject *v) {
    PyObject **p = slot_of(o, lay, k);
    if (!p) return PyObject_SetAttr(o, lay->names[k], v);
    PyObject *old = *p;  /* as the member descriptor sets it */
    Py_INCREF(v);
    *p = v;
    Py_XDECREF(old);
    return 0;
}

static int setd(PyObject *o, const Layout *lay, int k, double d) {
    PyObject *v = PyFloat_FromDouble(d);
    if (!v) return -1;
    int r = seto(o, lay, k, v);
    Py_DECREF(v);
    return r;
}

/* port.up or port.down (a new reference), which must be a list: TypeError otherwise */
static PyObject *port_flows(PyObject *port, int down) {
    PyObject *lst = geto(port, &L_port, down ? P_DOWN : P_UP);
    if (lst && !PyList_Check(lst)) {
        PyErr_Format(PyExc_TypeError, "the C fair share needs a port's up/down flows as a list, not %.100s",
                     Py_TYPE(lst)->tp_name);
        Py_CLEAR(lst);
    }
    return lst;
}

/* sum of the rates of list `lst` in order, as Python's sum() over floats (3.11: plain adds) */
static int sum_rates(PyObject *lst, double *out) {
    double s = 0.0;
    Py_ssize_t n = PyList_GET_SIZE(lst);
    for (Py_ssize_t k = 0; k < n; k++) {
        double r;
        if (getd(PyList_GET_ITEM(lst, k), &L_flow, F_RATE, &r) < 0) return -1;
        s += r;
    }
    *out = s;
    return 0;
}

/* the cached load of port (up or down), summed afresh and stored when not known */
static int port_load(PyObject *port, int down, double *out) {
    int cache = down ? P_DOWN_LOAD : P_UP_LOAD;
    double used;
    if (getd(port, &L_port, cache, &used) < 0) return -1;
    if (used < 0.0) {
        PyObject *lst = port_flows(port, down);
        if (!lst) return -1;
        int r = sum_rates(lst, &used);
        Py_DECREF(lst);
        if (r < 0 || setd(port, &L_port, cache, used) < 0) return -1;
    }
    *out = used;
    return 0;
}

typedef struct { PyObject *port; int down; Py_ssize_t count, res; } Rec;  /* a resource seen in this call */
typedef struct { double cap0, given, at; Py_ssize_t rising, rec, nmine; } Res;  /* a shared one (`use`) */

typedef struct { Rec *recs; Py_ssize_t nrecs; Py_ssize_t *table; size_t mask; } Map;

static Py_ssize_t map_get(Map *m, PyObject *port, int down) {
    size_t h = (((size_t)port) >> 4) * 2 + (size_t)down;
    h ^= h >> 17;
    for (size_t k = h & m->mask;; k = (k + 1) & m->mask) {
        Py_ssize_t idx = m->table[k];
        if (idx < 0) {
            idx = m->nrecs++;
            m->recs[idx].port = port; m->recs[idx].down = down; m->recs[idx].count = 0; m->recs[idx].res = -1;
            m->table[k] = idx;
            return idx;
        }
        if (m->recs[idx].port == port && m->recs[idx].down == down) return idx;
    }
}

static double *g_limit;
static int cmp_limit(const void *a, const void *b) {
    Py_ssize_t i = *(const Py_ssize_t *)a, j = *(const Py_ssize_t *)b;
    double x = g_limit[i], y = g_limit[j];
    if (x < y) return -1;
    if (y < x) return 1;
    return (i > j) - (i < j);  /* stable, as sorted() */
}

static PyObject *share(PyObject *self, PyObject *args) {
    PyObject *flows, *tag, *engine, *finish;
    if (!PyArg_ParseTuple(args, "O!OOO", &PyList_Type, &flows, &tag, &engine, &finish)) return NULL;
    /* our own tuple of the flows: engine.at / retime / cancel run Python code, which could change the list */
    if (!(flows = PyList_AsTuple(flows))) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(flows);
    if (n == 0) { Py_DECREF(flows); Py_RETURN_NONE; }
    PyObject *result = NULL;
    size_t tsize = 4; while (tsize < 4 * n + 4) tsize <<= 1;
    /* the call's scratch, in one block: flows' ports, limits, levels, rates, resources, order */
    size_t bytes = 2 * n * sizeof(PyObject *) + 3 * n * sizeof(double) + 6 * n * sizeof(Py_ssize_t) +
        2 * n * sizeof(Rec) + tsize * sizeof(Py_ssize_t) + 2 * n * sizeof(Res);
    char *block = malloc(bytes), *at = block;
    if (!block) { Py_DECREF(flows); return PyErr_NoMemory(); }
#define TAKE(type, count) ((type *)((at += (count) * sizeof(type)) - (count) * sizeof(type)))
    PyObject **src = TAKE(PyObject *, n), **dst = TAKE(PyObject *, n);  /* zeroed: released at done */
    double *limit = TAKE(double, n), *level = TAKE(double, n), *rate = TAKE(double, n);
    Py_ssize_t *srec = TAKE(Py_ssize_t, n), *drec = TAKE(Py_ssize_t, n), *sres = TAKE(Py_ssize_t, n),
        *dres = TAKE(Py_ssize_t, n), *order = TAKE(Py_ssize_t, n), *stop = TAKE(Py_ssize_t, n);
    Map m; m.recs = TAKE(Rec, 2 * n); m.nrecs = 0; m.table = TAKE(Py_ssize_t, tsize); m.mask = tsize - 1;
    Res *res = TAKE(Res, 2 * n); Py_ssize_t nres = 0;
#undef TAKE
    memset(block, 0, 2 * n * sizeof(PyObject *));
    memset(m.table, -1, tsize * sizeof(Py_ssize_t));
    learn(&L_flow, Py_TYPE(PyTuple_GET_ITEM(flows, 0)));
    /* count the flows on each resource */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyTuple_GET_ITEM(flows, i);
        level[i] = -1.0;
        if (!(src[i] = geto(f, &L_flow, F_SRC)) || !(dst[i] = geto(f, &L_flow, F_DST))) goto done;
        if (i == 0) learn(&L_port, Py_TYPE(src[0]));
        srec[i] = map_get(&m, src[i], 0);
        m.recs[srec[i]].count++;
        double dl;
        if (getd(dst[i], &L_port, P_DOWNLOAD_BPS, &dl) < 0) goto done;
        if (dl != INFINITY) { drec[i] = map_get(&m, dst[i], 1); m.recs[drec[i]].count++; }
        else drec[i] = -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyTuple_GET_ITEM(flows, i);
        double lim, r;
        if (getd(f, &L_flow, F_CAP, &lim) < 0 || getd(f, &L_flow, F_RATE, &r) < 0) goto done;
        rate[i] = r;
        for (int side = 0; side < 2; side++) {
            Py_ssize_t rc = side ? drec[i] : srec[i];
            Py_ssize_t *slot = side ? &dres[i] : &sres[i];
            *slot = -1;
            if (rc < 0) continue;
            Rec *rec = &m.recs[rc];
            PyObject *port = side ? dst[i] : src[i];
            double capacity;
            if (getd(port, &L_port, side ? P_DOWNLOAD_BPS : P_UPLOAD_BPS, &capacity) < 0) goto done;
            if (rec->count == 1) {
                PyObject *lst = port_flows(port, side);
                if (!lst) goto done;
                Py_ssize_t len = PyList_GET_SIZE(lst);
                Py_DECREF(lst);
                double left;
                if (len == 1) left = capacity;
                else {
                    double used;
                    if (port_load(port, side, &used) < 0) goto done;
                    left = (capacity - used) + r;
                }
                if (left < lim) lim = left > 0.0 ? left : 0.0;
            } else {
                if (rec->res < 0) {
                    rec->res = nres;
                    res[nres].cap0 = capacity; res[nres].given = 0.0; res[nres].rising = rec->count;
                    res[nres].at = INFINITY; res[nres].rec = rc; res[nres].nmine = 0;
                    nres++;
                }
                res[rec->res].nmine++;
                *slot = rec->res;
            }
        }
        limit[i] = lim;
    }
    for (Py_ssize_t k = 0; k < nres; k++) {  /* what the flows not in `flows` leave */
        Rec *rec = &m.recs[res[k].rec];
        PyObject *lst = port_flows(rec->port, rec->down);
        if (!lst) goto done;
        Py_ssize_t len = PyList_GET_SIZE(lst);
        Py_DECREF(lst);
        if (res[k].nmine != len) {
            double load, mine = 0.0;
            if (port_load(rec->port, rec->down, &load) < 0) goto done;
            for (Py_ssize_t i = 0; i < n; i++)
                if ((rec->down ? dres[i] : sres[i]) == k) mine += rate[i];
            double left = res[k].cap0 - (load - mine);
            res[k].cap0 = left > 0.0 ? left : 0.0;
        }
    }
    if (nres) {
        for (Py_ssize_t k = 0; k < nres; k++) res[k].at = (res[k].cap0 - res[k].given) / res[k].rising;
        for (Py_ssize_t i = 0; i < n; i++) order[i] = i;
        g_limit = limit;
        qsort(order, n, sizeof(Py_ssize_t), cmp_limit);
        Py_ssize_t active = n, i = 0;
        while (active) {
            while (i < n && level[order[i]] >= 0.0) i++;
            if (i == n) {  /* where Python's filling would raise IndexError (a flow listed twice) */
                PyErr_SetString(PyExc_RuntimeError, "fair share: rising flows left but none unset (a flow listed twice?)");
                goto done;
            }
            double at_full = INFINITY; Py_ssize_t full = -1;
            for (Py_ssize_t k = 0; k < nres; k++) if (res[k].at < at_full) { at_full = res[k].at; full = k; }
            if (full < 0) {
                for (Py_ssize_t j = i; j < n; j++) if (level[order[j]] < 0.0) level[order[j]] = limit[order[j]];
                break;
            }
            Py_ssize_t f = order[i];
            double lv = limit[f];
            Py_ssize_t nstop = 0;
            if (lv <= at_full) stop[nstop++] = f;
            else {
                for (Py_ssize_t j = 0; j < n; j++)
                    if ((sres[j] == full || dres[j] == full) && level[j] < 0.0) stop[nstop++] = j;
                lv = at_full > 0.0 ? at_full : 0.0;
            }
            for (Py_ssize_t s = 0; s < nstop; s++) {
                Py_ssize_t g = stop[s];
                level[g] = lv;
                active--;
                for (int side = 0; side < 2; side++) {
                    Py_ssize_t k = side ? dres[g] : sres[g];
                    if (k < 0) continue;
                    res[k].given += lv;
                    Py_ssize_t rising = --res[k].rising;
                    res[k].at = rising ? (res[k].cap0 - res[k].given) / rising : INFINITY;
                }
            }
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++) level[i] = limit[i];
    }
    double now;
    if (take_double(PyObject_GetAttr(engine, s_now), &now) < 0) goto done;  /* the engine's `now` */
    for (Py_ssize_t i = 0; i < n; i++) {  /* `_set_rate` */
        PyObject *f = PyTuple_GET_ITEM(flows, i);
        double r = level[i], old = rate[i];
        PyObject *handle = geto(f, &L_flow, F_HANDLE);
        if (!handle) goto done;
        int has = handle != Py_None;
        if (has) {
            if (fabs(r - old) <= 1e-9 * old) { Py_DECREF(handle); continue; }
            double remaining, since;
            if (getd(f, &L_flow, F_REMAINING, &remaining) < 0 || getd(f, &L_flow, F_SINCE, &since) < 0 ||
                setd(f, &L_flow, F_REMAINING, remaining - (now - since) * old) < 0) { Py_DECREF(handle); goto done; }
        } else if (r == 0.0) { Py_DECREF(handle); continue; }
        if (setd(f, &L_flow, F_SINCE, now) < 0 || setd(f, &L_flow, F_RATE, r) < 0 ||
            seto(src[i], &L_port, P_UP_LOAD, minus_one) < 0 || seto(dst[i], &L_port, P_DOWN_LOAD, minus_one) < 0) { Py_DECREF(handle); goto done; }
        if (r > 0.0) {
            double remaining;
            if (getd(f, &L_flow, F_REMAINING, &remaining) < 0) { Py_DECREF(handle); goto done; }
            PyObject *when = PyFloat_FromDouble(now + (remaining > 0.0 ? remaining : 0.0) / r);
            if (!when) { Py_DECREF(handle); goto done; }
            PyObject *h;
            if (has) h = PyObject_CallMethodObjArgs(engine, s_retime, handle, when, finish, f, NULL);
            else h = PyObject_CallMethodObjArgs(engine, s_at, when, finish, f, NULL);
            Py_DECREF(when);
            if (!h) { Py_DECREF(handle); goto done; }
            int e = seto(f, &L_flow, F_HANDLE, h);
            Py_DECREF(h);
            if (e < 0) { Py_DECREF(handle); goto done; }
        } else if (has) {
            PyObject *c = PyObject_CallMethodNoArgs(handle, s_cancel);
            if (!c || seto(f, &L_flow, F_HANDLE, Py_None) < 0) { Py_XDECREF(c); Py_DECREF(handle); goto done; }
            Py_DECREF(c);
        }
        Py_DECREF(handle);
    }
    result = Py_None; Py_INCREF(result);
done:
    for (Py_ssize_t i = 0; i < n; i++) { Py_XDECREF(src[i]); Py_XDECREF(dst[i]); }
    free(block);
    Py_DECREF(flows);
    return result;
}

/* the engine's event queue, `_cqueue.c` (compiled into this module) */
extern PyTypeObject p2pnet_QueueType;
extern PyMethodDef p2pnet_queue_methods[];

static PyMethodDef methods[] = {{"share", share, METH_VARARGS, "fairshare.share in C"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_cfairshare", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cfairshare(void) {
#define I(v, s) if (!(v = PyUnicode_InternFromString(s))) return NULL
    I(L_flow.names[F_SRC], "src"); I(L_flow.names[F_DST], "dst"); I(L_flow.names[F_CAP], "cap");
    I(L_flow.names[F_RATE], "rate"); I(L_flow.names[F_HANDLE], "handle"); I(L_flow.names[F_REMAINING], "remaining");
    I(L_flow.names[F_SINCE], "since"); I(L_port.names[P_UP], "up"); I(L_port.names[P_DOWN], "down");
    I(L_port.names[P_UPLOAD_BPS], "upload_bps"); I(L_port.names[P_DOWNLOAD_BPS], "download_bps");
    I(L_port.names[P_UP_LOAD], "up_load"); I(L_port.names[P_DOWN_LOAD], "down_load"); I(s_now, "now"); I(s_at, "at"); I(s_retime, "retime"); I(s_cancel, "cancel");
    if (!(minus_one = PyFloat_FromDouble(-1.0))) return NULL;
    if (PyType_Ready(&p2pnet_QueueType) < 0) return NULL;
    PyObject *module = PyModule_Create(&mod);
    if (module && (PyModule_AddStringConstant(module, "STAMP", P2PNET_STAMP) < 0 ||
                   PyModule_AddObjectRef(module, "Queue", (PyObject *)&p2pnet_QueueType) < 0 ||
                   PyModule_AddFunctions(module, p2pnet_queue_methods) < 0)) Py_CLEAR(module);
    return module;
}
