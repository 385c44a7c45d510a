/* Finding and loading oneDNN for the convolution-gradient core: dlopen() a libdnnl.so.3 and dlsym() the functions
 * onednn_dnnl.h declares, then make the CPU engine. Nothing links against oneDNN. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "onednn_dnnl.h"

struct dnnl_api bnfuse_dnnl;

/* the release whose enum values onednn_dnnl.h declares (onednn-cpu-gomp 2023.2) */
enum { VERIFIED_MAJOR = 3, VERIFIED_MINOR = 2 };

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;

void bnfuse_set_error(char *error, size_t error_size, const char *format, ...) {
    if (error == NULL || error_size == 0) {
        return;
    }
    va_list args;
    va_start(args, format);
    vsnprintf(error, error_size, format, args);
    va_end(args);
}

static int load_from(const char *path, char *error, size_t error_size) {
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        bnfuse_set_error(error, error_size, "cannot load oneDNN from %s: %s", path, dlerror());
        return BNFUSE_ONEDNN_UNSUPPORTED;
    }
    struct dnnl_api api = {0};
    struct {
        const char *name;
        void **slot;
    } symbols[] = {
        {"dnnl_engine_create", (void **)&api.engine_create},
        {"dnnl_stream_create", (void **)&api.stream_create},
        {"dnnl_stream_wait", (void **)&api.stream_wait},
        {"dnnl_stream_destroy", (void **)&api.stream_destroy},
        {"dnnl_memory_desc_create_with_tag", (void **)&api.memory_desc_create_with_tag},
        {"dnnl_memory_desc_create_with_strides", (void **)&api.memory_desc_create_with_strides},
        {"dnnl_memory_desc_destroy", (void **)&api.memory_desc_destroy},
        {"dnnl_memory_desc_equal", (void **)&api.memory_desc_equal},
        {"dnnl_primitive_desc_query_md", (void **)&api.primitive_desc_query_md},
        {"dnnl_convolution_forward_primitive_desc_create", (void **)&api.conv_fwd_pd_create},
        {"dnnl_convolution_backward_weights_primitive_desc_create", (void **)&api.conv_bwd_weights_pd_create},
        {"dnnl_convolution_backward_data_primitive_desc_create", (void **)&api.conv_bwd_data_pd_create},
        {"dnnl_reorder_primitive_desc_create", (void **)&api.reorder_pd_create},
        {"dnnl_primitive_desc_destroy", (void **)&api.primitive_desc_destroy},
        {"dnnl_primitive_create", (void **)&api.primitive_create},
        {"dnnl_primitive_destroy", (void **)&api.primitive_destroy},
        {"dnnl_primitive_execute", (void **)&api.primitive_execute},
        {"dnnl_memory_create", (void **)&api.memory_create},
        {"dnnl_memory_set_data_handle", (void **)&api.memory_set_data_handle},
        {"dnnl_memory_destroy", (void **)&api.memory_destroy},
        {"dnnl_memory_desc_get_size", (void **)&api.memory_desc_get_size},
        {"dnnl_version", (void **)&api.version},
        {"dnnl_primitive_attr_create", (void **)&api.attr_create},
        {"dnnl_primitive_attr_destroy", (void **)&api.attr_destroy},
        {"dnnl_primitive_attr_set_scratchpad_mode", (void **)&api.attr_set_scratchpad_mode},
        {"dnnl_sgemm", (void **)&api.sgemm},
        {"omp_get_max_threads", (void **)&api.omp_get_max_threads},
        {"omp_set_num_threads", (void **)&api.omp_set_num_threads},
    };
    for (size_t i = 0; i < sizeof(symbols) / sizeof(symbols[0]); i++) {
        *symbols[i].slot = dlsym(handle, symbols[i].name); /* searches libdnnl and its dependencies (libgomp) */
        if (*symbols[i].slot == NULL) {
            bnfuse_set_error(error, error_size, "%s has no symbol %s (not a oneDNN 3.x OpenMP build?)", path,
                             symbols[i].name);
            dlclose(handle);
            return BNFUSE_ONEDNN_UNSUPPORTED;
        }
    }
    const int *version = (const int *)api.version(); /* dnnl_version_t: major, minor, patch, hash, ... */
    if (version[0] != VERIFIED_MAJOR || version[1] != VERIFIED_MINOR) {
        bnfuse_set_error(error, error_size, "%s is oneDNN %d.%d.%d; bnfuse needs oneDNN %d.%d (onednn-cpu-gomp 2023.2)",
                         path, version[0], version[1], version[2], VERIFIED_MAJOR, VERIFIED_MINOR);
        dlclose(handle);
        return BNFUSE_ONEDNN_UNSUPPORTED;
    }
    dnnl_status_t status = api.engine_create(&api.engine, dnnl_cpu, 0);
    if (status != 0) {
        bnfuse_set_error(error, error_size, "oneDNN engine_create failed (dnnl_status_t %d)", status);
        dlclose(handle);
        return BNFUSE_ONEDNN_UNSUPPORTED;
    }
    api.handle = handle;
    bnfuse_dnnl = api;
    return BNFUSE_ONEDNN_OK;
}

int bnfuse_onednn_load(const char *path_or_null, char *error, size_t error_size) {
    pthread_mutex_lock(&load_lock);
    int result = BNFUSE_ONEDNN_OK;
    if (bnfuse_dnnl.handle == NULL) {
        const char *path = path_or_null;
        if (path == NULL || path[0] == '\0') {
            path = getenv("BNFUSE_ONEDNN_LIBRARY");
        }
        if (path == NULL || path[0] == '\0') {
            path = "libdnnl.so.3"; /* the dynamic loader's search: LD_LIBRARY_PATH, rpath, ld.so.cache */
        }
        result = load_from(path, error, error_size);
    }
    pthread_mutex_unlock(&load_lock);
    return result;
}

int bnfuse_onednn_version(int version[3]) {
    if (bnfuse_dnnl.handle == NULL) {
        return -1;
    }
    const int *v = (const int *)bnfuse_dnnl.version();
    for (int i = 0; i < 3; i++) {
        version[i] = v[i];
    }
    return 0;
}
