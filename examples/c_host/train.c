/* Trains a bnfuse training graph from C: onnxruntime's C API, bnfuse's custom-op library, no Python.
 *
 *   train_c TRAIN.onnx DATA.npz [--library LIBRARY] [--epochs N] [--batch-size B] [--lr LR] [--threads T] [--steps]
 *
 * TRAIN.onnx is a graph from `bnfuse train-graph`; LIBRARY is the file `bnfuse library-path` prints (or
 * BNFUSE_LIBRARY; a graph built with --portable needs none); DATA.npz
 * (numpy.savez) holds each data input by name (or `x` for a single one) and the labels (the graph's target
 * name, `labels` or `y`), samples along the first axis. Batches run in the file's order (no shuffling); the last
 * one may be smaller where the graph's batch is dynamic. Each epoch prints the mean loss over its samples and the
 * accuracy of the step's own logits (training mode, before the update); --steps prints every step's loss.
 *
 * The contract this follows is docs/hosts.md: the state is fed back output -> input after every step, and the
 * first step reads the initial state from the graph's initializers (nothing fed).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "npz.h"
#include "ort_table.h"
#include "spec.h"

static const ort_function *api;

#define CHECK(call)                                                                                                    \
    do {                                                                                                               \
        OrtStatus *status_ = (call);                                                                                   \
        if (status_) {                                                                                                 \
            fprintf(stderr, "train_c: onnxruntime: %s\n",                                                              \
                    ORT(api, GetErrorMessage, const char *(*)(const OrtStatus *))(status_));                         \
            ORT(api, ReleaseStatus, void (*)(OrtStatus *))(status_);                                                  \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)

static void die(const char *message) {
    fprintf(stderr, "train_c: %s\n", message);
    exit(2);
}

typedef struct {
    const char *model, *data, *library;
    int epochs, batch, threads, print_steps;
    float lr;
} options;

static options parse_arguments(int argc, char **argv) {
    options o = {NULL, NULL, getenv("BNFUSE_LIBRARY"), 1, 32, 1, 0, 0.01f};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has_value = i + 1 < argc;
        if (strcmp(a, "--library") == 0 && has_value) {
            o.library = argv[++i];
        } else if (strcmp(a, "--epochs") == 0 && has_value) {
            o.epochs = atoi(argv[++i]);
        } else if (strcmp(a, "--batch-size") == 0 && has_value) {
            o.batch = atoi(argv[++i]);
        } else if (strcmp(a, "--lr") == 0 && has_value) {
            o.lr = strtof(argv[++i], NULL);
        } else if (strcmp(a, "--threads") == 0 && has_value) {
            o.threads = atoi(argv[++i]);
        } else if (strcmp(a, "--steps") == 0) {
            o.print_steps = 1;
        } else if (a[0] == '-' || (o.model && o.data)) {
            die("usage: train_c TRAIN.onnx DATA.npz [--library LIBRARY] [--epochs N] [--batch-size B] [--lr LR] "
                "[--threads T] [--steps]");
        } else if (!o.model) {
            o.model = a;
        } else {
            o.data = a;
        }
    }
    if (!o.model || !o.data) {
        die("need TRAIN.onnx and DATA.npz (and --library: the file `bnfuse library-path` prints, or BNFUSE_LIBRARY)");
    }
    if (o.epochs < 1 || o.batch < 1 || o.threads < 1) {
        die("--epochs, --batch-size and --threads must be >= 1");
    }
    return o;
}

/* The element type and first dimension (-1 when dynamic) of session input `name`; -1 type when absent. */
static int input_type(OrtSession *session, const char *name, int64_t *first_dim) {
    size_t count = 0;
    OrtAllocator *allocator;
    CHECK(ORT(api, GetAllocatorWithDefaultOptions, OrtStatus * (*)(OrtAllocator **))(&allocator));
    CHECK(ORT(api, SessionGetInputCount, OrtStatus * (*)(const OrtSession *, size_t *))(session, &count));
    for (size_t i = 0; i < count; i++) {
        char *input_name;
        CHECK(ORT(api, SessionGetInputName, OrtStatus * (*)(const OrtSession *, size_t, OrtAllocator *, char **))(
            session, i, allocator, &input_name));
        int same = strcmp(input_name, name) == 0;
        CHECK(ORT(api, AllocatorFree, OrtStatus * (*)(OrtAllocator *, void *))(allocator, input_name));
        if (!same) {
            continue;
        }
        OrtTypeInfo *type_info;
        const OrtTensorTypeAndShapeInfo *tensor_info;
        int type = 0;
        size_t rank = 0;
        int64_t dims[NPZ_MAX_RANK] = {-1};
        CHECK(ORT(api, SessionGetInputTypeInfo, OrtStatus * (*)(const OrtSession *, size_t, OrtTypeInfo **))(
            session, i, &type_info));
        CHECK(ORT(api, CastTypeInfoToTensorInfo,
                  OrtStatus * (*)(const OrtTypeInfo *, const OrtTensorTypeAndShapeInfo **))(type_info, &tensor_info));
        CHECK(ORT(api, GetTensorElementType, OrtStatus * (*)(const OrtTensorTypeAndShapeInfo *, int *))(tensor_info,
                                                                                                        &type));
        CHECK(ORT(api, GetDimensionsCount, OrtStatus * (*)(const OrtTensorTypeAndShapeInfo *, size_t *))(tensor_info,
                                                                                                         &rank));
        if (rank > 0 && rank <= NPZ_MAX_RANK) {
            CHECK(ORT(api, GetDimensions, OrtStatus * (*)(const OrtTensorTypeAndShapeInfo *, int64_t *, size_t))(
                tensor_info, dims, rank));
        }
        ORT(api, ReleaseTypeInfo, void (*)(OrtTypeInfo *))(type_info);
        *first_dim = rank > 0 && dims[0] > 0 ? dims[0] : -1;
        return type;
    }
    return -1;
}

/* The array for graph input `name`: by its name, or one of the alternatives (NULL-terminated). */
static npz_array *find_array(npz_archive *archive, const char *name, const char *const *alternatives) {
    npz_array *array = npz_find(archive, name);
    for (; !array && alternatives && *alternatives; alternatives++) {
        array = npz_find(archive, *alternatives);
    }
    if (!array) {
        fprintf(stderr, "train_c: the data file has no array for input '%s'\n", name);
        exit(2);
    }
    return array;
}

/* `array` as `type` (float32 or int64), converted in place once. */
static void convert(npz_array *array, int type) {
    int want_size = type == ORT_TENSOR_FLOAT ? 4 : 8;
    char want_kind = type == ORT_TENSOR_FLOAT ? 'f' : 'i';
    if (array->kind == want_kind && array->item_size == want_size) {
        return;
    }
    void *out = aligned_alloc(64, ((size_t)array->count * (size_t)want_size + 63) / 64 * 64 + 64);
    if (!out) {
        die("out of memory");
    }
    for (int64_t i = 0; i < array->count; i++) {
        const char *at = (const char *)array->data + i * array->item_size;
        double value = 0;
        if (array->kind == 'f') {
            value = array->item_size == 8 ? *(const double *)at : *(const float *)at;
        } else if (array->item_size == 8) {
            value = (double)*(const int64_t *)at;
        } else if (array->item_size == 4) {
            value = array->kind == 'u' ? (double)*(const uint32_t *)at : (double)*(const int32_t *)at;
        } else if (array->item_size == 2) {
            value = array->kind == 'u' ? *(const uint16_t *)at : *(const int16_t *)at;
        } else {
            value = array->kind == 'i' ? *(const int8_t *)at : *(const uint8_t *)at;
        }
        if (type == ORT_TENSOR_FLOAT) {
            ((float *)out)[i] = (float)value;
        } else {
            ((int64_t *)out)[i] = (int64_t)value;
        }
    }
    free(array->data);
    array->data = out;
    array->kind = want_kind;
    array->item_size = want_size;
}

/* A tensor over samples [start, start + count) of `array`: no copy. */
static OrtValue *slice(const OrtMemoryInfo *memory, npz_array *array, int64_t start, int64_t count, int type) {
    int64_t shape[NPZ_MAX_RANK];
    int64_t per_sample = 1;
    shape[0] = count;
    for (int d = 1; d < array->rank; d++) {
        shape[d] = array->shape[d];
        per_sample *= array->shape[d];
    }
    OrtValue *value;
    char *data = (char *)array->data + start * per_sample * array->item_size;
    CHECK(ORT(api, CreateTensorWithDataAsOrtValue,
              OrtStatus * (*)(const OrtMemoryInfo *, void *, size_t, const int64_t *, size_t, int, OrtValue **))(
        memory, data, (size_t)(count * per_sample * array->item_size), shape, (size_t)array->rank, type, &value));
    return value;
}

/* Correct predictions in a [count, classes] float32 logits tensor against int64 labels. */
static int64_t correct(OrtValue *logits, const int64_t *labels, int64_t count) {
    OrtTensorTypeAndShapeInfo *info;
    size_t rank = 0;
    int64_t dims[2] = {0, 0};
    float *values;
    CHECK(ORT(api, GetTensorTypeAndShape, OrtStatus * (*)(const OrtValue *, OrtTensorTypeAndShapeInfo **))(logits,
                                                                                                           &info));
    CHECK(ORT(api, GetDimensionsCount, OrtStatus * (*)(const OrtTensorTypeAndShapeInfo *, size_t *))(info, &rank));
    if (rank == 2) {
        CHECK(ORT(api, GetDimensions, OrtStatus * (*)(const OrtTensorTypeAndShapeInfo *, int64_t *, size_t))(info, dims,
                                                                                                              2));
    }
    ORT(api, ReleaseTensorTypeAndShapeInfo, void (*)(OrtTensorTypeAndShapeInfo *))(info);
    if (rank != 2 || dims[0] != count) {
        return -1; /* not class scores */
    }
    CHECK(ORT(api, GetTensorMutableData, OrtStatus * (*)(OrtValue *, void **))(logits, (void **)&values));
    int64_t hits = 0;
    for (int64_t i = 0; i < count; i++) {
        int64_t best = 0;
        for (int64_t c = 1; c < dims[1]; c++) {
            best = values[i * dims[1] + c] > values[i * dims[1] + best] ? c : best;
        }
        hits += best == labels[i];
    }
    return hits;
}

int main(int argc, char **argv) {
    options o = parse_arguments(argc, argv);
    api = OrtGetApiBase()->GetApi(ORT_API_VERSION_USED);
    if (!api) {
        die("this onnxruntime is older than 1.16");
    }
    OrtEnv *env;
    OrtSessionOptions *session_options;
    OrtSession *session;
    CHECK(ORT(api, CreateEnv, OrtStatus * (*)(int, const char *, OrtEnv **))(ORT_LOGGING_ERROR, "train_c", &env));
    CHECK(ORT(api, CreateSessionOptions, OrtStatus * (*)(OrtSessionOptions **))(&session_options));
    CHECK(ORT(api, SetIntraOpNumThreads, OrtStatus * (*)(OrtSessionOptions *, int))(session_options, o.threads));
    CHECK(ORT(api, SetInterOpNumThreads, OrtStatus * (*)(OrtSessionOptions *, int))(session_options, 1));
    if (o.library) { /* a graph built with --portable has standard ONNX nodes only and needs no library */
        CHECK(ORT(api, RegisterCustomOpsLibrary_V2, OrtStatus * (*)(OrtSessionOptions *, const char *))(
            session_options, o.library));
    }
    CHECK(ORT(api, CreateSession, OrtStatus * (*)(const OrtEnv *, const char *, const OrtSessionOptions *,
                                                  OrtSession **))(env, o.model, session_options, &session));

    /* the interface, from the file's metadata */
    OrtModelMetadata *metadata;
    OrtAllocator *allocator;
    char *json = NULL, error[512];
    training_spec spec;
    CHECK(ORT(api, GetAllocatorWithDefaultOptions, OrtStatus * (*)(OrtAllocator **))(&allocator));
    CHECK(ORT(api, SessionGetModelMetadata, OrtStatus * (*)(const OrtSession *, OrtModelMetadata **))(session,
                                                                                                      &metadata));
    CHECK(ORT(api, ModelMetadataLookupCustomMetadataMap,
              OrtStatus * (*)(const OrtModelMetadata *, OrtAllocator *, const char *, char **))(
        metadata, allocator, "bnfuse.training", &json));
    ORT(api, ReleaseModelMetadata, void (*)(OrtModelMetadata *))(metadata);
    if (!json) {
        die("not a bnfuse training graph (no bnfuse.training metadata): build one with `bnfuse train-graph`");
    }
    int parsed = spec_parse(json, &spec, error, sizeof error);
    CHECK(ORT(api, AllocatorFree, OrtStatus * (*)(OrtAllocator *, void *))(allocator, json));
    if (parsed != 0) {
        die(error);
    }

    /* the data, converted once to the graph's input types */
    npz_archive archive;
    if (npz_read(o.data, &archive, error, sizeof error) != 0) {
        die(error);
    }
    size_t fed = spec.data_count + 1;
    npz_array **arrays = calloc(fed, sizeof *arrays);
    int *types = calloc(fed, sizeof *types);
    int64_t static_batch = -1, samples = -1;
    const char *single[] = {"x", "X", NULL}, *labels[] = {"labels", "y", NULL};
    for (size_t i = 0; i < fed; i++) {
        const char *name = i < spec.data_count ? spec.data[i] : spec.targets[0];
        int64_t first_dim = -1;
        types[i] = input_type(session, name, &first_dim);
        if (types[i] != ORT_TENSOR_FLOAT && types[i] != ORT_TENSOR_INT64) {
            die("a data or target input is neither float32 nor int64");
        }
        arrays[i] = find_array(&archive, name, i == spec.data_count ? labels : spec.data_count == 1 ? single : NULL);
        if (arrays[i]->rank < 1 || (samples >= 0 && arrays[i]->shape[0] != samples)) {
            die("the data file's arrays hold different numbers of samples");
        }
        samples = arrays[i]->shape[0];
        static_batch = first_dim > 0 ? first_dim : static_batch;
        convert(arrays[i], types[i]);
    }
    if (static_batch > 0 && static_batch != o.batch) {
        die("the graph has a static batch size: give it as --batch-size");
    }

    /* one step's names: data, target, lr, then the state (fed from the second step on) */
    size_t input_count = fed + 1 + spec.state_count, output_count = 1 + spec.state_count + (spec.output_count > 0);
    const char **input_names = calloc(input_count, sizeof *input_names);
    const char **output_names = calloc(output_count, sizeof *output_names);
    OrtValue **inputs = calloc(input_count, sizeof *inputs), **outputs = calloc(output_count, sizeof *outputs);
    for (size_t i = 0; i < spec.data_count; i++) {
        input_names[i] = spec.data[i];
    }
    input_names[spec.data_count] = spec.targets[0];
    input_names[fed] = spec.lr;
    output_names[0] = spec.loss;
    for (size_t i = 0; i < spec.state_count; i++) {
        input_names[fed + 1 + i] = spec.state_inputs[i];
        output_names[1 + i] = spec.state_outputs[i];
    }
    if (spec.output_count > 0) {
        output_names[output_count - 1] = spec.outputs[0];
    }
    OrtMemoryInfo *memory;
    CHECK(ORT(api, CreateCpuMemoryInfo, OrtStatus * (*)(int, int, OrtMemoryInfo **))(ORT_DEVICE_ALLOCATOR,
                                                                                     ORT_MEM_TYPE_DEFAULT, &memory));
    float lr = o.lr;
    int64_t scalar_shape[1] = {0};
    CHECK(ORT(api, CreateTensorWithDataAsOrtValue,
              OrtStatus * (*)(const OrtMemoryInfo *, void *, size_t, const int64_t *, size_t, int, OrtValue **))(
        memory, &lr, sizeof lr, scalar_shape, 0, ORT_TENSOR_FLOAT, &inputs[fed]));

    int have_state = 0;
    for (int epoch = 1; epoch <= o.epochs; epoch++) {
        double loss_sum = 0;
        int64_t seen = 0, hits = 0, scored = 0;
        for (int64_t start = 0; start < samples; start += o.batch) {
            int64_t count = samples - start < o.batch ? samples - start : o.batch;
            if (static_batch > 0 && count != static_batch) {
                break; /* a static graph takes whole batches only */
            }
            for (size_t i = 0; i < fed; i++) {
                inputs[i] = slice(memory, arrays[i], start, count, types[i]);
            }
            size_t feeding = have_state ? input_count : fed + 1; /* step 1: the initializers are the state */
            CHECK(ORT(api, Run, OrtStatus * (*)(OrtSession *, const void *, const char *const *,
                                                const OrtValue *const *, size_t, const char *const *, size_t,
                                                OrtValue **))(session, NULL, input_names, (const OrtValue *const *)inputs,
                                                              feeding, output_names, output_count, outputs));
            float *loss;
            CHECK(ORT(api, GetTensorMutableData, OrtStatus * (*)(OrtValue *, void **))(outputs[0], (void **)&loss));
            if (o.print_steps) {
                printf("step %lld loss %.9g\n", (long long)(start / o.batch + 1), (double)*loss);
            }
            loss_sum += (double)*loss * (double)count;
            seen += count;
            if (spec.output_count > 0 && types[spec.data_count] == ORT_TENSOR_INT64) {
                int64_t right = correct(outputs[output_count - 1], (const int64_t *)arrays[spec.data_count]->data + start,
                                        count);
                hits += right > 0 ? right : 0;
                scored += right >= 0 ? count : 0;
            }
            /* feed the state back: this step's outputs are the next step's inputs */
            for (size_t i = 0; i < fed; i++) {
                ORT(api, ReleaseValue, void (*)(OrtValue *))(inputs[i]);
            }
            for (size_t i = 0; i < spec.state_count; i++) {
                if (have_state) {
                    ORT(api, ReleaseValue, void (*)(OrtValue *))(inputs[fed + 1 + i]);
                }
                inputs[fed + 1 + i] = outputs[1 + i];
            }
            memset(outputs, 0, output_count * sizeof *outputs); /* Run allocates outputs given as NULL */
            ORT(api, ReleaseValue, void (*)(OrtValue *))(outputs[0]);
            if (spec.output_count > 0) {
                ORT(api, ReleaseValue, void (*)(OrtValue *))(outputs[output_count - 1]);
            }
            have_state = 1;
        }
        printf("epoch %d loss %.9g", epoch, seen ? loss_sum / (double)seen : 0.0);
        if (scored) {
            printf(" accuracy %.4f", (double)hits / (double)scored);
        }
        printf("\n");
        fflush(stdout);
    }

    for (size_t i = fed; i < input_count && (i == fed || have_state); i++) {
        ORT(api, ReleaseValue, void (*)(OrtValue *))(inputs[i]);
    }
    ORT(api, ReleaseMemoryInfo, void (*)(OrtMemoryInfo *))(memory);
    ORT(api, ReleaseSession, void (*)(OrtSession *))(session);
    ORT(api, ReleaseSessionOptions, void (*)(OrtSessionOptions *))(session_options);
    ORT(api, ReleaseEnv, void (*)(OrtEnv *))(env);
    free(input_names);
    free(output_names);
    free(inputs);
    free(outputs);
    free(arrays);
    free(types);
    npz_free(&archive);
    spec_free(&spec);
    return 0;
}
