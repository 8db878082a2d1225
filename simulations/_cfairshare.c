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
 * The module state (interned names, g_limit for qsort) is static: calls are serialised by the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* the build's stamp (simulations.fairshare.stamp(), passed by simulations.accel): the simulator
 * uses this module only while it matches the tree's */
#ifndef P2PNET_STAMP
#error "build with simulations.accel (python -m simulations.accel), which passes -DP2PNET_STAMP"
#endif

static PyObject *s_src, *s_dst, *s_cap, *s_rate, *s_up, *s_down, *s_upload_bps, *s_download_bps,
    *s_up_load, *s_down_load, *s_handle, *s_remaining, *s_since, *s_now, *s_at, *s_retime, *s_cancel,
    *minus_one;

static int getd(PyObject *o, PyObject *name, double *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    double d = PyFloat_AsDouble(v);
    Py_DECREF(v);
    if (d == -1.0 && PyErr_Occurred()) return -1;
    *out = d;
    return 0;
}

static int setd(PyObject *o, PyObject *name, double d) {
    PyObject *v = PyFloat_FromDouble(d);
    if (!v) return -1;
    int r = PyObject_SetAttr(o, name, v);
    Py_DECREF(v);
    return r;
}

/* port.up or port.down (a new reference), which must be a list: TypeError otherwise */
static PyObject *port_flows(PyObject *port, int down) {
    PyObject *lst = PyObject_GetAttr(port, down ? s_down : s_up);
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
        if (getd(PyList_GET_ITEM(lst, k), s_rate, &r) < 0) return -1;
        s += r;
    }
    *out = s;
    return 0;
}

/* the cached load of port (up or down), summed afresh and stored when not known */
static int port_load(PyObject *port, int down, double *out) {
    PyObject *cache = down ? s_down_load : s_up_load;
    double used;
    if (getd(port, cache, &used) < 0) return -1;
    if (used < 0.0) {
        PyObject *lst = port_flows(port, down);
        if (!lst) return -1;
        int r = sum_rates(lst, &used);
        Py_DECREF(lst);
        if (r < 0 || setd(port, cache, used) < 0) return -1;
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
    PyObject **src = calloc(n, sizeof(PyObject *)), **dst = calloc(n, sizeof(PyObject *));
    double *limit = malloc(n * sizeof(double)), *level = malloc(n * sizeof(double)),
        *rate = malloc(n * sizeof(double));
    Py_ssize_t *srec = malloc(n * sizeof(Py_ssize_t)), *drec = malloc(n * sizeof(Py_ssize_t)),
        *sres = malloc(n * sizeof(Py_ssize_t)), *dres = malloc(n * sizeof(Py_ssize_t)),
        *order = malloc(n * sizeof(Py_ssize_t)), *stop = malloc(n * sizeof(Py_ssize_t));
    Map m; m.recs = malloc(2 * n * sizeof(Rec)); m.nrecs = 0; m.table = malloc(tsize * sizeof(Py_ssize_t)); m.mask = tsize - 1;
    Res *res = malloc(2 * n * sizeof(Res)); Py_ssize_t nres = 0;
    if (!src || !dst || !limit || !level || !rate || !srec || !drec || !sres || !dres || !order || !stop || !m.recs ||
        !m.table || !res) { PyErr_NoMemory(); goto done; }
    memset(m.table, -1, tsize * sizeof(Py_ssize_t));
    /* count the flows on each resource */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyTuple_GET_ITEM(flows, i);
        level[i] = -1.0;
        if (!(src[i] = PyObject_GetAttr(f, s_src)) || !(dst[i] = PyObject_GetAttr(f, s_dst))) goto done;
        srec[i] = map_get(&m, src[i], 0);
        m.recs[srec[i]].count++;
        double dl;
        if (getd(dst[i], s_download_bps, &dl) < 0) goto done;
        if (dl != INFINITY) { drec[i] = map_get(&m, dst[i], 1); m.recs[drec[i]].count++; }
        else drec[i] = -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyTuple_GET_ITEM(flows, i);
        double lim, r;
        if (getd(f, s_cap, &lim) < 0 || getd(f, s_rate, &r) < 0) goto done;
        rate[i] = r;
        for (int side = 0; side < 2; side++) {
            Py_ssize_t rc = side ? drec[i] : srec[i];
            Py_ssize_t *slot = side ? &dres[i] : &sres[i];
            *slot = -1;
            if (rc < 0) continue;
            Rec *rec = &m.recs[rc];
            PyObject *port = side ? dst[i] : src[i];
            double capacity;
            if (getd(port, side ? s_download_bps : s_upload_bps, &capacity) < 0) goto done;
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
    if (getd(engine, s_now, &now) < 0) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {  /* `_set_rate` */
        PyObject *f = PyTuple_GET_ITEM(flows, i);
        double r = level[i], old = rate[i];
        PyObject *handle = PyObject_GetAttr(f, s_handle);
        if (!handle) goto done;
        int has = handle != Py_None;
        if (has) {
            if (fabs(r - old) <= 1e-9 * old) { Py_DECREF(handle); continue; }
            double remaining, since;
            if (getd(f, s_remaining, &remaining) < 0 || getd(f, s_since, &since) < 0 ||
                setd(f, s_remaining, remaining - (now - since) * old) < 0) { Py_DECREF(handle); goto done; }
        } else if (r == 0.0) { Py_DECREF(handle); continue; }
        if (setd(f, s_since, now) < 0 || setd(f, s_rate, r) < 0 || PyObject_SetAttr(src[i], s_up_load, minus_one) < 0 ||
            PyObject_SetAttr(dst[i], s_down_load, minus_one) < 0) { Py_DECREF(handle); goto done; }
        if (r > 0.0) {
            double remaining;
            if (getd(f, s_remaining, &remaining) < 0) { Py_DECREF(handle); goto done; }
            PyObject *when = PyFloat_FromDouble(now + (remaining > 0.0 ? remaining : 0.0) / r);
            if (!when) { Py_DECREF(handle); goto done; }
            PyObject *h;
            if (has) h = PyObject_CallMethodObjArgs(engine, s_retime, handle, when, finish, f, NULL);
            else h = PyObject_CallMethodObjArgs(engine, s_at, when, finish, f, NULL);
            Py_DECREF(when);
            if (!h) { Py_DECREF(handle); goto done; }
            int e = PyObject_SetAttr(f, s_handle, h);
            Py_DECREF(h);
            if (e < 0) { Py_DECREF(handle); goto done; }
        } else if (has) {
            PyObject *c = PyObject_CallMethodNoArgs(handle, s_cancel);
            if (!c || PyObject_SetAttr(f, s_handle, Py_None) < 0) { Py_XDECREF(c); Py_DECREF(handle); goto done; }
            Py_DECREF(c);
        }
        Py_DECREF(handle);
    }
    result = Py_None; Py_INCREF(result);
done:
    if (src) for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(src[i]);
    if (dst) for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(dst[i]);
    free(src); free(dst); free(limit); free(level); free(rate); free(srec); free(drec); free(sres); free(dres);
    free(order); free(stop); free(m.recs); free(m.table); free(res);
    Py_DECREF(flows);
    return result;
}

static PyMethodDef methods[] = {{"share", share, METH_VARARGS, "fairshare.share in C"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_cfairshare", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cfairshare(void) {
#define I(v, s) if (!(v = PyUnicode_InternFromString(s))) return NULL
    I(s_src, "src"); I(s_dst, "dst"); I(s_cap, "cap"); I(s_rate, "rate"); I(s_up, "up"); I(s_down, "down");
    I(s_upload_bps, "upload_bps"); I(s_download_bps, "download_bps"); I(s_up_load, "up_load");
    I(s_down_load, "down_load"); I(s_handle, "handle"); I(s_remaining, "remaining"); I(s_since, "since");
    I(s_now, "now"); I(s_at, "at"); I(s_retime, "retime"); I(s_cancel, "cancel");
    if (!(minus_one = PyFloat_FromDouble(-1.0))) return NULL;
    PyObject *module = PyModule_Create(&mod);
    if (module && PyModule_AddStringConstant(module, "STAMP", P2PNET_STAMP) < 0) Py_CLEAR(module);
    return module;
}
