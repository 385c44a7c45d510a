"""bnfuse.ConvInputGrad in onnxruntime against the float64 reference (and the reference against PyTorch); oneDNN on
and off."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper

from bnfuse.io import ort_compatible
from bnfuse.runtime import conv_grad, conv_input_grad, reference, session_options

from .test_conv_grad import CASES, GEMM_CASES, SPLIT_CASES, _output_shape, chunked_reference, torch_input_grad

# beyond test_conv_grad's: a stride larger than the kernel (input positions no window reads: zero gradient) and
# negative-free end pads with an unused tail on both axes
EXTRA_CASES = {
    "2d-stride-past-kernel": ((2, 4, 9, 10), 6, (1, 2), (3, 3), (1, 1), (0, 1, 0, 0), 1),
    "2d-grouped-strided-dilated-tail": ((3, 6, 13, 12), 9, (3, 3), (2, 3), (2, 1), (1, 2, 0, 1), 3),
}
ALL_CASES = {**CASES, **EXTRA_CASES}


def _session(dy_shape, w_shape, threads: int = 0, **attributes) -> onnxruntime.InferenceSession:  # noqa: ANN001
    node = conv_input_grad.make_node("dy", "w", "dx", **attributes)
    graph = helper.make_graph(
        [node],
        "dx",
        [
            helper.make_tensor_value_info("dy", TensorProto.FLOAT, list(dy_shape)),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, list(w_shape)),
        ],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, None)],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(conv_grad.DOMAIN, 1)]
    model = ort_compatible(helper.make_model(graph, opset_imports=opsets))
    options = session_options(["CPUExecutionProvider"], intra_op_num_threads=threads)
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _case(name: str, seed: int = 0):  # noqa: ANN202
    x_shape, out_channels, kernel, strides, dilations, pads, group = ALL_CASES[name]
    dy_shape = _output_shape(x_shape, out_channels, kernel, strides, dilations, pads)
    w_shape = (out_channels, x_shape[1] // group, *kernel)
    rng = np.random.default_rng(seed)
    dy = rng.standard_normal(dy_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    attributes = dict(
        kernel_shape=kernel, output_shape=x_shape[2:], strides=strides, dilations=dilations, pads=pads, group=group
    )
    expected = reference.conv_input_grad(dy, w, x_shape[2:], strides, dilations, pads, group)
    assert expected.shape == x_shape
    return dy, w, attributes, expected


def _geometry(dy: np.ndarray, w: np.ndarray, attributes: dict) -> conv_grad.Geometry:
    group = attributes["group"]
    x_shape = (dy.shape[0], w.shape[1] * group, *attributes["output_shape"])
    return conv_grad.Geometry(
        x_shape, dy.shape, attributes["kernel_shape"], attributes["strides"], attributes["dilations"],
        attributes["pads"], group,
    )  # fmt: skip


def _assert_matches(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * float(np.abs(expected).max()))


def _torch_expected(dy: np.ndarray, w: np.ndarray, attributes: dict) -> np.ndarray:
    names = ("strides", "dilations", "pads", "group")
    return torch_input_grad(dy, w, attributes["output_shape"], **{k: attributes[k] for k in names})


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "numpy"])
@pytest.mark.parametrize("name", list(ALL_CASES))
def test_op_matches_float64_reference(name: str, onednn: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both paths against PyTorch's float64 gradient: the numpy path runs bnfuse's reference itself."""
    if onednn and not conv_grad.available():
        pytest.skip("oneDNN (onednn-cpu-gomp) is not installed")
    if not onednn:
        monkeypatch.setattr(conv_grad, "_extension", lambda: None)  # as in a process without oneDNN
    dy, w, attributes, _ = _case(name)
    got = _session(dy.shape, w.shape, **attributes).run(None, {"dy": dy, "w": w})[0]
    _assert_matches(got, _torch_expected(dy, w, attributes))


@pytest.mark.parametrize("name", list(ALL_CASES))
def test_reference_matches_torch_conv_input_grad(name: str) -> None:
    dy, w, attributes, expected = _case(name, seed=3)
    np.testing.assert_allclose(expected, _torch_expected(dy, w, attributes), rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not conv_grad.available(), reason="oneDNN (onednn-cpu-gomp) is not installed")
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize(
    "name",
    ["1d-strided-dilated-grouped", "2d-resnet-like", "2d-strided-unused-tail", "2d-depthwise", "3d",
     "2d-grouped-strided-dilated-tail", *SPLIT_CASES, *GEMM_CASES],
)  # fmt: skip
def test_op_on_the_session_pool_gives_the_chunks_bits(name: str, threads: int) -> None:
    """With onednn_threads(k) the op runs its chunks (batch, input channels or groups: conv_grad.split) as tasks on
    onnxruntime's intra-op pool, each writing its own part of dX: the chunks' one-thread results side by side, bit
    for bit, and float64's values. A batch chunk small enough for the core's matrix product runs on it (as a call on
    its images alone would), so a batch split need not give the unchunked call's bits."""
    dy, w, attributes, expected = _case(name, seed=7)
    session = _session(dy.shape, w.shape, threads=2, **attributes)
    with conv_grad.onednn_threads(threads):
        got = session.run(None, {"dy": dy, "w": w})[0]
    _assert_matches(got, expected)
    geometry = _geometry(dy, w, attributes)
    np.testing.assert_array_equal(got, chunked_reference(True, geometry, dy, w, threads))


def test_input_grad_checks_its_arrays() -> None:
    dy, w, attributes, _ = _case("1d")
    geometry = _geometry(dy, w, attributes)
    with pytest.raises(Exception, match="dY must be a C-contiguous float32 array"):
        conv_input_grad.input_grad(dy.astype(np.float64), w, geometry)
    with pytest.raises(Exception, match="W must be a C-contiguous float32 array"):
        conv_input_grad.input_grad(dy, np.asfortranarray(w[..., None])[..., 0].copy(order="F"), geometry)


def test_wrong_weight_shape_is_one_clear_error() -> None:
    dy, w, attributes, _ = _case("2d-resnet-like")
    wrong = np.zeros((w.shape[0] + 1, *w.shape[1:]), np.float32)  # one output channel more than dY has
    session = _session(dy.shape, wrong.shape, **attributes)
    with pytest.raises(Exception, match=r"ConvInputGrad: W \(9, 8, 3, 3\) does not fit dY \(4, 8, 12, 12\)"):
        session.run(None, {"dy": dy, "w": wrong})
    kernel = np.zeros((*w.shape[:2], 2, 2), np.float32)
    with pytest.raises(Exception, match=r"ConvInputGrad: W \(8, 8, 2, 2\) must be \[O, C/G, \*kernel_shape"):
        _session(dy.shape, kernel.shape, **attributes).run(None, {"dy": dy, "w": kernel})


def test_output_shape_is_required() -> None:
    node = helper.make_node(conv_input_grad.OP, ["dy", "w"], ["dx"], domain=conv_grad.DOMAIN, kernel_shape=[3])
    graph = helper.make_graph(
        [node],
        "dx",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1, 3]) for n in ("dy", "w")],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, None)],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(conv_grad.DOMAIN, 1)]
    model = ort_compatible(helper.make_model(graph, opset_imports=opsets))
    with pytest.raises(Exception, match="kernel_shape and output_shape .* are required"):
        session = onnxruntime.InferenceSession(
            model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"]
        )
        session.run(None, {"dy": np.zeros((1, 1, 3), np.float32), "w": np.zeros((1, 1, 3), np.float32)})


@pytest.mark.skipif(not conv_grad.available(), reason="oneDNN (onednn-cpu-gomp) is not installed")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_both_ops_match_torch_grads(name: str, threads: int) -> None:
    """Both ops, chunked over ``threads``, against PyTorch's own convolution gradients in float64
    (torch.nn.grad.conv{1,2,3}d_weight / _input on the explicitly padded X): 1-3-D, grouped, depthwise, dilated,
    strided, asymmetric pads, unused tails, and the deep layers that split over channels."""
    torch = pytest.importorskip("torch")
    from .test_conv_grad import _session as _weight_session

    dy, w, attributes, _ = _case(name, seed=13)
    spatial, pads = len(attributes["kernel_shape"]), attributes["pads"]
    x = np.random.default_rng(14).standard_normal(
        (dy.shape[0], w.shape[1] * attributes["group"], *attributes["output_shape"])
    )
    x = x.astype(np.float32)
    torch_pads = [p for axis in reversed(range(spatial)) for p in (pads[axis], pads[axis + spatial])]
    padded = torch.nn.functional.pad(torch.tensor(x, dtype=torch.float64), torch_pads)
    grad = (getattr(torch.nn.grad, f"conv{spatial}d_weight"), getattr(torch.nn.grad, f"conv{spatial}d_input"))
    common = dict(stride=attributes["strides"], dilation=attributes["dilations"], groups=attributes["group"])
    dy64, w64 = torch.tensor(dy, dtype=torch.float64), torch.tensor(w, dtype=torch.float64)
    want_dw = grad[0](padded, tuple(w.shape), dy64, **common).numpy()
    crop = (slice(None), slice(None), *(slice(pads[a], pads[a] + x.shape[2 + a]) for a in range(spatial)))
    want_dx = grad[1](tuple(padded.shape), w64, dy64, **common)[crop].numpy()
    weight_attributes = {k: v for k, v in attributes.items() if k != "output_shape"}
    with conv_grad.onednn_threads(threads):
        dw = _weight_session(x.shape, dy.shape, threads=2, **weight_attributes).run(None, {"x": x, "dy": dy})[0]
        dx = _session(dy.shape, w.shape, threads=2, **attributes).run(None, {"dy": dy, "w": w})[0]
    _assert_matches(dw, want_dw)
    _assert_matches(dx, want_dx)
