/* What the native ops share: see common.h. */
#include "common.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

ort_status bn_status(int code, const char *format, ...) {
    char message[1024];
    va_list args;
    va_start(args, format);
    vsnprintf(message, sizeof message, format, args);
    va_end(args);
    return ort.CreateStatus(code, message);
}

void bn_format_real(double value, char *out, size_t size) {
    if (isnan(value)) {
        snprintf(out, size, "nan");
        return;
    }
    if (isinf(value)) {
        snprintf(out, size, value > 0 ? "inf" : "-inf");
        return;
    }
    for (int digits = 1; digits <= 17; ++digits) {
        snprintf(out, size, "%.*g", digits, value);
        if (strtod(out, NULL) == value) {
            break;
        }
    }
    if (strpbrk(out, ".e") == NULL && strlen(out) + 3 <= size) {
        strcat(out, ".0");
    }
}

void bn_format_shape(const bn_shape *shape, char *out, size_t size) {
    size_t used = (size_t)snprintf(out, size, "(");
    for (size_t i = 0; i < shape->rank && used < size; ++i) {
        used += (size_t)snprintf(out + used, size - used, i ? ", %lld" : "%lld", (long long)shape->dims[i]);
    }
    if (used < size) {
        snprintf(out + used, size - used, shape->rank == 1 ? ",)" : ")");
    }
}

void bn_read_node_name(const void *info, bn_label *label) {
    size_t size = sizeof label->node;
    label->node[0] = '\0';
    ort_status status = ort.KernelInfo_GetNodeName(info, label->node, &size);
    if (status != NULL) { /* too long for the buffer, or none: the name only labels messages */
        ort.ReleaseStatus(status);
        label->node[0] = '\0';
    }
}

/* What attribute ``name`` holds, asking for each scalar type in turn (for messages). */
static const char *attribute_kind(const void *info, const char *name) {
    int64_t integer = 0;
    float real = 0.0f;
    size_t size = 0;
    ort_status status = ort.KernelInfoGetAttribute_int64(info, name, &integer);
    if (status == NULL) {
        return "an int";
    }
    ort.ReleaseStatus(status);
    if ((status = ort.KernelInfoGetAttribute_float(info, name, &real)) == NULL) {
        return "a float";
    }
    ort.ReleaseStatus(status);
    if ((status = ort.KernelInfoGetAttribute_string(info, name, NULL, &size)) == NULL) {
        return "a string";
    }
    ort.ReleaseStatus(status);
    return "another type (a list, tensor or graph)";
}

/* NULL with *present set when the look-up succeeded (1) or the node has no such attribute (0); else the error. */
static ort_status attribute_present(ort_status status, const void *info, const bn_label *label, const char *name,
                                    const char *expected, int *present) {
    *present = status == NULL;
    if (status == NULL) {
        return NULL;
    }
    char message[512];
    snprintf(message, sizeof message, "%s", ort.GetErrorMessage(status));
    ort.ReleaseStatus(status);
    if (strncmp(message, "No attribute with name", 22) == 0 ||
        strncmp(message, "No attribute with this name is defined", 38) == 0) {
        return NULL;
    }
    return bn_status(ORT_INVALID_ARGUMENT, "%s: attribute %s must be %s, got %s (node '%s'; onnxruntime: %s)",
                     label->op, name, expected, attribute_kind(info, name), label->node, message);
}

ort_status bn_attr_float(const void *info, const bn_label *label, const char *name, float fallback, float *out) {
    int present = 0;
    BN_TRY(attribute_present(ort.KernelInfoGetAttribute_float(info, name, out), info, label, name, "a float",
                             &present));
    if (!present) {
        *out = fallback;
    }
    return NULL;
}

ort_status bn_attr_int(const void *info, const bn_label *label, const char *name, int64_t fallback, int64_t *out) {
    int present = 0;
    BN_TRY(attribute_present(ort.KernelInfoGetAttribute_int64(info, name, out), info, label, name, "an int",
                             &present));
    if (!present) {
        *out = fallback;
    }
    return NULL;
}

ort_status bn_attr_string(const void *info, const bn_label *label, const char *name, const char *fallback, char *out,
                          size_t size) {
    size_t needed = 0;
    int present = 0;
    BN_TRY(attribute_present(ort.KernelInfoGetAttribute_string(info, name, NULL, &needed), info, label, name,
                             "a string", &present));
    if (!present) {
        snprintf(out, size, "%s", fallback);
        return NULL;
    }
    if (needed > size) { /* longer than any valid value: keep a prefix, which no valid value matches */
        char *buffer = malloc(needed);
        if (buffer == NULL) {
            return bn_status(ORT_FAIL, "%s: out of memory", label->op);
        }
        ort_status status = ort.KernelInfoGetAttribute_string(info, name, buffer, &needed);
        snprintf(out, size, "%s", status == NULL ? buffer : "");
        free(buffer);
        return status;
    }
    return ort.KernelInfoGetAttribute_string(info, name, out, &needed);
}

ort_status bn_attr_floats(const void *info, const bn_label *label, const char *name, float **out, size_t *count) {
    int present = 0;
    *out = NULL;
    *count = 0;
    BN_TRY(attribute_present(ort.KernelInfoGetAttributeArray_float(info, name, NULL, count), info, label, name,
                             "a list of floats", &present));
    if (!present) {
        *count = 0;
        return NULL;
    }
    *out = malloc((*count ? *count : 1) * sizeof(float));
    if (*out == NULL) {
        return bn_status(ORT_FAIL, "%s: out of memory", label->op);
    }
    return ort.KernelInfoGetAttributeArray_float(info, name, *out, count);
}

ort_status bn_attr_ints(const void *info, const bn_label *label, const char *name, int64_t *out, size_t capacity,
                        size_t *count) {
    int present = 0;
    *count = 0;
    BN_TRY(attribute_present(ort.KernelInfoGetAttributeArray_int64(info, name, NULL, count), info, label, name,
                             "a list of ints", &present));
    if (!present) {
        *count = 0;
        return NULL;
    }
    if (*count > capacity) {
        return bn_status(ORT_INVALID_ARGUMENT, "%s: attribute %s has %zu values, at most %zu allowed (node '%s')",
                         label->op, name, *count, capacity, label->node);
    }
    return ort.KernelInfoGetAttributeArray_int64(info, name, out, count);
}

ort_status bn_read_input(void *context, size_t index, void **data, int *type, bn_shape *shape) {
    const void *value = NULL;
    void *info = NULL;
    *data = NULL;
    shape->rank = 0;
    BN_TRY(ort.KernelContext_GetInput(context, index, &value));
    if (value == NULL) {
        return NULL;
    }
    BN_TRY(ort.GetTensorTypeAndShape(value, &info));
    ort_status status = ort.GetTensorElementType(info, type);
    if (status == NULL) {
        status = ort.GetDimensionsCount(info, &shape->rank);
    }
    if (status == NULL && shape->rank > BN_MAX_RANK) {
        status = bn_status(ORT_RUNTIME_EXCEPTION, "bnfuse's ops take tensors of at most 8 dimensions (input %zu has %zu)",
                           index, shape->rank);
    } else if (status == NULL) {
        status = ort.GetDimensions(info, shape->dims, shape->rank);
    }
    ort.ReleaseTensorTypeAndShapeInfo(info);
    if (status == NULL) {
        status = ort.GetTensorMutableData((void *)value, data);
    }
    return status;
}

ort_status bn_make_output(void *context, size_t index, const bn_shape *shape, void **data) {
    void *value = NULL;
    *data = NULL;
    BN_TRY(ort.KernelContext_GetOutput(context, index, shape->dims, shape->rank, &value));
    return value == NULL ? NULL : ort.GetTensorMutableData(value, data);
}

int64_t bn_element_count(const bn_shape *shape) {
    int64_t count = 1;
    for (size_t i = 0; i < shape->rank; ++i) {
        count *= shape->dims[i];
    }
    return count;
}

int bn_same_shape(const bn_shape *a, const bn_shape *b) {
    if (a->rank != b->rank) {
        return 0;
    }
    for (size_t i = 0; i < a->rank; ++i) {
        if (a->dims[i] != b->dims[i]) {
            return 0;
        }
    }
    return 1;
}

/* -- float16 ------------------------------------------------------------------------------------------------ */

float bn_half_to_float(uint16_t half) {
    const uint32_t sign = (uint32_t)(half & 0x8000) << 16;
    uint32_t exponent = (half >> 10) & 0x1f, mantissa = half & 0x3ff, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000 | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            --exponent;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Round ``m`` (a mantissa with its implicit bit) right by ``shift`` bits to nearest even. */
static uint64_t round_shift(uint64_t m, int shift) {
    if (shift >= 64) {
        return 0;
    }
    const uint64_t kept = m >> shift, rest = m & ((UINT64_C(1) << shift) - 1), half = UINT64_C(1) << (shift - 1);
    return kept + (rest > half || (rest == half && (kept & 1)));
}

uint16_t bn_double_to_half(double value) {
    uint64_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 48) & 0x8000);
    const uint64_t magnitude = bits & UINT64_C(0x7fffffffffffffff);
    const int exponent = (int)(magnitude >> 52);
    const uint64_t mantissa = magnitude & UINT64_C(0xfffffffffffff);
    if (exponent == 0x7ff) { /* Inf, NaN (kept quiet) */
        return sign | 0x7c00 | (mantissa ? (uint16_t)(0x200 | ((mantissa >> 42) & 0x3ff)) : 0);
    }
    if (magnitude >= UINT64_C(0x40effe0000000000)) { /* >= 65520: rounds past the largest half */
        return sign | 0x7c00;
    }
    if (exponent >= 1009) { /* a normal half; a carry out of the mantissa bumps the exponent, as it should */
        return sign | (uint16_t)((((uint64_t)(exponent - 1008) << 52 | mantissa) >> 42) +
                                 ((mantissa & ((UINT64_C(1) << 42) - 1)) > (UINT64_C(1) << 41) ||
                                  ((mantissa & ((UINT64_C(1) << 42) - 1)) == (UINT64_C(1) << 41) &&
                                   ((mantissa >> 42) & 1))));
    }
    if (exponent == 0) {
        return sign; /* double subnormals are far below half's smallest */
    }
    return sign | (uint16_t)round_shift(mantissa | (UINT64_C(1) << 52), 1051 - exponent);
}

uint16_t bn_float_to_half(float value) {
    /* every float is a double exactly, and rounding it once to half is what NumPy's float32 -> float16 does */
    return bn_double_to_half((double)value);
}

/* -- the intra-op pool ---------------------------------------------------------------------------------------- */

ort_status bn_run_tasks(void *context, ort_parallel_fn task, void *data, size_t count) {
    if (count > 1 && ort.KernelContext_ParallelFor != NULL && context != NULL) {
        return ort.KernelContext_ParallelFor(context, task, count, 0, data);
    }
    for (size_t index = 0; index < count; ++index) {
        task(data, index);
    }
    return NULL;
}
