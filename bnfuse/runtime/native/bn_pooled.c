/* The BN kernels' parallel loops (cpuloops.c's tasks) for large inputs, run on onnxruntime's intra-op pool through
 * KernelContext_ParallelFor: what cpu.py's parallel path does, in C. Same bits as the serial kernels: channel ranges
 * may be cut anywhere, row chunks come from the shape and their partial sums are added in chunk order. */
#include "bn_pooled.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_CHANNEL_TASKS = 64 };

/* the row-chunk loops pay on the pool only from here (cpu.POOL_ROWS_FROM_BYTES); below, they run on this thread */
static void *rows_context(void *context, const dims *d) {
    return d->outer * d->channels * d->inner * 4 >= BN_POOL_ROWS_FROM_BYTES ? context : NULL;
}

static int64_t channel_tasks(int64_t count) {
    return count < 1 ? 1 : (count > MAX_CHANNEL_TASKS ? MAX_CHANNEL_TASKS : count);
}

static ort_status out_of_memory(void) { return ort.CreateStatus(ORT_FAIL, "bnfuse: out of memory"); }

/* width copies of per-channel values, each repeated inner times (np.repeat) */
static void repeat(const double *values, dims d, double *wide) {
    for (int64_t f = 0; f < d.channels * d.inner; ++f) {
        wide[f] = values[f / d.inner];
    }
}

/* y = (x - center) * mul + add per channel, relu fused (cpu._affine with alpha 1, beta 0) */
static ort_status affine(void *context, const float *x, dims d, const double *center, const double *mul,
                         const double *add, int relu, float *y) {
    if (d.inner >= MIN_INNER) {
        const int64_t tasks = channel_tasks(d.outer * d.channels);
        int64_t ints[5] = {d.outer, d.channels, d.inner, tasks, relu};
        double reals[2] = {1.0, 0.0};
        void *data[7] = {(void *)x, (void *)center, (void *)mul, (void *)add, y, ints, reals};
        return bn_run_tasks(context, (ort_parallel_fn)task_affine_channels, data, (size_t)tasks);
    }
    const int64_t width = d.channels * d.inner, chunks = row_chunks(d.outer, width);
    double *wide = malloc(3 * (size_t)width * sizeof(double));
    if (wide == NULL) {
        return out_of_memory();
    }
    repeat(center, d, wide);
    repeat(mul, d, wide + width);
    repeat(add, d, wide + 2 * width);
    int64_t ints[4] = {d.outer, width, chunks, relu};
    double reals[1] = {0.0};
    void *data[7] = {(void *)x, wide, wide + width, wide + 2 * width, y, ints, reals};
    ort_status status = bn_run_tasks(rows_context(context, &d), (ort_parallel_fn)task_affine_rows, data, (size_t)chunks);
    free(wide);
    return status;
}

/* per-channel mean and biased variance on the rows path (two passes: cpu._statistics) */
static ort_status row_statistics(void *context, const float *x, dims d, double *mean, double *var) {
    const int64_t width = d.channels * d.inner, chunks = row_chunks(d.outer, width), count = d.outer * d.inner;
    double *work = malloc((size_t)(2 + chunks) * (size_t)width * sizeof(double));
    if (work == NULL) {
        return out_of_memory();
    }
    double *center = work, *col = work + width, *part = work + 2 * width;
    memset(center, 0, (size_t)width * sizeof(double));
    ort_status status = NULL;
    for (int squared = 0; squared < 2 && status == NULL; ++squared) {
        int64_t ints[4] = {d.outer, width, chunks, squared};
        void *data[4] = {(void *)x, center, part, ints};
        status = bn_run_tasks(rows_context(context, &d), (ort_parallel_fn)task_column_sums, data, (size_t)chunks);
        memset(col, 0, (size_t)width * sizeof(double));
        for (int64_t k = 0; k < chunks; ++k) {
            for (int64_t f = 0; f < width; ++f) {
                col[f] += part[k * width + f];
            }
        }
        double *out = squared ? var : mean;
        for (int64_t c = 0; c < d.channels; ++c) {
            out[c] = pairwise_sum(col + c * d.inner, d.inner) / (double)count;
        }
        repeat(mean, d, center);
    }
    free(work);
    return status;
}

ort_status bn_pooled_inference(void *context, const float *x, dims d, const double *scale, const double *bias,
                               const double *mean, const double *var, double eps, int fix_gamma, float *y) {
    double *mul = malloc((size_t)d.channels * sizeof(double));
    if (mul == NULL) {
        return out_of_memory();
    }
    for (int64_t c = 0; c < d.channels; ++c) {
        mul[c] = (fix_gamma ? 1.0 : scale[c]) / sqrt(var[c] + eps);
    }
    ort_status status = affine(context, x, d, mean, mul, bias, 0, y);
    free(mul);
    return status;
}

ort_status bn_pooled_training(void *context, const float *x, dims d, const double *scale, const double *bias,
                              const double *rm, const double *rv, double eps, double weight, int64_t flags, float *y,
                              double *new_mean, double *new_var, double *saved_mean, double *saved_inv_std,
                              double *batch_var) {
    const int64_t n = d.channels, count = d.outer * d.inner;
    double *work = malloc(4 * (size_t)n * sizeof(double));
    if (work == NULL) {
        return out_of_memory();
    }
    double *gamma = work, *mean = work + n, *var = work + 2 * n, *mul = work + 3 * n;
    const int relu = (flags & RELU) != 0, global_stats = (flags & GLOBAL_STATS) != 0;
    for (int64_t c = 0; c < n; ++c) {
        gamma[c] = (flags & FIX_GAMMA) ? 1.0 : scale[c];
    }
    ort_status status = NULL;
    if (global_stats || d.inner < MIN_INNER) {
        if (global_stats) {
            memcpy(mean, rm, (size_t)n * sizeof(double));
            memcpy(var, rv, (size_t)n * sizeof(double));
        } else {
            status = row_statistics(context, x, d, mean, var);
        }
        for (int64_t c = 0; c < n; ++c) {
            saved_inv_std[c] = 1.0 / sqrt(var[c] + eps);
            mul[c] = gamma[c] * saved_inv_std[c];
        }
        if (status == NULL) {
            status = affine(context, x, d, mean, mul, bias, relu, y);
        }
    } else {
        const int64_t tasks = channel_tasks(n);
        int64_t ints[5] = {d.outer, n, d.inner, tasks, relu};
        double reals[3] = {eps, 1.0, 0.0};
        void *data[9] = {(void *)x, gamma, (void *)bias, mean, var, saved_inv_std, y, ints, reals};
        status = bn_run_tasks(context, (ort_parallel_fn)task_train_channels, data, (size_t)tasks);
    }
    const double factor = (flags & UNBIASED) && count > 1 ? (double)count / (double)(count - 1) : 1.0;
    for (int64_t c = 0; c < n; ++c) {
        if (global_stats) {
            new_mean[c] = rm[c];
            new_var[c] = rv[c];
        } else {
            new_mean[c] = rm[c] * (1.0 - weight) + mean[c] * weight;
            new_var[c] = rv[c] * (1.0 - weight) + var[c] * factor * weight;
        }
        saved_mean[c] = mean[c];
        if (batch_var != NULL) {
            batch_var[c] = var[c];
        }
    }
    free(work);
    return status;
}

/* dX by the rows loops (cpu._grad_sums_rows_view, then cpu._dx_rows_view) */
static ort_status backward_rows(void *context, const float *dy, const float *x, const float *y, int relu, dims d,
                                const double *center, const double *inv_std, const double *gamma, int global_stats,
                                double *sum_dy, double *sum_xc, float *dx) {
    const int64_t width = d.channels * d.inner, chunks = row_chunks(d.outer, width), n = d.channels;
    double *work = malloc(((size_t)(6 + 2 * chunks) * (size_t)width + 3 * (size_t)n) * sizeof(double));
    if (work == NULL) {
        return out_of_memory();
    }
    double *wide_center = work, *col_dy = work + width, *col_xc = work + 2 * width;
    double *a = work + 3 * width, *b = work + 4 * width, *e = work + 5 * width;
    double *part_dy = work + 6 * width, *part_xc = part_dy + chunks * width;
    double *k_dy = part_xc + chunks * width, *k_xc = k_dy + n, *k_add = k_xc + n;
    repeat(center, d, wide_center);
    void *rows = rows_context(context, &d);
    int64_t ints[4] = {d.outer, width, chunks, relu};
    void *sums[7] = {(void *)dy, (void *)x, wide_center, part_dy, part_xc, (void *)y, ints};
    ort_status status = bn_run_tasks(rows, (ort_parallel_fn)task_grad_sums, sums, (size_t)chunks);
    memset(col_dy, 0, 2 * (size_t)width * sizeof(double));
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        for (int64_t f = 0; f < width; ++f) {
            col_dy[f] += part_dy[chunk * width + f];
            col_xc[f] += part_xc[chunk * width + f];
        }
    }
    for (int64_t c = 0; c < n; ++c) {
        sum_dy[c] = pairwise_sum(col_dy + c * d.inner, d.inner);
        sum_xc[c] = pairwise_sum(col_xc + c * d.inner, d.inner);
        dx_factors(gamma[c], inv_std[c], sum_dy[c], sum_xc[c], d.outer * d.inner, global_stats, &k_dy[c], &k_xc[c],
                   &k_add[c]);
    }
    repeat(k_dy, d, a);
    repeat(k_xc, d, b);
    repeat(k_add, d, e);
    double reals[1] = {0.0};
    void *data[10] = {(void *)dy, (void *)x, wide_center, a, b, e, dx, (void *)y, ints, reals};
    if (status == NULL) {
        status = bn_run_tasks(rows, (ort_parallel_fn)task_dx_rows, data, (size_t)chunks);
    }
    free(work);
    return status;
}

ort_status bn_pooled_backward(void *context, const float *dy, const float *x, dims d, const double *scale,
                              const double *saved_mean, const double *saved_inv_std, int64_t flags, const float *y,
                              float *dx, double *dscale, double *dbias) {
    const int64_t n = d.channels;
    const int relu = (flags & RELU) != 0, global_stats = (flags & GLOBAL_STATS) != 0;
    double *work = malloc(2 * (size_t)n * sizeof(double));
    if (work == NULL) {
        return out_of_memory();
    }
    double *gamma = work, *sum_xc = work + n;
    for (int64_t c = 0; c < n; ++c) {
        gamma[c] = (flags & FIX_GAMMA) ? 1.0 : scale[c];
    }
    const float *masked_by = relu ? y : dy; /* read only with relu */
    ort_status status;
    if (d.inner >= MIN_INNER) {
        const int64_t tasks = channel_tasks(n);
        int64_t ints[6] = {d.outer, n, d.inner, tasks, global_stats, relu};
        double reals[2] = {1.0, 0.0};
        void *data[11] = {(void *)dy,    (void *)x, (void *)saved_mean, (void *)saved_inv_std, gamma,
                          dbias,         sum_xc,    dx,                 (void *)masked_by,      ints,
                          reals};
        status = bn_run_tasks(context, (ort_parallel_fn)task_backward_channels, data, (size_t)tasks);
    } else {
        status = backward_rows(context, dy, x, masked_by, relu, d, saved_mean, saved_inv_std, gamma, global_stats,
                               dbias, sum_xc, dx);
    }
    for (int64_t c = 0; c < n; ++c) {
        dscale[c] = (flags & FIX_GAMMA) ? 0.0 : sum_xc[c] * saved_inv_std[c];
    }
    free(work);
    return status;
}
