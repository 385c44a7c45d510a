"""Training data: .npz layouts, validation splits, the seeded epoch order, batches, label checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bnfuse.errors import BnfuseError
from bnfuse.training import data


@pytest.mark.parametrize(("x_name", "y_name"), [("x", "labels"), ("X", "y"), ("input", "labels"), ("input", "y")])
def test_accepted_layouts(tmp_path: Path, x_name: str, y_name: str) -> None:
    x, y = np.arange(12, dtype=np.float32).reshape(6, 2), np.arange(6)
    np.savez(tmp_path / "d.npz", **{x_name: x, y_name: y})
    loaded = data.load_npz(tmp_path / "d.npz", ["input"], "labels")
    np.testing.assert_array_equal(loaded.inputs["input"], x)
    np.testing.assert_array_equal(loaded.labels, y)


def test_layout_errors_list_what_is_accepted(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", images=np.zeros((4, 2)), y=np.zeros(4))
    with pytest.raises(BnfuseError, match=r"no array for input 'input' \(arrays: images, y; accepted: "
                       r"'input' or 'x' or 'X'\)$"):  # fmt: skip
        data.load_npz(tmp_path / "d.npz", ["input"], "labels")
    np.savez(tmp_path / "two.npz", a=np.zeros((4, 2)), b=np.zeros(4), labels=np.zeros(4))
    with pytest.raises(BnfuseError, match=r"no array for input 'c' \(arrays: a, b, labels; accepted: 'a', 'c'\)$"):
        data.load_npz(tmp_path / "two.npz", ["a", "c"], "labels")
    np.savez(tmp_path / "nolabels.npz", x=np.zeros((4, 2)))
    with pytest.raises(BnfuseError, match=r"no labels array \(arrays: x; accepted: 'target' or 'labels' or 'y'\)$"):
        data.load_npz(tmp_path / "nolabels.npz", ["input"], "target")
    np.savez(tmp_path / "uneven.npz", x=np.zeros((4, 2)), labels=np.zeros(3))
    with pytest.raises(BnfuseError, match=r"different sample counts \(x 4, labels 3\)"):
        data.load_npz(tmp_path / "uneven.npz", ["input"], "labels")
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 2)), labels=np.zeros(0))
    with pytest.raises(BnfuseError, match="the data file holds no samples"):
        data.load_npz(tmp_path / "empty.npz", ["input"], "labels")


@pytest.mark.parametrize("target", ["labels", None])
def test_file_faults_give_one_line_with_or_without_labels(tmp_path: Path, target: str | None) -> None:
    """The faults `bnfuse train` (labels) and `bnfuse recalibrate` (no labels) share, each with its one message."""
    np.savez(tmp_path / "none.npz")
    np.savez(tmp_path / "scalar.npz", x=np.float32(1), labels=np.zeros(4))
    np.save(tmp_path / "lone.npy", np.zeros((4, 2)))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    np.savez(tmp_path / "pickled.npz", x=np.array([{"a": 1}] * 4, dtype=object), labels=np.zeros(4))
    cases = {
        "none.npz": "the data file holds no arrays",
        "scalar.npz": "array 'x' is a scalar, not a batch of samples",
        "lone.npy": "not a readable .npz file (a .npy array, not an .npz archive of named arrays)",
        "junk.npz": "not a readable .npz file (",
        "pickled.npz": "not a readable .npz file (Object arrays cannot be loaded when allow_pickle=False)",
        "missing.npz": "not a readable .npz file (",
    }
    for name, message in cases.items():
        with pytest.raises(BnfuseError) as raised:
            data.load_arrays(tmp_path / name, ["input"], target)
        assert str(raised.value).startswith(f"{tmp_path / name}: {message}") and "\n" not in str(raised.value), name
    np.savez(tmp_path / "labelled.npz", X=np.ones((3, 2)), labels=np.zeros(5))  # labels only read with a target
    if target is None:
        inputs, labels = data.load_arrays(tmp_path / "labelled.npz", ["input"], target)
        assert labels is None and list(inputs) == ["input"] and inputs["input"].shape == (3, 2)
    else:
        with pytest.raises(BnfuseError, match=r"different sample counts \(X 3, labels 5\)"):
            data.load_arrays(tmp_path / "labelled.npz", ["input"], target)


def test_split_is_seeded_and_disjoint() -> None:
    whole = data.Dataset({"x": np.arange(50, dtype=np.float32)[:, None]}, np.arange(50))
    train, val = data.split(whole, 0.2, seed=3)
    assert (len(train), len(val)) == (40, 10)
    assert sorted(np.concatenate([train.labels, val.labels]).tolist()) == list(range(50))
    again, _ = data.split(whole, 0.2, seed=3)
    np.testing.assert_array_equal(again.labels, train.labels)
    other, _ = data.split(whole, 0.2, seed=4)
    assert not np.array_equal(other.labels, train.labels)


def test_every_sample_once_per_epoch_in_a_seeded_order() -> None:
    orders = [data.epoch_order(23, epoch, seed=0) for epoch in (1, 2)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(23))
    assert not np.array_equal(orders[0], orders[1])
    np.testing.assert_array_equal(data.epoch_order(23, 2, seed=0), orders[1])  # any epoch, no replay
    np.testing.assert_array_equal(data.epoch_order(23, 5, seed=None), np.arange(23))
    sizes = [len(b) for b in data.batches(orders[0], 5, drop_last=False)]
    assert sizes == [5, 5, 5, 5, 3] and data.step_count(23, 5, False) == 5
    assert [len(b) for b in data.batches(orders[0], 5, drop_last=True)] == [5] * 4 and data.step_count(23, 5, True) == 4
    assert np.concatenate(list(data.batches(orders[0], 5, drop_last=False))).tolist() == orders[0].tolist()


def test_label_checks() -> None:
    data.check_labels(np.array([0, 2, 1]), "cross-entropy", 3)
    with pytest.raises(BnfuseError, match=r"3 at \[1\] is not a class index in \[0, 3\)"):
        data.check_labels(np.array([0, 3, 1]), "cross-entropy", 3)
    with pytest.raises(BnfuseError, match="val.npz: labels: nan"):
        data.check_labels(np.array([0.5, np.nan]), "mse", None, where="val.npz: labels")
