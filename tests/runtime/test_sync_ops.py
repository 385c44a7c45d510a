"""The collective ops in one process (a world of one) and the float64 merge they rely on; the multi-rank runs
are in tests/training/test_distributed.py (real mpiexec)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from bnfuse.runtime import collectives, ops, session_options, sync_ops
from bnfuse.runtime.semantics import BatchNormConfig, Mode, MomentumConvention, param_shape

CPU = ["CPUExecutionProvider"]


def _session(model) -> ort.InferenceSession:  # noqa: ANN001
    return ort.InferenceSession(model.SerializeToString(), session_options(CPU), providers=CPU)


def _packed(x: np.ndarray) -> np.ndarray:
    count, mean, m2 = sync_ops.local_moments(x, BatchNormConfig())
    return np.concatenate([np.array([count], np.int64).view(np.float64), mean, m2])


@pytest.mark.parametrize("mean", [0.0, 1000.0, 1e6])
def test_chan_merge_in_rank_order_equals_the_whole_batch(mean: float) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((40, 3, 4)) * 0.5 + mean).astype(np.float32)
    cuts = [0, 3, 3, 11, 27, 40]  # ranks of 3, 0, 8, 16, 13 samples
    gathered = np.stack([_packed(x[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)])
    total, merged_mean, m2 = sync_ops.merge_moments(gathered)
    xf = x.astype(np.float64)
    assert total == 40 * 4
    np.testing.assert_allclose(merged_mean, xf.mean(axis=(0, 2)), rtol=1e-14)
    np.testing.assert_allclose(m2 / total, xf.var(axis=(0, 2)), rtol=1e-9)


def test_counts_travel_as_64_bit_patterns() -> None:
    big = 2**62 + 1  # beyond float64's exact integers: only the bit pattern keeps it
    row = np.concatenate([np.array([big], np.int64).view(np.float64), [5.0], [0.0]])
    total, mean, m2 = sync_ops.merge_moments(np.stack([row, row]))
    assert total == 2 * big and mean[0] == 5.0 and m2[0] == 0.0


@pytest.mark.parametrize("attrs", [{}, {"axis": -1, "momentum": 0.1, "momentum_convention": "pytorch"}])
def test_one_rank_equals_the_plain_ops(attrs: dict) -> None:
    """A world of one: the sync ops give the non-distributed ops' results within float32 rounding."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 4, 5)) + 1000).astype(np.float32)
    channels = 4 if not attrs else 5
    params = {
        "scale": rng.uniform(0.5, 2, channels).astype(np.float32),
        "B": rng.standard_normal(channels).astype(np.float32),
        "input_mean": np.zeros(channels, np.float32),
        "input_var": np.ones(channels, np.float32),
    }
    assert isinstance(collectives.current(), collectives.SingleProcess)
    sync = _session(sync_ops.sync_op_model(sync_ops.SYNC_TRAINING, **attrs))
    plain = _session(ops.single_op_model(ops.TRAINING, **attrs))
    got = sync.run(None, {"X": x, **params, "token": np.array([41], np.int64)})
    want = plain.run(None, {"X": x, **params})
    assert got[-1].tolist() == [42]
    for a, b in zip(got[:5], want, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)
    grad_attrs = {k: v for k, v in attrs.items() if k == "axis"}
    dy = rng.standard_normal(x.shape).astype(np.float32)
    feeds = {"dY": dy, "X": x, "scale": params["scale"], "saved_mean": want[3], "saved_inv_std": want[4]}
    got = _session(sync_ops.sync_op_model(sync_ops.SYNC_GRAD, **grad_attrs)).run(
        None, {**feeds, "token": np.array([0], np.int64)}
    )
    want = _session(ops.single_op_model(ops.GRAD, **grad_attrs)).run(None, feeds)
    for a, b in zip(got[:3], want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_all_reduce_of_one_rank_is_the_identity(dtype: type) -> None:
    session = _session(sync_ops.sync_op_model(sync_ops.ALL_REDUCE, dtype=dtype))
    x = np.arange(7).astype(dtype)
    y, token = session.run(None, {"X": x, "token": np.array([3], np.int64)})
    assert y.dtype == x.dtype and y.tolist() == x.tolist() and token.tolist() == [4]


def test_frozen_statistics_and_bad_tokens_are_refused() -> None:
    with pytest.raises(Exception, match="use_global_stats needs no synchronization"):
        _session(sync_ops.sync_op_model(sync_ops.SYNC_TRAINING, use_global_stats=1))
    for op in (sync_ops.SYNC_TRAINING, sync_ops.SYNC_GRAD):  # the distribute pass unfuses it first
        with pytest.raises(Exception, match="no fused activation"):
            _session(sync_ops.sync_op_model(op, activation="relu"))
    session = _session(sync_ops.sync_op_model(sync_ops.ALL_REDUCE))
    with pytest.raises(Exception, match="token must have shape"):
        session.run(None, {"X": np.ones(2, np.float32), "token": np.zeros(2, np.int64)})


def test_a_batch_empty_everywhere_fails_the_run() -> None:
    session = _session(sync_ops.sync_op_model(sync_ops.SYNC_TRAINING))
    params = {n: np.ones(3, np.float32) for n in ("scale", "B", "input_mean", "input_var")}
    with pytest.raises(Exception, match="the batch is empty on every rank"):
        session.run(None, {"X": np.zeros((0, 3), np.float32), **params, "token": np.zeros(1, np.int64)})


def _gpu_available() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    import cupy

    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - CUDA driver missing or broken: no usable GPU
        return False


# Set in the subprocess that runs this file with tests/cuda_emulator's CuPy stand-in (as tests/runtime/test_cuda.py).
EMULATED_RUN = os.environ.get("BNFUSE_CUDA_EMULATED_RUN") == "1"
EMULATOR_DIR = Path(__file__).resolve().parents[1] / "cuda_emulator"
GPU_CONFIGS = [
    BatchNormConfig(),
    BatchNormConfig(axis=-1, fix_gamma=True, unbiased_running_var=True, momentum=0.3),
    BatchNormConfig(mode=Mode.PER_ACTIVATION, momentum_convention=MomentumConvention.PYTORCH, momentum=0.1),
]


@pytest.mark.skipif(
    not _gpu_available(), reason="no CuPy / GPU here: test_gpu_math_on_the_emulator runs it on the CUDA emulator"
)
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=["default", "channels-last-fix-gamma-unbiased", "per-activation"])
def test_gpu_math_matches_host_math(config: BatchNormConfig) -> None:
    """sync_forward / sync_backward on device arrays give the host's float64 results (one rank)."""
    import cupy

    rng = np.random.default_rng(2)
    x = (rng.standard_normal((8, 3, 4)) * 2 + 100).astype(np.float32)
    size = int(np.prod(param_shape(config, x.shape)))
    scale, bias = rng.uniform(0.5, 2, size).astype(np.float32), rng.standard_normal(size).astype(np.float32)
    running = [rng.standard_normal(size).astype(np.float32), rng.uniform(0.5, 2, size).astype(np.float32)]
    world = collectives.SingleProcess()
    host = sync_ops.sync_forward(x, scale, bias, *running, config, world)
    device = sync_ops.sync_forward(cupy.asarray(x), *(cupy.asarray(a) for a in (scale, bias, *running)), config, world)
    assert all(isinstance(b, cupy.ndarray) for b in device)
    for a, b in zip(host, device, strict=True):
        np.testing.assert_allclose(cupy.asnumpy(b), a, rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    saved = [host[3].astype(np.float32), host[4].astype(np.float32)]
    host = sync_ops.sync_backward(dy, x, scale, *saved, config, world)
    device = sync_ops.sync_backward(*(cupy.asarray(a) for a in (dy, x, scale, *saved)), config, world)
    for a, b in zip(host, device, strict=True):
        np.testing.assert_allclose(cupy.asnumpy(b), a, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(EMULATED_RUN, reason="this is the emulator run")
@pytest.mark.skipif(_gpu_available(), reason="a real GPU runs the GPU test directly")
def test_gpu_math_on_the_emulator(tmp_path: Path) -> None:
    """CI has no GPU: the GPU test runs in a subprocess whose ``cupy`` is tests/cuda_emulator's stand-in (device
    arrays that never convert to NumPy implicitly), and must pass there, not skip. The sync ops' device math is
    array code only (no kernel to compile), so the stand-in needs no g++ or CUDA toolkit here."""
    junit = tmp_path / "junit.xml"
    path = [str(EMULATOR_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "BNFUSE_CUDA_EMULATED_RUN": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               "-k", "test_gpu_math_matches_host_math", str(Path(__file__).resolve())]  # fmt: skip
    run = subprocess.run(command, cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-4000:]
    outcomes = {
        case.get("name"): next((c.tag for c in case if c.tag in ("skipped", "failure", "error")), "passed")
        for case in ElementTree.parse(junit).iter("testcase")
    }
    assert len(outcomes) == len(GPU_CONFIGS) and set(outcomes.values()) == {"passed"}, outcomes
