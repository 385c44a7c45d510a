"""The oneDNN convolution-gradient core (bnfuse/runtime/native/onednn_*.c) hosted without Python: a small C host
(tests/runtime/c/onednn_host.c) built with ``cc`` against the core alone gives the Python-hosted ops' bits."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bnfuse.runtime import conv_grad, conv_input_grad

from .test_conv_grad import CASES, DIRECT_CASES, SPLIT_CASES, _geometry, _output_shape, _session
from .test_conv_input_grad import _session as _input_session

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "bnfuse" / "runtime" / "native"
CORE = [NATIVE / f"onednn_{name}.c" for name in ("load", "plan", "split", "conv", "direct", "gemm")]

pytestmark = pytest.mark.skipif(
    not conv_grad.available() or shutil.which("cc") is None, reason="needs oneDNN (onednn-cpu-gomp) and a C compiler"
)


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Path:
    program = tmp_path_factory.mktemp("host") / "onednn_host"
    command = [
        "cc", "-O2", "-Wall", "-Wextra", "-Werror", "-std=c11", f"-I{NATIVE}",
        str(ROOT / "tests" / "runtime" / "c" / "onednn_host.c"), *map(str, CORE), "-ldl", "-lpthread", "-o",
        str(program),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    return program


def test_the_core_needs_no_python(host: Path) -> None:
    undefined = subprocess.run(["nm", "-u", str(host)], check=True, capture_output=True, text=True).stdout
    assert "Py" not in undefined and "python" not in undefined.lower()
    libraries = subprocess.run(["ldd", str(host)], check=True, capture_output=True, text=True).stdout
    assert "python" not in libraries.lower() and "dnnl" not in libraries  # oneDNN comes by dlopen()


def _run_host(host: Path, tmp_path: Path, kind: str, threads: int, geometry: conv_grad.Geometry, a, b, shape):  # noqa: ANN001, ANN202
    a_path, b_path, out_path = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "out.bin"
    a.tofile(a_path)
    b.tofile(b_path)
    values = [str(v) for v in geometry.core_values()]
    done = subprocess.run(
        [str(host), str(conv_grad.library_path() or ""), kind, str(threads), *values, str(a_path), str(b_path),
         str(out_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return np.fromfile(out_path, np.float32).reshape(shape)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    "name",
    [
        "1d-strided-dilated-grouped",
        "2d-resnet-like",
        "2d-1x1-strided",
        "2d-depthwise",
        "3d",
        *SPLIT_CASES,
        *DIRECT_CASES,
    ],
)
def test_a_c_host_gives_the_python_hosted_ops_bits(host: Path, tmp_path: Path, name: str, threads: int) -> None:
    x_shape, out_channels, kernel, strides, dilations, pads, group = CASES[name]
    dy_shape = _output_shape(x_shape, out_channels, kernel, strides, dilations, pads)
    attributes = dict(kernel_shape=kernel, strides=strides, dilations=dilations, pads=pads, group=group)
    geometry = _geometry(x_shape, dy_shape, attributes)
    rng = np.random.default_rng(5)
    x = rng.standard_normal(x_shape).astype(np.float32)
    dy = rng.standard_normal(dy_shape).astype(np.float32)
    w = rng.standard_normal(geometry.weight_shape).astype(np.float32)
    with conv_grad.onednn_threads(threads):
        dw = _session(x_shape, dy_shape, threads=2, **attributes).run(None, {"x": x, "dy": dy})[0]
        dx = _input_session(dy_shape, w.shape, threads=2, output_shape=x_shape[2:], **attributes).run(
            None, {"dy": dy, "w": w}
        )[0]
    np.testing.assert_array_equal(_run_host(host, tmp_path, "weight", threads, geometry, x, dy, dw.shape), dw)
    np.testing.assert_array_equal(_run_host(host, tmp_path, "input", threads, geometry, dy, w, dx.shape), dx)
    with conv_grad.onednn_threads(1):
        np.testing.assert_allclose(dx, conv_input_grad.input_grad(dy, w, geometry), rtol=1e-4, atol=1e-4)


def test_a_bad_geometry_is_one_clear_message(host: Path, tmp_path: Path) -> None:
    x_shape, dy_shape = (2, 4, 9), (2, 6, 5)  # kernel 3 gives 7 positions, not 5
    geometry = conv_grad.Geometry(x_shape, dy_shape, (3,), (1,), (1,), (0, 0), 1)
    zeros = np.zeros(18, np.float32)
    (tmp_path / "a.bin").write_bytes(zeros.tobytes())
    values = [str(v) for v in geometry.core_values()]
    done = subprocess.run(
        [str(host), str(conv_grad.library_path() or ""), "weight", "2", *values, *(str(tmp_path / "a.bin"),) * 3],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 4
    assert done.stderr.strip() == "oneDNN convolution gradient: axis 0: dY has 5 positions, the Conv gives 7"
