"""onnxruntime's C ABI for bnfuse's custom ops: the only package of bnfuse that touches ctypes.

How the pieces meet:

* The custom-op library (``bnfuse/runtime/native/``, built as ``bnfuse/runtime/_ortentry*.so``) exports
  ``RegisterCustomOps`` and defines, creates and computes the native CPU ops in C, with or without Python. For the ops
  that stay in Python (the CuPy CUDA kernels, the MPI collective ops, ConvWeightGrad / ConvInputGrad) :func:`install`
  sets a hook through ctypes (loading the same path gives the handle onnxruntime dlopens); RegisterCustomOps calls
  it with the domain it fills, and the hook adds those ops to it.
* The hook builds ``OrtCustomOp`` structs (version 16: ``CreateKernelV2`` / ``KernelComputeV2``, so a Python
  exception becomes an ``OrtStatus`` that onnxruntime raises with our message) for the op specs it is given. Every
  function pointer in a struct is the library's (native/python_hook.c): onnxruntime's questions about the op (name,
  provider, types, characteristics) are answered in C from a description placed right after the struct
  (:class:`_OpDescription`); only creating, running and destroying a kernel reach Python.
* Kernels see ORT's own buffers: NumPy views over CPU tensors, CuPy arrays over CUDA device pointers,
  and the CUDA stream ORT computes on. A Python kernel's ``op_kernel`` is a :class:`_Plan` made once when ORT creates
  it; its hot path makes two C calls into the library (``bnfuse_read_inputs`` / ``bnfuse_make_outputs``, which call
  the OrtApi entries this package hands them: :class:`_HotPath`) instead of ~30 ctypes calls; views of an earlier
  call are reused when ORT passes the same buffers.
* Lifetime in someone else's process: onnxruntime calls the op structs, plans and callbacks for as long as a
  session using them exists, and sessions held in a runpy namespace, a cache or a reference cycle die in the
  interpreter's final garbage collection, after this package's globals are gone. So everything onnxruntime may
  call is kept for the life of the process (:func:`_keep_for_process`: the registry and the entry, never
  freed), and the library asks the interpreter before each call into Python: once it is finalizing,
  RegisterCustomOps registers the native ops only, a Python op's CreateKernelV2 and compute return an error status
  and its KernelDestroy returns at once (native/python_hook.c, ``bnfuse_set_python``).
* OpenMP's settings belong to whoever else runs in the process (PyTorch reads ``omp_get_max_threads`` for its
  intra-op threads): :func:`openmp_settings_kept` puts back every loaded OpenMP runtime's thread count, dynamic
  adjustment and nesting after code that may change them (an OpenMP layer may set them when it starts).

The package, one module per job (the only modules of bnfuse that touch ctypes):

* ``api.py``: the ``OrtApi`` function table (declared from the order of ``onnxruntime_c_api.h``), the C API
  versions asked for, error codes and :class:`OrtError`.
* ``tensors.py``: element types, NumPy / CuPy views over ORT's buffers, the entry library's per-call helpers and
  their tensor tables, :class:`KernelContext`.
* ``kernel_info.py``: :class:`KernelInfo`, a node's attributes.
* ``custom_ops.py``: the op specs' protocols, the ``OrtCustomOp`` structs and their descriptions, plans, and the
  registry of everything onnxruntime may call back into.
* ``entry.py``: loading the entry library, the RegisterCustomOps callback, the process-wide counters.
* ``openmp.py``: the OpenMP settings reader.

Every name is re-exported here, so ``ortabi.<name>`` reads as it did when this was one module. State that is
rebound after import (``_entry``, ``_hot``) is read from its owning module through :func:`__getattr__`; a test
that replaces a function a submodule calls patches that submodule (``ortabi.tensors.run_tasks``).
"""

from __future__ import annotations

from typing import Any

from bnfuse.runtime.ortabi.api import (
    _API_ENTRIES,
    _SIGNATURES,
    API_INDEX,
    API_VERSION,
    CPU_PROVIDER,
    CUDA_PROVIDER,
    CUSTOM_OP_VERSION,
    ORT_FAIL,
    ORT_INVALID_ARGUMENT,
    ORT_RUNTIME_EXCEPTION,
    PARALLEL_FOR_VERSION,
    OrtApi,
    OrtError,
    _p_size,
    _p_vp,
    _vp,
)
from bnfuse.runtime.ortabi.custom_ops import (
    _COMPUTE,
    _COMPUTE_V2,
    _CREATE_KERNEL,
    _CREATE_KERNEL_V2,
    _DESTROY,
    _ENTRY_FUNCTIONS,
    _GET_COUNT,
    _GET_INT,
    _GET_STRING,
    _GET_TYPE,
    _INFER_SHAPE,
    INPUT_OUTPUT_OPTIONAL,
    INPUT_OUTPUT_REQUIRED,
    INPUT_OUTPUT_VARIADIC,
    OP_INFO_OFFSET,
    Kernel,
    OpSpec,
    OrtCustomOp,
    _describe,
    _describe_op,
    _int32s,
    _keep_for_process,
    _OpDescription,
    _OpInfo,
    _Plan,
    _Registry,
    _registry,
)
from bnfuse.runtime.ortabi.entry import (
    _REGISTER,
    _SET_PYTHON,
    OpsProvider,
    _Entry,
    _entry_lock,
    _fallback_status,
    _finalizing_function,
    entry_library_path,
    install,
    live_kernel_count,
    native_call_count,
    ort_api,
    refused_call_count,
)
from bnfuse.runtime.ortabi.kernel_info import (
    _ABSENT_ATTRIBUTE,
    KernelInfo,
)
from bnfuse.runtime.ortabi.openmp import (
    _OPENMP_LIBRARIES,
    _loaded_openmp_runtimes,
    _openmp_handles,
    _openmp_settings_of,
    openmp_settings,
    openmp_settings_kept,
)
from bnfuse.runtime.ortabi.tensors import (
    _DATA,
    _DIMS,
    _DTYPES,
    _ELEMENT_TYPES,
    _OPTIONAL_TENSOR_API,
    _PADDING,
    _RANK,
    _TABLE_CALL,
    _TABLE_ROWS,
    _TASK,
    _TENSOR_API,
    _TYPE,
    _VALUE,
    ENTRY_ABI_VERSION,
    MAX_RANK,
    TENSOR_FIELDS,
    KernelContext,
    ViewCache,
    _ArrayInterface,
    _entry_address,
    _give_table,
    _HotPath,
    _output_rows,
    _rows_for,
    _tables,
    _take_table,
    _TensorApi,
    bind_hot_path,
    cupy_view,
    dtype_of,
    element_type,
    numpy_view,
    run_tasks,
)

# Every name of the one-module ortabi, private ones included (tests and docs reach them).
__all__ = [
    "_API_ENTRIES",
    "_SIGNATURES",
    "API_INDEX",
    "API_VERSION",
    "CPU_PROVIDER",
    "CUDA_PROVIDER",
    "CUSTOM_OP_VERSION",
    "ORT_FAIL",
    "ORT_INVALID_ARGUMENT",
    "ORT_RUNTIME_EXCEPTION",
    "PARALLEL_FOR_VERSION",
    "OrtApi",
    "OrtError",
    "_p_size",
    "_p_vp",
    "_vp",
    "_COMPUTE",
    "_COMPUTE_V2",
    "_CREATE_KERNEL",
    "_CREATE_KERNEL_V2",
    "_DESTROY",
    "_ENTRY_FUNCTIONS",
    "_GET_COUNT",
    "_GET_INT",
    "_GET_STRING",
    "_GET_TYPE",
    "_INFER_SHAPE",
    "INPUT_OUTPUT_OPTIONAL",
    "INPUT_OUTPUT_REQUIRED",
    "INPUT_OUTPUT_VARIADIC",
    "OP_INFO_OFFSET",
    "Kernel",
    "OpSpec",
    "OrtCustomOp",
    "_describe",
    "_describe_op",
    "_int32s",
    "_keep_for_process",
    "_OpDescription",
    "_OpInfo",
    "_Plan",
    "_Registry",
    "_registry",
    "_REGISTER",
    "_SET_PYTHON",
    "OpsProvider",
    "_Entry",
    "_entry_lock",
    "_fallback_status",
    "_finalizing_function",
    "entry_library_path",
    "install",
    "live_kernel_count",
    "native_call_count",
    "ort_api",
    "refused_call_count",
    "_ABSENT_ATTRIBUTE",
    "KernelInfo",
    "_OPENMP_LIBRARIES",
    "_loaded_openmp_runtimes",
    "_openmp_handles",
    "_openmp_settings_of",
    "openmp_settings",
    "openmp_settings_kept",
    "_DATA",
    "_DIMS",
    "_DTYPES",
    "_ELEMENT_TYPES",
    "_OPTIONAL_TENSOR_API",
    "_PADDING",
    "_RANK",
    "_TABLE_CALL",
    "_TABLE_ROWS",
    "_TASK",
    "_TENSOR_API",
    "_TYPE",
    "_VALUE",
    "ENTRY_ABI_VERSION",
    "MAX_RANK",
    "TENSOR_FIELDS",
    "KernelContext",
    "ViewCache",
    "_ArrayInterface",
    "_entry_address",
    "_give_table",
    "_HotPath",
    "_output_rows",
    "_rows_for",
    "_tables",
    "_take_table",
    "_TensorApi",
    "bind_hot_path",
    "cupy_view",
    "dtype_of",
    "element_type",
    "numpy_view",
    "run_tasks",
]

# Module state rebound after import: read where it lives, never a copy taken when this package was imported.
_REBOUND = {"_entry": "entry", "_hot": "tensors"}


def __getattr__(name: str) -> Any:
    owner = _REBOUND.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{owner}"), name)
