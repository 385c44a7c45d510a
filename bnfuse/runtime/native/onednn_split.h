/* Internal to the oneDNN convolution-gradient core: the sub-convolution of one chunk (onednn_split.c). */
#ifndef BNFUSE_ONEDNN_SPLIT_H
#define BNFUSE_ONEDNN_SPLIT_H

#include "onednn_dnnl.h"

/* The plan spec of the chunk [start, start + extent) along `axis` (BNFUSE_ONEDNN_SPLIT_*) of a geometry, and the
 * element offsets of its three operands (in the plan's order) in the whole tensors. */
void bnfuse_chunk_spec(const bnfuse_conv_geometry *geometry, int kind, int axis, int64_t start, int64_t extent,
                       int threads, plan_spec_t *spec, size_t offsets[3]);

#endif
