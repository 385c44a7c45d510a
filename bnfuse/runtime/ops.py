"""bnfuse's custom ops for onnxruntime (domain ``bnfuse``, version 1): what each op is and does.

For every op: its name, inputs and outputs with their element types, its attributes (parsed once per
node into a :class:`~bnfuse.runtime.semantics.BatchNormConfig`), the shapes of its outputs, and the
kernel call. The C ABI side (structs, callbacks, tensor views) is :mod:`bnfuse.runtime.ortabi`; the
math is the kernels' (:mod:`bnfuse.runtime.reference`, ``cpu``, ``cuda``). docs/ops.md documents the
ops for users.

Types: ``T`` (X, Y, dY, dX) is float32 or float16; ``U`` (scale, bias, statistics, dScale, dBias) is
float32 or float16. The registered pairs are (float32, float32), (float16, float16) and
(float16, float32), one kernel each per execution provider.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from bnfuse.attributes import onnx_float
from bnfuse.runtime.semantics import BatchNormConfig, BatchNormError, Mode, param_shape

if TYPE_CHECKING:
    import onnx

DOMAIN = "bnfuse"
CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"

INFERENCE = "BatchNormalizationInference"
TRAINING = "BatchNormalizationTraining"
GRAD = "BatchNormalizationGrad"
OP_NAMES = (INFERENCE, TRAINING, GRAD)

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
DTYPE_PAIRS: tuple[tuple[np.dtype, np.dtype], ...] = ((F32, F32), (F16, F16), (F16, F32))

INPUT_NAMES = {
    INFERENCE: ("X", "scale", "B", "mean", "var"),
    TRAINING: ("X", "scale", "B", "input_mean", "input_var"),
    GRAD: ("dY", "X", "scale", "saved_mean", "saved_inv_std"),
}
# Optional inputs after those, all of type T: Grad's Y, the forward's activated output (activation "relu" only).
OPTIONAL_INPUT_NAMES = {INFERENCE: (), TRAINING: (), GRAD: ("Y",)}
OUTPUT_NAMES = {
    INFERENCE: ("Y",),
    TRAINING: ("Y", "running_mean", "running_var", "saved_mean", "saved_inv_std", "batch_var"),
    GRAD: ("dX", "dScale", "dBias"),
}
# Which inputs / outputs have X's type T (the others have scale's type U).
_DATA_INPUTS = {INFERENCE: 1, TRAINING: 1, GRAD: 2}
_DATA_OUTPUTS = {INFERENCE: 1, TRAINING: 1, GRAD: 1}
_OPTIONAL_OUTPUTS = {INFERENCE: frozenset(), TRAINING: frozenset({5}), GRAD: frozenset()}
_OPTIONAL_INPUTS = {
    op: frozenset(range(len(INPUT_NAMES[op]), len(INPUT_NAMES[op]) + len(OPTIONAL_INPUT_NAMES[op])))
    for op in INPUT_NAMES
}

# Attributes each op reads, with their defaults (docs/ops.md lists them with their meaning); a float default is
# the float32 an attribute holds, so a node without it computes what a node writing it does.
ATTRIBUTES: dict[str, dict[str, float | int | str]] = {
    INFERENCE: {"epsilon": onnx_float(1e-5), "mode": "spatial", "axis": 1},
    TRAINING: {
        "epsilon": onnx_float(1e-5),
        "momentum": onnx_float(0.9),
        "momentum_convention": "onnx",
        "mode": "spatial",
        "axis": 1,
        "unbiased_running_var": 0,
        "fix_gamma": 0,
        "use_global_stats": 0,
        "activation": "none",
    },
    # Grad accepts epsilon (nodes may copy the training node's attributes) but never uses it: saved_inv_std
    # already includes it.
    GRAD: {
        "epsilon": onnx_float(1e-5),
        "mode": "spatial",
        "axis": 1,
        "use_global_stats": 0,
        "fix_gamma": 0,
        "activation": "none",
    },
}
_FLAGS = ("unbiased_running_var", "fix_gamma", "use_global_stats")


class AttributeSource(Protocol):
    """Read access to a node's attributes (ortabi.KernelInfo in a session)."""

    def float_attr(self, name: str, default: float) -> float: ...
    def int_attr(self, name: str, default: int) -> int: ...
    def string_attr(self, name: str, default: str) -> str: ...
    def node_name(self) -> str: ...


class Context(Protocol):
    """One kernel invocation (ortabi.KernelContext in a session)."""

    on_gpu: bool

    def output_count(self) -> int: ...
    def input_arrays(self, count: int) -> Sequence[Any]: ...
    def output_arrays(
        self, shapes: tuple[tuple[int, ...] | None, ...], dtypes: Sequence[np.dtype]
    ) -> Sequence[Any]: ...
    def gpu_stream(self) -> int: ...


def parse_config(op: str, attributes: AttributeSource) -> BatchNormConfig:
    """The node's attributes as a BatchNormConfig; a bad value raises BatchNormError naming it."""
    defaults = ATTRIBUTES[op]
    values: dict[str, Any] = {}
    for name, default in defaults.items():
        if isinstance(default, float):
            values[name] = attributes.float_attr(name, default)
        elif isinstance(default, int):
            values[name] = attributes.int_attr(name, default)
        else:
            values[name] = attributes.string_attr(name, default)
    for flag in _FLAGS:
        if flag in values:
            if values[flag] not in (0, 1):
                raise BatchNormError(f"{op}: attribute {flag} must be 0 or 1, got {values[flag]}")
            values[flag] = bool(values[flag])
    try:
        values["mode"] = Mode(str(values["mode"]).lower())
    except ValueError:
        choices = " or ".join(repr(m.value) for m in Mode)
        raise BatchNormError(f"{op}: attribute mode must be {choices}, got {values['mode']!r}") from None
    if "momentum_convention" in values:  # kept a string: "mindspore" also implies MindSpore's epsilon range
        values["momentum_convention"] = str(values["momentum_convention"])
    if op == INFERENCE and attributes.string_attr("activation", "none") != "none":
        # not an attribute of the op, but looked up by name: a fused activation silently dropped gives wrong outputs
        raise BatchNormError(f"{op}: has no attribute activation (fold BN into the preceding op instead)")
    try:
        return BatchNormConfig(**values)
    except BatchNormError as exc:
        raise BatchNormError(f"{op}: {exc}") from None


# -- kernel backends ------------------------------------------------------------------------------------


def kernel_module(provider: str) -> Any:
    """The module whose forward_inference / forward_training / backward run on ``provider``."""
    from bnfuse.runtime import kernels

    return kernels.backend("cuda" if provider == CUDA else "cpu")


# -- debug hook: which buffers the kernels saw ----------------------------------------------------------


@dataclass(frozen=True)
class KernelCall:
    """The data addresses of the arrays one kernel call received (inputs) and wrote (outputs)."""

    op: str
    node: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    stream: int = 0  # CUDA EP: the stream the kernel ran on (CuPy's current stream inside the call)
    ort_stream: int = 0  # CUDA EP: ORT's compute stream for the call


_recorders: list[list[KernelCall]] = []
_recorders_lock = threading.Lock()


@contextlib.contextmanager
def record_addresses() -> Iterator[list[KernelCall]]:
    """Record every kernel call's input and output addresses while the block runs (zero-copy proof)."""
    from bnfuse.runtime import ortabi

    calls: list[KernelCall] = []
    with _recorders_lock:
        _recorders.append(calls)
        ortabi.set_fast_path(False)  # the C fast path never reaches Python: record through the Python path
    try:
        yield calls
    finally:
        with _recorders_lock:
            _recorders.remove(calls)
            if not _recorders:
                ortabi.set_fast_path(True)


def array_address(array: Any) -> int:
    """Where an array's data starts: NumPy via the array interface, CuPy via its device pointer."""
    if isinstance(array, np.ndarray):
        return int(array.__array_interface__["data"][0])
    return int(array.data.ptr)


def _record(op: str, node: str, inputs: Sequence[Any], outputs: Sequence[Any], streams: tuple[int, int]) -> None:
    call = KernelCall(
        op,
        node,
        tuple(array_address(a) for a in inputs if a is not None),
        tuple(array_address(a) for a in outputs if a is not None),
        *streams,
    )
    with _recorders_lock:
        for calls in _recorders:
            calls.append(call)


# -- kernels ---------------------------------------------------------------------------------------------


def _check_shapes(op: str, config: BatchNormConfig, inputs: Sequence[Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate ranks and shapes of an op's inputs; returns (X's shape, the parameters' shape)."""
    names = INPUT_NAMES[op] + OPTIONAL_INPUT_NAMES[op]
    data_count = _DATA_INPUTS[op]
    x_shape = inputs[data_count - 1].shape  # X is the last leading data input (GRAD: dY, X; then the optional Y)
    try:
        expected = param_shape(config, x_shape)
    except BatchNormError as exc:
        raise BatchNormError(f"{op}: X has shape {x_shape}: {exc}") from None
    for index, array in enumerate(inputs):
        if array is None:  # a missing optional input
            continue
        wanted = x_shape if index < data_count or index in _OPTIONAL_INPUTS[op] else expected
        if array.shape != wanted:
            raise BatchNormError(
                f"{op}: {names[index]} has shape {array.shape}, expected {wanted} "
                f"(mode {config.mode.value}, axis {config.axis}, X shape {x_shape})"
            )
    return x_shape, expected


@dataclass(frozen=True)
class FastPath:
    """A node's path in the entry library (ortabi.FastPath; ortentry.c's bnfuse_plan): the BN ops' small-tensor
    path (entry: a cpu_entry C function), or a fused optimizer step's (optimizer_ops.py: entry 0, op 3 / 4, the
    hyperparameters in ``hyper``)."""

    entry: int
    op: int
    per_activation: bool = False
    axis: int = 0
    below_bytes: int = 0
    flags: int = 0
    epsilon: float = 0.0
    weight: float = 0.0
    hyper: tuple[float, ...] = ()
    parameters: int = 0


_FAST_OPS = {INFERENCE: (0, "forward_inference"), TRAINING: (1, "forward_training"), GRAD: (2, "backward")}


def fast_path(spec: OpSpec, config: BatchNormConfig, kernels: Any) -> FastPath | None:
    """The C fast path for a float32 node on the CPU provider running bnfuse's own CPU kernels, else None.

    It runs cpu.py's serial small-tensor functions: a kernel module or function replaced at run time (a
    test double, a spy) is called through Python instead.
    """
    if spec.name not in _FAST_OPS or spec.provider != CPU or spec.data_dtype != F32 or spec.param_dtype != F32:
        return None  # ops added later (e.g. collectives) take the Python path unless given a fast path here
    from bnfuse.runtime import cpu, cpu_entry

    code, function = _FAST_OPS[spec.name]
    if kernels is not cpu or getattr(cpu, function) is not cpu.DEFINED_KERNELS[function]:
        return None
    flags = (
        cpu_entry.UNBIASED * config.unbiased_running_var
        + cpu_entry.FIX_GAMMA * config.fix_gamma
        + cpu_entry.GLOBAL_STATS * config.use_global_stats
        + cpu_entry.RELU * (config.activation == "relu")
    )
    return FastPath(
        entry=cpu_entry.entry_address(function),
        op=code,
        per_activation=config.mode is Mode.PER_ACTIVATION,
        axis=config.axis,
        below_bytes=cpu.POOL_FROM_BYTES,  # the serial functions run up to where the pool starts to pay
        flags=int(flags),
        epsilon=float(config.epsilon),
        weight=float(config.batch_weight),
    )


@dataclass
class BatchNormKernel:
    """One node's kernel: its parsed config, its registered types, and the kernel module it calls."""

    spec: OpSpec
    node: str
    config: BatchNormConfig
    kernels: Any = field(repr=False)
    fast_path: FastPath | None = None
    # Per-node facts looked up on the first call, then reused: the hot path stays short.
    _input_count: int = field(init=False, repr=False)
    _output_dtypes: tuple[np.dtype, ...] = field(init=False, repr=False)
    _with_batch_var: bool | None = field(default=None, init=False, repr=False)
    _shapes: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict, init=False, repr=False)
    _on_pool: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._input_count = len(INPUT_NAMES[self.spec.name]) + len(OPTIONAL_INPUT_NAMES[self.spec.name])
        self._output_dtypes = self.spec.output_dtypes
        self._on_pool = getattr(self.kernels, "on_pool", None)  # cpu.py has it; the reference kernels do not

    def compute(self, context: Context) -> None:
        inputs = context.input_arrays(self._input_count)
        shapes = tuple(None if a is None else a.shape for a in inputs)  # GRAD's Y is optional
        checked = self._shapes.get(shapes)
        if checked is None:
            checked = _check_shapes(self.spec.name, self.config, inputs)
            if len(self._shapes) >= 64:
                self._shapes.clear()
            self._shapes[shapes] = checked
        streams = (0, 0)
        if context.on_gpu:
            with _on_stream(context, inputs[0]):
                outputs = self._run(context, inputs, *checked)
                if _recorders:
                    import cupy

                    streams = (int(cupy.cuda.get_current_stream().ptr), int(context.gpu_stream()))
        elif self._on_pool is not None:  # the CPU kernels' parallel loops on the session's intra-op pool
            with self._on_pool(context.parallel_for):
                outputs = self._run(context, inputs, *checked)
        else:
            outputs = self._run(context, inputs, *checked)
        if _recorders:
            _record(self.spec.name, self.node, inputs, outputs, streams)

    def _run(self, context: Context, inputs: Sequence[Any], x_shape: tuple, p_shape: tuple) -> Sequence[Any]:
        kernels, config, op, dtypes = self.kernels, self.config, self.spec.name, self._output_dtypes
        if op == INFERENCE:
            outputs = context.output_arrays((x_shape,), dtypes)
            _require_written(op, outputs, (kernels.forward_inference(*inputs, config, out=outputs[0]),))
            return outputs
        if op == TRAINING:
            if self._with_batch_var is None:
                self._with_batch_var = context.output_count() > 5
            shapes = (x_shape, p_shape, p_shape, p_shape, p_shape, p_shape if self._with_batch_var else None)
            outputs = context.output_arrays(shapes, dtypes)
            if not math.prod(x_shape):  # no samples: nothing to normalize, the statistics stay as they are
                _empty_batch(outputs, running=inputs[3:5])
                return outputs
            # batch_var is optional in the graph but not for the kernels: give them scratch space.
            written = (*outputs[:5], outputs[5] if outputs[5] is not None else _empty_like(outputs[1]))
            result = kernels.forward_training(*inputs, config, out=_training_outputs(*written))
            _require_written(op, written, result)
            return outputs
        y = inputs[5]
        if (y is not None) != (config.activation == "relu"):
            raise BatchNormError(f'{op}: input Y goes with activation "relu" only (activation: {config.activation!r})')
        outputs = context.output_arrays((x_shape, p_shape, p_shape), dtypes)
        if not math.prod(x_shape):  # no samples: no gradient
            _empty_batch(outputs)
            return outputs
        activated = () if y is None else (y,)
        result = kernels.backward(*inputs[:5], config, *activated, out=_grad_outputs(*outputs))
        _require_written(op, outputs, result)
        return outputs


def _empty_batch(outputs: Sequence[Any], running: Sequence[Any] = ()) -> None:
    """The outputs of a BN op on an empty batch (no NaN from a mean of nothing): the running statistics passed
    through unchanged, every other per-channel output (saved / batch statistics, gradients) zero."""
    for index, array in enumerate(outputs[1:], start=1):
        if array is not None:
            array[...] = running[index - 1] if index - 1 < len(running) else 0


def _training_outputs(*arrays: Any) -> Any:
    from bnfuse.runtime.kernel_types import TrainingOutputs

    return TrainingOutputs(*arrays)


def _grad_outputs(*arrays: Any) -> Any:
    from bnfuse.runtime.kernel_types import GradOutputs

    return GradOutputs(*arrays)


def _require_written(op: str, outputs: Sequence[Any], result: Sequence[Any]) -> None:
    """The kernels promise to write into ``out``; an output array they replaced would reach ORT unwritten."""
    for index, (given, returned) in enumerate(zip(outputs, result, strict=True)):
        if returned is not given and array_address(returned) != array_address(given):
            raise RuntimeError(f"{op}: kernel returned a new array for output {index} instead of writing into it")


def _empty_like(array: Any) -> Any:
    if isinstance(array, np.ndarray):
        return np.empty_like(array)
    import cupy

    return cupy.empty_like(array)


@contextlib.contextmanager
def _on_stream(context: Context, first_input: Any) -> Iterator[None]:
    """On the CUDA EP, run the kernel on the device of its inputs and on ORT's compute stream."""
    if not context.on_gpu:
        yield
        return
    import cupy

    with first_input.device, cupy.cuda.ExternalStream(context.gpu_stream()):
        yield


# -- op specs ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpSpec:
    """One registered kernel: an op name on one execution provider for one (T, U) type pair."""

    name: str
    provider: str
    data_dtype: np.dtype
    param_dtype: np.dtype

    @property
    def input_dtypes(self) -> tuple[np.dtype, ...]:
        count = len(INPUT_NAMES[self.name])
        data = _DATA_INPUTS[self.name]
        optional = (self.data_dtype,) * len(_OPTIONAL_INPUTS[self.name])
        return (self.data_dtype,) * data + (self.param_dtype,) * (count - data) + optional

    @property
    def output_dtypes(self) -> tuple[np.dtype, ...]:
        count = len(OUTPUT_NAMES[self.name])
        data = _DATA_OUTPUTS[self.name]
        return (self.data_dtype,) * data + (self.param_dtype,) * (count - data)

    @property
    def optional_outputs(self) -> frozenset[int]:
        return _OPTIONAL_OUTPUTS[self.name]

    @property
    def optional_inputs(self) -> frozenset[int]:
        return _OPTIONAL_INPUTS[self.name]

    def create_kernel(self, attributes: AttributeSource) -> BatchNormKernel:
        config = parse_config(self.name, attributes)
        counted = getattr(attributes, "input_count", None)  # ortabi.KernelInfo has it
        if self.name == GRAD and config.activation == "none" and counted is not None and counted() > 5:
            raise BatchNormError(f'{GRAD}: input Y goes with activation "relu" only (activation: none)')
        kernels = kernel_module(self.provider)
        node = attributes.node_name()
        return BatchNormKernel(self, node, config, kernels, fast_path(self, config, kernels))


def single_op_model(
    op: str,
    *,
    data_dtype: Any = np.float32,
    param_dtype: Any = None,
    x_shape: Sequence[int | str] | None = None,
    outputs: int | None = None,
    name: str = "bn",
    **attributes: Any,
) -> onnx.ModelProto:
    """A one-node ONNX model running ``op`` (inputs and outputs named as in :data:`INPUT_NAMES` /
    :data:`OUTPUT_NAMES`), loadable by onnxruntime with bnfuse's ops registered.

    ``outputs``: how many of the op's outputs the node has (Training: 5, or 6 with batch_var).
    ``x_shape`` (optional, may hold symbolic names) types X / dY / Y / dX; the other shapes stay open.
    """
    from onnx import TensorProto, helper

    from bnfuse.io import ort_compatible

    if op not in OP_NAMES:
        raise BatchNormError(f"unknown op {op!r} (expected one of {', '.join(OP_NAMES)})")
    data = np.dtype(data_dtype)
    param = data if param_dtype is None else np.dtype(param_dtype)
    codes = {F32: TensorProto.FLOAT, F16: TensorProto.FLOAT16, np.dtype(np.float64): TensorProto.DOUBLE}
    in_names, out_names = INPUT_NAMES[op], OUTPUT_NAMES[op]
    if op == GRAD and attributes.get("activation", "none") != "none":
        in_names = in_names + OPTIONAL_INPUT_NAMES[op]  # Y is read only with a fused activation
    out_names = out_names[: outputs if outputs is not None else (5 if op == TRAINING else len(out_names))]
    shape = list(x_shape) if x_shape is not None else None

    def info(names: Sequence[str], data: set[int]) -> list[onnx.ValueInfoProto]:
        return [
            helper.make_tensor_value_info(n, codes[data_t] if i in data else codes[param], shape if i in data else None)
            for i, n in enumerate(names)
        ]

    data_t = data
    data_inputs = set(range(_DATA_INPUTS[op])) | set(_OPTIONAL_INPUTS[op])
    node = helper.make_node(op, list(in_names), list(out_names), name=name, domain=DOMAIN, **attributes)
    graph = helper.make_graph([node], op, info(in_names, data_inputs), info(out_names, set(range(_DATA_OUTPUTS[op]))))
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)], producer_name="bnfuse"
    )
    return ort_compatible(model)


def available_providers() -> tuple[str, ...]:
    """The providers bnfuse has kernels for here: CPU, and CUDA where this onnxruntime has it and CuPy is
    installed (the CUDA kernels are CuPy kernels)."""
    import importlib.util

    import onnxruntime

    cuda = CUDA in onnxruntime.get_available_providers() and importlib.util.find_spec("cupy") is not None
    return (CPU, CUDA) if cuda else (CPU,)


_SPECS: dict[tuple[str, ...], tuple[OpSpec, ...]] = {}


def op_specs(providers: Iterable[str]) -> tuple[Any, ...]:
    """Every kernel to register for ``providers`` (the same objects on every call)."""
    key = tuple(p for p in (CPU, CUDA) if p in set(providers))
    if key not in _SPECS:
        from bnfuse.runtime.sync_ops import sync_op_specs

        _SPECS[key] = tuple(
            OpSpec(name, provider, data, param) for provider in key for name in OP_NAMES for data, param in DTYPE_PAIRS
        ) + sync_op_specs(key)  # the collective ops (SyncBN, all-reduce): see sync_ops.py
    return _SPECS[key]


_requested = threading.local()


@contextlib.contextmanager
def registering_for(providers: Iterable[str]) -> Iterator[None]:
    """Make RegisterCustomOps calls made by this thread register kernels for ``providers`` only."""
    previous = getattr(_requested, "providers", None)
    _requested.providers = tuple(providers)
    try:
        yield
    finally:
        _requested.providers = previous


def registration() -> tuple[str, Sequence[OpSpec]]:
    """What ortabi registers when onnxruntime calls RegisterCustomOps: the domain and its kernels (the BN ops,
    and on the CPU ConvWeightGrad, bnfuse/runtime/conv_grad.py, ConvInputGrad, conv_input_grad.py, and the optimizer
    steps, optimizer_ops.py)."""
    from bnfuse.runtime import conv_grad, conv_input_grad, optimizer_ops

    providers = getattr(_requested, "providers", None) or available_providers()
    return DOMAIN, (*op_specs(providers), *conv_grad.SPECS, *conv_input_grad.SPECS, *optimizer_ops.SPECS)
