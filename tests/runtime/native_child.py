"""Run by test_native.py in a fresh interpreter that must never import bnfuse: registers the library at argv[1] on
plain onnxruntime options and runs the cases in argv[2] (models, inputs, float64 expected values), then checks that
bad attributes and bad shapes give errors naming the op, with the session usable afterwards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

CPU = ["CPUExecutionProvider"]


def options(library: str, threads: int) -> ort.SessionOptions:
    made = ort.SessionOptions()
    made.intra_op_num_threads = threads
    made.register_custom_ops_library(library)
    return made


def run_cases(library: str, directory: Path) -> int:
    cases = json.loads((directory / "cases.json").read_text())
    for number, case in enumerate(cases):
        arrays = np.load(directory / f"{number}.npz")
        feeds = {k[3:]: arrays[k] for k in arrays.files if k.startswith("in_")}
        for threads in (1, 2):
            session = ort.InferenceSession(str(directory / f"{number}.onnx"), options(library, threads), providers=CPU)
            got = session.run(None, feeds)
            for index in range(case["outputs"]):
                want, have = arrays[f"out_{index}"], got[index].astype(np.float64)
                scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
                if have.shape != want.shape or not np.allclose(
                    have, want, rtol=case["tolerance"], atol=case["tolerance"] * scale, equal_nan=True
                ):
                    worst = float(np.max(np.abs(have - want))) if have.shape == want.shape else "shape"
                    raise AssertionError(f"{case['label']} output {index} ({threads} threads): off by {worst}")
    return len(cases)


def check_errors(library: str, directory: Path) -> None:
    """A bad attribute fails session creation; a bad shape fails the run; either names the op and the reason."""
    import onnx

    model = onnx.load(str(directory / "0.onnx"))
    node = model.graph.node[0]
    node.attribute.append(onnx.helper.make_attribute("axis", 1.5))
    try:
        ort.InferenceSession(model.SerializeToString(), options(library, 1), providers=CPU)
    except Exception as exc:  # noqa: BLE001 - onnxruntime's exception types vary by release
        assert f"{node.op_type}: attribute axis must be an int, got a float" in str(exc), str(exc)
    else:
        raise AssertionError("a float axis was accepted")
    arrays = np.load(directory / "0.npz")
    feeds = {k[3:]: arrays[k] for k in arrays.files if k.startswith("in_")}
    session = ort.InferenceSession(str(directory / "0.onnx"), options(library, 1), providers=CPU)
    name = next(iter(feeds))
    try:
        session.run(None, {**feeds, name: np.ones(3, feeds[name].dtype)})
    except Exception as exc:  # noqa: BLE001
        assert node.op_type in str(exc) and "shape" in str(exc), str(exc)
    else:
        raise AssertionError("a rank-1 X was accepted")
    session.run(None, feeds)  # still usable


def main() -> None:
    library, directory = sys.argv[1], Path(sys.argv[2])
    count = run_cases(library, directory)
    check_errors(library, directory)
    print(f"{count} cases passed")
    print(f"bnfuse imported: {any(name == 'bnfuse' or name.startswith('bnfuse.') for name in sys.modules)}")


if __name__ == "__main__":
    main()
