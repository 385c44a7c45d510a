"""Run by test_native.py in a fresh interpreter that never imports bnfuse: fuzzes the native library at argv[1] over
attributes (valid and not, of the right type and not) and input shapes (ranks 0 to 9, sizes 0 to 5, parameters of
the right shape and not). Every session creation and every run either succeeds with outputs of the expected shapes
or raises an onnxruntime error naming the op; the process never crashes and a refused run leaves the session usable.
Prints the counts."""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

OPS = {
    "BatchNormalizationInference": (["X", "scale", "B", "mean", "var"], ["Y"]),
    "BatchNormalizationTraining": (["X", "scale", "B", "input_mean", "input_var"], ["Y", "rm", "rv", "sm", "sis"]),
    "BatchNormalizationGrad": (["dY", "X", "scale", "saved_mean", "saved_inv_std"], ["dX", "dScale", "dBias"]),
}
VALUES = {
    "epsilon": [1e-5, 0.0, -1.0, 2.0, float("nan"), 1, "x"],
    "momentum": [0.1, 0.9, -0.5, 1.5, 1.0, 0, [0.1, 0.2]],
    "axis": [1, -1, 2, 0, 5, -9, 1.0],
    "mode": ["spatial", "per_activation", "PER_ACTIVATION", "bogus", 0],
    "momentum_convention": ["onnx", "pytorch", "mindspore", "keras", 3],
    "unbiased_running_var": [0, 1, 2, -1],
    "fix_gamma": [0, 1, 5],
    "use_global_stats": [0, 1, -3],
    "activation": ["none", "relu", "gelu", 1],
}


def model(op: str, attributes: dict) -> bytes:
    inputs, outputs = OPS[op]
    if op.endswith("Grad") and attributes.get("activation") == "relu":
        inputs = [*inputs, "Y"]
    node = helper.make_node(op, inputs, outputs, domain="bnfuse", name="fuzz", **attributes)
    graph = helper.make_graph(
        [node], "fuzz",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
    )  # fmt: skip
    made = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("bnfuse", 1)])
    made.ir_version = 9
    return made.SerializeToString()


def feeds(session: ort.InferenceSession, rng: np.random.Generator, valid: bool, attributes: dict) -> dict:
    names = [i.name for i in session.get_inputs()]
    rank = int(rng.integers(2, 5)) if valid else int(rng.integers(0, 10))
    x_shape = tuple(int(d) for d in rng.integers(0 if not valid else 1, 5, rank))
    per_activation = str(attributes.get("mode", "spatial")).lower() == "per_activation"
    axis = attributes.get("axis", 1) if isinstance(attributes.get("axis", 1), int) else 1
    if per_activation:
        p_shape = x_shape[1:]
    else:
        p_shape = (x_shape[axis % rank],) if rank else ()
    if not valid and rng.random() < 0.5:
        p_shape = tuple(int(d) for d in rng.integers(0, 5, int(rng.integers(0, 3))))
    data = {"X", "dY", "Y"}
    return {n: np.asarray(rng.standard_normal(x_shape if n in data else p_shape) + 2.0, np.float32) for n in names}


def main() -> None:
    library, count = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(33)
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.log_severity_level = 4
    created = refused_creation = ran = refused_run = 0
    while ran + refused_run < count:
        op = str(rng.choice(list(OPS)))
        attributes = {k: v[int(rng.integers(len(v)))] for k, v in VALUES.items() if rng.random() < 0.4}
        try:
            session = ort.InferenceSession(model(op, attributes), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - onnxruntime's exception types vary by release
            assert op in str(exc) or "fuzz" in str(exc), str(exc)
            refused_creation += 1
            continue
        created += 1
        last_good = None
        for _ in range(40):
            valid = rng.random() < 0.5
            given = feeds(session, rng, valid, attributes)
            try:
                outputs = session.run(None, given)
            except Exception as exc:  # noqa: BLE001
                assert op in str(exc) or "bnfuse" in str(exc), str(exc)
                refused_run += 1
                continue
            x = given["X"]
            assert outputs[0].shape == x.shape, (op, attributes, outputs[0].shape, x.shape)
            ran += 1
            last_good = given
        if last_good is not None:
            session.run(None, last_good)  # still usable after whatever was refused
    print(f"created {created} refused {refused_creation} ran {ran} refused runs {refused_run}")


if __name__ == "__main__":
    main()
