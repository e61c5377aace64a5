/* RMSNorm of float32 rows, shared by _cpu_norm.c and _cpu_decoder.c so both give the same bits:
 *
 *     out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * weight
 *
 * The sum of squares is taken in double (its order then does not matter to a float result). */

#ifndef SPLITSERVE_RMS_NORM_H
#define SPLITSERVE_RMS_NORM_H

#include <math.h>
#include <stdint.h>

static inline void rms_norm_rows(const float *x, const float *weight, int64_t rows, int64_t dim, double eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * dim;
        double sum = 0.0;
        for (int64_t i = 0; i < dim; i++) {
            sum += (double)row[i] * (double)row[i];
        }
        float inv = (float)(1.0 / sqrt(sum / (double)dim + eps));
        float *o = out + r * dim;
        for (int64_t i = 0; i < dim; i++) {
            o[i] = row[i] * inv * weight[i];
        }
    }
}

#endif
