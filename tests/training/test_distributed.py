"""Data-parallel training under real ``mpiexec`` on localhost (MPICH from the test extra), each launch time-limited.

Ranks run tests/training/mpi_cases.py (or the CLI) and write what they computed; the comparisons against one
process on the whole batch happen here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from bnfuse.io import save_model
from bnfuse.models import registry
from bnfuse.passes.training import SGD, Adam, build_training_graph, read_spec
from bnfuse.passes.training.distribute import DROPOUT_RANK_STRIDE, collective_schedule, distribute_training_graph
from bnfuse.passes.training.groups import GroupRule
from bnfuse.runtime import reference, session_options
from bnfuse.runtime.semantics import BatchNormConfig
from bnfuse.runtime.sync_ops import SYNC_GRAD, SYNC_TRAINING
from bnfuse.training import TrainingSession

pytest.importorskip("mpi4py", reason="the distributed tests need mpi4py + an MPI (pip install -e '.[test]')")
CASES = Path(__file__).with_name("mpi_cases.py")
LIMIT_S = 240  # 2 shared cores: several ranks each import onnxruntime


def _mpiexec() -> str:
    beside = Path(sys.executable).with_name("mpiexec")
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpiexec not found (pip install mpich gives one next to the interpreter)")
    return found


def _launch(ranks: int, *command: str, timeout: float = LIMIT_S) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [_mpiexec(), "-n", str(ranks), *command], capture_output=True, text=True, timeout=timeout, env=env
    )


def _case(ranks: int, case: str, outdir: Path, timeout: float = LIMIT_S) -> subprocess.CompletedProcess[str]:
    return _launch(ranks, sys.executable, str(CASES), case, str(outdir), timeout=timeout)


def _rel(actual: np.ndarray, expected: np.ndarray) -> float:
    scale = max(float(np.abs(expected).max()), 1e-30) if expected.size else 1.0
    return float(np.abs(actual.astype(np.float64) - expected).max() / scale) if expected.size else 0.0


def test_sync_bn_on_uneven_and_empty_ranks_matches_one_process(tmp_path: Path) -> None:
    """4 ranks with 3/5/8/16 and 3/0/8/16 samples, channel means 0 and 1000, NCHW and channels-last: forward,
    backward and running statistics equal float64 BN on the concatenated batch within 1e-6 (relative)."""
    result = _case(4, "sync_bn", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(4)]
    keys = sorted({k.rsplit("/", 1)[0] for k in ranks[0]})
    assert len(keys) == 8
    for key in keys:
        layout = key.split("/")[0]
        attrs = {"nchw": {"momentum": 0.9}, "nhwc": {"axis": -1, "momentum": 0.1}}[layout]
        config = BatchNormConfig(
            **attrs,
            momentum_convention="pytorch" if layout == "nhwc" else "onnx",
            unbiased_running_var=layout == "nhwc",
        )

        def whole(name: str, key: str = key) -> np.ndarray:
            return np.concatenate([r[f"{key}/{name}"] for r in ranks])

        first = ranks[0]
        params = [first[f"{key}/{n}"] for n in ("scale", "B", "input_mean", "input_var")]
        x, dy = whole("x"), whole("dy")
        expected = reference.forward_training(x.astype(np.float64), *(p.astype(np.float64) for p in params), config)
        assert _rel(whole("y"), expected.y) < 1e-6, key
        for name in ("running_mean", "running_var", "saved_mean", "saved_inv_std"):
            for r in ranks:  # identical on every rank, bit for bit
                np.testing.assert_array_equal(r[f"{key}/{name}"], first[f"{key}/{name}"])
            assert _rel(first[f"{key}/{name}"], getattr(expected, name)) < 1e-6, (key, name)
        # the backward reads the float32 saved statistics the forward wrote (as in a graph): the oracle gets them too
        saved = [first[f"{key}/{n}"].astype(np.float64) for n in ("saved_mean", "saved_inv_std")]
        grads = reference.backward(dy.astype(np.float64), x.astype(np.float64), params[0].astype(np.float64), *saved,
                                   config)  # fmt: skip
        assert _rel(whole("dx"), grads.dx) < 1e-6, key
        # dScale / dBias stay local: their sum over the ranks is the whole batch's
        assert _rel(sum(r[f"{key}/dscale"].astype(np.float64) for r in ranks), grads.dscale) < 1e-6, key
        assert _rel(sum(r[f"{key}/dbias"].astype(np.float64) for r in ranks), grads.dbias) < 1e-6, key
        if "empty_rank" in key:
            assert ranks[1][f"{key}/y"].shape[0] == 0 and not ranks[1][f"{key}/dbias"].any()
        assert all(int(r[f"{key}/token"][0]) == 2 for r in ranks)


def _small_training(tmp_path: Path, per_rank: int, ranks: int, seed: int = 0) -> tuple[onnx.ModelProto, Path]:
    """An MLP with BatchNorm1d, its data (per_rank * ranks samples) in data.npz, and its training graphs."""
    model = registry.build("mlp_gemm", size=16, width=0.125, seed=seed)
    rng = np.random.default_rng(seed)
    total = per_rank * ranks
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((total, 16)).astype(np.float32) + 3.0,
             labels=rng.integers(0, 10, total))  # fmt: skip
    save_model(model, tmp_path / "model.onnx")
    return model, tmp_path / "data.npz"


def _distributed_graph(model: onnx.ModelProto, batch: int, **options: object) -> onnx.ModelProto:
    train, _ = build_training_graph(model, batch_size=batch, **{"loss": "cross-entropy", **options})
    return distribute_training_graph(train)[0]


@pytest.mark.parametrize("ranks", [1, 4])
def test_sgd_steps_on_ranks_match_one_process_on_the_whole_batch(tmp_path: Path, ranks: int) -> None:
    """`mpiexec -n N bnfuse train` on a distributed graph (4 samples per rank, 5 SGD steps with momentum) gives
    the parameters and running statistics of one process training on all samples at once within 1e-5."""
    per_rank, steps = 4, 5
    model, data = _small_training(tmp_path, per_rank, ranks)
    optimizer = SGD(momentum=0.9, weight_decay=1e-3)
    dist = _distributed_graph(model, per_rank, optimizer=optimizer)
    save_model(dist, tmp_path / "dist.onnx")
    args = ["train", str(tmp_path / "dist.onnx"), "--data", str(data), "-o", str(tmp_path / "out.onnx")]
    args += ["--no-shuffle"]
    result = _launch(ranks, sys.executable, "-m", "bnfuse.cli", *args, "--epochs", str(steps), "--lr", "0.5")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("epoch 5/5") == 1  # only rank 0 prints
    cores = len(os.sched_getaffinity(0))
    if ranks > 1:  # the thread choice, said once
        share = f"{ranks} ranks on this machine share {cores} cores: {max(1, cores // ranks)} onnxruntime thread"
        assert result.stdout.count("threads: ") == 1 and f"{ranks} ranks; threads: {share}" in result.stdout
    else:
        assert "threads: " not in result.stdout
    trained = onnx.load(tmp_path / "out.onnx")

    whole, _ = build_training_graph(model, loss="cross-entropy", batch_size=per_rank * ranks, optimizer=optimizer)
    session = TrainingSession(whole, lr=0.5)
    arrays = np.load(data)
    losses = [session.step(arrays["x"], arrays["labels"]) for _ in range(steps)]
    expected = session.export_inference_model()
    got = {t.name: onnx.numpy_helper.to_array(t) for t in trained.graph.initializer}
    compared = 0
    for tensor in expected.graph.initializer:
        want = onnx.numpy_helper.to_array(tensor)
        if want.dtype == np.float32:
            np.testing.assert_allclose(got[tensor.name], want, rtol=1e-5, atol=1e-5, err_msg=tensor.name)
            compared += 1
    assert compared >= 10 and abs(losses[0] - losses[-1]) > 1e-3  # it trained, and every weight was compared
    mean_loss = float(result.stdout.split("epoch 5/5: loss ")[-1].split()[0])
    assert mean_loss == pytest.approx(float(np.mean(losses[-1:])), rel=1e-4)  # the global loss, not rank 0's


@pytest.mark.parametrize("drop_last", [False, True])
def test_cli_on_3_ranks_trains_every_sample_as_one_process_on_the_same_global_batches(
    tmp_path: Path, drop_last: bool
) -> None:
    """29 samples (divisible by neither 3 ranks nor the batch of 4 per rank), 2 shuffled epochs: `mpiexec -n 3 bnfuse
    train` uses every sample once per epoch (global batches of 12, 12 and 5, split 4/4/4 and 2/2/1) and ends with
    the weights of one process taking the same global batches (within 1e-5); it says how it split the data, once.
    --drop-last: each rank 2 full batches of its contiguous share (24 of 29 samples), as static graphs train."""
    from bnfuse.training.data import epoch_order
    from bnfuse.training.distributed import EpochSplit

    ranks, per_rank, count, epochs, seed = 3, 4, 29, 2, 5
    model = registry.build("mlp_gemm", size=16, width=0.125, seed=3)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((count, 16)) + 2.0).astype(np.float32)
    labels = rng.integers(0, 10, count)
    np.savez(tmp_path / "data.npz", x=x, labels=labels)
    optimizer = SGD(momentum=0.9)
    save_model(_distributed_graph(model, per_rank, optimizer=optimizer), tmp_path / "dist.onnx")
    args = ["train", str(tmp_path / "dist.onnx"), "--data", str(tmp_path / "data.npz"), "-o", str(tmp_path / "o.onnx")]
    args += ["--epochs", str(epochs), "--lr", "0.1", "--shuffle-seed", str(seed)] + (
        ["--drop-last"] if drop_last else []
    )
    result = _launch(ranks, sys.executable, "-m", "bnfuse.cli", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    split = EpochSplit(count, ranks, per_rank, drop_last=drop_last)
    expected_line = (
        "data: 3 ranks x 4 samples per step, 2 steps per epoch: 24 of 29 samples each epoch (--drop-last)"
        if drop_last
        else "data: 3 ranks: every one of 29 samples once per epoch, 3 steps of 12 (4 per rank); the last step's 5 "
        "split 2/2/1 over the ranks"
    )
    assert result.stdout.count("data: ") == 1 and expected_line in result.stdout, result.stdout

    train, _ = build_training_graph(model, loss="cross-entropy", batch_size=ranks * per_rank, optimizer=optimizer)
    session = TrainingSession(train, lr=0.1)
    seen = []
    for epoch in range(1, epochs + 1):
        order = epoch_order(count, epoch, seed)  # bnfuse train's order of that epoch
        for step in range(split.steps):  # global batch s: every rank's step-s share, in rank order
            index = np.concatenate([order[split.positions(rank)[step]] for rank in range(ranks)])
            session.step(x[index], labels[index])
            seen.append(index)
    epoch_samples = np.concatenate(seen[: split.steps])
    assert len(epoch_samples) == (24 if drop_last else count) == len(set(epoch_samples.tolist()))
    expected = {t.name: onnx.numpy_helper.to_array(t) for t in session.export_inference_model().graph.initializer}
    got = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(tmp_path / "o.onnx").graph.initializer}
    compared = 0
    for name, want in expected.items():
        if want.dtype == np.float32 and want.size > 1:
            assert _rel(got[name], want.astype(np.float64)) < 1e-5, name
            compared += 1
    assert compared >= 10


def test_cli_refuses_a_plain_graph_launched_on_several_ranks(tmp_path: Path) -> None:
    """`mpiexec -n 2 bnfuse train` on a graph built without --distributed: every rank would train alone and write
    the same file; each says so in one line and exits 2 instead."""
    model, data = _small_training(tmp_path, 4, 2)
    plain, _ = build_training_graph(model, batch_size=4)
    save_model(plain, tmp_path / "plain.onnx")
    args = ["train", str(tmp_path / "plain.onnx"), "--data", str(data), "-o", str(tmp_path / "out.onnx")]
    result = _launch(2, sys.executable, "-m", "bnfuse.cli", *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    line = "bnfuse train: error: launched as 2 processes (mpiexec / mpirun), but"
    assert result.stderr.count(line) == 2 and not (tmp_path / "out.onnx").exists()


def test_cli_threads_option_wins_over_the_share(tmp_path: Path) -> None:
    """`--threads K` on 2 ranks: K threads per rank, said once; `--threads 0` is one line and exit 2."""
    model, data = _small_training(tmp_path, 4, 2)
    save_model(_distributed_graph(model, 4), tmp_path / "dist.onnx")
    args = ["train", str(tmp_path / "dist.onnx"), "--data", str(data), "-o", str(tmp_path / "out.onnx")]
    result = _launch(2, sys.executable, "-m", "bnfuse.cli", *args, "--threads", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("2 ranks; threads: 3 onnxruntime threads per rank (as set)") == 1
    bad = _launch(2, sys.executable, "-m", "bnfuse.cli", *args, "--threads", "0")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.count("bnfuse train: error: --threads must be >= 1, got 0") == 2  # each rank, before MPI


# --- the option matrix: N ranks, uneven samples, against one process on the concatenated batch -----------------

PER_RANK, MATRIX_LR = 4, 0.05
# Adam at PyTorch's default lr. It moves each element by lr x m / (sqrt(v) + eps) whatever the gradient's scale: for
# an element whose gradient is ~eps, the float32 rounding of the ranks' partial sums (another order than one
# process's) moves it by a fraction of lr (measured: 4.6e-5 of the tensor's scale at lr 0.01 on 4 uneven ranks).
ADAM_LR = 1e-3


def _matrix_counts(ranks: int, network: str) -> list[list[int]]:
    """Samples per rank in each step: even, uneven, then uneven with an empty rank (the MLPs; a dynamic-batch
    CNN cannot take an empty batch: a Reshape with an inferred dimension fails on 0 samples)."""
    empty = [7, 0, 5, 3] if network.startswith("mlp") else [7, 1, 5, 3]
    return [[PER_RANK] * ranks, [2, 4, 6, 2][:ranks], empty[:ranks]]


DROPOUT_SEED, DROPOUT_RATIO = 7, 0.3
MATRIX: dict[str, tuple[str, str, dict[str, object]]] = {  # name: (network, loss, build_training_graph options)
    "sgd": ("mlp", "cross-entropy", {"optimizer": SGD()}),
    "momentum": ("mlp", "cross-entropy", {"optimizer": SGD(momentum=0.9)}),
    "nesterov": ("cnn", "cross-entropy", {"optimizer": SGD(momentum=0.9, nesterov=True)}),
    "weight_decay": ("mlp", "mse", {"optimizer": SGD(momentum=0.9, weight_decay=1e-2)}),
    "param_groups": (
        "mlp",
        "cross-entropy",
        {
            "optimizer": SGD(momentum=0.9, weight_decay=1e-2),
            "param_groups": [GroupRule("@bn", weight_decay=0.0), GroupRule("fc0.*", lr_scale=0.1)],
        },
    ),
    "adam": ("mlp", "cross-entropy", {"optimizer": Adam(weight_decay=1e-3)}),
    "adam_standard": ("cnn", "cross-entropy", {"optimizer": "adam", "fused_optimizer": False}),
    "sgd_standard": ("mlp", "mse", {"optimizer": SGD(momentum=0.9), "fused_optimizer": False}),
    "relu_unfused": ("cnn", "cross-entropy", {"optimizer": SGD(momentum=0.9), "fuse_relu": False}),
    "frozen_bn": ("cnn", "cross-entropy", {"optimizer": SGD(momentum=0.9), "frozen_bn": True}),
    "frozen_one_bn": ("mlp", "cross-entropy", {"frozen_bn": ["bn1"]}),
    "cumulative": ("cnn", "mse", {"momentum_convention": "cumulative"}),
    "pytorch_momentum": ("cnn", "cross-entropy", {"momentum": 0.1, "momentum_convention": "pytorch"}),
    "fix_gamma": ("mlp", "cross-entropy", {"fix_gamma": True, "optimizer": SGD(momentum=0.9)}),
    "dropout": ("mlp_dropout", "cross-entropy", {"optimizer": SGD(momentum=0.9), "dropout_seed": DROPOUT_SEED}),
}


def _cnn() -> onnx.ModelProto:
    """Conv -> BN -> ReLU twice (channel means far from 0 in the input), global pool, Gemm: 10 classes."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)

    def tensor(name: str, *shape: int, scale: float = 0.3, offset: float = 0.0) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale + offset).astype(np.float32), name)

    inits, nodes, x = [], [], "input"
    for index, (cin, cout) in enumerate([(3, 8), (8, 8)]):
        inits.append(tensor(f"conv{index}.weight", cout, cin, 3, 3))  # no bias before BN (see _networks)
        inits += [tensor(f"bn{index}.scale", cout, offset=1.0), tensor(f"bn{index}.bias", cout)]
        inits += [tensor(f"bn{index}.mean", cout), numpy_helper.from_array(np.ones(cout, np.float32), f"bn{index}.var")]
        nodes += [
            helper.make_node("Conv", [x, f"conv{index}.weight"], [f"conv{index}"], pads=[1] * 4),
            helper.make_node(
                "BatchNormalization",
                [f"conv{index}", *(f"bn{index}.{n}" for n in ("scale", "bias", "mean", "var"))],
                [f"bn{index}"],
            ),
            helper.make_node("Relu", [f"bn{index}"], [f"relu{index}"]),
        ]
        x = f"relu{index}"
    inits += [tensor("fc.weight", 10, 8), tensor("fc.bias", 10)]
    nodes += [
        helper.make_node("GlobalAveragePool", [x], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["output"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 6, 6])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _networks() -> dict[str, onnx.ModelProto]:
    from onnx import helper, numpy_helper

    mlp = registry.build("mlp_gemm", size=16, width=0.125, seed=2)
    # no bias before a BN (PyTorch's bias=False): its gradient is 0 but for rounding, which Adam would amplify
    before_bn = {n.input[0] for n in mlp.graph.node if n.op_type == "BatchNormalization"}
    for node in mlp.graph.node:
        if node.op_type == "Gemm" and node.output[0] in before_bn:
            del node.input[2:]
    kept = {name for node in mlp.graph.node for name in node.input}
    unused = [t for t in mlp.graph.initializer if t.name not in kept]
    for tensor in unused:
        mlp.graph.initializer.remove(tensor)
    dropout = onnx.ModelProto()
    dropout.CopyFrom(mlp)
    graph = dropout.graph
    index = next(i for i, n in enumerate(graph.node) if n.output[0] == "relu1")
    graph.node.insert(index + 1, helper.make_node("Dropout", ["relu1", "ratio"], ["drop1"]))
    graph.initializer.append(numpy_helper.from_array(np.array(DROPOUT_RATIO, np.float32), "ratio"))
    for node in graph.node[index + 2 :]:
        node.input[:] = ["drop1" if name == "relu1" else name for name in node.input]
    return {"mlp": mlp, "mlp_dropout": dropout, "cnn": _cnn()}


def _matrix_data(ranks: int) -> dict[str, np.ndarray]:
    """Every step's global batch (the most samples any network's counts give): inputs per network, labels per loss;
    a network's step s takes its first sum(counts) samples."""
    rng = np.random.default_rng(ranks)
    data = {}
    for step in range(3):
        total = max(sum(_matrix_counts(ranks, network)[step]) for network in ("mlp", "cnn"))
        data[f"mlp/x/{step}"] = (rng.standard_normal((total, 16)) * 2 + 3).astype(np.float32)
        data[f"cnn/x/{step}"] = (rng.standard_normal((total, 3, 6, 6)) * 2 + 5).astype(np.float32)
        data[f"cross-entropy/labels/{step}"] = rng.integers(0, 10, total)
        data[f"mse/labels/{step}"] = rng.standard_normal((total, 10)).astype(np.float32)
    return data


def _rank_masks(counts: list[list[int]], width: int) -> list[np.ndarray]:
    """The masks each rank's Dropout draws at each step (seed DROPOUT_SEED + rank * stride, [its samples, width]),
    concatenated in rank order: what the one-process oracle applies to the whole batch."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    per_rank = []
    for rank in range(len(counts[0])):
        node = helper.make_node(
            "Dropout", ["x", "ratio", "train"], ["y", "mask"], seed=DROPOUT_SEED + rank * DROPOUT_RANK_STRIDE
        )
        graph = helper.make_graph(
            [node],
            "drop",
            [
                helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width]),
                helper.make_tensor_value_info("ratio", TensorProto.FLOAT, []),
                helper.make_tensor_value_info("train", TensorProto.BOOL, []),
            ],
            [helper.make_tensor_value_info("mask", TensorProto.BOOL, None)],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        fixed = {"ratio": np.array(DROPOUT_RATIO, np.float32), "train": np.array(True)}
        draws = [session.run(None, {"x": np.ones((step[rank], width), np.float32), **fixed})[0] for step in counts]
        per_rank.append(draws)
    return [np.concatenate([draws[step] for draws in per_rank]) for step in range(len(counts))]


def _one_process(
    train: onnx.ModelProto, xs: list[np.ndarray], labels: list[np.ndarray], masks: list[np.ndarray] | None, lr: float
) -> tuple[list[float], dict[str, np.ndarray]]:
    """The plain graph on whole batches in one onnxruntime session; with ``masks``, its Dropout replaced by those
    masks (fed as an input) so that it drops what the ranks dropped. Returns (losses, final state)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    spec = read_spec(train)
    model = onnx.ModelProto()
    model.CopyFrom(train)
    if masks is not None:
        graph = model.graph
        index, drop = next((i, n) for i, n in enumerate(graph.node) if n.op_type == "Dropout")
        graph.node.remove(drop)
        scale = numpy_helper.from_array(np.array(1 / (1 - DROPOUT_RATIO), np.float32), "oracle/scale")
        graph.initializer.append(scale)
        width = masks[0].shape[1]
        graph.input.append(helper.make_tensor_value_info("oracle/mask", TensorProto.BOOL, ["batch", width]))
        for node in reversed([
            helper.make_node("Identity", ["oracle/mask"], [drop.output[1]]),
            helper.make_node("Cast", ["oracle/mask"], ["oracle/maskf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [drop.input[0], "oracle/maskf"], ["oracle/kept"]),
            helper.make_node("Mul", ["oracle/kept", "oracle/scale"], [drop.output[0]]),
        ]):  # fmt: skip
            graph.node.insert(index, node)
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    state = {name: values[name] for name in spec.state}
    providers = ["CPUExecutionProvider"]
    options = session_options(providers, log_severity_level=3)  # state initializers are fed: no warnings
    session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
    names = [o.name for o in session.get_outputs()]
    losses = []
    for step in range(len(xs)):
        feeds = {spec.data[0]: xs[step], spec.targets[0]: labels[step], spec.lr: np.array(lr, np.float32)}
        if masks is not None:
            feeds["oracle/mask"] = masks[step]
        out = dict(zip(names, session.run(None, {**feeds, **state}), strict=True))
        losses.append(float(out[spec.loss]))
        state = {name: out[new] for name, new in spec.state.items()}
    return losses, state


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_option_matrix_on_ranks_matches_one_process_on_the_concatenated_batch(tmp_path: Path, ranks: int) -> None:
    """Every optimizer (SGD plain / momentum / Nesterov / weight decay / parameter groups, Adam; fused and standard
    update nodes), fused ReLU on and off, frozen BN (all, one), cumulative and PyTorch-momentum running averages
    (unbiased running variance), fixed gamma and dropout (each rank its own seed stream), 3 steps on N ranks
    holding even, uneven and (MLPs) empty shares of the step's batch, the communicator given as mpi4py's
    COMM_WORLD: every rank's losses and final state (parameters, running statistics, optimizer state with Adam's
    step counter) equal one process on the concatenated batches within 1e-5 (per tensor, relative to its largest
    value): loss and gradients are exact global means."""
    networks = _networks()
    data = _matrix_data(ranks)
    plan: dict[str, object] = {"cases": {}}
    oracles = {}
    for name, (network, loss, options) in MATRIX.items():
        model = networks[network]
        kind = "mlp" if network.startswith("mlp") else "cnn"
        counts = _matrix_counts(ranks, network)
        dist = _distributed_graph(model, PER_RANK, loss=loss, **options)
        save_model(dist, tmp_path / f"{name}.onnx")
        lr = ADAM_LR if name.startswith("adam") else MATRIX_LR
        plan["cases"][name] = (f"{kind}/x", f"{loss}/labels", counts, lr)
        whole, _ = build_training_graph(model, loss=loss, batch_size=ranks * PER_RANK, **options)
        width = next(t.dims[0] for t in model.graph.initializer if t.name == "bn1.scale")
        masks = _rank_masks(counts, width) if network == "mlp_dropout" else None
        xs = [data[f"{kind}/x/{step}"][: sum(c)] for step, c in enumerate(counts)]
        labels = [data[f"{loss}/labels/{step}"][: sum(c)] for step, c in enumerate(counts)]
        oracles[name] = _one_process(whole, xs, labels, masks, lr)
    (tmp_path / "matrix.json").write_text(json.dumps(plan))
    np.savez(tmp_path / "matrix_data.npz", **data)
    result = _case(ranks, "matrix", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    got = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(ranks)]
    for name, (losses, state) in oracles.items():
        for rank, values in enumerate(got):
            assert _rel(values[f"{name}/losses"], np.array(losses)) < 1e-5, (name, rank)
            assert int(values[f"{name}/threads"]) == max(1, len(os.sched_getaffinity(0)) // ranks)  # the share
            for key, want in state.items():
                error = _rel(values[f"{name}/{key}"], np.asarray(want, np.float64))
                assert values[f"{name}/{key}"].shape == np.shape(want), (name, key)
                assert error < 1e-5, (name, rank, key, error)
        assert abs(losses[0] - losses[-1]) > 1e-4, name  # it trained
    adam_steps = [v["adam/adam.step"] for v in got]
    assert all(step.shape == () and float(step) == 3 for step in adam_steps)


def _write_failure_fixtures(tmp_path: Path) -> None:
    model, _ = _small_training(tmp_path, 4, 4)
    save_model(_distributed_graph(model, 4), tmp_path / "train.onnx")
    save_model(_distributed_graph(model, 4, optimizer="adam"), tmp_path / "other.onnx")


def _error_lines(stderr: str, ranks: int) -> dict[int, list[str]]:
    """The ``bnfuse: rank R: error: ...`` lines by rank; fails on a traceback or any other bnfuse line."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines: dict[int, list[str]] = {rank: [] for rank in range(ranks)}
    for line in stderr.splitlines():
        found = re.match(r"bnfuse: rank (\d+): error: (.+)", line)
        if found:
            lines[int(found.group(1))].append(found.group(2))
        else:  # the launcher's own notes (MPICH: "Abort(2) on node 0 ..."), never Python's error report
            assert not line.startswith("bnfuse") and not re.match(r"\s*(File \"|\w+(Error|Exception)\b)", line), line
    return lines


@pytest.mark.parametrize("comm", ["mpi4py", "bnfuse"])
def test_a_raising_rank_ends_the_job_quickly_with_its_error(tmp_path: Path, comm: str) -> None:
    """abort_on_error(MPI.COMM_WORLD) (or bnfuse's communicator): rank 1's exception is one line, no traceback,
    and MPI_Abort ends the 3 ranks blocked in the step within 10 s."""
    _write_failure_fixtures(tmp_path)
    (tmp_path / "comm").write_text(comm)
    result = _case(4, "raising_rank", tmp_path)
    ended = time.time()
    assert result.returncode != 0
    lines = _error_lines(result.stderr, 4)
    assert lines == {0: [], 1: ["RuntimeError: rank 1 fails on purpose"], 2: [], 3: []}, result.stderr[-3000:]
    assert ended - float((tmp_path / "raised_at").read_text()) < 10.0


def test_a_silent_rank_is_caught_by_the_watchdog(tmp_path: Path) -> None:
    _write_failure_fixtures(tmp_path)
    result = _case(3, "silent_rank", tmp_path)
    ended = time.time()
    assert result.returncode != 0
    assert "made no progress for 2 s" in result.stderr
    assert ended - float((tmp_path / "raised_at").read_text()) < 10.0


@pytest.mark.parametrize("comm", ["mpi4py", "bnfuse"])
def test_a_mismatched_graph_is_refused_at_start_up(tmp_path: Path, comm: str) -> None:
    """Rank 1 with another graph: no rank starts; one line per rank (every rank prints before any aborts), no
    traceback; the job ends within 10 s of the check."""
    _write_failure_fixtures(tmp_path)
    (tmp_path / "comm").write_text(comm)
    result = _case(2, "mismatched_graph", tmp_path)
    ended = time.time()
    assert result.returncode != 0
    lines = _error_lines(result.stderr, 2)
    assert all(len(mine) == 1 for mine in lines.values()), result.stderr
    expected = "rank(s) 1 have a different training graph, onnxruntime version or collective schedule than rank 0"
    assert all(line.startswith(expected) for mine in lines.values() for line in mine)
    assert not list(tmp_path.glob("started*"))
    assert ended - max(float(p.read_text()) for p in tmp_path.glob("starting*")) < 10.0


def test_abort_on_error_with_debug_prints_the_traceback_first(tmp_path: Path) -> None:
    """BNFUSE_DEBUG=1: the traceback, then the same one line."""
    _write_failure_fixtures(tmp_path)
    (tmp_path / "comm").write_text("mpi4py")
    env = dict(os.environ, BNFUSE_DEBUG="1")
    result = subprocess.run(
        [_mpiexec(), "-n", "2", sys.executable, str(CASES), "mismatched_graph", str(tmp_path)],
        capture_output=True, text=True, timeout=LIMIT_S, env=env,
    )  # fmt: skip
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "DistributedError" in result.stderr
    assert re.search(r"^bnfuse: rank \d: error: rank\(s\) 1 have a different", result.stderr, re.M)


def test_communicator_takes_what_users_hold() -> None:
    """One wrapping function: mpi4py communicators are wrapped, bnfuse ones kept, anything else refused."""
    from mpi4py import MPI

    from bnfuse.runtime import collectives
    from bnfuse.training import distributed

    wrapped = distributed.communicator(MPI.COMM_SELF)
    assert isinstance(wrapped, collectives.MpiCommunicator) and (wrapped.rank, wrapped.size) == (0, 1)
    assert distributed.communicator(wrapped) is wrapped
    alone = collectives.SingleProcess()
    assert distributed.communicator(alone) is alone
    with pytest.raises(distributed.DistributedError, match="not a communicator: str"):
        distributed.communicator("world")
    state = {"adam.step": np.array(3.0, np.float32), "w": np.ones((2, 3), np.float32)}
    shapes = {k: v.shape for k, v in distributed.broadcast_state(MPI.COMM_SELF, state).items()}
    assert shapes == {"adam.step": (), "w": (2, 3)}  # a scalar stays a scalar (Adam's step counter)
    share = distributed.thread_share(MPI.COMM_SELF)
    assert share.local_ranks == share.sharing == 1 and share.threads == share.cores == len(os.sched_getaffinity(0))


def test_distributed_graph_on_one_process_equals_the_plain_graph() -> None:
    """Without a communicator the collectives are a world of one: same losses and state as the plain graph."""
    model = registry.build("mlp_gemm", size=16, width=0.125, seed=1)
    plain, _ = build_training_graph(model, loss="mse", batch_size=6, optimizer="adam", fuse_relu=True)
    dist, report = distribute_training_graph(plain)
    assert report.synced_batch_norms == report.synced_batch_norm_grads == 3
    # the plain graph fuses BN -> ReLU (fuse_relu); the synchronized ops have no activation: split off again
    fused = [n for n in plain.graph.node if any(a.name == "activation" for a in n.attribute)]
    assert len(fused) >= 2 and not any(any(a.name == "activation" for a in n.attribute) for n in dist.graph.node)
    unfused, _ = build_training_graph(model, loss="mse", batch_size=6, optimizer="adam", fuse_relu=False)
    dist_unfused, _ = distribute_training_graph(unfused)
    for op_type in ("Relu", "Greater", "Cast", "Mul", SYNC_TRAINING, SYNC_GRAD):
        assert sum(n.op_type == op_type for n in dist.graph.node) == sum(
            n.op_type == op_type for n in dist_unfused.graph.node
        ), op_type
    schedule = collective_schedule(dist)
    assert len(schedule) == report.collectives == 3 + 3 + 1 + 2  # BN forward, backward, gradients, count, loss
    parameters = read_spec(plain).parameters
    assert report.gradients == len(parameters)
    assert report.gradient_values == sum(int(np.prod(t.dims)) for t in plain.graph.initializer if t.name in parameters)
    a, b = TrainingSession(plain, lr=0.01), TrainingSession(dist, lr=0.01)
    rng = np.random.default_rng(0)
    labels_shape = [6, *[i for i in a._session.get_inputs() if i.name == "labels"][0].shape[1:]]
    for _ in range(3):
        x = rng.standard_normal((6, 16)).astype(np.float32)
        y = rng.standard_normal(labels_shape).astype(np.float32)
        assert b.step(x, y) == pytest.approx(a.step(x, y), rel=1e-6)
    for name, value in a.state().items():
        np.testing.assert_allclose(b.state()[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_collectives_are_chained_in_one_order() -> None:
    model = registry.build("mlp_gemm", size=16, width=0.125, seed=1)
    dist = _distributed_graph(model, 4)
    collective = [n for n in dist.graph.node if n.domain == "bnfuse" and n.input[-1].startswith("dist/token")]
    assert [n.name for n in collective] == collective_schedule(dist)
    for index, node in enumerate(collective):  # token i in, token i + 1 out: no two can reorder
        assert node.input[-1] == f"dist/token{index}" and node.output[-1] == f"dist/token{index + 1}"
    for loss in ("cross-entropy", "mse"):  # the local-count chain a dynamic batch computes is gone, nothing left over
        graph = _distributed_graph(model, 4, loss=loss).graph
        read = {name for node in graph.node for name in node.input}
        assert [t.name for t in graph.initializer if t.name not in read] == [], loss


@pytest.mark.parametrize(
    ("count", "size", "batch"), [(100, 3, 4), (24, 3, 4), (7, 3, 2), (5, 4, 3), (3, 3, 4), (97, 3, 4), (26, 3, 4)]
)
def test_epoch_split_gives_every_sample_once_in_the_global_batches(count: int, size: int, batch: int) -> None:
    from bnfuse.training.distributed import EpochSplit

    split = EpochSplit(count, size, batch, drop_last=False)
    every = [split.positions(rank) for rank in range(size)]
    assert all(len(steps) == split.steps for steps in every)  # every rank runs the same steps
    start = 0
    for step in range(split.steps):  # step s of every rank, in rank order, is global batch s
        together = [i for rank in range(size) for i in range(count)[every[rank][step]]]
        assert together == list(range(start, start + len(together)))
        start += len(together)
        sizes = [len(range(count)[every[rank][step]]) for rank in range(size)]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1 and max(sizes) <= batch + 1
        assert len(together) == batch * size or step == split.steps - 1
    assert start == count  # every sample once
    assert "every one of" in split.describe()


def test_epoch_split_with_drop_last_is_the_static_batch_behaviour() -> None:
    from bnfuse.training.distributed import DistributedError, EpochSplit, shard

    split = EpochSplit(100, 3, 4, drop_last=True)
    assert split.steps == (100 // 3) // 4 == 8
    for rank in range(3):
        share = shard(100, rank, 3)
        assert split.positions(rank) == [slice(share.start + 4 * i, share.start + 4 * i + 4) for i in range(8)]
    expected = "3 ranks x 4 samples per step, 8 steps per epoch: 96 of 100 samples each epoch (--drop-last)"
    assert split.describe() == expected
    assert EpochSplit(100, 3, 4, drop_last=False).describe() == (
        "3 ranks: every one of 100 samples once per epoch, 9 steps of 12 (4 per rank); the last step's 4 split "
        "2/1/1 over the ranks"
    )
    assert EpochSplit(97, 3, 4, drop_last=False).steps == 8  # a last sliver of 1 (< 3 ranks) joins step 8
    with pytest.raises(DistributedError, match="2 samples for 3 ranks"):
        EpochSplit(2, 3, 4, drop_last=False)
    with pytest.raises(DistributedError, match=r"3 samples per rank \(3 ranks\), fewer than the batch size 4"):
        EpochSplit(11, 3, 4, drop_last=True)
