/* bnfuse.runtime._cpukernels, the loops: elementwise rows (strict IEEE), the per-channel bodies and the tasks of
 * cpu.py's parallel loops (``void task(void **data, size_t index)``; data layouts: cpu_pool.py). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpukernels.h"

/* -- elementwise rows (strict IEEE) ----------------------------------------------------------------- */
/* relu: v < 0 ? 0 : v on the float64 value before it is stored (NaN and -0 kept, as PyTorch's Relu). */

/* y = (x - m) * a + b [+ beta * y] over one row of n elements with scalar factors. */
BN_LOOP void affine_row(const float *x, float *y, int64_t n, double m, double a, double b, double beta,
                               int relu) {
    if (beta == 0.0) {
        if (relu) {
            for (int64_t i = 0; i < n; ++i) {
                double v = ((double)x[i] - m) * a + b;
                y[i] = (float)(v < 0.0 ? 0.0 : v);
            }
        } else {
            for (int64_t i = 0; i < n; ++i) {
                y[i] = (float)(((double)x[i] - m) * a + b);
            }
        }
    } else if (relu) {
        for (int64_t i = 0; i < n; ++i) {
            double v = ((double)x[i] - m) * a + b + beta * (double)y[i];
            y[i] = (float)(v < 0.0 ? 0.0 : v);
        }
    } else {
        for (int64_t i = 0; i < n; ++i) {
            y[i] = (float)(((double)x[i] - m) * a + b + beta * (double)y[i]);
        }
    }
}

/* The same over a row of the (rows, F) view with per-column factors. */
BN_LOOP void affine_wide(const float *x, float *y, int64_t n, const double *m, const double *a,
                                const double *b, double beta, int relu) {
    if (beta == 0.0) {
        if (relu) {
            for (int64_t i = 0; i < n; ++i) {
                double v = ((double)x[i] - m[i]) * a[i] + b[i];
                y[i] = (float)(v < 0.0 ? 0.0 : v);
            }
        } else {
            for (int64_t i = 0; i < n; ++i) {
                y[i] = (float)(((double)x[i] - m[i]) * a[i] + b[i]);
            }
        }
    } else if (relu) {
        for (int64_t i = 0; i < n; ++i) {
            double v = ((double)x[i] - m[i]) * a[i] + b[i] + beta * (double)y[i];
            y[i] = (float)(v < 0.0 ? 0.0 : v);
        }
    } else {
        for (int64_t i = 0; i < n; ++i) {
            y[i] = (float)(((double)x[i] - m[i]) * a[i] + b[i] + beta * (double)y[i]);
        }
    }
}

/* dx = a * g + b * (x - m) + e [+ beta * dx]; g = dy, or 0 where y <= 0 with relu. */
BN_LOOP void dx_row(const float *dy, const float *x, const float *y, float *dx, int64_t n, double m, double a,
                           double b, double e, double beta, int relu) {
    if (relu) {
        if (beta == 0.0) {
            for (int64_t i = 0; i < n; ++i) {
                double g = y[i] <= 0.0f ? 0.0 : (double)dy[i];
                dx[i] = (float)(a * g + b * ((double)x[i] - m) + e);
            }
        } else {
            for (int64_t i = 0; i < n; ++i) {
                double g = y[i] <= 0.0f ? 0.0 : (double)dy[i];
                dx[i] = (float)(a * g + b * ((double)x[i] - m) + e + beta * (double)dx[i]);
            }
        }
    } else if (beta == 0.0) {
        for (int64_t i = 0; i < n; ++i) {
            dx[i] = (float)(a * (double)dy[i] + b * ((double)x[i] - m) + e);
        }
    } else {
        for (int64_t i = 0; i < n; ++i) {
            dx[i] = (float)(a * (double)dy[i] + b * ((double)x[i] - m) + e + beta * (double)dx[i]);
        }
    }
}

BN_LOOP void dx_wide(const float *dy, const float *x, const float *y, float *dx, int64_t n, const double *m,
                            const double *a, const double *b, const double *e, double beta, int relu) {
    if (relu) {
        if (beta == 0.0) {
            for (int64_t i = 0; i < n; ++i) {
                double g = y[i] <= 0.0f ? 0.0 : (double)dy[i];
                dx[i] = (float)(a[i] * g + b[i] * ((double)x[i] - m[i]) + e[i]);
            }
        } else {
            for (int64_t i = 0; i < n; ++i) {
                double g = y[i] <= 0.0f ? 0.0 : (double)dy[i];
                dx[i] = (float)(a[i] * g + b[i] * ((double)x[i] - m[i]) + e[i] + beta * (double)dx[i]);
            }
        }
    } else if (beta == 0.0) {
        for (int64_t i = 0; i < n; ++i) {
            dx[i] = (float)(a[i] * (double)dy[i] + b[i] * ((double)x[i] - m[i]) + e[i]);
        }
    } else {
        for (int64_t i = 0; i < n; ++i) {
            dx[i] = (float)(a[i] * (double)dy[i] + b[i] * ((double)x[i] - m[i]) + e[i] + beta * (double)dx[i]);
        }
    }
}

/* -- per-channel bodies shared by the tasks and the serial kernels ---------------------------------- */

/* Channel c: two-pass mean and biased variance, then y while the channel is still in cache. */
static void train_channel(const float *x, dims d, int64_t c, double gamma, double bias, double eps, double alpha,
                          double beta, int relu, double *mean, double *var, double *inv_std, float *y) {
    const int64_t count = d.outer * d.inner, stride = d.channels * d.inner, start = c * d.inner;
    double mu = channel_sum(x + start, d.outer, stride, d.inner) / (double)count;
    double v = channel_sqdev(x + start, d.outer, stride, d.inner, mu) / (double)count;
    double r = 1.0 / sqrt(v + eps);
    mean[c] = mu;
    var[c] = v;
    inv_std[c] = r;
    double a = gamma * r * alpha, b = bias * alpha;
    for (int64_t o = 0; o < d.outer; ++o) {
        affine_row(x + start + o * stride, y + start + o * stride, d.inner, mu, a, b, beta, relu);
    }
}

/* Channel c's dx coefficients from its sums: k_dy, k_xc, k_add (global statistics: no batch terms). */
void dx_factors(double gamma, double r, double s_dy, double s_xc, int64_t count, int global_stats,
                       double *k_dy, double *k_xc, double *k_add) {
    *k_dy = gamma * r;
    if (global_stats) {
        *k_xc = 0.0;
        *k_add = 0.0;
    } else {
        *k_xc = -*k_dy * r * (s_xc * r) / (double)count;
        *k_add = -*k_dy * s_dy / (double)count;
    }
}

static void backward_channel(const float *dy, const float *x, const float *y, int relu, dims d, int64_t c,
                             double center, double r, double gamma, int global_stats, double alpha, double beta,
                             double *sum_dy, double *sum_dy_xc, float *dx) {
    const int64_t stride = d.channels * d.inner, start = c * d.inner;
    double s_dy, s_xc, k_dy, k_xc, k_add;
    channel_grad_sums(dy + start, x + start, y + start, relu, d.outer, stride, d.inner, center, &s_dy, &s_xc);
    sum_dy[c] = s_dy;
    sum_dy_xc[c] = s_xc;
    dx_factors(gamma, r, s_dy, s_xc, d.outer * d.inner, global_stats, &k_dy, &k_xc, &k_add);
    for (int64_t o = 0; o < d.outer; ++o) {
        int64_t at = start + o * stride;
        dx_row(dy + at, x + at, y + at, dx + at, d.inner, center, k_dy * alpha, k_xc * alpha, k_add * alpha, beta,
               relu);
    }
}

static int64_t span_start(size_t index, int64_t tasks, int64_t total) { return (int64_t)index * total / tasks; }

int64_t row_chunks(int64_t rows, int64_t width) { /* cpu._chunks(*_rows_geometry(...)) */
    int64_t per_block = ROW_BLOCK_ELEMENTS / width > 1 ? ROW_BLOCK_ELEMENTS / width : 1;
    int64_t chunks = (rows + per_block - 1) / per_block;
    return chunks < 1 ? 1 : (chunks > MAX_CHUNKS ? MAX_CHUNKS : chunks);
}

/* -- tasks (data layouts: cpu_pool.py's run_* functions) --------------------------------------------- */

void task_train_channels(void **data, size_t index) {
    const int64_t *ints = data[7];
    const double *reals = data[8];
    dims d = {ints[0], ints[1], ints[2]};
    const double *gamma = data[1], *bias = data[2];
    int64_t stop = span_start(index + 1, ints[3], d.channels);
    for (int64_t c = span_start(index, ints[3], d.channels); c < stop; ++c) {
        train_channel(data[0], d, c, gamma[c], bias[c], reals[0], reals[1], reals[2], ints[4] != 0, data[3],
                      data[4], data[5], data[6]);
    }
}

void task_backward_channels(void **data, size_t index) {
    const int64_t *ints = data[9];
    const double *reals = data[10];
    dims d = {ints[0], ints[1], ints[2]};
    const double *center = data[2], *inv_std = data[3], *gamma = data[4];
    int64_t stop = span_start(index + 1, ints[3], d.channels);
    for (int64_t c = span_start(index, ints[3], d.channels); c < stop; ++c) {
        backward_channel(data[0], data[1], data[8], ints[5] != 0, d, c, center[c], inv_std[c], gamma[c],
                         ints[4] != 0, reals[0], reals[1], data[5], data[6], data[7]);
    }
}

void task_affine_channels(void **data, size_t index) {
    const int64_t *ints = data[5];
    const double *reals = data[6];
    dims d = {ints[0], ints[1], ints[2]};
    const float *x = data[0];
    const double *center = data[1], *mul = data[2], *add = data[3];
    float *y = data[4];
    int64_t stop = span_start(index + 1, ints[3], d.outer * d.channels);
    for (int64_t t = span_start(index, ints[3], d.outer * d.channels); t < stop; ++t) {
        int64_t c = t % d.channels;
        affine_row(x + t * d.inner, y + t * d.inner, d.inner, center[c], mul[c] * reals[0], add[c] * reals[0],
                   reals[1], ints[4] != 0);
    }
}

static void chunk_rows(const int64_t *ints, size_t index, int64_t *r0, int64_t *r1) {
    int64_t rows = ints[0], chunks = ints[2], per_chunk = (rows + chunks - 1) / chunks;
    *r0 = (int64_t)index * per_chunk;
    *r1 = *r0 + per_chunk < rows ? *r0 + per_chunk : rows;
}

void task_column_sums(void **data, size_t index) {
    const int64_t *ints = data[3];
    int64_t r0, r1;
    chunk_rows(ints, index, &r0, &r1);
    rows_sums(data[0], ints[1], r0, r1, data[1], ints[3] != 0, (double *)data[2] + (int64_t)index * ints[1]);
}

void task_grad_sums(void **data, size_t index) {
    const int64_t *ints = data[6];
    int64_t r0, r1, at = (int64_t)index * ints[1];
    chunk_rows(ints, index, &r0, &r1);
    rows_grad_sums(data[0], data[1], data[5], ints[3] != 0, ints[1], r0, r1, data[2], (double *)data[3] + at,
                   (double *)data[4] + at);
}

void task_affine_rows(void **data, size_t index) {
    const int64_t *ints = data[5];
    const double *reals = data[6];
    int64_t r0, r1, width = ints[1];
    chunk_rows(ints, index, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r) {
        affine_wide((const float *)data[0] + r * width, (float *)data[4] + r * width, width, data[1], data[2],
                    data[3], reals[0], ints[3] != 0);
    }
}

void task_dx_rows(void **data, size_t index) {
    const int64_t *ints = data[8];
    const double *reals = data[9];
    int64_t r0, r1, width = ints[1];
    chunk_rows(ints, index, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r) {
        int64_t at = r * width;
        dx_wide((const float *)data[0] + at, (const float *)data[1] + at, (const float *)data[7] + at,
                (float *)data[6] + at, width, data[2], data[3], data[4], data[5], reals[0], ints[3] != 0);
    }
}
