/* The entry point onnxruntime looks for in a custom-op library: RegisterCustomOps.
 *
 * It only forwards to a Python callback installed through bnfuse_set_register_callback (from
 * bnfuse/runtime/ortabi.py, which loads this same shared object with ctypes and so gets the same
 * handle onnxruntime dlopens). Everything else -- the op definitions, the kernels -- lives in Python.
 * The library links against neither onnxruntime nor Python.
 *
 * The two structs below are the first members of onnxruntime's public OrtApiBase and OrtApi; both
 * are append-only, so these prefixes hold for every onnxruntime release.
 */
#include <stddef.h>
#include <stdint.h>

#define BNFUSE_EXPORT __attribute__((visibility("default")))

typedef void *(*bnfuse_register_fn)(void *session_options, const void *api_base);

typedef struct {
    const void *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} bnfuse_api_base_prefix;

typedef struct {
    void *(*CreateStatus)(int code, const char *message);
} bnfuse_api_prefix;

enum { BNFUSE_ORT_FAIL = 1, BNFUSE_OLDEST_API = 1 };

static bnfuse_register_fn registered_callback = NULL;

BNFUSE_EXPORT void bnfuse_set_register_callback(bnfuse_register_fn callback) { registered_callback = callback; }

BNFUSE_EXPORT int bnfuse_has_register_callback(void) { return registered_callback != NULL; }

BNFUSE_EXPORT void *RegisterCustomOps(void *session_options, const void *api_base) {
    if (registered_callback != NULL) {
        return registered_callback(session_options, api_base);
    }
    /* Loaded by onnxruntime without bnfuse's Python side: fail with a status, never crash. */
    const bnfuse_api_base_prefix *base = (const bnfuse_api_base_prefix *)api_base;
    const bnfuse_api_prefix *api = base ? (const bnfuse_api_prefix *)base->GetApi(BNFUSE_OLDEST_API) : NULL;
    if (api == NULL) {
        return NULL;
    }
    return api->CreateStatus(BNFUSE_ORT_FAIL,
                             "bnfuse custom ops: register the library through bnfuse.runtime.session_options() "
                             "or call bnfuse.runtime.library_path() in this process first");
}
