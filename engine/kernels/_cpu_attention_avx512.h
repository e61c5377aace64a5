/* The AVX-512 copy of the attention unit (engine/kernels/_cpu_attention.c), for head dims that
 * are a multiple of 16. Included once, by that file only, after _cpu_attention_loops.h.
 *
 * Why not the generic loops compiled for AVX-512: they score key by key, a dot product and a
 * horizontal sum per (row, key), and widen each block into memory before reading it back. Here a
 * tile of up to 16 keys is widened straight from the pool (e4m3, bf16 or fp32) into registers and
 * transposed in them, so that scores need no horizontal sum:
 *
 *     kt[d] = (K[0][d], .., K[15][d])          one zmm per head-dim index, head_dim x 16 floats
 *     S[r]  = sum_d q[r][d] * kt[d]            16 keys' scores of row r, FMAs with a broadcast q
 *     acc[r][d0..d0+15] += p[r][j] * V[j][..]  P.V as 16 rank-1 updates, 4 rows in registers
 *
 * The softmax runs on the 16 scores at once (masked lanes: keys a row may not see, or past the
 * tile). Same float32 math as the generic loops, in another order: results agree within rounding.
 */

#ifndef SPLITSERVE_CPU_ATTENTION_AVX512_H
#define SPLITSERVE_CPU_ATTENTION_AVX512_H

#include <immintrin.h>

#include "_cpu_attention_loops.h"

#define AVX512_TARGET "avx512f,avx512bw,avx512dq,avx512vl,fma,f16c"
#define AVX512_INLINE static inline __attribute__((always_inline, target(AVX512_TARGET)))
#define TILE_KEYS 16
#define ROW_GROUP 4 /* rows whose accumulators stay in registers together */

/* e4m3 codes are read as float16 bit patterns 2**8 times smaller: the sign-extended code shifted
 * left by 7 puts e4m3's 4 exponent and 3 mantissa bits at the bottom of float16's exponent and
 * the top of its mantissa, the mask drops the extra sign copy. Every e4m3 value, subnormals
 * included, is exact in float16, and vcvtph2ps widens without the float32 subnormals of
 * e4m3_to_float's bit move; the block's scales take the 2**8 back (exact: a power of two). */
#define FP8_AS_HALF_SCALE 256.0f

/* 16 consecutive elements of a K/V row, widened exactly to float32 (e4m3: times 2**-8, see above). */
AVX512_INLINE __m512 load16(const void *src, int kind) {
    if (kind == KV_FP32) {
        return _mm512_loadu_ps(src);
    }
    if (kind == KV_BF16) {
        __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
        return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    }
    __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)src)), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(h, _mm256_set1_epi16((short)0xBFFF)));
}

/* r[i] (row i, 16 columns) becomes column i: three stages of in-lane interleaves, then a 4 x 4
 * transpose of the 128-bit lanes. */
AVX512_INLINE void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) {
        __m512d a = _mm512_castps_pd(t[4 * k]), b = _mm512_castps_pd(t[4 * k + 1]);
        __m512d c = _mm512_castps_pd(t[4 * k + 2]), d = _mm512_castps_pd(t[4 * k + 3]);
        u[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 4; i++) {
        __m512 a = _mm512_shuffle_f32x4(u[i], u[4 + i], 0x44), b = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0x44);
        __m512 c = _mm512_shuffle_f32x4(u[i], u[4 + i], 0xEE), d = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0xEE);
        r[i] = _mm512_shuffle_f32x4(a, b, 0x88);
        r[4 + i] = _mm512_shuffle_f32x4(a, b, 0xDD);
        r[8 + i] = _mm512_shuffle_f32x4(c, d, 0x88);
        r[12 + i] = _mm512_shuffle_f32x4(c, d, 0xDD);
    }
}

/* kt[d][j] = K[j][d] for the tile's n keys (rows `stride` elements apart), zero past n. */
AVX512_INLINE void transpose_keys(float *kt, const uint8_t *src, Py_ssize_t stride, int kind, int element_bytes,
                                  int n, int hd) {
    for (int d0 = 0; d0 < hd; d0 += 16) {
        __m512 r[16];
        if (n == 16) {
            for (int j = 0; j < 16; j++) {
                r[j] = load16(src + (j * stride + d0) * element_bytes, kind);
            }
        } else {
            for (int j = 0; j < 16; j++) {
                r[j] = j < n ? load16(src + (j * stride + d0) * element_bytes, kind) : _mm512_setzero_ps();
            }
        }
        transpose16(r);
        for (int i = 0; i < 16; i++) {
            _mm512_store_ps(kt + (Py_ssize_t)(d0 + i) * 16, r[i]);
        }
    }
}

/* The tile's values as float32 rows: the source itself when it is float32, else widened. */
AVX512_INLINE const float *widen_values(float *tile, const uint8_t *src, Py_ssize_t stride, int kind,
                                        int element_bytes, int n, int hd, Py_ssize_t *out_stride) {
    if (kind == KV_FP32) {
        *out_stride = stride;
        return (const float *)src;
    }
    for (int j = 0; j < n; j++) {
        for (int d0 = 0; d0 < hd; d0 += 16) {
            _mm512_storeu_ps(tile + (Py_ssize_t)j * hd + d0, load16(src + (j * stride + d0) * element_bytes, kind));
        }
    }
    *out_stride = hd;
    return tile;
}

/* exp_nonpositive in 16 lanes. */
AVX512_INLINE __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* Scores of rows r0 .. r0 + nr - 1 against the transposed tile: two sums per row (even and odd
 * head-dim indexes) so that even three rows keep six FMA chains in flight. */
AVX512_INLINE void score_rows(const float *kt, const float *q, int nr, int hd, __m512 *scores) {
    __m512 even[ROW_GROUP], odd[ROW_GROUP];
    for (int r = 0; r < nr; r++) {
        even[r] = _mm512_setzero_ps();
        odd[r] = _mm512_setzero_ps();
    }
    for (int d = 0; d < hd; d += 2) {
        __m512 k0 = _mm512_load_ps(kt + (Py_ssize_t)d * 16), k1 = _mm512_load_ps(kt + (Py_ssize_t)(d + 1) * 16);
        for (int r = 0; r < nr; r++) {
            even[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[(Py_ssize_t)r * hd + d]), k0, even[r]);
            odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[(Py_ssize_t)r * hd + d + 1]), k1, odd[r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        scores[r] = _mm512_add_ps(even[r], odd[r]);
    }
}

/* Row r's online softmax over the tile: its visible lanes' maximum rescales the running state,
 * and probs[r] gets the tile's weights times v_scale (zero where the row sees no key). */
AVX512_INLINE void softmax_row(Scratch *w, int r, __m512 s, int visible, float k_scale, float v_scale, int hd) {
    float *probs = w->probs + (Py_ssize_t)r * 16;
    if (visible <= 0) {
        _mm512_store_ps(probs, _mm512_setzero_ps());
        return;
    }
    __mmask16 mask = visible >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << visible) - 1);
    s = _mm512_mul_ps(s, _mm512_set1_ps(k_scale));
    float tile_max = _mm512_mask_reduce_max_ps(mask, s);
    if (tile_max > w->max[r]) {
        float alpha = exp_nonpositive(w->max[r] - tile_max);
        w->sum[r] *= alpha;
        float *acc = w->acc + (Py_ssize_t)r * hd;
        for (int d0 = 0; d0 < hd; d0 += 16) {
            _mm512_storeu_ps(acc + d0, _mm512_mul_ps(_mm512_loadu_ps(acc + d0), _mm512_set1_ps(alpha)));
        }
        w->max[r] = tile_max;
    }
    __m512 p = _mm512_maskz_mov_ps(mask, exp16_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(w->max[r]))));
    w->sum[r] += _mm512_reduce_add_ps(p);
    _mm512_store_ps(probs, _mm512_mul_ps(p, _mm512_set1_ps(v_scale)));
}

/* acc[r] += sum_j probs[r][j] * values[j] for rows r0 .. r0 + nr - 1, 64 head dims at a time:
 * the 4 x nr accumulators stay in registers and are independent FMA chains (a loop over 16 dims
 * at a time had nr chains of 16 dependent FMAs, bound by their latency). */
AVX512_INLINE void accumulate_rows(Scratch *w, int r0, int nr, const float *values, Py_ssize_t stride, int n, int hd) {
    for (int d0 = 0; d0 < hd; d0 += 64) {
        int nv = hd - d0 >= 64 ? 4 : (hd - d0) / 16;
        __m512 acc[ROW_GROUP][4];
        for (int r = 0; r < nr; r++) {
            for (int i = 0; i < nv; i++) {
                acc[r][i] = _mm512_loadu_ps(w->acc + (Py_ssize_t)(r0 + r) * hd + d0 + 16 * i);
            }
        }
        for (int j = 0; j < n; j++) {
            __m512 v[4];
            for (int i = 0; i < nv; i++) {
                v[i] = _mm512_loadu_ps(values + j * stride + d0 + 16 * i);
            }
            for (int r = 0; r < nr; r++) {
                __m512 p = _mm512_set1_ps(w->probs[(r0 + r) * 16 + j]);
                for (int i = 0; i < nv; i++) {
                    acc[r][i] = _mm512_fmadd_ps(p, v[i], acc[r][i]);
                }
            }
        }
        for (int r = 0; r < nr; r++) {
            for (int i = 0; i < nv; i++) {
                _mm512_storeu_ps(w->acc + (Py_ssize_t)(r0 + r) * hd + d0 + 16 * i, acc[r][i]);
            }
        }
    }
}

/* Rows r0 .. r0 + nr - 1 through one tile; nr a constant at each call site (see attend_tile16). */
AVX512_INLINE void tile_row_group(Scratch *w, int r0, int nr, int group, int hd, int64_t start, int64_t first_key,
                                  int n, const float *values, Py_ssize_t v_stride, float k_scale, float v_scale) {
    __m512 scores[ROW_GROUP];
    score_rows(w->k_tile, w->q + (Py_ssize_t)r0 * hd, nr, hd, scores);
    for (int r = 0; r < nr; r++) {
        int64_t visible = start + (r0 + r) / group - first_key + 1;
        softmax_row(w, r0 + r, scores[r], visible < n ? (int)visible : n, k_scale, v_scale, hd);
    }
    accumulate_rows(w, r0, nr, values, v_stride, n, hd);
}

/* Up to 16 keys (first at position first_key; K and V rows of `kind`, the given numbers of
 * elements apart) folded into every row of the item. */
AVX512_INLINE void attend_tile16(Scratch *w, int rows, int group, int hd, int64_t start, int64_t first_key, int n,
                                 const uint8_t *k_src, Py_ssize_t k_stride, const uint8_t *v_src, Py_ssize_t v_src_stride,
                                 int kind, int element_bytes, float k_scale, float v_scale) {
    transpose_keys(w->k_tile, k_src, k_stride, kind, element_bytes, n, hd);
    Py_ssize_t v_stride;
    const float *values = widen_values(w->v_tile, v_src, v_src_stride, kind, element_bytes, n, hd, &v_stride);
    int r0 = 0;
    for (; r0 + ROW_GROUP <= rows; r0 += ROW_GROUP) {
        tile_row_group(w, r0, ROW_GROUP, group, hd, start, first_key, n, values, v_stride, k_scale, v_scale);
    }
    switch (rows - r0) {
    case 3:
        tile_row_group(w, r0, 3, group, hd, start, first_key, n, values, v_stride, k_scale, v_scale);
        break;
    case 2:
        tile_row_group(w, r0, 2, group, hd, start, first_key, n, values, v_stride, k_scale, v_scale);
        break;
    case 1:
        tile_row_group(w, r0, 1, group, hd, start, first_key, n, values, v_stride, k_scale, v_scale);
        break;
    }
}

/* The pool's blocks [first_block, end_block) of the unit; `kind` a constant at each call site. */
AVX512_INLINE void pool_tiles(const AttentionArgs *a, Scratch *w, const WorkUnit *u, int rows, int hd, int kind) {
    const Pool *p = &a->pool;
    int64_t start = a->starts[u->seq];
    int bs = p->block_size, element_bytes = kind == KV_FP32 ? 4 : kind == KV_BF16 ? 2 : 1;
    for (int64_t b = u->first_block; b < u->end_block; b++) {
        int64_t block = a->tables[u->seq * a->table_width + b];
        int n = start - b * bs < bs ? (int)(start - b * bs) : bs;
        const uint8_t *base = p->base + block * p->block_bytes;
        const uint8_t *k_src = base + tile_offset(p, u->kv_head, a->layer, 0);
        const uint8_t *v_src = base + tile_offset(p, u->kv_head, a->layer, 1);
        float k_scale = 1.0f, v_scale = 1.0f;
        if (kind == KV_FP8) {
            k_scale = *scale_ptr(p, block, u->kv_head, a->layer, 0) * FP8_AS_HALF_SCALE;
            v_scale = *scale_ptr(p, block, u->kv_head, a->layer, 1) * FP8_AS_HALF_SCALE;
        }
        for (int j0 = 0; j0 < n; j0 += TILE_KEYS) {
            int m = n - j0 < TILE_KEYS ? n - j0 : TILE_KEYS;
            Py_ssize_t skip = (Py_ssize_t)j0 * hd * element_bytes;
            attend_tile16(w, rows, a->group, hd, start, b * bs + j0, m, k_src + skip, hd, v_src + skip, hd, kind,
                          element_bytes, k_scale, v_scale);
        }
    }
}

/* This step's own K/V rows (float32 or bf16, `kind` a constant at each call site). */
AVX512_INLINE void own_tiles(const AttentionArgs *a, Scratch *w, const WorkUnit *u, int rows, int hd, int kind) {
    int64_t token0 = a->query_starts[u->seq];
    int num_tokens = (int)(a->query_starts[u->seq + 1] - token0);
    int64_t start = a->starts[u->seq];
    int element_bytes = kind == KV_BF16 ? 2 : 4;
    Py_ssize_t head_offset = (Py_ssize_t)u->kv_head * hd * element_bytes;
    for (int j0 = 0; j0 < num_tokens; j0 += TILE_KEYS) {
        int m = num_tokens - j0 < TILE_KEYS ? num_tokens - j0 : TILE_KEYS;
        const uint8_t *k_src = (const uint8_t *)a->k + (token0 + j0) * a->k_token_stride * element_bytes + head_offset;
        const uint8_t *v_src = (const uint8_t *)a->v + (token0 + j0) * a->v_token_stride * element_bytes + head_offset;
        attend_tile16(w, rows, a->group, hd, start, start + j0, m, k_src, a->k_token_stride, v_src, a->v_token_stride,
                      kind, element_bytes, 1.0f, 1.0f);
    }
}

AVX512_INLINE void attend_unit_avx512_dim(const AttentionArgs *a, Scratch *w, const WorkUnit *u, int hd) {
    int rows = load_queries(a, w, u->seq, u->kv_head, hd);
    switch (a->pool.kind) {
    case KV_FP8:
        pool_tiles(a, w, u, rows, hd, KV_FP8);
        break;
    case KV_BF16:
        pool_tiles(a, w, u, rows, hd, KV_BF16);
        break;
    default:
        pool_tiles(a, w, u, rows, hd, KV_FP32);
    }
    if (u->own_rows && a->bf16) {
        own_tiles(a, w, u, rows, hd, KV_BF16);
    } else if (u->own_rows) {
        own_tiles(a, w, u, rows, hd, KV_FP32);
    }
    store_rows(a, w, u, rows, hd);
}

/* head_dim 64 (SmolLM2) and 128 as constants, so the per-dim loops unroll; 16 | head_dim. */
AVX512_INLINE void attend_unit_avx512(const AttentionArgs *a, Scratch *w, const WorkUnit *u) {
    switch (a->pool.head_dim) {
    case 64:
        attend_unit_avx512_dim(a, w, u, 64);
        break;
    case 128:
        attend_unit_avx512_dim(a, w, u, 128);
        break;
    default:
        attend_unit_avx512_dim(a, w, u, a->pool.head_dim);
    }
}

#endif
