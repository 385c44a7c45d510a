"""bnfuse as a guest in someone else's process: what the subprocesses of tests/runtime/test_ortabi_lifetime.py and
tests/training/test_session_threads.py run.

``build(kinds)`` makes a session (or TrainingSession) of each kind, runs it and checks what it computed against
the float64 reference (or an independent computation); ``use(held)`` runs every one again. The holders are what
the caller keeps alive, in whatever way the teardown pattern under test keeps them.

``python guest_cases.py threads KIND`` (torch imported and set to one thread first, as a PyTorch script does)
prints, as one JSON line, the thread settings of torch, every loaded OpenMP runtime and BLAS (and whether numba
was imported: bnfuse's kernels are C) before and
after building and stepping a graph of KIND (:data:`GRAPHS`), read here and by threadpoolctl -- never through
bnfuse.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

KINDS = ("inference", "training", "grad", "training_session", "optimizer", "distributed")
PROVIDERS = ["CPUExecutionProvider"]


def _feeds(op: str, x_shape: tuple[int, ...], seed: int = 0) -> dict[str, np.ndarray]:
    from bnfuse.runtime import ops

    rng = np.random.default_rng(seed)
    channels = x_shape[1]
    x = (rng.standard_normal(x_shape) * 2 + 0.5).astype(np.float32)
    scale, bias = (rng.random(channels) + 0.5).astype(np.float32), rng.standard_normal(channels).astype(np.float32)
    mean = (rng.standard_normal(channels) * 0.1).astype(np.float32)
    var = (rng.random(channels) + 0.5).astype(np.float32)
    if op == ops.GRAD:
        dy = rng.standard_normal(x_shape).astype(np.float32)
        arrays = (dy, x, scale, mean, (1.0 / np.sqrt(var + 1.0)).astype(np.float32))
    else:
        arrays = (x, scale, bias, mean, var)
    return dict(zip(ops.INPUT_NAMES[op], arrays, strict=True))


def _op_session(op: str, by_hand: bool, x_shape: tuple[int, ...]) -> tuple[Any, Callable[[], None]]:
    """One op in a plain onnxruntime session: through session_options(), or the library registered by hand."""
    import onnxruntime as ort

    from bnfuse.runtime import library_path, ops, reference, session_options
    from bnfuse.runtime.semantics import BatchNormConfig

    if by_hand:
        options = ort.SessionOptions()
        options.register_custom_ops_library(library_path())
    else:
        options = session_options(PROVIDERS)
    session = ort.InferenceSession(ops.single_op_model(op).SerializeToString(), options, providers=PROVIDERS)
    feeds = _feeds(op, x_shape)
    config = BatchNormConfig()

    def check() -> None:
        got = session.run(None, feeds)
        if op == ops.INFERENCE:
            expected = [reference.forward_inference(*feeds.values(), config)]
        elif op == ops.TRAINING:
            expected = list(reference.forward_training(*feeds.values(), config))[:5]
        else:
            expected = list(reference.backward(*feeds.values(), config))
        assert len(got) == len(expected), (op, len(got))
        for value, want in zip(got, expected, strict=True):
            np.testing.assert_allclose(value, want, rtol=2e-4, atol=2e-5, err_msg=op)

    return session, check


def _optimizer_session() -> tuple[Any, Callable[[], None]]:
    """bnfuse.SGDStep on two parameters: p' = p - lr * g, computed in float32 as the standard nodes do."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from bnfuse.io import ort_compatible
    from bnfuse.runtime import optimizer_ops, session_options

    shapes = ((3, 4), (40000,))  # the second is cut into chunks on the session's pool
    inputs = ["lr"] + [name for i in range(len(shapes)) for name in (f"p{i}", f"g{i}")]
    infos = [helper.make_tensor_value_info("lr", TensorProto.FLOAT, [])]
    for i, shape in enumerate(shapes):
        infos += [helper.make_tensor_value_info(f"{k}{i}", TensorProto.FLOAT, shape) for k in "pg"]
    outputs = [helper.make_tensor_value_info(f"new_p{i}", TensorProto.FLOAT, s) for i, s in enumerate(shapes)]
    node = helper.make_node(
        optimizer_ops.SGD_STEP, inputs, [o.name for o in outputs], domain=optimizer_ops.DOMAIN,
        weight_decays=[0.0] * len(shapes), lr_scales=[1.0] * len(shapes),
    )  # fmt: skip
    graph = helper.make_graph([node], "step", infos, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(optimizer_ops.DOMAIN, 1)]
    model = ort_compatible(helper.make_model(graph, opset_imports=opsets))
    session = ort.InferenceSession(model.SerializeToString(), session_options(PROVIDERS), providers=PROVIDERS)
    rng = np.random.default_rng(5)
    feeds = {"lr": np.array(0.25, np.float32)}
    for i, shape in enumerate(shapes):
        feeds[f"p{i}"] = rng.standard_normal(shape).astype(np.float32)
        feeds[f"g{i}"] = rng.standard_normal(shape).astype(np.float32)

    def check() -> None:
        for i, new_p in enumerate(session.run(None, feeds)):
            expected = feeds[f"p{i}"] - feeds[f"g{i}"] * feeds["lr"]
            assert new_p.tobytes() == expected.tobytes(), f"SGDStep parameter {i}"

    return session, check


def _mlp_data(batch: int, features: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((batch, features)).astype(np.float32) + 3.0, rng.integers(0, 10, batch)) for _ in range(2)
    ]


def _training_session() -> tuple[Any, Callable[[], None]]:
    """A TrainingSession of a small MLP with BatchNorm1d: each step moves the parameters and gives a finite loss;
    a second session on the same graph and data gives the same losses (both made and run here)."""
    from bnfuse.models import registry
    from bnfuse.passes.training import build_training_graph
    from bnfuse.training import TrainingSession

    model = registry.build("mlp_gemm", size=16, width=0.125, seed=3)
    train, _ = build_training_graph(model, loss="cross-entropy", batch_size=4)
    session = TrainingSession(train, lr=0.1)
    twin = TrainingSession(train, lr=0.1)
    data = _mlp_data(4, 16, 7)

    def check() -> None:
        before = session.state()
        losses = [session.step(x, labels) for x, labels in data]
        assert all(np.isfinite(losses)), losses
        assert losses == [twin.step(x, labels) for x, labels in data]
        assert any(not np.array_equal(before[k], v) for k, v in session.state().items())

    return (session, twin), check


def _distributed_session() -> tuple[Any, Callable[[], None]]:
    """A distributed training graph on a world of one rank (mpi4py's COMM_WORLD, no mpiexec): its losses equal the
    plain graph's."""
    from mpi4py import MPI

    from bnfuse.models import registry
    from bnfuse.passes.training import build_training_graph
    from bnfuse.passes.training.distribute import distribute_training_graph
    from bnfuse.training import TrainingSession

    model = registry.build("mlp_gemm", size=16, width=0.125, seed=4)
    plain, _ = build_training_graph(model, loss="cross-entropy", batch_size=4, fuse_relu=False)
    dist, _ = distribute_training_graph(plain)
    session = TrainingSession(dist, lr=0.1, comm=MPI.COMM_WORLD)
    reference_session = TrainingSession(plain, lr=0.1)
    data = _mlp_data(4, 16, 8)

    def check() -> None:
        for x, labels in data:
            loss, expected = session.step(x, labels), reference_session.step(x, labels)
            assert np.isfinite(loss) and abs(loss - expected) <= 1e-6 * max(1.0, abs(expected)), (loss, expected)

    return (session, reference_session), check


def _builders() -> dict[str, Callable[[], tuple[Any, Callable[[], None]]]]:
    from bnfuse.runtime import ops

    return {
        "inference": lambda: _op_session(ops.INFERENCE, False, (4, 3, 5)),
        "training": lambda: _op_session(ops.TRAINING, True, (4, 3, 5)),  # the hand-registered library
        "grad": lambda: _op_session(ops.GRAD, False, (6, 4)),
        "training_session": _training_session,
        "optimizer": _optimizer_session,
        "distributed": _distributed_session,
    }


def build(kinds: tuple[str, ...] = KINDS) -> dict[str, tuple[Any, Callable[[], None]]]:
    """Sessions of each kind, each run and checked once (prints ``built KIND``)."""
    builders = _builders()
    held = {}
    for kind in kinds:
        held[kind] = builders[kind]()
        held[kind][1]()
        print(f"built {kind}", flush=True)
    return held


def use(held: dict[str, tuple[Any, Callable[[], None]]]) -> None:
    """Run and check every held session again (prints ``used KIND``)."""
    for kind, (_, check) in held.items():
        check()
        print(f"used {kind}", flush=True)


# -- thread settings ---------------------------------------------------------------------------------------------

# name -> (model, build_training_graph options, distributed)
GRAPHS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "mlp_fused": ("mlp_gemm", {}, False),
    "mlp_unfused": ("mlp_gemm", {"fuse_relu": False, "fused_optimizer": False}, False),
    "cnn_fused": ("resnet18", {}, False),
    "cnn_unfused": ("resnet18", {"fuse_relu": False, "fused_optimizer": False}, False),
    "mlp_distributed": ("mlp_gemm", {"fuse_relu": False}, True),
    "ops": ("", {}, False),  # the ops alone, in plain sessions: small (C path) and large (session pool) tensors
}


def thread_settings() -> dict[str, Any]:
    """torch's intra-op threads, whether numba is imported, every loaded OpenMP runtime's (max threads, dynamic, max
    active levels) and every BLAS's thread count (threadpoolctl, read-only)."""
    import threadpoolctl

    settings: dict[str, Any] = {}
    if "torch" in sys.modules:
        settings["torch"] = sys.modules["torch"].get_num_threads()
    settings["numba imported"] = "numba" in sys.modules
    for library in threadpoolctl.threadpool_info():
        path = library["filepath"]
        if library["user_api"] == "openmp":
            handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            levels = handle.omp_get_max_active_levels()
            settings[path] = [handle.omp_get_max_threads(), handle.omp_get_dynamic(), levels]
        else:
            settings[path] = library["num_threads"]
    return settings


def _step_graph(name: str) -> Any:
    from bnfuse.models import registry
    from bnfuse.passes.training import build_training_graph
    from bnfuse.training import TrainingSession

    model_name, options, distributed = GRAPHS[name]
    if model_name == "mlp_gemm":
        model, x_shape = registry.build(model_name, size=16, width=0.125, seed=2), (8, 16)
    else:
        model, x_shape = registry.build(model_name, size=32, width=0.125, seed=2), (4, 3, 32, 32)
    train, _ = build_training_graph(model, loss="cross-entropy", batch_size=x_shape[0], **options)
    comm = None
    if distributed:
        from mpi4py import MPI

        from bnfuse.passes.training.distribute import distribute_training_graph

        train, comm = distribute_training_graph(train)[0], MPI.COMM_WORLD
    session = TrainingSession(train, lr=0.05, comm=comm)
    rng = np.random.default_rng(1)
    for _ in range(2):
        loss = session.step(rng.standard_normal(x_shape).astype(np.float32), rng.integers(0, 10, x_shape[0]))
        assert np.isfinite(loss), loss
    return session


def _run_ops() -> Any:
    from bnfuse.runtime import ops

    held = []
    for op in (ops.TRAINING, ops.GRAD, ops.INFERENCE):
        for by_hand, shape in ((False, (4, 3, 5)), (True, (4, 3, 5)), (False, (8, 64, 48, 48))):  # last: 4.7 MB
            session, check = _op_session(op, by_hand, shape)
            check()
            held.append(session)
    optimizer, check = _optimizer_session()
    check()
    return held, optimizer


def threads(name: str) -> None:
    import torch

    torch.set_num_threads(1)  # a PyTorch script's setting, unlike every default here
    report: dict[str, Any] = {"before": thread_settings()}
    held = _run_ops() if name == "ops" else _step_graph(name)
    report["after"] = thread_settings()
    torch.set_num_threads(2)
    report["before_again"] = thread_settings()
    held = (held, _run_ops() if name == "ops" else _step_graph(name))
    report["after_again"] = thread_settings()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "threads":
        threads(sys.argv[2])
    else:
        raise SystemExit(f"unknown case {sys.argv[1]!r}")
