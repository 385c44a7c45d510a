"""bnfuse.SGDStep / AdamStep in onnxruntime: against a float64 reference, bit for bit against the standard-ONNX
nodes they replace (optimizers.expand_fused_steps), the same bits on 1 and 2 threads, and their errors."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from bnfuse.io import ort_compatible
from bnfuse.passes.training.optimizers import expand_fused_steps
from bnfuse.runtime import optimizer_ops, ortabi, session_options

# Parameter shapes: a scalar-like bias, a matrix, and one large enough for several 16384-element pool chunks.
SHAPES = [(7,), (33, 17), (5, 4, 3, 3), (3, 129, 130)]


def _model(op: str, shapes, states: int, lead: int, **attributes) -> onnx.ModelProto:  # noqa: ANN001
    scalars = ["lr"] if lead == 1 else ["step_size", "root"]
    inputs, outputs, infos, out_infos = list(scalars), [], [], []
    for name in scalars:
        infos.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, []))
    for i, shape in enumerate(shapes):
        given = [f"p{i}", f"g{i}", *[f"s{i}_{k}" for k in range(states)]]
        made = [f"new_p{i}", *[f"new_s{i}_{k}" for k in range(states)]]
        inputs += given
        outputs += made
        infos += [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(shape)) for n in given]
        out_infos += [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(shape)) for n in made]
    node = helper.make_node(op, inputs, outputs, name="step", domain=optimizer_ops.DOMAIN, **attributes)
    graph = helper.make_graph([node], "step", infos, out_infos)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(optimizer_ops.DOMAIN, 1)]
    return ort_compatible(helper.make_model(graph, opset_imports=opsets))


def _run(model: onnx.ModelProto, feeds: dict, threads: int = 2) -> list[np.ndarray]:
    options = session_options(["CPUExecutionProvider"], intra_op_num_threads=threads, log_severity_level=3)
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _feeds(shapes, states: int, scalars: dict[str, float], seed: int = 0) -> dict[str, np.ndarray]:  # noqa: ANN001
    rng = np.random.default_rng(seed)
    feeds = {name: np.array(value, np.float32) for name, value in scalars.items()}
    for i, shape in enumerate(shapes):
        feeds[f"p{i}"] = rng.standard_normal(shape).astype(np.float32)
        feeds[f"g{i}"] = rng.standard_normal(shape).astype(np.float32)
        feeds[f"g{i}"].reshape(-1)[:3] = [-0.0, 0.0, 1e-30]  # signed zeros and tiny values go through too
        for k in range(states):
            state = rng.standard_normal(shape).astype(np.float32)
            feeds[f"s{i}_{k}"] = np.abs(state) if k == 1 else state  # Adam's exp_avg_sq is >= 0
    return feeds


def _sgd_reference(feeds, count: int, momentum: float, nesterov: bool, decays, scales) -> list[np.ndarray]:  # noqa: ANN001
    """torch.optim.SGD's update in float64."""
    lr, result = float(feeds["lr"]), []
    for i in range(count):
        p, g = feeds[f"p{i}"].astype(np.float64), feeds[f"g{i}"].astype(np.float64)
        d = g + decays[i] * p
        if momentum:
            buffer = momentum * feeds[f"s{i}_0"].astype(np.float64) + d
            d = d + momentum * buffer if nesterov else buffer
            result += [p - lr * scales[i] * d, buffer]
        else:
            result.append(p - lr * scales[i] * d)
    return result


def _adam_reference(feeds, count: int, beta1: float, beta2: float, eps: float, decays, scales) -> list[np.ndarray]:  # noqa: ANN001
    """torch.optim.Adam's update in float64, given step_size = lr / (1 - beta1^t) and root = sqrt(1 - beta2^t)."""
    step_size, root, result = float(feeds["step_size"]), float(feeds["root"]), []
    for i in range(count):
        p, g = feeds[f"p{i}"].astype(np.float64), feeds[f"g{i}"].astype(np.float64)
        d = g + decays[i] * p
        m = beta1 * feeds[f"s{i}_0"].astype(np.float64) + (1 - beta1) * d
        v = beta2 * feeds[f"s{i}_1"].astype(np.float64) + (1 - beta2) * d * d
        result += [p - step_size * scales[i] * m / (np.sqrt(v) / root + eps), m, v]
    return result


SGD_CASES = {
    "plain": (0.0, 0, [0.0] * 4, [1.0] * 4),
    "momentum": (0.9, 0, [0.0] * 4, [1.0] * 4),
    "momentum-decay-groups": (0.9, 0, [1e-4, 0.0, 5e-4, 1e-4], [1.0, 0.1, 1.0, 2.0]),
    "nesterov-decay": (0.8, 1, [1e-3] * 4, [1.0] * 4),
    "nesterov": (0.8, 1, [0.0] * 4, [0.5] * 4),
    "decay-no-momentum": (0.0, 0, [1e-2] * 4, [1.0, 1.0, 3.0, 1.0]),
}


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_step_matches_float64_and_the_standard_nodes_bit_for_bit(case: str) -> None:
    momentum, nesterov, decays, scales = SGD_CASES[case]
    states = 1 if momentum else 0
    model = _model(
        optimizer_ops.SGD_STEP, SHAPES, states, 1, momentum=momentum, nesterov=nesterov, weight_decays=decays,
        lr_scales=scales,
    )  # fmt: skip
    feeds = _feeds(SHAPES, states, {"lr": 0.05})
    before = ortabi.native_call_count()
    fused = _run(model, feeds)
    assert ortabi.native_call_count() == before + 1  # the native op served it
    decays32, scales32 = [float(np.float32(v)) for v in decays], [float(np.float32(v)) for v in scales]
    expected = _sgd_reference(feeds, len(SHAPES), float(np.float32(momentum)), bool(nesterov), decays32, scales32)
    for got, want in zip(fused, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    standard = onnx.ModelProto()
    standard.CopyFrom(model)
    assert expand_fused_steps(standard) == 1
    assert not any(n.domain == optimizer_ops.DOMAIN for n in standard.graph.node)
    for got, want in zip(fused, _run(standard, feeds), strict=True):
        np.testing.assert_array_equal(got, want)
        assert np.array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize(("decay", "scales"), [(0.0, [1.0] * 4), (1e-2, [1.0, 0.5, 2.0, 1.0])])
def test_adam_step_matches_float64_and_the_standard_nodes_bit_for_bit(decay: float, scales: list[float]) -> None:
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    model = _model(
        optimizer_ops.ADAM_STEP, SHAPES, 2, 2, beta1=beta1, beta2=beta2, epsilon=eps, weight_decays=[decay] * 4,
        lr_scales=scales,
    )  # fmt: skip
    t = 3
    feeds = _feeds(SHAPES, 2, {"step_size": 1e-3 / (1 - beta1**t), "root": np.sqrt(1 - beta2**t)}, seed=1)
    fused = _run(model, feeds)
    f32 = [float(np.float32(v)) for v in (beta1, beta2, eps, decay)]
    expected = _adam_reference(feeds, len(SHAPES), *f32[:3], [f32[3]] * 4, scales)
    for got, want in zip(fused, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    standard = onnx.ModelProto()
    standard.CopyFrom(model)
    expand_fused_steps(standard)
    for got, want in zip(fused, _run(standard, feeds), strict=True):
        np.testing.assert_array_equal(got, want)


def test_one_and_two_threads_give_the_same_bits() -> None:
    model = _model(
        optimizer_ops.SGD_STEP, SHAPES, 1, 1, momentum=0.9, nesterov=1, weight_decays=[1e-3] * 4,
        lr_scales=[1.0, 0.1, 1.0, 1.0],
    )  # fmt: skip
    feeds = _feeds(SHAPES, 1, {"lr": 0.1}, seed=2)
    for one, two in zip(_run(model, feeds, 1), _run(model, feeds, 2), strict=True):
        np.testing.assert_array_equal(one, two)


def test_a_state_of_another_shape_is_refused_by_name() -> None:
    model = _model(optimizer_ops.SGD_STEP, [(4, 3)], 1, 1, momentum=0.9, weight_decays=[0.0], lr_scales=[1.0])
    del model.graph.input[3].type.tensor_type.shape.dim[:]  # s0_0 of any shape
    feeds = _feeds([(4, 3)], 1, {"lr": 0.1})
    feeds["s0_0"] = np.zeros((3, 4), np.float32)
    with pytest.raises(Exception, match=r"SGDStep node 'step': parameter 0's gradient and state must have its shape"):
        _run(model, feeds)


def test_an_input_count_that_does_not_fit_the_attributes_is_refused() -> None:
    model = _model(optimizer_ops.SGD_STEP, [(4,), (5,)], 0, 1, weight_decays=[0.0, 0.0, 0.0], lr_scales=[1.0] * 3)
    with pytest.raises(Exception, match=r"5 inputs, expected 7 \(1 scalar\(s\), then 2 per parameter for 3"):
        _run(model, _feeds([(4,), (5,)], 0, {"lr": 0.1}))


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ({"weight_decays": [0.0], "lr_scales": [1.0, 1.0]}, "one value per parameter, got 1 and 2"),
        ({"weight_decays": [-1.0], "lr_scales": [1.0]}, "weight_decays must be >= 0"),
        ({"weight_decays": [0.0], "lr_scales": [1.0], "nesterov": 1}, "nesterov 0 or 1 \\(1 needs momentum > 0\\)"),
    ],
)
def test_bad_attributes_are_refused_when_the_session_is_made(attributes: dict, message: str) -> None:
    model = _model(optimizer_ops.SGD_STEP, [(4,)], 0, 1, **attributes)
    with pytest.raises(Exception, match=message):
        _run(model, _feeds([(4,)], 0, {"lr": 0.1}))
