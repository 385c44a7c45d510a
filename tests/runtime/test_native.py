"""The native custom-op library (bnfuse/runtime/native/) on its own: registered in a process that never imports bnfuse,
every CPU op against the float64 reference; no libpython, no Python symbol; built without Python by its Makefile;
its generated schema header and its OrtApi indices up to date."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from bnfuse.runtime import conv_grad, library_path, ops, reference, schema
from bnfuse.runtime.ortabi.api import API_INDEX
from bnfuse.runtime.semantics import BatchNormConfig

NATIVE = Path(schema.__file__).resolve().parent / "native"
CHILD = Path(__file__).with_name("native_child.py")


def test_schema_header_is_generated_from_schema_py() -> None:
    assert (NATIVE / "schema.h").read_text() == schema.c_header(), "run `python -m bnfuse.runtime.schema`"


def test_ort_api_indices_match_the_table_order() -> None:
    declared = dict(re.findall(r"ORT_API_(\w+) = (\d+),\n", (NATIVE / "ort_api.h").read_text()))
    assert declared, "no indices found in ort_api.h"
    for name, index in declared.items():
        assert API_INDEX[name] == int(index), name


def test_schema_matches_the_python_ops() -> None:
    for name in ops.OP_NAMES:
        op = schema.BY_NAME[name]
        assert tuple(v.name for v in op.inputs) == ops.INPUT_NAMES[name] + ops.OPTIONAL_INPUT_NAMES[name]
        assert tuple(v.name for v in op.outputs) == ops.OUTPUT_NAMES[name]
        assert op.defaults == ops.ATTRIBUTES[name]


def test_schema_shape_rules() -> None:
    training, grad = schema.BN_TRAINING, schema.BN_GRAD
    assert schema.bn_output_shapes(training, {}, [(4, 3, 5)] + [(3,)] * 4)[:3] == [(4, 3, 5), (3,), (3,)]
    assert schema.bn_output_shapes(training, {"axis": -1}, [(4, 5, 3)])[1] == (3,)
    assert schema.bn_output_shapes(grad, {"mode": b"per_activation"}, [(4, 3, 5), (4, 3, 5)]) == [
        (4, 3, 5), (3, 5), (3, 5)
    ]  # fmt: skip
    assert schema.bn_output_shapes(grad, {}, [(4, 3), None]) == [None, None, None]  # X unknown
    conv = {"kernel_shape": [3, 2], "group": 2}
    assert schema.output_shapes("ConvWeightGrad", conv, [(5, 4, 9, 9), (5, 6, 7, 8)]) == [(6, 2, 3, 2)]
    assert schema.output_shapes("ConvInputGrad", conv | {"output_shape": [9, 9]}, [(5, 6, 7, 8), (6, 2, 3, 2)]) == [
        (5, 4, 9, 9)
    ]


def test_schema_type_rules() -> None:
    """Data outputs (T) take X's element type, the statistics (U) the parameters': float16 data with float32
    statistics (BN_TYPE_PAIRS), and None where the input that decides is unknown."""
    half, single = schema.FLOAT16, schema.FLOAT
    training, grad = schema.BN_TRAINING.name, schema.BN_GRAD.name
    assert schema.output_element_types(training, [half, single, single, single, single]) == [half] + [single] * 5
    assert schema.output_element_types(grad, [half, half, single, single, single, half]) == [half, single, single]
    assert schema.output_element_types("ConvWeightGrad", [None, half]) == [half]
    assert schema.output_element_types(training, [half]) == [half] + [None] * 5


@pytest.mark.skipif(shutil.which("ldd") is None or shutil.which("nm") is None, reason="needs ldd and nm")
def test_library_needs_no_python() -> None:
    path = library_path()
    linked = subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout
    assert "python" not in linked.lower(), linked
    undefined = subprocess.run(["nm", "-D", "--undefined-only", path], capture_output=True, text=True, check=True)
    assert not [s for s in undefined.stdout.split() if s.startswith(("Py", "_Py"))], undefined.stdout
    exported = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True)
    names = {line.split()[-1] for line in exported.stdout.splitlines() if line.split()}
    assert "RegisterCustomOps" in names
    assert all(n == "RegisterCustomOps" or n.startswith(("bnfuse_", "_")) for n in names), names  # exports.map


# -- the cases, with their expected values from reference.py (float64) --------------------------------------------

CODES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}
SMALL, POOLED, ROWS_POOLED = (4, 3, 5, 6), (8, 32, 64, 72), (4, 64, 80, 64)  # serial, pooled channels / rows


def _bn_cases() -> list[tuple[str, tuple[int, ...], tuple, dict]]:
    cases = []
    pairs = [(np.float32, np.float32), (np.float16, np.float16), (np.float16, np.float32)]
    layouts = [(SMALL, {}), ((4, 5, 6, 3), {"axis": -1}), ((6, 4, 3), {"mode": "per_activation"}), ((7, 5), {})]
    variants = [
        {},
        {"fix_gamma": 1},
        {"use_global_stats": 1},
        {"unbiased_running_var": 1, "momentum_convention": "pytorch", "momentum": 0.25},
        {"activation": "relu"},
    ]
    for op in ops.OP_NAMES:
        for pair in pairs:
            for shape, layout in layouts:
                cases.append((op, shape, pair, layout))
        for variant in variants:
            attributes = {k: v for k, v in variant.items() if k in ops.ATTRIBUTES[op]}
            if attributes or not variant:
                cases.append((op, SMALL, pairs[0], attributes))
                cases.append((op, POOLED, pairs[0], attributes))
        cases.append((op, ROWS_POOLED, pairs[0], {"axis": -1}))
        cases.append((op, (0, 3, 4), pairs[0], {}))  # empty batch
        cases.append(
            (op, SMALL, pairs[2], {"mode": "per_activation"} | ({"activation": "relu"} if op != ops.INFERENCE else {}))
        )
    return cases


def _config(op: str, attributes: dict) -> BatchNormConfig:
    values = {k: v for k, v in attributes.items()}
    for name in ("fix_gamma", "use_global_stats", "unbiased_running_var"):
        if name in values:
            values[name] = bool(values[name])
    for name in ("momentum", "epsilon"):
        if name in values:
            values[name] = float(np.float32(values[name]))
    return BatchNormConfig(**values)


def _bn_case(op: str, shape: tuple[int, ...], pair: tuple, attributes: dict, rng: np.random.Generator) -> dict:
    data, param = np.dtype(pair[0]), np.dtype(pair[1])
    config = _config(op, attributes)
    from bnfuse.runtime.semantics import param_shape

    p_shape = param_shape(config, shape)
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(data)
    scale = (rng.random(p_shape) + 0.5).astype(param)
    bias = rng.standard_normal(p_shape).astype(param)
    relu = attributes.get("activation") == "relu"
    f64 = {"x": x.astype(np.float64), "scale": scale.astype(np.float64), "bias": bias.astype(np.float64)}
    if op == ops.GRAD:
        dy = rng.standard_normal(shape).astype(data)
        axes = tuple(range(1)) if config.mode.value == "per_activation" else None
        reduce = axes if axes is not None else tuple(a for a in range(len(shape)) if a != (config.axis % len(shape)))
        mean = (x.astype(np.float64).mean(reduce) if x.size else np.zeros(p_shape)).astype(param)
        var = x.astype(np.float64).var(reduce) if x.size else np.ones(p_shape)
        inv_std = (1.0 / np.sqrt(var + 1e-5)).astype(param)
        inputs = [dy, x, scale, mean, inv_std]
        y = None
        if relu:
            y = rng.standard_normal(shape).astype(data)
            inputs.append(y)
        want = reference.backward(
            dy.astype(np.float64), f64["x"], f64["scale"], mean.astype(np.float64), inv_std.astype(np.float64),
            config, None if y is None else y.astype(np.float64),
        )  # fmt: skip
        outputs = list(want)
    else:
        mean = rng.standard_normal(p_shape).astype(param)
        var = (rng.random(p_shape) + 0.5).astype(param)
        inputs = [x, scale, bias, mean, var]
        args = (*f64.values(), mean.astype(np.float64), var.astype(np.float64), config)
        if op == ops.INFERENCE:
            outputs = [reference.forward_inference(*args)]
        else:
            outputs = list(reference.forward_training(*args))
    if not x.size:  # an empty batch: the running statistics pass through, every other per-channel output is zero
        running = [mean, var] if op == ops.TRAINING else []
        outputs = [np.zeros(shape), *running, *[np.zeros(p_shape)] * (len(outputs) - 1 - len(running))]
    model = ops.single_op_model(op, data_dtype=data, param_dtype=param, outputs=len(outputs), **attributes)
    names = [i.name for i in model.graph.input]
    half = np.dtype(np.float16) in (data, param)
    return {
        "model": model.SerializeToString(),
        "inputs": dict(zip(names, inputs, strict=True)),
        "outputs": [np.asarray(o, np.float64) for o in outputs],
        "tolerance": 2e-2 if half else 2e-4,
        "label": f"{op} {shape} {data.name}/{param.name} {attributes}",
    }


def _step_case(op: str, rng: np.random.Generator) -> dict:
    """SGDStep (momentum, Nesterov, decay, lr scale) or AdamStep on three parameters, one of them pooled-size."""
    shapes = [(3, 4), (70000,), (5,)]
    adam = op == "AdamStep"
    states = 2 if adam else 1
    decays, scales = [0.0, 0.01, 0.1], [1.0, 0.5, 2.0]
    lead = ["step_size", "root"] if adam else ["lr"]
    feeds = {"step_size": np.float32(0.01), "root": np.float32(0.3)} if adam else {"lr": np.float32(0.1)}
    inputs, outputs, expected = list(lead), [], []
    f32 = np.float32
    for i, shape in enumerate(shapes):
        p, g = rng.standard_normal(shape).astype(f32), rng.standard_normal(shape).astype(f32)
        s = [np.abs(rng.standard_normal(shape)).astype(f32) for _ in range(states)]
        names = [f"p{i}", f"g{i}", *(f"s{i}_{k}" for k in range(states))]
        inputs += names
        feeds.update(zip(names, [p, g, *s], strict=True))
        outputs += [f"new_p{i}", *(f"new_s{i}_{k}" for k in range(states))]
        decay, scale = f32(decays[i]), f32(scales[i])
        d = g + p * decay if decays[i] else g
        if adam:
            rate = feeds["step_size"] * scale if scales[i] != 1.0 else feeds["step_size"]
            m = s[0] * f32(0.9) + d * f32(1 - f32(0.9))
            v = s[1] * f32(0.999) + (d * d) * f32(1 - f32(0.999))
            expected += [p - (m / (np.sqrt(v) / feeds["root"] + f32(1e-8))) * rate, m, v]
        else:
            rate = feeds["lr"] * scale if scales[i] != 1.0 else feeds["lr"]
            buffer = s[0] * f32(0.9) + d
            expected += [p - (d + buffer * f32(0.9)) * rate, buffer]
    attributes = {"weight_decays": decays, "lr_scales": scales}
    attributes |= {} if adam else {"momentum": 0.9, "nesterov": 1}
    node = helper.make_node(op, inputs, outputs, domain=ops.DOMAIN, name="step", **attributes)
    graph = helper.make_graph(
        [node], "step",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ops.DOMAIN, 1)])
    model.ir_version = 9
    return {
        "model": model.SerializeToString(),
        "inputs": feeds,
        "outputs": [np.asarray(e, np.float64) for e in expected],
        "tolerance": 1e-6,
        "label": f"{op} nesterov/decay/lr scales",
    }


CONV_CASES = [  # (X shape, W shape, strides, dilations, pads, group)
    ((2, 3, 9, 8), (4, 3, 3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 1),
    ((3, 4, 11, 10), (4, 2, 3, 2), (2, 1), (1, 2), (0, 1, 1, 0), 2),
    ((2, 6, 7, 7), (6, 1, 3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 6),  # depthwise
    ((4, 16, 12, 12), (8, 16, 1, 1), (2, 2), (1, 1), (0, 0, 0, 0), 1),
    ((2, 3, 17), (5, 3, 4), (2,), (1,), (1, 2), 1),  # 1-D
]


def _conv_case(index: int, input_grad: bool, rng: np.random.Generator) -> dict:
    """ConvWeightGrad / ConvInputGrad of one Conv against reference.py's float64 gradients."""
    x_shape, w_shape, strides, dilations, pads, group = CONV_CASES[index]
    spatial = len(x_shape) - 2
    kernel = w_shape[2:]
    out = tuple(
        (x_shape[2 + i] + pads[i] + pads[spatial + i] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1
        for i in range(spatial)
    )
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    dy = rng.standard_normal((x_shape[0], w_shape[0], *out)).astype(np.float32)
    attributes = {"kernel_shape": list(kernel), "strides": list(strides), "dilations": list(dilations),
                  "pads": list(pads), "group": group}  # fmt: skip
    if input_grad:
        names, feeds, op = ["dY", "W"], [dy, w], "ConvInputGrad"
        attributes["output_shape"] = list(x_shape[2:])
        want = reference.conv_input_grad(dy, w, x_shape[2:], strides, dilations, pads, group)
    else:
        names, feeds, op = ["X", "dY"], [x, dy], "ConvWeightGrad"
        want = reference.conv_weight_grad(x, dy, tuple(kernel), strides, dilations, pads, group)
    output = "dX" if input_grad else "dW"
    node = helper.make_node(op, names, [output], domain=ops.DOMAIN, name="conv", **attributes)
    graph = helper.make_graph(
        [node], op, [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ops.DOMAIN, 1)])
    model.ir_version = 9
    return {
        "model": model.SerializeToString(),
        "inputs": dict(zip(names, feeds, strict=True)),
        "outputs": [np.asarray(want, np.float64)],
        "tolerance": 1e-4,
        "label": f"{op} case {index}",
    }


def _python_hosted_bits(case: dict) -> dict:
    """The case's expected dW as the Python-hosted op computes it at 2 threads (conv_grad.weight_grad): the native
    op at BNFUSE_ONEDNN_THREADS=2 must give these bits."""
    x, dy = case["inputs"]["X"], case["inputs"]["dY"]
    node = onnx.load_from_string(case["model"]).graph.node[0]
    attributes = {a.name: list(helper.get_attribute_value(a)) for a in node.attribute if a.name != "group"}
    group = next(a.i for a in node.attribute if a.name == "group")
    geometry = conv_grad.Geometry(
        x.shape, dy.shape, tuple(attributes["kernel_shape"]), tuple(attributes["strides"]),
        tuple(attributes["dilations"]), tuple(attributes["pads"]), group,
    )  # fmt: skip
    with conv_grad.onednn_threads(2):
        want = conv_grad.weight_grad(x, dy, geometry)
    return {**case, "outputs": [want.astype(np.float64)], "tolerance": 0.0, "label": case["label"] + " (bits)"}


def _write_cases(directory: Path, cases: list[dict]) -> None:
    index = []
    for number, case in enumerate(cases):
        (directory / f"{number}.onnx").write_bytes(case["model"])
        arrays = {f"in_{k}": np.asarray(v) for k, v in case["inputs"].items()}
        arrays |= {f"out_{i}": v for i, v in enumerate(case["outputs"])}
        np.savez(directory / f"{number}.npz", **arrays)
        index.append({"label": case["label"], "tolerance": case["tolerance"], "outputs": len(case["outputs"])})
    (directory / "cases.json").write_text(json.dumps(index))


def _run_child(library: str, directory: Path, **environment: str) -> str:
    env = {**os.environ, **environment}
    done = subprocess.run(
        [sys.executable, str(CHILD), library, str(directory)], capture_output=True, text=True, timeout=400, env=env
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


def test_every_cpu_op_in_a_process_that_never_imports_bnfuse(tmp_path: Path) -> None:
    rng = np.random.default_rng(33)
    cases = [_bn_case(*case, rng) for case in _bn_cases()] + [_step_case(op, rng) for op in ("SGDStep", "AdamStep")]
    if conv_grad.available():
        cases += [_conv_case(i, grad, rng) for i in range(len(CONV_CASES)) for grad in (False, True)]
        cases += [_python_hosted_bits(_conv_case(i, False, rng)) for i in range(len(CONV_CASES))]
    _write_cases(tmp_path, cases)
    onednn = {"BNFUSE_ONEDNN_LIBRARY": str(conv_grad.library_path())} if conv_grad.available() else {}
    out = _run_child(library_path(), tmp_path, **onednn, BNFUSE_ONEDNN_THREADS="2")
    assert f"{len(cases)} cases passed" in out, out
    assert "bnfuse imported: False" in out, out


@pytest.mark.skipif(not conv_grad.available(), reason="needs oneDNN (onednn-cpu-gomp)")
def test_conv_gradients_without_onednn_fail_session_creation_with_one_message(tmp_path: Path) -> None:
    _write_cases(tmp_path, [_conv_case(0, False, np.random.default_rng(1))])
    script = (
        "import sys, onnxruntime as ort\n"
        "o = ort.SessionOptions(); o.register_custom_ops_library(sys.argv[1])\n"
        "try:\n"
        "    ort.InferenceSession(sys.argv[2], o, providers=['CPUExecutionProvider'])\n"
        "except Exception as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "BNFUSE_ONEDNN_LIBRARY": str(tmp_path / "no-libdnnl.so.3")}
    done = subprocess.run(
        [sys.executable, "-c", script, library_path(), str(tmp_path / "0.onnx")], capture_output=True, text=True,
        env=env, timeout=120,
    )  # fmt: skip
    assert "ConvWeightGrad needs oneDNN" in done.stdout and "BNFUSE_ONEDNN_LIBRARY" in done.stdout, done.stdout


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("cc") is None, reason="needs make and cc")
def test_the_makefile_builds_the_same_library_without_python(tmp_path: Path) -> None:
    built = tmp_path / "libbnfuse_ops.so"
    subprocess.run(["make", "-s", "-C", str(NATIVE), f"OUT={built}"], check=True, capture_output=True, timeout=300)
    rng = np.random.default_rng(7)
    cases = [_bn_case(ops.TRAINING, SMALL, (np.float32, np.float32), {}, rng), _step_case("AdamStep", rng)]
    _write_cases(tmp_path, cases)
    assert "2 cases passed" in _run_child(str(built), tmp_path)


def test_fuzz_attributes_and_shapes_never_crash() -> None:
    """10,000 runs over random attributes (valid and not, wrongly typed too) and shapes (ranks 0 to 9, empty
    dimensions, parameters of the wrong shape), in a process that never imports bnfuse: every creation and run
    succeeds with outputs of X's shape or fails with an error naming the op; the sessions stay usable."""
    fuzz = Path(__file__).with_name("native_fuzz_child.py")
    done = subprocess.run(
        [sys.executable, str(fuzz), library_path(), "10000"], capture_output=True, text=True, timeout=500
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    counts = dict(zip(*[iter(done.stdout.replace("refused runs", "refused_runs").split())] * 2, strict=True))
    assert int(counts["ran"]) + int(counts["refused_runs"]) >= 10000
    assert int(counts["ran"]) > 1000 and int(counts["refused_runs"]) > 1000  # both kinds really exercised
    assert int(counts["created"]) > 100 and int(counts["refused"]) > 100


@pytest.mark.parametrize("kind", ["mlp", "resnet"])
def test_a_training_graph_stepped_by_hand_without_bnfuse_equals_training_session(kind: str, tmp_path: Path) -> None:
    """The graph file is all a host needs: stepped by hand in a process that never imports bnfuse (the native ops,
    the convolution gradients on oneDNN at 1 thread), three steps give TrainingSession's losses and state, bit for
    bit (both at 1 intra-op thread; TrainingSession without its session-time NCHWc rewrite)."""
    pytest.importorskip("torch")
    import torch

    from bnfuse.passes.training import SGD, build_training_graph, read_spec
    from bnfuse.training.session import TrainingSession
    from tests.loaders import torch_nets

    nets = torch_nets()
    net, shape = nets.make(kind, seed=5)
    train_model, _ = build_training_graph(nets.export(net, torch.randn(*shape)), optimizer=SGD(momentum=0.9))
    spec = read_spec(train_model)
    used = {n.op_type for n in train_model.graph.node if n.domain == ops.DOMAIN}
    assert {ops.TRAINING, ops.GRAD, "SGDStep"} <= used
    if kind == "resnet" and conv_grad.available():
        assert {"ConvWeightGrad", "ConvInputGrad"} & used  # the native convolution gradients ran too
    batches = nets.batches(shape, 3, 3)  # the nets have at least 3 classes
    session = TrainingSession(train_model, lr=0.05, nchwc=False, intra_op_threads=1, weight_grad_threads=1)
    losses = [session.step(x, y) for x, y in batches]
    final = session.state()
    graph = tmp_path / "train.onnx"
    onnx.save(train_model, graph)
    arrays = {f"x{i}": x for i, (x, _) in enumerate(batches)} | {f"y{i}": y for i, (_, y) in enumerate(batches)}
    np.savez(tmp_path / "batches.npz", steps=len(batches), lr=np.array(0.05, np.float32), **arrays)
    env = {**os.environ, "BNFUSE_ONEDNN_THREADS": "1"}
    if conv_grad.available():
        env["BNFUSE_ONEDNN_LIBRARY"] = str(conv_grad.library_path())
    child = Path(__file__).with_name("native_step_child.py")
    done = subprocess.run(
        [sys.executable, str(child), library_path(), str(graph), str(tmp_path / "batches.npz"), str(tmp_path / "o")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "bnfuse imported: False" in done.stdout
    hosted = np.load(tmp_path / "o.npz")  # np.savez adds the suffix
    assert hosted["losses"].tolist() == losses
    for index, name in enumerate(spec.state):
        assert hosted[f"state_{index}"].tobytes() == np.asarray(final[name]).tobytes(), name
