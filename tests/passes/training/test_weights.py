"""Weights detached while the training pass builds: the graph is the one built with every weight inline, bit for bit;
the input model is left as it was; a session on the handed-over arrays steps as one on the graph's initializers."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from bnfuse.errors import ModelError
from bnfuse.io import read_mapped
from bnfuse.passes.training import SGD, Adam, build_training_graph, weights
from bnfuse.passes.training.build import build_detached
from bnfuse.passes.training.spec import read_spec
from bnfuse.training.session import TrainingSession
from tests.loaders import torch_nets

torch = pytest.importorskip("torch")
nets = torch_nets()


def _model(kind: str) -> onnx.ModelProto:
    net, shape = nets.make(kind, seed=5)
    return nets.export(net, torch.randn(*shape))


def _detached_counts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tensors each build detaches (recorded as it copies the model)."""
    counts: list[int] = []
    original = weights.detached_copy

    def counting(model: onnx.ModelProto) -> tuple[onnx.ModelProto, weights.Detached]:
        copy, store = original(model)
        counts.append(len(store))
        return copy, store

    monkeypatch.setattr(weights, "detached_copy", counting)
    return counts


def _frozen_subset(model: onnx.ModelProto) -> list[str]:
    """A few weights to train; the other large ones stay constants of the graph (onnx-ad reads their values)."""
    large = [t.name for t in model.graph.initializer if t.name.endswith("weight") and len(t.dims) == 4]
    return large[:2]


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("resnet", {}),
        ("resnet", {"static_batch": True, "batch_size": 6, "optimizer": Adam(), "fix_gamma": True}),
        ("resnet", {"portable": True, "optimizer": SGD(momentum=0.9)}),
        ("resnet", {"trainable": "frozen subset"}),
        ("convzoo", {"frozen_bn": True, "batch_size": 4}),
        ("mlp", {"optimizer": Adam(weight_decay=1e-3)}),
    ],
    ids=["resnet", "resnet-static-adam-fix-gamma", "resnet-portable", "resnet-frozen-weights", "convzoo", "mlp-adam"],
)
def test_the_graph_is_the_one_built_with_every_weight_inline(
    kind: str, options: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(kind)
    if options.get("trainable") == "frozen subset":
        options = {**options, "trainable": _frozen_subset(model)}
    counts = _detached_counts(monkeypatch)
    monkeypatch.setattr(weights, "MIN_DETACH_BYTES", 64)  # small nets: every float tensor but the tiniest detached
    detached, _ = build_training_graph(model, **options)
    assert counts and counts[0] > 0  # the build did run on placeholders
    monkeypatch.setattr(weights, "MIN_DETACH_BYTES", 2**62)  # nothing detached: every weight inline throughout
    inline, _ = build_training_graph(model, **options)
    assert counts[-1] == 0
    assert detached.SerializeToString() == inline.SerializeToString()
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in detached.graph.initializer)


def test_the_input_model_is_left_as_it_was() -> None:
    model = _model("resnet")
    before = model.SerializeToString()
    build_training_graph(model)
    assert model.SerializeToString() == before


def test_a_session_on_the_handed_over_arrays_steps_as_one_on_the_initializers() -> None:
    model = _model("resnet")
    graph, _ = build_training_graph(model, optimizer=SGD(momentum=0.9))
    owned = onnx.ModelProto()
    owned.CopyFrom(model)
    store = weights.detach(owned)
    assert len(store) > 0
    bare, _ = build_detached(owned, store, optimizer=SGD(momentum=0.9))
    state = weights.take(bare, store, read_spec(bare).state)
    assert state and all(array.flags.writeable for array in state.values())
    assert not any(t.name in state for t in bare.graph.initializer)  # the graph holds no copy of them
    weights.attach(bare, store)
    reference = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
    for name, array in state.items():
        np.testing.assert_array_equal(array, reference[name], err_msg=name)
    ours, theirs = TrainingSession(bare, lr=0.05, initial_state=state), TrainingSession(graph, lr=0.05)
    rng = np.random.default_rng(0)
    shape = (5, *[d.dim_value for d in graph.graph.input[0].type.tensor_type.shape.dim[1:]])
    for _ in range(3):
        x, labels = rng.standard_normal(shape).astype(np.float32), rng.integers(0, 10, shape[0])
        assert ours.step(x, labels) == theirs.step(x, labels)
    for name, value in theirs.state().items():
        np.testing.assert_array_equal(ours.state()[name], value, err_msg=name)
    exported, expected = ours.export_inference_model(), theirs.export_inference_model()
    assert exported.SerializeToString() == expected.SerializeToString()


def test_a_placeholder_of_another_store_is_not_resolved() -> None:
    tensor = numpy_helper.from_array(np.ones((32, 32), np.float32), "w")
    graph = onnx.helper.make_graph([], "g", [], [], [tensor])
    model = onnx.helper.make_model(graph)
    store = weights.detach(model)
    placeholder = model.graph.initializer[0]
    assert len(store) == 1 and store.location(placeholder) is not None and not placeholder.raw_data
    other = weights.Detached()
    assert other.raw(placeholder) is None
    weights.attach(model, other)  # not its placeholder: left as it is
    assert model.graph.initializer[0].data_location == onnx.TensorProto.EXTERNAL
    weights.attach(model, store)
    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[0]), np.ones((32, 32), np.float32))


def test_a_model_with_external_tensors_is_not_detached() -> None:
    inline = numpy_helper.from_array(np.ones((32, 32), np.float32), "w")
    external = onnx.TensorProto(name="e", data_type=onnx.TensorProto.FLOAT, dims=[4])
    external.data_location = onnx.TensorProto.EXTERNAL
    entry = external.external_data.add()
    entry.key, entry.value = "location", "e.bin"
    model = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], [], [inline, external]))
    assert len(weights.detach(model)) == 0
    assert model.graph.initializer[0].raw_data == inline.raw_data


def test_a_static_build_is_the_one_piece_build_of_the_inline_model() -> None:
    """build_training_graph (weights detached, prepare_source then build_prepared) == assemble.build_static on the
    model as given (every weight inline, one piece), bit for bit once the spec's default batch size is recorded."""
    from bnfuse.passes.training import assemble, build, dynamic_batch, prepare
    from bnfuse.passes.training.spec import set_spec

    model = _model("resnet")
    ours, _ = build_training_graph(model, static_batch=True, batch_size=4, optimizer=Adam())
    options = {k: v for k, v in build._option_defaults().items() if k != "nchwc"} | {"optimizer": Adam()}
    relaxed = dynamic_batch.without_batch_sizes(model, {i.name for i in prepare.data_inputs(model)})  # as build.py
    theirs, _ = assemble.build_static(relaxed, **options, batch_size=4, input_shapes=None)
    spec = read_spec(theirs)
    spec.batch_size = 4
    set_spec(theirs, spec)
    assert ours.SerializeToString() == theirs.SerializeToString()


def test_a_model_file_is_checked_on_its_placeholders(tmp_path: Path) -> None:
    """build_training_graph(path) runs onnx's checker on the model with its weights detached: a valid model's
    placeholders pass as inputs of their type and shape; a model the checker refuses still fails in one line, here
    a weight given twice (both large: both placeholders)."""
    model = _model("resnet")
    path = tmp_path / "resnet.onnx"
    onnx.save(model, str(path))
    from_file, _ = build_training_graph(str(path))
    assert from_file.SerializeToString() == build_training_graph(model)[0].SerializeToString()
    source = onnx.load(str(path))
    store = weights.detach(source)
    checkable = weights.checkable_source(source, store)
    placeholders = {t.name for t in source.graph.initializer if store.location(t) is not None}
    assert placeholders and placeholders <= {i.name for i in checkable.graph.input}
    assert not placeholders & {t.name for t in checkable.graph.initializer}
    onnx.checker.check_model(checkable)
    weight = next(t for t in model.graph.initializer if t.name in placeholders)
    model.graph.initializer.append(weight)
    onnx.save(model, str(path))
    with pytest.raises(ModelError, match=rf"^{re.escape(str(path))}: invalid ONNX model \(.*{re.escape(weight.name)}"):
        build_training_graph(str(path))


def test_a_mapped_file_detaches_what_detach_would_and_keeps_the_rest_inline(tmp_path: Path) -> None:
    """weights.detach_payloads of bnfuse.io.read_mapped's model: the large float weight a placeholder of the mapped
    bytes, a BN's large parameters and a large int64 tensor inline again, every value as in the file."""
    rng = np.random.default_rng(0)
    arrays = {
        "w": rng.standard_normal((1024, 3, 1, 1)).astype(np.float32),
        "scale": rng.standard_normal(1024).astype(np.float32),
        "bias": rng.standard_normal(1024).astype(np.float32),
        "mean": np.zeros(1024, np.float32),
        "var": np.ones(1024, np.float32),
        "ints": np.arange(1024, dtype=np.int64),
    }
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Conv", ["x", "w"], ["c"]),
            onnx.helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["y"]),
        ],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 2, 2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 1024, 2, 2])],
        [numpy_helper.from_array(array, name) for name, array in arrays.items()],
    )
    path = tmp_path / "m.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)]), str(path))
    mapped = read_mapped(path)
    assert mapped is not None
    model, payloads = mapped
    assert len(payloads) == len(arrays)  # every one of them at least 4 KiB: all mapped
    store = weights.detach_payloads(model, payloads)
    assert len(payloads) == 0 and len(store) == 1
    tensors = {t.name: t for t in model.graph.initializer}
    assert weights.is_placeholder(tensors["w"]) and store.location(tensors["w"]) is not None
    for name in arrays.keys() - {"w"}:
        assert not weights.is_placeholder(tensors[name]), name
        np.testing.assert_array_equal(numpy_helper.to_array(tensors[name]), arrays[name])
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    taken = weights.take(copy, store, ["w"])  # the array a session gets, writable, from the mapped bytes
    np.testing.assert_array_equal(taken["w"], arrays["w"])
    assert taken["w"].flags.writeable and "w" not in {t.name for t in copy.graph.initializer}
    remapped = read_mapped(path)
    assert remapped is not None
    model = remapped[0]
    store = weights.detach_payloads(*remapped)
    tensors = {t.name: t for t in model.graph.initializer}
    weights.attach(model, store)
    np.testing.assert_array_equal(numpy_helper.to_array(tensors["w"]), arrays["w"])
    onnx.checker.check_model(model)
