/* The native ops' kernels (bn_ops.c, optimizer_ops.c) as register.c's op structs call them. */
#ifndef BNFUSE_NATIVE_OPS_H
#define BNFUSE_NATIVE_OPS_H

#include "common.h"
#include "schema.h"

/* One registered op: onnxruntime's struct first (its address is the op's), then what the op is. */
typedef struct {
    bnfuse_custom_op base;
    const bn_op_schema *schema;
    int code; /* BN_OP_* */
    int data_type, param_type;
    const char *provider;
} bn_native_op;

ort_status bn_create(const bn_native_op *op, const void *info, void **kernel);
ort_status bn_compute(void *kernel, void *context);
ort_status step_create(const bn_native_op *op, const void *info, void **kernel);
ort_status step_compute(void *kernel, void *context);
void step_destroy(void *kernel);
ort_status conv_create(const bn_native_op *op, const void *info, void **kernel);
ort_status conv_compute(void *kernel, void *context);

#endif
