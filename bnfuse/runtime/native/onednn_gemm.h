/* Internal to the convolution-gradient core: the gradients of a convolution on a small map as one matrix product
 * each (onednn_gemm.c). */
#ifndef BNFUSE_ONEDNN_GEMM_H
#define BNFUSE_ONEDNN_GEMM_H

#include "onednn_conv.h"

/* Whether the weight gradient of this (checked) geometry runs as im2col + oneDNN's sgemm: 2-D, one group, a kernel
 * larger than 1x1, and at most GEMM_MAX_PIXELS output positions over the batch (deep layers at small batches). */
int bnfuse_gemm_weight_grad_applies(const bnfuse_conv_geometry *geometry);

/* Whether the input gradient of this (checked) geometry runs as oneDNN's sgemm + col2im: 2-D, one group, a kernel
 * larger than 1x1, at most GEMM_MAX_INPUT_PIXELS output positions over the batch and GEMM_MAX_INPUT_MAP per image. */
int bnfuse_gemm_input_grad_applies(const bnfuse_conv_geometry *geometry);

/* Whether the weight (input_grad 0) or input gradient of this geometry runs on the product. */
int bnfuse_gemm_applies(const bnfuse_conv_geometry *geometry, int input_grad);

/* The scratch bytes either gradient needs for this geometry (X or dX unrolled, and dY transposed). */
size_t bnfuse_gemm_scratch(const bnfuse_conv_geometry *geometry);

/* dW of such a geometry (overwritten), with `scratch` of bnfuse_gemm_scratch bytes (64-byte aligned);
 * ranges of output channels on the host's pool when it has threads > 1. BNFUSE_ONEDNN_OK, or BNFUSE_ONEDNN_ERROR
 * when the parallel-for or oneDNN's sgemm failed. oneDNN must be loaded. */
int bnfuse_gemm_weight_grad(const bnfuse_conv_geometry *geometry, const float *x, const float *dy, float *dw,
                            void *scratch, const bnfuse_thread_pool *pool);

/* dX (overwritten) of such a geometry from dY and W, likewise; ranges of input channels on the host's pool. */
int bnfuse_gemm_input_grad(const bnfuse_conv_geometry *geometry, const float *dy, const float *w, float *dx,
                           void *scratch, const bnfuse_thread_pool *pool);

/* The weight gradient (first X, second dY) or the input gradient (first dY, second W), as above. */
int bnfuse_gemm_gradient(const bnfuse_conv_geometry *geometry, int input_grad, const float *first,
                         const float *second, float *result, void *scratch, const bnfuse_thread_pool *pool);

#endif
