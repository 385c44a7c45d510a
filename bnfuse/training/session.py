"""Training a bnfuse training graph in a plain onnxruntime session, state kept between steps.

``TrainingSession(train_model)`` holds the parameters, running statistics and optimizer state as
onnxruntime OrtValues on the session's device. Each ``step`` binds them as inputs and binds the graph's
updated-state outputs to a second set of preallocated OrtValues (two IOBindings built once, used
alternately), so state never round-trips through host memory and no step allocates state tensors.
``export_inference_model()`` writes the trained weights and running statistics back into the inference
model, ready for ``bnfuse.optimize``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from bnfuse.errors import BnfuseError
from bnfuse.io import load_model, ort_compatible
from bnfuse.training import memory as training_memory

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
NCHWC = "com.microsoft.nchwc"
# Fewest output pixels per image for which a Conv runs as NCHWc: its weight is reordered in the graph on every
# step (a 6-D Transpose, ~3 ns per weight element), which the blocked kernel repays only where each weight element
# is used at enough positions (see nchwc_convs).
NCHWC_MIN_PIXELS = 64
_SHAPE_KEEPING_BN_OPS = ("BatchNormalizationTraining", "BatchNormalizationGrad")


def _intra_op_threads(options: Any) -> int:
    """The intra-op pool size of a session made with ``options`` (onnxruntime's default, 0, is one thread per
    core; the cores this process may run on stand in for it)."""
    threads = int(getattr(options, "intra_op_num_threads", 0) or 0)
    return threads if threads > 0 else len(os.sched_getaffinity(0))


class TrainingSession:
    """Runs optimizer steps of a training graph built by ``bnfuse.passes.training.build_training_graph``.

    providers: as for onnxruntime.InferenceSession (default CPU); state lives on CUDA when
    CUDAExecutionProvider comes first. session_options: the caller's onnxruntime.SessionOptions (threads,
    logging), with bnfuse's library registered into them when the graph has bnfuse ops; default: bnfuse's
    options (``bnfuse.runtime.session_options``) when the graph has bnfuse ops, else plain ones.
    memory: ``"lean"`` (default) or ``"speed"``: the onnxruntime settings (applied to ``session_options``, the
    caller's too) and the weight-gradient layout, see ``bnfuse.training.memory`` and docs/training.md "Memory".
    nchwc: on CPU, run the 2-D convolutions as onnxruntime's blocked-layout (NCHWc) kernels where the CPU
    has them (see ``nchwc_convs``). nchwc_weight_grads: with oneDNN, the Conv weight gradients read those
    kernels' NCHWc copy of X (up to ~2% faster, the copies held until the backward; ``blocked_weight_grads``
    counts them); default: only with ``memory="speed"``.
    kernel_threads: threads of bnfuse's CPU BN kernels (their C pool, cpu.kernel_threads) during a step where they
    cannot use the session's intra-op pool (onnxruntime < 1.17; with 1.17+ large BN tensors run as tasks on that
    pool and smaller ones on the calling thread, docs/ops.md "Execution"). None: all cores. Default 1: a second
    pool beside onnxruntime's (then numba's OpenMP workers, spinning after each kernel) slowed a ResNet step ~8%.
    weight_grad_threads: on CPU, the thread count bnfuse.ConvWeightGrad / ConvInputGrad nodes split their work for
    (default: the pool's thread count; 1: one thread per gradient): chunks of the batch (more than the threads where
    a chunk's X and dY would pass 16 MiB) or, where the activations are small next to the weight, of the channels
    or groups (conv_grad.split), run as tasks on the session's intra-op pool. The bits depend on the count
    (batch partials are added in chunk order), not on the pool.
    comm: for a distributed graph (``train-graph --distributed``), an mpi4py communicator (or a
    ``bnfuse.runtime.collectives`` one): every rank checks it runs the same step, starts from rank 0's state
    and runs its collectives on it (see ``bnfuse.training.distributed``). watchdog_s: with ``comm``, a step
    running longer than this ends the job (default 300 s; 0 turns it off).
    intra_op_threads: onnxruntime's intra-op threads (set on ``session_options``). None: the options' own setting;
    where that is onnxruntime's default (0: every core) and ``comm`` puts several ranks on this machine, each rank
    takes its share of the cores (``distributed.thread_share``), as torchrun does. ``threads_note`` says which.
    """

    def __init__(
        self,
        train_model: onnx.ModelProto | str | os.PathLike[str],
        providers: Sequence[Any] | None = None,
        *,
        lr: float = 0.01,
        session_options: Any = None,
        memory: str = training_memory.DEFAULT,
        nchwc: bool = True,
        nchwc_weight_grads: bool | None = None,
        kernel_threads: int | None = 1,
        weight_grad_threads: int | None = None,
        comm: Any = None,
        watchdog_s: float | None = None,
        intra_op_threads: int | None = None,
    ) -> None:
        import onnxruntime

        from bnfuse.passes.training.spec import read_spec

        self.memory = training_memory.check_mode(memory)
        if nchwc_weight_grads is None:
            nchwc_weight_grads = training_memory.nchwc_weight_grads(memory)
        model = train_model if isinstance(train_model, onnx.ModelProto) else load_model(train_model, check=False)
        self._model = model
        self.spec = read_spec(model)
        lr_type = next((i.type.tensor_type.elem_type for i in model.graph.input if i.name == self.spec.lr), None)
        if lr_type == onnx.TensorProto.DOUBLE:  # built from a float64 model: an oracle's graph, not onnxruntime's
            raise BnfuseError(
                "this training graph is float64 (built from a float64 model): onnxruntime's CPU provider and bnfuse's "
                "kernels run float32; export the model in float32 (float64 graphs are for the check in "
                "docs/training.md, 'Float64 verification')"
            )
        providers = list(providers) if providers is not None else [CPU]
        names = [p[0] if isinstance(p, tuple | list) else str(p) for p in providers]
        self.device = "cuda" if names and names[0] == CUDA and CUDA in onnxruntime.get_available_providers() else "cpu"

        initial = {t.name: t for t in model.graph.initializer if t.name in self.spec.state}
        missing = [n for n in self.spec.state if n not in initial]
        if missing:
            raise BnfuseError(f"training graph has no initial value for state {', '.join(missing[:3])}")
        # The session reads state from the bindings only: drop the initial values from its copy of the graph
        # (also keeps onnxruntime from holding a second copy of every weight).
        stripped = onnx.ModelProto()
        stripped.CopyFrom(model)
        keep = [t for t in stripped.graph.initializer if t.name not in self.spec.state]
        stripped.graph.ClearField("initializer")
        stripped.graph.initializer.extend(keep)
        ort_compatible(stripped)
        if self.device == "cuda":  # the fused optimizer step has a CPU kernel only: the same update in standard ops
            from bnfuse.passes.training.optimizers import expand_fused_steps

            expand_fused_steps(stripped)
        self.nchwc_convs = 0  # Conv nodes run as onnxruntime's NCHWc kernels
        if nchwc and self.device == "cpu" and (not names or names[0] == CPU):
            self.nchwc_convs = nchwc_convs(stripped, nchwc_block(), weight_grads=nchwc_weight_grads)
        # weight gradients reading the forward Conv's NCHWc copy of X (see _blocked_weight_grads)
        self.blocked_weight_grads = sum(
            any(a.name == "x_block" for a in n.attribute) for n in stripped.graph.node if n.op_type == "ConvWeightGrad"
        )
        uses_custom = any(node.domain == "bnfuse" for node in model.graph.node)
        self._kernel_threads = kernel_threads if uses_custom and self.device == "cpu" else None
        if session_options is None:
            if uses_custom:
                from bnfuse.runtime import session_options as bnfuse_options

                session_options = bnfuse_options(providers)
            else:
                session_options = onnxruntime.SessionOptions()
        elif uses_custom:  # the caller's options (threads, logging): the graph's ops must be known to them
            from bnfuse.runtime import register_library

            register_library(session_options, providers)
        if intra_op_threads is not None:
            if intra_op_threads < 1:
                raise BnfuseError(f"intra_op_threads must be >= 1, got {intra_op_threads}")
            session_options.intra_op_num_threads = intra_op_threads
        training_memory.apply(session_options, memory)
        self.comm = None
        self.threads_note: str | None = None  # how the intra-op threads were chosen, with comm
        if comm is not None:  # before the session: a rank with another graph must not start its collectives
            from bnfuse.training import distributed

            self.comm = distributed.attach(comm, model)
            if self.comm.rank:  # after the graph check: each rank its own dropout masks
                from bnfuse.passes.training.distribute import seed_dropout_for_rank

                seed_dropout_for_rank(stripped, self.comm.rank)
            session_options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
            share = distributed.thread_share(self.comm)  # collective: every rank passed attach
            if session_options.intra_op_num_threads > 0:
                self.threads_note = f"{session_options.intra_op_num_threads} onnxruntime threads per rank (as set)"
            elif share.local_ranks > 1:
                session_options.intra_op_num_threads = share.threads
                self.threads_note = share.describe()
            else:
                self.threads_note = "one rank on this machine: onnxruntime's default threads (one per core)"
        try:
            self._session = onnxruntime.InferenceSession(
                stripped.SerializeToString(), session_options, providers=providers
            )
        except Exception as exc:
            if "Domain already set" not in str(exc):
                raise
            raise BnfuseError(
                "these SessionOptions already had bnfuse's library registered by hand: build them with "
                "bnfuse.runtime.session_options(...) or pass options without the library"
            ) from exc

        # ConvWeightGrad nodes split their batch over the session's intra-op pool (conv_grad.onednn_threads).
        self._weight_grad_chunks = (
            weight_grad_threads or _intra_op_threads(session_options)
            if self.device == "cpu"
            and any(node.op_type in ("ConvWeightGrad", "ConvInputGrad") for node in model.graph.node)
            else None
        )
        self._ort = onnxruntime
        arrays = {name: numpy_helper.to_array(tensor) for name, tensor in initial.items()}
        self._buffers = [
            {name: self._device_value(arrays[name]) for name in self.spec.state},
            {name: self._empty(arrays[name].shape, arrays[name].dtype) for name in self.spec.state},
        ]
        self._lr_value = float(lr)
        self._lr = self._device_value(np.array(lr, np.float32))
        self._loss = self._empty((), np.float32)
        self._outputs = {o.name: o for o in self._session.get_outputs() if o.name in self.spec.outputs}
        # the data and target inputs' types and shapes, read by every step: get_inputs() lists every state input anew
        fed = {*self.spec.data, *self.spec.targets}
        self._fed_inputs = {i.name: i for i in self._session.get_inputs() if i.name in fed}
        self._bindings = [self._binding(src, dst) for src, dst in (self._buffers, self._buffers[::-1])]
        self._current = 0
        self.steps = 0
        self._watchdog: Any = None
        if self.comm is not None:
            from bnfuse.training import distributed

            self.load_state(distributed.broadcast_state(self.comm, self.state()))
            timeout = distributed.DEFAULT_WATCHDOG_S if watchdog_s is None else watchdog_s
            self._watchdog = distributed.Watchdog(self.comm, timeout) if timeout else None

    # --- buffers and bindings ---
    def _device_value(self, array: np.ndarray) -> Any:
        # np.require, not np.ascontiguousarray: that one turns a scalar (lr, adam.step) into shape (1,)
        return self._ort.OrtValue.ortvalue_from_numpy(np.require(array, requirements="C"), self.device, 0)

    def _empty(self, shape: Sequence[int], dtype: Any) -> Any:
        return self._ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device, 0)

    def _binding(self, source: Mapping[str, Any], target: Mapping[str, Any]) -> Any:
        binding = self._session.io_binding()
        for name, value in source.items():
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(self.spec.state[name], target[name])
        binding.bind_ortvalue_input(self.spec.lr, self._lr)
        binding.bind_ortvalue_output(self.spec.loss, self._loss)
        return binding

    # --- training ---
    @property
    def lr(self) -> float:
        return self._lr_value

    @lr.setter
    def lr(self, value: float) -> None:
        """A new learning rate for the next steps (a new scalar bound to both bindings)."""
        self._lr_value = float(value)
        self._lr = self._device_value(np.array(value, np.float32))
        for binding in self._bindings:
            binding.bind_ortvalue_input(self.spec.lr, self._lr)

    def step(self, inputs: np.ndarray | Mapping[str, np.ndarray], labels: np.ndarray) -> float:
        """One optimizer step on a batch; returns the loss (before the step, as PyTorch reports it). On a rank of
        several (``comm``) the batch is this rank's share of the step's and may be empty; the loss is the step's."""
        feeds = self._feeds(inputs)
        binding = self._bindings[self._current]
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        target = self.spec.targets[0]
        batch = len(next(iter(feeds.values())))
        binding.bind_cpu_input(target, self._target(target, labels, batch))
        with self._threads(), self._watchdog or contextlib.nullcontext():
            self._session.run_with_iobinding(binding)
        self._current ^= 1
        self.steps += 1
        return float(self._loss.numpy())

    def _threads(self) -> contextlib.AbstractContextManager[object]:
        if self._kernel_threads is None:  # no bnfuse CPU kernels in this graph
            return contextlib.nullcontext()
        from bnfuse.runtime.cpu import kernel_threads

        if self._weight_grad_chunks is None:
            return kernel_threads(self._kernel_threads)
        from bnfuse.runtime.conv_grad import onednn_threads

        stack = contextlib.ExitStack()
        stack.enter_context(kernel_threads(self._kernel_threads))
        stack.enter_context(onednn_threads(self._weight_grad_chunks))
        return stack

    def _feeds(self, inputs: np.ndarray | Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not isinstance(inputs, Mapping):
            if len(self.spec.data) != 1:
                raise BnfuseError(f"the model has {len(self.spec.data)} data inputs; pass a dict by name")
            inputs = {self.spec.data[0]: inputs}
        unknown = set(inputs) - set(self.spec.data)
        if unknown or len(inputs) != len(self.spec.data):
            raise BnfuseError(f"data inputs are {', '.join(self.spec.data)}; got {', '.join(sorted(inputs))}")
        expected = self._fed_inputs
        feeds = {}
        for name, array in inputs.items():
            array = np.ascontiguousarray(array, dtype=np.float32 if expected[name].type == "tensor(float)" else None)
            if not _fits(array.shape, expected[name].shape):
                raise BnfuseError(
                    f"input {name!r} has shape {list(array.shape)}, the graph needs {_shape_text(expected[name])}"
                )
            feeds[name] = array
        sizes = {len(array) if array.ndim else 0 for array in feeds.values()}
        if 0 in sizes and (self.comm is None or self.comm.size == 1):  # a rank of many may hold none: BN merges
            raise BnfuseError("empty batch: a step needs at least one sample (BN statistics of no samples are NaN)")
        if len(sizes) != 1:
            raise BnfuseError(f"data inputs have different batch sizes ({', '.join(map(str, sorted(sizes)))})")
        return feeds

    def _target(self, name: str, labels: np.ndarray, batch: int) -> np.ndarray:
        info = self._fed_inputs[name]
        dtype = np.int64 if info.type == "tensor(int64)" else np.float32
        array = np.ascontiguousarray(labels, dtype=dtype)
        if not _fits(array.shape, info.shape) or not array.ndim or len(array) != batch:
            raise BnfuseError(f"{name} has shape {list(array.shape)}, the graph needs {_shape_text(info, batch)}")
        return array

    @property
    def train_model(self) -> onnx.ModelProto:
        """The training graph this session runs (as given, with its initial state)."""
        return self._model

    @property
    def batch_size(self) -> int | None:
        """The graph's batch size: its static one, else the default it was built with (None if none was given)."""
        static = self.static_batch_size
        return static if static is not None else self.spec.batch_size

    @property
    def static_batch_size(self) -> int | None:
        """The only batch size a static graph takes; None for a dynamic batch dimension (any size from 1)."""
        first = self._fed_inputs[self.spec.data[0]].shape[0]
        return first if isinstance(first, int) else None

    # --- state ---
    def state(self) -> dict[str, np.ndarray]:
        """Current parameters, running statistics and optimizer state: host copies, never changed by later steps.

        (``OrtValue.numpy()`` is a view of the session's buffer on CPU, which the step after next overwrites.)
        """
        return {name: _host_copy(value) for name, value in self._buffers[self._current].items()}

    def parameters(self) -> dict[str, np.ndarray]:
        """Current trainable parameters (host copies, as ``state``)."""
        current = self._buffers[self._current]
        return {name: _host_copy(current[name]) for name in self.spec.parameters}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters and running statistics under the input model's names: for a PyTorch export, the module's
        ``state_dict()`` names, so ``net.load_state_dict({k: torch.from_numpy(v) ...}, strict=False)`` loads them.

        With a cumulative average (``bn.num_batches_tracked`` in the state), each ``<bn>.running_mean`` also
        gets its ``<bn>.num_batches_tracked`` (int64); otherwise PyTorch's counters are not part of the graph.
        """
        current = self.state()
        names = self.spec.parameters + self.spec.running_stats
        renamed = self.spec.original_names
        result = {name: current[name] for name in names if name not in renamed}
        for name in names:  # a BN's renamed copy of a shared tensor, under the name it read (kept names win)
            if name in renamed:
                result.setdefault(renamed[name], current[name])
        counters = [current[c] for c in self.spec.counters]
        if counters:
            tracked = np.array(round(float(counters[0])), np.int64)
            for name in [n for n in result if n.endswith(".running_mean")]:
                result[name.removesuffix("running_mean") + "num_batches_tracked"] = tracked.copy()
        return result

    def load_state(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite state tensors (by name) with host arrays."""
        current = self._buffers[self._current]
        for name, array in values.items():
            if name not in current:
                raise BnfuseError(f"{name!r} is not a state tensor of this training graph")
            old = current[name]
            array = np.require(array, dtype=old.numpy().dtype, requirements="C")
            if list(array.shape) != list(old.shape()):
                raise BnfuseError(f"state {name!r} has shape {old.shape()}, got {list(array.shape)}")
            if self.device == "cpu":
                old.update_inplace(array)
            else:
                current[name] = self._device_value(array)
        self._bindings = [self._binding(src, dst) for src, dst in (self._buffers, self._buffers[::-1])]

    def export_inference_model(self) -> onnx.ModelProto:
        """The inference model with the trained parameters and updated running statistics."""
        from bnfuse.passes.training.export import export_inference_model

        current = self._buffers[self._current]
        names = set(self.spec.parameters) | set(self.spec.running_stats)
        return export_inference_model(self._model, {n: _host_copy(current[n]) for n in names})


def _fits(shape: Sequence[int], declared: Sequence[Any]) -> bool:
    """Whether an array's shape matches a declared one (a symbolic or unknown dimension takes any size)."""
    if len(shape) != len(declared):
        return False
    return all(not isinstance(d, int) or d == s for s, d in zip(shape, declared, strict=True))


def _shape_text(info: Any, batch: int | None = None) -> str:
    """A declared shape for messages: symbolic dimensions as the batch size where known, else their names."""
    return "[" + ", ".join(str(d) if isinstance(d, int) else str(batch or d or "?") for d in info.shape) + "]"


def _host_copy(value: Any) -> np.ndarray:
    return np.array(value.numpy(), copy=True)


@functools.cache
def nchwc_block() -> int:
    """onnxruntime's NCHWc channel block on this CPU (16 with AVX-512, 8 with AVX2), 0 where it has none.

    The layout is onnxruntime's internal one, so the probe does not trust it: a small Conv rewritten by
    ``nchwc_convs`` must give the plain Conv's result (blocked and unblocked input paths), else 0 (no rewrite).
    """
    import onnxruntime
    from onnx import TensorProto, helper

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4

    def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
        session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=[CPU])
        return session.run(None, feeds)[0]

    probe = helper.make_graph(
        [helper.make_node("ReorderInput", ["x"], ["y"], domain=NCHWC)],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(NCHWC, 1)]
    try:
        block = int(
            run(helper.make_model(probe, opset_imports=opsets), {"x": np.zeros((1, 4, 1, 1), np.float32)}).shape[1]
        )
        if block <= 4:
            return 0
        rng = np.random.default_rng(0)
        for channels_in in (block, 3):
            conv = helper.make_graph(
                [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 0, 2, 1], strides=[1, 2])],
                "conv",
                [
                    helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, channels_in, 7, 6]),
                    helper.make_tensor_value_info("w", TensorProto.FLOAT, [block, channels_in, 3, 2]),
                ],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            )
            plain = helper.make_model(conv, opset_imports=opsets[:1])
            feeds = {
                "x": rng.standard_normal((2, channels_in, 7, 6)).astype(np.float32),
                "w": rng.standard_normal((block, channels_in, 3, 2)).astype(np.float32),
            }
            blocked = onnx.ModelProto()
            blocked.CopyFrom(plain)
            if nchwc_convs(blocked, block) != 1 or not np.allclose(run(blocked, feeds), run(plain, feeds), 1e-4, 1e-4):
                return 0
    except Exception:  # noqa: BLE001 - a build or CPU without the NCHWc kernels, or a changed layout
        return 0
    return block


def nchwc_convs(
    model: onnx.ModelProto, block: int, *, weight_grads: bool = False, min_pixels: int | None = None
) -> int:
    """Rewrite 2-D, ungrouped, non-1x1 Conv nodes as onnxruntime's NCHWc Conv between ReorderInput /
    ReorderOutput, the weight reordered in the graph (OIHWBiBo, or OIHWBo for inputs narrower than a block).

    onnxruntime applies this layout itself only to constant weights; a training graph's weights are inputs, so
    its convolutions (forward and stride-1 input gradients) run as im2col + GEMM, ~1.8x slower on ResNet shapes
    (measured: [32, 16, 32, 32] 3x3 1.17 -> 0.64 ms with the reorders). 1x1 kernels stay: the reorders cost
    more than they save, and so do maps of fewer than ``min_pixels`` output pixels per image (default
    NCHWC_MIN_PIXELS): the weight's reorder, a 6-D Transpose on every step, cost 7 ms for a 512x512x3x3 weight
    whose blocked Conv took 0.7 ms at [4, 512, 2, 2] (torchvision resnet18 at 64x64; its step went 127 -> 76 ms at
    1 thread, bench/RESULTS.md). Output shapes come from onnx's shape inference, seeing bnfuse's BN nodes as
    Identity; an unknown one keeps the rewrite. Channels must be multiples of the block (no padded channels).
    ``weight_grads``: point the ConvWeightGrad nodes at the NCHWc copies of X made here (see _blocked_weight_grads).
    Returns the count."""
    from onnx import helper, numpy_helper

    if block <= 1:
        return 0
    graph = model.graph
    inferred = onnx.shape_inference.infer_shapes(_inferable(model))
    shapes = {
        v.name: [d.dim_value if d.HasField("dim_value") else 0 for d in v.type.tensor_type.shape.dim]
        for v in [*inferred.graph.input, *inferred.graph.value_info]
        if v.type.tensor_type.HasField("shape")
    }
    shapes.update({t.name: list(t.dims) for t in graph.initializer})
    nodes: list[onnx.NodeProto] = []
    blocked_copies: dict[str, str] = {}  # a Conv input -> its NCHWc copy (ReorderInput's output)
    count = 0
    for node in graph.node:
        ws = shapes.get(node.input[1]) if node.op_type == "Conv" and node.domain in ("", "ai.onnx") else None
        ys = shapes.get(node.output[0], [])
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (
            ws is None
            or len(ws) != 4
            or not all(ws)
            or attrs.get("group", 1) != 1
            or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET")
            or ws[2] * ws[3] == 1
            or ws[0] % block
            or (ws[1] % block and ws[1] >= block)
            or _output_pixels(ys) < (NCHWC_MIN_PIXELS if min_pixels is None else min_pixels)
        ):
            nodes.append(node)
            continue
        co, ci, kh, kw = ws
        stem = f"{node.name or node.output[0]}_nchwc"
        blocked_input = ci % block == 0  # else OIHWBo: NCHW input read directly (e.g. 3-channel images)
        if blocked_input:
            split, perm = [co // block, block, ci // block, block, kh, kw], [0, 2, 4, 5, 3, 1]
        else:
            split, perm = [co // block, block, ci, kh, kw], [0, 2, 3, 4, 1]
        constants = {f"{stem}_split": split, f"{stem}_shape": ws}
        graph.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), k) for k, v in constants.items())
        w = node.input[1]
        nodes += [
            helper.make_node("Reshape", [w, f"{stem}_split"], [f"{stem}_w0"]),
            helper.make_node("Transpose", [f"{stem}_w0"], [f"{stem}_w1"], perm=perm),
            helper.make_node("Reshape", [f"{stem}_w1", f"{stem}_shape"], [f"{stem}_w"]),
        ]
        x = node.input[0]
        if blocked_input:
            nodes.append(helper.make_node("ReorderInput", [x], [f"{stem}_x"], domain=NCHWC))
            blocked_copies.setdefault(x, f"{stem}_x")
            x = f"{stem}_x"
        inputs = [x, f"{stem}_w", *node.input[2:3]]
        keep = {k: v for k, v in attrs.items() if k in ("dilations", "kernel_shape", "pads", "strides")}
        nodes.append(helper.make_node("Conv", inputs, [f"{stem}_y"], domain=NCHWC, **keep))
        nodes.append(helper.make_node("ReorderOutput", [f"{stem}_y"], [node.output[0]], domain=NCHWC, channels=co))
        count += 1
    if count:
        if weight_grads:
            _blocked_weight_grads(nodes, blocked_copies, block)
        graph.ClearField("node")
        graph.node.extend(nodes)
        if not any(o.domain == NCHWC for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(NCHWC, 1))
    return count


def _output_pixels(shape: Sequence[int]) -> float:
    """Output pixels per image of a Conv output shape [N, C, *spatial]; unknown: infinite (the rewrite applies)."""
    if len(shape) < 3 or not all(shape[2:]):
        return float("inf")
    return float(np.prod(shape[2:]))


def _inferable(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` that onnx's shape inference sees through: bnfuse's BN nodes (first output shaped as
    their first input) become Identity, so the shapes past them (every Conv after a BN) are inferred."""
    from onnx import helper

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for index, node in enumerate(copy.graph.node):
        if node.domain == "bnfuse" and node.op_type in _SHAPE_KEEPING_BN_OPS:
            copy.graph.node[index].CopyFrom(helper.make_node("Identity", [node.input[0]], [node.output[0]]))
    return copy


def _blocked_weight_grads(nodes: list[onnx.NodeProto], blocked_copies: dict[str, str], block: int) -> int:
    """Point each 2-D, ungrouped bnfuse.ConvWeightGrad whose X has an NCHWc copy (made for a forward Conv) at that
    copy (attribute x_block): oneDNN reads the blocked layout it computes in, instead of reordering plain X on every
    call. Only where oneDNN runs here (the NumPy fallback needs plain X). Returns how many."""
    from onnx import helper

    from bnfuse.runtime import conv_grad

    if not blocked_copies or not conv_grad.available():
        return 0
    count = 0
    for node in nodes:
        if node.domain != conv_grad.DOMAIN or node.op_type != conv_grad.OP or node.input[0] not in blocked_copies:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("group", 1) != 1 or len(attrs.get("kernel_shape", ())) != 2 or attrs.get("x_block", 0):
            continue
        node.input[0] = blocked_copies[node.input[0]]
        node.attribute.append(helper.make_attribute("x_block", block))
        count += 1
    return count
