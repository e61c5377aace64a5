/* The C entry points one engine extension lends another, through a PyCapsule each module sets
 * as its `_C_API` attribute (CPython's way for extensions to share code: the caller runs the
 * very code, and the instruction-set choice, of the module that was imported).
 *
 *   engine.quant._qmatmul._C_API       QMatmulApi    (capsule name QMATMUL_API_NAME)
 *   engine.kernels._cpu_attention._C_API AttentionApi (capsule name ATTENTION_API_NAME)
 *
 * engine.kernels._cpu_decoder (the decode step's layers in one call) is the caller. Every
 * function here runs without the GIL; the ones that take Python objects need it, and say so. */

#ifndef SPLITSERVE_NATIVE_API_H
#define SPLITSERVE_NATIVE_API_H

#include <Python.h>
#include <stdint.h>

#define QMATMUL_API_NAME "engine.quant._qmatmul._C_API"
#define ATTENTION_API_NAME "engine.kernels._cpu_attention._C_API"
#define NATIVE_API_VERSION 2

enum { QMATMUL_Q4 = 0, QMATMUL_Q8 = 1 };

typedef struct {
    int version;
    /* y[m, n] = x[m, k] W^T for a weight packed by engine/quant/native.py (format QMATMUL_Q4 or
     * _Q8), x and y float32 C-contiguous, k a multiple of 32, the packed bytes already checked
     * against (n, k) by the caller, x quantized to `planes` int8 planes (1 or 2, checked by the
     * caller). 0, or -1 when scratch memory could not be had. No GIL. */
    int (*matmul)(int format, const float *x, int64_t m, int64_t k, const uint8_t *packed, int64_t n, float *y, int planes);
    /* The packed size of an n x k weight, for the caller's checks. */
    int64_t (*packed_bytes)(int format, int64_t n, int64_t k);
} QMatmulApi;

typedef struct AttentionPlan AttentionPlan;

typedef struct {
    int version;
    /* Parse and check a pool and the sequences of one step, as attention() does (same errors,
     * ValueError naming the argument): decode or chunk sequences over `num_tokens` query rows
     * of `num_heads` heads. Holds the buffers until attention_plan_free. GIL held; NULL on error. */
    AttentionPlan *(*plan)(PyObject *pool, PyObject *layout, PyObject *block_tables, PyObject *starts, PyObject *query_starts,
                           int64_t num_tokens, int num_heads, int head_dim);
    /* One layer's attention for the planned sequences, float32: q [tokens, heads, head_dim],
     * k/v [tokens, kv_heads, head_dim] with the given token strides (in floats), out contiguous.
     * 0, or -1 when scratch memory could not be had. No GIL. */
    int (*run)(const AttentionPlan *plan, int layer, const float *q, int64_t q_stride, const float *k, int64_t k_stride,
               const float *v, int64_t v_stride, float *out, int num_threads);
    /* The pool's KV heads and layers, as the plan parsed them. */
    void (*geometry)(const AttentionPlan *plan, int *num_kv_heads, int *num_layers);
    void (*free)(AttentionPlan *plan); /* GIL held */
} AttentionApi;

/* The module `def` describes, with `api` as its _C_API capsule (named `capsule_name`); NULL with
 * the error set when either cannot be made. For the lending modules' PyInit functions. */
static inline PyObject *module_with_c_api(struct PyModuleDef *def, void *api, const char *capsule_name) {
    PyObject *module = PyModule_Create(def);
    PyObject *capsule = module ? PyCapsule_New(api, capsule_name, NULL) : NULL;
    int added = capsule ? PyModule_AddObjectRef(module, "_C_API", capsule) : -1;
    Py_XDECREF(capsule);
    if (added < 0) {
        Py_XDECREF(module);
        return NULL;
    }
    return module;
}

#endif
