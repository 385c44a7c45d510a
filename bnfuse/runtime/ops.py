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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from bnfuse.runtime import schema
from bnfuse.runtime.semantics import BatchNormConfig, BatchNormError, Mode, param_shape

if TYPE_CHECKING:
    import onnx

DOMAIN = schema.DOMAIN
CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"

INFERENCE = schema.BN_INFERENCE.name
TRAINING = schema.BN_TRAINING.name
GRAD = schema.BN_GRAD.name
OP_NAMES = (INFERENCE, TRAINING, GRAD)

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
DTYPE_PAIRS: tuple[tuple[np.dtype, np.dtype], ...] = ((F32, F32), (F16, F16), (F16, F32))

# The ops' names, inputs, outputs and attributes come from the one schema (schema.py), which the native library reads
# as native/schema.h.
_SCHEMAS = {name: schema.BY_NAME[name] for name in OP_NAMES}
INPUT_NAMES = {op: tuple(v.name for v in s.inputs if not v.optional) for op, s in _SCHEMAS.items()}
# Optional inputs after those, all of type T: Grad's Y, the forward's activated output (activation "relu" only).
OPTIONAL_INPUT_NAMES = {op: tuple(v.name for v in s.inputs if v.optional) for op, s in _SCHEMAS.items()}
OUTPUT_NAMES = {op: tuple(v.name for v in s.outputs) for op, s in _SCHEMAS.items()}
# How many leading inputs / outputs have X's type T (the others have scale's type U; optional inputs are T).
_DATA_INPUTS = {op: sum(v.data and not v.optional for v in s.inputs) for op, s in _SCHEMAS.items()}
_DATA_OUTPUTS = {op: sum(v.data for v in s.outputs) for op, s in _SCHEMAS.items()}
_OPTIONAL_OUTPUTS = {op: frozenset(i for i, v in enumerate(s.outputs) if v.optional) for op, s in _SCHEMAS.items()}
_OPTIONAL_INPUTS = {op: frozenset(i for i, v in enumerate(s.inputs) if v.optional) for op, s in _SCHEMAS.items()}

# Attributes each op reads, with their defaults (docs/ops.md lists them with their meaning); a float default is
# the float32 an attribute holds, so a node without it computes what a node writing it does. Grad accepts epsilon
# (nodes may copy the training node's attributes) but never uses it: saved_inv_std already includes it.
ATTRIBUTES: dict[str, dict[str, float | int | str]] = {op: dict(s.defaults) for op, s in _SCHEMAS.items()}  # type: ignore[misc]
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
    calls: list[KernelCall] = []
    with _recorders_lock:
        _recorders.append(calls)
    try:
        yield calls
    finally:
        with _recorders_lock:
            _recorders.remove(calls)


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


@dataclass
class BatchNormKernel:
    """One node's kernel: its parsed config, its registered types, and the kernel module it calls."""

    spec: OpSpec
    node: str
    config: BatchNormConfig
    kernels: Any = field(repr=False)
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
        return BatchNormKernel(self, node, config, kernels)


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
