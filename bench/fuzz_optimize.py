"""Fuzzing `bnfuse optimize`: mutated small models, each optimized with a time limit, outcomes counted.

    python bench/fuzz_optimize.py [--count 10000] [--seed 1] [--timeout 60] [--json counts.json]

Seed models are small but cover the paths (weights mapped or inline, Conv / ConvTranspose / Gemm / MatMul,
a trailing Mul + Add, an If branch, a model keeping its weights as external data). Each case mutates one
seed, either at the byte level (bit flips, overwritten / inserted / deleted runs, truncation) or at the
protobuf field level (dims, types, data fields, external-data entries, names, attributes, opsets, BN
statistics), then runs ``bnfuse optimize`` on it. Outcomes:

- ``exit 0, equal``: written, and the output computes what the input computes in onnxruntime;
- ``exit 0, input not runnable``: written, but onnxruntime cannot run the mutated input to compare;
- ``exit 1`` / ``exit 2``: the check failed / the input was refused, with exactly one line on stderr;
- anything else is a defect: a traceback, more than one line, another exit code, an output that differs
  or does not run, a run past the time limit (a hang), the input's files changed, a stray file left.

This driver runs the cases in a long-lived worker process (``--worker``) that calls the CLI's ``main`` in
process, restarted after a hang; tests/test_fuzz_optimize.py runs a few hundred cases, each in its own
``bnfuse optimize`` subprocess.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import select
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
OK_OUTCOMES = ("exit 0, equal", "exit 0, input not runnable", "exit 1", "exit 2")


# --- seed models ---------------------------------------------------------------------------------


def _bn_params(rng: np.random.Generator, channels: int, prefix: str) -> list[TensorProto]:
    return [
        numpy_helper.from_array(rng.uniform(0.5, 1.5, channels).astype(np.float32), f"{prefix}.scale"),
        numpy_helper.from_array(rng.normal(0, 0.1, channels).astype(np.float32), f"{prefix}.bias"),
        numpy_helper.from_array(rng.normal(0, 0.1, channels).astype(np.float32), f"{prefix}.mean"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, channels).astype(np.float32), f"{prefix}.var"),
    ]


def _bn(prefix: str, x: str, y: str) -> onnx.NodeProto:
    names = [f"{prefix}.{p}" for p in ("scale", "bias", "mean", "var")]
    return helper.make_node("BatchNormalization", [x, *names], [y], name=prefix, epsilon=1e-5)


def _model(graph: onnx.GraphProto, opset: int = 17) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def seed_models() -> dict[str, onnx.ModelProto]:
    """Small models, one per path through the pass (built with onnx directly: milliseconds)."""
    rng = np.random.default_rng(0)
    x4 = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 6, 6])
    conv = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            _bn("bn", "c", "b"),
            helper.make_node("Relu", ["b"], ["r"], name="relu"),
            helper.make_node("Conv", ["r", "w2"], ["c2"], name="conv2"),
            _bn("bn2", "c2", "y"),
        ],
        "conv",
        [x4],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16, 6, 6])],
        [
            numpy_helper.from_array(rng.normal(0, 0.3, (32, 8, 3, 3)).astype(np.float32), "w"),  # 9 KiB: mapped
            numpy_helper.from_array(rng.normal(0, 0.3, (16, 32, 1, 1)).astype(np.float32), "w2"),
            *_bn_params(rng, 32, "bn"),
            *_bn_params(rng, 16, "bn2"),
        ],
    )
    transpose = helper.make_graph(
        [
            helper.make_node("ConvTranspose", ["x", "wt"], ["t"], name="deconv", strides=[2, 2]),
            _bn("bn", "t", "b"),
            helper.make_node("Mul", ["b", "k"], ["m"], name="mul"),
            helper.make_node("Add", ["m", "a"], ["y"], name="add"),
        ],
        "transpose",
        [x4],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 12, 13, 13])],
        [
            numpy_helper.from_array(rng.normal(0, 0.3, (8, 12, 3, 3)).astype(np.float32), "wt"),
            *_bn_params(rng, 12, "bn"),
            numpy_helper.from_array(rng.uniform(0.5, 2, (1, 12, 1, 1)).astype(np.float32), "k"),
            numpy_helper.from_array(rng.normal(0, 1, (1, 12, 1, 1)).astype(np.float32), "a"),
        ],
    )
    gemm = helper.make_graph(
        [
            helper.make_node("Gemm", ["v", "g", "gb"], ["h"], name="gemm", transB=1),
            _bn("bn", "h", "hb"),
            helper.make_node("MatMul", ["hb", "mm"], ["p"], name="matmul"),
            _bn("bn2", "p", "y"),
        ],
        "gemm",
        [helper.make_tensor_value_info("v", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 24])],
        [
            numpy_helper.from_array(rng.normal(0, 0.2, (48, 64)).astype(np.float32), "g"),
            numpy_helper.from_array(rng.normal(0, 0.2, 48).astype(np.float32), "gb"),
            numpy_helper.from_array(rng.normal(0, 0.2, (48, 24)).astype(np.float32), "mm"),
            *_bn_params(rng, 48, "bn"),
            *_bn_params(rng, 24, "bn2"),
        ],
    )
    branch = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="inner_conv"), _bn("bn", "c", "z")],
        "then",
        [],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
    )
    other = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["z2"], name="plain_conv")],
        "else",
        [],
        [helper.make_tensor_value_info("z2", TensorProto.FLOAT, None)],
    )
    conditional = helper.make_graph(
        [helper.make_node("If", ["flag"], ["y"], name="if", then_branch=branch, else_branch=other)],
        "conditional",
        [x4, helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(rng.normal(0, 0.3, (4, 8, 3, 3)).astype(np.float32), "w"),
            *_bn_params(rng, 4, "bn"),
        ],
    )
    return {
        "conv": _model(conv),
        "transpose": _model(transpose, 13),
        "gemm": _model(gemm, 15),
        "if": _model(conditional),
    }


def write_seed(name: str, model: onnx.ModelProto, directory: Path, *, external: bool = False) -> list[Path]:
    """The seed's files in ``directory``: the model, and its data file when ``external``."""
    path = directory / f"{name}.onnx"
    if external:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)  # onnx.save_model moves the tensors of the model it saves out to the file
        onnx.save_model(copy, str(path), save_as_external_data=True, location=f"{name}.onnx.data", size_threshold=256)
        data = directory / f"{name}.onnx.data"
        return [path, data] if data.exists() else [path]
    path.write_bytes(model.SerializeToString())
    return [path]


# --- mutations -----------------------------------------------------------------------------------


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """One to three byte-level edits."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        if not out:
            out += rng.randbytes(rng.randint(1, 16))
            continue
        kind = rng.choice(("flip", "overwrite", "insert", "delete", "truncate", "duplicate", "varint"))
        at = rng.randrange(len(out))
        if kind == "flip":
            out[at] ^= 1 << rng.randrange(8)
        elif kind == "overwrite":
            run = rng.randbytes(rng.randint(1, 8))
            out[at : at + len(run)] = run
        elif kind == "insert":
            out[at:at] = rng.randbytes(rng.randint(1, 16))
        elif kind == "delete":
            del out[at : at + rng.randint(1, 16)]
        elif kind == "truncate":
            del out[at:]
        elif kind == "duplicate":
            end = min(len(out), at + rng.randint(1, 64))
            out[end:end] = out[at:end]
        else:  # a varint byte: length prefixes and dims live there
            out[at] = rng.choice((0x00, 0x7F, 0x80, 0xFF))
    return bytes(out)


_LOCATIONS = (
    "bnfuse-payload:0",
    "bnfuse-payload:7",
    "../outside.data",
    "/etc/hostname",
    "/dev/zero",
    "",
    "sub/../../x.data",
    "nonexistent.data",
    "a\\..\\b.data",
    "x" * 300,
)
_DIMS = (-1, 0, 1, 2, 3, 7, 2**31, 2**62, 2**63 - 1)
_FLOATS = (float("nan"), float("inf"), -float("inf"), -1.0, 0.0, 1e-45, 3e38, 1.0)
_OPS = ("Conv", "BatchNormalization", "Gemm", "MatMul", "Mul", "Add", "Relu", "Identity", "If", "Bogus", "")


def _tensors(model: onnx.ModelProto) -> list[TensorProto]:
    from onnx import external_data_helper

    return list(external_data_helper._get_all_tensors(model))


def _nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    nodes = list(graph.node)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                nodes += _nodes(attr.g)
    return nodes


def _mutate_tensor(model: onnx.ModelProto, rng: random.Random) -> None:
    tensor = rng.choice(_tensors(model))
    kind = rng.randrange(10)
    if kind == 0 and tensor.dims:
        tensor.dims[rng.randrange(len(tensor.dims))] = rng.choice(_DIMS)
    elif kind == 1:
        tensor.data_type = rng.randrange(30)
    elif kind == 2:
        raw = tensor.raw_data
        tensor.raw_data = raw[: rng.randrange(len(raw) + 1)] if rng.random() < 0.5 else raw + rng.randbytes(4)
    elif kind == 3:
        tensor.float_data.extend(rng.choice(_FLOATS) for _ in range(rng.choice((1, 4, 48, 2000))))
    elif kind == 4:
        tensor.int64_data.extend([rng.choice(_DIMS)])
    elif kind == 5:
        tensor.data_location = TensorProto.EXTERNAL
        del tensor.external_data[:]
        tensor.external_data.add(key="location", value=rng.choice(_LOCATIONS))
    elif kind == 6:
        for entry in tensor.external_data:
            if rng.random() < 0.5:
                entry.value = rng.choice(("-1", "x", "0", "4", "999999999999", str(2**64), *_LOCATIONS))
        if not tensor.external_data:
            tensor.dims.append(rng.choice(_DIMS))
    elif kind == 7:
        tensor.name = rng.choice(("", "x" * 300, "y", "w", "bn.var", "ü" * 5))
    elif kind == 8 and tensor.dims:
        del tensor.dims[rng.randrange(len(tensor.dims))]
    else:
        tensor.ClearField("raw_data")


def _mutate_statistics(model: onnx.ModelProto, rng: random.Random) -> None:
    candidates = [t for t in model.graph.initializer if t.name.endswith((".var", ".scale", ".mean"))]
    if not candidates:
        return _mutate_tensor(model, rng)
    tensor = rng.choice(candidates)
    try:
        values = numpy_helper.to_array(tensor).copy()
    except Exception:  # already broken by an earlier edit, or external: edit its fields instead
        return _mutate_tensor(model, rng)
    if values.size:
        values.reshape(-1)[rng.randrange(values.size)] = rng.choice(_FLOATS)
        if rng.random() < 0.3:  # a signalling NaN
            values.view(np.uint32).reshape(-1)[0] = 0x7F800001
    tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
    return None


def _mutate_node(model: onnx.ModelProto, rng: random.Random) -> None:
    nodes = _nodes(model.graph)
    if not nodes:
        return
    node = rng.choice(nodes)
    kind = rng.randrange(8)
    if kind == 0:
        node.op_type = rng.choice(_OPS)
    elif kind == 1 and node.input:
        del node.input[rng.randrange(len(node.input))]
    elif kind == 2:
        node.input.append(rng.choice(("", "x", "w", "missing")))
    elif kind == 3 and node.output:
        node.output[0] = rng.choice(("x", "y", "c", "w", "", "z" * 300))
    elif kind == 4:
        node.attribute.append(helper.make_attribute(rng.choice(("epsilon", "momentum", "bogus")), rng.choice(_FLOATS)))
    elif kind == 5:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.FLOAT:
                attr.f = rng.choice(_FLOATS)
            elif attr.type == onnx.AttributeProto.INTS and attr.ints:
                attr.ints[0] = rng.choice(_DIMS)
            elif attr.type == onnx.AttributeProto.INT:
                attr.i = rng.choice(_DIMS)
    elif kind == 6:
        node.domain = rng.choice(("", "ai.onnx", "com.microsoft", "bnfuse", "x"))
    else:
        node.name = rng.choice(("", "n" * 300, "bn", "conv"))


def _mutate_graph(model: onnx.ModelProto, rng: random.Random) -> None:
    graph = model.graph
    kind = rng.randrange(8)
    if kind == 0 and graph.node:
        del graph.node[rng.randrange(len(graph.node))]
    elif kind == 1 and graph.initializer:
        del graph.initializer[rng.randrange(len(graph.initializer))]
    elif kind == 2 and len(graph.node) > 1:
        nodes = list(graph.node)
        rng.shuffle(nodes)
        del graph.node[:]
        graph.node.extend(nodes)
    elif kind == 3 and graph.input:
        dims = graph.input[0].type.tensor_type.shape.dim
        if dims:
            dims[rng.randrange(len(dims))].dim_value = rng.choice(_DIMS[:7])
    elif kind == 4:
        model.opset_import[0].version = rng.choice((0, 1, 6, 7, 9, 13, 17, 23, 26, 1000))
    elif kind == 5:
        model.ir_version = rng.choice((0, 1, 3, 4, 7, 10, 13, 14, 100))
    elif kind == 6 and graph.output:
        graph.output[0].name = rng.choice(("", "x", "o" * 300, "b"))
    else:
        graph.initializer.append(rng.choice(list(graph.initializer) or [TensorProto(name="w")]))


PROTO_MUTATIONS: tuple[Callable[[onnx.ModelProto, random.Random], None], ...] = (
    _mutate_tensor,
    _mutate_tensor,
    _mutate_statistics,
    _mutate_node,
    _mutate_graph,
)


def mutate_model(model: onnx.ModelProto, rng: random.Random) -> onnx.ModelProto:
    """One or two protobuf-field-level edits of a copy of ``model``."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for _ in range(rng.randint(1, 2)):
        rng.choice(PROTO_MUTATIONS)(copy, rng)
    return copy


@dataclass
class Case:
    """One mutated input: its files (model first) in its own directory, and the CLI arguments."""

    directory: Path
    files: list[Path]
    argv: list[str]
    label: str


def make_case(index: int, seed: int, root: Path, seeds: dict[str, onnx.ModelProto]) -> Case:
    """Case ``index`` of run ``seed``: a seed model, mutated at the byte or the field level."""
    rng = random.Random(f"{seed}:{index}")
    name = rng.choice(sorted(seeds))
    external = rng.random() < 0.25
    directory = root / f"case{index}"
    directory.mkdir(parents=True)
    files = write_seed(name, seeds[name], directory, external=external)
    level = "bytes" if rng.random() < 0.5 else "fields"
    if level == "bytes":
        target = files[0] if len(files) == 1 or rng.random() < 0.7 else files[1]
        target.write_bytes(mutate_bytes(target.read_bytes(), rng))
    else:
        model = onnx.load(str(files[0]), load_external_data=False)
        files[0].write_bytes(mutate_model(model, rng).SerializeToString())
    output = directory / "out" / f"{name}.opt.onnx"
    argv = ["optimize", str(files[0]), "-o", str(output)]
    if rng.random() < 0.3:
        argv.append("--check")
    if rng.random() < 0.2:
        argv += ["--json", str(directory / "out" / "report.json")]
    return Case(directory, files, argv, f"{name}{' (external)' if external else ''} {level}")


# --- judging -------------------------------------------------------------------------------------


def digests(files: list[Path]) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else "" for p in files}


def judge(case: Case, code: int | None, stderr: str, before: dict[str, str]) -> tuple[str, str]:
    """(outcome, detail) of a finished run; outcomes outside OK_OUTCOMES are defects."""
    if code is None:
        return "hang", "ran past the time limit"
    if digests(case.files) != before:
        return "input changed", ""
    lines = stderr.strip().splitlines()
    if "Traceback" in stderr:
        return "traceback", lines[-1] if lines else ""
    out_dir = case.directory / "out"
    written = sorted(p.name for p in out_dir.iterdir()) if out_dir.exists() else []
    if code in (1, 2):
        if len(lines) != 1:
            return "not one line", " | ".join(lines[:3])
        stray = sorted(set(p.name for p in case.directory.iterdir()) - {p.name for p in case.files} - {"out"})
        if written or stray:
            return "file left behind", ", ".join(written + stray)
        return f"exit {code}", lines[0]
    if code != 0:
        return f"exit {code}", " | ".join(lines[:3])
    if lines:
        return "noise on stderr", " | ".join(lines[:3])
    output = Path(case.argv[case.argv.index("-o") + 1])
    return compare_in_onnxruntime(case.files[0], output)


def compare_in_onnxruntime(source: Path, output: Path) -> tuple[str, str]:
    """Whether the written model computes what the input computes, on seeded random inputs."""
    import onnxruntime as ort

    ort.set_default_logger_severity(4)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    try:
        original = ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
        feeds = _feeds(original)
        want = original.run(None, feeds)
    except Exception as exc:  # the mutated input itself does not run: nothing to compare against
        return "exit 0, input not runnable", _one_line(exc)
    try:
        optimized = ort.InferenceSession(str(output), options, providers=["CPUExecutionProvider"])
        got = optimized.run(None, feeds)
    except Exception as exc:
        return "output does not run", _one_line(exc)
    for expected, actual in zip(want, got, strict=True):
        expected, actual = np.asarray(expected), np.asarray(actual)
        if expected.shape != actual.shape or expected.dtype != actual.dtype:
            return "output differs", f"{expected.shape} {expected.dtype} vs {actual.shape} {actual.dtype}"
        if expected.dtype.kind == "f":
            expected, actual = expected.astype(np.float64), actual.astype(np.float64)
            both = np.isfinite(expected) & np.isfinite(actual)
            scale = float(np.max(np.abs(expected[both]), initial=0.0))
            close = np.isclose(actual, expected, rtol=1e-4, atol=1e-4 * scale, equal_nan=True)
            # A value at float32's edge may overflow in one rounding of the weights and not in the other.
            edge = ~both & (np.maximum(np.abs(np.nan_to_num(expected)), np.abs(np.nan_to_num(actual))) > 1e36)
            if not (close | edge).all():
                where = ~(close | edge)
                return "output differs", f"{int(where.sum())} values, e.g. {expected[where][0]} vs {actual[where][0]}"
        elif not np.array_equal(actual, expected):
            return "output differs", "integer outputs differ"
    return "exit 0, equal", ""


def _feeds(session: object) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for info in session.get_inputs():  # type: ignore[attr-defined]
        shape = [d if isinstance(d, int) and d >= 0 else 2 for d in info.shape]
        kind = info.type.removeprefix("tensor(").removesuffix(")")
        if kind == "bool":
            feeds[info.name] = np.array(rng.random() < 0.5).reshape(shape) if not shape else rng.random(shape) < 0.5
        else:
            dtype = {"float": np.float32, "double": np.float64, "float16": np.float16}.get(kind, np.float32)
            feeds[info.name] = rng.normal(0, 1, shape).astype(dtype)
    return feeds


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


# --- running: a long-lived worker, restarted after a hang ----------------------------------------


def worker() -> None:
    """Read one JSON argv per line on stdin, run the CLI in process, answer {code, stderr} per line."""
    from bnfuse.cli import main

    for line in sys.stdin:
        argv = json.loads(line)
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 2
            except BaseException:  # what the CLI let escape: a defect, reported as the traceback it would print
                traceback.print_exc()
                code = 1
        print(json.dumps({"code": code, "stderr": err.getvalue()}), flush=True)


class Worker:
    """A ``--worker`` process; ``run`` gives None (and restarts it) when a case passes the time limit."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None

    def run(self, argv: list[str], timeout: float) -> tuple[int | None, str]:
        if self._process is None or self._process.poll() is not None:
            env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            self._process = subprocess.Popen(
                [sys.executable, __file__, "--worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
        process = self._process
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(argv) + "\n")
        process.stdin.flush()
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        if not ready:
            self.close()
            return None, ""
        line = process.stdout.readline()
        if not line:  # the worker died (a crash in native code): report it as a traceback-like defect
            self.close()
            return 139, "Traceback: worker process died"
        answer = json.loads(line)
        return answer["code"], answer["stderr"]

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None


def run_cases(count: int, seed: int, timeout: float, progress: bool = True) -> tuple[Counter[str], list[str]]:
    """Run ``count`` cases in a worker; the outcome counts and one line per defect."""
    seeds = seed_models()
    counts: Counter[str] = Counter()
    defects: list[str] = []
    runner = Worker()
    root = Path(tempfile.mkdtemp(prefix="bnfuse-fuzz-"))
    started = time.time()
    try:
        for index in range(count):
            case = make_case(index, seed, root, seeds)
            before = digests(case.files)
            code, stderr = runner.run(case.argv, timeout)
            outcome, detail = judge(case, code, stderr, before)
            counts[outcome] += 1
            if outcome not in OK_OUTCOMES:
                defects.append(f"case {index} ({case.label}): {outcome}: {detail}")
                print(defects[-1], file=sys.stderr, flush=True)
            shutil.rmtree(case.directory, ignore_errors=True)
            if progress and (index + 1) % 500 == 0:
                print(f"{index + 1}/{count} in {time.time() - started:.0f} s: {dict(counts)}", file=sys.stderr)
    finally:
        runner.close()
        shutil.rmtree(root, ignore_errors=True)
    return counts, defects


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per case before it counts as a hang")
    parser.add_argument("--json", help="write the counts and defects here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return 0
    started = time.time()
    counts, defects = run_cases(args.count, args.seed, args.timeout)
    elapsed = time.time() - started
    summary = {"count": args.count, "seed": args.seed, "seconds": round(elapsed), "outcomes": dict(counts)}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "defects": defects}, indent=1))
    return 1 if defects else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
