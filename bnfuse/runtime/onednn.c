/* bnfuse.runtime._onednn: the Python face of the oneDNN convolution-gradient core (bnfuse/runtime/native/
 * onednn_conv.h), for the Python-hosted ops ConvWeightGrad (conv_grad.py) and ConvInputGrad (conv_input_grad.py).
 * The native custom-op library runs the same core, so both hosts give the same bits.
 *
 * A gradient call releases the GIL for the whole core call; the core runs its chunks through a parallel-for that
 * takes the GIL back only to call the kernel context's parallel_for(task, count, data) (onnxruntime's
 * KernelContext_ParallelFor through ortabi), whose tasks run without the GIL and touch no Python. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "native/onednn_conv.h"

enum { GEOMETRY_VALUES = 5 + 7 * BNFUSE_ONEDNN_MAX_SPATIAL + 1, ERROR_SIZE = 512 };

static PyObject *raise(int status, const char *error) {
    PyErr_SetString(status == BNFUSE_ONEDNN_UNSUPPORTED ? PyExc_NotImplementedError : PyExc_RuntimeError, error);
    return NULL;
}

static PyObject *load(PyObject *self, PyObject *args) {
    const char *path = NULL;
    if (!PyArg_ParseTuple(args, "z", &path)) {
        return NULL;
    }
    char error[ERROR_SIZE] = "";
    int status;
    Py_BEGIN_ALLOW_THREADS;
    status = bnfuse_onednn_load(path, error, sizeof(error));
    Py_END_ALLOW_THREADS;
    if (status != BNFUSE_ONEDNN_OK) {
        PyErr_SetString(PyExc_OSError, error);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *version(PyObject *self, PyObject *args) {
    int v[3];
    if (bnfuse_onednn_version(v) != 0) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(iii)", v[0], v[1], v[2]);
}

/* geometry: the sequence (spatial, batch, in_channels, out_channels, groups, input[3], output[3], kernel[3],
 * stride[3], dilation[3], pad_begin[3], pad_end[3], x_block) of bnfuse_conv_geometry's fields. */
static int read_geometry(PyObject *sequence, bnfuse_conv_geometry *g) {
    PyObject *fast = PySequence_Fast(sequence, "geometry");
    if (fast == NULL) {
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(fast) != GEOMETRY_VALUES) {
        PyErr_Format(PyExc_ValueError, "geometry: expected %d values, got %zd", GEOMETRY_VALUES,
                     PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return -1;
    }
    int64_t values[GEOMETRY_VALUES];
    for (int i = 0; i < GEOMETRY_VALUES; i++) {
        values[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    }
    Py_DECREF(fast);
    if (PyErr_Occurred()) {
        return -1;
    }
    memset(g, 0, sizeof(*g));
    g->spatial = (int)values[0];
    g->batch = values[1];
    g->in_channels = values[2];
    g->out_channels = values[3];
    g->groups = values[4];
    int64_t *arrays[] = {g->input, g->output, g->kernel, g->stride, g->dilation, g->pad_begin, g->pad_end};
    for (int a = 0; a < 7; a++) {
        memcpy(arrays[a], values + 5 + a * BNFUSE_ONEDNN_MAX_SPATIAL, sizeof(int64_t) * BNFUSE_ONEDNN_MAX_SPATIAL);
    }
    g->x_block = (int)values[GEOMETRY_VALUES - 1];
    return 0;
}

/* The core's parallel-for over a Python kernel context: the context's parallel_for(task, count, data), called
 * with the GIL taken back (a failure is kept in *failure and raised once the core returns). */
typedef struct {
    PyObject *context;
    PyObject *failure_type, *failure_value, *failure_traceback;
} python_pool_t;

static int python_parallel_for(void *data, void (*task)(void *, size_t), void *user, size_t count) {
    python_pool_t *pool = data;
    PyGILState_STATE state = PyGILState_Ensure();
    PyObject *done = PyObject_CallMethod(pool->context, "parallel_for", "NnN", PyLong_FromVoidPtr((void *)task),
                                         (Py_ssize_t)count, PyLong_FromVoidPtr(user));
    int status = 0;
    if (done == NULL) {
        if (pool->failure_type == NULL) {
            PyErr_Fetch(&pool->failure_type, &pool->failure_value, &pool->failure_traceback);
        }
        PyErr_Clear();
        status = -1;
    }
    Py_XDECREF(done);
    PyGILState_Release(state);
    return status;
}

/* weight_grad(geometry, x, dy, dw, threads, context) / input_grad(geometry, dy, w, dx, threads, context): buffer
 * addresses; context None: the chunks run in order on this thread. */
static PyObject *gradient(PyObject *args, int input_grad) {
    PyObject *geometry_obj, *context;
    unsigned long long first, second, result;
    int threads;
    if (!PyArg_ParseTuple(args, "OKKKiO", &geometry_obj, &first, &second, &result, &threads, &context)) {
        return NULL;
    }
    bnfuse_conv_geometry geometry;
    if (read_geometry(geometry_obj, &geometry)) {
        return NULL;
    }
    python_pool_t python_pool = {context, NULL, NULL, NULL};
    bnfuse_thread_pool pool = {context == Py_None ? NULL : python_parallel_for, &python_pool, threads};
    char error[ERROR_SIZE] = "";
    int status;
    Py_BEGIN_ALLOW_THREADS;
    if (input_grad) {
        status = bnfuse_onednn_input_grad(&geometry, (const float *)(uintptr_t)first, (const float *)(uintptr_t)second,
                                          (float *)(uintptr_t)result, &pool, error, sizeof(error));
    } else {
        status = bnfuse_onednn_weight_grad(&geometry, (const float *)(uintptr_t)first,
                                           (const float *)(uintptr_t)second, (float *)(uintptr_t)result, &pool, error,
                                           sizeof(error));
    }
    Py_END_ALLOW_THREADS;
    if (python_pool.failure_type != NULL) { /* the context's parallel_for raised: that error, not the core's */
        PyErr_Restore(python_pool.failure_type, python_pool.failure_value, python_pool.failure_traceback);
        return NULL;
    }
    if (status != BNFUSE_ONEDNN_OK) {
        return raise(status, error);
    }
    Py_RETURN_NONE;
}

static PyObject *weight_grad(PyObject *self, PyObject *args) { return gradient(args, 0); }

static PyObject *input_grad(PyObject *self, PyObject *args) { return gradient(args, 1); }

/* split(geometry, input_grad, threads) -> (axis, sizes): how a call splits its work (bnfuse_onednn_split). */
static PyObject *split(PyObject *self, PyObject *args) {
    PyObject *geometry_obj;
    int input_grad, threads;
    if (!PyArg_ParseTuple(args, "Opi", &geometry_obj, &input_grad, &threads)) {
        return NULL;
    }
    bnfuse_conv_geometry geometry;
    if (read_geometry(geometry_obj, &geometry)) {
        return NULL;
    }
    int axis = 0;
    int64_t sizes[BNFUSE_ONEDNN_MAX_CHUNKS];
    char error[ERROR_SIZE] = "";
    int count = bnfuse_onednn_split(&geometry, input_grad, threads, &axis, sizes, error, sizeof(error));
    if (count == 0) {
        return raise(BNFUSE_ONEDNN_ERROR, error);
    }
    PyObject *tuple = PyTuple_New(count);
    if (tuple == NULL) {
        return NULL;
    }
    for (int i = 0; i < count; i++) {
        PyTuple_SET_ITEM(tuple, i, PyLong_FromLongLong(sizes[i]));
    }
    return Py_BuildValue("(iN)", axis, tuple);
}

/* The core's lock is taken with the GIL released, everywhere: a call holding that lock takes the GIL back for its
 * parallel-for. */
static PyObject *workspace_bytes(PyObject *self, PyObject *args) {
    size_t bytes;
    Py_BEGIN_ALLOW_THREADS;
    bytes = bnfuse_onednn_workspace_bytes();
    Py_END_ALLOW_THREADS;
    return PyLong_FromSize_t(bytes);
}

static PyObject *release_workspaces(PyObject *self, PyObject *args) {
    Py_BEGIN_ALLOW_THREADS;
    bnfuse_onednn_release_workspaces();
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "load(path or None): dlopen libdnnl.so.3 (bnfuse_onednn_load)."},
    {"version", version, METH_NOARGS, "The loaded oneDNN's (major, minor, patch), or None."},
    {"weight_grad", weight_grad, METH_VARARGS, "weight_grad(geometry, x, dy, dw, threads, context or None)."},
    {"input_grad", input_grad, METH_VARARGS, "input_grad(geometry, dy, w, dx, threads, context or None)."},
    {"split", split, METH_VARARGS, "split(geometry, input_grad, threads) -> (axis, chunk sizes)."},
    {"workspace_bytes", workspace_bytes, METH_NOARGS, "Bytes the shared workspaces and partial sums hold."},
    {"release_workspaces", release_workspaces, METH_NOARGS, "Free the shared workspaces and partial sums."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_onednn", NULL, -1, methods};

PyMODINIT_FUNC PyInit__onednn(void) { return PyModule_Create(&module); }
