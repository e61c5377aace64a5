/* engine.kernels._cpu_attention: paged attention and FP8 KV writes on CPU, one C call each.
 *
 * The torch path (engine/layers/attention.py, engine/kv_cache.py) gathers a dequantized copy of
 * every context block for every layer and then runs SDPA: some twenty small tensor ops per layer,
 * whose overhead is most of a decode step's attention time on a small model. Both functions here
 * read the pool where it lies, in the byte layout of kv_store/layout.py:
 *
 *     pool   uint8 [num_blocks, block_bytes]
 *     block  payload [kv_heads, layers, 2 (K,V), block_size, head_dim] | f32 scales [kv_heads, layers, 2]
 *            ^ 0 (fp32 / bf16 / e4m3 elements)                           ^ scales_offset (fp8 only)
 *
 * attention(): one layer, a batch of sequences, each with a run of query tokens at consecutive
 * positions (one in decode, 1 + k drafts in a verify chunk). Query token i of sequence s sits at
 * position starts[s] + i and sees keys 0 .. starts[s] + i (the causal mask of DecodeGroup and
 * PrefillChunk). Keys before starts[s] come from the pool through the sequence's block table;
 * keys from starts[s] on are this step's own K/V rows, which the engine writes to the pool only
 * after the whole forward pass:
 *
 *     key position   0 ............ starts[s]-1 | starts[s] ... starts[s]+n-1
 *     read from      pool blocks (block table)  | k/v rows query_starts[s] .. query_starts[s+1]-1
 *
 * One work item per (sequence, KV head): the query heads sharing that KV head (GQA) take each
 * K/V element once. Blocks stream through an online softmax in float32; a FP8 block's K scale
 * multiplies its scores and its V scale the softmax weights, so elements are widened exactly and
 * never scaled one by one. An item with a long context runs as several units over parts of it,
 * merged afterwards (split-K, _cpu_attention_split.h); how an item is split depends on its own
 * context length only, so the result depends neither on the number of threads nor on the other
 * sequences of the call.
 *
 * write_fp8(): PagedKVCache.write for FP8 pools, bit for bit the torch path, because blocks
 * travel byte for byte to other workers and tiers. A touched block is dequantized (code value
 * times its old scale: one rounding, as dequantize_fp8's one- and two-step rules both give), this
 * step's rows are placed, slots past the block's fill are multiplied by zero (keeping the sign of
 * zero, as torch's multiply by the mask does), and every (kv head, layer, K|V) group gets
 * scale = amax / 448 (1 where that is not > 0) and codes = e4m3(clamp(x / scale, +-448)) with
 * round-to-nearest-even. Every step is elementwise, or a max, so vectorizing changes no bit.
 *
 * Compiled for the portable baseline, with AVX2+FMA copies of the hot loops and AVX-512 loops of
 * their own (_cpu_attention_avx512.h: transposed 16-key tiles, no horizontal sums) chosen at
 * import (__builtin_cpu_supports), never -march=native: the image runs on other machines than it
 * is built on. Scratch is per thread and kept between calls (no malloc per call). OpenMP is libgomp, the one torch loaded (the Python wrapper imports torch first).
 * setup.py adds -fno-trapping-math, which changes no value (no fast-math) but lets GCC compute
 * both sides of the e4m3 encoder's select and so vectorize it; FP exception flags are unused.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_cpu_attention_loops.h"
#include "_cpu_attention_avx512.h"
#include "_cpu_attention_split.h"
#include "native_api.h"

#define MIN_PARALLEL_ELEMENTS 16384 /* K/V elements below which one thread beats waking the team */
/* K/V elements from which a call gives up the GIL while it computes (about a millisecond). Below,
 * it keeps it: the call replaces ~20 torch ops that would each give it up and take it back, and
 * taking it back from a busy thread can cost a switch interval (5 ms). */
#define MIN_GIL_FREE_ELEMENTS (1 << 20)

/* ------------------------------------------------------------------------------------------ */
/* Per-ISA copies of the loops (_cpu_attention_loops.h)                                       */

/* head dims that are no multiple of 16 run the generic loops, compiled for AVX-512 too */
__attribute__((target(AVX512_TARGET))) static void attend_unit_avx512_entry(const AttentionArgs *a, Scratch *w, const WorkUnit *u) {
    if (a->pool.head_dim % 16 == 0) {
        attend_unit_avx512(a, w, u);
    } else {
        attend_unit(a, w, u);
    }
}

__attribute__((target("avx2,fma"))) static void attend_unit_avx2(const AttentionArgs *a, Scratch *w, const WorkUnit *u) {
    attend_unit(a, w, u);
}

static void attend_unit_portable(const AttentionArgs *a, Scratch *w, const WorkUnit *u) {
    attend_unit(a, w, u);
}

__attribute__((target("avx2,fma"))) static void requantize_group_avx2(const WriteArgs *a, float *x, Py_ssize_t unique, int head, int layer, int kv) {
    requantize_group(a, x, unique, head, layer, kv);
}

static void requantize_group_portable(const WriteArgs *a, float *x, Py_ssize_t unique, int head, int layer, int kv) {
    requantize_group(a, x, unique, head, layer, kv);
}

/* ------------------------------------------------------------------------------------------ */
/* Dispatch                                                                                   */

typedef void (*AttendFn)(const AttentionArgs *, Scratch *, const WorkUnit *);
typedef void (*RequantizeFn)(const WriteArgs *, float *, Py_ssize_t, int, int, int);

static AttendFn attend_fn = attend_unit_portable;
static RequantizeFn requantize_fn = requantize_group_portable;
static const char *isa_name = "portable";

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static int cpu_has_avx512(void) {
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c");
}

/* write_fp8 keeps its AVX2 loops under 'avx512' (it is bit-exact and not the hot path). */
static int select_isa(const char *name) {
    if (strcmp(name, "best") == 0) {
        name = cpu_has_avx512() ? "avx512" : cpu_has_avx2() ? "avx2" : "portable";
    }
    if (strcmp(name, "avx512") == 0 && cpu_has_avx512()) {
        attend_fn = attend_unit_avx512_entry;
        requantize_fn = requantize_group_avx2;
        isa_name = "avx512";
        return 0;
    }
    if (strcmp(name, "avx2") == 0 && cpu_has_avx2()) {
        attend_fn = attend_unit_avx2;
        requantize_fn = requantize_group_avx2;
        isa_name = "avx2";
        return 0;
    }
    if (strcmp(name, "portable") == 0) {
        attend_fn = attend_unit_portable;
        requantize_fn = requantize_group_portable;
        isa_name = "portable";
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "isa: '%s' is not one of 'best', 'portable', 'avx2' (a CPU with AVX2 and FMA) or "
                 "'avx512' (AVX-512 F, BW, DQ and VL)", name);
    return -1;
}

/* ------------------------------------------------------------------------------------------ */
/* Argument checking                                                                          */

#define MAX_BUFFERS 8

typedef struct {
    Py_buffer views[MAX_BUFFERS];
    int count;
} Buffers;

static void release_all(Buffers *buffers) {
    for (int i = 0; i < buffers->count; i++) {
        PyBuffer_Release(&buffers->views[i]);
    }
    buffers->count = 0;
}

/* A numpy-style array argument: ndim dims, items of `itemsize` bytes (0: any) of one of `formats`,
 * the last `contiguous_dims` dims contiguous, every stride a non-negative multiple of the item. */
static Py_buffer *get_array(Buffers *buffers, PyObject *object, const char *name, int ndim, const char *formats,
                            Py_ssize_t itemsize, int writable, int contiguous_dims) {
    Py_buffer *view = &buffers->views[buffers->count];
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: expected a%s array (numpy view of a CPU tensor), got %.100s", name,
                     writable ? " writable" : "", Py_TYPE(object)->tp_name);
        return NULL;
    }
    buffers->count++;
    const char *format = view->format ? view->format : "B";
    if (format[0] == '<' || format[0] == '=' || format[0] == '@') {
        format++;
    }
    if (itemsize == 0) {
        itemsize = view->itemsize;
    }
    if (view->ndim != ndim || view->itemsize != itemsize || strlen(format) != 1 || !strchr(formats, format[0])) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d dims of %zd-byte items (format one of '%s'), got %d dims of "
                     "%zd-byte '%s'", name, ndim, itemsize, formats, view->ndim, view->itemsize, format);
        return NULL;
    }
    Py_ssize_t expected = itemsize;
    for (int d = ndim - 1; d >= ndim - contiguous_dims; d--) {
        if (view->shape[d] > 1 && view->strides[d] != expected) {
            PyErr_Format(PyExc_ValueError, "%s: dim %d must be contiguous (stride %zd bytes), got stride %zd", name, d,
                         expected, view->strides[d]);
            return NULL;
        }
        expected *= view->shape[d];
    }
    for (int d = 0; d < ndim; d++) {
        if (view->strides[d] < 0 || view->strides[d] % itemsize) {
            PyErr_Format(PyExc_ValueError, "%s: dim %d has stride %zd bytes, not a non-negative multiple of %zd", name, d,
                         view->strides[d], itemsize);
            return NULL;
        }
    }
    return view;
}

static int parse_pool(Buffers *buffers, PyObject *pool_object, PyObject *layout, int writable, Pool *pool) {
    Py_ssize_t scales_offset;
    if (!PyArg_ParseTuple(layout, "iiiiin;layout: expected (num_kv_heads, num_layers, block_size, head_dim, kv_kind, scales_offset)",
                          &pool->num_kv_heads, &pool->num_layers, &pool->block_size, &pool->head_dim, &pool->kind,
                          &scales_offset)) {
        return -1;
    }
    if (pool->num_kv_heads < 1 || pool->num_layers < 1 || pool->block_size < 1 || pool->head_dim < 1) {
        PyErr_SetString(PyExc_ValueError, "layout: heads, layers, block size and head dim must all be >= 1");
        return -1;
    }
    if (pool->kind < KV_FP32 || pool->kind > KV_FP8) {
        PyErr_Format(PyExc_ValueError, "layout: kv_kind %d is not 0 (fp32), 1 (bf16) or 2 (fp8_e4m3)", pool->kind);
        return -1;
    }
    pool->element_bytes = pool->kind == KV_FP32 ? 4 : pool->kind == KV_BF16 ? 2 : 1;
    Py_buffer *view = get_array(buffers, pool_object, "pool", 2, "B", 1, writable, 2);
    if (view == NULL) {
        return -1;
    }
    Py_ssize_t tiles = (Py_ssize_t)pool->num_kv_heads * pool->num_layers * 2;
    Py_ssize_t payload_bytes = tiles * pool->block_size * pool->head_dim * pool->element_bytes;
    Py_ssize_t end = pool->kind == KV_FP8 ? scales_offset + tiles * 4 : payload_bytes;
    if (view->shape[1] < end || (pool->kind == KV_FP8 && (scales_offset < payload_bytes || scales_offset % 4)) ||
        view->shape[1] % 8) {
        PyErr_Format(PyExc_ValueError, "pool: blocks of %zd bytes do not hold the layout (payload %zd bytes, scales at %zd)",
                     view->shape[1], payload_bytes, scales_offset);
        return -1;
    }
    pool->base = view->buf;
    pool->num_blocks = view->shape[0];
    pool->block_bytes = view->shape[1];
    pool->scales_offset = scales_offset;
    return 0;
}

/* Queries and K/V rows: float32 ('f'), or bf16 as int16 bits ('h'/'H'). */
static int check_compute_dtype(const Py_buffer *view, const char *name, int *bf16) {
    char format = view->format[strlen(view->format) - 1];
    if (format == 'f' && view->itemsize == 4) {
        *bf16 = 0;
        return 0;
    }
    if ((format == 'h' || format == 'H') && view->itemsize == 2) {
        *bf16 = 1;
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "%s: expected float32, or bf16 as int16 bits; got %zd-byte '%s' items", name, view->itemsize,
                 view->format);
    return -1;
}

static int check_rows(const Py_buffer *view, const char *name, Py_ssize_t tokens, Py_ssize_t heads, Py_ssize_t head_dim) {
    if (view->shape[0] != tokens || view->shape[1] != heads || view->shape[2] != head_dim) {
        PyErr_Format(PyExc_ValueError, "%s: expected [%zd, %zd, %zd], got [%zd, %zd, %zd]", name, tokens, heads, head_dim,
                     view->shape[0], view->shape[1], view->shape[2]);
        return -1;
    }
    return 0;
}

/* Sequences: query_starts [S+1] from 0 up to the token count, each run >= 1 token; every block a
 * sequence reads from the pool is named in its table and exists. */
static int check_sequences(const AttentionArgs *a, Py_ssize_t num_seqs, Py_ssize_t num_tokens) {
    if (a->query_starts[0] != 0 || a->query_starts[num_seqs] != num_tokens) {
        PyErr_Format(PyExc_ValueError, "query_starts: must run from 0 to the %zd query tokens, got %lld .. %lld", num_tokens,
                     (long long)a->query_starts[0], (long long)a->query_starts[num_seqs]);
        return -1;
    }
    for (Py_ssize_t s = 0; s < num_seqs; s++) {
        if (a->query_starts[s + 1] <= a->query_starts[s]) {
            PyErr_Format(PyExc_ValueError, "query_starts: sequence %zd has no query token (%lld .. %lld)", s,
                         (long long)a->query_starts[s], (long long)a->query_starts[s + 1]);
            return -1;
        }
        int64_t start = a->starts[s];
        int64_t needed = (start + a->pool.block_size - 1) / a->pool.block_size;
        if (start < 0 || needed > a->table_width) {
            PyErr_Format(PyExc_ValueError, "starts: sequence %zd starts at position %lld, which needs %lld blocks; "
                         "its table has %zd", s, (long long)start, (long long)needed, a->table_width);
            return -1;
        }
        for (int64_t b = 0; b < needed; b++) {
            int64_t block = a->tables[s * a->table_width + b];
            if (block < 0 || block >= a->pool.num_blocks) {
                PyErr_Format(PyExc_ValueError, "block_tables: sequence %zd names block %lld, outside the pool's [0, %zd)", s,
                             (long long)block, a->pool.num_blocks);
                return -1;
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* attention()                                                                                */

/* Units (_cpu_attention_split.h) across the team, then the split items' merges. */
static int run_attention(const AttentionArgs *a, Py_ssize_t num_seqs, int num_threads, Py_ssize_t work) {
    UnitPlan plan;
    if (plan_units(a, num_seqs, &plan) < 0) {
        return -1;
    }
    int failed = 0;
    if (work < MIN_PARALLEL_ELEMENTS || plan.num_units < 2) {
        num_threads = 1;
    }
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        Scratch w;
        int ready = thread_scratch_for(&w, plan.max_rows, a->pool.head_dim, a->pool.block_size) == 0;
        if (!ready) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (Py_ssize_t i = 0; i < plan.num_units; i++) {
            if (ready) {
                attend_fn(a, &w, &plan.units[i]);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (Py_ssize_t i = 0; i < plan.num_units; i++) {
            const WorkUnit *u = &plan.units[i];
            if (ready && u->partial != NULL && u->part == 0) {
                merge_parts(a, &w, u);
            }
        }
    }
    return failed ? -1 : 0;
}

static PyObject *attention(PyObject *module, PyObject *args) {
    PyObject *q_obj, *k_obj, *v_obj, *out_obj, *pool_obj, *layout, *tables_obj, *starts_obj, *query_starts_obj;
    int layer, num_threads;
    if (!PyArg_ParseTuple(args, "OOOOOO!iOOOi:attention", &q_obj, &k_obj, &v_obj, &out_obj, &pool_obj, &PyTuple_Type,
                          &layout, &layer, &tables_obj, &starts_obj, &query_starts_obj, &num_threads)) {
        return NULL;
    }
    Buffers buffers = {.count = 0};
    AttentionArgs a;
    memset(&a, 0, sizeof a);
    PyObject *result = NULL;
    if (parse_pool(&buffers, pool_obj, layout, 0, &a.pool) < 0) {
        goto done;
    }
    /* float32, or bf16 as its int16 bits (numpy has no bf16) */
    Py_buffer *q = get_array(&buffers, q_obj, "q", 3, "fhH", 0, 0, 2);
    if (q == NULL || check_compute_dtype(q, "q", &a.bf16) < 0) {
        goto done;
    }
    const char *formats = a.bf16 ? "hH" : "f";
    Py_ssize_t itemsize = a.bf16 ? 2 : 4;
    Py_buffer *k = get_array(&buffers, k_obj, "k", 3, formats, itemsize, 0, 2);
    Py_buffer *v = k ? get_array(&buffers, v_obj, "v", 3, formats, itemsize, 0, 2) : NULL;
    Py_buffer *out = v ? get_array(&buffers, out_obj, "out", 3, formats, itemsize, 1, 3) : NULL;
    Py_buffer *tables = out ? get_array(&buffers, tables_obj, "block_tables", 2, "lq", 8, 0, 2) : NULL;
    Py_buffer *starts = tables ? get_array(&buffers, starts_obj, "starts", 1, "lq", 8, 0, 1) : NULL;
    Py_buffer *query_starts = starts ? get_array(&buffers, query_starts_obj, "query_starts", 1, "lq", 8, 0, 1) : NULL;
    if (query_starts == NULL) {
        goto done;
    }
    Py_ssize_t num_tokens = q->shape[0], num_heads = q->shape[1], hd = a.pool.head_dim;
    Py_ssize_t num_seqs = tables->shape[0];
    if (q->shape[2] != hd) {
        PyErr_Format(PyExc_ValueError, "q: head_dim %zd, the pool's is %zd", q->shape[2], hd);
        goto done;
    }
    if (num_heads % a.pool.num_kv_heads) {
        PyErr_Format(PyExc_ValueError, "q: %zd query heads are not a multiple of the pool's %d KV heads", num_heads,
                     a.pool.num_kv_heads);
        goto done;
    }
    if (check_rows(k, "k", num_tokens, a.pool.num_kv_heads, hd) < 0 || check_rows(v, "v", num_tokens, a.pool.num_kv_heads, hd) < 0 ||
        check_rows(out, "out", num_tokens, num_heads, hd) < 0) {
        goto done;
    }
    if (layer < 0 || layer >= a.pool.num_layers) {
        PyErr_Format(PyExc_ValueError, "layer: %d outside [0, %d)", layer, a.pool.num_layers);
        goto done;
    }
    if (starts->shape[0] != num_seqs || query_starts->shape[0] != num_seqs + 1) {
        PyErr_Format(PyExc_ValueError, "starts, query_starts: expected [%zd] and [%zd] for %zd block tables, got [%zd] and [%zd]",
                     num_seqs, num_seqs + 1, num_seqs, starts->shape[0], query_starts->shape[0]);
        goto done;
    }
    if (num_seqs < 1) {
        PyErr_SetString(PyExc_ValueError, "block_tables: no sequence");
        goto done;
    }
    a.layer = layer;
    a.num_heads = (int)num_heads;
    a.group = (int)(num_heads / a.pool.num_kv_heads);
    a.q = q->buf;
    a.k = k->buf;
    a.v = v->buf;
    a.out = out->buf;
    a.q_token_stride = q->strides[0] / itemsize;
    a.k_token_stride = k->strides[0] / itemsize;
    a.v_token_stride = v->strides[0] / itemsize;
    a.tables = tables->buf;
    a.table_width = tables->shape[1];
    a.starts = starts->buf;
    a.query_starts = query_starts->buf;
    a.sm_scale = (float)(1.0 / sqrt((double)hd));
    if (check_sequences(&a, num_seqs, num_tokens) < 0) {
        goto done;
    }
    Py_ssize_t work = 0;
    for (Py_ssize_t s = 0; s < num_seqs; s++) {
        work += (a.starts[s] + a.query_starts[s + 1] - a.query_starts[s]) * a.pool.num_kv_heads * hd;
    }
    PyThreadState *thread = work >= MIN_GIL_FREE_ELEMENTS ? PyEval_SaveThread() : NULL;
    int status = run_attention(&a, num_seqs, num_threads < 1 ? 1 : num_threads, work);
    if (thread != NULL) {
        PyEval_RestoreThread(thread);
    }
    if (status < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release_all(&buffers);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* The C API (native_api.h): attention() split into a plan per step and a run per layer        */

struct AttentionPlan {
    Buffers buffers;
    AttentionArgs args; /* everything but the layer and the rows */
    Py_ssize_t num_seqs;
    Py_ssize_t work;
};

static void api_free(AttentionPlan *plan) {
    if (plan != NULL) {
        release_all(&plan->buffers);
        PyMem_Free(plan);
    }
}

static AttentionPlan *api_plan(PyObject *pool_obj, PyObject *layout, PyObject *tables_obj, PyObject *starts_obj,
                               PyObject *query_starts_obj, int64_t num_tokens, int num_heads, int head_dim) {
    AttentionPlan *plan = PyMem_Calloc(1, sizeof(AttentionPlan));
    if (plan == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    AttentionArgs *a = &plan->args;
    if (!PyTuple_Check(layout)) {
        PyErr_SetString(PyExc_TypeError, "layout: expected a tuple");
        goto fail;
    }
    if (parse_pool(&plan->buffers, pool_obj, layout, 0, &a->pool) < 0) {
        goto fail;
    }
    Py_buffer *tables = get_array(&plan->buffers, tables_obj, "block_tables", 2, "lq", 8, 0, 2);
    Py_buffer *starts = tables ? get_array(&plan->buffers, starts_obj, "starts", 1, "lq", 8, 0, 1) : NULL;
    Py_buffer *query_starts = starts ? get_array(&plan->buffers, query_starts_obj, "query_starts", 1, "lq", 8, 0, 1) : NULL;
    if (query_starts == NULL) {
        goto fail;
    }
    Py_ssize_t num_seqs = tables->shape[0];
    if (head_dim != a->pool.head_dim || num_heads < 1 || num_heads % a->pool.num_kv_heads) {
        PyErr_Format(PyExc_ValueError, "pool: its %d KV heads of %d dims do not serve %d query heads of %d dims", a->pool.num_kv_heads,
                     a->pool.head_dim, num_heads, head_dim);
        goto fail;
    }
    if (num_seqs < 1 || starts->shape[0] != num_seqs || query_starts->shape[0] != num_seqs + 1) {
        PyErr_Format(PyExc_ValueError, "starts, query_starts: expected [%zd] and [%zd] for %zd block tables (at least one), got [%zd] and [%zd]",
                     num_seqs, num_seqs + 1, num_seqs, starts->shape[0], query_starts->shape[0]);
        goto fail;
    }
    a->num_heads = num_heads;
    a->group = num_heads / a->pool.num_kv_heads;
    a->tables = tables->buf;
    a->table_width = tables->shape[1];
    a->starts = starts->buf;
    a->query_starts = query_starts->buf;
    a->sm_scale = (float)(1.0 / sqrt((double)head_dim));
    if (check_sequences(a, num_seqs, (Py_ssize_t)num_tokens) < 0) {
        goto fail;
    }
    plan->num_seqs = num_seqs;
    for (Py_ssize_t s = 0; s < num_seqs; s++) {
        plan->work += (a->starts[s] + a->query_starts[s + 1] - a->query_starts[s]) * a->pool.num_kv_heads * head_dim;
    }
    return plan;
fail:
    api_free(plan);
    return NULL;
}

static int api_run(const AttentionPlan *plan, int layer, const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                   const float *v, int64_t v_stride, float *out, int num_threads) {
    AttentionArgs a = plan->args;
    a.layer = layer;
    a.q = (const char *)q;
    a.k = (const char *)k;
    a.v = (const char *)v;
    a.out = (char *)out;
    a.q_token_stride = q_stride;
    a.k_token_stride = k_stride;
    a.v_token_stride = v_stride;
    return run_attention(&a, plan->num_seqs, num_threads < 1 ? 1 : num_threads, plan->work);
}

static void api_geometry(const AttentionPlan *plan, int *num_kv_heads, int *num_layers) {
    *num_kv_heads = plan->args.pool.num_kv_heads;
    *num_layers = plan->args.pool.num_layers;
}

static AttentionApi c_api = {NATIVE_API_VERSION, api_plan, api_run, api_geometry, api_free};

/* ------------------------------------------------------------------------------------------ */
/* write_fp8()                                                                                */

typedef struct {
    int64_t block;
    Py_ssize_t token;
} SlotKey;

static int compare_slots(const void *x, const void *y) {
    const SlotKey *a = x, *b = y;
    if (a->block != b->block) {
        return a->block < b->block ? -1 : 1;
    }
    return a->token < b->token ? -1 : a->token > b->token;
}

static PyObject *write_fp8(PyObject *module, PyObject *args) {
    PyObject *k_obj, *v_obj, *ids_obj, *offsets_obj, *pool_obj, *layout;
    int num_threads;
    if (!PyArg_ParseTuple(args, "OOOOOO!i:write_fp8", &k_obj, &v_obj, &ids_obj, &offsets_obj, &pool_obj, &PyTuple_Type,
                          &layout, &num_threads)) {
        return NULL;
    }
    Buffers buffers = {.count = 0};
    WriteArgs a;
    memset(&a, 0, sizeof a);
    PyObject *result = NULL;
    SlotKey *slots = NULL;
    int64_t *blocks = NULL, *fills = NULL;
    Py_ssize_t *order = NULL, *group_starts = NULL;
    if (parse_pool(&buffers, pool_obj, layout, 1, &a.pool) < 0) {
        goto done;
    }
    if (a.pool.kind != KV_FP8) {
        PyErr_SetString(PyExc_ValueError, "layout: write_fp8 writes fp8_e4m3 pools only (kv_kind 2)");
        goto done;
    }
    Py_buffer *k = get_array(&buffers, k_obj, "k", 4, "fhH", 0, 0, 4);
    if (k == NULL || check_compute_dtype(k, "k", &a.bf16) < 0) {
        goto done;
    }
    Py_ssize_t itemsize = a.bf16 ? 2 : 4;
    Py_buffer *v = get_array(&buffers, v_obj, "v", 4, a.bf16 ? "hH" : "f", itemsize, 0, 4);
    Py_buffer *ids = v ? get_array(&buffers, ids_obj, "block_ids", 1, "lq", 8, 0, 1) : NULL;
    Py_buffer *offsets = ids ? get_array(&buffers, offsets_obj, "offsets", 1, "lq", 8, 0, 1) : NULL;
    if (offsets == NULL) {
        goto done;
    }
    Py_ssize_t num_tokens = k->shape[0];
    for (int d = 0; d < 4; d++) {
        Py_ssize_t expected[4] = {num_tokens, a.pool.num_layers, a.pool.num_kv_heads, a.pool.head_dim};
        if (k->shape[d] != expected[d] || v->shape[d] != expected[d]) {
            PyErr_Format(PyExc_ValueError, "k, v: expected [%zd, %zd, %zd, %zd] (tokens, layers, kv_heads, head_dim), got "
                         "k dim %d = %zd, v dim %d = %zd", expected[0], expected[1], expected[2], expected[3], d, k->shape[d],
                         d, v->shape[d]);
            goto done;
        }
    }
    if (ids->shape[0] != num_tokens || offsets->shape[0] != num_tokens) {
        PyErr_Format(PyExc_ValueError, "block_ids, offsets: expected [%zd] each, got [%zd] and [%zd]", num_tokens, ids->shape[0],
                     offsets->shape[0]);
        goto done;
    }
    const int64_t *id_values = ids->buf, *offset_values = offsets->buf;
    for (Py_ssize_t t = 0; t < num_tokens; t++) {
        if (id_values[t] < 0 || id_values[t] >= a.pool.num_blocks) {
            PyErr_Format(PyExc_ValueError, "block_ids: token %zd names block %lld, outside the pool's [0, %zd)", t,
                         (long long)id_values[t], a.pool.num_blocks);
            goto done;
        }
        if (offset_values[t] < 0 || offset_values[t] >= a.pool.block_size) {
            PyErr_Format(PyExc_ValueError, "offsets: token %zd has offset %lld, outside the block's [0, %d)", t,
                         (long long)offset_values[t], a.pool.block_size);
            goto done;
        }
    }
    if (num_tokens == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    slots = PyMem_Malloc(sizeof(SlotKey) * num_tokens);
    blocks = PyMem_Malloc(sizeof(int64_t) * num_tokens);
    fills = PyMem_Malloc(sizeof(int64_t) * num_tokens);
    order = PyMem_Malloc(sizeof(Py_ssize_t) * num_tokens);
    group_starts = PyMem_Malloc(sizeof(Py_ssize_t) * (num_tokens + 1));
    if (!slots || !blocks || !fills || !order || !group_starts) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t t = 0; t < num_tokens; t++) {
        slots[t] = (SlotKey){id_values[t], t};
    }
    qsort(slots, num_tokens, sizeof(SlotKey), compare_slots);
    Py_ssize_t num_unique = 0;
    for (Py_ssize_t t = 0; t < num_tokens; t++) {
        if (t == 0 || slots[t].block != slots[t - 1].block) {
            blocks[num_unique] = slots[t].block;
            fills[num_unique] = 0;
            group_starts[num_unique++] = t;
        }
        order[t] = slots[t].token;
        int64_t fill = offset_values[slots[t].token] + 1;
        fills[num_unique - 1] = fill > fills[num_unique - 1] ? fill : fills[num_unique - 1];
    }
    group_starts[num_unique] = num_tokens;
    a.k = k->buf;
    a.v = v->buf;
    a.offsets = offset_values;
    a.blocks = blocks;
    a.fills = fills;
    a.token_order = order;
    a.group_starts = group_starts;
    Py_ssize_t per_block = (Py_ssize_t)a.pool.num_kv_heads * a.pool.num_layers * 2;
    Py_ssize_t num_groups = num_unique * per_block;
    Py_ssize_t count = (Py_ssize_t)a.pool.block_size * a.pool.head_dim;
    if (num_groups * count < MIN_PARALLEL_ELEMENTS || num_threads < 1) {
        num_threads = 1;
    }
    int failed = 0;
    PyThreadState *thread = num_groups * count >= MIN_GIL_FREE_ELEMENTS ? PyEval_SaveThread() : NULL;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *x = malloc(sizeof(float) * count);
        if (x == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (Py_ssize_t g = 0; g < num_groups; g++) {
            if (x != NULL) {
                Py_ssize_t tile = g % per_block;
                requantize_fn(&a, x, g / per_block, (int)(tile / (a.pool.num_layers * 2)),
                              (int)(tile / 2 % a.pool.num_layers), (int)(tile % 2));
            }
        }
        free(x);
    }
    if (thread != NULL) {
        PyEval_RestoreThread(thread);
    }
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(slots);
    PyMem_Free(blocks);
    PyMem_Free(fills);
    PyMem_Free(order);
    PyMem_Free(group_starts);
    release_all(&buffers);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* Module                                                                                     */

static PyObject *use_isa(PyObject *module, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s:use_isa", &name)) {
        return NULL;
    }
    PyObject *previous = PyUnicode_FromString(isa_name);
    if (previous == NULL || select_isa(name) < 0) {
        Py_XDECREF(previous);
        return NULL;
    }
    return previous;
}

static PyMethodDef methods[] = {
    {"attention", attention, METH_VARARGS,
     "attention(q, k, v, out, pool, layout, layer, block_tables, starts, query_starts, num_threads) -> None\n\n"
     "Causal attention of one layer over the paged pool, written into ``out`` [tokens, heads, head_dim].\n"
     "q [tokens, heads, head_dim]; k, v [tokens, kv_heads, head_dim]: this step's rows, not yet in the pool;\n"
     "float32, or bf16 passed as int16 bits (all three and out alike); the head dims contiguous.\n"
     "pool: uint8 [num_blocks, block_bytes]; layout: (num_kv_heads, num_layers, block_size, head_dim,\n"
     "kv_kind 0 fp32 / 1 bf16 / 2 fp8_e4m3, scales_offset). block_tables int64 [seqs, width];\n"
     "starts int64 [seqs] each sequence's first query position; query_starts int64 [seqs + 1] its\n"
     "query tokens' run. Query token i of sequence s sees positions 0 .. starts[s] + i."},
    {"write_fp8", write_fp8, METH_VARARGS,
     "write_fp8(k, v, block_ids, offsets, pool, layout, num_threads) -> None\n\n"
     "PagedKVCache.write for an fp8_e4m3 pool, bit for bit: k, v [tokens, layers, kv_heads, head_dim]\n"
     "(float32 or bf16 as int16 bits) stored at slots (block_ids[i], offsets[i]) (int64), every touched\n"
     "block requantized with scale amax / 448 per (kv head, layer, K|V)."},
    {"use_isa", use_isa, METH_VARARGS,
     "use_isa(name) -> previous name\n\n"
     "Pick the compiled loops: 'best' (the default at import), 'avx512', 'avx2' or 'portable'. For tests and benchmarks."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef cpu_attention_module = {
    PyModuleDef_HEAD_INIT, "engine.kernels._cpu_attention",
    "Paged attention and FP8 KV writes on CPU (engine/kernels/cpu_attention.py wraps them; the torch path is the reference).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__cpu_attention(void) {
    if (select_isa("best") < 0) {
        return NULL;
    }
    return module_with_c_api(&cpu_attention_module, &c_api, ATTENTION_API_NAME);
}
