"""bnfuse.ConvWeightGrad in onnxruntime against the float64 reference; oneDNN on and off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper

from bnfuse.io import ort_compatible
from bnfuse.runtime import conv_grad, reference, session_options

ROOT = Path(__file__).resolve().parents[2]

# (X shape, output channels, kernel, strides, dilations, pads, group)
CASES = {
    "1d": ((2, 4, 11), 6, (3,), (1,), (1,), (1, 1), 1),
    "1d-strided-dilated-grouped": ((3, 6, 20), 4, (3,), (2,), (3,), (2, 0), 2),
    "2d-resnet-like": ((4, 8, 12, 12), 8, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 1),
    "2d-strided-unused-tail": ((2, 3, 11, 10), 8, (3, 3), (2, 2), (1, 1), (0, 0, 0, 0), 1),
    "2d-1x1-strided": ((2, 8, 9, 9), 16, (1, 1), (2, 2), (1, 1), (0, 0, 0, 0), 1),
    "2d-asym-pads-dilated-grouped": ((2, 4, 9, 8), 6, (3, 2), (2, 1), (1, 2), (1, 0, 2, 1), 2),
    "2d-depthwise": ((2, 8, 7, 6), 8, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 8),
    "3d": ((2, 3, 5, 6, 7), 4, (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1, 1, 1, 1), 1),
    "3d-strided-dilated-grouped": ((2, 4, 7, 8, 6), 4, (2, 3, 1), (1, 2, 2), (2, 1, 1), (0, 1, 1, 1, 0, 0), 4),
    "2d-deep-small": ((2, 48, 4, 4), 64, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 1),
    "2d-deep-strided-batch-1": ((1, 32, 7, 7), 40, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), 1),
    # depthwise geometries oneDNN's depthwise kernel refuses: the core's direct loop (native/onednn_direct.c)
    "2d-depthwise-5x5-small-map": ((4, 24, 2, 2), 24, (5, 5), (1, 1), (1, 1), (2, 2, 2, 2), 24),
    "2d-depthwise-multiplier-strided-dilated": ((2, 6, 9, 8), 12, (5, 3), (2, 1), (1, 2), (2, 1, 1, 2), 6),
    "2d-depthwise-5x5-strided-tail": ((3, 20, 11, 10), 20, (5, 5), (2, 2), (1, 1), (2, 2, 1, 1), 20),
    # at most 64 output positions over the batch: one matrix product in the core (native/onednn_gemm.c)
    "2d-small-map": ((3, 20, 3, 3), 40, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 1),
    "2d-small-map-strided-dilated-asym-pads": ((2, 7, 6, 5), 36, (3, 2), (2, 1), (2, 2), (2, 1, 1, 0), 1),
    # 2x2 output maps: the input gradient's product too
    "2d-2x2-map": ((4, 40, 2, 2), 24, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 1),
    "2d-strided-onto-2x2-asym-pads": ((3, 33, 4, 3), 20, (3, 2), (2, 2), (1, 1), (1, 0, 0, 1), 1),
}
# the matrix-product cases (and "2d-deep-small", "2d-deep-strided-batch-1", "2d-strided-unused-tail"; the input
# gradient's: the 2x2 ones): channels a multiple of 16 and not, padding on one side only, a dilation larger than the
# map's unused tail
GEMM_CASES = ("2d-small-map", "2d-small-map-strided-dilated-asym-pads", "2d-2x2-map", "2d-strided-onto-2x2-asym-pads")
# the direct loop's cases: one lane block and a partial one (24 channels), a channel multiplier of 2
DIRECT_CASES = (
    "2d-depthwise-5x5-small-map",
    "2d-depthwise-multiplier-strided-dilated",
    "2d-depthwise-5x5-strided-tail",
)


def _output_shape(x_shape, out_channels, kernel, strides, dilations, pads):  # noqa: ANN001, ANN202
    spatial = len(kernel)
    sizes = [
        (x_shape[2 + i] + pads[i] + pads[i + spatial] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1
        for i in range(spatial)
    ]
    return (x_shape[0], out_channels, *sizes)


def _session(x_shape, dy_shape, threads: int = 0, **attributes) -> onnxruntime.InferenceSession:  # noqa: ANN001
    node = conv_grad.make_node("x", "dy", "dw", **attributes)
    graph = helper.make_graph(
        [node],
        "dw",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape)),
            helper.make_tensor_value_info("dy", TensorProto.FLOAT, list(dy_shape)),
        ],
        [helper.make_tensor_value_info("dw", TensorProto.FLOAT, None)],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(conv_grad.DOMAIN, 1)]
    model = ort_compatible(helper.make_model(graph, opset_imports=opsets))
    options = session_options(["CPUExecutionProvider"], intra_op_num_threads=threads)
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _case(name: str, seed: int = 0):  # noqa: ANN202
    x_shape, out_channels, kernel, strides, dilations, pads, group = CASES[name]
    dy_shape = _output_shape(x_shape, out_channels, kernel, strides, dilations, pads)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(np.float32)
    dy = rng.standard_normal(dy_shape).astype(np.float32)
    attributes = dict(kernel_shape=kernel, strides=strides, dilations=dilations, pads=pads, group=group)
    expected = reference.conv_weight_grad(x, dy, kernel, strides, dilations, pads, group)
    return x, dy, attributes, expected


def _assert_matches(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * float(np.abs(expected).max()))


def _torch_padded(x: np.ndarray, pads: tuple[int, ...]):  # noqa: ANN202
    """X as a float64 torch tensor, zero-padded by ONNX pads (begins then ends; torch.nn.grad takes symmetric ones)."""
    import torch

    spatial = len(pads) // 2
    widths = [w for axis in reversed(range(spatial)) for w in (pads[axis], pads[axis + spatial])]
    return torch.nn.functional.pad(torch.tensor(x, dtype=torch.float64), widths)


def torch_weight_grad(x: np.ndarray, dy: np.ndarray, kernel, strides, dilations, pads, group: int) -> np.ndarray:  # noqa: ANN001
    """The oracle every case is checked against: torch.nn.grad.conv{1,2,3}d_weight in float64 (independent of
    bnfuse's NumPy reference, which the op's no-oneDNN path runs)."""
    torch = pytest.importorskip("torch")
    weight_grad = getattr(torch.nn.grad, f"conv{len(kernel)}d_weight")
    shape = (dy.shape[1], x.shape[1] // group, *kernel)
    xt, dyt = _torch_padded(x, pads), torch.tensor(dy, dtype=torch.float64)
    return weight_grad(xt, shape, dyt, stride=strides, dilation=dilations, groups=group).numpy()


def torch_input_grad(dy: np.ndarray, w: np.ndarray, spatial, strides, dilations, pads, group: int) -> np.ndarray:  # noqa: ANN001
    """torch.nn.grad.conv{1,2,3}d_input in float64 on the padded input, cropped back to the Conv's input."""
    torch = pytest.importorskip("torch")
    input_grad = getattr(torch.nn.grad, f"conv{len(spatial)}d_input")
    rank = len(spatial)
    padded = [spatial[i] + pads[i] + pads[i + rank] for i in range(rank)]
    shape = (dy.shape[0], w.shape[1] * group, *padded)
    wt, dyt = torch.tensor(w, dtype=torch.float64), torch.tensor(dy, dtype=torch.float64)
    full = input_grad(shape, wt, dyt, stride=strides, dilation=dilations, groups=group)
    crop = tuple(slice(pads[i], pads[i] + spatial[i]) for i in range(rank))
    return full[(slice(None), slice(None), *crop)].numpy()


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "numpy"])
@pytest.mark.parametrize("name", list(CASES))
def test_op_matches_float64_reference(name: str, onednn: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both paths against PyTorch's float64 gradient: the numpy path runs bnfuse's reference itself, so checking it
    against that reference would compare the reference with itself."""
    if onednn and not conv_grad.available():
        pytest.skip("oneDNN (onednn-cpu-gomp) is not installed")
    if not onednn:
        monkeypatch.setattr(conv_grad, "_extension", lambda: None)  # as in a process without oneDNN
    x, dy, attributes, _ = _case(name)
    expected = torch_weight_grad(x, dy, **{k: attributes[k] for k in ("strides", "dilations", "pads", "group")},
                                 kernel=attributes["kernel_shape"])  # fmt: skip
    got = _session(x.shape, dy.shape, **attributes).run(None, {"x": x, "dy": dy})[0]
    _assert_matches(got, expected)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_torch_conv_weight_grad(name: str) -> None:
    x, dy, attributes, expected = _case(name, seed=3)
    want = torch_weight_grad(x, dy, **{k: attributes[k] for k in ("strides", "dilations", "pads", "group")},
                             kernel=attributes["kernel_shape"])  # fmt: skip
    np.testing.assert_allclose(expected, want, rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not conv_grad.available(), reason="oneDNN (onednn-cpu-gomp) is not installed")
def test_onednn_threads_setting_is_per_call() -> None:
    x, dy, attributes, expected = _case("2d-resnet-like", seed=1)
    geometry = conv_grad.Geometry(
        x.shape, dy.shape, attributes["kernel_shape"], attributes["strides"], attributes["dilations"],
        attributes["pads"], attributes["group"],
    )  # fmt: skip
    with conv_grad.onednn_threads(1):
        single = conv_grad.weight_grad(x, dy, geometry)
    _assert_matches(single, expected)
    _assert_matches(conv_grad.weight_grad(x, dy, geometry), expected)
    with conv_grad.onednn_threads(0):  # one call on oneDNN's own OpenMP team
        _assert_matches(conv_grad.weight_grad(x, dy, geometry), expected)


def _geometry(x_shape, dy_shape, attributes: dict) -> conv_grad.Geometry:  # noqa: ANN001
    return conv_grad.Geometry(
        tuple(x_shape), tuple(dy_shape), tuple(attributes["kernel_shape"]), tuple(attributes["strides"]),
        tuple(attributes["dilations"]), tuple(attributes["pads"]), attributes["group"],
    )  # fmt: skip


def _chunk_geometry(geometry: conv_grad.Geometry, axis: int, size: int, input_grad: bool) -> conv_grad.Geometry:
    g = geometry
    x_shape, dy_shape, group = list(g.x_shape), list(g.dy_shape), g.group
    if axis == conv_grad.SPLIT_BATCH:
        x_shape[0] = dy_shape[0] = size
    elif axis == conv_grad.SPLIT_GROUPS:
        group, x_shape[1], dy_shape[1] = size, size * (g.x_shape[1] // g.group), size * (g.dy_shape[1] // g.group)
    elif input_grad:
        x_shape[1] = size
    else:
        dy_shape[1] = size
    return conv_grad.Geometry(tuple(x_shape), tuple(dy_shape), g.kernel_shape, g.strides, g.dilations, g.pads, group)


def chunked_reference(
    input_grad: bool, geometry: conv_grad.Geometry, first: np.ndarray, second: np.ndarray, threads: int
) -> np.ndarray:
    """The bits a gradient split over ``threads`` must give, built from one-thread calls on each chunk's own
    (contiguous) operands: batch chunks' weight gradients added in chunk order, batch chunks' input gradients side
    by side; channel or group chunks' results side by side along the output's channels."""
    from bnfuse.runtime import conv_input_grad

    axis, sizes = conv_grad.split(geometry, threads, input_grad=input_grad)
    og, cg = geometry.dy_shape[1] // geometry.group, geometry.x_shape[1] // geometry.group
    parts = []
    for start, size in zip(np.cumsum((0, *sizes[:-1])).tolist(), sizes, strict=True):
        part = _chunk_geometry(geometry, axis, size, input_grad)
        if axis == conv_grad.SPLIT_BATCH:
            a, b = first[start : start + size], (second if input_grad else second[start : start + size])
        elif axis == conv_grad.SPLIT_GROUPS:
            rows = slice(start * og, (start + size) * og)
            if input_grad:  # dY's and W's rows of these groups
                a, b = first[:, rows], second[rows]
            else:  # X's and dY's channels of these groups
                a, b = first[:, start * cg : (start + size) * cg], second[:, rows]
        elif input_grad:  # input channels: all of dY, W's columns
            a, b = first, second[:, start : start + size]
        else:  # output channels: all of X, dY's channels
            a, b = first, second[:, start : start + size]
        a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
        with conv_grad.onednn_threads(1):
            parts.append(conv_input_grad.input_grad(a, b, part) if input_grad else conv_grad.weight_grad(a, b, part))
    if axis == conv_grad.SPLIT_BATCH and not input_grad:
        total = parts[0]
        for partial in parts[1:]:
            total = total + partial
        return total
    along = 1 if (input_grad and axis != conv_grad.SPLIT_BATCH) else 0
    return np.concatenate(parts, axis=along)


# deep layers at a small batch: the weight outweighs X and dY, so the channels split
SPLIT_CASES = ("2d-deep-small", "2d-deep-strided-batch-1")


@pytest.mark.skipif(not conv_grad.available(), reason="oneDNN (onednn-cpu-gomp) is not installed")
def test_split_follows_the_shape_and_the_threads() -> None:
    def geometry(batch: int, channels: int, size: int) -> conv_grad.Geometry:
        shape = (batch, channels, size, size)
        return conv_grad.Geometry(shape, shape, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 1)

    split, batch, channels = conv_grad.split, conv_grad.SPLIT_BATCH, conv_grad.SPLIT_CHANNELS
    assert split(geometry(32, 16, 32), 2) == (batch, (16, 16))  # 4 MiB of X and dY: one chunk per thread
    assert split(geometry(128, 32, 64), 2) == (batch, (16,) * 8)  # 128 MiB: 8 chunks of 16 MiB
    assert split(geometry(128, 32, 64), 3)[1] == (15, 15) + (14,) * 7  # a multiple of the threads
    assert split(geometry(7, 3, 8), 3) == (batch, (3, 2, 2))  # the first ones larger
    assert split(geometry(1, 3, 8), 2) == (batch, (1,))  # nothing to split
    assert split(geometry(4, 512, 2), 2) == (channels, (256, 256))  # resnet's last stage
    assert split(geometry(4, 512, 2), 2, input_grad=True) == (channels, (256, 256))
    assert split(geometry(4, 512, 2), 0) == (batch, (4,))  # one call on OpenMP's own team
    assert split(geometry(4, 16, 4), 2) == (batch, (4,))  # one matrix product, 16 rows: one chunk
    assert split(geometry(4, 16, 4), 2, input_grad=True) == (batch, (2, 2))  # the primitive's split
    assert split(geometry(4, 40, 4), 3) == (channels, (16, 24))  # the product's rows: 16-row units
    depthwise = conv_grad.Geometry((2, 8, 7, 6), (2, 8, 7, 6), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 8)
    assert split(depthwise, 3) == (conv_grad.SPLIT_GROUPS, (3, 3, 2))


@pytest.mark.skipif(not conv_grad.available(), reason="oneDNN (onednn-cpu-gomp) is not installed")
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize(
    "name",
    ["1d-strided-dilated-grouped", "2d-resnet-like", "2d-strided-unused-tail", "2d-depthwise", "3d",
     "3d-strided-dilated-grouped", *SPLIT_CASES, *DIRECT_CASES, *GEMM_CASES],
)  # fmt: skip
def test_op_on_the_session_pool_gives_the_chunks_bits(name: str, threads: int) -> None:
    """With onednn_threads(k) the op runs its chunks (batch, channels or groups: conv_grad.split) as tasks on
    onnxruntime's intra-op pool: the result is the chunks' one-thread weight gradients (batch chunks added in chunk
    order), bit for bit, and matches float64."""
    x, dy, attributes, expected = _case(name, seed=7)
    session = _session(x.shape, dy.shape, threads=2, **attributes)
    with conv_grad.onednn_threads(threads):
        got = session.run(None, {"x": x, "dy": dy})[0]
    _assert_matches(got, expected)
    np.testing.assert_array_equal(
        got, chunked_reference(False, _geometry(x.shape, dy.shape, attributes), x, dy, threads)
    )


@pytest.mark.parametrize("name", DIRECT_CASES)
def test_direct_depthwise_loop_bits_do_not_depend_on_the_threads(name: str) -> None:
    """The direct loop sums each output channel on one task in one order: 1, 2 and 3 threads on the session's pool
    give the same bits, and they match float64 (the loop runs without oneDNN too: its cases need no skip)."""
    x, dy, attributes, _ = _case(name, seed=11)
    expected = torch_weight_grad(x, dy, **{k: attributes[k] for k in ("strides", "dilations", "pads", "group")},
                                 kernel=attributes["kernel_shape"])  # fmt: skip
    session = _session(x.shape, dy.shape, threads=3, **attributes)
    results = []
    for threads in (1, 2, 3):
        with conv_grad.onednn_threads(threads):
            results.append(session.run(None, {"x": x, "dy": dy})[0])
    _assert_matches(results[0], expected)
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


@pytest.mark.skipif(not conv_grad.available(), reason="oneDNN (onednn-cpu-gomp) is not installed")
def test_the_cases_exercise_every_split() -> None:
    """The cases above cover the batch, channel and group splits of both gradients."""
    seen = set()
    for name in ("2d-resnet-like", "2d-depthwise", *SPLIT_CASES):
        x, dy, attributes, _ = _case(name)
        geometry = _geometry(x.shape, dy.shape, attributes)
        seen |= {(grad, conv_grad.split(geometry, 2, input_grad=grad)[0]) for grad in (False, True)}
    assert seen == {(grad, axis) for grad in (False, True) for axis in (0, 1, 2)}


@pytest.mark.skipif(not conv_grad.available(), reason="oneDNN (onednn-cpu-gomp) is not installed")
@pytest.mark.parametrize("threads", [1, 2])
def test_more_chunks_than_pool_threads_share_the_threads_workspaces(threads: int) -> None:
    """A batch past the core's 16 MiB chunk cap runs as more chunks than pool threads, taking the threads'
    workspaces in turn: the chunks' gradients added in order, bit for bit, and one workspace per thread held (not
    one per chunk)."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((12, 16, 160, 160)).astype(np.float32)  # X and dY: 39 MiB, 3.3 MiB per image
    dy = rng.standard_normal((12, 16, 160, 160)).astype(np.float32)
    attributes = dict(kernel_shape=(3, 3), strides=(1, 1), dilations=(1, 1), pads=(1, 1, 1, 1), group=1)
    geometry = _geometry(x.shape, dy.shape, attributes)
    axis, sizes = conv_grad.split(geometry, threads)
    assert axis == conv_grad.SPLIT_BATCH and len(sizes) > threads
    conv_grad.release_workspaces()
    session = _session(x.shape, dy.shape, threads=threads, **attributes)
    with conv_grad.onednn_threads(threads):
        got = session.run(None, {"x": x, "dy": dy})[0]
    held = conv_grad.workspace_bytes()
    want = chunked_reference(False, geometry, x, dy, threads)
    np.testing.assert_array_equal(got, want)
    largest_chunk = max(sizes) * (x[0].nbytes + dy[0].nbytes)
    partials = (len(sizes) - 1) * want.nbytes
    assert (threads - 0.5) * largest_chunk < held < threads * 1.5 * largest_chunk + partials
    conv_grad.release_workspaces()
    assert conv_grad.workspace_bytes() == 0


def _nchwc(x: np.ndarray, block: int) -> np.ndarray:
    """x (N, C, H, W) in onnxruntime's NCHWc layout: (N, C/block, H, W, block) in memory, shaped (N, C, H, W)."""
    n, c, h, w = x.shape
    return np.ascontiguousarray(x.reshape(n, c // block, block, h, w).transpose(0, 1, 3, 4, 2)).reshape(x.shape)


# (X shape, output channels, kernel, strides, dilations, pads): 2-D, ungrouped, channels a multiple of the block
BLOCKED_CASES = {
    "3x3": ((4, 16, 12, 12), 8, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
    "3x3-strided": ((3, 16, 11, 10), 32, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1)),
    "1x1-strided": ((2, 32, 9, 9), 16, (1, 1), (2, 2), (1, 1), (0, 0, 0, 0)),
    "dilated-asym-pads": ((2, 16, 9, 8), 8, (3, 2), (1, 1), (2, 1), (2, 0, 1, 1)),
    # at most 64 output positions: the core unrolls the blocked X itself (native/onednn_gemm.c)
    "3x3-small-map": ((4, 32, 2, 2), 48, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
    "strided-dilated-small-map": ((2, 16, 5, 6), 20, (3, 3), (2, 2), (2, 1), (1, 0, 2, 1)),
}


@pytest.mark.skipif(not conv_grad.available(), reason="oneDNN (onednn-cpu-gomp) is not installed")
@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("name", list(BLOCKED_CASES))
def test_blocked_x_gives_the_plain_x_gradient(name: str, block: int, chunks: int) -> None:
    """x_block: X in NCHWc (what TrainingSession feeds from the forward Conv's ReorderInput): the float64 reference's
    gradient of the plain X, and the plain-X op's bits (oneDNN computes in the blocked layout either way)."""
    x_shape, out_channels, kernel, strides, dilations, pads = BLOCKED_CASES[name]
    dy_shape = _output_shape(x_shape, out_channels, kernel, strides, dilations, pads)
    rng = np.random.default_rng(11)
    x = rng.standard_normal(x_shape).astype(np.float32)
    dy = rng.standard_normal(dy_shape).astype(np.float32)
    attributes = dict(kernel_shape=kernel, strides=strides, dilations=dilations, pads=pads, group=1)
    expected = reference.conv_weight_grad(x, dy, kernel, strides, dilations, pads, 1)
    blocked = _session(x_shape, dy_shape, threads=2, x_block=block, **attributes)
    plain = _session(x_shape, dy_shape, threads=2, **attributes)
    with conv_grad.onednn_threads(chunks):
        got = blocked.run(None, {"x": _nchwc(x, block), "dy": dy})[0]
        plain_got = plain.run(None, {"x": x, "dy": dy})[0]
    _assert_matches(got, expected)
    np.testing.assert_array_equal(got, plain_got)


@pytest.mark.parametrize(
    ("x_shape", "block", "group", "message"),
    [
        ((2, 12, 5, 5), 8, 1, "channels a multiple of the block"),
        ((2, 16, 5, 5), 8, 2, "ungrouped"),
        ((2, 16, 5, 5), 4, 1, "x_block must be 0 \\(plain NCHW X\\), 8 or 16, got 4"),
    ],
)
def test_blocked_x_that_does_not_fit_is_refused(x_shape, block: int, group: int, message: str) -> None:  # noqa: ANN001
    dy_shape = (x_shape[0], 8, 3, 3)
    attributes = dict(kernel_shape=(3, 3), strides=(1, 1), dilations=(1, 1), pads=(0, 0, 0, 0), group=group)
    feeds = {"x": np.zeros(x_shape, np.float32), "dy": np.zeros(dy_shape, np.float32)}
    with pytest.raises(Exception, match=message):
        _session(x_shape, dy_shape, x_block=block, **attributes).run(None, feeds)


def test_blocked_x_without_onednn_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conv_grad, "_extension", lambda: None)  # as in a process without oneDNN
    x_shape, dy_shape = (2, 8, 5, 5), (2, 8, 3, 3)
    attributes = dict(kernel_shape=(3, 3), strides=(1, 1), dilations=(1, 1), pads=(0, 0, 0, 0), group=1)
    feeds = {"x": np.zeros(x_shape, np.float32), "dy": np.zeros(dy_shape, np.float32)}
    with pytest.raises(Exception, match="a blocked \\(NCHWc\\) X needs oneDNN"):
        _session(x_shape, dy_shape, x_block=8, **attributes).run(None, feeds)


def test_wrong_dy_shape_is_one_clear_error() -> None:
    x, dy, attributes, _ = _case("2d-resnet-like")
    session = _session(x.shape, (dy.shape[0], dy.shape[1], 5, 5), **attributes)
    with pytest.raises(Exception, match=r"ConvWeightGrad: dY has spatial shape \(5, 5\), the Conv gives \(12, 12\)"):
        session.run(None, {"x": x, "dy": np.zeros((dy.shape[0], dy.shape[1], 5, 5), np.float32)})


def test_kernel_shape_is_required() -> None:
    node = helper.make_node(conv_grad.OP, ["x", "dy"], ["dw"], domain=conv_grad.DOMAIN)
    graph = helper.make_graph(
        [node],
        "dw",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1, 3]) for n in ("x", "dy")],
        [helper.make_tensor_value_info("dw", TensorProto.FLOAT, None)],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(conv_grad.DOMAIN, 1)]
    model = ort_compatible(helper.make_model(graph, opset_imports=opsets))
    with pytest.raises(Exception, match="kernel_shape is required"):
        session = onnxruntime.InferenceSession(
            model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"]
        )
        session.run(None, {"x": np.zeros((1, 1, 3), np.float32), "dy": np.zeros((1, 1, 3), np.float32)})


def test_library_is_found_in_the_installed_wheel() -> None:
    from importlib import metadata

    try:
        metadata.distribution(conv_grad.WHEEL)
    except metadata.PackageNotFoundError:
        pytest.skip("onednn-cpu-gomp is not installed")
    path = conv_grad.library_path()
    assert path is not None and path.name.startswith("libdnnl.so") and path.is_file()
    assert conv_grad.available()
    assert conv_grad.version()[0] == 3


_FALLBACK_SCRIPT = """
import numpy as np, torch
from bnfuse.passes.training import build_training_graph
from bnfuse.runtime import conv_grad
from bnfuse.training import TrainingSession
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                          torch.nn.Conv2d(8, 8, 3, stride=2, padding=1), torch.nn.Flatten(), torch.nn.Linear(8 * 16, 4))
net.eval()
x = torch.randn(4, 3, 8, 8)
import io, onnx
buffer = io.BytesIO()
torch.onnx.export(net, (x,), buffer, dynamo=False, training=torch.onnx.TrainingMode.PRESERVE,
                  do_constant_folding=False)
model = onnx.load_from_string(buffer.getvalue())
train, _ = build_training_graph(model)
ops = sum(n.op_type == conv_grad.OP for n in train.graph.node)
session = TrainingSession(train, lr=0.1)
rng = np.random.default_rng(0)
losses = [session.step(rng.standard_normal((4, 3, 8, 8)).astype(np.float32), rng.integers(0, 4, 4)) for _ in range(3)]
print(conv_grad.available(), ops, *losses)
"""


def _run_fallback_script(onednn: str) -> list[str]:
    pytest.importorskip("torch")
    env = {**os.environ, "BNFUSE_ONEDNN": onednn, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _FALLBACK_SCRIPT], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_without_onednn_the_graph_rule_trains_the_same() -> None:
    """BNFUSE_ONEDNN=0 (as without the wheel): no ConvWeightGrad nodes, and the same losses as with oneDNN."""
    off = _run_fallback_script("0")
    assert off[:2] == ["False", "0"]
    if not conv_grad.available():
        return
    on = _run_fallback_script("1")
    assert on[:2] == ["True", "2"]
    np.testing.assert_allclose([float(v) for v in on[2:]], [float(v) for v in off[2:]], rtol=1e-5)


def test_weight_grad_checks_its_arrays() -> None:
    x, dy, attributes, _ = _case("1d")
    geometry = conv_grad.Geometry(
        x.shape, dy.shape, attributes["kernel_shape"], attributes["strides"], attributes["dilations"],
        attributes["pads"], attributes["group"],
    )  # fmt: skip
    with pytest.raises(Exception, match="X must be a C-contiguous float32 array"):
        conv_grad.weight_grad(x.astype(np.float64), dy, geometry)
    with pytest.raises(Exception, match="dY must be a C-contiguous float32 array"):
        conv_grad.weight_grad(x, np.asfortranarray(dy), geometry)


def test_concurrent_calls_on_one_plan_give_right_results() -> None:
    """Threads share the cached plan (its buffers) and oneDNN's stream: calls must not interleave."""
    from concurrent.futures import ThreadPoolExecutor

    x, dy, attributes, expected = _case("2d-resnet-like", seed=5)
    geometry = conv_grad.Geometry(
        x.shape, dy.shape, attributes["kernel_shape"], attributes["strides"], attributes["dilations"],
        attributes["pads"], attributes["group"],
    )  # fmt: skip
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: conv_grad.weight_grad(x, dy, geometry), range(16)))
    for result in results:
        _assert_matches(result, expected)


def test_plans_share_one_workspace_sized_for_the_largest_call() -> None:
    """Cached plans own no buffers: the blocked copies of X and dY live in one workspace per chunk slot, grown to the
    largest call's need (not one per geometry), and a smaller geometry after a larger one still gets its own bits."""
    if not conv_grad.available():
        pytest.skip("needs oneDNN")
    cases = [_case(name, seed=7) for name in ("2d-resnet-like", "3d", "2d-1x1-strided")]
    needs = []
    for x, dy, attributes, expected in cases:  # each alone: what it needs
        conv_grad.release_workspaces()
        _assert_matches(conv_grad.weight_grad(x, dy, _geometry(x.shape, dy.shape, attributes)), expected)
        needs.append(conv_grad.workspace_bytes())
    assert max(needs) > 0 and sum(needs) > max(needs)  # the geometries need workspace, and not all the same
    conv_grad.release_workspaces()
    for x, dy, attributes, expected in cases:  # one after another: the largest need, not their sum
        _assert_matches(conv_grad.weight_grad(x, dy, _geometry(x.shape, dy.shape, attributes)), expected)
    held = conv_grad.workspace_bytes()
    assert held == max(needs)
    x, dy, attributes, expected = cases[0]  # after the others, in the same (reused) workspace
    _assert_matches(conv_grad.weight_grad(x, dy, _geometry(x.shape, dy.shape, attributes)), expected)
    assert conv_grad.workspace_bytes() == held
    conv_grad.release_workspaces()
    assert conv_grad.workspace_bytes() == 0
