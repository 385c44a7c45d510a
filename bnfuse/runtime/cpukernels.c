/* bnfuse.runtime._cpukernels: the fast CPU BN kernels (bnfuse/runtime/cpu.py is their Python face).
 *
 * The data is viewed as (outer, channels, inner), float32; parameters and every accumulation are float64.
 * Everything here is a plain C function of one of two shapes:
 *
 * - a task ``void task(void **data, size_t index)``: one range of channels, or one fixed row chunk, of one of
 *   cpu.py's parallel loops. cpu_pool.py hands tasks to onnxruntime's intra-op pool inside a session
 *   (KernelContext_ParallelFor) and to this file's own small pthread pool (run(), GIL released) outside one.
 *   The serial kernels (serial_inference / _training / _backward) are tasks of count 1.
 * - an entry ``void f(void **tensors, const int64_t *ints, const double *reals)``: the serial kernels with
 *   float32 parameters, called by ortentry.c's per-call fast path (cpu_entry.py).
 *
 * Determinism: no atomics in the arithmetic; every sum has one order, fixed by the shape and the implementation
 * picked for the process (the channel reductions: AVX2 lanes or a portable omp simd loop), the row chunks' column
 * sums are strictly in row order, chunk partials are added in chunk order by the caller. Each reduction is
 * one non-inlined function, so every path (serial, task, any thread count) runs the same machine code for it.
 * Elementwise loops are strict IEEE (-ffp-contract=off: no FMA contraction). NaN and Inf propagate (no
 * -ffast-math). target_clones compiles the elementwise loops for AVX-512, AVX2 and baseline x86-64 (the CPU picks
 * one clone for the process). Results may differ in the last bits between CPUs, never between runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define BN_LOOP __attribute__((noinline, target_clones("avx512f", "avx2", "default")))
#else
#define BN_LOOP __attribute__((noinline))
#endif

typedef void (*bn_task)(void **data, size_t index);

enum { MIN_INNER = 32, ROW_BLOCK_ELEMENTS = 16384, MAX_CHUNKS = 64 }; /* cpu.py's _MIN_INNER, ... */

static atomic_int scratch_failed; /* a serial kernel could not allocate its scratch: run() raises MemoryError */

static double *scratch(size_t count) {
    double *memory = malloc((count ? count : 1) * sizeof(double));
    if (memory == NULL) {
        atomic_store(&scratch_failed, 1);
    }
    return memory;
}

/* -- reductions (one machine-code copy each: the same bits on every path) ---------------------------- */

/* The channel reductions: one implementation is picked for the process when the module loads (AVX2 where the CPU
 * has it, else portable C) and every path calls it, so the order of every sum is fixed for the process. AVX2: four
 * accumulators of 4 float64 lanes over all of a channel's rows (per row: blocks of 16 elements, then blocks of 4 into
 * the first accumulator, the row's last inner % 4 into a scalar), then the accumulators and lanes in a fixed tree.
 * Portable: an ``omp simd`` reduction (-fopenmp-simd; no OpenMP runtime). The two may differ in the last bits. */
typedef double (*channel_sum_fn)(const float *x, int64_t outer, int64_t stride, int64_t inner);
typedef double (*channel_sqdev_fn)(const float *x, int64_t outer, int64_t stride, int64_t inner, double mu);
typedef void (*channel_grad_sums_fn)(const float *dy, const float *x, const float *y, int relu, int64_t outer,
                                     int64_t stride, int64_t inner, double mu, double *sum_dy, double *sum_dy_xc);

__attribute__((noinline)) static double portable_sum(const float *x, int64_t outer, int64_t stride, int64_t inner) {
    double total = 0.0;
    for (int64_t o = 0; o < outer; ++o) {
        const float *row = x + o * stride;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < inner; ++i) {
            total += (double)row[i];
        }
    }
    return total;
}

__attribute__((noinline)) static double portable_sqdev(const float *x, int64_t outer, int64_t stride, int64_t inner,
                                                       double mu) {
    double total = 0.0;
    for (int64_t o = 0; o < outer; ++o) {
        const float *row = x + o * stride;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < inner; ++i) {
            double d = (double)row[i] - mu;
            total += d * d;
        }
    }
    return total;
}

__attribute__((noinline)) static void portable_grad_sums(const float *dy, const float *x, const float *y, int relu,
                                                         int64_t outer, int64_t stride, int64_t inner, double mu,
                                                         double *sum_dy, double *sum_dy_xc) {
    double s_dy = 0.0, s_xc = 0.0;
    for (int64_t o = 0; o < outer; ++o) {
        const float *g_row = dy + o * stride, *x_row = x + o * stride, *y_row = y + o * stride;
#pragma omp simd reduction(+ : s_dy, s_xc)
        for (int64_t i = 0; i < inner; ++i) {
            double g = relu && y_row[i] <= 0.0f ? 0.0 : (double)g_row[i];
            s_dy += g;
            s_xc += g * ((double)x_row[i] - mu);
        }
    }
    *sum_dy = s_dy;
    *sum_dy_xc = s_xc;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define BN_AVX2 __attribute__((target("avx2"), noinline))
#define BN_AVX2_INLINE static inline __attribute__((target("avx2"), always_inline))

BN_AVX2_INLINE __m256d load4(const float *p) { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }

/* dy where the forward's y > 0 or NaN (y <= 0 masks it). */
BN_AVX2_INLINE __m256d masked4(const float *dy, const float *y) {
    return _mm256_andnot_pd(_mm256_cmp_pd(load4(y), _mm256_setzero_pd(), _CMP_LE_OQ), load4(dy));
}

BN_AVX2_INLINE double lanes_sum(const __m256d *acc) {
    __m256d v = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
    double lane[4];
    _mm256_storeu_pd(lane, v);
    return (lane[0] + lane[1]) + (lane[2] + lane[3]);
}

BN_AVX2 static double avx2_sum(const float *x, int64_t outer, int64_t stride, int64_t inner) {
    __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    double tail = 0.0;
    const int64_t wide = inner - inner % 16, body = inner - inner % 4;
    for (int64_t o = 0; o < outer; ++o) {
        const float *row = x + o * stride;
        for (int64_t i = 0; i < wide; i += 16) {
            for (int k = 0; k < 4; ++k) {
                acc[k] = _mm256_add_pd(acc[k], load4(row + i + 4 * k));
            }
        }
        for (int64_t i = wide; i < body; i += 4) {
            acc[0] = _mm256_add_pd(acc[0], load4(row + i));
        }
        for (int64_t i = body; i < inner; ++i) {
            tail += (double)row[i];
        }
    }
    return lanes_sum(acc) + tail;
}

BN_AVX2 static double avx2_sqdev(const float *x, int64_t outer, int64_t stride, int64_t inner, double mu) {
    __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    const __m256d center = _mm256_set1_pd(mu);
    double tail = 0.0;
    const int64_t wide = inner - inner % 16, body = inner - inner % 4;
    for (int64_t o = 0; o < outer; ++o) {
        const float *row = x + o * stride;
        for (int64_t i = 0; i < wide; i += 16) {
            for (int k = 0; k < 4; ++k) {
                __m256d d = _mm256_sub_pd(load4(row + i + 4 * k), center);
                acc[k] = _mm256_add_pd(acc[k], _mm256_mul_pd(d, d));
            }
        }
        for (int64_t i = wide; i < body; i += 4) {
            __m256d d = _mm256_sub_pd(load4(row + i), center);
            acc[0] = _mm256_add_pd(acc[0], _mm256_mul_pd(d, d));
        }
        for (int64_t i = body; i < inner; ++i) {
            double d = (double)row[i] - mu;
            tail += d * d;
        }
    }
    return lanes_sum(acc) + tail;
}

BN_AVX2 static void avx2_grad_sums(const float *dy, const float *x, const float *y, int relu, int64_t outer,
                                   int64_t stride, int64_t inner, double mu, double *sum_dy, double *sum_dy_xc) {
    __m256d acc_dy[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    __m256d acc_xc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    const __m256d center = _mm256_set1_pd(mu);
    double tail_dy = 0.0, tail_xc = 0.0;
    const int64_t wide = inner - inner % 16, body = inner - inner % 4;
    for (int64_t o = 0; o < outer; ++o) {
        const float *g_row = dy + o * stride, *x_row = x + o * stride, *y_row = y + o * stride;
        if (relu) { /* loops apart: each stays one straight vector body */
            for (int64_t i = 0; i < wide; i += 16) {
                for (int k = 0; k < 4; ++k) {
                    __m256d g = masked4(g_row + i + 4 * k, y_row + i + 4 * k);
                    acc_dy[k] = _mm256_add_pd(acc_dy[k], g);
                    acc_xc[k] = _mm256_add_pd(acc_xc[k], _mm256_mul_pd(g, _mm256_sub_pd(load4(x_row + i + 4 * k), center)));
                }
            }
            for (int64_t i = wide; i < body; i += 4) {
                __m256d g = masked4(g_row + i, y_row + i);
                acc_dy[0] = _mm256_add_pd(acc_dy[0], g);
                acc_xc[0] = _mm256_add_pd(acc_xc[0], _mm256_mul_pd(g, _mm256_sub_pd(load4(x_row + i), center)));
            }
        } else {
            for (int64_t i = 0; i < wide; i += 16) {
                for (int k = 0; k < 4; ++k) {
                    __m256d g = load4(g_row + i + 4 * k);
                    acc_dy[k] = _mm256_add_pd(acc_dy[k], g);
                    acc_xc[k] = _mm256_add_pd(acc_xc[k], _mm256_mul_pd(g, _mm256_sub_pd(load4(x_row + i + 4 * k), center)));
                }
            }
            for (int64_t i = wide; i < body; i += 4) {
                __m256d g = load4(g_row + i);
                acc_dy[0] = _mm256_add_pd(acc_dy[0], g);
                acc_xc[0] = _mm256_add_pd(acc_xc[0], _mm256_mul_pd(g, _mm256_sub_pd(load4(x_row + i), center)));
            }
        }
        for (int64_t i = body; i < inner; ++i) {
            double g = relu && y_row[i] <= 0.0f ? 0.0 : (double)g_row[i];
            tail_dy += g;
            tail_xc += g * ((double)x_row[i] - mu);
        }
    }
    *sum_dy = lanes_sum(acc_dy) + tail_dy;
    *sum_dy_xc = lanes_sum(acc_xc) + tail_xc;
}
#endif

static channel_sum_fn channel_sum = portable_sum;
static channel_sqdev_fn channel_sqdev = portable_sqdev;
static channel_grad_sums_fn channel_grad_sums = portable_grad_sums;

static const char *reductions_name = "portable";

/* BNFUSE_CPU_REDUCTIONS=portable keeps the portable loops (tests run both implementations on one machine). */
static void pick_reductions(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    const char *wanted = getenv("BNFUSE_CPU_REDUCTIONS");
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && !(wanted != NULL && strcmp(wanted, "portable") == 0)) {
        reductions_name = "avx2";
        channel_sum = avx2_sum;
        channel_sqdev = avx2_sqdev;
        channel_grad_sums = avx2_grad_sums;
    }
#endif
}

/* acc[f] = sum over rows r0..r1 of (x - center[f]) (or its square), each column in row order. */
BN_LOOP static void rows_sums(const float *x, int64_t width, int64_t r0, int64_t r1, const double *center,
                              int squared, double *acc) {
    for (int64_t f = 0; f < width; ++f) {
        acc[f] = 0.0;
    }
    for (int64_t r = r0; r < r1; ++r) {
        const float *row = x + r * width;
        if (squared) {
            for (int64_t f = 0; f < width; ++f) {
                double d = (double)row[f] - center[f];
                acc[f] += d * d;
            }
        } else {
            for (int64_t f = 0; f < width; ++f) {
                acc[f] += (double)row[f] - center[f];
            }
        }
    }
}

BN_LOOP static void rows_grad_sums(const float *dy, const float *x, const float *y, int relu, int64_t width,
                                   int64_t r0, int64_t r1, const double *center, double *acc_dy, double *acc_xc) {
    for (int64_t f = 0; f < width; ++f) {
        acc_dy[f] = 0.0;
        acc_xc[f] = 0.0;
    }
    for (int64_t r = r0; r < r1; ++r) {
        const float *g_row = dy + r * width, *x_row = x + r * width, *y_row = y + r * width;
        if (relu) {
            for (int64_t f = 0; f < width; ++f) {
                double g = y_row[f] <= 0.0f ? 0.0 : (double)g_row[f];
                acc_dy[f] += g;
                acc_xc[f] += g * ((double)x_row[f] - center[f]);
            }
        } else {
            for (int64_t f = 0; f < width; ++f) {
                double g = (double)g_row[f];
                acc_dy[f] += g;
                acc_xc[f] += g * ((double)x_row[f] - center[f]);
            }
        }
    }
}

/* NumPy's pairwise summation of a[0:n] for n <= 128 (a row of ``col.reshape(C, inner).sum(axis=1)``), so the
 * serial rows path gives the bits of the parallel one, which sums with NumPy. */
static double pairwise_sum(const double *a, int64_t n) {
    if (n < 8) {
        double total = -0.0;
        for (int64_t i = 0; i < n; ++i) {
            total += a[i];
        }
        return total;
    }
    double r[8];
    for (int j = 0; j < 8; ++j) {
        r[j] = a[j];
    }
    int64_t i = 8;
    for (; i < n - n % 8; i += 8) {
        for (int j = 0; j < 8; ++j) {
            r[j] += a[i + j];
        }
    }
    double total = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) {
        total += a[i];
    }
    return total;
}

/* -- elementwise rows (strict IEEE) ----------------------------------------------------------------- */
/* relu: v < 0 ? 0 : v on the float64 value before it is stored (NaN and -0 kept, as PyTorch's Relu). */

/* y = (x - m) * a + b [+ beta * y] over one row of n elements with scalar factors. */
BN_LOOP static void affine_row(const float *x, float *y, int64_t n, double m, double a, double b, double beta,
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
BN_LOOP static void affine_wide(const float *x, float *y, int64_t n, const double *m, const double *a,
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
BN_LOOP static void dx_row(const float *dy, const float *x, const float *y, float *dx, int64_t n, double m, double a,
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

BN_LOOP static void dx_wide(const float *dy, const float *x, const float *y, float *dx, int64_t n, const double *m,
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

typedef struct {
    int64_t outer, channels, inner;
} dims;

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
static void dx_factors(double gamma, double r, double s_dy, double s_xc, int64_t count, int global_stats,
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

static int64_t row_chunks(int64_t rows, int64_t width) { /* cpu._chunks(*_rows_geometry(...)) */
    int64_t per_block = ROW_BLOCK_ELEMENTS / width > 1 ? ROW_BLOCK_ELEMENTS / width : 1;
    int64_t chunks = (rows + per_block - 1) / per_block;
    return chunks < 1 ? 1 : (chunks > MAX_CHUNKS ? MAX_CHUNKS : chunks);
}

/* -- tasks (data layouts: cpu_pool.py's run_* functions) --------------------------------------------- */

static void task_train_channels(void **data, size_t index) {
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

static void task_backward_channels(void **data, size_t index) {
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

static void task_affine_channels(void **data, size_t index) {
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

static void task_column_sums(void **data, size_t index) {
    const int64_t *ints = data[3];
    int64_t r0, r1;
    chunk_rows(ints, index, &r0, &r1);
    rows_sums(data[0], ints[1], r0, r1, data[1], ints[3] != 0, (double *)data[2] + (int64_t)index * ints[1]);
}

static void task_grad_sums(void **data, size_t index) {
    const int64_t *ints = data[6];
    int64_t r0, r1, at = (int64_t)index * ints[1];
    chunk_rows(ints, index, &r0, &r1);
    rows_grad_sums(data[0], data[1], data[5], ints[3] != 0, ints[1], r0, r1, data[2], (double *)data[3] + at,
                   (double *)data[4] + at);
}

static void task_affine_rows(void **data, size_t index) {
    const int64_t *ints = data[5];
    const double *reals = data[6];
    int64_t r0, r1, width = ints[1];
    chunk_rows(ints, index, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r) {
        affine_wide((const float *)data[0] + r * width, (float *)data[4] + r * width, width, data[1], data[2],
                    data[3], reals[0], ints[3] != 0);
    }
}

static void task_dx_rows(void **data, size_t index) {
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
static int serial_inference(const float *x, dims d, const double *scale, const double *bias, const double *mean,
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

enum { UNBIASED = 1, FIX_GAMMA = 2, GLOBAL_STATS = 4, RELU = 8 }; /* cpu_entry.py's flags */

/* forward_training into y and the per-channel outputs (float64; batch_var may be NULL). */
static int serial_training(const float *x, dims d, const double *scale, const double *bias, const double *rm,
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
static int serial_backward(const float *dy, const float *x, dims d, const double *scale, const double *saved_mean,
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
static void task_serial_inference(void **data, size_t index) {
    (void)index;
    const int64_t *ints = data[6];
    const double *reals = data[7];
    dims d = {ints[0], ints[1], ints[2]};
    serial_inference(data[0], d, data[1], data[2], data[3], data[4], reals[0], (ints[3] & FIX_GAMMA) != 0, reals[1],
                     reals[2], data[5]);
}

static void task_serial_training(void **data, size_t index) {
    (void)index;
    const int64_t *ints = data[11];
    const double *reals = data[12];
    dims d = {ints[0], ints[1], ints[2]};
    serial_training(data[0], d, data[1], data[2], data[3], data[4], reals[0], reals[1], ints[3], reals[2], reals[3],
                    data[5], data[6], data[7], data[8], data[9], data[10]);
}

static void task_serial_backward(void **data, size_t index) {
    (void)index;
    const int64_t *ints = data[9];
    const double *reals = data[10];
    dims d = {ints[0], ints[1], ints[2]};
    serial_backward(data[0], data[1], d, data[2], data[3], data[4], ints[3], reals[0], reals[1], data[5], data[6],
                    data[7], data[8]);
}

/* -- entries of ortentry.c's fast path: float32 parameters ----------------------------------------------- */
/* tensors = the op's inputs then its outputs (a fused Grad's Y last, slot 11); ints = {outer, channels, inner,
 * flags, batch_var present}; reals = {epsilon, batch weight}. */

enum { Y_SLOT = 11 };

static void widen(const float *from, double *to, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        to[i] = (double)from[i];
    }
}

static void narrow(const double *from, float *to, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        to[i] = (float)from[i];
    }
}

static void fill_nan(float *to, int64_t n) { /* scratch could not be allocated: no silent garbage */
    for (int64_t i = 0; i < n; ++i) {
        to[i] = NAN;
    }
}

static void entry_inference(void **tensors, const int64_t *ints, const double *reals) {
    dims d = {ints[0], ints[1], ints[2]};
    const int64_t n = d.channels;
    double *p = scratch(4 * (size_t)n);
    if (p == NULL || (widen(tensors[1], p, n), widen(tensors[2], p + n, n), widen(tensors[3], p + 2 * n, n),
                      widen(tensors[4], p + 3 * n, n),
                      serial_inference(tensors[0], d, p, p + n, p + 2 * n, p + 3 * n, reals[0],
                                       (ints[3] & FIX_GAMMA) != 0, 1.0, 0.0, tensors[5]) != 0)) {
        fill_nan(tensors[5], d.outer * d.channels * d.inner);
    }
    free(p);
}

static void entry_training(void **tensors, const int64_t *ints, const double *reals) {
    dims d = {ints[0], ints[1], ints[2]};
    const int64_t n = d.channels;
    double *p = scratch(9 * (size_t)n);
    if (p == NULL) {
        fill_nan(tensors[5], d.outer * d.channels * d.inner);
        return;
    }
    for (int k = 0; k < 4; ++k) {
        widen(tensors[1 + k], p + k * n, n);
    }
    double *out = p + 4 * n; /* new_mean, new_var, saved_mean, saved_inv_std, batch_var */
    if (serial_training(tensors[0], d, p, p + n, p + 2 * n, p + 3 * n, reals[0], reals[1], ints[3], 1.0, 0.0,
                        tensors[5], out, out + n, out + 2 * n, out + 3 * n, out + 4 * n) != 0) {
        fill_nan(tensors[5], d.outer * d.channels * d.inner);
    }
    for (int k = 0; k < (ints[4] ? 5 : 4); ++k) {
        narrow(out + k * n, tensors[6 + k], n);
    }
    free(p);
}

static void entry_backward(void **tensors, const int64_t *ints, const double *reals) {
    (void)reals;
    dims d = {ints[0], ints[1], ints[2]};
    const int64_t n = d.channels;
    double *p = scratch(5 * (size_t)n);
    if (p == NULL) {
        fill_nan(tensors[5], d.outer * d.channels * d.inner);
        return;
    }
    for (int k = 0; k < 3; ++k) {
        widen(tensors[2 + k], p + k * n, n);
    }
    const float *y = (ints[3] & RELU) ? tensors[Y_SLOT] : tensors[0];
    if (serial_backward(tensors[0], tensors[1], d, p, p + n, p + 2 * n, ints[3], 1.0, 0.0, y, tensors[5], p + 3 * n,
                        p + 4 * n) != 0) {
        fill_nan(tensors[5], d.outer * d.channels * d.inner);
    }
    narrow(p + 3 * n, tensors[6], n);
    narrow(p + 4 * n, tensors[7], n);
    free(p);
}

/* -- a small pthread pool for the tasks outside onnxruntime's sessions ----------------------------------
 * Workers are started on first need (at most the largest thread count asked for, less the caller, who runs tasks
 * too) and take task indices from one shared counter; a worker spins briefly after a job before it sleeps. One
 * job at a time: a caller that finds the pool busy (another Python thread's kernel) runs its tasks itself. No
 * OpenMP: nothing here changes any library's thread settings. */

enum { SPIN_NS = 50000 };

static struct {
    pthread_mutex_t lock, job;
    pthread_cond_t wake, idle;
    _Atomic uint64_t generation;
    int workers, active, wanted, joined, busy;
    bn_task task;
    void **data;
    size_t count;
    _Atomic size_t next;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void drain(bn_task task, void **data, size_t count) {
    for (;;) {
        size_t index = atomic_fetch_add(&pool.next, 1);
        if (index >= count) {
            return;
        }
        task(data, index);
    }
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *worker(void *unused) {
    (void)unused;
    uint64_t seen = 0;
    for (;;) {
        int64_t until = now_ns() + SPIN_NS;
        while (atomic_load(&pool.generation) == seen && now_ns() < until) {
#if defined(__x86_64__)
            __builtin_ia32_pause();
#endif
        }
        pthread_mutex_lock(&pool.lock);
        while (atomic_load(&pool.generation) == seen) {
            pthread_cond_wait(&pool.wake, &pool.lock);
        }
        seen = atomic_load(&pool.generation);
        if (!pool.active || pool.joined >= pool.wanted) {
            pthread_mutex_unlock(&pool.lock);
            continue;
        }
        pool.joined++;
        pool.busy++;
        bn_task task = pool.task;
        void **data = pool.data;
        size_t count = pool.count;
        pthread_mutex_unlock(&pool.lock);
        drain(task, data, count);
        pthread_mutex_lock(&pool.lock);
        if (--pool.busy == 0) {
            pthread_cond_signal(&pool.idle);
        }
        pthread_mutex_unlock(&pool.lock);
    }
    return NULL;
}

static void run_serially(bn_task task, void **data, size_t count) {
    for (size_t index = 0; index < count; ++index) {
        task(data, index);
    }
}

static void pool_run(bn_task task, void **data, size_t count, int threads) {
    if (threads <= 1 || count <= 1 || pthread_mutex_trylock(&pool.job) != 0) {
        run_serially(task, data, count);
        return;
    }
    pthread_mutex_lock(&pool.lock);
    while (pool.workers < threads - 1) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attributes, worker, NULL);
        pthread_attr_destroy(&attributes);
        if (failed) {
            break;
        }
        pool.workers++;
    }
    int helpers = threads - 1 < pool.workers ? threads - 1 : pool.workers;
    pool.wanted = (size_t)helpers < count - 1 ? helpers : (int)(count - 1);
    pool.joined = 0;
    pool.task = task;
    pool.data = data;
    pool.count = count;
    atomic_store(&pool.next, 0);
    pool.active = 1;
    atomic_fetch_add(&pool.generation, 1);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    drain(task, data, count);
    pthread_mutex_lock(&pool.lock);
    pool.active = 0;
    while (pool.busy > 0) {
        pthread_cond_wait(&pool.idle, &pool.lock);
    }
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.job);
}

static void pool_after_fork(void) { /* the child has none of the parent's workers */
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.job, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.idle, NULL);
    pool.workers = 0;
    pool.active = 0;
    pool.busy = 0;
}

/* -- Python interface ------------------------------------------------------------------------------------ */

typedef struct {
    const char *name;
    bn_task task;
} named_task;

static const named_task tasks[] = {
    {"train_channels", task_train_channels},
    {"backward_channels", task_backward_channels},
    {"affine_channels", task_affine_channels},
    {"column_sums", task_column_sums},
    {"grad_sums", task_grad_sums},
    {"affine_rows", task_affine_rows},
    {"dx_rows", task_dx_rows},
    {"serial_inference", task_serial_inference},
    {"serial_training", task_serial_training},
    {"serial_backward", task_serial_backward},
};

static int is_task(uintptr_t address) {
    for (size_t k = 0; k < sizeof(tasks) / sizeof(tasks[0]); ++k) {
        if ((uintptr_t)tasks[k].task == address) {
            return 1;
        }
    }
    return 0;
}

enum { MAX_ARRAYS = 16, MAX_SCALARS = 8 };

/* run(task, count, arrays, ints, reals, threads_or_runner): data = the arrays' addresses, then an int64 array of
 * ints and a float64 array of reals. threads_or_runner: an int runs the tasks on this file's pool with that many
 * threads (GIL released); else a callable runner(task, count, data address), e.g. onnxruntime's parallel_for. */
static PyObject *py_run(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long address;
    Py_ssize_t count;
    PyObject *arrays, *ints, *reals, *how;
    if (!PyArg_ParseTuple(args, "KnO!O!O!O", &address, &count, &PyTuple_Type, &arrays, &PyTuple_Type, &ints,
                          &PyTuple_Type, &reals, &how)) {
        return NULL;
    }
    if (!is_task((uintptr_t)address)) {
        PyErr_SetString(PyExc_ValueError, "not a task of this module");
        return NULL;
    }
    Py_ssize_t n_arrays = PyTuple_GET_SIZE(arrays), n_ints = PyTuple_GET_SIZE(ints), n_reals = PyTuple_GET_SIZE(reals);
    if (n_arrays > MAX_ARRAYS || n_ints > MAX_SCALARS || n_reals > MAX_SCALARS || count < 0) {
        PyErr_SetString(PyExc_ValueError, "too many arrays or scalars");
        return NULL;
    }
    int64_t int_values[MAX_SCALARS];
    double real_values[MAX_SCALARS];
    for (Py_ssize_t k = 0; k < n_ints; ++k) {
        int_values[k] = PyLong_AsLongLong(PyTuple_GET_ITEM(ints, k));
    }
    for (Py_ssize_t k = 0; k < n_reals; ++k) {
        real_values[k] = PyFloat_AsDouble(PyTuple_GET_ITEM(reals, k));
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer views[MAX_ARRAYS];
    void *data[MAX_ARRAYS + 2];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    for (; held < n_arrays; ++held) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(arrays, held), &views[held], PyBUF_C_CONTIGUOUS) != 0) {
            goto done;
        }
        data[held] = views[held].buf;
    }
    data[n_arrays] = int_values;
    data[n_arrays + 1] = real_values;
    atomic_store(&scratch_failed, 0);
    if (PyLong_Check(how)) {
        int threads = (int)PyLong_AsLong(how);
        if (threads == -1 && PyErr_Occurred()) {
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS pool_run((bn_task)(uintptr_t)address, data, (size_t)count, threads);
        Py_END_ALLOW_THREADS
    } else {
        PyObject *called = PyObject_CallFunction(how, "KnK", address, count, (unsigned long long)(uintptr_t)data);
        if (called == NULL) {
            goto done;
        }
        Py_DECREF(called);
    }
    if (atomic_exchange(&scratch_failed, 0)) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t k = 0; k < held; ++k) {
        PyBuffer_Release(&views[k]);
    }
    return result;
}

static PyObject *py_addresses(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *table = PyDict_New();
    if (table == NULL) {
        return NULL;
    }
    for (size_t k = 0; k < sizeof(tasks) / sizeof(tasks[0]); ++k) {
        PyObject *value = PyLong_FromUnsignedLongLong((uintptr_t)tasks[k].task);
        if (value == NULL || PyDict_SetItemString(table, tasks[k].name, value) != 0) {
            Py_XDECREF(value);
            Py_DECREF(table);
            return NULL;
        }
        Py_DECREF(value);
    }
    return table;
}

static PyObject *py_entries(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("{sKsKsK}", "forward_inference", (unsigned long long)(uintptr_t)entry_inference,
                         "forward_training", (unsigned long long)(uintptr_t)entry_training, "backward",
                         (unsigned long long)(uintptr_t)entry_backward);
}

static PyObject *py_reductions(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(reductions_name);
}

static PyMethodDef methods[] = {
    {"reductions", py_reductions, METH_NOARGS, "The channel reductions picked for this process: avx2 or portable."},
    {"run", py_run, METH_VARARGS, "run(task, count, arrays, ints, reals, threads_or_runner): run count tasks."},
    {"addresses", py_addresses, METH_NOARGS, "{name: address} of the tasks."},
    {"entries", py_entries, METH_NOARGS, "{kernel: address} of the fast path's entry functions."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpukernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpukernels(void) {
    static int registered = 0;
    if (!registered) {
        pick_reductions();
        pthread_atfork(NULL, NULL, pool_after_fork);
        registered = 1;
    }
    return PyModule_Create(&module);
}
