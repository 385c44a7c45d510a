/* bnfuse.runtime._cpukernels, the reductions: per-channel sums (one implementation picked for the process, called
 * by every path, so the bits do not depend on the path or the thread count) and the row chunks' column sums. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpukernels.h"

/* The channel reductions: one implementation is picked for the process when the module loads (AVX-512, else AVX2,
 * else portable C) and every path calls it, so the order of every sum is fixed for the process. AVX2: four
 * accumulators of 4 float64 lanes over all of a channel's rows (per row: blocks of 16 elements, then blocks of 4 into
 * the first accumulator, the row's last inner % 4 into a scalar), then the accumulators and lanes in a fixed tree;
 * AVX-512 the same with 8 lanes (blocks of 32, then 8). Portable: an ``omp simd`` reduction (-fopenmp-simd; no OpenMP
 * runtime). They may differ in the last bits. */
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

#define BN_AVX512 __attribute__((target("avx512f"), noinline))
#define BN_AVX512_INLINE static inline __attribute__((target("avx512f"), always_inline))

BN_AVX512_INLINE __m512d load8(const float *p) { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }

/* dy where the forward's y > 0 or NaN (y <= 0 masks it). */
BN_AVX512_INLINE __m512d masked8(const float *dy, const float *y) {
    __mmask8 blocked = _mm512_cmp_pd_mask(load8(y), _mm512_setzero_pd(), _CMP_LE_OQ);
    return _mm512_maskz_mov_pd((__mmask8)~blocked, load8(dy));
}

BN_AVX512_INLINE double lanes_sum8(const __m512d *acc) {
    __m512d v = _mm512_add_pd(_mm512_add_pd(acc[0], acc[1]), _mm512_add_pd(acc[2], acc[3]));
    double lane[8];
    _mm512_storeu_pd(lane, v);
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

/* As the AVX2 loops with 8 lanes per accumulator: blocks of 32, then of 8, the last inner % 8 into a scalar. */
BN_AVX512 static double avx512_sum(const float *x, int64_t outer, int64_t stride, int64_t inner) {
    __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
    double tail = 0.0;
    const int64_t wide = inner - inner % 32, body = inner - inner % 8;
    for (int64_t o = 0; o < outer; ++o) {
        const float *row = x + o * stride;
        for (int64_t i = 0; i < wide; i += 32) {
            for (int k = 0; k < 4; ++k) {
                acc[k] = _mm512_add_pd(acc[k], load8(row + i + 8 * k));
            }
        }
        for (int64_t i = wide; i < body; i += 8) {
            acc[0] = _mm512_add_pd(acc[0], load8(row + i));
        }
        for (int64_t i = body; i < inner; ++i) {
            tail += (double)row[i];
        }
    }
    return lanes_sum8(acc) + tail;
}

BN_AVX512 static double avx512_sqdev(const float *x, int64_t outer, int64_t stride, int64_t inner, double mu) {
    __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
    const __m512d center = _mm512_set1_pd(mu);
    double tail = 0.0;
    const int64_t wide = inner - inner % 32, body = inner - inner % 8;
    for (int64_t o = 0; o < outer; ++o) {
        const float *row = x + o * stride;
        for (int64_t i = 0; i < wide; i += 32) {
            for (int k = 0; k < 4; ++k) {
                __m512d d = _mm512_sub_pd(load8(row + i + 8 * k), center);
                acc[k] = _mm512_add_pd(acc[k], _mm512_mul_pd(d, d));
            }
        }
        for (int64_t i = wide; i < body; i += 8) {
            __m512d d = _mm512_sub_pd(load8(row + i), center);
            acc[0] = _mm512_add_pd(acc[0], _mm512_mul_pd(d, d));
        }
        for (int64_t i = body; i < inner; ++i) {
            double d = (double)row[i] - mu;
            tail += d * d;
        }
    }
    return lanes_sum8(acc) + tail;
}

BN_AVX512 static void avx512_grad_sums(const float *dy, const float *x, const float *y, int relu, int64_t outer,
                                       int64_t stride, int64_t inner, double mu, double *sum_dy, double *sum_dy_xc) {
    __m512d acc_dy[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
    __m512d acc_xc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
    const __m512d center = _mm512_set1_pd(mu);
    double tail_dy = 0.0, tail_xc = 0.0;
    const int64_t wide = inner - inner % 32, body = inner - inner % 8;
    for (int64_t o = 0; o < outer; ++o) {
        const float *g_row = dy + o * stride, *x_row = x + o * stride, *y_row = y + o * stride;
        if (relu) {
            for (int64_t i = 0; i < wide; i += 32) {
                for (int k = 0; k < 4; ++k) {
                    __m512d g = masked8(g_row + i + 8 * k, y_row + i + 8 * k);
                    __m512d xc = _mm512_sub_pd(load8(x_row + i + 8 * k), center);
                    acc_dy[k] = _mm512_add_pd(acc_dy[k], g);
                    acc_xc[k] = _mm512_add_pd(acc_xc[k], _mm512_mul_pd(g, xc));
                }
            }
            for (int64_t i = wide; i < body; i += 8) {
                __m512d g = masked8(g_row + i, y_row + i);
                acc_dy[0] = _mm512_add_pd(acc_dy[0], g);
                acc_xc[0] = _mm512_add_pd(acc_xc[0], _mm512_mul_pd(g, _mm512_sub_pd(load8(x_row + i), center)));
            }
        } else {
            for (int64_t i = 0; i < wide; i += 32) {
                for (int k = 0; k < 4; ++k) {
                    __m512d g = load8(g_row + i + 8 * k);
                    __m512d xc = _mm512_sub_pd(load8(x_row + i + 8 * k), center);
                    acc_dy[k] = _mm512_add_pd(acc_dy[k], g);
                    acc_xc[k] = _mm512_add_pd(acc_xc[k], _mm512_mul_pd(g, xc));
                }
            }
            for (int64_t i = wide; i < body; i += 8) {
                __m512d g = load8(g_row + i);
                acc_dy[0] = _mm512_add_pd(acc_dy[0], g);
                acc_xc[0] = _mm512_add_pd(acc_xc[0], _mm512_mul_pd(g, _mm512_sub_pd(load8(x_row + i), center)));
            }
        }
        for (int64_t i = body; i < inner; ++i) {
            double g = relu && y_row[i] <= 0.0f ? 0.0 : (double)g_row[i];
            tail_dy += g;
            tail_xc += g * ((double)x_row[i] - mu);
        }
    }
    *sum_dy = lanes_sum8(acc_dy) + tail_dy;
    *sum_dy_xc = lanes_sum8(acc_xc) + tail_xc;
}
#endif

channel_sum_fn channel_sum = portable_sum;
channel_sqdev_fn channel_sqdev = portable_sqdev;
channel_grad_sums_fn channel_grad_sums = portable_grad_sums;

const char *reductions_name = "portable";

/* BNFUSE_CPU_REDUCTIONS=portable (or avx2) keeps the portable (or AVX2) loops: tests run each on one machine. */
void pick_reductions(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    const char *wanted = getenv("BNFUSE_CPU_REDUCTIONS");
    __builtin_cpu_init();
    const int portable = wanted != NULL && strcmp(wanted, "portable") == 0;
    const int avx2_only = wanted != NULL && strcmp(wanted, "avx2") == 0;
    if (__builtin_cpu_supports("avx512f") && !portable && !avx2_only) {
        reductions_name = "avx512";
        channel_sum = avx512_sum;
        channel_sqdev = avx512_sqdev;
        channel_grad_sums = avx512_grad_sums;
    } else if (__builtin_cpu_supports("avx2") && !portable) {
        reductions_name = "avx2";
        channel_sum = avx2_sum;
        channel_sqdev = avx2_sqdev;
        channel_grad_sums = avx2_grad_sums;
    }
#endif
}

/* acc[f] = sum over rows r0..r1 of (x - center[f]) (or its square), each column in row order. */
BN_LOOP void rows_sums(const float *x, int64_t width, int64_t r0, int64_t r1, const double *center,
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

BN_LOOP void rows_grad_sums(const float *dy, const float *x, const float *y, int relu, int64_t width,
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
double pairwise_sum(const double *a, int64_t n) {
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
