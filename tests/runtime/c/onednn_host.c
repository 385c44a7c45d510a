/* A host of the oneDNN convolution-gradient core with no Python in the process: tests/runtime/test_onednn_core.py
 * builds it with `cc` from bnfuse/runtime/native/onednn_*.c and compares its bits with the Python-hosted ops.
 *
 *   onednn_host LIBDNNL weight|input THREADS G0 ... G26 FIRST SECOND RESULT
 *
 * G0..G26: bnfuse_conv_geometry's fields in order (spatial, batch, in/out channels, groups, then input, output,
 * kernel, stride, dilation, pad_begin, pad_end as 3 values each, then x_block); FIRST, SECOND: float32 files of the
 * operands ((X, dY) or (dY, W)); RESULT: the float32 file written. The chunks run on THREADS pthreads. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "onednn_conv.h"

typedef struct {
    void (*task)(void *, size_t);
    void *user;
    size_t count, next;
} work_t;

static void *worker(void *data) {
    work_t *work = data;
    for (;;) {
        size_t index = __atomic_fetch_add(&work->next, 1, __ATOMIC_RELAXED);
        if (index >= work->count) {
            return NULL;
        }
        work->task(work->user, index);
    }
}

/* The host's parallel-for: `*(int *)pool` threads (the calling one among them) take the indices in turn. */
static int parallel_for(void *pool, void (*task)(void *, size_t), void *user, size_t count) {
    int threads = *(int *)pool;
    work_t work = {task, user, count, 0};
    pthread_t helpers[64];
    int started = 0;
    for (; started < threads - 1 && started < 64; started++) {
        if (pthread_create(&helpers[started], NULL, worker, &work) != 0) {
            break;
        }
    }
    worker(&work);
    for (int i = 0; i < started; i++) {
        pthread_join(helpers[i], NULL);
    }
    return 0;
}

static float *read_floats(const char *path, size_t count) {
    float *data = malloc(count * sizeof(float) + 1);
    FILE *file = fopen(path, "rb");
    if (data == NULL || file == NULL || fread(data, sizeof(float), count, file) != count) {
        fprintf(stderr, "cannot read %zu floats from %s\n", count, path);
        exit(2);
    }
    fclose(file);
    return data;
}

int main(int argc, char **argv) {
    if (argc != 4 + 27 + 3) {
        fprintf(stderr, "usage: %s LIBDNNL weight|input THREADS G0..G26 FIRST SECOND RESULT\n", argv[0]);
        return 2;
    }
    char error[512] = "";
    if (bnfuse_onednn_load(argv[1][0] ? argv[1] : NULL, error, sizeof(error)) != BNFUSE_ONEDNN_OK) {
        fprintf(stderr, "%s\n", error);
        return 3;
    }
    int input_grad = strcmp(argv[2], "input") == 0, threads = atoi(argv[3]);
    int64_t values[27];
    for (int i = 0; i < 27; i++) {
        values[i] = atoll(argv[4 + i]);
    }
    bnfuse_conv_geometry g;
    memset(&g, 0, sizeof(g));
    g.spatial = (int)values[0];
    g.batch = values[1];
    g.in_channels = values[2];
    g.out_channels = values[3];
    g.groups = values[4];
    int64_t *arrays[] = {g.input, g.output, g.kernel, g.stride, g.dilation, g.pad_begin, g.pad_end};
    for (int a = 0; a < 7; a++) {
        memcpy(arrays[a], values + 5 + 3 * a, 3 * sizeof(int64_t));
    }
    g.x_block = (int)values[26];
    if (bnfuse_onednn_check_geometry(&g, error, sizeof(error)) != BNFUSE_ONEDNN_OK) {
        fprintf(stderr, "%s\n", error);
        return 4;
    }
    size_t x = (size_t)(g.batch * g.in_channels), dy = (size_t)(g.batch * g.out_channels);
    size_t w = (size_t)(g.out_channels * (g.in_channels / g.groups));
    for (int i = 0; i < g.spatial; i++) {
        x *= (size_t)g.input[i];
        dy *= (size_t)g.output[i];
        w *= (size_t)g.kernel[i];
    }
    size_t first = input_grad ? dy : x, second = input_grad ? w : dy, result = input_grad ? x : w;
    float *a = read_floats(argv[31], first), *b = read_floats(argv[32], second), *out = malloc(result * 4 + 1);
    bnfuse_thread_pool pool = {parallel_for, &threads, threads};
    int status = input_grad ? bnfuse_onednn_input_grad(&g, a, b, out, &pool, error, sizeof(error))
                            : bnfuse_onednn_weight_grad(&g, a, b, out, &pool, error, sizeof(error));
    if (status != BNFUSE_ONEDNN_OK) {
        fprintf(stderr, "%s\n", error);
        return 5;
    }
    FILE *file = fopen(argv[33], "wb");
    if (file == NULL || fwrite(out, sizeof(float), result, file) != result) {
        fprintf(stderr, "cannot write %s\n", argv[33]);
        return 2;
    }
    fclose(file);
    printf("%zu\n", bnfuse_onednn_workspace_bytes());
    return 0;
}
