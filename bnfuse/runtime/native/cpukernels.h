/* Declarations shared by the C files of bnfuse.runtime._cpukernels (see cpukernels.c). */
#ifndef BNFUSE_CPUKERNELS_H
#define BNFUSE_CPUKERNELS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define BN_LOOP __attribute__((noinline, target_clones("avx512f", "avx2", "default")))
#else
#define BN_LOOP __attribute__((noinline))
#endif

typedef void (*bn_task)(void **data, size_t index);

enum { MIN_INNER = 32, ROW_BLOCK_ELEMENTS = 16384, MAX_CHUNKS = 64 }; /* cpu.py's _MIN_INNER, ... */
enum { UNBIASED = 1, FIX_GAMMA = 2, GLOBAL_STATS = 4, RELU = 8 };      /* cpu.py's flags */

typedef struct {
    int64_t outer, channels, inner;
} dims;

/* cpureduce.c: the channel reductions (picked once per process) and the row-chunk column sums */
typedef double (*channel_sum_fn)(const float *x, int64_t outer, int64_t stride, int64_t inner);
typedef double (*channel_sqdev_fn)(const float *x, int64_t outer, int64_t stride, int64_t inner, double mu);
typedef void (*channel_grad_sums_fn)(const float *dy, const float *x, const float *y, int relu, int64_t outer,
                                     int64_t stride, int64_t inner, double mu, double *sum_dy, double *sum_dy_xc);
extern channel_sum_fn channel_sum;
extern channel_sqdev_fn channel_sqdev;
extern channel_grad_sums_fn channel_grad_sums;
extern const char *reductions_name;
void pick_reductions(void);
void rows_sums(const float *x, int64_t width, int64_t r0, int64_t r1, const double *center, int squared,
               double *acc);
void rows_grad_sums(const float *dy, const float *x, const float *y, int relu, int64_t width, int64_t r0, int64_t r1,
                    const double *center, double *acc_dy, double *acc_xc);
double pairwise_sum(const double *a, int64_t n);

/* cpuloops.c: elementwise rows, per-channel bodies, the parallel loops' tasks */
void affine_row(const float *x, float *y, int64_t n, double m, double a, double b, double beta, int relu);
void affine_wide(const float *x, float *y, int64_t n, const double *m, const double *a, const double *b, double beta,
                 int relu);
void dx_row(const float *dy, const float *x, const float *y, float *dx, int64_t n, double m, double a, double b,
            double e, double beta, int relu);
void dx_wide(const float *dy, const float *x, const float *y, float *dx, int64_t n, const double *m, const double *a,
             const double *b, const double *e, double beta, int relu);
void dx_factors(double gamma, double r, double s_dy, double s_xc, int64_t count, int global_stats, double *k_dy,
                double *k_xc, double *k_add);
int64_t row_chunks(int64_t rows, int64_t width);
void task_train_channels(void **data, size_t index);
void task_backward_channels(void **data, size_t index);
void task_affine_channels(void **data, size_t index);
void task_column_sums(void **data, size_t index);
void task_grad_sums(void **data, size_t index);
void task_affine_rows(void **data, size_t index);
void task_dx_rows(void **data, size_t index);

/* cpuserial.c: the serial kernels (tasks of count 1) */
extern atomic_int scratch_failed; /* a serial kernel could not allocate its scratch: run() raises MemoryError */
void task_serial_inference(void **data, size_t index);
void task_serial_training(void **data, size_t index);
void task_serial_backward(void **data, size_t index);
/* the serial kernels themselves (float64 parameters; 0, or -1 when scratch memory ran out): the native ops' path */
int serial_inference(const float *x, dims d, const double *scale, const double *bias, const double *mean,
                     const double *var, double eps, int fix_gamma, double alpha, double beta, float *y);
int serial_training(const float *x, dims d, const double *scale, const double *bias, const double *rm,
                    const double *rv, double eps, double weight, int64_t flags, double alpha, double beta, float *y,
                    double *new_mean, double *new_var, double *saved_mean, double *saved_inv_std, double *batch_var);
int serial_backward(const float *dy, const float *x, dims d, const double *scale, const double *saved_mean,
                    const double *saved_inv_std, int64_t flags, double alpha, double beta, const float *y, float *dx,
                    double *dscale, double *dbias);

#endif
