"""Every BN op x type pair x layout x size class x attribute in a real onnxruntime session, against float64 formulas
written from the attribute values (tests/runtime/op_oracle.py), not through bnfuse's config parsing or reference.

Size classes: "serial" (a few KiB: the small-tensor path) and "pooled": X of 2.2M elements, 8.4 MiB in float32,
above every size at which bnfuse's CPU kernels leave their serial loop for the pooled one (4 MiB, 8 MiB for
row-wise layouts, 256 KiB for the Python-hosted float16 path; docs/ops.md "Execution"). The pooled shapes keep
the reduced count M small (4 to 128 values per statistic over thousands of channels), so the unbiased factor
M / (M - 1) moves the running variance by 0.8% or more: a kernel that dropped it on the large-input path passed
every kernel test before this file. Bad input (ranks, shapes, types, channels, attribute values and types) must
give an onnxruntime error naming the op and the reason, and leave the session usable. A seeded random sample
draws ops, shapes and attributes (bench/fuzz_ops.py runs 10,000).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from tests.loaders import bench_module
from tests.runtime.op_oracle import (
    GRAD,
    INFERENCE,
    OUTPUTS,
    TRAINING,
    TYPE_PAIRS,
    Case,
    expected,
    feeds,
    mismatches,
    model_bytes,
    random_case,
    run_case,
    session,
)

# layout -> (attributes, serial shape, pooled shape): NCHW, NHWC, (N, C), per-activation (N, C, L)
LAYOUTS: dict[str, tuple[dict[str, Any], tuple[int, ...], tuple[int, ...]]] = {
    "nchw": ({}, (4, 3, 5, 6), (4, 17408, 1, 32)),  # pooled: inner 32 (channels-first loops), M = 128
    "nhwc": ({"axis": -1}, (3, 5, 4, 6), (2, 4, 4, 68000)),  # M = 32
    "nc": ({}, (16, 7), (8, 275000)),  # M = 8
    "per_activation": ({"mode": "per_activation"}, (5, 3, 4), (4, 550, 1000)),  # M = 4
}
SIZES = ("serial", "pooled")
# One attribute (or a combination) away from the defaults at a time; every value of every attribute appears.
ATTRIBUTES: dict[str, list[dict[str, Any]]] = {
    INFERENCE: [{}, {"epsilon": 0.25}],
    TRAINING: [
        {},
        {"fix_gamma": 1},
        {"use_global_stats": 1},
        {"unbiased_running_var": 1, "momentum": 0.25},  # onnx convention: batch weight 0.75
        {"unbiased_running_var": 1, "momentum_convention": "pytorch", "momentum": 0.75},
        {"momentum_convention": "mxnet", "momentum": 0.3},
        {"momentum_convention": "mindspore", "momentum": 0.6, "epsilon": 0.5},
        {"momentum_convention": "cudnn", "momentum": 0.5},
        {"activation": "relu"},
        {"fix_gamma": 1, "use_global_stats": 1, "activation": "relu", "epsilon": 1e-3},
        {
            "fix_gamma": 1,
            "unbiased_running_var": 1,
            "momentum_convention": "pytorch",
            "momentum": 0.9,
            "activation": "relu",
        },  # fmt: skip
    ],
    GRAD: [
        {},
        {"fix_gamma": 1},
        {"use_global_stats": 1},
        {"activation": "relu"},
        {"fix_gamma": 1, "use_global_stats": 1, "activation": "relu"},
        {"fix_gamma": 1, "activation": "relu", "epsilon": 0.5},  # epsilon: accepted, unused (saved_inv_std has it)
    ],
}


def _attribute_id(attributes: dict[str, Any]) -> str:
    return "-".join(f"{k}={v}" for k, v in attributes.items()) or "defaults"


MATRIX = [
    pytest.param(Case(op, {**layout_attrs, **attrs}, types, shapes[SIZES.index(size)]),
                 id=f"{size}-{layout}-{types}-{op.removeprefix('BatchNormalization')}-{_attribute_id(attrs)}")
    for size in SIZES
    for layout, (layout_attrs, *shapes) in LAYOUTS.items()
    for types in TYPE_PAIRS
    for op, variants in ATTRIBUTES.items()
    for attrs in variants
]  # fmt: skip


@pytest.mark.parametrize("case", MATRIX)
def test_op_matches_float64_formulas(case: Case) -> None:
    problems = run_case(case)
    assert not problems, f"{case.describe()}:\n" + "\n".join(problems)


@pytest.mark.parametrize("types", list(TYPE_PAIRS))
@pytest.mark.parametrize("op", [TRAINING, GRAD, INFERENCE])
def test_empty_batch(op: str, types: str) -> None:
    """An empty batch: Training leaves the running statistics and saves zeros; Grad gives zero dScale and dBias."""
    attrs = {"unbiased_running_var": 1} if op == TRAINING else {}
    case = Case(op, attrs, types, (0, 3, 4))
    assert not run_case(case), case.describe()


def test_results_do_not_depend_on_the_thread_count() -> None:
    """The pooled path at 1 and 2 intra-op threads: the same bits."""
    case = Case(TRAINING, {"axis": -1, "unbiased_running_var": 1}, "f32", LAYOUTS["nhwc"][2])
    inputs = feeds(case)
    model = model_bytes(case.op, case.attributes)
    one, two = (session(model, threads).run(None, inputs) for threads in (1, 2))
    for a, b in zip(one, two, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not mismatches(case, two, expected(case, inputs))


# -- bad input ------------------------------------------------------------------------------------------------

GOOD = Case(TRAINING, {}, "f32", (4, 3, 5))


def _assert_usable(sess: ort.InferenceSession, case: Case = GOOD) -> None:
    """A good run on the session right after a refused one gives the right values."""
    inputs = feeds(case)
    assert not mismatches(case, sess.run(None, inputs), expected(case, inputs))


def _replace(inputs: dict[str, np.ndarray], **changes: np.ndarray) -> dict[str, np.ndarray]:
    return {**inputs, **changes}


GOOD_INPUTS = feeds(GOOD)
# (id, inputs, what the error must say): each is refused at the run, the session stays usable
BAD_RUNS = [
    ("rank-1", _replace(GOOD_INPUTS, X=np.ones(4, np.float32)), r"input rank must be 2 to 8, got 1"),
    ("rank-9", _replace(GOOD_INPUTS, X=np.ones((1,) * 9, np.float32)), r"at most 8 dimensions"),
    ("few-channels", _replace(GOOD_INPUTS, scale=np.ones(2, np.float32)), r"scale has shape \(2,\), expected \(3,\)"),
    ("more-channels", _replace(GOOD_INPUTS, X=np.ones((4, 5, 5), np.float32)), r"has shape \(3,\), expected \(5,\)"),
    ("param-rank", _replace(GOOD_INPUTS, input_var=np.ones((3, 1), np.float32)), r"input_var has shape \(3, 1\)"),
]  # fmt: skip


@pytest.mark.parametrize(("inputs", "message"), [pytest.param(i, m, id=n) for n, i, m in BAD_RUNS])
def test_bad_shapes_fail_the_run_with_the_reason_and_the_session_stays_usable(inputs: dict, message: str) -> None:
    sess = session(model_bytes(TRAINING, {}))
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.RuntimeException, match=rf"{TRAINING}.*{message}"):
        sess.run(None, inputs)
    _assert_usable(sess)


def test_grad_shape_mismatch_and_axis_out_of_range() -> None:
    grad = Case(GRAD, {}, "f32", (4, 3, 5))
    sess = session(model_bytes(GRAD, {}))
    inputs = feeds(grad)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.RuntimeException, match=rf"{GRAD}.*dY has shape"):
        sess.run(None, _replace(inputs, dY=np.ones((4, 3, 6), np.float32)))
    _assert_usable(sess, grad)
    sess = session(model_bytes(INFERENCE, {"axis": 0}))  # never valid: axis 0 is the batch
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.RuntimeException, match=rf"{INFERENCE}.*axis 0 .*range"):
        sess.run(None, feeds(Case(INFERENCE, {}, "f32", (2, 3, 4))))
    _assert_usable(session(model_bytes(INFERENCE, {})), Case(INFERENCE, {}, "f32", (2, 3, 4)))
    sess = session(model_bytes(INFERENCE, {"axis": 3}))
    case = Case(INFERENCE, {"axis": 3}, "f32", (2, 3, 4, 5))
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.RuntimeException, match=rf"{INFERENCE}.*axis 3 .*range"):
        sess.run(None, feeds(Case(INFERENCE, {"axis": 3}, "f32", (2, 3, 4))))  # rank 3: axis 3 does not exist
    _assert_usable(sess, case)


def test_wrong_input_types_are_refused() -> None:
    """A type pair that is not registered (float32 data, float16 parameters; float64; int64) fails session creation;
    a feed of the wrong type fails the run; the session stays usable."""
    for data, param in ((np.float32, np.float16), (np.float64, np.float64)):
        with pytest.raises(Exception, match=r"(?i)type|implementation"):
            session(model_bytes(TRAINING, {}, data, param))
    with pytest.raises(Exception, match=r"(?i)type|implementation"):
        session(model_bytes(TRAINING, {}, input_types={"scale": np.int64}))
    sess = session(model_bytes(TRAINING, {}))
    with pytest.raises(Exception, match=r"(?i)type"):
        sess.run(None, _replace(GOOD_INPUTS, X=GOOD_INPUTS["X"].astype(np.float64)))
    _assert_usable(sess)


BAD_ATTRIBUTES = [
    ("mode", TRAINING, {"mode": "nchw"}, r"attribute mode must be"),
    ("convention", TRAINING, {"momentum_convention": "keras"}, r"unknown momentum convention 'keras'"),
    ("epsilon-zero", TRAINING, {"epsilon": 0.0}, r"epsilon must be > 0"),
    ("epsilon-negative", INFERENCE, {"epsilon": -1e-5}, r"epsilon must be > 0"),
    ("epsilon-mindspore-range", TRAINING, {"momentum_convention": "mindspore", "epsilon": 2.0}, r"epsilon must be in"),
    ("momentum-above-1", TRAINING, {"momentum": 1.5}, r"momentum must be in \[0, 1\]"),
    ("momentum-negative", TRAINING, {"momentum": -0.1}, r"momentum must be in \[0, 1\]"),
    ("fix-gamma-2", TRAINING, {"fix_gamma": 2}, r"fix_gamma must be 0 or 1"),
    ("global-stats-minus-1", GRAD, {"use_global_stats": -1}, r"use_global_stats must be 0 or 1"),
    ("unbiased-2", TRAINING, {"unbiased_running_var": 2}, r"unbiased_running_var must be 0 or 1"),
    ("activation", TRAINING, {"activation": "gelu"}, r"activation must be"),
    ("inference-activation", INFERENCE, {"activation": "relu"}, r"has no attribute activation"),
]  # fmt: skip
BAD_ATTRIBUTE_TYPES = [
    ("epsilon-int", TRAINING, helper.make_attribute("epsilon", 1), "epsilon"),
    ("axis-float", INFERENCE, helper.make_attribute("axis", 1.0), "axis"),
    ("fix-gamma-string", GRAD, helper.make_attribute("fix_gamma", "yes"), "fix_gamma"),
    ("mode-int", TRAINING, helper.make_attribute("mode", 1), "mode"),
]


@pytest.mark.parametrize(("op", "attributes", "message"), [pytest.param(*c[1:], id=c[0]) for c in BAD_ATTRIBUTES])
def test_bad_attribute_values_fail_session_creation(op: str, attributes: dict, message: str) -> None:
    with pytest.raises(Exception, match=rf"{op}.*{message}"):
        session(model_bytes(op, attributes))
    _assert_usable(session(model_bytes(GOOD.op, GOOD.attributes)))  # the process and the library stay usable


@pytest.mark.parametrize(("op", "attribute", "name"), [pytest.param(*c[1:], id=c[0]) for c in BAD_ATTRIBUTE_TYPES])
def test_bad_attribute_types_fail_session_creation(op: str, attribute: Any, name: str) -> None:
    with pytest.raises(Exception, match=rf"{op}.*{name}"):
        session(model_bytes(op, {}, raw_attributes=[attribute]))
    _assert_usable(session(model_bytes(GOOD.op, GOOD.attributes)))


def test_grad_y_input_must_match_the_activation() -> None:
    inputs = [*OUTPUTS[GRAD]]  # noqa: F841 - names only
    with pytest.raises(Exception, match=rf"{GRAD}.*Y goes with activation"):
        sess = session(model_bytes(GRAD, {}, inputs=["dY", "X", "scale", "saved_mean", "saved_inv_std", "Y"]))
        case = Case(GRAD, {"activation": "relu"}, "f32", (4, 3, 5))
        sess.run(None, feeds(case))
    _assert_usable(session(model_bytes(GOOD.op, GOOD.attributes)))


# -- random cases ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", range(4))
def test_random_ops_shapes_and_attributes(block: int) -> None:
    """A seeded sample of bench/fuzz_ops.py's draws (ops, type pairs, ranks 2-6, axes, modes, every attribute)."""
    rng = np.random.default_rng(1000 + block)
    failures = []
    for index in range(40):
        case = random_case(rng, seed=block * 1000 + index)
        problems = run_case(case)
        if problems:
            failures.append(f"{case.describe()}: {problems}")
    assert not failures, "\n".join(failures)


def test_fuzz_script_sample_with_bad_input() -> None:
    """bench/fuzz_ops.py on a small seeded sample, every third case broken (bad attributes or feeds), one large."""
    fuzz = bench_module("fuzz_ops")
    assert fuzz.main(["--count", "60", "--seed", "3", "--bad-every", "3", "--large-every", "59"]) == 0
