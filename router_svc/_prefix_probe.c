/* The prefix index's lookup (router_svc/prefix_index.py, PrefixIndex.cached_blocks), compiled:
 * the same bisection over a request's block hashes, probe for probe, read from the index's own
 * dict (block hash -> mask of fleet slots), writing each candidate's cached depth into the
 * caller's int64 array. The pure-Python loop in prefix_index.py is the reference it must equal
 * (tests/router_svc/test_prefix_index_compiled.py). Built by `make native`. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    Py_ssize_t lo, hi;
    PyObject *mask; /* owned */
} Range;

/* The mask of the slots holding hashes[i] (a new reference; 0 when none), NULL on error. */
static PyObject *holding(PyObject *holders, PyObject *hashes, Py_ssize_t i, PyObject *zero) {
    PyObject *key = PySequence_GetItem(hashes, i);
    if (key == NULL) {
        return NULL;
    }
    PyObject *mask = PyDict_GetItemWithError(holders, key); /* borrowed */
    Py_DECREF(key);
    if (mask == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        mask = zero;
    }
    Py_INCREF(mask);
    return mask;
}

/* Sets out[slot] = depth for every slot whose bit is set in mask. */
static int write_depth(PyObject *mask, int64_t *out, Py_ssize_t slots, int64_t depth) {
    Py_ssize_t size = (slots + 7) / 8;
    PyObject *bytes = PyObject_CallMethod(mask, "to_bytes", "ns", size, "little");
    if (bytes == NULL) {
        return -1;
    }
    const unsigned char *bits = (const unsigned char *)PyBytes_AS_STRING(bytes);
    for (Py_ssize_t byte = 0; byte < size; byte++) {
        unsigned int b = bits[byte];
        while (b) {
            Py_ssize_t slot = byte * 8 + __builtin_ctz(b);
            if (slot < slots) {
                out[slot] = depth;
            }
            b &= b - 1;
        }
    }
    Py_DECREF(bytes);
    return 0;
}

static int push(Range **stack, Py_ssize_t *top, Py_ssize_t *capacity, Range range) {
    if (*top == *capacity) {
        Py_ssize_t grown = *capacity * 2;
        Range *larger = PyMem_Realloc(*stack, grown * sizeof(Range));
        if (larger == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *stack = larger;
        *capacity = grown;
    }
    (*stack)[(*top)++] = range;
    return 0;
}

/* fill_prefixes(holders, hashes, members, out, max_probes, resolution) -> bool
 * False when no slot of members holds hashes[0] (out untouched); else True, out (a writable
 * int64 buffer of one count per fleet slot, zeroed) holding each slot's cached blocks. */
static PyObject *fill_prefixes(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *holders, *hashes, *members, *out_object;
    Py_ssize_t max_probes, resolution;
    if (!PyArg_ParseTuple(args, "O!OOOnn", &PyDict_Type, &holders, &hashes, &members, &out_object,
                          &max_probes, &resolution)) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Length(hashes);
    if (n < 0) {
        return NULL;
    }
    if (n == 0) {
        Py_RETURN_FALSE;
    }
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL) {
        return NULL;
    }
    PyObject *held = holding(holders, hashes, 0, zero);
    if (held == NULL) {
        Py_DECREF(zero);
        return NULL;
    }
    PyObject *first = PyNumber_And(held, members);
    Py_DECREF(held);
    if (first == NULL) {
        Py_DECREF(zero);
        return NULL;
    }
    int any = PyObject_IsTrue(first);
    if (any <= 0) {
        Py_DECREF(first);
        Py_DECREF(zero);
        if (any < 0) {
            return NULL;
        }
        Py_RETURN_FALSE;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(out_object, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(first);
        Py_DECREF(zero);
        return NULL;
    }
    if (view.len % 8 != 0) {
        PyBuffer_Release(&view);
        Py_DECREF(first);
        Py_DECREF(zero);
        PyErr_SetString(PyExc_TypeError, "out: expected an int64 buffer");
        return NULL;
    }
    int64_t *out = (int64_t *)view.buf;
    Py_ssize_t slots = view.len / 8;
    Py_ssize_t capacity = 64, top = 0;
    Range *stack = PyMem_Malloc(capacity * sizeof(Range));
    int failed = stack == NULL;
    if (failed) {
        PyErr_NoMemory();
        Py_DECREF(first);
    } else {
        stack[top++] = (Range){0, n, first};
    }
    Py_ssize_t probes = max_probes;
    Py_ssize_t finest = 1; /* one block for the deepest prefix, then 1/resolution of it */
    Py_ssize_t coarse = n / resolution > 1 ? n / resolution : 1;
    while (!failed && top) {
        Range range = stack[--top];
        if (range.hi - range.lo > finest && probes) {
            probes--;
            Py_ssize_t mid = (range.lo + range.hi) / 2;
            PyObject *at_mid = holding(holders, hashes, mid, zero);
            PyObject *holding_mid = at_mid ? PyNumber_And(range.mask, at_mid) : NULL;
            Py_XDECREF(at_mid);
            PyObject *rest = holding_mid ? PyNumber_Xor(range.mask, holding_mid) : NULL;
            Py_DECREF(range.mask);
            int rest_any = rest ? PyObject_IsTrue(rest) : -1;
            int mid_any = holding_mid ? PyObject_IsTrue(holding_mid) : -1;
            if (rest_any < 0 || mid_any < 0) {
                Py_XDECREF(rest);
                Py_XDECREF(holding_mid);
                failed = 1;
                break;
            }
            if (rest_any) {
                failed = push(&stack, &top, &capacity, (Range){range.lo, mid, rest}) < 0;
                rest = failed ? rest : NULL;
            }
            Py_XDECREF(rest);
            if (!failed && mid_any) {
                failed = push(&stack, &top, &capacity, (Range){mid, range.hi, holding_mid}) < 0;
                holding_mid = failed ? holding_mid : NULL;
            }
            Py_XDECREF(holding_mid);
            continue;
        }
        finest = coarse;
        failed = write_depth(range.mask, out, slots, (int64_t)range.lo + 1) < 0;
        Py_DECREF(range.mask);
    }
    while (top) {
        Py_DECREF(stack[--top].mask);
    }
    PyMem_Free(stack);
    PyBuffer_Release(&view);
    Py_DECREF(zero);
    if (failed) {
        return NULL;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"fill_prefixes", fill_prefixes, METH_VARARGS,
     "fill_prefixes(holders, hashes, members, out, max_probes, resolution) -> bool: the prefix "
     "index's lookup (router_svc/prefix_index.py), compiled."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_prefix_probe", "The prefix index's lookup, compiled.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__prefix_probe(void) { return PyModule_Create(&module); }
