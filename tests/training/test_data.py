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
    with pytest.raises(BnfuseError, match=r"no array for input 'input' \(arrays: images, y; accepted: inputs "
                       r"'input' or 'x' or 'X'; labels 'labels' or 'y'\)"):  # fmt: skip
        data.load_npz(tmp_path / "d.npz", ["input"], "labels")
    np.savez(tmp_path / "two.npz", a=np.zeros((4, 2)), b=np.zeros(4), labels=np.zeros(4))
    with pytest.raises(BnfuseError, match=r"no array for input 'c' .*accepted: inputs 'a', 'c'; labels"):
        data.load_npz(tmp_path / "two.npz", ["a", "c"], "labels")
    np.savez(tmp_path / "uneven.npz", x=np.zeros((4, 2)), labels=np.zeros(3))
    with pytest.raises(BnfuseError, match=r"different sample counts \(input 4, labels 3\)"):
        data.load_npz(tmp_path / "uneven.npz", ["input"], "labels")
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 2)), labels=np.zeros(0))
    with pytest.raises(BnfuseError, match="no samples"):
        data.load_npz(tmp_path / "empty.npz", ["input"], "labels")


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
