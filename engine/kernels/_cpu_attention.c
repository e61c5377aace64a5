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
 * never scaled one by one. Items are independent, so the result does not depend on the number
 * of threads.
 *
 * write_fp8(): PagedKVCache.write for FP8 pools, bit for bit the torch path, because blocks
 * travel byte for byte to other workers and tiers. A touched block is dequantized (code value
 * times its old scale: one rounding, as dequantize_fp8's one- and two-step rules both give), this
 * step's rows are placed, slots past the block's fill are multiplied by zero (keeping the sign of
 * zero, as torch's multiply by the mask does), and every (kv head, layer, K|V) group gets
 * scale = amax / 448 (1 where that is not > 0) and codes = e4m3(clamp(x / scale, +-448)) with
 * round-to-nearest-even. Every step is elementwise, or a max, so vectorizing changes no bit.
 *
 * Compiled for the portable baseline, with AVX2+FMA copies of the hot loops chosen at import
 * (__builtin_cpu_supports), never -march=native: the image runs on other machines than it is
 * built on. OpenMP is libgomp, the one torch loaded (the Python wrapper imports torch first).
 * setup.py adds -fno-trapping-math, which changes no value (no fast-math) but lets GCC compute
 * both sides of the e4m3 encoder's select and so vectorize it; FP exception flags are unused.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { KV_FP32 = 0, KV_BF16 = 1, KV_FP8 = 2 };

#define FP8_E4M3_MAX 448.0f
#define MIN_PARALLEL_ELEMENTS 16384 /* K/V elements below which one thread beats waking the team */
/* K/V elements from which a call gives up the GIL while it computes (about a millisecond). Below,
 * it keeps it: the call replaces ~20 torch ops that would each give it up and take it back, and
 * taking it back from a busy thread can cost a switch interval (5 ms). */
#define MIN_GIL_FREE_ELEMENTS (1 << 20)

/* ------------------------------------------------------------------------------------------ */
/* Scalar conversions (exact, or round-to-nearest-even where they narrow)                     */

ALWAYS_INLINE float bits_to_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

ALWAYS_INLINE uint32_t float_to_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

/* The e4m3 code's value, exact: the bit move of kv_store/fp8.py. Sign extension and a shift put
 * the 4 exponent and 3 mantissa bits at the bottom of float32's exponent and the top of its
 * mantissa (the value times 2**-120); the mask drops the smeared sign copies; 2**120 rebiases. */
ALWAYS_INLINE float e4m3_to_float(uint8_t code) {
    uint32_t bits = ((uint32_t)(int32_t)(int8_t)code << 20) & 0x87F00000u;
    return bits_to_float(bits) * 0x1p120f;
}

/* float32 to e4m3 as quantize_fp8 does it: saturate to +-448, then round to nearest even; NaN
 * gives the NaN code 0x7f with y's sign, as torch's cast does. Integer selects only, so that the
 * loop around it vectorizes (clamping with float compares first would not). */
ALWAYS_INLINE uint8_t float_to_e4m3(float y) {
    uint32_t bits = float_to_bits(y);
    uint32_t sign = (bits >> 24) & 0x80u;
    uint32_t mag = bits & 0x7FFFFFFFu;
    /* Below 2**-6 e4m3 counts in steps of 2**-9: adding 2**14, whose float32 ulp is 2**-9, makes
     * the FPU round |y| to that step (to even), and the sum's low bits are the count. */
    uint32_t small = float_to_bits(bits_to_float(mag) + 16384.0f) - (141u << 23);
    /* Otherwise keep 3 mantissa bits, rounding bit 20 to even, and rebias the exponent 127 -> 7. */
    uint32_t normal = ((mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20) - (120u << 3);
    uint32_t code = mag < (121u << 23) ? small : normal;
    code = mag >= 0x43E00000u ? 0x7Eu : code; /* 448.0f and above (inf included): 448 */
    code = mag > 0x7F800000u ? 0x7Fu : code;
    return (uint8_t)(code | sign);
}

ALWAYS_INLINE float bf16_to_float(uint16_t bits) {
    return bits_to_float((uint32_t)bits << 16);
}

ALWAYS_INLINE uint16_t float_to_bf16(float f) {
    uint32_t bits = float_to_bits(f);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
        return 0x7FC0; /* torch's NaN */
    }
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* ------------------------------------------------------------------------------------------ */
/* Pool geometry                                                                              */

typedef struct {
    uint8_t *base;
    Py_ssize_t num_blocks;
    Py_ssize_t block_bytes;
    Py_ssize_t scales_offset;
    int num_kv_heads;
    int num_layers;
    int block_size;
    int head_dim;
    int kind;
    int element_bytes;
} Pool;

/* Byte offset, inside a block, of the [block_size, head_dim] tile of (head, layer, K|V). */
ALWAYS_INLINE Py_ssize_t tile_offset(const Pool *p, int head, int layer, int kv) {
    Py_ssize_t tile = ((Py_ssize_t)head * p->num_layers + layer) * 2 + kv;
    return tile * p->block_size * p->head_dim * p->element_bytes;
}

ALWAYS_INLINE float *scale_ptr(const Pool *p, int64_t block, int head, int layer, int kv) {
    Py_ssize_t index = ((Py_ssize_t)head * p->num_layers + layer) * 2 + kv;
    return (float *)(p->base + block * p->block_bytes + p->scales_offset + index * 4);
}

/* ------------------------------------------------------------------------------------------ */
/* Attention                                                                                  */

typedef struct {
    Pool pool;
    int layer;
    int group;           /* query heads per KV head */
    int bf16;            /* queries, K/V rows and output are bf16 (else float32) */
    const char *q, *k, *v;
    char *out;
    Py_ssize_t q_token_stride, k_token_stride, v_token_stride; /* in elements */
    int num_heads;
    const int64_t *tables;
    Py_ssize_t table_width;
    const int64_t *starts;
    const int64_t *query_starts;
    float sm_scale;
} AttentionArgs;

typedef struct {
    float *q;      /* [rows, head_dim] this item's queries, times sm_scale */
    float *acc;    /* [rows, head_dim] */
    float *max;    /* [rows] */
    float *sum;    /* [rows] */
    float *weights; /* [block_size] */
    float *k_tile;  /* [block_size, head_dim] widened K (fp8, bf16) */
    float *v_tile;
} Scratch;

ALWAYS_INLINE float dot(const float *a, const float *b, int n) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int i = 0; i < n; i++) {
        total += a[i] * b[i];
    }
    return total;
}

/* Four dot products with one query: four independent sums, so the adds do not wait on each other. */
ALWAYS_INLINE void dot4(const float *q, const float *k0, Py_ssize_t stride, int n, float *out) {
    const float *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int i = 0; i < n; i++) {
        s0 += q[i] * k0[i];
        s1 += q[i] * k1[i];
        s2 += q[i] * k2[i];
        s3 += q[i] * k3[i];
    }
    out[0] = s0;
    out[1] = s1;
    out[2] = s2;
    out[3] = s3;
}

ALWAYS_INLINE void axpy(float *y, float a, const float *x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) {
        y[i] += a * x[i];
    }
}

/* y += w[0] x0 + .. + w[3] x3 (rows `stride` apart): one pass over y for four rows. */
ALWAYS_INLINE void axpy4(float *y, const float *w, const float *x0, Py_ssize_t stride, int n) {
    const float *x1 = x0 + stride, *x2 = x1 + stride, *x3 = x2 + stride;
    float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
#pragma omp simd
    for (int i = 0; i < n; i++) {
        y[i] += w0 * x0[i] + w1 * x1[i] + w2 * x2[i] + w3 * x3[i];
    }
}

/* e**x for x <= 0 (a score minus the running max), in a form that vectorizes, unlike expf:
 * x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact), e**r by its Taylor series
 * to r**7 (truncation below 1e-8 relative), 2**n built in the exponent bits. Below -87 the
 * result would leave float's normal range; e**-87 stands in (a weight of ~1e-38 beside the
 * row's maximum, whose weight is 1). */
ALWAYS_INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2**23 */
    float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * bits_to_float((uint32_t)((int32_t)n + 127) << 23);
}

ALWAYS_INLINE void widen_fp8(float *dst, const uint8_t *src, Py_ssize_t n) {
#pragma omp simd
    for (Py_ssize_t i = 0; i < n; i++) {
        dst[i] = e4m3_to_float(src[i]);
    }
}

ALWAYS_INLINE void widen_bf16(float *dst, const uint16_t *src, Py_ssize_t n) {
#pragma omp simd
    for (Py_ssize_t i = 0; i < n; i++) {
        dst[i] = bf16_to_float(src[i]);
    }
}

/* Rows of keys (row stride in floats) folded into every query row that sees them. Key j sits at
 * position first_key + j; query row r at position start + r / group. */
ALWAYS_INLINE void attend_tile(Scratch *w, int rows, int group, int head_dim, int64_t start,
                               const float *keys, Py_ssize_t key_stride, const float *values,
                               Py_ssize_t value_stride, int num_keys, int64_t first_key,
                               float k_scale, float v_scale) {
    for (int r = 0; r < rows; r++) {
        int64_t visible = start + r / group - first_key + 1;
        if (visible <= 0) {
            continue;
        }
        int n = visible < num_keys ? (int)visible : num_keys;
        const float *q = w->q + (Py_ssize_t)r * head_dim;
        float *acc = w->acc + (Py_ssize_t)r * head_dim;
        float *scores = w->weights;
        int j = 0;
        for (; j + 4 <= n; j += 4) {
            dot4(q, keys + j * key_stride, key_stride, head_dim, scores + j);
        }
        for (; j < n; j++) {
            scores[j] = dot(q, keys + j * key_stride, head_dim);
        }
        float tile_max = -INFINITY;
        for (j = 0; j < n; j++) {
            scores[j] *= k_scale;
            tile_max = scores[j] > tile_max ? scores[j] : tile_max;
        }
        if (tile_max > w->max[r]) {
            float alpha = exp_nonpositive(w->max[r] - tile_max);
            w->sum[r] *= alpha;
            for (int d = 0; d < head_dim; d++) {
                acc[d] *= alpha;
            }
            w->max[r] = tile_max;
        }
        float row_max = w->max[r], total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (j = 0; j < n; j++) {
            float p = exp_nonpositive(scores[j] - row_max);
            total += p;
            scores[j] = p * v_scale;
        }
        w->sum[r] += total;
        for (j = 0; j + 4 <= n; j += 4) {
            axpy4(acc, scores + j, values + j * value_stride, value_stride, head_dim);
        }
        for (; j < n; j++) {
            axpy(acc, scores[j], values + j * value_stride, head_dim);
        }
    }
}

ALWAYS_INLINE const float *token_rows(const AttentionArgs *a, const char *base, Py_ssize_t token_stride,
                                      int64_t token, int head, int n, float *tile, Py_ssize_t *stride) {
    int hd = a->pool.head_dim;
    if (!a->bf16) {
        *stride = token_stride;
        return (const float *)base + token * token_stride + (Py_ssize_t)head * hd;
    }
    const uint16_t *src = (const uint16_t *)base + token * token_stride + (Py_ssize_t)head * hd;
    for (int j = 0; j < n; j++) {
        widen_bf16(tile + (Py_ssize_t)j * hd, src + j * token_stride, hd);
    }
    *stride = hd;
    return tile;
}

ALWAYS_INLINE const float *pool_tile(const Pool *p, const uint8_t *src, int n, float *tile) {
    Py_ssize_t count = (Py_ssize_t)n * p->head_dim;
    if (p->kind == KV_FP32) {
        return (const float *)src;
    }
    if (p->kind == KV_BF16) {
        widen_bf16(tile, (const uint16_t *)src, count);
    } else {
        widen_fp8(tile, src, count);
    }
    return tile;
}

/* head_dim is a parameter so that callers can pass a constant and have the loops specialized. */
ALWAYS_INLINE void attend_item_dim(const AttentionArgs *a, Scratch *w, Py_ssize_t seq, int kv_head, int hd) {
    const Pool *p = &a->pool;
    int64_t token0 = a->query_starts[seq];
    int num_tokens = (int)(a->query_starts[seq + 1] - token0);
    int64_t start = a->starts[seq];
    int rows = num_tokens * a->group;
    for (int r = 0; r < rows; r++) {
        int64_t token = token0 + r / a->group;
        int head = kv_head * a->group + r % a->group;
        float *q = w->q + (Py_ssize_t)r * hd;
        if (a->bf16) {
            const uint16_t *src = (const uint16_t *)a->q + token * a->q_token_stride + (Py_ssize_t)head * hd;
            for (int d = 0; d < hd; d++) {
                q[d] = bf16_to_float(src[d]) * a->sm_scale;
            }
        } else {
            const float *src = (const float *)a->q + token * a->q_token_stride + (Py_ssize_t)head * hd;
            for (int d = 0; d < hd; d++) {
                q[d] = src[d] * a->sm_scale;
            }
        }
        memset(w->acc + (Py_ssize_t)r * hd, 0, sizeof(float) * hd);
        w->max[r] = -INFINITY;
        w->sum[r] = 0.0f;
    }
    int bs = p->block_size;
    int64_t num_pool_blocks = (start + bs - 1) / bs;
    for (int64_t b = 0; b < num_pool_blocks; b++) {
        int64_t block = a->tables[seq * a->table_width + b];
        int n = start - b * bs < bs ? (int)(start - b * bs) : bs;
        const uint8_t *base = p->base + block * p->block_bytes;
        const float *keys = pool_tile(p, base + tile_offset(p, kv_head, a->layer, 0), n, w->k_tile);
        const float *values = pool_tile(p, base + tile_offset(p, kv_head, a->layer, 1), n, w->v_tile);
        float k_scale = 1.0f, v_scale = 1.0f;
        if (p->kind == KV_FP8) {
            k_scale = *scale_ptr(p, block, kv_head, a->layer, 0);
            v_scale = *scale_ptr(p, block, kv_head, a->layer, 1);
        }
        attend_tile(w, rows, a->group, hd, start, keys, hd, values, hd, n, b * bs, k_scale, v_scale);
    }
    for (int j0 = 0; j0 < num_tokens; j0 += bs) {
        int n = num_tokens - j0 < bs ? num_tokens - j0 : bs;
        Py_ssize_t k_stride, v_stride;
        const float *keys = token_rows(a, a->k, a->k_token_stride, token0 + j0, kv_head, n, w->k_tile, &k_stride);
        const float *values = token_rows(a, a->v, a->v_token_stride, token0 + j0, kv_head, n, w->v_tile, &v_stride);
        attend_tile(w, rows, a->group, hd, start, keys, k_stride, values, v_stride, n, start + j0, 1.0f, 1.0f);
    }
    for (int r = 0; r < rows; r++) {
        int64_t token = token0 + r / a->group;
        int head = kv_head * a->group + r % a->group;
        Py_ssize_t offset = (token * a->num_heads + head) * hd;
        const float *acc = w->acc + (Py_ssize_t)r * hd;
        float inverse = 1.0f / w->sum[r];
        if (a->bf16) {
            uint16_t *dst = (uint16_t *)a->out + offset;
            for (int d = 0; d < hd; d++) {
                dst[d] = float_to_bf16(acc[d] * inverse);
            }
        } else {
            float *dst = (float *)a->out + offset;
            for (int d = 0; d < hd; d++) {
                dst[d] = acc[d] * inverse;
            }
        }
    }
}

ALWAYS_INLINE void attend_item(const AttentionArgs *a, Scratch *w, Py_ssize_t seq, int kv_head) {
    switch (a->pool.head_dim) {
    case 64:
        attend_item_dim(a, w, seq, kv_head, 64);
        break;
    case 128:
        attend_item_dim(a, w, seq, kv_head, 128);
        break;
    default:
        attend_item_dim(a, w, seq, kv_head, a->pool.head_dim);
    }
}

__attribute__((target("avx2,fma"))) static void attend_item_avx2(const AttentionArgs *a, Scratch *w, Py_ssize_t seq, int kv_head) {
    attend_item(a, w, seq, kv_head);
}

static void attend_item_portable(const AttentionArgs *a, Scratch *w, Py_ssize_t seq, int kv_head) {
    attend_item(a, w, seq, kv_head);
}

/* ------------------------------------------------------------------------------------------ */
/* FP8 write                                                                                  */

typedef struct {
    Pool pool;
    int bf16;
    const char *k, *v;       /* [tokens, layers, kv_heads, head_dim] */
    const int64_t *offsets;  /* [tokens] */
    const int64_t *blocks;   /* [num_unique] the touched blocks */
    const int64_t *fills;    /* [num_unique] slots valid after this write */
    const Py_ssize_t *token_order;  /* tokens grouped by block, in their order within each */
    const Py_ssize_t *group_starts; /* [num_unique + 1] each block's run in token_order */
} WriteArgs;

/* One (block, kv head, layer, K|V) group of block_size * head_dim values, requantized. */
ALWAYS_INLINE void requantize_group(const WriteArgs *a, float *x, Py_ssize_t unique, int head, int layer, int kv) {
    const Pool *p = &a->pool;
    int hd = p->head_dim;
    Py_ssize_t count = (Py_ssize_t)p->block_size * hd;
    int64_t block = a->blocks[unique];
    uint8_t *codes = p->base + block * p->block_bytes + tile_offset(p, head, layer, kv);
    float *scale_slot = scale_ptr(p, block, head, layer, kv);
    float old_scale = *scale_slot;
#pragma omp simd
    for (Py_ssize_t i = 0; i < count; i++) {
        x[i] = e4m3_to_float(codes[i]) * old_scale;
    }
    const char *rows = kv ? a->v : a->k;
    for (Py_ssize_t t = a->group_starts[unique]; t < a->group_starts[unique + 1]; t++) {
        Py_ssize_t token = a->token_order[t];
        Py_ssize_t row = ((token * p->num_layers + layer) * p->num_kv_heads + head) * hd;
        float *dst = x + a->offsets[token] * hd;
        if (a->bf16) {
            widen_bf16(dst, (const uint16_t *)rows + row, hd);
        } else {
            memcpy(dst, (const float *)rows + row, sizeof(float) * hd);
        }
    }
#pragma omp simd
    for (Py_ssize_t i = a->fills[unique] * hd; i < count; i++) {
        x[i] *= 0.0f;
    }
    float amax = 0.0f;
    int num_nan = 0;
#pragma omp simd reduction(max : amax) reduction(+ : num_nan)
    for (Py_ssize_t i = 0; i < count; i++) {
        float magnitude = fabsf(x[i]);
        num_nan += magnitude != magnitude;
        amax = magnitude > amax ? magnitude : amax;
    }
    float scale = (num_nan ? NAN : amax) / FP8_E4M3_MAX;
    scale = scale > 0.0f ? scale : 1.0f;
#pragma omp simd
    for (Py_ssize_t i = 0; i < count; i++) {
        codes[i] = float_to_e4m3(x[i] / scale);
    }
    *scale_slot = scale;
}

__attribute__((target("avx2,fma"))) static void requantize_group_avx2(const WriteArgs *a, float *x, Py_ssize_t unique, int head, int layer, int kv) {
    requantize_group(a, x, unique, head, layer, kv);
}

static void requantize_group_portable(const WriteArgs *a, float *x, Py_ssize_t unique, int head, int layer, int kv) {
    requantize_group(a, x, unique, head, layer, kv);
}

/* ------------------------------------------------------------------------------------------ */
/* Dispatch                                                                                   */

typedef void (*AttendFn)(const AttentionArgs *, Scratch *, Py_ssize_t, int);
typedef void (*RequantizeFn)(const WriteArgs *, float *, Py_ssize_t, int, int, int);

static AttendFn attend_fn = attend_item_portable;
static RequantizeFn requantize_fn = requantize_group_portable;
static const char *isa_name = "portable";

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static int select_isa(const char *name) {
    if (strcmp(name, "best") == 0) {
        name = cpu_has_avx2() ? "avx2" : "portable";
    }
    if (strcmp(name, "avx2") == 0 && cpu_has_avx2()) {
        attend_fn = attend_item_avx2;
        requantize_fn = requantize_group_avx2;
        isa_name = "avx2";
        return 0;
    }
    if (strcmp(name, "portable") == 0) {
        attend_fn = attend_item_portable;
        requantize_fn = requantize_group_portable;
        isa_name = "portable";
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "isa: '%s' is not one of 'best', 'portable' or (on a CPU with AVX2 and FMA) 'avx2'", name);
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

static int run_attention(const AttentionArgs *a, Py_ssize_t num_seqs, int num_threads, Py_ssize_t work) {
    Py_ssize_t max_tokens = 0;
    for (Py_ssize_t s = 0; s < num_seqs; s++) {
        Py_ssize_t n = a->query_starts[s + 1] - a->query_starts[s];
        max_tokens = n > max_tokens ? n : max_tokens;
    }
    Py_ssize_t rows = max_tokens * a->group;
    Py_ssize_t hd = a->pool.head_dim, bs = a->pool.block_size;
    Py_ssize_t floats = 2 * rows * hd + 2 * rows + bs + 2 * bs * hd;
    Py_ssize_t num_items = num_seqs * a->pool.num_kv_heads;
    int failed = 0;
    if (work < MIN_PARALLEL_ELEMENTS || num_items < 2) {
        num_threads = 1;
    }
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *scratch = malloc(sizeof(float) * floats);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        Scratch w = {scratch, scratch + rows * hd, scratch + 2 * rows * hd, scratch + 2 * rows * hd + rows,
                     scratch + 2 * rows * hd + 2 * rows, scratch + 2 * rows * hd + 2 * rows + bs,
                     scratch + 2 * rows * hd + 2 * rows + bs + bs * hd};
#pragma omp for schedule(dynamic, 1)
        for (Py_ssize_t item = 0; item < num_items; item++) {
            if (scratch != NULL) {
                attend_fn(a, &w, item / a->pool.num_kv_heads, (int)(item % a->pool.num_kv_heads));
            }
        }
        free(scratch);
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
     "Pick the compiled loops: 'best' (the default at import), 'avx2' or 'portable'. For tests and benchmarks."},
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
    return PyModule_Create(&cpu_attention_module);
}
