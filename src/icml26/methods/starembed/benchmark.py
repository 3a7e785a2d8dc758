"""The StarEmbed protocol for any embedding model: classification with fixed probes, clustering, OOD detection.

Plug in a model by writing an object with ``fit(curves, labels) -> self`` and ``transform(curves) -> [n, d]``
(the :class:`Embedder` protocol; sklearn transformers fit it). ``evaluate`` returns one flat dict of metrics.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from .config import StarEmbedConfig
from .data import LightCurve, LightCurveDataset, _check_seed


@runtime_checkable
class Embedder(Protocol):
    """``fit(X, y=None) -> self`` and ``transform(X) -> [n, d]`` with X a sequence of LightCurve; the room's
    embedders are scikit-learn transformers that satisfy it (``base.CurveEmbedder``)."""

    def fit(self, X: Sequence[LightCurve], y: np.ndarray | None = None) -> "Embedder": ...

    def transform(self, X: Sequence[LightCurve]) -> np.ndarray: ...


def _check(X: np.ndarray, n: int, what: str) -> np.ndarray:
    raw = np.asarray(X)
    if raw.dtype == object or not (np.issubdtype(raw.dtype, np.number) or raw.dtype == bool):
        raise TypeError(f"{what} must be a numeric array, got {type(X).__name__} of dtype {raw.dtype}")
    if np.iscomplexobj(raw):
        raise TypeError(f"{what} must be real, got complex values (dtype {raw.dtype})")
    X = raw.astype(float)
    if X.ndim != 2 or X.shape[0] != n:
        raise ValueError(f"{what} must be a 2-D array with one row per light curve ({n}), got shape {X.shape}")
    if X.shape[1] == 0:
        raise ValueError(f"{what} have 0 features: shape {X.shape}")
    if not np.all(np.isfinite(X)):
        raise ValueError(f"{what} contains NaN or inf values")
    return X


def hungarian_macro_f1(y: np.ndarray, cluster: np.ndarray) -> float:
    """Macro-F1 after mapping clusters to classes with the Hungarian algorithm on the confusion matrix."""
    from scipy.optimize import linear_sum_assignment
    from sklearn.metrics import f1_score

    labels, clusters = np.unique(y), np.unique(cluster)
    cm = np.array([[np.sum((cluster == c) & (y == l)) for l in labels] for c in clusters])
    rows, cols = linear_sum_assignment(-cm)
    mapping = {clusters[r]: labels[c] for r, c in zip(rows, cols)}
    pred = np.array([mapping.get(c, "__unmatched__") for c in cluster], dtype=object)
    return float(f1_score(y.astype(object), pred, labels=labels.astype(object), average="macro", zero_division=0))


def classification_task(Xtr, ytr, Xte, yte, cfg: StarEmbedConfig, seed: int) -> dict:
    """Standardise, then random forest (fixed paper HPO best), kNN and balanced logistic regression."""
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score, f1_score
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(Xtr)
    Xtr, Xte = scaler.transform(Xtr), scaler.transform(Xte)
    probes = {"rf": RandomForestClassifier(cfg.rf_trees, max_depth=cfg.rf_depth, random_state=seed, n_jobs=1),
              "knn": KNeighborsClassifier(cfg.knn_k),
              "logreg": LogisticRegression(class_weight="balanced", max_iter=5000)}
    out = {}
    for name, probe in probes.items():
        pred = probe.fit(Xtr, ytr).predict(Xte)
        out[f"{name}_acc"] = float(accuracy_score(yte, pred))
        out[f"{name}_macro_f1"] = float(f1_score(yte, pred, average="macro", zero_division=0))
    return out


def clustering_task(X, y, seed: int) -> dict:
    """KMeans with k = #classes on standardised embeddings: ARI, NMI, Hungarian macro-F1."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score
    from sklearn.preprocessing import StandardScaler

    Xs = StandardScaler().fit_transform(X)
    cluster = KMeans(len(np.unique(y)), n_init=10, random_state=seed).fit_predict(Xs)
    return {"kmeans_ari": float(adjusted_rand_score(y, cluster)),
            "kmeans_nmi": float(normalized_mutual_info_score(y, cluster)),
            "kmeans_hungarian_f1": hungarian_macro_f1(y, cluster)}


def ood_task(Xtr, ytr, Xid, Xood, cfg: StarEmbedConfig, seed: int) -> dict:
    """One IsolationForest per ID class on its training embeddings; normality = max over classes of the
    decision function; AUROC of OOD (positive) vs ID test by the negated normality (summary rule RECON)."""
    from sklearn.ensemble import IsolationForest
    from sklearn.metrics import roc_auc_score
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(Xtr)
    Xtr, Xid, Xood = scaler.transform(Xtr), scaler.transform(Xid), scaler.transform(Xood)
    forests = [IsolationForest(n_estimators=cfg.iforest_trees, random_state=seed).fit(Xtr[ytr == c])
               for c in np.unique(ytr)]
    normal = lambda Z: np.max([f.decision_function(Z) for f in forests], axis=0)
    score = -np.concatenate([normal(Xid), normal(Xood)])
    truth = np.r_[np.zeros(len(Xid)), np.ones(len(Xood))]
    return {"ood_auroc": float(roc_auc_score(truth, score))}


def evaluate(embedder: Embedder, data: LightCurveDataset, cfg: StarEmbedConfig, seed: int = 0) -> dict:
    """Fit ``embedder`` on the training curves, embed every split, and run all three tasks; returns flat metrics."""
    if not isinstance(embedder, Embedder):
        raise TypeError(f"embedder must have fit(curves, labels) and transform(curves); got {type(embedder).__name__}")
    if not isinstance(data, LightCurveDataset):
        raise TypeError(f"data must be a LightCurveDataset (from build_dataset), got {type(data).__name__}")
    if not isinstance(cfg, StarEmbedConfig):
        raise TypeError(f"cfg must be a StarEmbedConfig, got {type(cfg).__name__}")
    _check_seed(seed)
    empty = [name for name in ("train", "test", "ood") if not np.any(data.split == name)]
    if empty:
        raise ValueError(f"data has no light curve in split(s) {empty}")
    tr, ytr = data.subset("train")
    te, yte = data.subset("test")
    ood, _ = data.subset("ood")
    embedder.fit(tr, ytr)
    Xtr = _check(embedder.transform(tr), len(tr), "train embeddings")
    Xte = _check(embedder.transform(te), len(te), "test embeddings")
    Xood = _check(embedder.transform(ood), len(ood), "OOD embeddings")
    return {**classification_task(Xtr, ytr, Xte, yte, cfg, seed), **clustering_task(Xte, yte, seed),
            **ood_task(Xtr, ytr, Xte, Xood, cfg, seed)}
