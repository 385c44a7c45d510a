"""bnfuse.runtime's public face: library_path(), session_options(), and failure without the compiled library."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import bnfuse.runtime as runtime
from bnfuse.errors import BnfuseError
from bnfuse.runtime import ops, reference, registry, sync_ops
from bnfuse.runtime.semantics import BatchNormConfig

REPO = Path(__file__).resolve().parents[2]


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, env=env
    )


def _inference_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 4)).astype(np.float32)
    params = [(rng.random(2) + 0.5).astype(np.float32) for _ in range(4)]
    return dict(zip(ops.INPUT_NAMES[ops.INFERENCE], (x, *params), strict=True))


def test_library_path_is_the_built_entry_library() -> None:
    path = Path(runtime.library_path())
    assert path.is_file() and path.name.startswith("_ortentry") and path.parent.name == "runtime"
    assert runtime.library_path() == str(path)


def test_register_custom_ops_library_by_hand() -> None:
    options = ort.SessionOptions()
    options.register_custom_ops_library(runtime.library_path())
    model = ops.single_op_model(ops.INFERENCE).SerializeToString()
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    feeds = _inference_feeds()
    (y,) = session.run(None, feeds)
    np.testing.assert_allclose(y, reference.forward_inference(*feeds.values(), BatchNormConfig()), rtol=1e-5)


def test_session_options_sets_attributes() -> None:
    options = runtime.session_options(
        intra_op_num_threads=1, execution_mode=ort.ExecutionMode.ORT_PARALLEL, log_severity_level=3
    )
    assert isinstance(options, ort.SessionOptions)
    assert options.intra_op_num_threads == 1 and options.execution_mode == ort.ExecutionMode.ORT_PARALLEL


def test_session_options_rejects_unknown_attribute() -> None:
    with pytest.raises(BnfuseError, match="onnxruntime.SessionOptions has no attribute 'intra_threads'"):
        runtime.session_options(intra_threads=1)


@pytest.mark.parametrize(
    "providers",
    [None, ["CPUExecutionProvider"], [("CPUExecutionProvider", {})], ["CUDAExecutionProvider", "CPUExecutionProvider"]],
)
def test_session_options_for_provider_lists(providers) -> None:
    """Any InferenceSession-style provider list works; CUDA kernels only where this onnxruntime has CUDA."""
    options = runtime.session_options(providers)
    model = ops.single_op_model(ops.INFERENCE).SerializeToString()
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    assert session.run(None, _inference_feeds())[0].shape == (3, 2, 4)


def test_registered_kernels_per_provider() -> None:
    specs = registry.op_specs(["CPUExecutionProvider"])
    bn_specs = [s for s in specs if isinstance(s, ops.OpSpec)]
    assert len(bn_specs) == len(ops.OP_NAMES) * len(ops.DTYPE_PAIRS)
    assert {s.name for s in specs if not isinstance(s, ops.OpSpec)} == set(sync_ops.SYNC_OP_NAMES)
    assert {(s.name, s.data_dtype, s.param_dtype) for s in bn_specs} == {
        (op, d, p) for op in ops.OP_NAMES for d, p in ops.DTYPE_PAIRS
    }
    both = registry.op_specs(["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert {s.provider for s in both} == {"CPUExecutionProvider", "CUDAExecutionProvider"}
    assert registry.op_specs(["CPUExecutionProvider"]) is specs  # the same structs every time


def test_library_without_bnfuse_python_side_registers_the_native_ops() -> None:
    """onnxruntime loading the library in a process where bnfuse never installed its hook: the native CPU ops are
    there (test_native.py runs every one of them), the Python-only ops are not, and nothing fails."""
    result = _run_python(
        f"""
        import sys
        import onnxruntime
        options = onnxruntime.SessionOptions()
        options.register_custom_ops_library({runtime.library_path()!r})
        print("registered", "bnfuse" in sys.modules)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "registered False" in result.stdout


def test_import_without_compiled_library_then_one_line_error() -> None:
    result = _run_python(
        """
        import importlib.machinery
        importlib.machinery.EXTENSION_SUFFIXES[:] = [".not-built.so"]  # as if the library was never built
        import bnfuse.runtime
        from bnfuse.errors import BnfuseError
        try:
            bnfuse.runtime.library_path()
        except BnfuseError as exc:
            print("BnfuseError:", exc)
        """
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("BnfuseError: bnfuse's onnxruntime entry library is not built in")
    assert "pip install -e ." in lines[0]


def test_cuda_execution_provider_matches_reference(monkeypatch) -> None:
    """The CUDA path, pinned to the GPU: inputs and outputs bound to OrtValues on 'cuda', so the kernel must
    see those device addresses (no host copies), launched on ORT's non-default compute stream. Needs
    onnxruntime-gpu, CuPy and a GPU."""
    cupy = pytest.importorskip("cupy")
    if "CUDAExecutionProvider" not in ort.get_available_providers() or cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("no CUDA execution provider or no GPU")
    cuda_kernels = ops.kernel_module(ops.CUDA)
    streams: list[int] = []

    class StreamNotingKernels:
        """The real CUDA kernels, noting the CuPy stream current when the op calls them."""

        @staticmethod
        def forward_training(*args, **kwargs):  # noqa: ANN002, ANN003, ANN205
            streams.append(cupy.cuda.get_current_stream().ptr)
            return cuda_kernels.forward_training(*args, **kwargs)

    kernel_module = ops.kernel_module
    monkeypatch.setattr(ops, "kernel_module", lambda p: StreamNotingKernels if p == ops.CUDA else kernel_module(p))
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    model = ops.single_op_model(ops.TRAINING).SerializeToString()
    session = ort.InferenceSession(model, runtime.session_options(providers), providers=providers)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 4, 6, 6)).astype(np.float32)
    params = [(rng.random(4) + 0.5).astype(np.float32) for _ in range(4)]
    feeds = dict(zip(ops.INPUT_NAMES[ops.TRAINING], (x, *params), strict=True))
    want = list(reference.forward_training(*feeds.values(), BatchNormConfig()))[:5]  # the node has 5 outputs

    binding = session.io_binding()
    inputs = {name: ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0) for name, array in feeds.items()}
    for name, value in inputs.items():
        binding.bind_ortvalue_input(name, value)
    outputs = {
        name: ort.OrtValue.ortvalue_from_shape_and_type(w.shape, w.dtype.type, "cuda", 0)
        for name, w in zip(ops.OUTPUT_NAMES[ops.TRAINING][:5], want, strict=True)
    }
    for name, value in outputs.items():
        binding.bind_ortvalue_output(name, value)
    with ops.record_addresses() as calls:
        session.run_with_iobinding(binding)

    assert all(v.device_name().lower() == "cuda" for v in (*inputs.values(), *outputs.values()))
    assert len(calls) == 1
    assert calls[0].inputs == tuple(v.data_ptr() for v in inputs.values())
    assert calls[0].outputs == tuple(v.data_ptr() for v in outputs.values())
    assert len(streams) == 1 and streams[0] != 0  # ORT's compute stream, not CuPy's default (null) stream
    for g, w in zip(binding.copy_outputs_to_cpu(), want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
