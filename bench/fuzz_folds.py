"""Differential fuzzing of the folds: random valid graphs, each optimized and compared in onnxruntime.

    python bench/fuzz_folds.py [--count 1000] [--seed 1] [--start 0] [--dtypes float32,float64,float16]
                               [--json result.json] [--save DIR] [--case N]

Each case (``--seed``, index) is a recipe of steps drawn from Conv / ConvTranspose / Gemm / MatMul (+ bias Add)
/ BatchNormalization / Relu / Mul-Add-Sub-Div by a constant (per channel, scalar, or broadcasting along other
axes) / Transpose (identity, pairs, lone) / Concat (of producers, or sharing a tensor) / residual Add / Flatten /
Reshape / Dropout / Identity, float32, float64 (matrix ops only: onnxruntime's CPU has no float64 Conv) or
float16. Weights come from initializers, Constant nodes or graph inputs; some tensors are graph outputs or read
twice. BN statistics are calibrated on the data (one onnxruntime run of the graph with identity BNs), drawn at
random, or an amplifier pair (factor up to 500, shift up to 3e4, then a BN that scales it back down: the pattern
where float16 folds overflow).

A third of the 4-D float32 / float16 recipes also get a re-parameterizable block (RepVGG / MobileOne / ACNet /
DBB-style branches summed, random channels, groups and stride: ``_rep_block``) for the branch merges, and a third
of all recipes one of issue 35's other shapes: pre-activation blocks (BN -> Relu / LeakyRelu / PRelu -> [pool] ->
Conv / Gemm / MatMul), pools, LeViT's tokens (MatMul on [1, m, k] -> Flatten / Reshape -> BN), a Conv with an int8
weight through a per-channel DequantizeLinear then a BN; 15% of the 4-D ones tf2onnx's NHWC wrapping (Transposes
around activations, and around a Concat before a BN: ``_nhwc``); each drawn from a stream of its own
(``draw_recipe(..., blocks=False)`` replays the recipes of the runs before them).

A share of the Concat steps become "concat+part" (``CONCAT_PART_SHARE``: a BN on one block of the channel Concat,
Split / Slice -> BN -> Concat again, ``_concat_part``) and of the blocks "repblock+dbb" (``DBB_SHARE``: DBB's 1 x 1
-> Pad -> k x k branch added), chosen from a stream of their own; the step's other draws are unchanged.

Per case: ``bnfuse.optimize`` (in process), then ``--check``'s proof (``prove``), then both models in
onnxruntime (all graph optimizations off) on seeded inputs, and onnxruntime's own optimizer on the original
(ORT_ENABLE_EXTENDED, its BN fusions; ALL adds layout changes that turn a lone BN into an NCHWc convolution):
its BN left and its outputs. Outputs are compared relative to their largest magnitude: float32 1e-4,
float64 1e-9. A mismatch is rounding where it stays within 4x what one rounding of the folded values moves the
optimized model by (TWINS twins with each new value moved by -1, 0 or +1 ulp: a Div by a value near zero after
a BN amplifies any rounding), or where the same graph widened to float64 folds with the same decisions, exactly
(<= 1e-9), into the float32 weights rounded once (within 1 ulp); else the fold is wrong. float16 outputs
are judged by ``--check``'s own rule, the same code (bnfuse.passes.check.tolerances: ``precision_references``,
``tensor_error``) on the fuzzer's draw: against the original widened to float32, within 2x (the original's own
error + what moving the folded values by an ulp moves the optimized model: three random twins and two moving
the biases alone) + 2^-9, values float16 does not determine left out; beyond it the fold is wrong, whatever the
check said on its own draw (the detail says whether the float16 weights are the exact float64 fold rounded
once). Outcomes (``DEFECTS`` must never occur):

- ``ok``: proof passed, outputs equal; ``no BN folded``: nothing to prove; ``original overflows``: the
  float16 original gives inf where its float32 twin does not (in an output, or, for a mismatch, inside), so no
  comparison means anything;
- ``rounding, check passed`` / ``rounding, check refused``: float32 / float64 outputs differ by rounding only;
- ``wrong output`` (proof passed: a missed failure), ``wrong output, check refused``, ``false alarm`` (proof
  failed, outputs equal), ``crash`` (an exception other than a one-line refusal), ``refused`` (a valid graph
  refused), ``optimized does not run``.

A defect is minimized: steps are dropped one at a time while the same defect remains, and the smallest recipe
is printed (and, with ``--save``, written as ONNX). tests/test_fuzz_folds.py runs a seeded sample;
bench/RESULTS.md has the long run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"float32": TensorProto.FLOAT, "float64": TensorProto.DOUBLE, "float16": TensorProto.FLOAT16}
DEFECTS = (
    "wrong output",
    "wrong output, check refused",
    "false alarm",
    "crash",
    "refused",
    "optimized does not run",
)
TOLERANCE = {TensorProto.FLOAT: 1e-4, TensorProto.DOUBLE: 1e-9}
BEYOND_OWN = "beyond the original's own float16 error"  # a float16 detail: passed on the twins' allowance
TWINS = 3  # re-rounded twins: the allowance takes the largest of their errors
ROUNDING_FACTOR = 4.0  # float32 / float64: a mismatch within 4x the twins' largest move is rounding
BATCH = 2
OPS_4D = ("conv", "conv", "convT", "bn", "bn", "bnpair", "relu", "affine", "affine", "transpose", "concat",
          "residual", "flatten", "dropout", "identity", "output")  # fmt: skip
OPS_2D = ("gemm", "gemm", "matmul", "matmul", "bn", "bn", "bnpair", "relu", "affine", "affine", "transpose",
          "concat", "dropout", "identity", "output")  # fmt: skip
# issue 35's shapes, inserted (one per recipe, in EXTRA_SHARE of them) from a stream of their own: every other
# recipe is drawn exactly as before they existed
EXTRA_4D = ("preact", "preact", "pool", "qdq")
EXTRA_2D = ("tokens", "tokens", "preact")
EXTRA_SHARE = 0.35
# tf2onnx's NHWC wrapping (``_nhwc``), inserted in NHWC_SHARE of the 4-D recipes from a third stream of its own
NHWC_SHARE = 0.15


# --- recipes and graphs ----------------------------------------------------------------------------


@dataclass
class Recipe:
    """A case: global choices and the steps, each with its own seed (so dropping one keeps the others)."""

    dtype: str
    opset: int
    start: str  # "4d" or "2d"
    channels: int
    side: int
    steps: list[tuple[str, int]]

    def describe(self) -> str:
        steps = " -> ".join(op for op, _ in self.steps)
        return f"{self.dtype} opset {self.opset} {self.start} C={self.channels} side={self.side}: {steps}"


def draw_recipe(seed: int, index: int, dtypes: tuple[str, ...], *, blocks: bool = True) -> Recipe:
    """The case (seed, index). ``blocks``: a share of the 4-D recipes get a re-parameterizable block
    (``_rep_block``), and a share of all recipes one of issue 35's other shapes (``EXTRA_4D`` / ``EXTRA_2D``), each
    drawn from a stream of its own so the other steps are those of the runs before them (False: exactly the recipe
    those runs drew)."""
    rng = np.random.default_rng([seed, index])
    dtype = str(rng.choice(dtypes))
    start = "2d" if dtype == "float64" or rng.random() < 0.3 else "4d"
    ops = OPS_2D if start == "2d" else OPS_4D
    first = "gemm" if start == "2d" and rng.random() < 0.5 else "matmul" if start == "2d" else "conv"
    steps = [first] + [str(rng.choice(ops)) for _ in range(int(rng.integers(1, 7)))]
    if not any(s.startswith("bn") for s in steps):
        steps.insert(int(rng.integers(1, len(steps) + 1)), "bn")
    if dtype == "float64":  # onnxruntime's CPU has no float64 Conv: stay 2-D
        steps = [s for s in steps if s not in ("conv", "convT", "residual", "flatten")] or ["bn"]
    seeds = rng.integers(0, 2**31, len(steps))
    recipe = Recipe(
        dtype,
        int(rng.choice([13, 15, 17])),
        start,
        int(rng.integers(1, 9)),
        int(rng.integers(3, 7)),
        [(s, int(k)) for s, k in zip(steps, seeds, strict=True)],
    )
    if not blocks:
        return recipe
    # the two insertions draw from streams of their own: each leaves the other's recipes as they were drawn
    extra = np.random.default_rng([seed, index, 35])
    if start == "4d" and dtype != "float64" and extra.random() < BLOCK_SHARE:
        recipe.steps.insert(int(extra.integers(0, len(steps) + 1)), ("repblock", int(extra.integers(0, 2**31))))
    shapes = np.random.default_rng([seed, index, 36])
    if shapes.random() < EXTRA_SHARE:
        step = str(shapes.choice(EXTRA_2D if start == "2d" else EXTRA_4D))
        recipe.steps.insert(int(shapes.integers(1, len(recipe.steps) + 1)), (step, int(shapes.integers(0, 2**31))))
    # session 33's variants of a step (a DBB branch in the block, a BN on part of a Concat): the same step, its own
    # draws unchanged, with an addition drawn from a stream of its own
    variants = np.random.default_rng([seed, index, 37])
    for position, (op, step_seed) in enumerate(recipe.steps):
        share = {"repblock": DBB_SHARE, "concat": CONCAT_PART_SHARE}.get(op)
        if share is not None and variants.random() < share:
            recipe.steps[position] = (f"{op}+{'dbb' if op == 'repblock' else 'part'}", step_seed)
    nhwc = np.random.default_rng([seed, index, 38])
    if start == "4d" and dtype != "float64" and nhwc.random() < NHWC_SHARE:
        recipe.steps.insert(int(nhwc.integers(1, len(recipe.steps) + 1)), ("nhwc", int(nhwc.integers(0, 2**31))))
    return recipe


@dataclass
class _State:
    """The graph being built: nodes, constants, inputs, outputs, the current tensor and its shape."""

    dtype: np.dtype
    elem: int
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    weight_feeds: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)
    batchnorms: list = field(default_factory=list)  # (node index, mode, names of its 4 params)
    counter: int = 0
    cur: str = "x"
    shape: list = field(default_factory=list)

    def name(self, base: str) -> str:
        self.counter += 1
        return f"{base}{self.counter}"

    def constant(self, rng: np.random.Generator, values: np.ndarray, base: str, *, source: str | None = None) -> str:
        """A constant from an initializer, a Constant node or a graph input (not foldable: fed the same values)."""
        name = self.name(base)
        values = np.asarray(values).astype(self.dtype)
        source = source or str(rng.choice(["init"] * 8 + ["constant", "input"]))
        if source == "init":
            self.inits.append(numpy_helper.from_array(values, name))
        elif source == "constant":
            self.nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(values, name)))
        else:
            self.inputs.append(helper.make_tensor_value_info(name, self.elem, list(values.shape)))
            self.weight_feeds[name] = values
        return name

    def node(self, op: str, inputs: list[str], shape: list[int], **attrs: object) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        self.cur, self.shape = out, list(shape)
        return out


def _weights(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    return rng.normal(0, 1 / np.sqrt(max(fan_in, 1)), shape)


def build(recipe: Recipe) -> tuple[onnx.ModelProto, _State]:
    """The recipe's graph, with identity placeholders for BN statistics (``calibrate`` sets them)."""
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(DTYPES[recipe.dtype]))
    s = _State(dtype, DTYPES[recipe.dtype])
    s.shape = [BATCH, recipe.channels, recipe.side, recipe.side] if recipe.start == "4d" else [BATCH, recipe.channels]
    s.inputs.append(helper.make_tensor_value_info("x", s.elem, list(s.shape)))
    for op, seed in recipe.steps:
        _STEPS[op](s, np.random.default_rng(seed), recipe)
    s.outputs.append((s.cur, s.shape))
    outputs = [helper.make_tensor_value_info(o, s.elem, shape) for o, shape in dict(s.outputs).items()]
    graph = helper.make_graph(s.nodes, "fuzz", s.inputs, outputs, s.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", recipe.opset)])
    model.ir_version = 8
    return model, s


def _conv(s: _State, rng: np.random.Generator, recipe: Recipe, *, k: int | None = None, co: int | None = None) -> None:
    if len(s.shape) != 4:
        return
    n, c, h, w = s.shape
    co = co or int(rng.integers(1, 9))
    k = k or int(rng.choice([1, 3]))
    pad = int(rng.choice([0, 1])) if k == 3 else 0
    stride = int(rng.choice([1, 2])) if min(h, w) >= 4 and rng.random() < 0.3 else 1
    if h + 2 * pad < k or w + 2 * pad < k:
        return
    group = 1
    if co == c and c > 1 and rng.random() < 0.3:
        group = c
    elif c % 2 == 0 and co % 2 == 0 and rng.random() < 0.2:
        group = 2
    weight = s.constant(rng, _weights(rng, (co, c // group, k, k), c // group * k * k), "w")
    inputs = [s.cur, weight]
    if rng.random() < 0.5:
        inputs.append(s.constant(rng, rng.normal(0, 0.5, co), "b"))
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    s.node("Conv", inputs, [n, co, oh, ow], pads=[pad] * 4, strides=[stride] * 2, group=group, kernel_shape=[k, k])


def _conv_transpose(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    if len(s.shape) != 4 or max(s.shape[2:]) > 8:
        return
    n, c, h, w = s.shape
    group = 2 if c % 2 == 0 and rng.random() < 0.3 else 1
    per_out = int(rng.integers(1, 5))
    k, stride = int(rng.choice([1, 2, 3])), int(rng.choice([1, 2]))
    weight = s.constant(rng, _weights(rng, (c, per_out, k, k), c // group * k * k), "wt")
    inputs = [s.cur, weight]
    if rng.random() < 0.5:
        inputs.append(s.constant(rng, rng.normal(0, 0.5, per_out * group), "b"))
    oh, ow = (h - 1) * stride + k, (w - 1) * stride + k
    s.node("ConvTranspose", inputs, [n, per_out * group, oh, ow], strides=[stride] * 2, group=group)


def _gemm(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    if len(s.shape) != 2:
        return
    m, k = s.shape
    n = int(rng.integers(1, 9))
    trans_b = int(rng.random() < 0.5)
    b = _weights(rng, (k, n), k)
    inputs = [s.cur, s.constant(rng, b.T if trans_b else b, "B")]
    attrs: dict[str, object] = {"transB": trans_b}
    if rng.random() < 0.3:
        attrs["alpha"] = float(rng.uniform(0.5, 2))
    c_kind = str(rng.choice(["none", "n", "1n", "mn"]))
    if c_kind != "none":
        shape = {"n": (n,), "1n": (1, n), "mn": (m, n)}[c_kind]
        inputs.append(s.constant(rng, rng.normal(0, 0.5, shape), "C"))
        if rng.random() < 0.3:
            attrs["beta"] = float(rng.uniform(0.5, 2))
    s.node("Gemm", inputs, [m, n], **attrs)


def _matmul(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    if len(s.shape) != 2:
        return
    m, k = s.shape
    n = int(rng.integers(1, 9))
    s.node("MatMul", [s.cur, s.constant(rng, _weights(rng, (k, n), k), "W")], [m, n])
    if rng.random() < 0.5:
        shape = (n,) if rng.random() < 0.6 else (1, n)
        bias = s.constant(rng, rng.normal(0, 0.5, shape), "bias")
        s.node("Add", [bias, s.cur] if rng.random() < 0.3 else [s.cur, bias], [m, n])


def _bn(s: _State, rng: np.random.Generator, recipe: Recipe, *, mode: str | None = None) -> None:
    if len(s.shape) < 2:
        return
    c = s.shape[1]
    mode = mode or str(rng.choice(["calibrated"] * 7 + ["random"] * 3))
    params = [s.constant(rng, np.zeros(c), f"bn{p}_", source="init") for p in ("scale", "bias", "mean", "var")]
    attrs = {} if rng.random() < 0.5 else {"epsilon": float(rng.choice([1e-5, 1e-3, 1e-6]))}
    s.batchnorms.append((len(s.nodes), mode, params, float(rng.random()), int(rng.integers(0, 2**31))))
    s.node("BatchNormalization", [s.cur, *params], s.shape, **attrs)
    if rng.random() < 0.1:
        s.outputs.append((s.cur, s.shape))  # a graph-output BN


def _bn_pair(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    _bn(s, rng, recipe, mode="amplify")
    _bn(s, rng, recipe, mode="normalize")


def _relu(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    s.node("Relu", [s.cur], s.shape)


def _preact(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    """A pre-activation block (issue 35): [residual Add or Relu: nothing to fold back into] -> BN -> Relu / LeakyRelu
    / PRelu -> [pool] -> Conv (maybe padded) / Gemm / MatMul."""
    if rng.random() < 0.6:
        if len(s.shape) == 4 and rng.random() < 0.5:
            _residual(s, rng, recipe)
        else:
            _relu(s, rng, recipe)
    _bn(s, rng, recipe, mode="positive" if rng.random() < 0.7 else None)
    kinds = ["Relu", "LeakyRelu", "PRelu"] if s.dtype != np.float64 else ["Relu"]  # onnxruntime: no float64 others
    kind = str(rng.choice(kinds))
    if kind == "PRelu":
        slope_shape = (s.shape[1],) + (1,) * (len(s.shape) - 2)
        s.node("PRelu", [s.cur, s.constant(rng, rng.uniform(-0.3, 0.3, slope_shape), "slope")], s.shape)
    else:
        s.node(kind, [s.cur], s.shape, **({"alpha": float(rng.uniform(0.01, 0.3))} if kind == "LeakyRelu" else {}))
    if len(s.shape) == 4 and rng.random() < 0.3:
        _pool(s, rng, recipe)
    if len(s.shape) == 4:
        _conv(s, rng, recipe, k=3)
    else:
        (_gemm if rng.random() < 0.5 else _matmul)(s, rng, recipe)


def _nhwc(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    """tf2onnx with its optimizers off (Keras's NHWC): each NCHW op wrapped in Transposes, activations and Concats
    between them in NHWC. [BN] -> Transpose -> 1-2 activations -> Transpose -> Conv, or two Convs -> Transposes ->
    Concat (last axis) -> Transpose -> BN, or -> Mul -> Add along the last axis (Keras 3's BN)."""
    if len(s.shape) != 4:
        return
    to_nhwc, to_nchw = [0, 2, 3, 1], [0, 3, 1, 2]
    if rng.random() < 0.5:
        if rng.random() < 0.7:
            _bn(s, rng, recipe, mode="positive" if rng.random() < 0.7 else None)
        nchw = list(s.shape)
        s.node("Transpose", [s.cur], [nchw[p] for p in to_nhwc], perm=to_nhwc)
        kinds = ["Relu", "LeakyRelu"] + (["Clip", "Sigmoid"] if s.dtype == np.float32 else [])
        for _ in range(int(rng.integers(1, 3))):
            kind = str(rng.choice(kinds))
            if kind == "Clip":  # ReLU6; a bound fed as a graph input now and then (no longer a constant)
                bounds = [s.constant(rng, np.array(0.0), "lo"), s.constant(rng, np.array(6.0), "hi")]
                s.node("Clip", [s.cur, *bounds], s.shape)
            else:
                s.node(kind, [s.cur], s.shape, **({"alpha": 0.1} if kind == "LeakyRelu" else {}))
        s.node("Transpose", [s.cur], nchw, perm=to_nchw)
        _conv(s, rng, recipe, k=3)
        return
    source, shape = s.cur, list(s.shape)
    branches = []
    for _ in range(2):
        s.cur, s.shape = source, list(shape)
        _conv(s, rng, recipe, k=1)
        s.node("Transpose", [s.cur], [s.shape[p] for p in to_nhwc], perm=to_nhwc)
        branches.append((s.cur, list(s.shape)))
    if branches[0][1][:3] != branches[1][1][:3]:  # strides differ: no Concat
        s.cur, s.shape = source, shape
        return
    joined = branches[0][1][:3] + [branches[0][1][3] + branches[1][1][3]]
    s.node("Concat", [b[0] for b in branches], joined, axis=3 if rng.random() < 0.5 else -1)
    if rng.random() < 0.3:  # Keras 3's BN, in NHWC: a Mul and an Add along the last axis
        channels = joined[3]
        scale = rng.uniform(0.5, 2, channels) * rng.choice([-1, 1], channels)
        s.node("Mul", [s.cur, s.constant(rng, scale, "k")], joined)
        s.node("Add", [s.cur, s.constant(rng, rng.normal(0, 1, (1, 1, 1, channels)), "k")], joined)
        return
    s.node("Transpose", [s.cur], [joined[p] for p in to_nchw], perm=to_nchw)
    _bn(s, rng, recipe)


def _pool(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    if len(s.shape) != 4:
        return
    kind = str(rng.choice(["MaxPool", "AveragePool", "GlobalAveragePool"]))
    if kind == "GlobalAveragePool":
        s.node(kind, [s.cur], s.shape[:2] + [1, 1])
        return
    include = {"count_include_pad": int(rng.integers(0, 2))} if kind == "AveragePool" else {}
    s.node(kind, [s.cur], s.shape, kernel_shape=[3, 3], pads=[1, 1, 1, 1], **include)


def _tokens(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    """LeViT's BatchNorm1d on tokens: [m, k] -> [1, m, k] @ W [+ bias] -> Flatten / Reshape to [m, n] -> BN."""
    if len(s.shape) != 2:
        return
    m, k = s.shape
    n = int(rng.integers(1, 9))
    shape_name = s.name("tokens")
    s.inits.append(numpy_helper.from_array(np.array([1, m, k], np.int64), shape_name))
    s.node("Reshape", [s.cur, shape_name], [1, m, k])
    s.node("MatMul", [s.cur, s.constant(rng, _weights(rng, (k, n), k), "W")], [1, m, n])
    if rng.random() < 0.4:
        s.node("Add", [s.cur, s.constant(rng, rng.normal(0, 0.5, (n,)), "bias")], [1, m, n])
    if rng.random() < 0.5:
        s.node("Flatten", [s.cur], [m, n], axis=2)
    else:
        flat = s.name("flat")
        s.inits.append(numpy_helper.from_array(np.array([-1, n], np.int64), flat))
        s.node("Reshape", [s.cur, flat], [m, n])
    _bn(s, rng, recipe)


def _qdq(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    """A Conv whose weight is int8 through a per-output-channel DequantizeLinear, then a BN (issue 35)."""
    if len(s.shape) != 4 or s.dtype != np.float32:  # float16 DequantizeLinear outputs need opset 19
        return
    n, c, h, w = s.shape
    co = int(rng.integers(1, 9))
    pad = int(rng.integers(0, 2))
    if h + 2 * pad < 3 or w + 2 * pad < 3:
        return
    scale = rng.uniform(0.002, 0.02, co).astype(np.float32)
    quantized = np.clip(np.round(_weights(rng, (co, c, 3, 3), c * 9) / scale.reshape(-1, 1, 1, 1)), -127, 127)
    names = [s.name("wq"), s.name("ws"), s.name("wz")]
    values = [quantized.astype(np.int8), scale, np.zeros(co, np.int8)]
    s.inits += [numpy_helper.from_array(v, name) for v, name in zip(values, names, strict=True)]
    weight = s.name("wdq")
    s.nodes.append(helper.make_node("DequantizeLinear", names, [weight], name=weight, axis=0))
    inputs = [s.cur, weight] + ([s.constant(rng, rng.normal(0, 0.5, co), "b")] if rng.random() < 0.5 else [])
    s.node("Conv", inputs, [n, co, h + 2 * pad - 2, w + 2 * pad - 2], pads=[pad] * 4)
    _bn(s, rng, recipe)


def _affine(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    op = str(rng.choice(["Mul", "Add", "Sub", "Div"]))
    rank, c = len(s.shape), s.shape[1]
    kinds = ["channel", "channel", "channel", "scalar", "one", "other"]
    kind = str(rng.choice(kinds))
    if kind == "channel":
        shape = (c,) + (1,) * (rank - 2) if rng.random() < 0.6 else (1, c) + (1,) * (rank - 2)
    elif kind == "scalar":
        shape = ()
    elif kind == "one":
        shape = (1,)
    else:  # broadcasting along another axis: not per channel
        shape = (s.shape[-1],) if rank == 2 or rng.random() < 0.5 else tuple(s.shape[2:])
        if rank == 2 and rng.random() < 0.5:
            shape = (s.shape[0], 1)
    if op in ("Mul", "Div"):
        values = rng.uniform(0.5, 2, shape) * rng.choice([-1, 1], shape)
    else:
        values = rng.normal(0, 1, shape)
    constant = s.constant(rng, values, "k")
    first = rng.random() < 0.2
    s.node(op, [constant, s.cur] if first else [s.cur, constant], s.shape)


def _transpose(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    rank = len(s.shape)
    kind = rng.random()
    perm = list(range(rank)) if kind < 0.3 else [int(p) for p in rng.permutation(rank)]
    s.node("Transpose", [s.cur], [s.shape[p] for p in perm], perm=perm)
    if kind > 0.6:  # a pair composing to the identity
        inverse = [int(i) for i in np.argsort(perm)]
        s.node("Transpose", [s.cur], [s.shape[p] for p in inverse], perm=inverse)


def _concat(s: _State, rng: np.random.Generator, recipe: Recipe, *, part: bool = False) -> None:
    source, shape = s.cur, list(s.shape)
    branches = []
    for _ in range(2):
        s.cur, s.shape = source, list(shape)
        if len(shape) == 4 and rng.random() < 0.8:
            _conv(s, rng, recipe, k=1)
        elif len(shape) == 2 and rng.random() < 0.8:
            (_gemm if rng.random() < 0.5 else _matmul)(s, rng, recipe)
        branches.append((s.cur, list(s.shape)))
    axis = 1 if rng.random() < 0.8 else len(shape) - 1
    others = [[d for i, d in enumerate(b[1]) if i != axis] for b in branches]
    if others[0] != others[1]:
        s.cur, s.shape = branches[0]
        return
    out = list(branches[0][1])
    out[axis] = branches[0][1][axis] + branches[1][1][axis]
    s.node("Concat", [b[0] for b in branches], out, axis=axis)
    if part and axis == 1:  # drawn from a stream of its own: the rest of the step is as a plain "concat" draws it
        _concat_part(s, np.random.default_rng([rng.bit_generator.seed_seq.entropy, 36]), recipe,
                     [b[1][1] for b in branches])  # fmt: skip


def _concat_part(s: _State, rng: np.random.Generator, recipe: Recipe, sizes: list[int]) -> None:
    """A BN on part of the Concat just made: Split / Slice -> BN on one block, the other passed on, concatenated
    again. The block is one input (folds into its producer) or cuts an input, or a Sigmoid also reads the whole
    Concat (both stay)."""
    joined, shape, channels = s.cur, list(s.shape), sum(sizes)
    first = bool(rng.random() < 0.5)
    covered = sizes[0] if first else sizes[1]
    if rng.random() < 0.15 and covered > 1:
        covered -= 1  # the block cuts an input: refused
    cut = covered if first else channels - covered
    if rng.random() < 0.1:
        s.outputs.append((s.node("Sigmoid", [joined], shape), shape))  # another reader of every channel
    blocks = [list(shape), list(shape)]
    blocks[0][1], blocks[1][1] = cut, channels - cut
    if rng.random() < 0.5:
        sizes_name = s.name("sizes")
        s.inits.append(numpy_helper.from_array(np.array([cut, channels - cut], np.int64), sizes_name))
        outs = [s.name("part"), s.name("part")]
        s.nodes.append(helper.make_node("Split", [joined, sizes_name], outs, name=s.name("split"), axis=1))
    else:
        outs = []
        for begin, end in ((0, cut), (cut - channels, 2**63 - 1)):  # the second from the end, as exporters write
            names = [s.name(p) for p in ("starts", "ends", "axes")]
            for name, value in zip(names, (begin, end, 1), strict=True):
                s.inits.append(numpy_helper.from_array(np.array([value], np.int64), name))
            outs.append(s.node("Slice", [joined, *names], shape))
    s.cur, s.shape = outs[0 if first else 1], blocks[0 if first else 1]
    _bn(s, rng, recipe)
    parts = [s.cur, outs[1]] if first else [outs[0], s.cur]
    s.node("Concat", parts, shape, axis=1)


def _residual(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    if len(s.shape) != 4:
        return
    source, shape = s.cur, list(s.shape)
    _conv(s, rng, recipe, k=1, co=shape[1])
    if s.shape != shape:
        return
    s.node("Add", [source, s.cur], shape)


BLOCK_SHARE = 0.35  # of the 4-D float32 / float16 recipes: one re-parameterizable block inserted (see draw_recipe)
REP_BRANCHES = ("kxk", "kxk", "1x1", "1xk", "kx1", "bn", "id", "scale", "pool", "seq", "shifted")
CONCAT_PART_SHARE = 0.3  # of the Concat steps: a BN on one block of the Concat ("concat+part", _concat_part)
DBB_SHARE = 0.3  # of the blocks: one more branch where it has a window, 1 x 1 -> Pad -> k x k ("repblock+dbb")


def _rep_block(s: _State, rng: np.random.Generator, recipe: Recipe, *, dbb: bool = False) -> None:
    """A re-parameterizable block (RepVGG / MobileOne / ACNet / DBB): 2-5 branches of the current tensor summed.

    k x k, 1 x 1, 1 x k and k x 1 Convs (each + BN or not, random groups, a common stride), the input through a
    BN, itself or a per-channel Mul, an AveragePool (count_include_pad 0 or 1), a 1 x 1 -> k x k pair (padded,
    biased or not: exact or refused), a k x k Conv padded off-centre; a branch is sometimes a graph output too; the
    sum sometimes in a RepMixer (x + layer_scale * (sum - BN(x))). ``dbb`` (the step "repblock+dbb") adds DBB's
    1 x 1 -> pad with the bias -> unpadded k x k branch, drawn from a stream of its own: Pad(0) -> BN, or Add(v) ->
    Pad(v), exact; a biased 1 x 1 padded with zeros or a Pad by another value, refused."""
    if len(s.shape) != 4:
        return
    n, c, h, w = s.shape
    source = s.cur
    k = int(rng.choice([3, 3, 5])) if min(h, w) >= 3 else 1
    stride = 2 if min(h, w) >= 4 and rng.random() < 0.25 else 1
    co = c if stride == 1 and rng.random() < 0.7 else int(rng.integers(1, 9))
    group = 1
    if co == c and c > 1 and rng.random() < 0.4:
        group = c
    elif c % 2 == 0 and co % 2 == 0 and rng.random() < 0.3:
        group = 2
    out = [n, co, (h - 1) // stride + 1, (w - 1) // stride + 1]
    kinds = [str(x) for x in rng.choice(REP_BRANCHES, int(rng.integers(2, 6)))]
    if stride != 1 or co != c:
        kinds = [x for x in kinds if x not in ("bn", "id", "scale", "pool")] or ["kxk", "1x1"]

    def conv(window: tuple[int, int], pads: list[int], c_in: int, c_out: int, strides: int, bias: bool,
             draw: np.random.Generator = rng) -> None:  # fmt: skip
        weight = s.constant(draw, _weights(draw, (c_out, c_in // group, *window),
                                           c_in // group * window[0] * window[1]), "w")  # fmt: skip
        inputs = [s.cur, weight] + ([s.constant(draw, draw.normal(0, 0.5, c_out), "b")] if bias else [])
        shape = [n, c_out, (s.shape[2] + pads[0] + pads[2] - window[0]) // strides + 1,
                 (s.shape[3] + pads[1] + pads[3] - window[1]) // strides + 1]  # fmt: skip
        s.node("Conv", inputs, shape, pads=pads, strides=[strides] * 2, group=group, kernel_shape=list(window))

    terms = []
    for kind in kinds:
        s.cur, s.shape = source, [n, c, h, w]
        half, bias = k // 2, bool(rng.random() < 0.4)
        if kind in ("kxk", "1x1", "1xk", "kx1", "shifted"):
            window = {"kxk": (k, k), "1x1": (1, 1), "1xk": (1, k), "kx1": (k, 1), "shifted": (k, k)}[kind]
            pads = [window[0] // 2, window[1] // 2] * 2
            if kind == "shifted" and k > 1:
                pads = [half + 1, half + 1, half - 1, half - 1]
            conv(window, pads, c, co, stride, bias)
        elif kind == "seq":
            middle = int(rng.integers(1, 3)) * max(group, 1) * (1 if group > 1 else int(rng.integers(1, 4)))
            conv((1, 1), [0] * 4, c, middle, 1, bias)
            if rng.random() < 0.5:
                _bn(s, rng, recipe)
            conv((k, k), [half] * 4, middle, co, stride, bool(rng.random() < 0.5))
        elif kind == "pool":
            include = int(rng.random() < 0.8)
            s.node(
                "AveragePool", [s.cur], [n, c, h, w], kernel_shape=[k, k], pads=[half] * 4, count_include_pad=include
            )
        elif kind == "scale":
            s.node("Mul", [s.cur, s.constant(rng, rng.uniform(0.5, 2, (c, 1, 1)), "k")], [n, c, h, w])
        if kind == "bn" or (kind not in ("id", "scale") and rng.random() < 0.6):
            _bn(s, rng, recipe)
        if rng.random() < 0.05:
            s.outputs.append((s.cur, s.shape))  # a branch read elsewhere: kept apart, or the merge refused
        terms.append(s.cur)
    padded = np.random.default_rng([rng.bit_generator.seed_seq.entropy, 35])  # its own stream: the rest replays
    if dbb and k > 1:
        s.cur, s.shape = source, [n, c, h, w]
        middle = int(padded.integers(1, 3)) * group
        conv((1, 1), [0] * 4, c, middle, 1, bool(padded.random() < 0.2), padded)  # biased: refused after Pad(0)
        half = k // 2
        if padded.random() < 0.5:  # DBB as ONNX writes it: Pad(0) -> BN, the BN turning the border into its bias
            _pad(s, half, 0.0)
            _bn(s, padded, recipe)
        else:  # Add(v) -> Pad(v): exact; Pad(v + 0.5): the border is not the branch's value, refused
            value = float(np.round(padded.normal(0, 1), 2))
            s.node("Add", [s.cur, s.constant(padded, np.array(value), "v")], s.shape)
            _pad(s, half, value + (0.5 if padded.random() < 0.2 else 0.0))
        conv((k, k), [0] * 4, middle, co, stride, bool(padded.random() < 0.5), padded)
        if padded.random() < 0.5:
            _bn(s, padded, recipe)
        terms.append(s.cur)
    if len(terms) > 2 and rng.random() < 0.4:
        s.node("Sum", terms, out)
    else:
        s.cur = terms[0]
        for term in terms[1:]:
            s.node("Add", [s.cur, term], out)
    s.shape = out
    if out == [n, c, h, w] and rng.random() < 0.25:  # FastViT's RepMixer: x + layer_scale * (sum - BN(x))
        mixed = s.cur
        s.cur, s.shape = source, [n, c, h, w]
        _bn(s, rng, recipe)
        s.node("Sub", [mixed, s.cur], out)
        s.node("Mul", [s.cur, s.constant(rng, rng.uniform(-1, 1, (c, 1, 1)), "ls")], out)
        s.node("Add", [source, s.cur], out)


def _pad(s: _State, pad: int, value: float) -> None:
    """A constant-mode Pad of the spatial axes by ``pad`` on every side (inputs: opset 11+)."""
    pads = s.name("pads")
    s.inits.append(numpy_helper.from_array(np.array([0, 0, pad, pad] * 2, np.int64), pads))
    constant = s.name("padvalue")
    s.inits.append(numpy_helper.from_array(np.array(value, s.dtype), constant))
    n, c, h, w = s.shape
    s.node("Pad", [s.cur, pads, constant], [n, c, h + 2 * pad, w + 2 * pad])


def _flatten(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    if len(s.shape) != 4:
        return
    n, features = s.shape[0], int(np.prod(s.shape[1:]))
    if rng.random() < 0.5:
        s.node("Flatten", [s.cur], [n, features], axis=1)
        return
    target = [[0, -1], [n, -1], [-1, features], [n, features]][int(rng.integers(0, 4))]
    shape_name = s.name("shape")
    s.inits.append(numpy_helper.from_array(np.array(target, np.int64), shape_name))
    s.node("Reshape", [s.cur, shape_name], [n, features])


def _dropout(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    s.node("Dropout", [s.cur], s.shape)


def _identity(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    s.node("Identity", [s.cur], s.shape)


def _output(s: _State, rng: np.random.Generator, recipe: Recipe) -> None:
    s.outputs.append((s.cur, s.shape))  # read by the next step too: a shared tensor that is a graph output


_STEPS = {
    "conv": _conv,
    "convT": _conv_transpose,
    "gemm": _gemm,
    "matmul": _matmul,
    "bn": _bn,
    "bnpair": _bn_pair,
    "relu": _relu,
    "affine": _affine,
    "transpose": _transpose,
    "concat": _concat,
    "residual": _residual,
    "repblock": _rep_block,
    "repblock+dbb": lambda s, rng, recipe: _rep_block(s, rng, recipe, dbb=True),
    "concat+part": lambda s, rng, recipe: _concat(s, rng, recipe, part=True),
    "flatten": _flatten,
    "dropout": _dropout,
    "identity": _identity,
    "output": _output,
    "preact": _preact,
    "pool": _pool,
    "tokens": _tokens,
    "qdq": _qdq,
    "nhwc": _nhwc,
}


# --- statistics --------------------------------------------------------------------------------------


def calibrate(model: onnx.ModelProto, state: _State, feeds: dict[str, np.ndarray]) -> onnx.ModelProto | None:
    """BN statistics: the identity placeholders replaced per BN mode, from one run observing each BN input."""
    inits = {t.name: t for t in model.graph.initializer}
    for _, _, params, _, _ in state.batchnorms:  # identity BN: scale 1, var 1 - eps would be exact; near enough
        for name, value in zip(params, (1.0, 0.0, 0.0, 1.0), strict=True):
            tensor = inits[name]
            tensor.CopyFrom(numpy_helper.from_array(np.full(tensor.dims, value).astype(state.dtype), name))
    watched = [model.graph.node[i].input[0] for i, *_ in state.batchnorms]
    observed = run(model, feeds, extra=watched)
    if observed is None:
        return None
    if not watched:
        return model
    amplified: tuple[float, float, np.ndarray, np.ndarray] | None = None
    half = state.dtype == np.float16
    for (_, mode, params, _, seed), value in zip(state.batchnorms, observed[-len(watched) :], strict=True):
        rng = np.random.default_rng(seed)
        axes = tuple(i for i in range(value.ndim) if i != 1)
        with np.errstate(invalid="ignore", over="ignore"):  # an amplified float16 input may hold inf
            observed64 = np.nan_to_num(value.astype(np.float64), posinf=6e4, neginf=-6e4)
        m = observed64.mean(axis=axes)
        sd = np.maximum(observed64.std(axis=axes), 1e-3)
        c = m.size
        if mode == "normalize" and amplified is not None:  # after an amplifier: its output's statistics
            factor, shift, m0, s0 = amplified
            m, sd = factor * (m - m0) + m0 + shift, factor * sd
            mode = "calibrated"
        amplified = None
        if mode == "amplify":
            # float16: the variance (factor * sd)^2 and every value must stay representable
            cap = 250.0 / max(float(sd.max()), 1e-3) if half else 500.0
            factor = float(min(rng.uniform(50, 500), cap))
            shift = float(rng.uniform(1e2, 2e4 if half else 3e4)) * float(rng.choice([-1, 1]))
            scale, bias, mean, var = factor * sd, m + shift, m, sd**2
            amplified = (factor, shift, m, sd)
        elif mode in ("calibrated", "positive"):  # positive: every scale > 0 (a pre-activation BN that can move)
            gain = rng.uniform(0.5, 2, c) * (1 if mode == "positive" else rng.choice([-1, 1], c))
            mean = m * (1 + rng.normal(0, 0.05, c))
            var = (sd * rng.uniform(0.8, 1.25, c)) ** 2
            scale, bias = gain * sd, m + rng.normal(0, 0.5, c) * sd
        else:
            scale, bias = rng.uniform(0.5, 2, c) * rng.choice([-1, 1], c), rng.normal(0, 1, c)
            mean, var = rng.normal(0, 1, c), rng.uniform(0.1, 3, c)
        for name, values in zip(params, (scale, bias, mean, var), strict=True):
            if half:  # statistics float16 can hold (an amplified input may pass its range)
                values = np.clip(np.nan_to_num(np.asarray(values, np.float64)), -6e4, 6e4)
            tensor = inits[name]
            tensor.CopyFrom(numpy_helper.from_array(np.asarray(values).astype(state.dtype), name))
    return model


# --- running -----------------------------------------------------------------------------------------


def feeds_for(model: onnx.ModelProto, state: _State, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal([d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim])}
    feeds = {k: v.astype(state.dtype) for k, v in feeds.items()}
    return {**feeds, **state.weight_feeds}


def run(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, extra: list[str] = (), level: str = "off", save: str = ""
) -> list[np.ndarray] | None:
    """The model's outputs (and ``extra`` tensors) in onnxruntime; None when it cannot run it."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = {
        "off": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    }[level]
    options.log_severity_level = 4
    options.intra_op_num_threads = 1
    if save:
        options.optimized_model_filepath = save
    if extra:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        present = {o.name for o in copy.graph.output}
        copy.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in extra if n not in present)
        model = copy
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        outputs = [o.name for o in model.graph.output if o.name not in extra]
        names = outputs + list(dict.fromkeys(extra))
        values = dict(zip(names, session.run(names, feeds), strict=True))
    except Exception:
        return None
    return [values[n] for n in outputs] + [values[n] for n in extra]


def relative_error(want: np.ndarray, got: np.ndarray) -> float:
    """max |got - want| / max |want| over finite values; inf where shapes or non-finite values disagree."""
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    if want.shape != got.shape or not np.array_equal(np.isnan(want), np.isnan(got)):
        return float("inf")
    if not np.array_equal(np.isinf(want), np.isinf(got)):  # of either sign: the sign of an exact zero is not kept
        return float("inf")
    finite = np.isfinite(want) & np.isfinite(got)
    diff = float(np.max(np.abs(want[finite] - got[finite]), initial=0.0))
    scale = float(np.max(np.abs(want[finite]), initial=0.0))
    return diff / scale if scale > 0 else diff


def widen(model: onnx.ModelProto, elem: int) -> onnx.ModelProto:
    """Every float tensor, type and Constant of ``model`` as ``elem`` (float32 or float64)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    np_type = helper.tensor_dtype_to_np_dtype(elem)
    floats = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16)

    def tensor(t: onnx.TensorProto) -> None:
        if t.data_type in floats:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np_type), t.name))

    for t in copy.graph.initializer:
        tensor(t)
    for node in copy.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                tensor(attr.t)
        if node.op_type == "BatchNormalization" and not any(a.name == "epsilon" for a in node.attribute):
            # written out: onnx's reference evaluator (float64 Conv runs there) defaults to 1e-5, not ONNX's
            # float32(1e-5) that onnxruntime and bnfuse use
            node.attribute.append(helper.make_attribute("epsilon", 1e-5))
    for info in [*copy.graph.input, *copy.graph.output, *copy.graph.value_info]:
        if info.type.tensor_type.elem_type in floats:
            info.type.tensor_type.elem_type = elem
    return copy


def run_wide(model: onnx.ModelProto, feeds: dict[str, np.ndarray], elem: int) -> list[np.ndarray] | None:
    """``model`` widened to ``elem``, in onnxruntime, else (float64 Conv) in onnx's reference evaluator."""
    wide = widen(model, elem)
    np_type = helper.tensor_dtype_to_np_dtype(elem)
    wide_feeds = {k: v.astype(np_type) for k, v in feeds.items()}
    values = run(wide, wide_feeds)
    if values is not None:
        return values
    from onnx.reference import ReferenceEvaluator

    # its BN of opsets 9-13 mixes in batch statistics
    from bnfuse.passes.check.engines import reference_overrides as _reference_overrides

    try:
        evaluator = ReferenceEvaluator(wide, new_ops=_reference_overrides(wide))
        return [np.asarray(v) for v in evaluator.run(None, wide_feeds)]
    except Exception:
        return None


def count_bn(model: onnx.ModelProto) -> int:
    return sum(1 for n in model.graph.node if n.op_type == "BatchNormalization")


# --- one case ----------------------------------------------------------------------------------------


@dataclass
class Result:
    outcome: str
    detail: str = ""
    bn: int = 0
    bn_bnfuse: int = 0
    bn_ort: int | None = None
    ort_wrong: bool = False
    forward: int = 0
    merges: int = 0  # branch sums merged into one Conv
    merges_refused: int = 0
    moved: int = 0  # BNs whose scale moved through an activation (bnfuse.passes.fold.moves)
    beyond_own: bool = False  # float16, passed: an output past 2x the original's own error + 2^-9 (the twins allow it)


def make_model(recipe: Recipe, seed: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]] | None:
    model, state = build(recipe)
    feeds = feeds_for(model, state, seed)
    model = calibrate(model, state, feeds)
    return None if model is None else (model, feeds_for(model, state, seed + 1))


def evaluate(recipe: Recipe, seed: int) -> Result:
    """Build, optimize, prove and compare one recipe (see the module docstring for the outcomes)."""
    import bnfuse
    from bnfuse.errors import BnfuseError, CheckFailedError
    from bnfuse.passes.optimize import prove

    made = make_model(recipe, seed)
    if made is None:
        return Result("original does not run")
    model, feeds = made
    elem = DTYPES[recipe.dtype]
    bn = count_bn(model)
    try:
        optimized, report = bnfuse.optimize(model)
    except BnfuseError as exc:
        return Result("refused", str(exc).splitlines()[0], bn)
    except Exception:
        return Result("crash", traceback.format_exc().strip().splitlines()[-1], bn)
    moved = sum(1 for r in report.batchnorms if r.status == "folded" and r.direction == "moved")
    result = Result("ok", "", bn, count_bn(optimized), forward=report.forward_folds, moved=moved)
    result.merges = sum(1 for m in report.merges if m.status == "merged")
    result.merges_refused = len(report.merges) - result.merges
    check_failed, message = False, ""
    rewrote = report.count("folded") + report.count("converted") + len(report.absorbed) + report.noops_removed
    rewrote += result.merges
    try:
        if rewrote:  # nothing rewritten, nothing to prove (the outputs are still compared below)
            prove(model, optimized, report, input_shapes=None, seed=0, tolerance=None)
    except CheckFailedError as exc:
        check_failed, message = True, str(exc)
    except Exception:
        return Result("crash", "check: " + traceback.format_exc().strip().splitlines()[-1], bn)
    want, got = run(model, feeds), run(optimized, feeds)
    if want is None:
        return Result("original does not run")
    if got is None:
        result.outcome = "optimized does not run"
        return result
    verdict, detail = compare(model, optimized, feeds, want, got, elem, written=report.written_weights, seed=seed)
    with tempfile.TemporaryDirectory() as scratch:
        path = f"{scratch}/ort.onnx"
        theirs = run(model, feeds, level="extended", save=path)
        if theirs is not None and Path(path).exists():
            result.bn_ort = count_bn(onnx.load(path, load_external_data=False))
            # onnxruntime rewrites every weight its fusions touch: the twin re-rounds them all
            result.ort_wrong = compare(model, model, feeds, want, theirs, elem, widened=False, seed=seed)[0] == "wrong"
    folded = report.count("folded") + report.count("converted") + len(report.absorbed) + result.merges
    result.beyond_own = verdict == "equal" and detail.startswith(BEYOND_OWN)
    if verdict == "original overflows":
        result.outcome = verdict
    elif verdict == "equal":
        result.outcome = "false alarm" if check_failed else "ok" if folded else "no BN folded"
    elif verdict == "rounding":
        result.outcome = "rounding, check refused" if check_failed else "rounding, check passed"
    else:
        result.outcome = "wrong output, check refused" if check_failed else "wrong output"
    result.detail = detail + (f" | check: {message}" if check_failed else "")
    return result


def compare(
    model: onnx.ModelProto,
    optimized: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    want: list[np.ndarray],
    got: list[np.ndarray],
    elem: int,
    *,
    widened: bool = True,
    written: list[str] | None = None,
    seed: int = 0,
) -> tuple[str, str]:
    """("equal" | "rounding" | "wrong" | "original overflows", detail) of ``got`` against ``want``.

    float16: ``--check``'s rule on this draw (``_compare_low_precision``).
    """
    if elem == TensorProto.FLOAT16:
        return _compare_low_precision(model, optimized, feeds, want, got, written, seed, widened=widened)
    errors = [relative_error(w, g) for w, g in zip(want, got, strict=True)]
    bad = [i for i, e in enumerate(errors) if e > TOLERANCE[elem]]
    if not bad:
        return "equal", ""
    detail = f"output {bad[0]}: rel {errors[bad[0]]:.2e}"
    if not widened:
        return "wrong", detail
    # What one rounding of the folded values moves the optimized model by (a Div by a value near zero amplifies
    # it), measured on this draw with twins of the fuzzer's own.
    moved = _ulp_twin_error(optimized, feeds, got, written)
    if all(errors[i] <= ROUNDING_FACTOR * moved[i] for i in bad):
        return "rounding", f"{detail}; one rounding of the folded values moves the output by {max(moved):.2e}"
    if elem == TensorProto.FLOAT and _refold_matches(model, optimized, feeds, TensorProto.DOUBLE):
        return "rounding", detail + "; it is the exact float64 fold rounded once"
    return "wrong", detail


def _compare_low_precision(
    model: onnx.ModelProto,
    optimized: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    want: list[np.ndarray],
    got: list[np.ndarray],
    written: list[str] | None,
    seed: int,
    *,
    widened: bool,
) -> tuple[str, str]:
    """float16: ``--check``'s own rule (bnfuse.passes.check.tolerances: precision_references and tensor_error,
    the same twins and limit) applied to the fuzzer's draw."""
    from bnfuse.passes.check.engines import Model
    from bnfuse.passes.check.tolerances import LOW_PRECISION_FLOOR, precision_references, tensor_error

    names = [o.name for o in model.graph.output]
    references = precision_references(Model(model), Model(optimized), feeds, seed, names, written)
    if references is None:
        return "equal", "no float32 reference"
    own = [relative_error(r, w) for r, w in zip(references.exact, want, strict=True)]
    if not all(np.isfinite(own)):
        return "original overflows", "the float16 original overflows where its float32 twin does not"
    triples = enumerate(zip(names, want, got, strict=True))
    errors = [tensor_error(name, w, g, references, i, None) for i, (name, w, g) in triples]
    bad = [e for e in errors if not e.passed]
    if not bad:
        floor = LOW_PRECISION_FLOOR[TensorProto.FLOAT16]
        past = [e for e, o in zip(errors, own, strict=True) if e.max_rel > 2 * o + floor]
        if past:
            return "equal", f"{BEYOND_OWN}: {past[0].name} {past[0].max_rel:.2e} (noise {past[0].noise})"
        return "equal", ""
    if _overflows_inside(model, feeds):
        return "original overflows", "the float16 original overflows inside (inf washed out before its outputs)"
    e = bad[0]
    detail = f"output {e.name}: {e.max_rel:.2e} from the {e.reference} > {e.tolerance:.2e} (noise {e.noise})"
    if widened and _refold_matches(model, optimized, feeds, TensorProto.DOUBLE):
        detail += "; it is the exact fold rounded once"
    return "wrong", detail


def _ulp_twin_error(
    optimized: onnx.ModelProto, feeds: dict[str, np.ndarray], got: list[np.ndarray], written: list[str] | None
) -> list[float]:
    """Per output, the largest move of TWINS copies of ``optimized`` whose ``written`` constants moved by -1, 0
    or +1 ulp (bnfuse's own twins, drawn with other seeds)."""
    from bnfuse.passes.check.tolerances import rerounded as _rerounded

    worst = [0.0] * len(got)
    for seed in range(TWINS):
        twin = _rerounded(optimized, written or [], np.random.default_rng((seed, 1)))
        values = run(twin, feeds) if twin is not None else None
        if values is not None:
            worst = [max(m, relative_error(g, v)) for m, g, v in zip(worst, got, values, strict=True)]
    return worst


def _refold_matches(
    model: onnx.ModelProto, optimized: onnx.ModelProto, feeds: dict[str, np.ndarray], elem: int
) -> bool:
    """Whether ``optimized`` is the exact fold rounded once: bnfuse folds the graph widened to ``elem`` (float32
    / float64) with the same decisions (the same nodes and constants), exactly (compared in float64, within
    1e-9), and each of ``optimized``'s constants is within 1 ulp of its type of the widened fold's."""
    import bnfuse

    wide = widen(model, elem)
    try:
        folded, report = bnfuse.optimize(wide)
    except Exception:
        return False
    if [(n.op_type, list(n.input)) for n in folded.graph.node] != [
        (n.op_type, list(n.input)) for n in optimized.graph.node
    ]:
        return False
    exact = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in folded.graph.initializer}
    for tensor in optimized.graph.initializer:
        value = numpy_helper.to_array(tensor)
        if tensor.name not in exact or exact[tensor.name].shape != value.shape:
            return False
        if value.dtype.kind == "f":
            spacing = np.spacing(np.abs(exact[tensor.name]).astype(value.dtype)).astype(np.float64)
            if not np.all(np.abs(value.astype(np.float64) - exact[tensor.name]) <= spacing):
                return False
    np_type = helper.tensor_dtype_to_np_dtype(elem)
    wide_feeds = {k: v.astype(np_type) for k, v in feeds.items()}
    a, b = run_wide(wide, wide_feeds, TensorProto.DOUBLE), run_wide(folded, wide_feeds, TensorProto.DOUBLE)
    if a is not None and b is not None:
        return max((relative_error(x, y) for x, y in zip(a, b, strict=True)), default=0.0) <= 1e-9
    # Neither engine runs it in float64 (onnx's reference evaluator lacks a grouped ConvTranspose, say): the
    # widened fold rounded to float32, in onnxruntime, within float32 rounding of the folded values.
    wide32, folded32 = widen(wide, TensorProto.FLOAT), widen(folded, TensorProto.FLOAT)
    feeds32 = {k: v.astype(np.float32) for k, v in feeds.items()}
    a, b = run(wide32, feeds32), run(folded32, feeds32)
    if a is None or b is None:
        return False
    moved = _ulp_twin_error(folded32, feeds32, b, report.written_weights)
    errors = [relative_error(x, y) for x, y in zip(a, b, strict=True)]
    return all(e <= max(TOLERANCE[TensorProto.FLOAT], ROUNDING_FACTOR * m) for e, m in zip(errors, moved, strict=True))


def _overflows_inside(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> bool:
    """Whether a tensor inside the float16 ``model`` is inf or NaN where its float32 twin's is finite (a Div by
    an overflowed tensor gives 0, and the output looks finite)."""
    names = [o for node in model.graph.node for o in node.output if o]
    low, wide = run(model, feeds, extra=names), run(widen(model, TensorProto.FLOAT), _wide_feeds(feeds), extra=names)
    if low is None or wide is None:
        return False
    return any(
        bool(np.any(~np.isfinite(np.asarray(a, np.float64)) & np.isfinite(np.asarray(b, np.float64))))
        for a, b in zip(low, wide, strict=True)
    )


def _wide_feeds(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feeds.items()}


# --- minimizing ----------------------------------------------------------------------------------------


def minimize(recipe: Recipe, still_fails) -> Recipe:  # noqa: ANN001
    """Drop steps (and shrink channels / sides) while ``still_fails(recipe)`` holds; the smallest recipe."""
    current = recipe
    changed = True
    while changed:
        changed = False
        for index in reversed(range(len(current.steps))):
            if len(current.steps) == 1:
                break
            candidate = Recipe(**{**current.__dict__, "steps": current.steps[:index] + current.steps[index + 1 :]})
            if still_fails(candidate):
                current, changed = candidate, True
        for key in ("channels", "side"):
            for smaller in range(1 if key == "channels" else 3, getattr(current, key)):
                candidate = Recipe(**{**current.__dict__, key: smaller})
                if still_fails(candidate):
                    current, changed = candidate, True
                    break
    return current


# --- driver ------------------------------------------------------------------------------------------


def run_cases(
    count: int, seed: int, *, start: int = 0, dtypes: tuple[str, ...] = tuple(DTYPES), progress: bool = False,
    minimize_defects: bool = True, save: Path | None = None, checkpoint: Path | None = None,
) -> dict:  # fmt: skip
    """Run cases start .. start + count - 1; the summary (outcomes, BN counts, defects with minimized recipes),
    also written to ``checkpoint`` every 250 cases (a long run can be read while it goes)."""
    outcomes: Counter[str] = Counter()
    per_dtype: dict[str, Counter[str]] = {d: Counter() for d in dtypes}
    totals = Counter()
    defects = []
    started = time.time()
    for index in range(start, start + count):
        recipe = draw_recipe(seed, index, dtypes)
        result = evaluate(recipe, seed + index)
        outcomes[result.outcome] += 1
        per_dtype[recipe.dtype][result.outcome] += 1
        totals["bn"] += result.bn
        totals["bn_left_bnfuse"] += result.bn_bnfuse
        totals["forward_folds"] += result.forward
        totals["merges"] += result.merges
        totals["merges_refused"] += result.merges_refused
        totals["moved_folds"] += result.moved
        if result.bn_ort is not None:
            totals["graphs_ort_optimized"] += 1
            totals["bn_left_ort"] += result.bn_ort
            totals["bn_in_ort_optimized"] += result.bn
            totals["bn_left_bnfuse_same_graphs"] += result.bn_bnfuse
            totals["bnfuse_leaves_more_than_ort"] += int(result.bn_bnfuse > result.bn_ort)
        totals["ort_optimizer_wrong"] += int(result.ort_wrong)
        totals["float16_beyond_own_error"] += int(result.beyond_own and result.outcome == "ok")
        if result.outcome in DEFECTS:
            entry = {"index": index, "outcome": result.outcome, "detail": result.detail, "recipe": recipe.describe()}
            if minimize_defects:
                smallest = minimize(recipe, lambda r, o=result.outcome, i=index: evaluate(r, seed + i).outcome == o)
                entry["minimized"] = smallest.describe()
                entry["minimized_recipe"] = smallest.__dict__
                if save is not None:
                    made = make_model(smallest, seed + index)
                    if made is not None:
                        save.mkdir(parents=True, exist_ok=True)
                        onnx.save(made[0], str(save / f"case{index}.onnx"))
            defects.append(entry)
            print(json.dumps(entry), file=sys.stderr, flush=True)
        done = index - start + 1
        if progress and done % 1000 == 0:
            print(f"{done}/{count} in {time.time() - started:.0f} s: {dict(outcomes)}", file=sys.stderr, flush=True)
        if checkpoint is not None and (done % 250 == 0 or done == count):
            partial = _summary(seed, start, done, dtypes, started, outcomes, per_dtype, totals, defects)
            checkpoint.write_text(json.dumps(partial, indent=1))
    return _summary(seed, start, count, dtypes, started, outcomes, per_dtype, totals, defects)


def _summary(seed, start, count, dtypes, started, outcomes, per_dtype, totals, defects) -> dict:  # noqa: ANN001
    return {
        "seed": seed,
        "start": start,
        "count": count,
        "dtypes": list(dtypes),
        "seconds": round(time.time() - started),
        "outcomes": dict(outcomes),
        "per_dtype": {d: dict(c) for d, c in per_dtype.items()},
        "totals": dict(totals),
        "defects": defects,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--start", type=int, default=0, help="first case index (to split a run)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated: float32,float64,float16")
    parser.add_argument("--case", type=int, help="run and print this one case (index), minimized if it fails")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--save", help="folder for the minimized defect models")
    args = parser.parse_args()
    dtypes = tuple(d for d in args.dtypes.split(",") if d)
    if any(d not in DTYPES for d in dtypes):
        parser.error(f"--dtypes: choose from {', '.join(DTYPES)}")
    if args.case is not None:
        recipe = draw_recipe(args.seed, args.case, dtypes)
        result = evaluate(recipe, args.seed + args.case)
        print(recipe.describe(), "->", result)
        return 1 if result.outcome in DEFECTS else 0
    summary = run_cases(
        args.count, args.seed, start=args.start, dtypes=dtypes, progress=True,
        save=Path(args.save) if args.save else None, checkpoint=Path(args.json) if args.json else None,
    )  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k != "defects"}, indent=1))
    print(f"defects: {len(summary['defects'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if summary["defects"] else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
