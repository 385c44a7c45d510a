/* bnfuse.runtime._cpukernels: the fast CPU BN kernels (bnfuse/runtime/cpu.py is their Python face). This file: the
 * thread pool and the Python interface; cpureduce.c, cpuloops.c and cpuserial.c: the kernels.
 *
 * The data is viewed as (outer, channels, inner), float32; parameters and every accumulation are float64.
 * Everything here is a plain C function of this shape:
 *
 * - a task ``void task(void **data, size_t index)``: one range of channels, or one fixed row chunk, of one of
 *   cpu.py's parallel loops. cpu_pool.py hands tasks to onnxruntime's intra-op pool inside a session
 *   (KernelContext_ParallelFor) and to this file's own small pthread pool (run(), GIL released) outside one.
 *   The serial kernels (serial_inference / _training / _backward) are tasks of count 1.
 * The native custom-op library (runtime/native/bn_ops.c) compiles the same kernels and calls them directly.
 *
 * Determinism: no atomics in the arithmetic; every sum has one order, fixed by the shape and the implementation
 * picked for the process (the channel reductions: AVX2 lanes or a portable omp simd loop), the row chunks' column
 * sums are strictly in row order, chunk partials are added in chunk order by the caller. Each reduction is
 * one non-inlined function, so every path (serial, task, any thread count) runs the same machine code for it.
 * Elementwise loops are strict IEEE (-ffp-contract=off: no FMA contraction). NaN and Inf propagate (no
 * -ffast-math). target_clones compiles the elementwise loops for AVX-512, AVX2 and baseline x86-64 (the CPU picks
 * one clone for the process). Results may differ in the last bits between CPUs, never between runs.
 */#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpukernels.h"

/* -- a small pthread pool for the tasks outside onnxruntime's sessions ----------------------------------
 * Workers are started on first need (at most the largest thread count asked for, less the caller, who runs tasks
 * too) and take task indices from one shared counter; a worker spins briefly after a job before it sleeps. One
 * job at a time: a caller that finds the pool busy (another Python thread's kernel) runs its tasks itself. No
 * OpenMP: nothing here changes any library's thread settings. */

enum { SPIN_NS = 50000 };

static struct {
    pthread_mutex_t lock, job;
    pthread_cond_t wake, idle;
    _Atomic uint64_t generation;
    int workers, active, wanted, joined, busy;
    bn_task task;
    void **data;
    size_t count;
    _Atomic size_t next;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void drain(bn_task task, void **data, size_t count) {
    for (;;) {
        size_t index = atomic_fetch_add(&pool.next, 1);
        if (index >= count) {
            return;
        }
        task(data, index);
    }
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *worker(void *unused) {
    (void)unused;
    uint64_t seen = 0;
    for (;;) {
        int64_t until = now_ns() + SPIN_NS;
        while (atomic_load(&pool.generation) == seen && now_ns() < until) {
#if defined(__x86_64__)
            __builtin_ia32_pause();
#endif
        }
        pthread_mutex_lock(&pool.lock);
        while (atomic_load(&pool.generation) == seen) {
            pthread_cond_wait(&pool.wake, &pool.lock);
        }
        seen = atomic_load(&pool.generation);
        if (!pool.active || pool.joined >= pool.wanted) {
            pthread_mutex_unlock(&pool.lock);
            continue;
        }
        pool.joined++;
        pool.busy++;
        bn_task task = pool.task;
        void **data = pool.data;
        size_t count = pool.count;
        pthread_mutex_unlock(&pool.lock);
        drain(task, data, count);
        pthread_mutex_lock(&pool.lock);
        if (--pool.busy == 0) {
            pthread_cond_signal(&pool.idle);
        }
        pthread_mutex_unlock(&pool.lock);
    }
    return NULL;
}

static void run_serially(bn_task task, void **data, size_t count) {
    for (size_t index = 0; index < count; ++index) {
        task(data, index);
    }
}

static void pool_run(bn_task task, void **data, size_t count, int threads) {
    if (threads <= 1 || count <= 1 || pthread_mutex_trylock(&pool.job) != 0) {
        run_serially(task, data, count);
        return;
    }
    pthread_mutex_lock(&pool.lock);
    while (pool.workers < threads - 1) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attributes, worker, NULL);
        pthread_attr_destroy(&attributes);
        if (failed) {
            break;
        }
        pool.workers++;
    }
    int helpers = threads - 1 < pool.workers ? threads - 1 : pool.workers;
    pool.wanted = (size_t)helpers < count - 1 ? helpers : (int)(count - 1);
    pool.joined = 0;
    pool.task = task;
    pool.data = data;
    pool.count = count;
    atomic_store(&pool.next, 0);
    pool.active = 1;
    atomic_fetch_add(&pool.generation, 1);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    drain(task, data, count);
    pthread_mutex_lock(&pool.lock);
    pool.active = 0;
    while (pool.busy > 0) {
        pthread_cond_wait(&pool.idle, &pool.lock);
    }
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.job);
}

static void pool_after_fork(void) { /* the child has none of the parent's workers */
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.job, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.idle, NULL);
    pool.workers = 0;
    pool.active = 0;
    pool.busy = 0;
}

/* -- Python interface ------------------------------------------------------------------------------------ */

typedef struct {
    const char *name;
    bn_task task;
} named_task;

static const named_task tasks[] = {
    {"train_channels", task_train_channels},
    {"backward_channels", task_backward_channels},
    {"affine_channels", task_affine_channels},
    {"column_sums", task_column_sums},
    {"grad_sums", task_grad_sums},
    {"affine_rows", task_affine_rows},
    {"dx_rows", task_dx_rows},
    {"serial_inference", task_serial_inference},
    {"serial_training", task_serial_training},
    {"serial_backward", task_serial_backward},
};

static int is_task(uintptr_t address) {
    for (size_t k = 0; k < sizeof(tasks) / sizeof(tasks[0]); ++k) {
        if ((uintptr_t)tasks[k].task == address) {
            return 1;
        }
    }
    return 0;
}

enum { MAX_ARRAYS = 16, MAX_SCALARS = 8 };

/* run(task, count, arrays, ints, reals, threads_or_runner): data = the arrays' addresses, then an int64 array of
 * ints and a float64 array of reals. threads_or_runner: an int runs the tasks on this file's pool with that many
 * threads (GIL released); else a callable runner(task, count, data address), e.g. onnxruntime's parallel_for. */
static PyObject *py_run(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long address;
    Py_ssize_t count;
    PyObject *arrays, *ints, *reals, *how;
    if (!PyArg_ParseTuple(args, "KnO!O!O!O", &address, &count, &PyTuple_Type, &arrays, &PyTuple_Type, &ints,
                          &PyTuple_Type, &reals, &how)) {
        return NULL;
    }
    if (!is_task((uintptr_t)address)) {
        PyErr_SetString(PyExc_ValueError, "not a task of this module");
        return NULL;
    }
    Py_ssize_t n_arrays = PyTuple_GET_SIZE(arrays), n_ints = PyTuple_GET_SIZE(ints), n_reals = PyTuple_GET_SIZE(reals);
    if (n_arrays > MAX_ARRAYS || n_ints > MAX_SCALARS || n_reals > MAX_SCALARS || count < 0) {
        PyErr_SetString(PyExc_ValueError, "too many arrays or scalars");
        return NULL;
    }
    int64_t int_values[MAX_SCALARS];
    double real_values[MAX_SCALARS];
    for (Py_ssize_t k = 0; k < n_ints; ++k) {
        int_values[k] = PyLong_AsLongLong(PyTuple_GET_ITEM(ints, k));
    }
    for (Py_ssize_t k = 0; k < n_reals; ++k) {
        real_values[k] = PyFloat_AsDouble(PyTuple_GET_ITEM(reals, k));
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer views[MAX_ARRAYS];
    void *data[MAX_ARRAYS + 2];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    for (; held < n_arrays; ++held) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(arrays, held), &views[held], PyBUF_C_CONTIGUOUS) != 0) {
            goto done;
        }
        data[held] = views[held].buf;
    }
    data[n_arrays] = int_values;
    data[n_arrays + 1] = real_values;
    atomic_store(&scratch_failed, 0);
    if (PyLong_Check(how)) {
        int threads = (int)PyLong_AsLong(how);
        if (threads == -1 && PyErr_Occurred()) {
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS pool_run((bn_task)(uintptr_t)address, data, (size_t)count, threads);
        Py_END_ALLOW_THREADS
    } else {
        PyObject *called = PyObject_CallFunction(how, "KnK", address, count, (unsigned long long)(uintptr_t)data);
        if (called == NULL) {
            goto done;
        }
        Py_DECREF(called);
    }
    if (atomic_exchange(&scratch_failed, 0)) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t k = 0; k < held; ++k) {
        PyBuffer_Release(&views[k]);
    }
    return result;
}

static PyObject *py_addresses(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *table = PyDict_New();
    if (table == NULL) {
        return NULL;
    }
    for (size_t k = 0; k < sizeof(tasks) / sizeof(tasks[0]); ++k) {
        PyObject *value = PyLong_FromUnsignedLongLong((uintptr_t)tasks[k].task);
        if (value == NULL || PyDict_SetItemString(table, tasks[k].name, value) != 0) {
            Py_XDECREF(value);
            Py_DECREF(table);
            return NULL;
        }
        Py_DECREF(value);
    }
    return table;
}

static PyObject *py_reductions(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(reductions_name);
}

static PyMethodDef methods[] = {
    {"reductions", py_reductions, METH_NOARGS, "The channel reductions picked for this process: avx2 or portable."},
    {"run", py_run, METH_VARARGS, "run(task, count, arrays, ints, reals, threads_or_runner): run count tasks."},
    {"addresses", py_addresses, METH_NOARGS, "{name: address} of the tasks."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpukernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpukernels(void) {
    static int registered = 0;
    if (!registered) {
        pick_reductions();
        pthread_atfork(NULL, NULL, pool_after_fork);
        registered = 1;
    }
    return PyModule_Create(&module);
}
