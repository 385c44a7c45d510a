/* The oneDNN convolution gradients for any host (onednn_conv.h): jobs (a geometry's chunks, a plan each, cached),
 * the shared workspaces and partial sums, and running a job's chunks through the host's parallel-for. */
#define _POSIX_C_SOURCE 200809L /* posix_memalign, under -std=c11 too */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "onednn_direct.h"
#include "onednn_gemm.h"
#include "onednn_split.h"

#define dnnl bnfuse_dnnl

enum { MAX_CHUNKS = BNFUSE_ONEDNN_MAX_CHUNKS, MAX_JOBS = 256, SUM_GRAIN = 1 << 16 /* floats per summing task */ };

typedef struct job {
    struct job *next;
    bnfuse_conv_geometry geometry; /* the key, with kind and threads; unused spatial entries zeroed */
    int kind, threads;
    int axis, count;
    plan_t *plans[MAX_CHUNKS];
    /* a batch chunk small enough for the matrix product (onednn_gemm.c) runs on it, as a call of its own would */
    int gemm[MAX_CHUNKS];
    bnfuse_conv_geometry chunk[MAX_CHUNKS];
    size_t offset[MAX_CHUNKS][3]; /* element offsets of each chunk's operands in the whole tensors */
    size_t workspace;             /* bytes: the largest plan's */
    size_t weight_elements;       /* a batch-split weight gradient: chunks 1.. write partial sums of this size */
    int unsupported;              /* oneDNN has no plan for a chunk: kept, so later calls fail at once */
    char message[256];            /* then: why */
} job_t;

/* Calls serialize here: the cached jobs, the workspaces and the partial sums serve one call at a time. */
static pthread_mutex_t core_lock = PTHREAD_MUTEX_INITIALIZER;
static job_t *jobs;
static int job_count;
static void *workspaces[MAX_CHUNKS]; /* per slot: as many as chunks run at once (the host's threads) */
static size_t workspace_sizes[MAX_CHUNKS];
static float *partials;
static size_t partial_bytes;

/* One call in flight: what its tasks read and write. */
typedef struct {
    job_t *job;
    const char *first, *second;
    char *result;
    int slots;
    int busy[MAX_CHUNKS]; /* per slot, taken and given back atomically */
    dnnl_status_t status[MAX_CHUNKS];
    size_t sum_tasks;
} call_t;

static void job_free(job_t *job) {
    for (int i = 0; i < job->count; i++) {
        bnfuse_plan_free(job->plans[i]);
    }
    free(job);
}

static job_t *make_job(const bnfuse_conv_geometry *key, int kind, int threads, char *error, size_t error_size,
                       int *result) {
    job_t *job = calloc(1, sizeof(job_t));
    if (job == NULL) {
        bnfuse_set_error(error, error_size, "oneDNN convolution gradient: out of memory");
        *result = BNFUSE_ONEDNN_ERROR;
        return NULL;
    }
    memcpy(&job->geometry, key, sizeof(*key)); /* padding too: keys are compared with memcmp */
    job->kind = kind;
    job->threads = threads;
    int64_t sizes[MAX_CHUNKS];
    job->count = bnfuse_onednn_split(key, kind == PLAN_DATA, threads, &job->axis, sizes, error, error_size);
    if (job->count == 0) {
        free(job);
        *result = BNFUSE_ONEDNN_ERROR;
        return NULL;
    }
    /* a chunk runs on one oneDNN thread beside the others; threads 0: one call on OpenMP's own team */
    int plan_threads = threads > 0 ? 1 : 0;
    int64_t start = 0;
    for (int i = 0; i < job->count; i++) {
        plan_spec_t spec;
        bnfuse_chunk_spec(key, kind, job->axis, start, sizes[i], plan_threads, &spec, job->offset[i]);
        start += sizes[i];
        job->chunk[i] = *key;
        job->chunk[i].batch = sizes[i];
        if (job->axis == BNFUSE_ONEDNN_SPLIT_BATCH && job->count > 1 &&
            bnfuse_gemm_applies(&job->chunk[i], kind == PLAN_DATA)) {
            job->gemm[i] = 1;
            size_t scratch = bnfuse_gemm_scratch(&job->chunk[i]);
            job->workspace = scratch > job->workspace ? scratch : job->workspace;
            continue;
        }
        job->plans[i] = bnfuse_plan_create(&spec, error, error_size);
        if (job->plans[i] == NULL) { /* a geometry oneDNN has no implementation for */
            for (int made = 0; made < i; made++) {
                bnfuse_plan_free(job->plans[made]);
                job->plans[made] = NULL;
            }
            job->count = 0;
            job->unsupported = 1;
            snprintf(job->message, sizeof(job->message), "%s", error ? error : "");
            *result = BNFUSE_ONEDNN_UNSUPPORTED;
            return job;
        }
        if (job->plans[i]->workspace > job->workspace) {
            job->workspace = job->plans[i]->workspace;
        }
    }
    if (kind == PLAN_WEIGHTS && job->axis == BNFUSE_ONEDNN_SPLIT_BATCH && job->count > 1) {
        int64_t kernel = 1;
        for (int i = 0; i < key->spatial; i++) {
            kernel *= key->kernel[i];
        }
        job->weight_elements = (size_t)(key->out_channels * (key->in_channels / key->groups) * kernel);
    }
    *result = BNFUSE_ONEDNN_OK;
    return job;
}

/* The cached job of (geometry, kind, threads), made on first use. Call under core_lock. */
static job_t *find_job(const bnfuse_conv_geometry *geometry, int kind, int threads, char *error, size_t error_size,
                       int *result) {
    bnfuse_conv_geometry key;
    memset(&key, 0, sizeof(key));
    key.spatial = geometry->spatial;
    key.batch = geometry->batch;
    key.in_channels = geometry->in_channels;
    key.out_channels = geometry->out_channels;
    key.groups = geometry->groups;
    key.x_block = geometry->x_block;
    for (int i = 0; i < geometry->spatial && i < BNFUSE_ONEDNN_MAX_SPATIAL; i++) {
        key.input[i] = geometry->input[i];
        key.output[i] = geometry->output[i];
        key.kernel[i] = geometry->kernel[i];
        key.stride[i] = geometry->stride[i];
        key.dilation[i] = geometry->dilation[i];
        key.pad_begin[i] = geometry->pad_begin[i];
        key.pad_end[i] = geometry->pad_end[i];
    }
    for (job_t *job = jobs; job != NULL; job = job->next) {
        if (job->kind == kind && job->threads == threads && memcmp(&job->geometry, &key, sizeof(key)) == 0) {
            if (job->unsupported) {
                bnfuse_set_error(error, error_size, "%s", job->message);
                *result = BNFUSE_ONEDNN_UNSUPPORTED;
                return NULL;
            }
            *result = BNFUSE_ONEDNN_OK;
            return job;
        }
    }
    job_t *job = make_job(&key, kind, threads, error, error_size, result);
    if (job == NULL) {
        return NULL;
    }
    if (job_count >= MAX_JOBS) { /* more geometries than a network has: start over */
        while (jobs != NULL) {
            job_t *next = jobs->next;
            job_free(jobs);
            jobs = next;
        }
        job_count = 0;
    }
    job->next = jobs;
    jobs = job;
    job_count++;
    return job->unsupported ? NULL : job;
}

/* Grow a 64-byte aligned buffer to `bytes` (the old one freed first: never both at once). */
static int grow(void **buffer, size_t *size, size_t bytes) {
    if (*size >= bytes && (*buffer != NULL || bytes == 0)) {
        return 0;
    }
    free(*buffer);
    *buffer = NULL;
    *size = 0;
    if (posix_memalign(buffer, WORKSPACE_ALIGN, bytes) != 0) {
        *buffer = NULL;
        return -1;
    }
    *size = bytes;
    return 0;
}

/* A free workspace slot (spins, yielding, while every slot is taken: only when more chunks run at once than the
 * host has threads). */
static int take_slot(call_t *call) {
    for (;;) {
        for (int slot = 0; slot < call->slots; slot++) {
            int expected = 0;
            if (__atomic_compare_exchange_n(&call->busy[slot], &expected, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
                return slot;
            }
        }
        sched_yield();
    }
}

/* One chunk, on whichever thread the host's pool gives it. */
static void run_chunk(void *user, size_t index) {
    call_t *call = user;
    job_t *job = call->job;
    if (index >= (size_t)job->count) {
        return;
    }
    int slot = take_slot(call);
    const size_t *offset = job->offset[index];
    char *result = job->weight_elements && index > 0 ? (char *)(partials + (index - 1) * job->weight_elements)
                                                     : call->result + 4 * offset[2];
    if (job->gemm[index]) { /* on this one thread, as a one-thread call on the chunk alone */
        const bnfuse_thread_pool one = {NULL, NULL, 1};
        const float *a = (const float *)(call->first + 4 * offset[0]), *b = (const float *)(call->second + 4 * offset[1]);
        call->status[index] = bnfuse_gemm_gradient(&job->chunk[index], job->kind == PLAN_DATA, a, b, (float *)result,
                                                   workspaces[slot], &one);
    } else {
        call->status[index] = bnfuse_plan_run(job->plans[index], call->first + 4 * offset[0],
                                              call->second + 4 * offset[1], result, workspaces[slot]);
    }
    __atomic_store_n(&call->busy[slot], 0, __ATOMIC_RELEASE);
}

/* dW += the partial sums of chunks 1.., in chunk order, over one range of the weight's elements: every element
 * gets the same additions in the same order whichever thread runs the range. */
static void sum_partials(void *user, size_t index) {
    call_t *call = user;
    job_t *job = call->job;
    size_t total = job->weight_elements, begin = index * SUM_GRAIN, end = begin + SUM_GRAIN;
    if (begin >= total) {
        return;
    }
    end = end < total ? end : total;
    float *dw = (float *)call->result;
    for (int chunk = 1; chunk < job->count; chunk++) {
        const float *partial = partials + (size_t)(chunk - 1) * total;
        for (size_t i = begin; i < end; i++) {
            dw[i] += partial[i];
        }
    }
}

static int run_tasks(const bnfuse_thread_pool *pool, void (*task)(void *, size_t), call_t *call, size_t count) {
    if (count > 1 && pool != NULL && pool->parallel_for != NULL) {
        return pool->parallel_for(pool->pool, task, call, count);
    }
    for (size_t i = 0; i < count; i++) {
        task(call, i);
    }
    return 0;
}

static int run_job(job_t *job, const float *first, const float *second, float *result, const bnfuse_thread_pool *pool,
                   char *error, size_t error_size) {
    int threads = pool != NULL ? pool->threads : 0;
    call_t call;
    memset(&call, 0, sizeof(call));
    call.job = job;
    call.first = (const char *)first;
    call.second = (const char *)second;
    call.result = (char *)result;
    call.slots = threads > 1 ? (threads < job->count ? threads : job->count) : 1;
    for (int slot = 0; slot < call.slots; slot++) {
        if (grow(&workspaces[slot], &workspace_sizes[slot], job->workspace ? job->workspace : WORKSPACE_ALIGN)) {
            bnfuse_set_error(error, error_size, "oneDNN convolution gradient: out of memory (workspace)");
            return BNFUSE_ONEDNN_ERROR;
        }
    }
    if (job->weight_elements &&
        grow((void **)&partials, &partial_bytes, 4 * job->weight_elements * (size_t)(job->count - 1))) {
        bnfuse_set_error(error, error_size, "oneDNN convolution gradient: out of memory (partial sums)");
        return BNFUSE_ONEDNN_ERROR;
    }
    for (int i = 0; i < job->count; i++) {
        call.status[i] = -1; /* not run */
    }
    /* one thread: the chunks (a batch past the chunk cap) in order here, not spinning for the one workspace */
    if (run_tasks(threads > 1 ? pool : NULL, run_chunk, &call, (size_t)job->count)) {
        bnfuse_set_error(error, error_size, "oneDNN convolution gradient: the host's parallel-for failed");
        return BNFUSE_ONEDNN_ERROR;
    }
    for (int i = 0; i < job->count; i++) {
        if (call.status[i] == -1) {
            bnfuse_set_error(error, error_size, "oneDNN convolution gradient: chunk %d of %d did not run", i,
                             job->count);
            return BNFUSE_ONEDNN_ERROR;
        }
        if (call.status[i] != 0) {
            bnfuse_set_error(error, error_size, "oneDNN primitive_execute failed (dnnl_status_t %d)", call.status[i]);
            return BNFUSE_ONEDNN_ERROR;
        }
    }
    if (job->weight_elements) {
        size_t tasks = (job->weight_elements + SUM_GRAIN - 1) / SUM_GRAIN;
        if (run_tasks(threads > 1 ? pool : NULL, sum_partials, &call, tasks)) {
            bnfuse_set_error(error, error_size, "oneDNN convolution gradient: the host's parallel-for failed");
            return BNFUSE_ONEDNN_ERROR;
        }
    }
    return BNFUSE_ONEDNN_OK;
}

static int gradient(int kind, const bnfuse_conv_geometry *geometry, const float *first, const float *second,
                    float *result, const bnfuse_thread_pool *pool, char *error, size_t error_size) {
    int status = bnfuse_onednn_check_geometry(geometry, error, error_size);
    if (status != BNFUSE_ONEDNN_OK) {
        return status;
    }
    if (kind == PLAN_WEIGHTS && bnfuse_direct_weight_grad_applies(geometry) && first != NULL && second != NULL &&
        result != NULL && (pool == NULL || pool->threads >= 0)) {
        /* depthwise: a direct loop (oneDNN's GEMM fallback for these is 10-100x slower; onednn_direct.c) */
        status = bnfuse_direct_weight_grad(geometry, first, second, result, pool);
        if (status != BNFUSE_ONEDNN_OK) {
            bnfuse_set_error(error, error_size, "convolution weight gradient: the parallel-for or a scratch allocation failed");
        }
        return status;
    }
    if (bnfuse_dnnl.handle == NULL) {
        bnfuse_set_error(error, error_size, "oneDNN is not loaded (bnfuse_onednn_load)");
        return BNFUSE_ONEDNN_UNSUPPORTED;
    }
    if (kind == PLAN_DATA && geometry->x_block) {
        bnfuse_set_error(error, error_size, "oneDNN convolution input gradient: dX is plain NCHW (x_block 0)");
        return BNFUSE_ONEDNN_ERROR;
    }
    if (first == NULL || second == NULL || result == NULL || (pool != NULL && pool->threads < 0)) {
        bnfuse_set_error(error, error_size, "oneDNN convolution gradient: NULL buffer or negative thread count");
        return BNFUSE_ONEDNN_ERROR;
    }
    int threads = pool != NULL ? pool->threads : 0;
    pthread_mutex_lock(&core_lock);
    if (bnfuse_gemm_applies(geometry, kind == PLAN_DATA)) {
        /* a small map: one matrix product (onednn_gemm.c), its scratch in the first workspace slot */
        if (grow(&workspaces[0], &workspace_sizes[0], bnfuse_gemm_scratch(geometry))) {
            bnfuse_set_error(error, error_size, "convolution gradient: out of memory (workspace)");
            status = BNFUSE_ONEDNN_ERROR;
        } else {
            status = bnfuse_gemm_gradient(geometry, kind == PLAN_DATA, first, second, result, workspaces[0], pool);
            if (status) {
                bnfuse_set_error(error, error_size, "convolution gradient: the parallel-for or oneDNN's sgemm failed");
            }
        }
        pthread_mutex_unlock(&core_lock);
        return status;
    }
    job_t *job = find_job(geometry, kind, threads, error, error_size, &status);
    if (job != NULL) {
        status = run_job(job, first, second, result, pool, error, error_size);
    }
    pthread_mutex_unlock(&core_lock);
    return status;
}

int bnfuse_onednn_weight_grad(const bnfuse_conv_geometry *geometry, const float *x, const float *dy, float *dw,
                              const bnfuse_thread_pool *pool, char *error, size_t error_size) {
    return gradient(PLAN_WEIGHTS, geometry, x, dy, dw, pool, error, error_size);
}

int bnfuse_onednn_input_grad(const bnfuse_conv_geometry *geometry, const float *dy, const float *w, float *dx,
                             const bnfuse_thread_pool *pool, char *error, size_t error_size) {
    return gradient(PLAN_DATA, geometry, dy, w, dx, pool, error, error_size);
}

size_t bnfuse_onednn_workspace_bytes(void) {
    pthread_mutex_lock(&core_lock);
    size_t total = partial_bytes;
    for (int slot = 0; slot < MAX_CHUNKS; slot++) {
        total += workspace_sizes[slot];
    }
    pthread_mutex_unlock(&core_lock);
    return total;
}

void bnfuse_onednn_release_workspaces(void) {
    pthread_mutex_lock(&core_lock);
    for (int slot = 0; slot < MAX_CHUNKS; slot++) {
        free(workspaces[slot]);
        workspaces[slot] = NULL;
        workspace_sizes[slot] = 0;
    }
    free(partials);
    partials = NULL;
    partial_bytes = 0;
    pthread_mutex_unlock(&core_lock);
}
