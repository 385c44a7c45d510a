/* What the native ops share (common.c): error statuses naming the op, attribute reading, tensor reading, float16
 * conversion and running tasks on onnxruntime's intra-op pool. */
#ifndef BNFUSE_NATIVE_COMMON_H
#define BNFUSE_NATIVE_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "ort_api.h"

enum { BN_MAX_RANK = 8, BN_NAME = 128 };

typedef struct {
    int64_t dims[BN_MAX_RANK];
    size_t rank;
} bn_shape;

/* What an op's kernel knows of itself for its messages: the op and the node. */
typedef struct {
    const char *op;
    char node[BN_NAME];
} bn_label;

#define BN_TRY(call)                \
    do {                            \
        ort_status status_ = (call); \
        if (status_ != NULL) {      \
            return status_;         \
        }                           \
    } while (0)

/* A status with code ``code`` and the printf-style message (no op name added). */
ort_status bn_status(int code, const char *format, ...) __attribute__((format(printf, 2, 3)));

/* Python's repr of a float (shortest round trip, ".0" for an integer), for messages matching the Python path's. */
void bn_format_real(double value, char *out, size_t size);

/* A shape as Python prints a tuple: "(3,)", "(2, 3)". */
void bn_format_shape(const bn_shape *shape, char *out, size_t size);

/* The node's name into label->node ("" when onnxruntime has none). */
void bn_read_node_name(const void *info, bn_label *label);

/* Attributes: absent -> the default; another type -> an error naming op, attribute, node and both types. */
ort_status bn_attr_float(const void *info, const bn_label *label, const char *name, float fallback, float *out);
ort_status bn_attr_int(const void *info, const bn_label *label, const char *name, int64_t fallback, int64_t *out);
ort_status bn_attr_string(const void *info, const bn_label *label, const char *name, const char *fallback, char *out,
                          size_t size);
/* A list of floats into a malloc'ed array (*count 0 and *out NULL when absent). */
ort_status bn_attr_floats(const void *info, const bn_label *label, const char *name, float **out, size_t *count);

/* A list of ints into out[capacity] (*count 0 when absent; more than capacity values: an error). */
ort_status bn_attr_ints(const void *info, const bn_label *label, const char *name, int64_t *out, size_t capacity,
                        size_t *count);

/* Input ``index``: *data NULL when absent; else its element type, shape (rank <= 8, or an error) and data. */
ort_status bn_read_input(void *context, size_t index, void **data, int *type, bn_shape *shape);

/* Output ``index`` of ``shape``; *data NULL when the node does not use it. */
ort_status bn_make_output(void *context, size_t index, const bn_shape *shape, void **data);

int64_t bn_element_count(const bn_shape *shape);
int bn_same_shape(const bn_shape *a, const bn_shape *b);

/* IEEE half <-> single / double, round to nearest even (NumPy's astype). */
float bn_half_to_float(uint16_t half);
uint16_t bn_float_to_half(float value);
uint16_t bn_double_to_half(double value);

/* Run tasks 0..count-1 of ``task`` over ``data`` on the session's intra-op pool (on the calling thread when there is
 * one task or the runtime has no KernelContext_ParallelFor). */
ort_status bn_run_tasks(void *context, ort_parallel_fn task, void *data, size_t count);

#endif
