/* Buffer helpers shared by the native modules (kvx_native.c, kvx_net.c). */
#ifndef KVX_BUF_H
#define KVX_BUF_H

#include <Python.h>

/* A C-contiguous buffer of uint64 values from ``o`` (``what`` names it in the error); 0 or -1 with
 * an exception set. The caller releases ``b``. */
static inline int get_u64(PyObject *o, Py_buffer *b, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (b->len % 8) {
        PyErr_Format(PyExc_TypeError, "%s must be a uint64 array", what);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

#endif
