/* Internal to the convolution-gradient core: direct loops for geometries oneDNN runs slowly (onednn_direct.c). */
#ifndef BNFUSE_ONEDNN_DIRECT_H
#define BNFUSE_ONEDNN_DIRECT_H

#include "onednn_conv.h"

/* Whether the weight gradient of this (checked) geometry runs on the direct loop: 2-D, plain X, grouped with one
 * input channel per group (depthwise, any channel multiplier). */
int bnfuse_direct_weight_grad_applies(const bnfuse_conv_geometry *geometry);

/* dW of such a geometry (overwritten), in ranges of output channels on the host's pool when it has threads > 1.
 * BNFUSE_ONEDNN_OK, or BNFUSE_ONEDNN_ERROR when the parallel-for or a scratch allocation failed. */
int bnfuse_direct_weight_grad(const bnfuse_conv_geometry *geometry, const float *x, const float *dy, float *dw,
                              const bnfuse_thread_pool *pool);

#endif
