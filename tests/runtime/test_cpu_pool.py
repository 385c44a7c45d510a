"""The CPU kernels' parallel loops as tasks of a pool runner (cpu_pool.py, cpu.on_pool): the same bits as the C pool's
loops, and the pool taken where the size says so. Inside sessions the native ops run the same tasks on onnxruntime's
pool (native/bn_pooled.c): test_native_ops.py."""

from __future__ import annotations

import numpy as np
import pytest

from bnfuse.runtime import cpu, ortabi
from bnfuse.runtime.kernel_types import GradOutputs, TrainingOutputs
from bnfuse.runtime.semantics import BatchNormConfig

# (shape, config) covering every pooled loop: channels-first (inner >= 32) and rows (small inner), both above
# the pool thresholds the tests set (the tuned ones, several MiB, would only make the tests slower).
LAYOUTS = {
    "channels-first": ((12, 12, 48, 48), {}),  # 1.3 MB, inner 2304
    "rows": ((24000, 25), {}),  # 2.4 MB, inner 1
    "rows-nhwc": ((60, 40, 40, 7), {"axis": -1}),
}


def _shape(name: str) -> tuple[int, ...]:
    return LAYOUTS[name][0]


@pytest.fixture
def low_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "POOL_FROM_BYTES", 1024 * 1024)
    monkeypatch.setattr(cpu, "POOL_ROWS_FROM_BYTES", 2 * 1024 * 1024)


def _serial_runner(calls: list[int]):  # noqa: ANN202
    def run(task: int, count: int, data: int) -> None:
        calls.append(count)
        ortabi.run_tasks(task, count, data)

    return run


def _all_bits(outputs) -> list[bytes]:  # noqa: ANN001
    return [np.asarray(o).tobytes() for o in outputs]


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("blend", [(1.0, 0.0), (0.5, 0.25)], ids=["plain", "alpha-beta"])
def test_pooled_loops_give_the_c_pools_bits(name: str, blend: tuple[float, float], low_thresholds: None) -> None:
    """Every kernel with its loops run as pool tasks (here: in order on this thread) against the C pool (2 threads)."""
    shape, attrs = _shape(name), LAYOUTS[name][1]
    alpha, beta = blend
    config = BatchNormConfig(axis=attrs.get("axis", 1))
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    channels = shape[config.axis]
    scale, bias = (rng.random(channels) + 0.5).astype(np.float32), rng.standard_normal(channels).astype(np.float32)
    mean = (rng.standard_normal(channels) * 0.1).astype(np.float32)
    var = (rng.random(channels) + 0.5).astype(np.float32)
    prior = rng.standard_normal(shape).astype(np.float32)

    def run_all() -> list[bytes]:
        y = prior.copy()
        inference = cpu.forward_inference(x, scale, bias, mean, var, config, alpha=alpha, beta=beta, out=y)
        stats = [np.empty(channels, np.float32) for _ in range(5)]
        prior_out = TrainingOutputs(prior.copy(), *stats)
        training = cpu.forward_training(x, scale, bias, mean, var, config, alpha=alpha, beta=beta, out=prior_out)
        grad_out = GradOutputs(prior.copy(), np.empty(channels, np.float32), np.empty(channels, np.float32))
        grad = cpu.backward(
            dy, x, scale, training.saved_mean, training.saved_inv_std, config, alpha_data=alpha, beta_data=beta,
            out=grad_out,
        )  # fmt: skip
        global_config = BatchNormConfig(axis=config.axis, use_global_stats=True)
        frozen = cpu.backward(dy, x, scale, mean, (1 / np.sqrt(var + 1e-5)).astype(np.float32), global_config)
        return _all_bits([inference, *training, *grad, *frozen])

    with cpu.kernel_threads(2):
        c_pool_bits = run_all()
    calls: list[int] = []
    with cpu.on_pool(_serial_runner(calls)):
        pool_bits = run_all()
    assert calls and all(count >= 1 for count in calls)
    assert pool_bits == c_pool_bits


def test_small_inputs_stay_off_the_pool() -> None:
    x = np.random.default_rng(0).standard_normal((16, 16, 31, 31)).astype(np.float32)
    assert cpu.SERIAL_BELOW_BYTES < x.nbytes < cpu.POOL_FROM_BYTES
    calls: list[int] = []
    ones = np.ones(16, np.float32)
    with cpu.on_pool(_serial_runner(calls)):
        cpu.forward_training(x, ones, ones * 0, ones * 0, ones, BatchNormConfig())
    assert calls == []


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("blend", [(1.0, 0.0), (0.5, 0.25)], ids=["plain", "alpha-beta"])
def test_fused_relu_loops_run_on_the_pool_with_the_c_pools_bits(
    name: str, blend: tuple[float, float], low_thresholds: None
) -> None:
    """activation "relu": every loop runs as pool tasks as without it (the same task count), with the C pool's bits,
    and the ReLU is really applied (Y >= 0; dY masked)."""
    shape, attrs = _shape(name), LAYOUTS[name][1]
    alpha, beta = blend
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    axis = attrs.get("axis", 1)
    channels = shape[axis]
    scale, bias = (rng.random(channels) + 0.5).astype(np.float32), rng.standard_normal(channels).astype(np.float32)
    mean, var = np.zeros(channels, np.float32), np.ones(channels, np.float32)
    prior = rng.standard_normal(shape).astype(np.float32)

    def run_all(config: BatchNormConfig) -> list[np.ndarray]:
        stats = [np.empty(channels, np.float32) for _ in range(5)]
        out = TrainingOutputs(prior.copy(), *stats)
        training = cpu.forward_training(x, scale, bias, mean, var, config, alpha=alpha, beta=beta, out=out)
        activated = (training.y,) if config.activation == "relu" else ()
        grad_out = GradOutputs(prior.copy(), np.empty(channels, np.float32), np.empty(channels, np.float32))
        grad = cpu.backward(
            dy, x, scale, training.saved_mean, training.saved_inv_std, config, *activated, alpha_data=alpha,
            beta_data=beta, out=grad_out,
        )  # fmt: skip
        return [np.array(a) for a in (*training, *grad)]

    fused = BatchNormConfig(axis=axis, activation="relu")
    with cpu.kernel_threads(2):
        c_pool_arrays = run_all(fused)
    tasks: dict[str, list[int]] = {}
    for config in (fused, BatchNormConfig(axis=axis)):
        calls: list[int] = []
        with cpu.on_pool(_serial_runner(calls)):
            arrays = run_all(config)
        tasks[config.activation] = calls
        if config is fused:
            assert _all_bits(arrays) == _all_bits(c_pool_arrays)
    assert tasks["relu"] == tasks["none"] and len(tasks["relu"]) >= 2
    y = c_pool_arrays[0]
    assert np.all(y >= 0) and 0.05 < np.mean(y == 0) < 0.95
    plain_dx = run_all(BatchNormConfig(axis=axis))[6]
    assert not np.array_equal(c_pool_arrays[6], plain_dx)  # the mask changed dX
