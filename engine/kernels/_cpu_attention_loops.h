/* The loops of engine/kernels/_cpu_attention.c: e4m3 and bf16 conversions, the pool's geometry,
 * the attention work unit and the FP8 requantization of one group. Everything is inlined into
 * the .c file's per-ISA entry points (always_inline), so each copy compiles these loops for its
 * own target (AVX2+FMA, the portable baseline, or AVX-512 for head dims that are no multiple of
 * 16; _cpu_attention_avx512.h has AVX-512's own). Included once, by that file only. */

#ifndef SPLITSERVE_CPU_ATTENTION_LOOPS_H
#define SPLITSERVE_CPU_ATTENTION_LOOPS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { KV_FP32 = 0, KV_BF16 = 1, KV_FP8 = 2 };

#define FP8_E4M3_MAX 448.0f

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
    float *k_tile;  /* [max(block_size, 16), head_dim] widened K (fp8, bf16), or K transposed */
    float *v_tile;
    float *probs;   /* [rows][16] softmax weights of a 16-key tile (AVX-512 loops) */
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

/* One work unit: a (sequence, KV head) item over the pool blocks [first_block, end_block), plus
 * this step's own K/V rows when own_rows. An item runs as one unit, or, split along its context
 * (_cpu_attention_split.h), as several whose partial softmax states are merged afterwards. */
typedef struct {
    Py_ssize_t seq;
    int kv_head;
    int own_rows;
    int64_t first_block, end_block;
    float *partial; /* NULL: normalize into out; else [rows][head_dim + 2]: acc, max, sum */
    int part, num_parts; /* this unit's place among its item's parts */
} WorkUnit;

/* The item's query rows (token-major, then the group's heads), times sm_scale; state reset. */
ALWAYS_INLINE int load_queries(const AttentionArgs *a, Scratch *w, Py_ssize_t seq, int kv_head, int hd) {
    int64_t token0 = a->query_starts[seq];
    int rows = (int)(a->query_starts[seq + 1] - token0) * a->group;
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
    return rows;
}

/* The unit's rows out: normalized into `out` (a whole item), or its raw state into the partial. */
ALWAYS_INLINE void store_rows(const AttentionArgs *a, const Scratch *w, const WorkUnit *u, int rows, int hd) {
    int64_t token0 = a->query_starts[u->seq];
    for (int r = 0; r < rows; r++) {
        const float *acc = w->acc + (Py_ssize_t)r * hd;
        if (u->partial != NULL) {
            float *dst = u->partial + (Py_ssize_t)r * (hd + 2);
            memcpy(dst, acc, sizeof(float) * hd);
            dst[hd] = w->max[r];
            dst[hd + 1] = w->sum[r];
            continue;
        }
        int64_t token = token0 + r / a->group;
        int head = u->kv_head * a->group + r % a->group;
        Py_ssize_t offset = (token * a->num_heads + head) * hd;
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

/* head_dim is a parameter so that callers can pass a constant and have the loops specialized. */
ALWAYS_INLINE void attend_unit_dim(const AttentionArgs *a, Scratch *w, const WorkUnit *u, int hd) {
    const Pool *p = &a->pool;
    Py_ssize_t seq = u->seq;
    int kv_head = u->kv_head;
    int64_t token0 = a->query_starts[seq];
    int num_tokens = (int)(a->query_starts[seq + 1] - token0);
    int64_t start = a->starts[seq];
    int rows = load_queries(a, w, seq, kv_head, hd);
    int bs = p->block_size;
    for (int64_t b = u->first_block; b < u->end_block; b++) {
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
    for (int j0 = 0; u->own_rows && j0 < num_tokens; j0 += bs) {
        int n = num_tokens - j0 < bs ? num_tokens - j0 : bs;
        Py_ssize_t k_stride, v_stride;
        const float *keys = token_rows(a, a->k, a->k_token_stride, token0 + j0, kv_head, n, w->k_tile, &k_stride);
        const float *values = token_rows(a, a->v, a->v_token_stride, token0 + j0, kv_head, n, w->v_tile, &v_stride);
        attend_tile(w, rows, a->group, hd, start, keys, k_stride, values, v_stride, n, start + j0, 1.0f, 1.0f);
    }
    store_rows(a, w, u, rows, hd);
}

ALWAYS_INLINE void attend_unit(const AttentionArgs *a, Scratch *w, const WorkUnit *u) {
    switch (a->pool.head_dim) {
    case 64:
        attend_unit_dim(a, w, u, 64);
        break;
    case 128:
        attend_unit_dim(a, w, u, 128);
        break;
    default:
        attend_unit_dim(a, w, u, a->pool.head_dim);
    }
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

#endif
