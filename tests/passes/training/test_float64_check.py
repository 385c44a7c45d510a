"""Float64 training graphs against PyTorch float64 at 1e-9 (bench/float64_check.py: onnx's reference evaluator with
bnfuse's ops on its NumPy float64 kernels), and every graph variant agreeing with the others.

Float32 comparisons of real networks are limited by ReLU / ReLU6 boundary flips (an activation input within float32
rounding of 0 or 6 takes the other side, and one flipped element moves a small map's BN gradient by 10-30%); in
float64 none flip, so a rule error of any size shows.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench import float64_check  # noqa: E402
from bnfuse.passes.training import build_training_graph  # noqa: E402

HAS_ORACLE = all(importlib.util.find_spec(m) for m in ("torch", "torchvision", "timm"))
needs_oracle = pytest.mark.skipif(not HAS_ORACLE, reason="needs the oracle extra (torch, torchvision, timm)")
RTOL = float64_check.RTOL


def _conv_model(op: str, x_shape, w_shape, **attributes) -> onnx.ModelProto:  # noqa: ANN001
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "w"], ["y"], **attributes)],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, x_shape)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, None)],
        [numpy_helper.from_array(np.random.default_rng(0).standard_normal(w_shape), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


CONV_CASES = [
    ("Conv", [2, 6, 9, 8], [4, 3, 3, 2], {"group": 2, "strides": [2, 1], "pads": [1, 0, 2, 1], "dilations": [1, 2]}),
    ("Conv", [1, 4, 7, 7], [4, 1, 3, 3], {"group": 4, "pads": [1, 1, 1, 1]}),
    ("ConvTranspose", [2, 4, 5, 4], [4, 3, 3, 2], {"strides": [2, 3], "pads": [1, 0, 0, 1], "output_padding": [1, 0]}),
]


@pytest.mark.parametrize(("op", "x_shape", "w_shape", "attributes"), CONV_CASES)
def test_numpy_conv_matches_the_reference_evaluators_own(op, x_shape, w_shape, attributes) -> None:  # noqa: ANN001
    """The oracle's fast Conv / ConvTranspose replace onnx's: same values (grouped, strided, dilated, padded; onnx's
    own ConvTranspose fails on groups, which the next test covers)."""
    from onnx.reference import ReferenceEvaluator

    model = _conv_model(op, x_shape, w_shape, **attributes)
    x = np.random.default_rng(1).standard_normal(x_shape)
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    actual = float64_check.evaluator(model).run(None, {"x": x})[0]
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=1e-12)


def test_numpy_conv_transpose_is_the_adjoint_of_conv() -> None:
    """<Conv(x, W), y> == <x, ConvTranspose(y, W)> for a grouped, strided, dilated, padded geometry."""
    rng = np.random.default_rng(2)
    x_shape, w_shape = [2, 6, 9, 10], [4, 3, 3, 2]
    geometry = {"group": 2, "strides": [2, 3], "pads": [1, 0, 2, 1], "dilations": [1, 2]}
    x = rng.standard_normal(x_shape)
    conv = _conv_model("Conv", x_shape, w_shape, **geometry)
    y_value = float64_check.evaluator(conv).run(None, {"x": x})[0]
    k = [(w_shape[2 + i] - 1) * geometry["dilations"][i] + 1 for i in range(2)]
    covered = [(y_value.shape[2 + i] - 1) * geometry["strides"][i] + k[i] for i in range(2)]
    output_padding = [x_shape[2 + i] + geometry["pads"][i] + geometry["pads"][i + 2] - covered[i] for i in range(2)]
    transpose = _conv_model("ConvTranspose", list(y_value.shape), w_shape, output_padding=output_padding, **geometry)
    y = rng.standard_normal(y_value.shape)
    back = float64_check.evaluator(transpose).run(None, {"x": y})[0]
    assert back.shape == x.shape
    assert abs(float(np.sum(y_value * y)) - float(np.sum(x * back))) <= 1e-12 * float(np.sum(np.abs(y_value * y)))


def test_numpy_max_pool_is_onnxruntimes() -> None:
    """The oracle's MaxPool: values and Indices equal onnxruntime's (float32 inputs, exact) on random geometries:
    overlapping windows (stride 1, where onnx's own reference gives wrong Indices), padding, dilation, ceil_mode
    (whose last window starting in the end padding onnxruntime and PyTorch drop, and onnx's reference keeps)."""
    import onnxruntime

    rng = np.random.default_rng(4)

    def model(attributes: dict, shape: list[int], elem: int) -> onnx.ModelProto:
        graph = helper.make_graph(
            [helper.make_node("MaxPool", ["x"], ["y", "i"], **attributes)],
            "g",
            [helper.make_tensor_value_info("x", elem, shape)],
            [
                helper.make_tensor_value_info("y", elem, None),
                helper.make_tensor_value_info("i", onnx.TensorProto.INT64, None),
            ],
        )
        made = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        made.ir_version = 8
        return made

    geometries = []
    for _ in range(60):
        k, stride, dilation, ceil = (
            int(v) for v in (rng.integers(2, 4), rng.integers(1, 4), rng.integers(1, 3), rng.integers(0, 2))
        )
        pads = [int(rng.integers(0, k // 2 + 1)), 0, int(rng.integers(0, k // 2 + 1)), 1]
        shape = [2, 3, int(rng.integers(dilation * (k - 1) + 1, 9)), int(rng.integers(dilation * (k - 1) + 1, 9))]
        attributes = {
            "kernel_shape": [k, k],
            "strides": [stride] * 2,
            "pads": pads,
            "dilations": [dilation] * 2,
            "ceil_mode": ceil,
        }
        geometries.append((attributes, shape))
    # a window larger than the input: onnxruntime computes one (the TorchScript exporter writes AdaptiveMaxPool2d(1)
    # as MaxPool 4x4 on a 3x3 map where ONNX shape inference sized a ceil_mode pool before it 4x4)
    geometries.append(({"kernel_shape": [4, 4], "strides": [4, 4]}, [2, 3, 3, 3]))
    for attributes, shape in geometries:
        x = rng.standard_normal(shape).astype(np.float32)
        ours = float64_check.evaluator(model(attributes, shape, onnx.TensorProto.DOUBLE)).run(
            None, {"x": x.astype(np.float64)}
        )
        session = onnxruntime.InferenceSession(model(attributes, shape, onnx.TensorProto.FLOAT).SerializeToString())
        theirs = session.run(None, {"x": x})
        assert ours[0].shape == theirs[0].shape, attributes
        np.testing.assert_array_equal(ours[0], theirs[0].astype(np.float64))
        np.testing.assert_array_equal(ours[1], theirs[1])


@needs_oracle
def test_numpy_average_pool_is_pytorchs() -> None:
    """The oracle's AveragePool against PyTorch's avg_pool2d in float64 on random geometries: padding, strides past
    the window, ceil_mode (windows overhanging the padded input: 4 x 4, kernel 3, stride 3, where onnx's reference
    averages a wrong window), count_include_pad both ways; and onnxruntime's own output in float32."""
    import onnxruntime
    import torch

    rng = np.random.default_rng(6)

    def model(attributes: dict, shape: list[int], elem: int) -> onnx.ModelProto:
        graph = helper.make_graph(
            [helper.make_node("AveragePool", ["x"], ["y"], **attributes)],
            "g",
            [helper.make_tensor_value_info("x", elem, shape)],
            [helper.make_tensor_value_info("y", elem, None)],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    geometries = [(3, 3, 0, True, True, [4, 4]), (4, 3, 0, False, False, [11, 9]), (3, 3, 0, True, False, [4, 5])]
    for _ in range(60):
        k, stride = int(rng.integers(2, 5)), int(rng.integers(1, 4))
        pad, ceil, include = int(rng.integers(0, k // 2 + 1)), bool(rng.integers(0, 2)), bool(rng.integers(0, 2))
        geometries.append((k, stride, pad, ceil, include, [int(rng.integers(k, 12)), int(rng.integers(k, 12))]))
    for k, stride, pad, ceil, include, size in geometries:
        x = rng.standard_normal([2, 3, *size])
        want = torch.nn.functional.avg_pool2d(
            torch.from_numpy(x), k, stride, pad, ceil_mode=ceil, count_include_pad=include
        ).numpy()
        attributes = {
            "kernel_shape": [k, k], "strides": [stride] * 2, "pads": [pad] * 4, "ceil_mode": int(ceil),
            "count_include_pad": int(include),
        }  # fmt: skip
        ours = float64_check.evaluator(model(attributes, [2, 3, *size], onnx.TensorProto.DOUBLE)).run(None, {"x": x})
        assert ours[0].shape == want.shape, attributes
        np.testing.assert_allclose(ours[0], want, rtol=1e-12, atol=1e-14, err_msg=str(attributes))
        float_model = model(attributes, [2, 3, *size], onnx.TensorProto.FLOAT)
        theirs = onnxruntime.InferenceSession(float_model.SerializeToString()).run(None, {"x": x.astype(np.float32)})
        np.testing.assert_allclose(theirs[0], want, rtol=1e-5, atol=1e-6, err_msg=str(attributes))


@needs_oracle
def test_erf_and_gelu_are_float64_precise() -> None:
    """The oracle's Erf and Gelu (both approximations) against PyTorch float64 to 1e-15 (onnx's reference ops were
    off by 3e-8 and 8e-8 in float64, beyond the oracle's 1e-9: the fuzzer's false MISMATCHes)."""
    import torch

    x = np.random.default_rng(5).standard_normal(500) * 3

    def run(node: onnx.NodeProto, opset: int) -> np.ndarray:
        graph = helper.make_graph(
            [node],
            "g",
            [helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, [500])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, None)],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        return float64_check.evaluator(model).run(None, {"x": x})[0]

    t = torch.from_numpy(x)
    np.testing.assert_allclose(run(helper.make_node("Erf", ["x"], ["y"]), 17), torch.erf(t).numpy(), rtol=0, atol=1e-15)
    for approximate in ("none", "tanh"):
        got = run(helper.make_node("Gelu", ["x"], ["y"], approximate=approximate), 20)
        want = torch.nn.functional.gelu(t, approximate=approximate).numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-14)


# small architectures and what each exercises: the channel shuffle (Shape-computed Reshape, Slice / Concat), grouped
# 3x3 convs with a stride-2 shortcut, channel Slice + Add / Concat of unequal channel counts with SiLU and ReLU6. Sizes
# where PyTorch float64 is well conditioned (its own spread, inputs moved by 1e-15, stays below 1e-9 after one step;
# rexnet's second step is float64-chaotic at 48x48: BNs over 2 values on 1x1 maps)
CASES = {
    "mobilenetv3_small_050": (2, 3, 64, 64),  # tied SE biases, HardSwish, HardSigmoid gates
    "shufflenet_v2_x0_5": (2, 3, 64, 64),
    "regnetx_002": (2, 3, 64, 64),
    "rexnet_100": (2, 3, 48, 48),
}


@needs_oracle
@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_graph_matches_pytorch_float64(name: str) -> None:
    shape = CASES[name]
    net, model = float64_check.export64(name, shape)
    data = float64_check.float64_batches(shape, 10, 2)
    results = float64_check.check_variants(build_training_graph, model, net, data, {"default": {}})
    errors, spread = [e for e, _ in results["default"]["errors"]], results["default"]["spread"]
    assert errors[0] <= RTOL, f"{name}: {results['default']['errors']}"  # the gradient itself
    assert float64_check.verdict(errors, spread) != "MISMATCH", f"{name}: {errors}, PyTorch float64's spread {spread}"
    loss_errors = results["default"]["loss_errors"]
    assert loss_errors[0] <= RTOL, loss_errors  # the forward of the same initial state
    # a later loss is a function of the state after the step before it: its error, conditioned by the network (BNs
    # over 2 values on rexnet's 1x1 maps amplify), within CHAOS_FACTOR of that state's error or PyTorch's own spread
    for k in range(1, len(loss_errors)):
        bound = float64_check.CHAOS_FACTOR * max(RTOL, errors[k - 1], spread[k - 1])
        assert loss_errors[k] <= bound, f"{name}: loss errors {loss_errors}, state errors {errors}, spread {spread}"


@needs_oracle
@pytest.mark.parametrize("name", ["mnasnet0_5", "mobilenet_v2"])
def test_graph_variants_agree_in_float64(name: str) -> None:
    """Default, fused ReLU off, standard optimizer, portable: each within 1e-9 of PyTorch float64 after two steps and
    of each other (issue 28's float32 "default vs portable" gaps were ReLU boundary flips)."""
    shape = (2, 3, 48, 48)
    net, model = float64_check.export64(name, shape)
    data = float64_check.float64_batches(shape, 10, 2)
    results = float64_check.check_variants(build_training_graph, model, net, data)
    assert set(results) == set(float64_check.VARIANTS)
    for variant, result in results.items():
        assert all(error <= RTOL for error, _ in result["errors"]), f"{name} {variant}: {result['errors']}"
    base = results["default"]["state"]
    for variant, result in results.items():
        error, tensor = float64_check.worst(result["state"], base)
        assert error <= RTOL, f"{name}: {variant} vs default {error:.2e} at {tensor}"


def _small_float64_model(rng: np.random.Generator) -> onnx.ModelProto:
    """MatMul -> BatchNormalization, float64: x [5, 3] -> y [5, 4]."""
    weight = rng.standard_normal((3, 4))
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("BatchNormalization", ["h", "s", "b", "m", "v"], ["y"], epsilon=1e-5, momentum=0.9),
        ],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, [5, 3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, [5, 4])],
        [
            numpy_helper.from_array(weight, "w"),
            numpy_helper.from_array(rng.uniform(0.5, 1.5, 4), "s"),
            numpy_helper.from_array(rng.standard_normal(4), "b"),
            numpy_helper.from_array(np.zeros(4), "m"),
            numpy_helper.from_array(np.ones(4), "v"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model


def test_float64_graph_sgd_momentum_fused_and_standard_agree() -> None:
    """The oracle's SGDStep (momentum, nesterov, weight decay) computes what the standard-ONNX update computes.
    Hyperparameters exact in float32: the fused node holds them as ONNX float (float32) attributes, the standard
    update as float64 constants (0.9 would differ by 2.4e-8)."""
    from bnfuse.passes.training.optimizers import SGD

    rng = np.random.default_rng(3)
    model = _small_float64_model(rng)
    data = [(rng.standard_normal((5, 3)), rng.integers(0, 4, 5).astype(np.int64)) for _ in range(3)]
    optimizer = SGD(momentum=0.875, nesterov=True, weight_decay=0.015625)
    states = []
    for fused in (True, False):
        train_model, _ = build_training_graph(
            model, batch_size=5, static_batch=True, optimizer=optimizer, fused_optimizer=fused
        )
        assert any(n.op_type == "SGDStep" for n in train_model.graph.node) == fused
        assert {i.type.tensor_type.elem_type for i in train_model.graph.input if i.name == "lr"} == {
            onnx.TensorProto.DOUBLE
        }
        states.append(float64_check.run_graph(train_model, data, lr=0.1).state)
    assert float64_check.worst(states[0], states[1])[0] <= 1e-13


@needs_oracle
def test_nchwc_on_and_off_agree_once_activation_masks_agree() -> None:
    """Float32, mobilenet_v2 at 48x48, batch 2: NCHWc rounds differently from the plain Conv, and with NCHWc off one
    ReLU6 input flips (a 0.13 error). Fed the float64 run's activation masks, both runs are within float32 rounding
    of PyTorch float64 (3x PyTorch float32's own error): the flips are the whole difference (bench/mask_replay.py)."""
    from bench import mask_replay

    rows = mask_replay.replay("mobilenet_v2", 48, 2)
    replayed = [row for row in rows if row["float64 masks"]]
    assert {row["nchwc"] for row in replayed} == {False, True} and replayed[0]["masks"] > 50
    for row in replayed:
        assert row["error"] <= max(3 * row["torch32"], 1e-4), row


def test_training_session_refuses_a_float64_graph_in_one_line() -> None:
    from bnfuse.errors import BnfuseError
    from bnfuse.training.session import TrainingSession

    train_model, _ = build_training_graph(_small_float64_model(np.random.default_rng(4)), batch_size=5)
    with pytest.raises(BnfuseError, match="float64") as caught:
        TrainingSession(train_model, lr=0.1)
    assert "\n" not in str(caught.value)
