"""The native BN ops (bnfuse/runtime/native/bn_ops.c) in real sessions of this process: the direct kernels' bits
(cpu.py) for every layout, attribute, type pair and size class (the serial kernels, and the pooled loops on the
session's pool at 1 and 2 threads), bound outputs, errors naming the op, ORT's inter-op threads."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

from bnfuse.runtime import cpu, ops, ortabi, session_options
from bnfuse.runtime.kernel_types import GradOutputs
from tests.runtime.test_ops import CPU, config_of, make_inputs, make_session

CASES = [
    (ops.INFERENCE, (4, 3, 5, 2), {}),
    (ops.INFERENCE, (3, 5, 2, 4), {"axis": -1}),
    (ops.INFERENCE, (6, 3, 4), {"mode": "per_activation", "epsilon": 1e-3}),
    (ops.TRAINING, (2, 3), {}),
    (ops.TRAINING, (4, 3, 40), {"momentum": 0.1, "momentum_convention": "pytorch", "unbiased_running_var": 1}),
    (ops.TRAINING, (4, 3, 3, 2), {"momentum": 0.9, "momentum_convention": "mxnet", "fix_gamma": 1}),
    (ops.TRAINING, (5, 6, 7), {"axis": -1, "momentum_convention": "cudnn", "momentum": 0.5}),
    (ops.TRAINING, (4, 3, 2), {"use_global_stats": 1}),
    (ops.TRAINING, (6, 3, 4), {"mode": "per_activation", "unbiased_running_var": 1}),
    (ops.TRAINING, (9000, 7), {}),  # several row chunks, under cpu.SERIAL_BELOW_BYTES
    # between SERIAL_BELOW_BYTES and POOL_FROM_BYTES: the direct kernels take the parallel loops, the native op
    # the serial functions -- the same bits
    (ops.TRAINING, (40000, 5), {}),
    (ops.GRAD, (8, 16, 40, 40), {}),
    (ops.INFERENCE, (6, 4, 100, 100), {}),
    (ops.GRAD, (4, 3, 2, 3), {}),
    (ops.GRAD, (2, 8, 33), {"use_global_stats": 1}),
    (ops.GRAD, (4, 3, 2), {"fix_gamma": 1}),
    (ops.GRAD, (3, 4, 5), {"axis": -1}),
    (ops.GRAD, (6, 3, 4), {"mode": "per_activation"}),
    # the fused ReLU (activation "relu"): Training's Y, Grad's optional Y input, both layouts and both paths
    (ops.TRAINING, (4, 3, 40), {"activation": "relu"}),
    (ops.TRAINING, (5, 6, 7), {"activation": "relu", "axis": -1}),
    (ops.TRAINING, (40000, 5), {"activation": "relu"}),
    (ops.GRAD, (4, 3, 2, 3), {"activation": "relu"}),
    (ops.GRAD, (8, 16, 40, 40), {"activation": "relu"}),
    (ops.GRAD, (3, 4, 5), {"activation": "relu", "axis": -1, "fix_gamma": 1}),
    # from 4 MiB of X (native/bn_pooled.h): the pooled loops, channels-first and rows (on the pool from 8 MiB)
    (ops.INFERENCE, (16, 64, 32, 33), {}),
    (ops.TRAINING, (16, 64, 32, 33), {"unbiased_running_var": 1, "activation": "relu"}),
    (ops.GRAD, (16, 64, 32, 33), {"activation": "relu", "fix_gamma": 1}),
    (ops.TRAINING, (45000, 25), {"use_global_stats": 1}),
    (ops.TRAINING, (90000, 25), {}),
    (ops.GRAD, (90000, 25), {}),
    (ops.GRAD, (60, 40, 40, 12), {"axis": -1, "activation": "relu"}),
    (ops.GRAD, (60, 40, 40, 12), {"axis": -1, "use_global_stats": 1}),
]


def _direct(op: str, feeds: dict[str, np.ndarray], attrs: dict, outputs: int) -> list[np.ndarray]:
    """The direct kernels' answer, with float attributes as the node holds them (float32)."""
    node_attrs = {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in attrs.items()}
    config, args = config_of(op, node_attrs), list(feeds.values())
    if op == ops.INFERENCE:
        return [cpu.forward_inference(*args, config)]
    if op == ops.TRAINING:
        return list(cpu.forward_training(*args, config))[:outputs]
    return list(cpu.backward(*args[:5], config, *args[5:]))


# every case with all outputs; Training (the one op with optional outputs) also with its first 6 only
OUTPUT_CASES = [(*case, None) for case in CASES] + [(*case, 6) for case in CASES if case[0] == ops.TRAINING]


@pytest.mark.parametrize(("op", "x_shape", "attrs", "outputs"), OUTPUT_CASES)
def test_native_ops_give_the_direct_kernels_bits(op, x_shape, attrs, outputs) -> None:
    feeds = make_inputs(op, x_shape, config_of(op, attrs), np.float32, np.float32, seed=len(x_shape))
    results = []
    for threads in (1, 2):
        options = session_options(["CPUExecutionProvider"], intra_op_num_threads=threads)
        session = make_session(op, outputs=outputs, options=options, **attrs)
        before = ortabi.native_call_count()
        results.append(session.run(None, feeds))
        assert ortabi.native_call_count() == before + 1
    direct = _direct(op, feeds, attrs, len(results[0]))
    assert len(direct) == (outputs or len(ops.OUTPUT_NAMES[op][:5]))
    for a, b, c in zip(*results, direct, strict=True):
        assert a.dtype == c.dtype and a.shape == c.shape
        assert a.tobytes() == b.tobytes() == c.tobytes()


def test_native_ops_write_into_bound_outputs() -> None:
    feeds = make_inputs(ops.GRAD, (4, 3, 5), config_of(ops.GRAD, {}), np.float32, np.float32, seed=9)
    session = make_session(ops.GRAD)
    binding = session.io_binding()
    values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in feeds.items()}
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    want = cpu.backward(*feeds.values(), config_of(ops.GRAD, {}))
    bound = [np.full_like(w, np.nan) for w in want]
    for name, array in zip(ops.OUTPUT_NAMES[ops.GRAD], bound, strict=True):
        binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(array))
    before = ortabi.native_call_count()
    session.run_with_iobinding(binding)
    assert ortabi.native_call_count() == before + 1
    for got, w in zip(bound, GradOutputs(*want), strict=True):
        assert got.tobytes() == w.tobytes()


@pytest.mark.parametrize(
    ("data", "param", "x_shape"),
    [
        (np.float16, np.float16, (2, 3, 4)),  # 16-bit: converted at the edges, as cpu.py converts
        (np.float16, np.float32, (2, 3, 40)),
        (np.float16, np.float16, (16, 64, 32, 64)),  # pooled
        (np.float32, np.float32, (0, 3, 4)),  # empty: the op's own answer (docs/ops.md), not a kernel's
    ],
)
def test_half_types_and_empty_batches(data, param, x_shape) -> None:
    config = config_of(ops.TRAINING, {})
    feeds = make_inputs(ops.TRAINING, x_shape, config, data, param)
    session = make_session(ops.TRAINING, data, param)
    got = session.run(None, feeds)
    if x_shape[0] == 0:  # no samples: running statistics passed through, saved statistics zero (no NaN)
        running_mean, running_var = list(feeds.values())[3:5]
        assert got[0].shape == x_shape
        assert got[1].tobytes() == running_mean.tobytes() and got[2].tobytes() == running_var.tobytes()
        assert not got[3].any() and not got[4].any()
        return
    want = cpu.forward_training(*feeds.values(), config)[: len(got)]
    for a, b in zip(got, want, strict=True):
        assert a.tobytes() == b.tobytes()


def test_refused_shapes_name_the_op_and_the_session_survives() -> None:
    session = make_session(ops.TRAINING)
    feeds = make_inputs(ops.TRAINING, (2, 3, 4), config_of(ops.TRAINING, {}), np.float32, np.float32)
    with pytest.raises(RuntimeException, match=r"input_var has shape \(4,\), expected \(3,\)"):
        session.run(None, {**feeds, "input_var": np.ones(4, np.float32)})
    with pytest.raises(RuntimeException, match="out of range"):
        make_session(ops.INFERENCE, axis=3).run(None, make_inputs(ops.INFERENCE, (2, 3, 4), config_of(
            ops.INFERENCE, {}), np.float32, np.float32))  # fmt: skip
    want = cpu.forward_training(*feeds.values(), config_of(ops.TRAINING, {}))
    assert session.run(None, feeds)[0].tobytes() == want.y.tobytes()  # the session survives


def test_native_ops_from_onnxruntimes_inter_op_threads() -> None:
    """ORT_PARALLEL: ORT's own threads call the native ops, which need no Python thread state."""
    from tests.runtime.test_ops import _two_branch_model

    options = session_options(execution_mode=ort.ExecutionMode.ORT_PARALLEL, inter_op_num_threads=2)
    session = ort.InferenceSession(_two_branch_model(), options, providers=CPU)
    config = config_of(ops.INFERENCE, {})
    before = ortabi.native_call_count()
    for seed in range(20):
        a = make_inputs(ops.INFERENCE, (4, 3, 6), config, np.float32, np.float32, seed=seed)
        b = make_inputs(ops.INFERENCE, (4, 3, 6), config, np.float32, np.float32, seed=seed + 100)
        y_a, y_b, _ = session.run(None, {f"{k}_a": v for k, v in a.items()} | {f"{k}_b": v for k, v in b.items()})
        assert y_a.tobytes() == cpu.forward_inference(*a.values(), config).tobytes()
        assert y_b.tobytes() == cpu.forward_inference(*b.values(), config).tobytes()
    assert ortabi.native_call_count() == before + 40


def test_ops_leave_torchs_thread_count_alone() -> None:
    """No bnfuse op may change torch's (OpenMP) thread setting."""
    torch = pytest.importorskip("torch")
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for op, shape in ((ops.TRAINING, (2, 3, 4)), (ops.TRAINING, (4, 64, 16, 16)), (ops.GRAD, (2, 3))):
                feeds = make_inputs(op, shape, config_of(op, {}), np.float32, np.float32)
                make_session(op).run(None, feeds)
                assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(previous)
