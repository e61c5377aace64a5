/* engine.quant._qmatmul: y[M, N] = x[M, K] W^T in float32 for decode-sized M, on group-32
 * quantized weights, with int8 dot products (VNNI's vpdpbusd: unsigned weight codes times
 * signed activation codes, as llama.cpp does; AVX2's maddubs where there is no VNNI).
 *
 *   Q4 (scale and min)  w = d * q + m,  q in 0..15      (GGUF Q4_0, Q4_1; --weights int4)
 *   Q8 (scale)          w = d * q,      q in -128..127  (GGUF Q8_0; the int4 format's LM head)
 *
 * Activations, per row and 32-block, in two int8 planes by default: sx1 = amax / 127 and
 * xq1 = round_half_even(x / sx1); then the same for what xq1 left over, r = x - sx1 * xq1
 * (sx2, xq2). Two carry ~15 bits of x and match fp32's perplexity, for twice the integer dots.
 * A caller may ask for one plane (llama.cpp's Q8_0 activations: EngineConfig.act_planes = 1),
 * which cost SmolLM2 ~1% perplexity and most of its greedy agreement with fp32 but halves the
 * dots, the bulk of a prompt's time. The min term uses the block's exact float sum of x (xsum):
 *
 *   Q4: sum_i w_i x_i ~ d * (sx1 * idot(q, xq1) + sx2 * idot(q, xq2)) + m * xsum
 *   Q8: the same without m, each idot(q + 128, xq) - 128 * sum(xq)
 *
 * Layout, built once at load by engine/quant/native.py: output rows in tiles of 16 (the last
 * padded with zero rows), each tile its 32-blocks in order, each block-tile contiguous:
 *
 *   Q4 block-tile, 320 bytes:
 *     [p = 0..3] 64 bytes: byte 4 j + t = code(row j, k 4p + t) | code(row j, k 4(p + 4) + t) << 4
 *     32 bytes: d of rows 0..15 (fp16)      32 bytes: m of rows 0..15 (fp16)
 *   Q8 block-tile, 544 bytes:
 *     [g = 0..7] 64 bytes: byte 4 j + t = q(row j, k 4g + t) + 128
 *     32 bytes: d of rows 0..15 (fp16)
 *
 * so one 64-byte vector holds 4 consecutive k of each of 16 rows: a VNNI dot (vpdpbusd) with
 * 4 bytes of xq broadcast adds into one int32 lane per output row, and 8 of them finish a block
 * with no horizontal sums (AVX2 takes each vector as two halves of 8 rows). Per output row the
 * float work is the same sequence on every path:
 *
 *   acc = fma((float)idot1, d * sx1, acc); acc = fma((float)idot2, d * sx2, acc);
 *   then, Q4 only, acc = fma(m, xsum, acc)
 *
 * block after block, so the AVX-512, AVX2 and scalar paths give the same bits, and each output
 * is written by one thread (OpenMP over tiles): the result does not depend on the thread count.
 * OpenMP is torch's libgomp (engine/quant/native.py imports torch first), so
 * torch.set_num_threads governs both. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_api.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#define GROUP 32
#define TILE_ROWS 16
#define Q4_TILE_BYTES 320
#define Q8_TILE_BYTES 544
#define ROW_CHUNK 8 /* activation rows per pass over a tile: 8 accumulators stay in registers */
/* Weight bytes ahead that a multi-row pass prefetches: with two or more rows a tile's dots take
 * about as long as streaming it from DRAM, and the hardware prefetcher alone does not overlap the
 * two (SmolLM2's layers at 5 rows, 2 threads: 8.6-9.0 ms of Q4 matmuls per step without, 6.8-7.4
 * with; the LM head 2.6-2.9 -> 1.5-1.7 ms). One row is bound by the stream and gains nothing. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
#define PARALLEL_MIN_MACS (1 << 17) /* rows x weights below which a parallel region costs more than it saves */

/* In order of preference: a CPU that runs one runs every one before it. */
enum isa { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512VNNI = 2, NUM_ISAS = 3 };
static const char *ISA_NAMES[] = {"scalar", "avx2", "avx512vnni"};
static enum isa best_isa = ISA_SCALAR;
static enum isa used_isa = ISA_SCALAR;

#define MAX_PLANES 2 /* x ~ sx1 * xq1 + sx2 * xq2: the second plane quantizes what the first rounded off */

/* Activations of all M rows, quantized once per call. */
typedef struct {
    const int8_t *q[MAX_PLANES];       /* [M, K] each */
    const float *scale[MAX_PLANES];    /* [M, K / 32] each: sx */
    const int32_t *offset[MAX_PLANES]; /* [M, K / 32] each: 128 * sum(xq), the Q8 unsigned-code correction */
    int planes;                        /* 1 or 2 */
    const float *sum;              /* [M, K / 32]: xsum */
    int64_t k;
    int64_t num_blocks;
} acts_t;

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1F;
    uint32_t mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000 | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: value = mantissa * 2^-24, exact in float */
        float value = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -value : value;
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* One plane of one block: codes of v at amax / 127, rounded half to even (as torch.round, so
 * the Python reference quantizes the same way); v becomes what the codes left over, exactly
 * rounded (fmaf). */
static void quantize_block(float *v, int8_t *out, float *scale, int32_t *offset) {
    float amax = 0.0f;
    for (int i = 0; i < GROUP; i++) {
        amax = fmaxf(amax, fabsf(v[i]));
    }
    float d = amax / 127.0f;
    float inverse = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t code_sum = 0;
    for (int i = 0; i < GROUP; i++) {
        float rounded = nearbyintf(v[i] * inverse);
        int32_t code = (int32_t)fmaxf(-127.0f, fminf(127.0f, rounded));
        out[i] = (int8_t)code;
        code_sum += code;
        v[i] = fmaf(-d, (float)code, v[i]);
    }
    *scale = d;
    *offset = 128 * code_sum;
}

/* The block's sum as a tree, v[i] + v[i + 16], then + [i + 8], [i + 4], [i + 2], [i + 1]: the
 * order the AVX-512 path adds in, so both give the same bits. */
static float block_sum(const float *v) {
    float partial[GROUP];
    memcpy(partial, v, sizeof partial);
    for (int width = GROUP / 2; width >= 1; width /= 2) {
        for (int i = 0; i < width; i++) {
            partial[i] += partial[i + width];
        }
    }
    return partial[0];
}

static void quantize_acts_scalar(const float *x, int64_t m, int64_t k, int planes, int8_t **q, float **scale, float *sum, int32_t **offset) {
    int64_t num_blocks = k / GROUP;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < num_blocks; b++) {
            float rest[GROUP];
            int64_t at = r * num_blocks + b;
            memcpy(rest, x + r * k + b * GROUP, sizeof rest);
            sum[at] = block_sum(rest);
            for (int p = 0; p < planes; p++) {
                quantize_block(rest, q[p] + r * k + b * GROUP, scale[p] + at, offset[p] + at);
            }
        }
    }
}

/* ---- scalar path: the same integer dots and float sequence, one output at a time ---- */

static int q4_code(const uint8_t *block, int row, int k) {
    int g = k / 4, t = k % 4;
    uint8_t byte = block[64 * (g & 3) + 4 * row + t];
    return g < 4 ? byte & 0x0F : byte >> 4;
}

static void q4_tile_scalar(const uint8_t *tile, const acts_t *a, int64_t r0, int mt, float *y, int64_t ldy, int rows) {
    for (int r = 0; r < mt; r++) {
        for (int j = 0; j < rows; j++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < a->num_blocks; b++) {
                const uint8_t *block = tile + b * Q4_TILE_BYTES;
                float d = half_to_float(load_u16(block + 256 + 2 * j));
                float mn = half_to_float(load_u16(block + 288 + 2 * j));
                int64_t at = (r0 + r) * a->num_blocks + b;
                for (int p = 0; p < a->planes; p++) {
                    const int8_t *xq = a->q[p] + (r0 + r) * a->k + b * GROUP;
                    int32_t idot = 0;
                    for (int i = 0; i < GROUP; i++) {
                        idot += q4_code(block, j, i) * xq[i];
                    }
                    acc = fmaf((float)idot, d * a->scale[p][at], acc);
                }
                acc = fmaf(mn, a->sum[at], acc);
            }
            y[r * ldy + j] = acc;
        }
    }
}

static void q8_tile_scalar(const uint8_t *tile, const acts_t *a, int64_t r0, int mt, float *y, int64_t ldy, int rows) {
    for (int r = 0; r < mt; r++) {
        for (int j = 0; j < rows; j++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < a->num_blocks; b++) {
                const uint8_t *block = tile + b * Q8_TILE_BYTES;
                float d = half_to_float(load_u16(block + 512 + 2 * j));
                int64_t at = (r0 + r) * a->num_blocks + b;
                for (int p = 0; p < a->planes; p++) {
                    const int8_t *xq = a->q[p] + (r0 + r) * a->k + b * GROUP;
                    int32_t idot = -a->offset[p][at];
                    for (int i = 0; i < GROUP; i++) {
                        idot += block[64 * (i / 4) + 4 * j + i % 4] * xq[i];
                    }
                    acc = fmaf((float)idot, d * a->scale[p][at], acc);
                }
            }
            y[r * ldy + j] = acc;
        }
    }
}

/* ---- AVX-512 VNNI path ---- */

#if HAVE_X86
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

AVX512_TARGET static inline __attribute__((always_inline)) void store_rows(float *y, __m512 acc, int rows) {
    if (rows == TILE_ROWS) {
        _mm512_storeu_ps(y, acc);
    } else {
        _mm512_mask_storeu_ps(y, (__mmask16)((1u << rows) - 1), acc);
    }
}

AVX512_TARGET static inline __attribute__((always_inline)) void q4_tile_avx512_body(
    const uint8_t *tile, const acts_t *a, int64_t r0, const int mt, const int planes, float *y, int64_t ldy, int rows) {
    __m512 acc[ROW_CHUNK];
    for (int r = 0; r < mt; r++) {
        acc[r] = _mm512_setzero_ps();
    }
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < a->num_blocks; b++) {
        const uint8_t *block = tile + b * Q4_TILE_BYTES;
        for (int line = 0; mt > 1 && line < Q4_TILE_BYTES; line += 64) {
            _mm_prefetch((const char *)(block + PREFETCH_BYTES + line), _MM_HINT_T0);
        }
        __m512i w[8];
        for (int p = 0; p < 4; p++) {
            __m512i raw = _mm512_loadu_si512((const void *)(block + 64 * p));
            w[p] = _mm512_and_si512(raw, nibble);
            w[p + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 256)));
        __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 288)));
        for (int r = 0; r < mt; r++) {
            int64_t at = (r0 + r) * a->num_blocks + b;
            for (int p = 0; p < planes; p++) {
                const int8_t *xq = a->q[p] + (r0 + r) * a->k + b * GROUP;
                __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512(); /* two chains of 4 */
                for (int g = 0; g < 8; g += 2) {
                    even = _mm512_dpbusd_epi32(even, w[g], _mm512_set1_epi32(load_i32(xq + 4 * g)));
                    odd = _mm512_dpbusd_epi32(odd, w[g + 1], _mm512_set1_epi32(load_i32(xq + 4 * g + 4)));
                }
                __m512i idot = _mm512_add_epi32(even, odd);
                __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(a->scale[p][at]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot), ds, acc[r]);
            }
            acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->sum[at]), acc[r]);
        }
    }
    for (int r = 0; r < mt; r++) {
        store_rows(y + r * ldy, acc[r], rows);
    }
}

AVX512_TARGET static inline __attribute__((always_inline)) void q8_tile_avx512_body(
    const uint8_t *tile, const acts_t *a, int64_t r0, const int mt, const int planes, float *y, int64_t ldy, int rows) {
    __m512 acc[ROW_CHUNK];
    for (int r = 0; r < mt; r++) {
        acc[r] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < a->num_blocks; b++) {
        const uint8_t *block = tile + b * Q8_TILE_BYTES;
        for (int line = 0; mt > 1 && line < Q8_TILE_BYTES; line += 64) {
            _mm_prefetch((const char *)(block + PREFETCH_BYTES + line), _MM_HINT_T0);
        }
        __m512i w[8];
        for (int g = 0; g < 8; g++) {
            w[g] = _mm512_loadu_si512((const void *)(block + 64 * g));
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 512)));
        for (int r = 0; r < mt; r++) {
            int64_t at = (r0 + r) * a->num_blocks + b;
            for (int p = 0; p < planes; p++) {
                const int8_t *xq = a->q[p] + (r0 + r) * a->k + b * GROUP;
                __m512i even = _mm512_set1_epi32(-a->offset[p][at]), odd = _mm512_setzero_si512();
                for (int g = 0; g < 8; g += 2) {
                    even = _mm512_dpbusd_epi32(even, w[g], _mm512_set1_epi32(load_i32(xq + 4 * g)));
                    odd = _mm512_dpbusd_epi32(odd, w[g + 1], _mm512_set1_epi32(load_i32(xq + 4 * g + 4)));
                }
                __m512i idot = _mm512_add_epi32(even, odd);
                __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(a->scale[p][at]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot), ds, acc[r]);
            }
        }
    }
    for (int r = 0; r < mt; r++) {
        store_rows(y + r * ldy, acc[r], rows);
    }
}

/* quantize_acts_scalar with vectors: a block is two 16-float halves. */
AVX512_TARGET static void quantize_acts_avx512(const float *x, int64_t m, int64_t k, int planes, int8_t **q, float **scale, float *sum, int32_t **offset) {
    int64_t num_blocks = k / GROUP;
    const __m512 limit = _mm512_set1_ps(127.0f);
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < num_blocks; b++) {
            int64_t at = r * num_blocks + b;
            const float *v = x + r * k + b * GROUP;
            __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
            __m512 t16 = _mm512_add_ps(lo, hi);
            __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(t16), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t16), 1)));
            __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
            __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
            __m128 t1 = _mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1));
            sum[at] = _mm_cvtss_f32(t1);
            for (int p = 0; p < planes; p++) {
                float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
                float d = amax / 127.0f;
                __m512 inverse = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f), dv = _mm512_set1_ps(d);
                __m512 code_lo = _mm512_roundscale_ps(_mm512_mul_ps(lo, inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                __m512 code_hi = _mm512_roundscale_ps(_mm512_mul_ps(hi, inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                code_lo = _mm512_max_ps(_mm512_min_ps(code_lo, limit), _mm512_sub_ps(_mm512_setzero_ps(), limit));
                code_hi = _mm512_max_ps(_mm512_min_ps(code_hi, limit), _mm512_sub_ps(_mm512_setzero_ps(), limit));
                __m512i int_lo = _mm512_cvtps_epi32(code_lo), int_hi = _mm512_cvtps_epi32(code_hi);
                int8_t *out = q[p] + r * k + b * GROUP;
                _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(int_lo));
                _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtepi32_epi8(int_hi));
                scale[p][at] = d;
                offset[p][at] = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(int_lo, int_hi));
                lo = _mm512_fnmadd_ps(dv, code_lo, lo);
                hi = _mm512_fnmadd_ps(dv, code_hi, hi);
            }
        }
    }
}

/* ---- AVX2 path: two 32-byte halves of each 64-byte vector, rows 0..7 and 8..15 ----
 *
 * No dpbusd: maddubs (u8 x s8, pairs summed into int16 with saturation) then madd with ones.
 * Q4: a pair is at most 2 * 15 * 127 = 3810, so the 8 maddubs of a block add up in int16
 * (30480) before one madd. Q8: the unsigned code q + 128 times 127 would saturate, so the dot
 * takes |q| as the unsigned side and x with q's sign as the signed one: |q| <= 128 and
 * |x| <= 127 (quantize_block clamps), a pair at most 32512, exact for every code -128..127;
 * the sign lands on x, never negating a -128. That is sum(q x) itself, no offset correction. */

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET static inline __attribute__((always_inline)) __m256i broadcast4(const int8_t *xq) {
    return _mm256_set1_epi32(load_i32(xq));
}

AVX2_TARGET static inline __attribute__((always_inline)) void store_rows_avx2(float *y, __m256 lo, __m256 hi, int rows) {
    if (rows == TILE_ROWS) {
        _mm256_storeu_ps(y, lo);
        _mm256_storeu_ps(y + 8, hi);
    } else {
        float row[TILE_ROWS];
        _mm256_storeu_ps(row, lo);
        _mm256_storeu_ps(row + 8, hi);
        memcpy(y, row, sizeof(float) * (size_t)rows);
    }
}

AVX2_TARGET static inline __attribute__((always_inline)) void q4_tile_avx2_body(
    const uint8_t *tile, const acts_t *a, int64_t r0, const int mt, const int planes, float *y, int64_t ldy, int rows) {
    __m256 acc[ROW_CHUNK][2];
    for (int r = 0; r < mt; r++) {
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < a->num_blocks; b++) {
        const uint8_t *block = tile + b * Q4_TILE_BYTES;
        for (int line = 0; mt > 1 && line < Q4_TILE_BYTES; line += 64) {
            _mm_prefetch((const char *)(block + PREFETCH_BYTES + line), _MM_HINT_T0);
        }
        for (int h = 0; h < 2; h++) {
            __m256i w[8];
            for (int p = 0; p < 4; p++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(block + 64 * p + 32 * h));
                w[p] = _mm256_and_si256(raw, nibble);
                w[p + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
            }
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 256 + 16 * h)));
            __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 288 + 16 * h)));
            for (int r = 0; r < mt; r++) {
                int64_t at = (r0 + r) * a->num_blocks + b;
                for (int p = 0; p < planes; p++) {
                    const int8_t *xq = a->q[p] + (r0 + r) * a->k + b * GROUP;
                    __m256i even = _mm256_maddubs_epi16(w[0], broadcast4(xq));
                    __m256i odd = _mm256_maddubs_epi16(w[1], broadcast4(xq + 4));
                    for (int g = 2; g < 8; g += 2) {
                        even = _mm256_add_epi16(even, _mm256_maddubs_epi16(w[g], broadcast4(xq + 4 * g)));
                        odd = _mm256_add_epi16(odd, _mm256_maddubs_epi16(w[g + 1], broadcast4(xq + 4 * g + 4)));
                    }
                    __m256i idot = _mm256_madd_epi16(_mm256_add_epi16(even, odd), ones);
                    __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(a->scale[p][at]));
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot), ds, acc[r][h]);
                }
                acc[r][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a->sum[at]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < mt; r++) {
        store_rows_avx2(y + r * ldy, acc[r][0], acc[r][1], rows);
    }
}

AVX2_TARGET static inline __attribute__((always_inline)) void q8_tile_avx2_body(
    const uint8_t *tile, const acts_t *a, int64_t r0, const int mt, const int planes, float *y, int64_t ldy, int rows) {
    __m256 acc[ROW_CHUNK][2];
    for (int r = 0; r < mt; r++) {
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
    const __m256i bias = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < a->num_blocks; b++) {
        const uint8_t *block = tile + b * Q8_TILE_BYTES;
        for (int line = 0; mt > 1 && line < Q8_TILE_BYTES; line += 64) {
            _mm_prefetch((const char *)(block + PREFETCH_BYTES + line), _MM_HINT_T0);
        }
        for (int h = 0; h < 2; h++) {
            __m256i magnitude[8], sign[8];
            for (int g = 0; g < 8; g++) {
                sign[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(block + 64 * g + 32 * h)), bias);
                magnitude[g] = _mm256_abs_epi8(sign[g]); /* -128 -> 0x80, read as unsigned 128 */
            }
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 512 + 16 * h)));
            for (int r = 0; r < mt; r++) {
                int64_t at = (r0 + r) * a->num_blocks + b;
                for (int p = 0; p < planes; p++) {
                    const int8_t *xq = a->q[p] + (r0 + r) * a->k + b * GROUP;
                    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
                    for (int g = 0; g < 8; g += 2) {
                        __m256i pe = _mm256_maddubs_epi16(magnitude[g], _mm256_sign_epi8(broadcast4(xq + 4 * g), sign[g]));
                        __m256i po = _mm256_maddubs_epi16(magnitude[g + 1], _mm256_sign_epi8(broadcast4(xq + 4 * g + 4), sign[g + 1]));
                        even = _mm256_add_epi32(even, _mm256_madd_epi16(pe, ones));
                        odd = _mm256_add_epi32(odd, _mm256_madd_epi16(po, ones));
                    }
                    __m256i idot = _mm256_add_epi32(even, odd);
                    __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(a->scale[p][at]));
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot), ds, acc[r][h]);
                }
            }
        }
    }
    for (int r = 0; r < mt; r++) {
        store_rows_avx2(y + r * ldy, acc[r][0], acc[r][1], rows);
    }
}

/* quantize_acts_scalar with vectors: a block is four 8-float quarters. */
AVX2_TARGET static void quantize_acts_avx2(const float *x, int64_t m, int64_t k, int planes, int8_t **q, float **scale, float *sum, int32_t **offset) {
    int64_t num_blocks = k / GROUP;
    const __m256 limit = _mm256_set1_ps(127.0f), negative_limit = _mm256_set1_ps(-127.0f);
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    const __m256i byte_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* packs interleave the 128-bit lanes */
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < num_blocks; b++) {
            int64_t at = r * num_blocks + b;
            const float *v = x + r * k + b * GROUP;
            __m256 part[4];
            for (int i = 0; i < 4; i++) {
                part[i] = _mm256_loadu_ps(v + 8 * i);
            }
            __m256 t8 = _mm256_add_ps(_mm256_add_ps(part[0], part[2]), _mm256_add_ps(part[1], part[3]));
            __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
            __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
            __m128 t1 = _mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1));
            sum[at] = _mm_cvtss_f32(t1);
            for (int p = 0; p < planes; p++) {
                __m256 most = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign_bit, part[0]), _mm256_andnot_ps(sign_bit, part[1])),
                                            _mm256_max_ps(_mm256_andnot_ps(sign_bit, part[2]), _mm256_andnot_ps(sign_bit, part[3])));
                __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
                __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
                float amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
                float d = amax / 127.0f;
                __m256 inverse = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f), dv = _mm256_set1_ps(d);
                __m256i codes[4];
                for (int i = 0; i < 4; i++) {
                    __m256 code = _mm256_round_ps(_mm256_mul_ps(part[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    code = _mm256_max_ps(_mm256_min_ps(code, limit), negative_limit);
                    codes[i] = _mm256_cvtps_epi32(code);
                    part[i] = _mm256_fnmadd_ps(dv, code, part[i]);
                }
                __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]), _mm256_packs_epi32(codes[2], codes[3]));
                _mm256_storeu_si256((__m256i *)(q[p] + r * k + b * GROUP), _mm256_permutevar8x32_epi32(bytes, byte_order));
                __m256i total8 = _mm256_add_epi32(_mm256_add_epi32(codes[0], codes[1]), _mm256_add_epi32(codes[2], codes[3]));
                __m128i total4 = _mm_add_epi32(_mm256_castsi256_si128(total8), _mm256_extracti128_si256(total8, 1));
                __m128i total2 = _mm_add_epi32(total4, _mm_unpackhi_epi64(total4, total4));
                scale[p][at] = d;
                offset[p][at] = 128 * (_mm_cvtsi128_si32(total2) + _mm_extract_epi32(total2, 1));
            }
        }
    }
}

/* One copy of each body per chunk height, so the accumulators are a fixed set of registers. */
#define CHUNK_CASES(body, planes) \
    switch (mt) {                                                    \
    case 1: body(tile, a, r0, 1, planes, y, ldy, rows); break;       \
    case 2: body(tile, a, r0, 2, planes, y, ldy, rows); break;       \
    case 3: body(tile, a, r0, 3, planes, y, ldy, rows); break;       \
    case 4: body(tile, a, r0, 4, planes, y, ldy, rows); break;       \
    case 5: body(tile, a, r0, 5, planes, y, ldy, rows); break;       \
    case 6: body(tile, a, r0, 6, planes, y, ldy, rows); break;       \
    case 7: body(tile, a, r0, 7, planes, y, ldy, rows); break;       \
    default: body(tile, a, r0, ROW_CHUNK, planes, y, ldy, rows); break; \
    }
/* ... and per plane count, so the plane loop unrolls. */
#define PLANE_CASES(body)                                            \
    if (a->planes == 1) {                                            \
        CHUNK_CASES(body, 1)                                         \
    } else {                                                         \
        CHUNK_CASES(body, 2)                                         \
    }

AVX512_TARGET static void q4_tile_avx512(const uint8_t *tile, const acts_t *a, int64_t r0, int mt, float *y, int64_t ldy, int rows) {
    PLANE_CASES(q4_tile_avx512_body)
}

AVX512_TARGET static void q8_tile_avx512(const uint8_t *tile, const acts_t *a, int64_t r0, int mt, float *y, int64_t ldy, int rows) {
    PLANE_CASES(q8_tile_avx512_body)
}

AVX2_TARGET static void q4_tile_avx2(const uint8_t *tile, const acts_t *a, int64_t r0, int mt, float *y, int64_t ldy, int rows) {
    PLANE_CASES(q4_tile_avx2_body)
}

AVX2_TARGET static void q8_tile_avx2(const uint8_t *tile, const acts_t *a, int64_t r0, int mt, float *y, int64_t ldy, int rows) {
    PLANE_CASES(q8_tile_avx2_body)
}
#endif

/* ---- the call: validate, quantize x, run the tiles ---- */

typedef void (*tile_fn)(const uint8_t *, const acts_t *, int64_t, int, float *, int64_t, int);

typedef struct {
    const char *name;
    int64_t tile_bytes;
    tile_fn by_isa[NUM_ISAS];
} format_t;

#if HAVE_X86
static const format_t Q4 = {"q4", Q4_TILE_BYTES, {q4_tile_scalar, q4_tile_avx2, q4_tile_avx512}};
static const format_t Q8 = {"q8", Q8_TILE_BYTES, {q8_tile_scalar, q8_tile_avx2, q8_tile_avx512}};
#else
static const format_t Q4 = {"q4", Q4_TILE_BYTES, {q4_tile_scalar}};
static const format_t Q8 = {"q8", Q8_TILE_BYTES, {q8_tile_scalar}};
#endif

static int check_float_matrix(const Py_buffer *view, const char *name) {
    if (view->ndim != 2) {
        PyErr_Format(PyExc_ValueError, "%s: must be 2-D [rows, features], got %d dimensions", name, view->ndim);
        return -1;
    }
    const char *format = view->format ? view->format : "B";
    if (view->itemsize != 4 || format[strlen(format) - 1] != 'f') {
        PyErr_Format(PyExc_ValueError, "%s: must be float32, got buffer format '%s'", name, format);
        return -1;
    }
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s: must be C-contiguous", name);
        return -1;
    }
    return 0;
}

static void run_tiles(const format_t *fmt, tile_fn fn, const uint8_t *weights, const acts_t *a, int64_t m, int64_t n, float *y) {
    int64_t num_tiles = (n + TILE_ROWS - 1) / TILE_ROWS;
    int64_t tile_stride = a->num_blocks * fmt->tile_bytes;
    int parallel = m * n * a->k >= PARALLEL_MIN_MACS;
    (void)parallel;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t t = 0; t < num_tiles; t++) {
        int rows = (int)(n - t * TILE_ROWS < TILE_ROWS ? n - t * TILE_ROWS : TILE_ROWS);
        for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
            int mt = (int)(m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK);
            fn(weights + t * tile_stride, a, r0, mt, y + r0 * n + t * TILE_ROWS, n, rows);
        }
    }
}

static int64_t fmt_packed_bytes(const format_t *fmt, int64_t n, int64_t k) {
    return (n + TILE_ROWS - 1) / TILE_ROWS * (k / GROUP) * fmt->tile_bytes;
}

/* y = x W^T once the arguments are checked; no GIL. -1: no memory for the activation planes. */
static int compute(const format_t *fmt, const float *x, int64_t m, int64_t k, const uint8_t *packed, int64_t n, float *y, int planes) {
    if (m == 0) {
        return 0;
    }
    int64_t num_blocks = k / GROUP;
    int64_t num_values = m * num_blocks;
    void *scratch = malloc((size_t)(num_values * 4 * (1 + 2 * planes) + planes * m * k));
    if (scratch == NULL) {
        return -1;
    }
    acts_t a = {.sum = (float *)scratch, .k = k, .num_blocks = num_blocks, .planes = planes};
    float *scale[MAX_PLANES];
    int32_t *offset[MAX_PLANES];
    int8_t *q[MAX_PLANES];
    for (int p = 0; p < planes; p++) {
        a.scale[p] = scale[p] = (float *)scratch + num_values * (1 + p);
        a.offset[p] = offset[p] = (int32_t *)scratch + num_values * (1 + planes + p);
        a.q[p] = q[p] = (int8_t *)scratch + num_values * 4 * (1 + 2 * planes) + p * m * k;
    }
    tile_fn fn = fmt->by_isa[used_isa];
#if HAVE_X86
    if (used_isa == ISA_AVX512VNNI) {
        quantize_acts_avx512(x, m, k, planes, q, scale, (float *)a.sum, offset);
    } else if (used_isa == ISA_AVX2) {
        quantize_acts_avx2(x, m, k, planes, q, scale, (float *)a.sum, offset);
    } else
#endif
    {
        quantize_acts_scalar(x, m, k, planes, q, scale, (float *)a.sum, offset);
    }
    run_tiles(fmt, fn, packed, &a, m, n, y);
    free(scratch);
    return 0;
}

static PyObject *matmul_impl(PyObject *args, const format_t *fmt) {
    PyObject *x_obj, *packed_obj, *out_obj;
    int planes = MAX_PLANES;
    if (!PyArg_ParseTuple(args, "OOO|i", &x_obj, &packed_obj, &out_obj, &planes)) {
        return NULL;
    }
    if (planes < 1 || planes > MAX_PLANES) {
        PyErr_Format(PyExc_ValueError, "planes: %d activation planes; the kernel runs 1 or %d", planes, MAX_PLANES);
        return NULL;
    }
    Py_buffer x = {0}, packed = {0}, out = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(x_obj, &x, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "x: must be a C-contiguous float32 buffer (a numpy array)");
        return NULL;
    }
    if (PyObject_GetBuffer(packed_obj, &packed, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "packed: must be a C-contiguous byte buffer");
        goto done;
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_RECORDS) < 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "out: must be a writable C-contiguous float32 buffer");
        goto done;
    }
    if (check_float_matrix(&x, "x") < 0 || check_float_matrix(&out, "out") < 0) {
        goto done;
    }
    int64_t m = x.shape[0], k = x.shape[1], n = out.shape[1];
    if (k <= 0 || k % GROUP != 0) {
        PyErr_Format(PyExc_ValueError, "x: %lld input features are not a positive whole number of %d-blocks", (long long)k, GROUP);
        goto done;
    }
    if (out.shape[0] != m) {
        PyErr_Format(PyExc_ValueError, "out: %lld rows for %lld rows of x", (long long)out.shape[0], (long long)m);
        goto done;
    }
    int64_t expected = fmt_packed_bytes(fmt, n, k);
    if (n <= 0 || packed.len != expected) {
        PyErr_Format(PyExc_ValueError, "packed: %zd bytes, but %lld x %lld %s weights take %lld", packed.len, (long long)n, (long long)k,
                     fmt->name, (long long)expected);
        goto done;
    }
    if (m == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = compute(fmt, (const float *)x.buf, m, k, (const uint8_t *)packed.buf, n, (float *)out.buf, planes);
    Py_END_ALLOW_THREADS
    if (status < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    if (x.obj) PyBuffer_Release(&x);
    if (packed.obj) PyBuffer_Release(&packed);
    if (out.obj) PyBuffer_Release(&out);
    return result;
}

static PyObject *q4_matmul(PyObject *module, PyObject *args) {
    return matmul_impl(args, &Q4);
}

static PyObject *q8_matmul(PyObject *module, PyObject *args) {
    return matmul_impl(args, &Q8);
}

/* The C API (native_api.h) */

static int api_matmul(int format, const float *x, int64_t m, int64_t k, const uint8_t *packed, int64_t n, float *y, int planes) {
    return compute(format == QMATMUL_Q8 ? &Q8 : &Q4, x, m, k, packed, n, y, planes);
}

static int64_t api_packed_bytes(int format, int64_t n, int64_t k) {
    return fmt_packed_bytes(format == QMATMUL_Q8 ? &Q8 : &Q4, n, k);
}

static QMatmulApi c_api = {NATIVE_API_VERSION, api_matmul, api_packed_bytes};

static PyObject *isa(PyObject *module, PyObject *unused) {
    return PyUnicode_FromString(ISA_NAMES[used_isa]);
}

static PyObject *isas(PyObject *module, PyObject *unused) {
    PyObject *names = PyList_New(0);
    for (int i = 0; names != NULL && i <= (int)best_isa; i++) {
        PyObject *name = PyUnicode_FromString(ISA_NAMES[i]);
        if (name == NULL || PyList_Append(names, name) < 0) {
            Py_XDECREF(name);
            Py_CLEAR(names);
            break;
        }
        Py_DECREF(name);
    }
    return names;
}

/* Whether the CPU multiplies bf16 itself (AVX512-BF16 or AMX): where it does not, torch's bf16
 * GEMM widens every operand first and a dense bf16 copy of a weight is slower at any row count
 * than this kernel (kernels.py keeps no such copy then). */
static PyObject *cpu_has_bf16(PyObject *module, PyObject *unused) {
#if HAVE_X86  /* the module's init ran __builtin_cpu_init */
    return PyBool_FromLong(__builtin_cpu_supports("avx512bf16") || __builtin_cpu_supports("amx-bf16"));
#else
    Py_RETURN_FALSE;
#endif
}

/* Tests run the slower paths on a machine with a faster one through this; the engine never calls it. */
static PyObject *use_isa(PyObject *module, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s:use_isa", &name)) {
        return NULL;
    }
    for (int i = 0; i <= (int)best_isa; i++) {
        if (strcmp(name, ISA_NAMES[i]) == 0) {
            enum isa previous = used_isa;
            used_isa = (enum isa)i;
            return PyUnicode_FromString(ISA_NAMES[previous]);
        }
    }
    PyErr_Format(PyExc_ValueError, "isa: %s is not available on this CPU (best: %s)", name, ISA_NAMES[best_isa]);
    return NULL;
}

static PyMethodDef methods[] = {
    {"q4_matmul", q4_matmul, METH_VARARGS,
     "q4_matmul(x, packed, out) -> None\n\n"
     "out[M, N] = x[M, K] W^T for a Q4 weight (w = d * q + m) in the 320-byte block-tile layout;\n"
     "x and out float32 C-contiguous (numpy arrays), K a multiple of 32."},
    {"q8_matmul", q8_matmul, METH_VARARGS,
     "q8_matmul(x, packed, out) -> None\n\n"
     "out[M, N] = x[M, K] W^T for a Q8 weight (w = d * q) in the 544-byte block-tile layout."},
    {"isa", isa, METH_NOARGS, "isa() -> str: the instruction set the kernels run ('avx512vnni', 'avx2' or 'scalar')."},
    {"isas", isas, METH_NOARGS, "isas() -> list[str]: the instruction sets this CPU can run, slowest first."},
    {"cpu_has_bf16", cpu_has_bf16, METH_NOARGS, "cpu_has_bf16() -> bool: whether the CPU has AVX512-BF16 or AMX-BF16."},
    {"use_isa", use_isa, METH_VARARGS, "use_isa(name) -> str: run on ``name`` (for tests); returns the previous one."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef qmatmul_module = {
    PyModuleDef_HEAD_INIT, "engine.quant._qmatmul",
    "Group-32 quantized matmuls with int8 dot products (engine/quant/kernels.py wraps them).", -1, methods,
};

PyMODINIT_FUNC PyInit__qmatmul(void) {
#if HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        best_isa = ISA_AVX2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
            __builtin_cpu_supports("avx512vnni")) {
            best_isa = ISA_AVX512VNNI;
        }
    }
#endif
    used_isa = best_isa;
    return module_with_c_api(&qmatmul_module, &c_api, QMATMUL_API_NAME);
}
