"""The scikit-learn face of the room's embedders: light curves in, an embedding matrix out.

Every embedder is a scikit-learn transformer (``BaseEstimator`` + ``TransformerMixin``): ``__init__`` stores its
parameters verbatim, so ``get_params``/``set_params``/``sklearn.clone`` work, and ``fit``/``transform``/
``fit_transform`` take ``X`` = a sequence of :class:`LightCurve` (a list, tuple or 1-D object array; ragged: each
curve has its own epochs), so they drop into ``Pipeline``, ``cross_val_score`` and ``GridSearchCV`` in front of
any classifier. ``transform`` returns a float64 array [n_curves, d].

Ragged light curves are not a 2-D numeric array, so the embedders declare ``input_tags.two_d_array = False``;
scikit-learn's estimator checks that feed random 2-D arrays therefore do not apply (the README lists which do).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sklearn.base import BaseEstimator, TransformerMixin

from .data import LightCurve


def as_curves(X, what: str = "X") -> list:
    """Validate ``X`` as a non-empty sequence of LightCurve objects and return it as a list (no copy of the data).

    Raises TypeError for anything else (a 2-D array, a single LightCurve, a string) and ValueError when empty.
    """
    if isinstance(X, LightCurve):
        raise TypeError(f"{what} must be a sequence of LightCurve objects, got a single LightCurve; wrap it: [curve]")
    if isinstance(X, np.ndarray) and (X.dtype != object or X.ndim != 1):
        raise TypeError(f"{what} must be a sequence of LightCurve objects (ragged light curves), got a {X.ndim}-D "
                        f"{X.dtype} array of shape {X.shape}; build one LightCurve(t, mag, err) per star")
    if isinstance(X, (str, bytes)) or not isinstance(X, (Sequence, np.ndarray)):
        raise TypeError(f"{what} must be a sequence of LightCurve objects, got {type(X).__name__}")
    curves = list(X)
    if not curves:
        raise ValueError(f"{what} is empty: got 0 light curves")
    for i, lc in enumerate(curves):
        if not isinstance(lc, LightCurve):
            raise TypeError(f"{what}[{i}] must be a LightCurve, got {type(lc).__name__}")
    return curves


class CurveEmbedder(TransformerMixin, BaseEstimator):
    """Shared scikit-learn plumbing of the embedders; subclasses implement ``_check_params`` and ``_embed``.

    ``fit(X, y=None)`` validates the parameters, the curves and (when given) the labels' length, then calls
    ``_fit``; ``transform(X)`` validates the curves and returns ``_embed(curves)`` as float64 [n_curves, d].
    """

    name = "embedder"

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.two_d_array = False  # ragged sequences of LightCurve, not a numeric matrix
        tags.requires_fit = self._requires_fit
        tags.non_deterministic = False
        return tags

    _requires_fit = True

    def __sklearn_is_fitted__(self) -> bool:
        return not self._requires_fit or hasattr(self, "n_features_out_")

    def _check_params(self) -> None:
        """Raise ValueError/TypeError naming a bad parameter (called by fit and by an unfitted transform)."""

    def _fit(self, curves: list) -> int:
        """Fit on the validated curves; return the embedding width d."""
        raise NotImplementedError

    def _embed(self, curves: list) -> np.ndarray:
        raise NotImplementedError

    def fit(self, X, y=None):
        """Check parameters, curves and labels, then fit; returns self. ``y`` is ignored (the embedders are
        unsupervised, as in the paper) but must have one label per curve when given."""
        self._check_params()
        curves = as_curves(X)
        if y is not None and len(y) != len(curves):
            raise ValueError(f"X and y have inconsistent numbers of samples: {len(curves)} light curves, "
                             f"{len(y)} labels")
        self.n_features_out_ = self._fit(curves)
        return self

    def transform(self, X) -> np.ndarray:
        """Embeddings [n_curves, d] (float64, finite) of the curves in ``X``."""
        from sklearn.utils.validation import check_is_fitted

        check_is_fitted(self)
        if not hasattr(self, "n_features_out_"):  # stateless and never fitted: its parameters are unchecked
            self._check_params()
        curves = as_curves(X)
        return np.asarray(self._embed(curves), dtype=np.float64)

    def get_feature_names_out(self, input_features=None) -> np.ndarray:
        """Output column names: ``<name>0 .. <name>{d-1}`` (the hand-crafted embedder names its features)."""
        from sklearn.utils.validation import check_is_fitted

        check_is_fitted(self)
        return np.asarray([f"{self.name}{i}" for i in range(self._width())], dtype=object)

    def _width(self) -> int:
        return self.n_features_out_
