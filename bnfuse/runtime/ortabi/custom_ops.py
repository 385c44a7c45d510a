"""bnfuse's custom ops as onnxruntime sees them: the ``OrtCustomOp`` structs with their descriptions (answered in
C by the entry library), each kernel's :class:`_Plan`, and :data:`_registry`, everything onnxruntime may call
back into, kept for the life of the process."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from bnfuse.runtime.ortabi.api import (
    CPU_PROVIDER,
    CUSTOM_OP_VERSION,
    ORT_INVALID_ARGUMENT,
    ORT_RUNTIME_EXCEPTION,
    OrtApi,
    OrtError,
    _p_vp,
)
from bnfuse.runtime.ortabi.kernel_info import KernelInfo
from bnfuse.runtime.ortabi.tensors import KernelContext, ViewCache, element_type

# OrtCustomOpInputOutputCharacteristic
INPUT_OUTPUT_REQUIRED = 0
INPUT_OUTPUT_OPTIONAL = 1
INPUT_OUTPUT_VARIADIC = 2


class Kernel(Protocol):
    def compute(self, context: KernelContext) -> None: ...


class OpSpec(Protocol):
    """What ops.py describes for each op; ortabi turns it into an OrtCustomOp."""

    name: str
    provider: str
    input_dtypes: tuple[np.dtype, ...]
    output_dtypes: tuple[np.dtype, ...]
    optional_outputs: frozenset[int]

    def create_kernel(self, info: KernelInfo) -> Kernel: ...


_CREATE_KERNEL = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_GET_STRING = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)  # never c_char_p: that restype leaks
_GET_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
_GET_COUNT = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)
_COMPUTE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
_DESTROY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_GET_INT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_CREATE_KERNEL_V2 = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, _p_vp)
_COMPUTE_V2 = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_INFER_SHAPE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


class _Plan(ctypes.Structure):
    """``bnfuse_plan`` of native/python_hook.c: one Python kernel; its address is the op_kernel onnxruntime holds."""

    _fields_ = [("python_compute", _COMPUTE_V2)]


class OrtCustomOp(ctypes.Structure):
    """``struct OrtCustomOp`` as in the public header; fields after InferOutputShapeFn are read by
    onnxruntime only for versions above 16 and stay NULL."""

    _fields_ = [
        ("version", ctypes.c_uint32),
        ("CreateKernel", _CREATE_KERNEL),
        ("GetName", _GET_STRING),
        ("GetExecutionProviderType", _GET_STRING),
        ("GetInputType", _GET_TYPE),
        ("GetInputTypeCount", _GET_COUNT),
        ("GetOutputType", _GET_TYPE),
        ("GetOutputTypeCount", _GET_COUNT),
        ("KernelCompute", _COMPUTE),
        ("KernelDestroy", _DESTROY),
        ("GetInputCharacteristic", _GET_TYPE),
        ("GetOutputCharacteristic", _GET_TYPE),
        ("GetInputMemoryType", _GET_TYPE),
        ("GetVariadicInputMinArity", _GET_INT),
        ("GetVariadicInputHomogeneity", _GET_INT),
        ("GetVariadicOutputMinArity", _GET_INT),
        ("GetVariadicOutputHomogeneity", _GET_INT),
        ("CreateKernelV2", _CREATE_KERNEL_V2),
        ("KernelComputeV2", _COMPUTE_V2),
        ("InferOutputShapeFn", _INFER_SHAPE),
        ("GetStartVersion", _GET_INT),
        ("GetEndVersion", _GET_INT),
        ("GetMayInplace", ctypes.c_void_p),
        ("ReleaseMayInplace", ctypes.c_void_p),
        ("GetAliasMap", ctypes.c_void_p),
        ("ReleaseAliasMap", ctypes.c_void_p),
    ]


class _Registry:
    """Everything onnxruntime may call back into, kept alive for the life of the process.

    Structs, name buffers and callbacks are created once per op spec; kernels are keyed by the address
    of their :class:`_Plan` (what ORT stores as ``void* op_kernel``).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.api: OrtApi | None = None
        self.ops: dict[int, tuple[OrtCustomOp, OpSpec, ctypes.Array, ctypes.Array]] = {}
        self.plans: dict[int, _Plan] = {}  # by kernel handle: each kernel's plan lives as long as the kernel
        self.kernels: dict[int, tuple[Kernel, bool, ViewCache, ViewCache]] = {}
        self.entry_functions: dict[str, int] = {}  # OrtCustomOp field -> the entry library's function (install())
        self.callbacks = self._make_callbacks()

    def _make_callbacks(self) -> dict[str, Any]:
        """The three entries that need Python: making, running and destroying a kernel. The entry library calls
        them (and only while the interpreter is not finalizing); it answers everything else about an op itself."""

        def spec(op: int) -> OpSpec:
            return self.ops[op][1]

        def create_kernel_v2(op: int, api: int, info: int, kernel_out: Any) -> int | None:
            try:
                definition = spec(op)
                kernel = definition.create_kernel(KernelInfo(self.ortapi(), info, definition.name))
                plan = _Plan(self.callbacks["KernelComputeV2"])
                handle = ctypes.addressof(plan)
                on_gpu = definition.provider != CPU_PROVIDER
                self.plans[handle] = plan
                self.kernels[handle] = (kernel, on_gpu, ViewCache(), ViewCache())
                kernel_out[0] = handle
                return None
            except BaseException as exc:  # noqa: B036 - nothing may unwind into onnxruntime
                return self.ortapi().make_status(_describe(exc), ORT_INVALID_ARGUMENT)

        def compute_v2(handle: int, context: int) -> int | None:
            try:
                kernel, on_gpu, inputs, outputs = self.kernels[handle]
                kernel.compute(KernelContext(self.api, context, on_gpu, inputs, outputs))
                return None
            except BaseException as exc:  # noqa: B036 - nothing may unwind into onnxruntime
                return self.ortapi().make_status(_describe(exc), ORT_RUNTIME_EXCEPTION)

        def destroy(handle: int) -> None:
            self.kernels.pop(handle, None)
            self.plans.pop(handle, None)

        return {
            "CreateKernelV2": _CREATE_KERNEL_V2(create_kernel_v2),
            "KernelComputeV2": _COMPUTE_V2(compute_v2),
            "KernelDestroy": _DESTROY(destroy),
        }

    def ortapi(self) -> OrtApi:
        assert self.api is not None, "onnxruntime has not called RegisterCustomOps yet"
        return self.api

    def custom_op(self, spec: OpSpec) -> int:
        """The address of the OrtCustomOp struct for ``spec`` (built on first use, then reused)."""
        for address, (_, known, _, _) in self.ops.items():
            if known is spec:
                return address
        description = _describe_op(spec)
        struct = description.op
        struct.version = CUSTOM_OP_VERSION
        # Every entry is the entry library's: it answers from the description, and calls the Python callbacks
        # (kernels) only while the interpreter is not finalizing.
        for field, function in self.entry_functions.items():
            setattr(struct, field, type(getattr(struct, field))(function))
        address = ctypes.addressof(struct)
        self.ops[address] = (struct, spec, description.keep_alive[0], description.keep_alive[1])
        return address

    def add_ops(self, api: OrtApi, domain: int, specs: Sequence[OpSpec]) -> None:
        """Add the ops of ``specs`` to ``domain`` (RegisterCustomOps' domain, which holds the native ops too)."""
        for spec in specs:
            api.check(api.CustomOpDomain_Add(domain, self.custom_op(spec)))


class _OpInfo(ctypes.Structure):
    """``bnfuse_op_info`` of native/python_hook.c: what onnxruntime asks of an op, answered in C."""

    _fields_ = [
        ("name", ctypes.c_void_p),
        ("provider", ctypes.c_void_p),
        ("inputs", ctypes.c_int64),
        ("outputs", ctypes.c_int64),
        ("input_types", ctypes.POINTER(ctypes.c_int32)),
        ("output_types", ctypes.POINTER(ctypes.c_int32)),
        ("input_characteristics", ctypes.POINTER(ctypes.c_int32)),
        ("output_characteristics", ctypes.POINTER(ctypes.c_int32)),
    ]


class _OpDescription(ctypes.Structure):
    """An OrtCustomOp (what onnxruntime holds a pointer to) followed by its description."""

    _fields_ = [("op", OrtCustomOp), ("info", _OpInfo)]


OP_INFO_OFFSET = _OpDescription.info.offset

# OrtCustomOp field -> the entry library's function onnxruntime calls there
_ENTRY_FUNCTIONS = {
    "GetName": "bnfuse_op_name",
    "GetExecutionProviderType": "bnfuse_op_provider",
    "GetInputType": "bnfuse_op_input_type",
    "GetInputTypeCount": "bnfuse_op_input_count",
    "GetOutputType": "bnfuse_op_output_type",
    "GetOutputTypeCount": "bnfuse_op_output_count",
    "GetInputCharacteristic": "bnfuse_op_input_characteristic",
    "GetOutputCharacteristic": "bnfuse_op_output_characteristic",
    "GetInputMemoryType": "bnfuse_op_input_memory_type",
    "GetVariadicInputMinArity": "bnfuse_op_one",
    "GetVariadicInputHomogeneity": "bnfuse_op_one",
    "GetVariadicOutputMinArity": "bnfuse_op_one",
    "GetVariadicOutputHomogeneity": "bnfuse_op_one",
    "CreateKernelV2": "bnfuse_create_kernel",
    "KernelComputeV2": "bnfuse_compute",
    "KernelDestroy": "bnfuse_destroy_kernel",
}


def _int32s(values: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_int32 * max(1, len(values)))(*values)


def _describe_op(spec: OpSpec) -> _OpDescription:
    """The OrtCustomOp struct of ``spec`` with its description after it (the arrays it points into are kept on it)."""
    variadic = getattr(spec, "variadic", False)  # one homogeneous list of at least one input / output

    def characteristics(count: int, optional: frozenset[int]) -> list[int]:
        if variadic:
            return [INPUT_OUTPUT_VARIADIC] * count
        return [INPUT_OUTPUT_OPTIONAL if i in optional else INPUT_OUTPUT_REQUIRED for i in range(count)]

    inputs, outputs = len(spec.input_dtypes), len(spec.output_dtypes)
    name = ctypes.create_string_buffer(spec.name.encode())
    provider = ctypes.create_string_buffer(spec.provider.encode())
    arrays = (
        _int32s([element_type(d) for d in spec.input_dtypes]),
        _int32s([element_type(d) for d in spec.output_dtypes]),
        _int32s(characteristics(inputs, getattr(spec, "optional_inputs", frozenset()))),
        _int32s(characteristics(outputs, spec.optional_outputs)),
    )
    description = _OpDescription()
    info = description.info
    info.name, info.provider = ctypes.addressof(name), ctypes.addressof(provider)
    info.inputs, info.outputs = inputs, outputs
    pointers = (ctypes.cast(a, ctypes.POINTER(ctypes.c_int32)) for a in arrays)
    info.input_types, info.output_types, info.input_characteristics, info.output_characteristics = pointers
    description.keep_alive = (name, provider, *arrays)
    return description


def _describe(exc: BaseException) -> str:
    message = str(exc) or type(exc).__name__
    return message if isinstance(exc, ValueError | OrtError) else f"{type(exc).__name__}: {message}"


def _keep_for_process(thing: object) -> None:
    """Keep ``thing`` (and all it references) alive until the process exits, whatever the order of teardown.

    One reference no object holds: neither clearing this module's globals at shutdown nor the final garbage
    collection frees it, so memory onnxruntime points into (op structs, plans, callbacks) outlives every session.
    """
    ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", ctypes.pythonapi))(thing)


_registry = _Registry()
_keep_for_process(_registry)
