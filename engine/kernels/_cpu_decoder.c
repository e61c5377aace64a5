/* engine.kernels._cpu_decoder: every decoder layer of a small step in one C call.
 *
 * A SmolLM2 decode step at one sequence runs ~4 ms of kernels (quantized matmuls, attention,
 * norms) under ~4 ms of Python: thirty layers of some twenty torch ops and kernel calls each,
 * every one a few microseconds of dispatch. This is the CPU's answer to a CUDA graph: the layers'
 * weights are bound once into a plan (plan()), and run() walks all layers for the step's tokens
 * with the GIL released, calling the very kernels the Python path calls:
 *
 *   per layer   xn = rms_norm(h, input_norm)                      (_rms_norm.h, as _cpu_norm)
 *               qkv = xn Wqkv^T                                    (_qmatmul's C API)
 *               q, k = rope(q, k)                                  x * cos + roll(x, hd/2) * signed_sin
 *               new_k[:, layer], new_v[:, layer] = k, v            (the runner writes them to the pool)
 *               a = attention(q, k, v over the pool)               (_cpu_attention's C API)
 *               h = h + a Wo^T
 *               xn = rms_norm(h, post_norm)
 *               g, u = xn Wgate_up^T
 *               h = h + (silu(g) * u) Wdown^T
 *
 * Every op is the Python path's op in the same float32 order (no contraction into FMAs: setup.py
 * passes -ffp-contract=off), so the result matches it bit for bit except SiLU, whose exp is
 * libm's here and Sleef's in torch (within an ulp). engine/kernels/cpu_decoder.py decides which
 * models and steps qualify (one rank, no MoE, no biases or q/k norms, every projection in a
 * native Q4/Q8 layout, float32, few tokens) and keeps the Python path as the reference. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_rms_norm.h"
#include "native_api.h"

#define PLAN_NAME "engine.kernels._cpu_decoder.Plan"
enum { QKV, O, GATE_UP, DOWN, NUM_LINEARS };
static const char *LINEAR_NAMES[NUM_LINEARS] = {"qkv", "o", "gate_up", "down"};

static const QMatmulApi *qmatmul;
static const AttentionApi *attention;

typedef struct {
    int format;
    const uint8_t *packed;
    int64_t n, k;
    int planes; /* activation planes, 1 or 2 */
} Linear;

typedef struct {
    const float *input_norm, *post_norm;
    Linear linears[NUM_LINEARS];
} Layer;

typedef struct {
    int num_layers, num_heads, num_kv_heads, head_dim;
    int64_t hidden, intermediate;
    double eps;
    Layer *layers;
    Py_buffer *views; /* every weight buffer, held for the plan's life */
    Py_ssize_t num_views;
} Plan;

static void plan_free(PyObject *capsule) {
    Plan *plan = PyCapsule_GetPointer(capsule, PLAN_NAME);
    if (plan == NULL) {
        return;
    }
    for (Py_ssize_t i = 0; i < plan->num_views; i++) {
        PyBuffer_Release(&plan->views[i]);
    }
    PyMem_Free(plan->views);
    PyMem_Free(plan->layers);
    PyMem_Free(plan);
}

/* A held C-contiguous buffer of `bytes` bytes (any, if < 0), or NULL with ValueError. */
static const void *hold(Plan *plan, PyObject *object, Py_ssize_t bytes, const char *what, int layer) {
    Py_buffer *view = &plan->views[plan->num_views];
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "layer %d %s: expected a C-contiguous buffer, got %.100s", layer, what, Py_TYPE(object)->tp_name);
        return NULL;
    }
    plan->num_views++;
    if (bytes >= 0 && view->len != bytes) {
        PyErr_Format(PyExc_ValueError, "layer %d %s: %zd bytes, expected %zd", layer, what, view->len, bytes);
        return NULL;
    }
    return view->buf;
}

static int parse_linear(Plan *plan, PyObject *spec, int layer, int which, int64_t n, int64_t k) {
    Linear *linear = &plan->layers[layer].linears[which];
    PyObject *packed;
    long long out_features, in_features;
    if (!PyArg_ParseTuple(spec, "iOLLi", &linear->format, &packed, &out_features, &in_features, &linear->planes)) {
        PyErr_Format(PyExc_ValueError, "layer %d %s: expected (format, packed, out_features, in_features, activation planes)", layer,
                     LINEAR_NAMES[which]);
        return -1;
    }
    if ((linear->format != QMATMUL_Q4 && linear->format != QMATMUL_Q8) || out_features != n || in_features != k || k % 32 ||
        (linear->planes != 1 && linear->planes != 2)) {
        PyErr_Format(PyExc_ValueError,
                     "layer %d %s: format %d, %lld x %lld, %d activation planes; expected 0 (q4) or 1 (q8), %lld x %lld (a multiple of 32), 1 or 2 planes",
                     layer, LINEAR_NAMES[which], linear->format, out_features, in_features, linear->planes, (long long)n, (long long)k);
        return -1;
    }
    linear->n = n;
    linear->k = k;
    linear->packed = hold(plan, packed, (Py_ssize_t)qmatmul->packed_bytes(linear->format, n, k), LINEAR_NAMES[which], layer);
    return linear->packed == NULL ? -1 : 0;
}

/* plan(layers, num_heads, num_kv_heads, head_dim, hidden, intermediate, eps) -> capsule */
static PyObject *make_plan(PyObject *module, PyObject *args) {
    PyObject *layers;
    Plan *plan = PyMem_Calloc(1, sizeof(Plan));
    if (plan == NULL) {
        return PyErr_NoMemory();
    }
    if (!PyArg_ParseTuple(args, "O!iiiLLd:plan", &PyTuple_Type, &layers, &plan->num_heads, &plan->num_kv_heads, &plan->head_dim,
                          &plan->hidden, &plan->intermediate, &plan->eps)) {
        PyMem_Free(plan);
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(plan, PLAN_NAME, plan_free);
    if (capsule == NULL) {
        PyMem_Free(plan);
        return NULL;
    }
    plan->num_layers = (int)PyTuple_GET_SIZE(layers);
    if (plan->num_layers < 1 || plan->num_heads < 1 || plan->num_kv_heads < 1 || plan->num_heads % plan->num_kv_heads ||
        plan->head_dim < 2 || plan->head_dim % 2 || plan->hidden < 1 || plan->intermediate < 1) {
        PyErr_Format(PyExc_ValueError, "plan: %d layers, %d heads over %d KV heads of %d dims: not a decoder", plan->num_layers,
                     plan->num_heads, plan->num_kv_heads, plan->head_dim);
        goto fail;
    }
    plan->layers = PyMem_Calloc(plan->num_layers, sizeof(Layer));
    plan->views = PyMem_Calloc((size_t)plan->num_layers * (2 + NUM_LINEARS), sizeof(Py_buffer));
    if (plan->layers == NULL || plan->views == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    int64_t hd = plan->head_dim, qkv = (plan->num_heads + 2 * (int64_t)plan->num_kv_heads) * hd;
    int64_t shapes[NUM_LINEARS][2] = {{qkv, plan->hidden}, {plan->hidden, plan->num_heads * hd},
                                      {2 * plan->intermediate, plan->hidden}, {plan->hidden, plan->intermediate}};
    for (int i = 0; i < plan->num_layers; i++) {
        PyObject *layer = PyTuple_GET_ITEM(layers, i);
        if (!PyTuple_Check(layer) || PyTuple_GET_SIZE(layer) != 2 + NUM_LINEARS) {
            PyErr_Format(PyExc_ValueError, "layer %d: expected (input_norm, post_norm, qkv, o, gate_up, down)", i);
            goto fail;
        }
        Layer *l = &plan->layers[i];
        Py_ssize_t norm_bytes = (Py_ssize_t)plan->hidden * 4;
        if ((l->input_norm = hold(plan, PyTuple_GET_ITEM(layer, 0), norm_bytes, "input_norm", i)) == NULL ||
            (l->post_norm = hold(plan, PyTuple_GET_ITEM(layer, 1), norm_bytes, "post_norm", i)) == NULL) {
            goto fail;
        }
        for (int w = 0; w < NUM_LINEARS; w++) {
            if (parse_linear(plan, PyTuple_GET_ITEM(layer, 2 + w), i, w, shapes[w][0], shapes[w][1]) < 0) {
                goto fail;
            }
        }
    }
    return capsule;
fail:
    Py_DECREF(capsule); /* plan_free releases what was held */
    return NULL;
}

/* A float32 C-contiguous array of exactly `ndim` dims whose shape is `shape` (a -1 entry: any). */
static int get_floats(PyObject *object, Py_buffer *view, const char *name, int ndim, const Py_ssize_t *shape, int writable) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: expected a C-contiguous%s float32 array", name, writable ? " writable" : "");
        return -1;
    }
    int ok = view->itemsize == 4 && view->format != NULL && strcmp(view->format, "f") == 0 && view->ndim == ndim;
    for (int d = 0; ok && d < ndim; d++) {
        ok = shape[d] < 0 || view->shape[d] == shape[d];
    }
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: expected a float32 array of %d dims (got %d dims of format %s) with the step's shape", name,
                     ndim, view->ndim, view->format ? view->format : "B");
        return -1;
    }
    return 0;
}

static void rope(const float *x, const float *cos, const float *sin, int hd, float *out) {
    int half = hd / 2;
    for (int i = 0; i < hd; i++) {
        float a = x[i] * cos[i];
        float b = x[(i + half) % hd] * sin[i];
        out[i] = a + b;
    }
}

static void add_into(float *h, const float *x, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        h[i] = h[i] + x[i];
    }
}

/* Every layer for `m` tokens; scratch holds the step's activations. -1: out of memory. */
static int run_layers(const Plan *p, const AttentionPlan *att, int64_t m, float *h, const float *cos, const float *sin, float *new_k,
                      float *new_v, int num_threads, float *scratch) {
    int64_t hd = p->head_dim, nh = p->num_heads, kvh = p->num_kv_heads, H = p->hidden, I = p->intermediate;
    int64_t qkv_width = (nh + 2 * kvh) * hd, qk_width = (nh + kvh) * hd, kv_row = (int64_t)p->num_layers * kvh * hd;
    float *xn = scratch, *qkv = xn + m * H, *qk = qkv + m * qkv_width, *att_out = qk + m * qk_width, *proj = att_out + m * nh * hd;
    float *gate_up = proj + m * H, *act = gate_up + m * 2 * I;
    for (int layer = 0; layer < p->num_layers; layer++) {
        const Layer *l = &p->layers[layer];
        const Linear *w = l->linears;
        rms_norm_rows(h, l->input_norm, m, H, p->eps, xn);
        if (qmatmul->matmul(w[QKV].format, xn, m, H, w[QKV].packed, w[QKV].n, qkv, w[QKV].planes) < 0) {
            return -1;
        }
        for (int64_t t = 0; t < m; t++) {
            for (int64_t head = 0; head < nh + kvh; head++) {
                rope(qkv + t * qkv_width + head * hd, cos + t * hd, sin + t * hd, (int)hd, qk + t * qk_width + head * hd);
            }
            memcpy(new_k + t * kv_row + layer * kvh * hd, qk + t * qk_width + nh * hd, sizeof(float) * kvh * hd);
            memcpy(new_v + t * kv_row + layer * kvh * hd, qkv + t * qkv_width + qk_width, sizeof(float) * kvh * hd);
        }
        if (attention->run(att, layer, qk, qk_width, qk + nh * hd, qk_width, qkv + qk_width, qkv_width, att_out, num_threads) < 0 ||
            qmatmul->matmul(w[O].format, att_out, m, nh * hd, w[O].packed, w[O].n, proj, w[O].planes) < 0) {
            return -1;
        }
        add_into(h, proj, m * H);
        rms_norm_rows(h, l->post_norm, m, H, p->eps, xn);
        if (qmatmul->matmul(w[GATE_UP].format, xn, m, H, w[GATE_UP].packed, w[GATE_UP].n, gate_up, w[GATE_UP].planes) < 0) {
            return -1;
        }
        for (int64_t t = 0; t < m; t++) {
            const float *g = gate_up + t * 2 * I, *u = g + I;
            for (int64_t i = 0; i < I; i++) {
                act[t * I + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
            }
        }
        if (qmatmul->matmul(w[DOWN].format, act, m, I, w[DOWN].packed, w[DOWN].n, proj, w[DOWN].planes) < 0) {
            return -1;
        }
        add_into(h, proj, m * H);
    }
    return 0;
}

/* run(plan, hidden, cos, sin, new_k, new_v, pool, layout, block_tables, starts, query_starts, num_threads) */
static PyObject *run(PyObject *module, PyObject *args) {
    PyObject *capsule, *hidden_obj, *cos_obj, *sin_obj, *k_obj, *v_obj, *pool, *layout, *tables, *starts, *query_starts;
    int num_threads;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOi:run", &capsule, &hidden_obj, &cos_obj, &sin_obj, &k_obj, &v_obj, &pool, &layout, &tables,
                          &starts, &query_starts, &num_threads)) {
        return NULL;
    }
    const Plan *p = PyCapsule_GetPointer(capsule, PLAN_NAME);
    if (p == NULL) {
        return NULL;
    }
    Py_buffer views[5] = {{0}};
    AttentionPlan *att = NULL;
    float *scratch = NULL;
    PyObject *result = NULL;
    Py_ssize_t hidden_shape[2] = {-1, (Py_ssize_t)p->hidden};
    if (get_floats(hidden_obj, &views[0], "hidden", 2, hidden_shape, 1) < 0) {
        goto done;
    }
    Py_ssize_t m = views[0].shape[0];
    Py_ssize_t rope_shape[2] = {m, p->head_dim}, kv_shape[4] = {m, p->num_layers, p->num_kv_heads, p->head_dim};
    if (get_floats(cos_obj, &views[1], "cos", 2, rope_shape, 0) < 0 || get_floats(sin_obj, &views[2], "sin", 2, rope_shape, 0) < 0 ||
        get_floats(k_obj, &views[3], "new_k", 4, kv_shape, 1) < 0 || get_floats(v_obj, &views[4], "new_v", 4, kv_shape, 1) < 0) {
        goto done;
    }
    if (m < 1) {
        PyErr_SetString(PyExc_ValueError, "hidden: no token rows");
        goto done;
    }
    att = attention->plan(pool, layout, tables, starts, query_starts, m, p->num_heads, p->head_dim);
    if (att == NULL) {
        goto done;
    }
    int pool_kv_heads, pool_layers;
    attention->geometry(att, &pool_kv_heads, &pool_layers);
    if (pool_kv_heads != p->num_kv_heads || pool_layers != p->num_layers) {
        PyErr_Format(PyExc_ValueError, "pool: %d KV heads x %d layers, the plan's model has %d x %d", pool_kv_heads, pool_layers,
                     p->num_kv_heads, p->num_layers);
        goto done;
    }
    int64_t hd = p->head_dim, width = (p->num_heads + 2 * p->num_kv_heads) * hd + (p->num_heads + p->num_kv_heads) * hd +
                                        p->num_heads * hd + 2 * p->hidden + 3 * p->intermediate;
    scratch = malloc(sizeof(float) * (size_t)(m * width));
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = run_layers(p, att, m, views[0].buf, views[1].buf, views[2].buf, views[3].buf, views[4].buf, num_threads, scratch);
    Py_END_ALLOW_THREADS
    if (status < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    free(scratch);
    if (att != NULL) {
        attention->free(att);
    }
    for (int i = 0; i < 5; i++) {
        if (views[i].obj != NULL) {
            PyBuffer_Release(&views[i]);
        }
    }
    return result;
}

static PyMethodDef methods[] = {
    {"plan", make_plan, METH_VARARGS,
     "plan(layers, num_heads, num_kv_heads, head_dim, hidden, intermediate, eps) -> capsule\n\n"
     "Bind a decoder's weights: layers is a tuple, per layer (input_norm, post_norm, qkv, o, gate_up, down),\n"
     "the norms float32 [hidden], each linear (format 0 q4 / 1 q8, packed bytes, out_features, in_features, activation planes 1 or 2)\n"
     "in engine/quant/native.py's layout. The buffers are held until the capsule goes."},
    {"run", run, METH_VARARGS,
     "run(plan, hidden, cos, sin, new_k, new_v, pool, layout, block_tables, starts, query_starts, num_threads) -> None\n\n"
     "Every layer for the step's tokens, in place on hidden float32 [tokens, hidden] (the residual stream\n"
     "before the final norm); cos, sin float32 [tokens, head_dim] (sin with its first half negated);\n"
     "fills new_k, new_v float32 [tokens, layers, kv_heads, head_dim]. The pool and sequences as\n"
     "_cpu_attention.attention takes them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef decoder_module = {
    PyModuleDef_HEAD_INIT, "engine.kernels._cpu_decoder",
    "A small step's decoder layers in one C call (engine/kernels/cpu_decoder.py wraps it; the layers' Python path is the reference).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__cpu_decoder(void) {
    qmatmul = PyCapsule_Import(QMATMUL_API_NAME, 0);
    attention = qmatmul ? PyCapsule_Import(ATTENTION_API_NAME, 0) : NULL;
    if (attention == NULL) {
        return NULL;
    }
    if (qmatmul->version != NATIVE_API_VERSION || attention->version != NATIVE_API_VERSION) {
        PyErr_Format(PyExc_ImportError, "_cpu_decoder: C API versions %d (qmatmul) and %d (attention), built for %d", qmatmul->version,
                     attention->version, NATIVE_API_VERSION);
        return NULL;
    }
    return PyModule_Create(&decoder_module);
}
