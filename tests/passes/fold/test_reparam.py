"""Branch merging in `optimize` (bnfuse.passes.fold.reparam) on hand-built RepVGG / MobileOne / ACNet / DBB / RepViT
blocks: one Conv per block, outputs as onnxruntime computes the branches, every merge proven by the check, and
refusals with their reason."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import bnfuse
from bnfuse.passes.optimize import prove


class Block:
    """A graph under construction: x (N, C, H, W) -> Relu -> branches."""

    def __init__(self, channels: int = 4, side: int = 6, dtype: type = np.float32, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.dtype = np.dtype(dtype)
        self.elem = helper.np_dtype_to_tensor_dtype(self.dtype)
        self.channels, self.side = channels, side
        self.nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu")]
        self.inits: list[onnx.TensorProto] = []
        self.outputs: list[str] = []
        self.count = 0

    def name(self, base: str) -> str:
        self.count += 1
        return f"{base}{self.count}"

    def constant(self, values: np.ndarray, base: str) -> str:
        name = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(values).astype(self.dtype), name))
        return name

    def conv(
        self,
        source: str,
        window: tuple[int, int],
        *,
        c_out: int | None = None,
        groups: int = 1,
        stride: int = 1,
        pads: tuple[int, ...] | None = None,
        bias: bool = True,
        dilation: int = 1,
    ) -> str:
        c_in = self.channels if source in ("r", "x") else None
        c_in = c_in or self.width[source]
        c_out = c_out or self.channels
        weight = self.constant(self.rng.normal(0, 0.5, (c_out, c_in // groups, *window)), "w")
        inputs = [source, weight] + ([self.constant(self.rng.normal(0, 0.5, c_out), "b")] if bias else [])
        pads = pads if pads is not None else (window[0] // 2 * dilation, window[1] // 2 * dilation) * 2
        out = self.name("conv")
        attrs = {"group": groups, "strides": [stride] * 2, "pads": list(pads), "kernel_shape": list(window)}
        self.nodes.append(helper.make_node("Conv", inputs, [out], name=out, dilations=[dilation] * 2, **attrs))
        self.width[out] = c_out
        return out

    @property
    def width(self) -> dict[str, int]:
        if not hasattr(self, "_width"):
            self._width: dict[str, int] = {}
        return self._width

    def bn(self, source: str) -> str:
        c = self.width.get(source, self.channels)
        params = [
            self.constant(self.rng.uniform(0.5, 1.5, c), "s"), self.constant(self.rng.normal(0, 0.5, c), "bb"),
            self.constant(self.rng.normal(0, 0.5, c), "m"), self.constant(self.rng.uniform(0.5, 1.5, c), "v"),
        ]  # fmt: skip
        out = self.name("bn")
        self.nodes.append(helper.make_node("BatchNormalization", [source, *params], [out], name=out))
        self.width[out] = c
        return out

    def op(self, op: str, inputs: list[str], **attrs: object) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        if inputs and inputs[0] in self.width:
            self.width[out] = self.width[inputs[0]]
        return out

    def add_all(self, terms: list[str]) -> str:
        total = terms[0]
        for term in terms[1:]:
            total = self.op("Add", [total, term])
        return total

    def pad(self, source: str, pads: tuple[int, int, int, int], value: float = 0.0, *, opset: int = 17) -> str:
        """ONNX Pad of the spatial axes (pads: top, left, bottom, right), constant mode: inputs from opset 11,
        attributes before."""
        full = [0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]]
        if opset < 11:
            return self.op("Pad", [source], pads=full, value=float(value))
        name = self.name("pads")
        self.inits.append(numpy_helper.from_array(np.array(full, np.int64), name))
        return self.op("Pad", [source, name, self.constant(np.array(value), "value")])

    def model(self, output: str, out_side: int | None = None, opset: int = 17) -> onnx.ModelProto:
        side = out_side or self.side
        shape = [1, self.width.get(output, self.channels), side, side]
        outputs = [helper.make_tensor_value_info(output, self.elem, shape)]
        outputs += [
            helper.make_tensor_value_info(o, self.elem, [1, self.width[o], self.side, self.side]) for o in self.outputs
        ]
        graph = helper.make_graph(
            self.nodes, "block",
            [helper.make_tensor_value_info("x", self.elem, [1, self.channels, self.side, self.side])], outputs,
            self.inits,
        )  # fmt: skip
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8 if opset > 10 else 5
        return model


def run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def optimize_and_compare(block: Block, model: onnx.ModelProto, rtol: float = 1e-5):  # noqa: ANN201
    optimized, report = bnfuse.optimize(model, check=True)
    x = block.rng.normal(size=(1, block.channels, block.side, block.side)).astype(block.dtype)
    for want, got in zip(run(model, x), run(optimized, x), strict=True):
        scale = max(float(np.max(np.abs(want.astype(np.float64)))), 1e-6)
        assert float(np.max(np.abs(want.astype(np.float64) - got.astype(np.float64)))) / scale <= rtol
    assert report.check is not None and report.check.passed
    merges = [m for m in report.merges if m.status == "merged"]
    proofs = {f.node: f for f in report.check.folds if f.status == "merged"}
    assert all(proofs[m.node].outcome == "ok" and proofs[m.node].isolated is not None for m in merges), proofs
    return optimized, report


@pytest.mark.parametrize("stride", [1, 2])
def test_repvgg_block_becomes_one_conv(stride: int) -> None:
    block = Block()
    terms = [block.bn(block.conv("r", (3, 3), stride=stride, bias=False)),
             block.bn(block.conv("r", (1, 1), stride=stride, bias=False, pads=(0,) * 4))]  # fmt: skip
    if stride == 1:
        terms.append(block.bn("r"))
    y = block.op("Relu", [block.add_all(terms)])
    model = block.model(y, out_side=3 if stride == 2 else None)
    optimized, report = optimize_and_compare(block, model)
    assert ops(optimized) == ["Relu", "Conv", "Relu"]
    (merge,) = report.merges
    assert merge.status == "merged" and merge.kernel == [3, 3] and merge.groups == 1 and merge.input == "r"
    assert len(merge.branches) == len(terms) and "BatchNormalization" in merge.branches[0]
    assert (
        report.count("folded") == len(terms) and report.merged_batchnorms == len(terms) and not report.count("skipped")
    )
    text = report.format_text(verbose=True)
    assert "1 merged into one Conv" in text and f"merged     {merge.node}: [Conv " in text
    data = json.loads(report.to_json())
    assert data["merges"][0]["into"] == merge.into and data["summary"]["merges"] == 1


def test_mobileone_depthwise_block_with_sum_and_scale_branch() -> None:
    block = Block(channels=6)
    terms = [block.bn(block.conv("r", (3, 3), groups=6, bias=False)) for _ in range(4)]
    terms.append(block.bn(block.conv("r", (1, 1), groups=6, bias=False)))  # the scale branch
    terms.append(block.bn("r"))
    terms.append(block.op("Mul", ["r", block.constant(block.rng.uniform(0.5, 2, (6, 1, 1)), "k")]))
    y = block.op("Sum", terms)
    optimized, report = optimize_and_compare(block, block.model(y))
    assert ops(optimized) == ["Relu", "Conv"]
    conv = optimized.graph.node[1]
    assert next(a.i for a in conv.attribute if a.name == "group") == 6
    assert report.merges[0].kernel == [3, 3] and len(report.merges[0].branches) == 7


def test_acnet_asymmetric_branches_and_average_pool_in_float16() -> None:
    block = Block(dtype=np.float16, seed=3)
    terms = [
        block.bn(block.conv("r", (3, 3), bias=False)),
        block.bn(block.conv("r", (1, 3), bias=False, pads=(0, 1, 0, 1))),
        block.bn(block.conv("r", (3, 1), bias=False, pads=(1, 0, 1, 0))),
        block.bn(block.op("AveragePool", ["r"], kernel_shape=[3, 3], pads=[1] * 4, count_include_pad=1)),
    ]
    optimized, report = optimize_and_compare(block, block.model(block.add_all(terms)), rtol=3e-3)
    assert ops(optimized) == ["Relu", "Conv"] and report.merges[0].status == "merged"
    weight = next(t for t in optimized.graph.initializer if t.name == optimized.graph.node[1].input[1])
    assert weight.data_type == TensorProto.FLOAT16


def test_dbb_pairs_merge_where_exact_and_are_refused_where_padding_meets_a_bias() -> None:
    block = Block(seed=4)
    wide = block.conv("r", (1, 1), c_out=6, bias=False, pads=(0,) * 4)
    pair = block.conv(wide, (3, 3), bias=False)  # 1x1 (no bias) -> padded 3x3: exact
    pooled = block.op(
        "AveragePool",
        [block.conv("r", (1, 1), bias=True, pads=(0,) * 4)],
        kernel_shape=[3, 3],
        pads=[1] * 4,
        count_include_pad=1,
    )  # fmt: skip  (biased 1x1 -> padded pool: not exact)
    model = block.model(block.add_all([block.bn(block.conv("r", (3, 3))), block.bn(pair), pooled]))
    optimized, report = optimize_and_compare(block, model)
    assert sorted(ops(optimized)) == ["Add", "AveragePool", "Conv", "Conv", "Relu"]  # the pooled branch kept apart
    (merge,) = report.merges
    assert merge.status == "merged" and len(merge.branches) == 2 and "zero padding is not its bias" in merge.reason

    block = Block(seed=5)
    wide = block.bn(block.conv("r", (1, 1), c_out=6, pads=(0,) * 4))
    pair = block.conv(wide, (3, 3), pads=(0,) * 4)  # DBB's 1x1 -> BN -> 3x3 without padding: exact
    model = block.model(block.add_all([block.conv("r", (3, 3), pads=(0,) * 4), pair]), out_side=4)
    optimized, report = optimize_and_compare(block, model)
    assert ops(optimized) == ["Relu", "Conv"] and report.merges[0].status == "merged"


@pytest.mark.parametrize("opset", [10, 17])
def test_dbb_pad_by_the_bn_bias_merges_and_any_other_pad_value_is_refused(opset: int) -> None:
    """DBB's 1 x 1 -> BN -> pad with the BN's bias -> unpadded 3 x 3, as ONNX writes it: Pad(0) -> BN (the BN turns
    the zero border into its bias), or a 1 x 1 -> Add(v) -> Pad(v); a Pad whose value is not the branch's value at
    a zero input (a biased 1 x 1 padded with zeros) is refused and kept apart, the rest merged."""
    block = Block(seed=18)
    dbb = block.bn(block.conv(block.bn(block.pad(block.conv("r", (1, 1), c_out=6, bias=False, pads=(0,) * 4),
                                                 (1, 1, 1, 1), opset=opset)), (3, 3), pads=(0,) * 4))  # fmt: skip
    shifted = block.op("Add", [block.conv("r", (1, 1), c_out=6, bias=False, pads=(0,) * 4),
                               block.constant(np.array(0.75), "v")])  # fmt: skip
    valued = block.conv(block.pad(shifted, (1, 1, 1, 1), 0.75, opset=opset), (3, 3), pads=(0,) * 4)
    model = block.model(block.add_all([block.bn(block.conv("r", (3, 3))), dbb, valued]), opset=opset)
    optimized, report = optimize_and_compare(block, model)
    assert ops(optimized) == ["Relu", "Conv"]
    (merge,) = report.merges
    assert merge.status == "merged" and merge.kernel == [3, 3] and sum("Pad" in b for b in merge.branches) == 2
    assert report.count("folded") == 3 and report.merged_batchnorms == 3

    block = Block(seed=19)
    biased = block.conv(block.pad(block.conv("r", (1, 1), c_out=6, pads=(0,) * 4), (1, 1, 1, 1)), (3, 3),
                        pads=(0,) * 4)  # fmt: skip
    model = block.model(block.add_all([block.bn(block.conv("r", (3, 3))), biased, block.bn("r")]))
    optimized, report = optimize_and_compare(block, model)
    (merge,) = report.merges
    assert merge.status == "merged" and len(merge.branches) == 2
    assert "the border is not the branch's value" in (merge.reason or "")
    assert sorted(ops(optimized)) == ["Add", "Conv", "Conv", "Conv", "Pad", "Relu"]


def test_repvit_mixer_then_bn_folds_into_the_merged_conv() -> None:
    block = Block(channels=5, seed=6)
    y = block.bn(block.add_all([block.conv("r", (3, 3), groups=5), block.conv("r", (1, 1), groups=5), "r"]))
    optimized, report = optimize_and_compare(block, block.model(y))
    assert ops(optimized) == ["Relu", "Conv"]
    (record,) = report.batchnorms
    assert record.status == "folded" and record.direction == "backward" and record.into == report.merges[0].into


def test_refusals_and_partial_merges_say_why() -> None:
    block = Block(seed=7)
    one = block.conv("r", (1, 1), pads=(0,) * 4)
    block.outputs.append(one)  # a branch read elsewhere: kept apart, the rest merged
    y = block.add_all([block.conv("r", (3, 3)), one, block.bn("r")])
    optimized, report = optimize_and_compare(block, block.model(y))
    (merge,) = report.merges
    assert merge.status == "merged" and len(merge.branches) == 2 and "graph output" in merge.reason
    assert ops(optimized).count("Conv") == 2 and ops(optimized).count("Add") == 1

    block = Block(seed=8)
    one = block.conv("r", (1, 1), pads=(0,) * 4)
    block.outputs.append(one)
    y = block.add_all([block.conv("r", (3, 3)), one])
    _, report = optimize_and_compare(block, block.model(y))
    (merge,) = report.merges
    assert merge.status == "skipped" and "read elsewhere" in merge.reason and "graph output" in merge.reason

    block = Block(seed=15)  # a non-linear term of the same input stays, and the report says why
    y = block.add_all([block.conv("r", (3, 3)), block.conv("r", (1, 1), pads=(0,) * 4), block.op("Sigmoid", ["r"])])
    optimized, report = optimize_and_compare(block, block.model(y))
    assert report.merges[0].status == "merged" and "goes through Sigmoid" in report.merges[0].reason
    assert sorted(ops(optimized)) == ["Add", "Conv", "Relu", "Sigmoid"]

    block = Block(seed=9)  # a dense 1x1 beside a depthwise 3x3: one dense 3x3 would cost more
    y = block.add_all([block.conv("r", (1, 1), pads=(0,) * 4), block.conv("r", (3, 3), groups=4)])
    optimized, report = optimize_and_compare(block, block.model(y))
    assert report.merges[0].status == "skipped" and "would cost" in report.merges[0].reason
    assert ops(optimized).count("Conv") == 2

    block = Block(seed=10)  # dilation 2: taps on even and odd offsets do not share one window
    y = block.add_all([block.conv("r", (3, 3), dilation=2), block.conv("r", (2, 2), dilation=2, pads=(1,) * 4)])
    _, report = optimize_and_compare(block, block.model(y))
    assert report.merges[0].status == "skipped" and "padding does not line up" in report.merges[0].reason
    assert "not merged" in report.format_text(verbose=True)


def test_a_residual_add_of_different_inputs_is_not_a_candidate() -> None:
    block = Block(seed=11)
    inner = block.op("Relu", [block.bn(block.conv("r", (3, 3)))])
    y = block.add_all([block.bn(block.conv(inner, (3, 3))), "r"])
    optimized, report = optimize_and_compare(block, block.model(y))
    assert not report.merges and ops(optimized).count("Conv") == 2 and ops(optimized).count("Add") == 1


def test_a_wrong_merge_is_caught_by_the_check() -> None:
    block = Block(seed=12)
    model = block.model(block.add_all([block.conv("r", (3, 3)), block.conv("r", (1, 1), pads=(0,) * 4), "r"]))
    optimized, report = bnfuse.optimize(model)
    weight = next(t for t in optimized.graph.initializer if t.name in report.written_weights and len(t.dims) == 4)
    values = numpy_helper.to_array(weight).copy()
    values[0, 0, 1, 1] *= 1.01
    weight.CopyFrom(numpy_helper.from_array(values, weight.name))
    with pytest.raises(bnfuse.errors.CheckFailedError, match="merge of the branches of"):
        prove(model, optimized, report, input_shapes=None, seed=0, tolerance=None)

    block = Block(seed=17)  # with a BN in a branch, that BN's record is the first to fail, named as merged
    model = block.model(block.add_all([block.bn(block.conv("r", (3, 3))), block.conv("r", (1, 1), pads=(0,) * 4)]))
    optimized, report = bnfuse.optimize(model)
    weight = next(t for t in optimized.graph.initializer if t.name in report.written_weights and len(t.dims) == 4)
    values = numpy_helper.to_array(weight).copy()
    values[0, 0, 1, 1] *= 1.01
    weight.CopyFrom(numpy_helper.from_array(values, weight.name))
    with pytest.raises(bnfuse.errors.CheckFailedError, match=r"\(one branch of a merge\) fails"):
        prove(model, optimized, report, input_shapes=None, seed=0, tolerance=None)


def test_fastvit_repmixer_layer_scale_over_a_difference_of_sums() -> None:
    """x + layer_scale * (mixer(x) - norm(x)): a Sub negates, a Mul by a per-channel constant scales, whole sums."""
    block = Block(channels=4, seed=13)
    kxk, scale = block.conv("r", (3, 3), groups=4, bias=False), block.conv("r", (1, 1), groups=4, pads=(0,) * 4)
    mixer = block.add_all([block.bn(kxk), block.bn(scale), block.bn("r")])
    scaled = block.op(
        "Mul", [block.op("Sub", [mixer, block.bn("r")]), block.constant(block.rng.normal(size=(4, 1, 1)), "g")]
    )
    optimized, report = optimize_and_compare(block, block.model(block.add_all(["r", scaled])))
    assert ops(optimized) == ["Relu", "Conv"] and report.merges[0].groups == 4 and len(report.merges[0].branches) == 5

    block = Block(channels=4, seed=14)  # the subtracted term is read elsewhere: kept, times -1, beside the merge
    other = block.bn("r")
    block.outputs.append(other)
    y = block.op("Sub", [block.add_all([block.conv("r", (3, 3)), block.conv("r", (1, 1), pads=(0,) * 4)]), other])
    optimized, report = optimize_and_compare(block, block.model(y))
    assert sorted(ops(optimized)) == ["Add", "BatchNormalization", "Conv", "Mul", "Relu"]
    assert report.merges[0].status == "merged" and "graph output" in report.merges[0].reason


def test_a_block_inside_an_if_branch_reading_the_outer_graph_merges() -> None:
    block = Block(seed=16)
    y = block.add_all([block.bn(block.conv("r", (3, 3))), block.conv("r", (1, 1), pads=(0,) * 4), block.bn("r")])
    inner = [n for n in block.nodes if n.name != "relu"]
    elem, shape = block.elem, [1, 4, 6, 6]
    then_branch = helper.make_graph(inner, "then", [], [helper.make_tensor_value_info(y, elem, shape)], block.inits)
    else_branch = helper.make_graph([helper.make_node("Identity", ["r"], ["same"])], "else", [],
                                    [helper.make_tensor_value_info("same", elem, shape)])  # fmt: skip
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_branch, else_branch=else_branch),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, shape)],
                              [helper.make_tensor_value_info("y", elem, shape)],
                              [numpy_helper.from_array(np.zeros((), np.float32), "zero")])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    optimized, report = bnfuse.optimize(model, check=True)
    (merge,) = report.merges
    assert merge.status == "merged" and merge.graph == "main/if.then_branch" and report.check.passed
    body = next(a.g for a in optimized.graph.node[-1].attribute if a.name == "then_branch")
    assert [n.op_type for n in body.node] == ["Conv"]
    x = np.abs(block.rng.normal(size=shape)).astype(np.float32)  # a positive sum: the then branch runs
    np.testing.assert_allclose(run(optimized, x)[0], run(model, x)[0], rtol=1e-5, atol=1e-5)
