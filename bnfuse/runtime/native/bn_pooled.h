/* The BN kernels on onnxruntime's intra-op pool (bn_pooled.c), for inputs from BN_POOL_FROM_BYTES on; below, the
 * serial kernels (cpuserial.c) run on the calling thread. Parameters and per-channel outputs are float64, data
 * float32; every function returns NULL or an OrtStatus. */
#ifndef BNFUSE_BN_POOLED_H
#define BNFUSE_BN_POOLED_H

#include "common.h"
#include "cpukernels.h"

/* cpu.POOL_FROM_BYTES and POOL_ROWS_FROM_BYTES (float32 bytes of X): measured in cpu.py's docstring */
#define BN_POOL_FROM_BYTES (INT64_C(4) * 1024 * 1024)
#define BN_POOL_ROWS_FROM_BYTES (INT64_C(8) * 1024 * 1024)

ort_status bn_pooled_inference(void *context, const float *x, dims d, const double *scale, const double *bias,
                               const double *mean, const double *var, double eps, int fix_gamma, float *y);
ort_status bn_pooled_training(void *context, const float *x, dims d, const double *scale, const double *bias,
                              const double *rm, const double *rv, double eps, double weight, int64_t flags, float *y,
                              double *new_mean, double *new_var, double *saved_mean, double *saved_inv_std,
                              double *batch_var);
ort_status bn_pooled_backward(void *context, const float *dy, const float *x, dims d, const double *scale,
                              const double *saved_mean, const double *saved_inv_std, int64_t flags, const float *y,
                              float *dx, double *dscale, double *dbias);

#endif
