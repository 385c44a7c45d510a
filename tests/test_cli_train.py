"""`bnfuse train-graph` and `bnfuse train`: files written, one-line errors (exit 2), trained model folds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from bnfuse.cli import main
from bnfuse.passes.training import read_spec
from bnfuse.training.session import TrainingSession


def write_conv_bn(path: Path) -> Path:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.full(4, 1.5, np.float32), "s"),
        numpy_helper.from_array(np.full(4, 0.1, np.float32), "b"),
        numpy_helper.from_array(np.full(4, 0.2, np.float32), "m"),
        numpy_helper.from_array(np.array([2, 1, 1, 1], np.float32), "v"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 3)).astype(np.float32), "fc"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"], name="bn"),
            helper.make_node("Relu", ["n"], ["r"]),
            helper.make_node("GlobalAveragePool", ["r"], ["p"]),
            helper.make_node("Flatten", ["p"], ["f"]),
            helper.make_node("MatMul", ["f", "fc"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return path


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def session_weights(
    train: Path, x: np.ndarray, labels: np.ndarray, *, epochs: int, lr: float, seed: int | None = 0
) -> dict[str, np.ndarray]:
    """What `bnfuse train` must write: TrainingSession steps over every sample each epoch (the last batch partial),
    in file order (seed None) or in the permutation drawn from (seed, epoch)."""
    session = TrainingSession(onnx.load(train), lr=lr)
    batch = session.batch_size
    for epoch in range(1, epochs + 1):
        order = np.random.default_rng([seed, epoch]).permutation(len(x)) if seed is not None else np.arange(len(x))
        for start in range(0, len(x), batch):
            index = order[start : start + batch]
            session.step(x[index], labels[index])
    return initializers(session.export_inference_model())


def write_data(path: Path) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x, labels = rng.standard_normal((10, 3, 6, 6)).astype(np.float32), rng.integers(0, 3, 10)
    np.savez(path, x=x, labels=labels)
    return x, labels


@pytest.mark.parametrize("portable", [False, True])
def test_train_graph_then_train_then_fold(tmp_path: Path, capsys: pytest.CaptureFixture[str], portable: bool) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    train = tmp_path / "train.onnx"
    argv = ["train-graph", str(source), "-o", str(train), "--batch-size", "4", "--sgd-momentum", "0.9"]
    assert main(argv + (["--portable"] if portable else [])) == 0
    out = capsys.readouterr().out
    assert "training graph:" in out and f"wrote {train}" in out
    spec = read_spec(onnx.load(train))
    assert spec.parameters == ["w", "s", "b", "fc"] and spec.running_stats == ["m", "v"]

    data = tmp_path / "data.npz"
    x, labels = write_data(data)
    trained = tmp_path / "trained.onnx"
    assert main(["train", str(train), "--data", str(data), "-o", str(trained), "--epochs", "2", "--lr", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "epoch 2/2: loss" in out and "3 steps" in out  # 10 samples: 4, 4 and the last 2
    # the trained weights and statistics: not the initial ones, exactly the 6 steps a TrainingSession takes
    got, initial = initializers(onnx.load(trained)), initializers(onnx.load(source))
    expected = session_weights(train, x, labels, epochs=2, lr=0.1)
    assert set(got) == set(expected) == set(initial)
    for name in initial:
        assert not np.allclose(got[name], initial[name]), f"{name} was not trained"
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)

    folded = tmp_path / "folded.onnx"
    argv = ["train", str(train), "--data", str(data), "-o", str(folded), "--epochs", "2", "--lr", "0.1", "--fold"]
    assert main(argv) == 0
    model = onnx.load(folded)
    assert not any(n.op_type == "BatchNormalization" for n in model.graph.node)
    probe = np.random.default_rng(2).standard_normal((2, 3, 6, 6)).astype(np.float32)  # dynamic batch is back
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": probe})[0]
    reference = ort.InferenceSession(str(trained), providers=["CPUExecutionProvider"]).run(None, {"x": probe})[0]
    assert y.shape == (2, 3)
    np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flag", [None, "lean", "speed"])
def test_train_uses_the_lean_memory_settings_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str | None
) -> None:
    """`bnfuse train` runs its session with memory="lean" (no memory pattern, graph order) by default; --memory speed
    keeps onnxruntime's defaults. The sessions are real: this only records the ones the command made."""
    from bnfuse.training import session as session_module

    made: list[TrainingSession] = []

    class Recorded(session_module.TrainingSession):
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(session_module, "TrainingSession", Recorded)
    source = write_conv_bn(tmp_path / "m.onnx")
    train = tmp_path / "train.onnx"
    assert main(["train-graph", str(source), "-o", str(train), "--batch-size", "4"]) == 0
    data = tmp_path / "data.npz"
    write_data(data)
    argv = ["train", str(train), "--data", str(data), "-o", str(tmp_path / "trained.onnx")]
    assert main(argv + (["--memory", flag] if flag else [])) == 0
    assert len(made) == 1
    options = made[0]._session.get_session_options()
    expected = "speed" if flag == "speed" else "lean"
    assert made[0].memory == expected
    if expected == "lean":
        assert (options.enable_mem_pattern, options.execution_order) == (False, ort.ExecutionOrder.PRIORITY_BASED)
    else:
        assert (options.enable_mem_pattern, options.execution_order) == (True, ort.ExecutionOrder.DEFAULT)


def test_train_shuffle_seed_is_the_session_in_that_order(tmp_path: Path) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    train = tmp_path / "train.onnx"
    assert main(["train-graph", str(source), "-o", str(train), "--batch-size", "4"]) == 0
    data = tmp_path / "data.npz"
    x, labels = write_data(data)
    results = {}
    for seed in (None, 0, 3):
        out = tmp_path / f"trained-{seed}.onnx"
        extra = ["--no-shuffle"] if seed is None else [] if seed == 0 else ["--shuffle-seed", str(seed)]
        assert main(["train", str(train), "--data", str(data), "-o", str(out), "--epochs", "2", *extra]) == 0
        results[seed] = initializers(onnx.load(out))
        expected = session_weights(train, x, labels, epochs=2, lr=0.01, seed=seed)
        for name, value in expected.items():
            np.testing.assert_array_equal(results[seed][name], value, err_msg=f"seed {seed}: {name}")
    # shuffled by default; other orders train to other weights
    assert not np.allclose(results[3]["w"], results[None]["w"])
    assert not np.allclose(results[0]["w"], results[None]["w"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train-graph", "{m}", "-o", "{t}", "--static-batch"], "dynamic dimension"),
        (
            ["train-graph", "{m}", "-o", "{t}", "--batch-size", "2", "--momentum-convention", "keras"],
            "momentum convention",
        ),
        (["train-graph", "{missing}", "-o", "{t}"], "no such file"),
        (["train-graph", "{m}", "-o", "{m}", "--batch-size", "2"], "refusing to overwrite"),
        (["train", "{g}", "--data", "{npz}", "-o", "{t}", "--sgd-momentum", "0.9"], "already a training graph"),
        (["train", "{g}", "--data", "{missing_npz}", "-o", "{t}"], "not a readable .npz file"),
        (["train", "{g}", "--data", "{npz}", "-o", "{t}", "--epochs", "0"], "--epochs 0: must be >= 1"),
        (["train-graph", "{m}", "-o", "{t}", "--nchwc", "--portable"], "--nchwc and --portable: not together"),
        (["train-graph", "{m}", "-o", "{t}", "--nchwc", "--distributed"], "--nchwc and --distributed: not together"),
    ],
)
def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    names = {"m": write_conv_bn(tmp_path / "m.onnx"), "t": tmp_path / "t.onnx", "missing": tmp_path / "missing.onnx"}
    names |= {"missing_npz": tmp_path / "missing.npz", "npz": tmp_path / "data.npz"}
    write_data(names["npz"])
    if "{g}" in argv:  # a real training graph, so the error is the one about the data
        names["g"] = tmp_path / "train.onnx"
        assert main(["train-graph", str(names["m"]), "-o", str(names["g"]), "--batch-size", "4"]) == 0
        capsys.readouterr()
    assert main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "t.onnx").exists()


def test_train_graph_refuses_a_model_without_batchnorm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = onnx.load(str(write_conv_bn(tmp_path / "m.onnx")))
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    model.graph.node.remove(bn)
    next(n for n in model.graph.node if n.op_type == "Relu").input[0] = "c"  # as if an exporter folded the BN
    source = tmp_path / "folded.onnx"
    onnx.save(model, str(source))
    assert main(["train-graph", str(source), "-o", str(tmp_path / "t.onnx"), "--batch-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "no BatchNormalization" in err and "optimize=False" in err and "docs/exporting.md" in err
    assert not (tmp_path / "t.onnx").exists()


def test_train_rejects_bad_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    train = tmp_path / "train.onnx"
    assert main(["train-graph", str(source), "-o", str(train), "--batch-size", "4"]) == 0
    data = tmp_path / "d.npz"
    np.savez(data, images=np.zeros((8, 3, 6, 6), np.float32))
    assert main(["train", str(train), "--data", str(data), "-o", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err
    assert f"{data}: no array for input 'x' (arrays: images; accepted: 'x' or 'X')\n" in err


def test_train_graph_parameter_groups_and_running_statistics_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    train = tmp_path / "train.onnx"
    argv = ["train-graph", str(source), "-o", str(train), "--batch-size", "4", "--weight-decay", "1e-3"]
    argv += ["--no-decay", "@bn", "--weight-decay", "fc=0.5", "--lr-mult", "fc=0.1"]
    argv += ["--momentum-convention", "cumulative", "--biased-running-var"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "weight decay: 0.5 on 1 tensors, 0.001 on 1 tensors, 0 on 2 tensors; lr x0.1 on 1 tensors" in out
    assert "momentum cumulative moving average (1/(1+n), PyTorch momentum=None); running variance biased" in out
    assert read_spec(onnx.load(train)).counters == ["bn.num_batches_tracked"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lr-mult", "fc"], "expected PATTERN=VALUE"),
        (["--weight-decay", "fc=x"], "expected PATTERN=VALUE"),
        (["--weight-decay", "x"], "expected WD or GLOB=WD"),
        (["--no-decay", "@convs"], "unknown parameter role"),
        (["--no-decay", "nothing*"], "matches no trainable parameter"),
        (["--momentum-convention", "cumulative", "--bn-momentum", "0.1"], "takes no momentum"),
    ],
)
def test_parameter_group_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    argv = ["train-graph", str(source), "-o", str(tmp_path / "t.onnx"), "--batch-size", "2", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "t.onnx").exists()


def test_train_writes_the_state_dict_under_the_model_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    train, data = tmp_path / "train.onnx", tmp_path / "d.npz"
    x, labels = write_data(data)
    assert main(["train-graph", str(source), "-o", str(train), "--batch-size", "4"]) == 0
    out, state = tmp_path / "trained.onnx", tmp_path / "state.npz"
    assert main(["train", str(train), "--data", str(data), "-o", str(out), "--state-dict", str(state)]) == 0
    assert f"wrote {state}" in capsys.readouterr().out
    trained = initializers(onnx.load(out))
    with np.load(state) as saved:
        assert set(saved.files) == {"w", "s", "b", "m", "v", "fc"}
        for name in saved.files:
            np.testing.assert_array_equal(saved[name], trained[name], err_msg=name)
    assert main(["train", str(train), "--data", str(data), "-o", str(out), "--state-dict", "s.pt"]) == 2
    assert "written as .npz" in capsys.readouterr().err
    missing = str(tmp_path / "no" / "s.npz")
    assert main(["train", str(train), "--data", str(data), "-o", str(out), "--state-dict", missing]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_train_graph_distributed_writes_the_synchronized_step(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from bnfuse.passes.training.distribute import collective_schedule

    source = write_conv_bn(tmp_path / "m.onnx")
    out = tmp_path / "d.onnx"
    assert main(["train-graph", str(source), "-o", str(out), "--distributed", "--batch-size", "3"]) == 0
    assert "synchronized BN forward" in capsys.readouterr().out
    model = onnx.load(out)
    ops = {n.op_type for n in model.graph.node if n.domain == "bnfuse"}
    from bnfuse.runtime import conv_grad

    weight_grads = {"ConvWeightGrad"} if conv_grad.available() else set()  # the Conv weight gradient on oneDNN
    expected = {"SyncBatchNormalizationTraining", "SyncBatchNormalizationGrad", "AllReduceSum", "SGDStep"}
    assert ops == expected | set(weight_grads)
    assert len(collective_schedule(model)) == 2 + 1 + 2  # BN forward and backward, the gradient bucket, count, loss
    assert main(["train-graph", str(source), "-o", str(out), "--distributed", "--portable", "--batch-size", "3"]) == 2
    assert "needs bnfuse's custom ops" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (np.array([0, 1, 2, 3, 0, 1, 2, 0, 1, 2]), "labels: 3 at [3] is not a class index in [0, 3) (1 such labels)"),
        (np.array([0, 1, -1, 2, 0, 1, 2, 0, 1, 2]), "labels: -1 at [2] is not a class index in [0, 3)"),
        (np.array([0, 1.5, 1, 2, 0, 1, 2, 0, 1, 2]), "labels: 1.5 at [1] is not a class index in [0, 3)"),
        (np.array(["a"] * 10), "labels: expected numbers"),
    ],
    ids=["too-large", "negative", "fractional", "text"],
)
def test_bad_labels_are_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], labels: np.ndarray, message: str
) -> None:
    train = tmp_path / "train.onnx"
    assert main(["train-graph", str(write_conv_bn(tmp_path / "m.onnx")), "-o", str(train), "--batch-size", "4"]) == 0
    capsys.readouterr()
    data = tmp_path / "data.npz"
    np.savez(data, x=np.zeros((10, 3, 6, 6), np.float32), labels=labels)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["train", str(train), "--data", str(data), "-o", str(tmp_path / "out.onnx")]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"bnfuse train: error: {message}") and captured.err.count("\n") == 1
    assert captured.out == ""  # refused before the first step
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_nan_in_the_data_stops_at_the_step_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train = tmp_path / "train.onnx"
    assert main(["train-graph", str(write_conv_bn(tmp_path / "m.onnx")), "-o", str(train), "--batch-size", "4"]) == 0
    capsys.readouterr()
    data = tmp_path / "data.npz"
    x, labels = write_data(data)
    x[5, 0, 0, 0] = np.nan  # sample 5: in the second batch of 4
    np.savez(data, x=x, labels=labels)
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = ["train", str(train), "--data", str(data), "-o", str(tmp_path / "out.onnx"), "--fold", "--no-shuffle"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("bnfuse train: error: epoch 1, step 2: the loss is nan") and err.count("\n") == 1
    assert "nothing written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_train_outputs_over_their_inputs_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    before = source.read_bytes()
    assert main(["train-graph", str(source), "-o", str(tmp_path / "sub" / ".." / "m.onnx")]) == 2
    assert "refusing to overwrite the input model" in capsys.readouterr().err
    assert source.read_bytes() == before
    train = tmp_path / "train.onnx"
    assert main(["train-graph", str(source), "-o", str(train), "--batch-size", "4"]) == 0
    data = tmp_path / "data.npz"
    write_data(data)
    capsys.readouterr()
    for target, what in ((train, "input model"), (data, "training data")):
        digest = target.read_bytes()
        assert main(["train", str(train), "--data", str(data), "-o", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.endswith(f"refusing to overwrite the {what}\n")
        assert target.read_bytes() == digest


# --- spellings that used to bite -----------------------------------------------------------------


def test_lr_is_not_an_abbreviation_of_lr_mult(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    with pytest.raises(SystemExit) as exit_info:
        main(["train-graph", str(source), "-o", str(tmp_path / "t.onnx"), "--lr", "0.05"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --lr 0.05" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no prefix of any option is taken for it
        main(["train", str(source), "--data", "d.npz", "-o", str(tmp_path / "t.onnx"), "--shuffle", "1"])
    assert "unrecognized arguments: --shuffle 1" in capsys.readouterr().err
    assert not (tmp_path / "t.onnx").exists()


def test_momentum_spellings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    train = tmp_path / "t.onnx"
    # train-graph --momentum: still the BN statistics' momentum, with a warning that names both spellings
    assert main(["train-graph", str(source), "-o", str(train), "--momentum", "0.8"]) == 0
    captured = capsys.readouterr()
    assert "--momentum is deprecated" in captured.err and "--bn-momentum" in captured.err
    assert "--sgd-momentum" in captured.err and "momentum 0.8" in captured.out
    assert "SGD(momentum=0.0" in captured.out
    # train: --sgd-momentum builds the graph with it; a bare --momentum is refused as ambiguous
    data = tmp_path / "data.npz"
    write_data(data)
    out = tmp_path / "o.onnx"
    argv = ["train", str(source), "--data", str(data), "-o", str(out), "--batch-size", "4"]
    assert main([*argv, "--sgd-momentum", "0.9", "--bn-momentum", "0.7"]) == 0
    captured = capsys.readouterr().out
    assert "SGD(momentum=0.9" in captured and "momentum 0.7" in captured and out.is_file()
    out.unlink()
    assert main([*argv, "--momentum", "0.9"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--sgd-momentum" in err and "--bn-momentum" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_train_fold_prints_no_option_train_lacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    data = tmp_path / "data.npz"
    write_data(data)
    argv = ["train", str(source), "--data", str(data), "-o", str(tmp_path / "o.onnx"), "--batch-size", "4", "--fold"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "bnfuse optimize:" in out and "1 folded" in out
    assert "-v" not in out and "format_text" not in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--keep", "best"], "--keep best needs validation data"),
        (["--val-split", "0.1", "--val-data", "{npz}"], "give --val-data or --val-split, not both"),
        (["--val-split", "1.5"], "--val-split 1.5: must be a fraction between 0 and 1"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--checkpoint-dir", "{tmp}/none", "--resume"], "--resume: no checkpoint"),
        (["--lr-schedule", "cosine", "--warmup-epochs", "1"], "--warmup-epochs 1: must be >= 0 and fewer than"),
        (["--batch-size", "0"], "--batch-size 0: must be >= 1"),
        (["--val-data", "{labelless}"], "labelless.npz: no labels array (arrays: X; accepted: 'labels' or 'y')"),
        (["--val-data", "{uneven}"], "uneven.npz: arrays have different sample counts (X 3, labels 2)"),
        (["--val-data", "{scalar}"], "scalar.npz: array 'labels' is a scalar, not a batch of samples"),
    ],
)
def test_job_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    source = write_conv_bn(tmp_path / "m.onnx")
    data = tmp_path / "data.npz"
    write_data(data)
    np.savez(tmp_path / "labelless.npz", X=np.zeros((3, 3, 6, 6), np.float32))
    np.savez(tmp_path / "uneven.npz", X=np.zeros((3, 3, 6, 6), np.float32), labels=np.zeros(2, np.int64))
    np.savez(tmp_path / "scalar.npz", X=np.zeros((3, 3, 6, 6), np.float32), labels=np.int64(0))
    names = {"npz": data, "tmp": tmp_path} | {n: tmp_path / f"{n}.npz" for n in ("labelless", "uneven", "scalar")}
    argv = ["train", str(source), "--data", str(data), "-o", str(tmp_path / "o.onnx")]
    assert main(argv + [a.format(**names) for a in extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o.onnx").exists()
