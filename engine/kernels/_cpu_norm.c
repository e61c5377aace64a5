/* engine.kernels._cpu_norm: RMSNorm of a few float32 rows in one C call.
 *
 *     out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight
 *
 * torch's CPU rms_norm is composite (pow, mean, add, rsqrt, mul, mul): about 20 us for one
 * 576-wide row, 61 of them per SmolLM2 decode step. Here it is one pass for the sum of squares
 * (in double, so the order of the sum does not matter to a float result) and one for the scale
 * (_rms_norm.h, which the fused decode layers of _cpu_decoder.c share).
 * Rows of a decode step are few and short: one thread, the GIL held. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "_rms_norm.h"

static int float_rows(Py_buffer *view, const char *name, Py_ssize_t *rows, Py_ssize_t *dim) {
    if (view->itemsize != 4 || view->format == NULL || strcmp(view->format, "f") != 0) {
        PyErr_Format(PyExc_ValueError, "%s: must be float32, got format %s", name, view->format ? view->format : "B");
        return -1;
    }
    if (view->ndim != 2) {
        PyErr_Format(PyExc_ValueError, "%s: must be [rows, dim], got %d dimensions", name, view->ndim);
        return -1;
    }
    *rows = view->shape[0];
    *dim = view->shape[1];
    return 0;
}

/* rms_norm(x, weight, eps, out): x, out float32 [rows, dim] C-contiguous; weight float32 [dim]. */
static PyObject *rms_norm(PyObject *module, PyObject *args) {
    PyObject *x_obj, *weight_obj, *out_obj;
    double eps;
    if (!PyArg_ParseTuple(args, "OOdO:rms_norm", &x_obj, &weight_obj, &eps, &out_obj)) {
        return NULL;
    }
    Py_buffer x = {0}, weight = {0}, out = {0};
    PyObject *result = NULL;
    Py_ssize_t rows, dim, out_rows, out_dim;
    if (PyObject_GetBuffer(x_obj, &x, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0
        || PyObject_GetBuffer(weight_obj, &weight, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0
        || PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        goto done;  /* the exporter named the problem (not contiguous, read-only) */
    }
    if (float_rows(&x, "x", &rows, &dim) < 0 || float_rows(&out, "out", &out_rows, &out_dim) < 0) {
        goto done;
    }
    if (out_rows != rows || out_dim != dim) {
        PyErr_Format(PyExc_ValueError, "out: must be [%zd, %zd] like x, got [%zd, %zd]", rows, dim, out_rows, out_dim);
        goto done;
    }
    if (weight.itemsize != 4 || weight.format == NULL || strcmp(weight.format, "f") != 0 || weight.len != dim * 4) {
        PyErr_Format(PyExc_ValueError, "weight: must be %zd float32s (x's last dimension), got %zd bytes of format %s",
                     dim, weight.len, weight.format ? weight.format : "B");
        goto done;
    }
    if (dim < 1) {
        PyErr_SetString(PyExc_ValueError, "x: rows must have at least one element");
        goto done;
    }
    rms_norm_rows(x.buf, weight.buf, rows, dim, eps, out.buf);
    result = Py_NewRef(Py_None);
done:
    if (x.obj != NULL) PyBuffer_Release(&x);
    if (weight.obj != NULL) PyBuffer_Release(&weight);
    if (out.obj != NULL) PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS, "rms_norm(x, weight, eps, out): out = x / sqrt(mean(x^2) + eps) * weight, per row."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_norm", "RMSNorm of float32 rows in C.", -1, methods};

PyMODINIT_FUNC PyInit__cpu_norm(void) { return PyModule_Create(&module); }
