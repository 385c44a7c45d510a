"""bnfuse's custom ops in real onnxruntime sessions (CPU EP), against the NumPy reference kernels."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, RuntimeException

from bnfuse.io import ort_compatible
from bnfuse.runtime import ops, ortabi, reference, session_options
from bnfuse.runtime.semantics import BatchNormConfig, param_shape

CPU = ["CPUExecutionProvider"]
PAIRS = [(np.float32, np.float32), (np.float16, np.float16), (np.float16, np.float32)]


def make_session(op: str, data=np.float32, param=None, *, options=None, outputs=None, **attrs) -> ort.InferenceSession:
    model = ops.single_op_model(op, data_dtype=data, param_dtype=param, outputs=outputs, **attrs)
    return ort.InferenceSession(model.SerializeToString(), options or session_options(), providers=CPU)


def config_of(op: str, attrs: dict[str, Any]) -> BatchNormConfig:
    """The BatchNormConfig the op parses from ``attrs`` (through the same parser, fed from a dict)."""
    source = SimpleNamespace(
        float_attr=lambda n, d: float(attrs.get(n, d)),
        int_attr=lambda n, d: int(attrs.get(n, d)),
        string_attr=lambda n, d: str(attrs.get(n, d)),
        node_name=lambda: "bn",
    )
    return ops.parse_config(op, source)


def make_inputs(op: str, x_shape, config: BatchNormConfig, data, param, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    p_shape = param_shape(config, x_shape)
    x = (rng.standard_normal(x_shape) * 2 + 0.5).astype(data)
    scale = (rng.random(p_shape) + 0.5).astype(param)
    bias = rng.standard_normal(p_shape).astype(param)
    mean = (rng.standard_normal(p_shape) * 0.1).astype(param)
    var = (rng.random(p_shape) + 0.5).astype(param)
    if op == ops.GRAD:
        dy = rng.standard_normal(x_shape).astype(data)
        inv_std = (1.0 / np.sqrt(var.astype(np.float64) + 1.0)).astype(param)
        return dict(zip(ops.INPUT_NAMES[op], (dy, x, scale, mean, inv_std), strict=True))
    return dict(zip(ops.INPUT_NAMES[op], (x, scale, bias, mean, var), strict=True))


def expected(op: str, feeds: dict[str, np.ndarray], config: BatchNormConfig, outputs: int) -> list[np.ndarray]:
    args = list(feeds.values())
    if op == ops.INFERENCE:
        return [reference.forward_inference(*args, config)]
    if op == ops.TRAINING:
        return list(reference.forward_training(*args, config))[:outputs]
    return list(reference.backward(*args, config))


def check(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        tol = 2e-2 if g.dtype == np.float16 or w.dtype == np.float16 else 2e-5
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=tol, atol=tol)


# -- numerics: every op, every type pair, every attribute ------------------------------------------------

LAYOUTS = [
    ((4, 3, 5, 2), {}),
    ((3, 5, 2, 4), {"axis": -1}),
    ((6, 3, 4), {"mode": "per_activation"}),
    ((8, 5), {}),
]


@pytest.mark.parametrize(("data", "param"), PAIRS)
@pytest.mark.parametrize(("x_shape", "attrs"), LAYOUTS)
def test_inference_matches_reference(data, param, x_shape, attrs) -> None:
    attrs = {**attrs, "epsilon": 1e-3}
    config = config_of(ops.INFERENCE, attrs)
    feeds = make_inputs(ops.INFERENCE, x_shape, config, data, param)
    got = make_session(ops.INFERENCE, data, param, **attrs).run(None, feeds)
    check(got, expected(ops.INFERENCE, feeds, config, 1))


TRAINING_ATTRS = [
    {},
    {"momentum": 0.1, "momentum_convention": "pytorch", "unbiased_running_var": 1},
    {"momentum": 0.25, "momentum_convention": "cudnn", "epsilon": 1e-3},
    {"momentum": 0.9, "momentum_convention": "mxnet", "fix_gamma": 1},
    {"momentum": 0.1, "momentum_convention": "mindspore", "axis": -1},
    {"use_global_stats": 1},
    {"mode": "per_activation", "unbiased_running_var": 1},
]


@pytest.mark.parametrize(("data", "param"), PAIRS)
@pytest.mark.parametrize("attrs", TRAINING_ATTRS)
def test_training_matches_reference(data, param, attrs) -> None:
    config = config_of(ops.TRAINING, attrs)
    feeds = make_inputs(ops.TRAINING, (4, 3, 3, 2), config, data, param, seed=1)
    session = make_session(ops.TRAINING, data, param, **attrs)
    check(session.run(None, feeds), expected(ops.TRAINING, feeds, config, 5))


@pytest.mark.parametrize(("data", "param"), PAIRS)
def test_training_with_batch_var_output(data, param) -> None:
    config = config_of(ops.TRAINING, {})
    feeds = make_inputs(ops.TRAINING, (5, 4, 3), config, data, param, seed=2)
    got = make_session(ops.TRAINING, data, param, outputs=6).run(None, feeds)
    check(got, expected(ops.TRAINING, feeds, config, 6))


def test_training_with_unnamed_batch_var_output() -> None:
    """A sixth output slot left empty (name ""): the kernel gets scratch space, ORT returns five outputs."""
    model = ops.single_op_model(ops.TRAINING, outputs=6)
    model.graph.node[0].output[5] = ""
    del model.graph.output[5]
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=CPU)
    config = config_of(ops.TRAINING, {})
    feeds = make_inputs(ops.TRAINING, (4, 3, 2), config, np.float32, np.float32, seed=6)
    check(session.run(None, feeds), expected(ops.TRAINING, feeds, config, 5))


def test_cudnn_cumulative_average_factor() -> None:
    """cuDNN's factor 1/(1+n) turns the running statistics into the plain average of the batch statistics."""
    config = config_of(ops.TRAINING, {"momentum_convention": "cudnn"})
    batches = [make_inputs(ops.TRAINING, (6, 3, 4), config, np.float32, np.float32, seed=s) for s in range(3)]
    running_mean = np.zeros(3, np.float32)
    for n, feeds in enumerate(batches):
        session = make_session(ops.TRAINING, momentum=1.0 / (1 + n), momentum_convention="cudnn")
        running_mean = session.run(None, {**feeds, "input_mean": running_mean})[1]
    batch_means = [f["X"].astype(np.float64).mean(axis=(0, 2)) for f in batches]
    np.testing.assert_allclose(running_mean, np.mean(batch_means, axis=0), rtol=1e-5, atol=1e-6)


GRAD_ATTRS = [{}, {"use_global_stats": 1}, {"fix_gamma": 1}, {"axis": -1}, {"mode": "per_activation"}]


@pytest.mark.parametrize(("data", "param"), PAIRS)
@pytest.mark.parametrize("attrs", GRAD_ATTRS)
def test_grad_matches_reference(data, param, attrs) -> None:
    config = config_of(ops.GRAD, attrs)
    feeds = make_inputs(ops.GRAD, (4, 3, 2, 3), config, data, param, seed=3)
    got = make_session(ops.GRAD, data, param, **attrs).run(None, feeds)
    check(got, expected(ops.GRAD, feeds, config, 3))


def test_training_feeds_grad() -> None:
    """saved_mean / saved_inv_std of the training op drive the grad op: dX matches the reference chain."""
    config = config_of(ops.TRAINING, {})
    feeds = make_inputs(ops.TRAINING, (4, 3, 5), config, np.float32, np.float32, seed=4)
    _, _, _, saved_mean, saved_inv_std = make_session(ops.TRAINING).run(None, feeds)
    dy = np.random.default_rng(5).standard_normal(feeds["X"].shape).astype(np.float32)
    grad_feeds = {"dY": dy, "X": feeds["X"], "scale": feeds["scale"], "saved_mean": saved_mean}
    got = make_session(ops.GRAD).run(None, {**grad_feeds, "saved_inv_std": saved_inv_std})
    ref = reference.forward_training(*feeds.values(), config)
    want = reference.backward(dy, feeds["X"], feeds["scale"], ref.saved_mean, ref.saved_inv_std, config)
    check(got, list(want))


# -- errors become onnxruntime errors with our message ----------------------------------------------------


def test_wrong_rank_raises_with_message_and_session_survives() -> None:
    session = make_session(ops.INFERENCE)
    config = config_of(ops.INFERENCE, {})
    feeds = make_inputs(ops.INFERENCE, (2, 3), config, np.float32, np.float32)
    with pytest.raises(RuntimeException, match="BatchNormalizationInference: X has shape \\(3,\\): input rank must be"):
        session.run(None, {**feeds, "X": np.ones(3, np.float32)})
    check(session.run(None, feeds), expected(ops.INFERENCE, feeds, config, 1))


def test_wrong_parameter_shape_raises() -> None:
    session = make_session(ops.TRAINING, mode="per_activation")
    config = config_of(ops.TRAINING, {"mode": "per_activation"})
    feeds = make_inputs(ops.TRAINING, (4, 3, 2), config, np.float32, np.float32)
    with pytest.raises(RuntimeException, match=r"input_var has shape \(3,\), expected \(3, 2\)"):
        session.run(None, {**feeds, "input_var": np.ones(3, np.float32)})


def test_axis_out_of_range_raises_at_run() -> None:
    session = make_session(ops.GRAD, axis=3)
    feeds = make_inputs(ops.GRAD, (2, 3), config_of(ops.GRAD, {}), np.float32, np.float32)
    with pytest.raises(RuntimeException, match="channel axis 3 is out of range for rank 2"):
        session.run(None, feeds)


@pytest.mark.parametrize(
    ("op", "attrs", "message"),
    [
        (ops.INFERENCE, {"mode": "bogus"}, "attribute mode must be 'spatial' or 'per_activation', got 'bogus'"),
        (ops.TRAINING, {"momentum_convention": "keras"}, "unknown momentum convention 'keras'"),
        (ops.TRAINING, {"momentum": 1.5}, r"momentum must be in \[0, 1\], got 1.5"),
        (ops.GRAD, {"epsilon": 0.0}, "epsilon must be > 0"),
        (ops.TRAINING, {"fix_gamma": 2}, "attribute fix_gamma must be 0 or 1, got 2"),
        (ops.GRAD, {"use_global_stats": -1}, "attribute use_global_stats must be 0 or 1"),
    ],
)
def test_bad_attribute_fails_at_session_creation(op, attrs, message) -> None:
    with pytest.raises(RuntimeException, match=f"{op}: .*{message}"):
        make_session(op, **attrs)


def test_unsupported_type_pair_is_refused_by_onnxruntime() -> None:
    with pytest.raises(Fail, match="BatchNormalizationInference"):
        make_session(ops.INFERENCE, np.float32, np.float16)


class _RaisingKernels:
    @staticmethod
    def forward_inference(*args, **kwargs):
        raise ZeroDivisionError("boom in the kernel")


class _ReplacingKernels:
    @staticmethod
    def forward_inference(x, scale, bias, mean, var, config, *, out=None):
        return np.zeros_like(out)  # a new array: ORT's output would stay unwritten


@pytest.mark.parametrize(
    ("kernels", "message"),
    [
        (_RaisingKernels, "ZeroDivisionError: boom in the kernel"),
        (_ReplacingKernels, "kernel returned a new array for output 0 instead of writing into it"),
    ],
)
def test_kernel_failure_becomes_onnxruntime_error(monkeypatch, kernels, message) -> None:
    monkeypatch.setattr(ops, "kernel_module", lambda provider: kernels)
    session = make_session(ops.INFERENCE)
    feeds = make_inputs(ops.INFERENCE, (2, 3), config_of(ops.INFERENCE, {}), np.float32, np.float32)
    with pytest.raises(RuntimeException, match=message):
        session.run(None, feeds)


# -- zero copy --------------------------------------------------------------------------------------------


def test_kernel_reads_callers_buffers_and_writes_bound_outputs() -> None:
    """Inputs: the kernel sees the very NumPy buffers passed to run (ORT wraps them). Outputs: with io
    binding to preallocated OrtValues, the kernel writes straight into them."""
    session = make_session(ops.TRAINING, outputs=6)
    config = config_of(ops.TRAINING, {})
    feeds = make_inputs(ops.TRAINING, (4, 3, 8), config, np.float32, np.float32)
    binding = session.io_binding()
    inputs = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in feeds.items()}
    for name, value in inputs.items():
        binding.bind_ortvalue_input(name, value)
    outputs = {}
    for name, array in zip(ops.OUTPUT_NAMES[ops.TRAINING], expected(ops.TRAINING, feeds, config, 6), strict=True):
        outputs[name] = ort.OrtValue.ortvalue_from_numpy(np.full_like(array, np.nan))
        binding.bind_ortvalue_output(name, outputs[name])
    with ops.record_addresses() as calls:
        session.run_with_iobinding(binding)
        session.run(None, feeds)
    bound, plain = calls
    assert bound.op == ops.TRAINING and bound.node == "bn"
    assert bound.inputs == tuple(v.data_ptr() for v in inputs.values())
    assert bound.outputs == tuple(v.data_ptr() for v in outputs.values())
    assert plain.inputs == tuple(a.ctypes.data for a in feeds.values())
    check([v.numpy() for v in outputs.values()], expected(ops.TRAINING, feeds, config, 6))


def test_output_views_are_ort_allocations() -> None:
    """Without binding, the arrays run() returns are the ones the kernel wrote (ORT allocated, no copy)."""
    session = make_session(ops.INFERENCE)
    feeds = make_inputs(ops.INFERENCE, (16, 4, 8), config_of(ops.INFERENCE, {}), np.float32, np.float32)
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    binding.bind_output("Y", "cpu")
    with ops.record_addresses() as calls:
        session.run_with_iobinding(binding)
    assert calls[0].outputs == (binding.get_outputs()[0].data_ptr(),)


# -- many sessions, threads, long runs --------------------------------------------------------------------


def test_several_sessions_at_once_and_kernels_released() -> None:
    before = ortabi.live_kernel_count()
    cases = [(ops.INFERENCE, {"epsilon": 0.1}), (ops.TRAINING, {"momentum": 0.5}), (ops.GRAD, {"fix_gamma": 1})]
    sessions = [(op, attrs, make_session(op, **attrs)) for op, attrs in cases]
    assert ortabi.live_kernel_count() >= before + len(cases)
    for seed in range(3):
        for op, attrs, session in sessions:
            config = config_of(op, attrs)
            feeds = make_inputs(op, (3, 4, 2), config, np.float32, np.float32, seed=seed)
            check(session.run(None, feeds), expected(op, feeds, config, 5))
    del sessions, session  # the loop variable holds the last one
    assert ortabi.live_kernel_count() == before


def _two_branch_model() -> bytes:
    """Two independent Inference nodes (and an Add joining them): ORT_PARALLEL runs the branches at once."""
    names = ops.INPUT_NAMES[ops.INFERENCE]
    nodes, inputs = [], []
    for branch in ("a", "b"):
        node_inputs = [f"{n}_{branch}" for n in names]
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in node_inputs]
        nodes.append(helper.make_node(ops.INFERENCE, node_inputs, [f"Y_{branch}"], domain="bnfuse", name=branch))
    nodes.append(helper.make_node("Add", ["Y_a", "Y_b"], ["Y"]))
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("Y_a", "Y_b", "Y")]
    graph = helper.make_graph(nodes, "two", inputs, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("bnfuse", 1)]
    return ort_compatible(helper.make_model(graph, opset_imports=opsets)).SerializeToString()


def test_parallel_execution_mode() -> None:
    options = session_options(execution_mode=ort.ExecutionMode.ORT_PARALLEL, inter_op_num_threads=2)
    session = ort.InferenceSession(_two_branch_model(), options, providers=CPU)
    config = config_of(ops.INFERENCE, {})
    for seed in range(20):
        a = make_inputs(ops.INFERENCE, (4, 3, 6), config, np.float32, np.float32, seed=seed)
        b = make_inputs(ops.INFERENCE, (4, 3, 6), config, np.float32, np.float32, seed=seed + 100)
        feeds = {f"{k}_a": v for k, v in a.items()} | {f"{k}_b": v for k, v in b.items()}
        y_a, y_b, y = session.run(None, feeds)
        want_a, want_b = expected(ops.INFERENCE, a, config, 1)[0], expected(ops.INFERENCE, b, config, 1)[0]
        check([y_a, y_b], [want_a, want_b])
        np.testing.assert_allclose(y, want_a + want_b, rtol=1e-5, atol=1e-5)


def test_python_threads_share_one_session() -> None:
    session = make_session(ops.TRAINING, momentum=0.8)
    config = config_of(ops.TRAINING, {"momentum": 0.8})
    failures: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for step in range(25):
                feeds = make_inputs(ops.TRAINING, (3 + seed % 3, 4, 5), config, np.float32, np.float32, seed + step)
                check(session.run(None, feeds), expected(ops.TRAINING, feeds, config, 5))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.fixture
def one_kernel_thread() -> Any:
    """The CPU kernel on one numba thread (this thread's setting; ORT runs kernels on the caller's thread in
    sequential mode): a multi-threaded launch on a tiny tensor waits for a free core on a busy machine."""
    numba = pytest.importorskip("numba")
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(previous)


def _growth_per_block(fn: Any, *, warmup: int, blocks: int = 5, runs: int = 2000) -> list[int]:
    """Resident-memory growth over consecutive blocks of ``runs`` calls, after ``warmup`` calls.

    A leak grows every block; allocator arenas grow now and then and settle. So: the median block must
    not grow, and the whole run only a little.
    """
    for _ in range(warmup):
        fn()
    sizes = [_resident_bytes()]
    for _ in range(blocks):
        for _ in range(runs):
            fn()
        sizes.append(_resident_bytes())
    return [after - before for before, after in zip(sizes, sizes[1:], strict=False)]


def _assert_flat(growth: list[int], what: str) -> None:
    per_block = sorted(growth)[len(growth) // 2]
    assert per_block <= 64 * 2**10 and sum(growth) < 4 * 2**20, (
        f"resident memory grew by {[g // 2**10 for g in growth]} KiB per block of {what}"
    )


def test_ten_thousand_runs_keep_resident_memory_flat(one_kernel_thread) -> None:
    session = make_session(ops.INFERENCE)
    feeds = make_inputs(ops.INFERENCE, (2, 3, 4), config_of(ops.INFERENCE, {}), np.float32, np.float32)
    growth = _growth_per_block(lambda: session.run(None, feeds), warmup=2000)  # arenas, view caches settle
    _assert_flat(growth, "2,000 runs")


def test_failing_runs_do_not_leak(one_kernel_thread) -> None:
    """Every failure creates an OrtStatus; they must all be released."""
    session = make_session(ops.INFERENCE, options=session_options(log_severity_level=4))
    bad = make_inputs(ops.INFERENCE, (2, 3), config_of(ops.INFERENCE, {}), np.float32, np.float32)
    bad["scale"] = np.ones(4, np.float32)

    def fail() -> None:
        try:
            session.run(None, bad)
        except RuntimeException:
            return
        raise AssertionError("the run did not fail")

    _assert_flat(_growth_per_block(fail, warmup=2000), "2,000 failing runs")
