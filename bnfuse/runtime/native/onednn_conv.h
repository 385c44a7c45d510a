/* bnfuse's convolution gradients on oneDNN's CPU engine, as a C API with no Python in it.
 *
 * Hosts: the native onnxruntime custom-op library (ConvWeightGrad / ConvInputGrad compute functions, with
 * OrtApi::KernelContext_ParallelFor as the parallel-for) and the Python extension bnfuse.runtime._onednn (the
 * Python-hosted ops). Both run the same code, so they give the same bits.
 *
 * oneDNN is not linked: bnfuse_onednn_load() dlopen()s a libdnnl.so.3 (oneDNN 3.x, OpenMP build; the release whose
 * enum values the core declares is checked) at run time, so building needs neither oneDNN nor its headers:
 *
 *     cc -O2 -fPIC -c bnfuse/runtime/native/onednn_{load,plan,split,conv,direct,gemm}.c   (link with -ldl -lpthread)
 *
 * (tests/runtime/c/onednn_host.c is a complete host: a pthread parallel-for, no Python.)
 *
 * Threads and determinism: a call splits its work into chunks fixed by the geometry and `threads` alone (never by
 * which pool thread runs which chunk) and runs them as tasks through the host's parallel-for (each chunk on one
 * oneDNN/OpenMP thread, so no OpenMP team spins beside the host's pool). Where the activations are small next to
 * the weight (deep layers, small batches) a call splits the channels or groups (each chunk computes its own slice of
 * the result, nothing is summed or copied twice); else it splits the batch (the weight gradient then adds the
 * chunks' partial sums in chunk order, in parallel over the weight's elements). The same geometry, inputs and
 * `threads` give the same bits on every host.
 *
 * Thread safety: calls may come from any thread; the core serializes them on one mutex (the cached plans and the
 * shared workspaces serve one call at a time). The parallel-for callback is invoked with that mutex held and must
 * not call back into this API.
 */
#ifndef BNFUSE_ONEDNN_CONV_H
#define BNFUSE_ONEDNN_CONV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    BNFUSE_ONEDNN_OK = 0,
    BNFUSE_ONEDNN_ERROR = -1,       /* bad arguments, or oneDNN failed while running: the message says which */
    BNFUSE_ONEDNN_UNSUPPORTED = -2, /* oneDNN is not loaded, or has no implementation for this geometry */
    BNFUSE_ONEDNN_MAX_SPATIAL = 3,
    BNFUSE_ONEDNN_MAX_CHUNKS = 64,
    /* how a call splits its work (bnfuse_onednn_split): */
    BNFUSE_ONEDNN_SPLIT_BATCH = 0,    /* images; the weight gradient adds the chunks' partial sums in chunk order */
    BNFUSE_ONEDNN_SPLIT_CHANNELS = 1, /* output channels (weight gradient) or input channels (input gradient) */
    BNFUSE_ONEDNN_SPLIT_GROUPS = 2,   /* groups of a grouped convolution */
};

/* One convolution, as the ONNX Conv it differentiates: X [batch, in_channels, input...] * W [out_channels,
 * in_channels / groups, kernel...] -> Y (= dY's shape) [batch, out_channels, output...]. Unused entries of the
 * spatial arrays (index >= spatial) are ignored. */
typedef struct {
    int spatial; /* 1 to 3 */
    int64_t batch;
    int64_t in_channels;  /* C: X's (and dX's) channels */
    int64_t out_channels; /* O: dY's channels */
    int64_t groups;       /* >= 1, dividing both channel counts; groups == in_channels == out_channels: depthwise */
    int64_t input[BNFUSE_ONEDNN_MAX_SPATIAL];  /* X's spatial sizes */
    int64_t output[BNFUSE_ONEDNN_MAX_SPATIAL]; /* dY's spatial sizes: must be what the Conv gives */
    int64_t kernel[BNFUSE_ONEDNN_MAX_SPATIAL];
    int64_t stride[BNFUSE_ONEDNN_MAX_SPATIAL];   /* >= 1 */
    int64_t dilation[BNFUSE_ONEDNN_MAX_SPATIAL]; /* ONNX's: 1 = dense */
    int64_t pad_begin[BNFUSE_ONEDNN_MAX_SPATIAL];
    int64_t pad_end[BNFUSE_ONEDNN_MAX_SPATIAL]; /* ONNX's end pads (an unused input tail is allowed) */
    int x_block; /* weight gradient only: 0 = X is plain NCHW; 8 or 16 = X in onnxruntime's NCHWc layout with that
                    channel block (2-D, groups == 1, in_channels a multiple of the block) */
} bnfuse_conv_geometry;

/* The host's parallel-for: run task(user, i) for every i in [0, count), on any threads, returning when all are
 * done; 0 on success, non-zero if the tasks could not be run. Tasks touch no Python and no host API. For an
 * onnxruntime custom op: a small adapter over OrtApi::KernelContext_ParallelFor(context, task, count, 0, user)
 * with `pool` = the OrtKernelContext (release the OrtStatus it returns; non-NULL -> return non-zero). */
typedef int (*bnfuse_parallel_for_fn)(void *pool, void (*task)(void *user, size_t index), void *user, size_t count);

typedef struct {
    bnfuse_parallel_for_fn parallel_for; /* NULL: the chunks run in order on the calling thread */
    void *pool;                          /* passed through to parallel_for */
    /* The number of threads the host gives the op (onnxruntime: the session's intra-op thread count) >= 1: the
     * chunk count is derived from it and the shape (and so are the bits of the weight gradient). 0: one oneDNN
     * call with OpenMP's own team of the calling thread's omp_get_max_threads() (no parallel_for used). */
    int threads;
} bnfuse_thread_pool;

/* Load oneDNN (once per process; later calls return 0 at once). path_or_null: a libdnnl.so.3 to dlopen(); NULL
 * searches, in order: the environment variable BNFUSE_ONEDNN_LIBRARY (a path), then the dynamic loader's search
 * for "libdnnl.so.3" (LD_LIBRARY_PATH, the rpath, /etc/ld.so.cache: a system install). The Python package passes
 * the path of the onednn-cpu-gomp wheel's library. Returns 0, or BNFUSE_ONEDNN_UNSUPPORTED with a one-line
 * message (not found, a symbol missing, another oneDNN release) in error[error_size]. */
int bnfuse_onednn_load(const char *path_or_null, char *error, size_t error_size);

/* The loaded oneDNN's version into version[3] (major, minor, patch); non-zero if none is loaded. */
int bnfuse_onednn_version(int version[3]);

/* Check a geometry (ranks, sizes, groups, dY's spatial sizes against the Conv's, x_block): 0, or
 * BNFUSE_ONEDNN_ERROR with a one-line message. The gradient calls check it too. */
int bnfuse_onednn_check_geometry(const bnfuse_conv_geometry *geometry, char *error, size_t error_size);

/* dW [out_channels, in_channels / groups, kernel...] of the geometry from X (plain NCHW, or NCHWc per x_block) and
 * dY [batch, out_channels, output...], float32, C-contiguous. dw is overwritten. */
int bnfuse_onednn_weight_grad(const bnfuse_conv_geometry *geometry, const float *x, const float *dy, float *dw,
                              const bnfuse_thread_pool *pool, char *error, size_t error_size);

/* dX [batch, in_channels, input...] of the geometry from dY and W [out_channels, in_channels / groups, kernel...]
 * (the Conv's weight as ONNX has it), float32, C-contiguous. dx is overwritten (x_block must be 0). */
int bnfuse_onednn_input_grad(const bnfuse_conv_geometry *geometry, const float *dy, const float *w, float *dx,
                             const bnfuse_thread_pool *pool, char *error, size_t error_size);

/* How a call with this geometry and thread count splits its work (the split the gradient calls use): returns the
 * chunk count (1 to BNFUSE_ONEDNN_MAX_CHUNKS; 0 with a message for a bad geometry) and writes the axis
 * (BNFUSE_ONEDNN_SPLIT_*) and each chunk's extent along it (images, channels or groups) into sizes. input_grad: 0
 * for the weight gradient, 1 for the input gradient. */
int bnfuse_onednn_split(const bnfuse_conv_geometry *geometry, int input_grad, int threads, int *axis,
                        int64_t sizes[], char *error, size_t error_size);

/* Bytes the shared workspaces (oneDNN's layouts of the operands and its scratchpads) and partial sums hold now;
 * bnfuse_onednn_release_workspaces() frees them (the next call allocates what it needs again). */
size_t bnfuse_onednn_workspace_bytes(void);
void bnfuse_onednn_release_workspaces(void);

#ifdef __cplusplus
}
#endif

#endif
