/* bnfuse.runtime._cpukernels, the serial kernels: one op on one thread, the loops of the tasks in the same order
 * (so a small input gets the bits the parallel path gives), as tasks of count 1 for cpu.py and as functions the
 * native ops (bn_ops.c) call. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpukernels.h"

atomic_int scratch_failed;

static double *scratch(size_t count) {
    double *memory = malloc((count ? count : 1) * sizeof(double));
    if (memory == NULL) {
        atomic_store(&scratch_failed, 1);
    }
    return memory;
}


/* -- serial kernels: the loops of the tasks in the same order on one thread --------------------------- */

/* Per-channel mean and biased variance as the parallel path computes them for this layout. */
static int serial_mean_var(const float *x, dims d, double *mean, double *var) {
    const int64_t count = d.outer * d.inner;
    if (d.inner >= MIN_INNER) {
        const int64_t stride = d.channels * d.inner;
        for (int64_t c = 0; c < d.channels; ++c) {
            const float *start = x + c * d.inner;
            mean[c] = channel_sum(start, d.outer, stride, d.inner) / (double)count;
            var[c] = channel_sqdev(start, d.outer, stride, d.inner, mean[c]) / (double)count;
        }
        return 0;
    }
    const int64_t width = d.channels * d.inner, chunks = row_chunks(d.outer, width);
    const int64_t per_chunk = (d.outer + chunks - 1) / chunks;
    double *work = scratch(4 * (size_t)width);
    if (work == NULL) {
        return -1;
    }
    double *col = work, *center = work + width, *part = work + 2 * width;
    for (int squared = 0; squared < 2; ++squared) {
        if (!squared) {
            memset(center, 0, (size_t)width * sizeof(double));
        }
        memset(col, 0, (size_t)width * sizeof(double));
        for (int64_t k = 0; k < chunks; ++k) {
            int64_t r0 = k * per_chunk, r1 = r0 + per_chunk < d.outer ? r0 + per_chunk : d.outer;
            rows_sums(x, width, r0, r1, center, squared, part);
            for (int64_t f = 0; f < width; ++f) {
                col[f] += part[f];
            }
        }
        for (int64_t c = 0; c < d.channels; ++c) {
            double value = pairwise_sum(col + c * d.inner, d.inner) / (double)count;
            if (squared) {
                var[c] = value;
            } else {
                mean[c] = value;
                for (int64_t i = 0; i < d.inner; ++i) {
                    center[c * d.inner + i] = value;
                }
            }
        }
    }
    free(work);
    return 0;
}

static int serial_grad_sums(const float *dy, const float *x, const float *y, int relu, dims d, const double *center,
                            double *sum_dy, double *sum_dy_xc) {
    if (d.inner >= MIN_INNER) {
        const int64_t stride = d.channels * d.inner;
        for (int64_t c = 0; c < d.channels; ++c) {
            int64_t start = c * d.inner;
            channel_grad_sums(dy + start, x + start, y + start, relu, d.outer, stride, d.inner, center[c], sum_dy + c,
                              sum_dy_xc + c);
        }
        return 0;
    }
    const int64_t width = d.channels * d.inner, chunks = row_chunks(d.outer, width);
    const int64_t per_chunk = (d.outer + chunks - 1) / chunks;
    double *work = scratch(5 * (size_t)width);
    if (work == NULL) {
        return -1;
    }
    double *wide_center = work, *part_dy = work + width, *part_xc = work + 2 * width;
    double *col_dy = work + 3 * width, *col_xc = work + 4 * width;
    for (int64_t f = 0; f < width; ++f) {
        wide_center[f] = center[f / d.inner];
        col_dy[f] = 0.0;
        col_xc[f] = 0.0;
    }
    for (int64_t k = 0; k < chunks; ++k) {
        int64_t r0 = k * per_chunk, r1 = r0 + per_chunk < d.outer ? r0 + per_chunk : d.outer;
        rows_grad_sums(dy, x, y, relu, width, r0, r1, wide_center, part_dy, part_xc);
        for (int64_t f = 0; f < width; ++f) {
            col_dy[f] += part_dy[f];
            col_xc[f] += part_xc[f];
        }
    }
    for (int64_t c = 0; c < d.channels; ++c) {
        sum_dy[c] = pairwise_sum(col_dy + c * d.inner, d.inner);
        sum_dy_xc[c] = pairwise_sum(col_xc + c * d.inner, d.inner);
    }
    free(work);
    return 0;
}

/* y = alpha * ((x - center[c]) * mul[c] + add[c]) + beta * y in memory order: channel rows for a long inner, else
 * rows of (outer, C * inner) with per-column factors; each element as the tasks compute it. */
static int serial_affine(const float *x, dims d, const double *center, const double *mul, const double *add,
                         double alpha, double beta, int relu, float *y) {
    if (d.inner >= MIN_INNER) {
        for (int64_t t = 0; t < d.outer * d.channels; ++t) {
            int64_t c = t % d.channels;
            affine_row(x + t * d.inner, y + t * d.inner, d.inner, center[c], mul[c] * alpha, add[c] * alpha, beta,
                       relu);
        }
        return 0;
    }
    const int64_t width = d.channels * d.inner;
    double *work = scratch(3 * (size_t)width);
    if (work == NULL) {
        return -1;
    }
    double *m = work, *a = work + width, *b = work + 2 * width;
    for (int64_t f = 0; f < width; ++f) {
        int64_t c = f / d.inner;
        m[f] = center[c];
        a[f] = mul[c] * alpha;
        b[f] = add[c] * alpha;
    }
    for (int64_t o = 0; o < d.outer; ++o) {
        affine_wide(x + o * width, y + o * width, width, m, a, b, beta, relu);
    }
    free(work);
    return 0;
}

/* forward_inference; parameters float64. */
int serial_inference(const float *x, dims d, const double *scale, const double *bias, const double *mean,
                            const double *var, double eps, int fix_gamma, double alpha, double beta, float *y) {
    double *mul = scratch((size_t)d.channels);
    if (mul == NULL) {
        return -1;
    }
    for (int64_t c = 0; c < d.channels; ++c) {
        mul[c] = (fix_gamma ? 1.0 : scale[c]) / sqrt(var[c] + eps);
    }
    int status = serial_affine(x, d, mean, mul, bias, alpha, beta, 0, y);
    free(mul);
    return status;
}

/* forward_training into y and the per-channel outputs (float64; batch_var may be NULL). */
int serial_training(const float *x, dims d, const double *scale, const double *bias, const double *rm,
                           const double *rv, double eps, double weight, int64_t flags, double alpha, double beta,
                           float *y, double *new_mean, double *new_var, double *saved_mean, double *saved_inv_std,
                           double *batch_var) {
    const int64_t count = d.outer * d.inner;
    double *work = scratch(4 * (size_t)d.channels);
    if (work == NULL) {
        return -1;
    }
    double *mean = work, *var = work + d.channels, *mul = work + 2 * d.channels, *add = work + 3 * d.channels;
    const int global_stats = (flags & GLOBAL_STATS) != 0;
    if (global_stats) {
        memcpy(mean, rm, (size_t)d.channels * sizeof(double));
        memcpy(var, rv, (size_t)d.channels * sizeof(double));
    } else if (serial_mean_var(x, d, mean, var) != 0) {
        free(work);
        return -1;
    }
    const double factor = (flags & UNBIASED) && count > 1 ? (double)count / (double)(count - 1) : 1.0;
    const double keep = 1.0 - weight;
    for (int64_t c = 0; c < d.channels; ++c) {
        double inv_std = 1.0 / sqrt(var[c] + eps);
        mul[c] = ((flags & FIX_GAMMA) ? 1.0 : scale[c]) * inv_std;
        add[c] = bias[c];
        if (global_stats) {
            new_mean[c] = rm[c];
            new_var[c] = rv[c];
        } else {
            new_mean[c] = rm[c] * keep + mean[c] * weight;
            new_var[c] = rv[c] * keep + var[c] * factor * weight;
        }
        saved_mean[c] = mean[c];
        saved_inv_std[c] = inv_std;
        if (batch_var != NULL) {
            batch_var[c] = var[c];
        }
    }
    int status = serial_affine(x, d, mean, mul, add, alpha, beta, (flags & RELU) != 0, y);
    free(work);
    return status;
}

/* backward into dx, dscale and dbias (unblended); with relu, dy masked where the forward's y <= 0. */
int serial_backward(const float *dy, const float *x, dims d, const double *scale, const double *saved_mean,
                           const double *saved_inv_std, int64_t flags, double alpha, double beta, const float *y,
                           float *dx, double *dscale, double *dbias) {
    const int relu = (flags & RELU) != 0, fix_gamma = (flags & FIX_GAMMA) != 0;
    const int64_t count = d.outer * d.inner, width = d.channels * d.inner;
    const int wide = d.inner < MIN_INNER;
    double *work = scratch(5 * (size_t)d.channels + (wide ? 4 * (size_t)width : 0));
    if (work == NULL) {
        return -1;
    }
    double *sum_dy = work, *sum_xc = work + d.channels, *a = work + 2 * d.channels, *b = work + 3 * d.channels;
    double *e = work + 4 * d.channels;
    if (serial_grad_sums(dy, x, relu ? y : dy, relu, d, saved_mean, sum_dy, sum_xc) != 0) {
        free(work);
        return -1;
    }
    for (int64_t c = 0; c < d.channels; ++c) {
        double r = saved_inv_std[c], k_dy, k_xc, k_add;
        dx_factors(fix_gamma ? 1.0 : scale[c], r, sum_dy[c], sum_xc[c], count, (flags & GLOBAL_STATS) != 0, &k_dy,
                   &k_xc, &k_add);
        a[c] = k_dy * alpha;
        b[c] = k_xc * alpha;
        e[c] = k_add * alpha;
        dscale[c] = fix_gamma ? 0.0 : sum_xc[c] * r;
        dbias[c] = sum_dy[c];
    }
    if (!relu) {
        y = dy; /* never read */
    }
    if (!wide) {
        for (int64_t t = 0; t < d.outer * d.channels; ++t) {
            int64_t c = t % d.channels, at = t * d.inner;
            dx_row(dy + at, x + at, y + at, dx + at, d.inner, saved_mean[c], a[c], b[c], e[c], beta, relu);
        }
    } else {
        double *m = work + 5 * d.channels, *aw = m + width, *bw = aw + width, *ew = bw + width;
        for (int64_t f = 0; f < width; ++f) {
            int64_t c = f / d.inner;
            m[f] = saved_mean[c];
            aw[f] = a[c];
            bw[f] = b[c];
            ew[f] = e[c];
        }
        for (int64_t o = 0; o < d.outer; ++o) {
            int64_t at = o * width;
            dx_wide(dy + at, x + at, y + at, dx + at, width, m, aw, bw, ew, beta, relu);
        }
    }
    free(work);
    return 0;
}

/* The serial kernels as tasks of count 1 for cpu.py's direct calls (parameters already float64):
 * inference: x, scale, bias, mean, var, y | ints outer, channels, inner, flags | reals eps, alpha, beta
 * training:  x, scale, bias, rm, rv, y, new_rm, new_rv, mean, inv_std, var | ints ..., flags | reals eps, weight,
 *            alpha, beta
 * backward:  dy, x, scale, saved_mean, saved_inv_std, y, dx, dscale, dbias | ints ..., flags | reals alpha, beta */
void task_serial_inference(void **data, size_t index) {
    (void)index;
    const int64_t *ints = data[6];
    const double *reals = data[7];
    dims d = {ints[0], ints[1], ints[2]};
    serial_inference(data[0], d, data[1], data[2], data[3], data[4], reals[0], (ints[3] & FIX_GAMMA) != 0, reals[1],
                     reals[2], data[5]);
}

void task_serial_training(void **data, size_t index) {
    (void)index;
    const int64_t *ints = data[11];
    const double *reals = data[12];
    dims d = {ints[0], ints[1], ints[2]};
    serial_training(data[0], d, data[1], data[2], data[3], data[4], reals[0], reals[1], ints[3], reals[2], reals[3],
                    data[5], data[6], data[7], data[8], data[9], data[10]);
}

void task_serial_backward(void **data, size_t index) {
    (void)index;
    const int64_t *ints = data[9];
    const double *reals = data[10];
    dims d = {ints[0], ints[1], ints[2]};
    serial_backward(data[0], data[1], d, data[2], data[3], data[4], ints[3], reals[0], reals[1], data[5], data[6],
                    data[7], data[8]);
}
