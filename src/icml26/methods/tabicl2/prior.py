"""Synthetic prior: random-DAG structural causal models (a reduced version of TabICLv2's "graph_scm" prior).

Reconstructed from the design in soda-inria/tabicl at commit 8f1aa2098c894ab91dba15209cf2002ba4be6c6c
(``src/tabicl/prior/graph_lib``; our own, much smaller code). One dataset is drawn as follows:

1. **Correlated hyper-parameters**: each named knob draws t ~ U(0,1), s ~ LogU(0.1, 1e4), then u ~ Beta(s t, s(1-t))
   per use, so repeated draws of one knob within a dataset are correlated (as in the official sampler).
2. **Random Cauchy DAG** on N nodes (2..max_nodes): edge i -> j (i < j) with probability
   sigmoid(offset + out_i + in_j), offset and the per-node importances drawn from a Cauchy distribution.
3. **Nodes** hold d-dimensional values for n rows. Roots: Gaussian with random covariance, uniform, Gaussian
   mixture or circle. Other nodes: each parent goes through a random function, and the results are summed,
   multiplied, max-ed or log-sum-exp-ed (or concatenated then mapped); then noise. Random function types: MLP,
   tree ensemble (axis-aligned random trees), discretisation (nearest of k centres), random Fourier features
   (a GP draw), linear, quadratic, soft (EM-like) assignment, product of two projections.
4. **Converters**: feature columns are node dimensions, numeric (optionally warped) or categorical (quantile or
   nearest-centre discretisation, random category codes); the target is a node converted to 2..max_classes
   classes by random quantile boundaries with permuted labels (or by argmax of a softmax discretiser).
   Regression (``task="regression"``, the v2 regressor's prior): the target is a random projection of the node,
   kept continuous, outlier-clipped (|z| > 4) and standardised with training statistics.
5. **Filtering**: a dataset is rejected if some class is missing from the training part, or if a depth-3 decision
   tree fitted on half of the training rows does not beat the majority class on the other half (y independent
   of x; for regression: its R^2 on the other half is not above 0); the official prior also filters
   unpredictable graphs, which we do not.
6. **Post-processing**: outlier clipping (|z| > 4 pulled to the bound, as the estimator does), standardisation
   with train statistics, random feature and row permutations.

Everything is drawn from one ``numpy.random.Generator`` seeded per dataset, so ``sample_dataset(seed, ...)`` is
deterministic; ``prior_hash`` gives a content hash of a batch for pre-generated shards.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor

FUNCTION_TYPES = ("mlp", "tree", "discretise", "rff", "linear", "quadratic", "soft_assign", "product")
AGGREGATIONS = ("sum", "product", "max", "logsumexp", "concat")
ROOT_TYPES = ("gaussian", "uniform", "mixture", "circle")
TASKS = ("classification", "regression")


@dataclass
class PriorConfig:
    """Ranges of the prior. Official stage-1 values: rows <= 1024, features 1-100, classes <= 10, 2-32 nodes."""

    max_nodes: int = 8
    max_node_dim: int = 4
    max_classes: int = 10
    categorical_prob: float = 0.2
    noise_max: float = 0.3
    min_tree_gain: float = 0.0

    def __post_init__(self) -> None:
        if self.max_nodes < 2:
            raise ValueError(f"PriorConfig.max_nodes must be >= 2, got {self.max_nodes}")
        if self.max_node_dim < 1:
            raise ValueError(f"PriorConfig.max_node_dim must be >= 1, got {self.max_node_dim}")
        if not 2 <= self.max_classes:
            raise ValueError(f"PriorConfig.max_classes must be >= 2, got {self.max_classes}")
        if not 0 <= self.categorical_prob <= 1:
            raise ValueError(f"PriorConfig.categorical_prob must be in [0, 1], got {self.categorical_prob}")


class _Knobs:
    """Correlated hyper-parameter sampler: one (alpha, beta) per knob name, a Beta draw per use."""

    def __init__(self, rng: np.random.Generator):
        self.rng, self.ab = rng, {}

    def u(self, name: str) -> float:
        if name not in self.ab:
            t = self.rng.uniform(0.02, 0.98)
            s = float(np.exp(self.rng.uniform(np.log(0.1), np.log(1e4))))
            self.ab[name] = (max(s * t, 1e-3), max(s * (1 - t), 1e-3))
        return float(self.rng.beta(*self.ab[name]))

    def choice(self, name: str, options) -> object:
        return options[min(int(self.u(name) * len(options)), len(options) - 1)]


def _std(x: np.ndarray) -> np.ndarray:
    return (x - x.mean(0)) / (x.std(0) + 1e-6)


def _activation(rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
    kind = rng.integers(8)
    if kind == 0:
        return np.tanh(x)
    if kind == 1:
        return np.maximum(x, 0) ** rng.uniform(0.5, 2)
    if kind == 2:
        return np.sin(x * rng.uniform(0.5, 3))
    if kind == 3:
        return np.abs(x) ** rng.uniform(0.5, 2)
    if kind == 4:
        return 1 / (1 + np.exp(-np.clip(x, -30, 30)))
    if kind == 5:  # Kumaraswamy-style warping of a squashed value
        u = 1 / (1 + np.exp(-np.clip(x, -30, 30)))
        a, b = rng.uniform(0.3, 3, size=2)
        return 1 - (1 - u ** a) ** b
    if kind == 6:
        return x / (np.linalg.norm(x, axis=-1, keepdims=True) + 1e-6)
    return x


def _weights(rng: np.random.Generator, d_in: int, d_out: int) -> np.ndarray:
    """Random matrix: Gaussian, sparse Gaussian, or controlled singular values."""
    kind = rng.integers(3)
    W = rng.normal(size=(d_in, d_out)) / np.sqrt(d_in)
    if kind == 1:
        W *= rng.random((d_in, d_out)) < rng.uniform(0.3, 1)
    elif kind == 2:
        U, _, Vt = np.linalg.svd(W, full_matrices=False)
        s = np.exp(-rng.uniform(0, 3) * np.arange(len(Vt)))
        W = (U * s) @ Vt * np.sqrt(min(d_in, d_out))
    return W


def _random_function(rng: np.random.Generator, knobs: _Knobs, x: np.ndarray, d_out: int) -> np.ndarray:
    """One random map (n, d_in) -> (n, d_out) of the types in ``FUNCTION_TYPES``."""
    n, d_in = x.shape
    kind = knobs.choice("function", FUNCTION_TYPES) if rng.random() < 0.5 else FUNCTION_TYPES[rng.integers(8)]
    if kind == "mlp":
        h = int(rng.integers(4, 33))
        return _activation(rng, x @ _weights(rng, d_in, h) + rng.normal(size=h) * 0.5) @ _weights(rng, h, d_out)
    if kind == "tree":
        out = np.zeros((n, d_out))
        for _ in range(int(rng.integers(1, 5))):
            depth = int(rng.integers(1, 5))
            leaf = np.zeros(n, dtype=np.int64)
            for _ in range(depth):
                f = rng.integers(d_in, size=1 << depth)
                thr = rng.normal(size=1 << depth) * x.std(0).mean()
                leaf = 2 * leaf + (x[np.arange(n), f[leaf]] > thr[leaf])
            out += rng.normal(size=(1 << depth, d_out))[leaf]
        return out
    if kind == "discretise":
        k = int(rng.integers(2, 9))
        centres = x[rng.integers(n, size=k)]
        idx = ((x[:, None] - centres[None]) ** 2).sum(-1).argmin(1)
        return rng.normal(size=(k, d_out))[idx]
    if kind == "rff":  # a draw from a GP with an RBF kernel, via random Fourier features
        m = 64
        omega = rng.normal(size=(d_in, m)) / rng.uniform(0.3, 3)
        phase = rng.uniform(0, 2 * np.pi, m)
        return np.cos(x @ omega + phase) @ rng.normal(size=(m, d_out)) * np.sqrt(2 / m)
    if kind == "linear":
        return x @ _weights(rng, d_in, d_out) + rng.normal(size=d_out)
    if kind == "quadratic":
        a, b = x @ _weights(rng, d_in, d_out), x @ _weights(rng, d_in, d_out)
        return a * b + x @ _weights(rng, d_in, d_out)
    if kind == "soft_assign":  # EM-style responsibilities of k Gaussian centres
        k = int(rng.integers(2, 7))
        centres = x[rng.integers(n, size=k)]
        logits = -((x[:, None] - centres[None]) ** 2).sum(-1) / rng.uniform(0.1, 2)
        p = np.exp(logits - logits.max(1, keepdims=True))
        return (p / p.sum(1, keepdims=True)) @ rng.normal(size=(k, d_out))
    # product of two random projections
    return (x @ _weights(rng, d_in, d_out)) * (x @ _weights(rng, d_in, d_out))


def _root(rng: np.random.Generator, knobs: _Knobs, n: int, d: int) -> np.ndarray:
    kind = knobs.choice("root", ROOT_TYPES)
    if kind == "gaussian":
        L = rng.normal(size=(d, d))
        return rng.normal(size=(n, d)) @ L
    if kind == "uniform":
        return rng.uniform(-1, 1, size=(n, d))
    if kind == "mixture":
        k = int(rng.integers(2, 6))
        comp = rng.integers(k, size=n)
        return rng.normal(size=(k, d))[comp] * 2 + rng.normal(size=(n, d)) * rng.uniform(0.1, 1)
    t = rng.uniform(0, 2 * np.pi, size=n)
    base = np.stack([np.cos(t), np.sin(t)], 1) + rng.normal(size=(n, 2)) * 0.05
    return base @ rng.normal(size=(2, d))


def _dag(rng: np.random.Generator, n_nodes: int) -> list[list[int]]:
    """Parents of each node of a random Cauchy DAG (edges only from lower to higher index)."""
    offset = rng.standard_cauchy()
    out_imp, in_imp = rng.standard_cauchy(n_nodes), rng.standard_cauchy(n_nodes)
    parents = []
    for j in range(n_nodes):
        logits = np.clip(offset + out_imp[:j] + in_imp[j], -30, 30)
        parents.append([i for i in range(j) if rng.random() < 1 / (1 + np.exp(-logits[i]))])
    return parents


def _scm_values(rng: np.random.Generator, cfg: PriorConfig, n: int) -> list[np.ndarray]:
    knobs = _Knobs(rng)
    n_nodes = int(rng.integers(2, cfg.max_nodes + 1))
    noise = cfg.noise_max * knobs.u("noise")
    values: list[np.ndarray] = []
    for parents in _dag(rng, n_nodes):
        d = int(rng.integers(1, cfg.max_node_dim + 1))
        if not parents:
            v = _root(rng, knobs, n, d)
        else:
            agg = knobs.choice("aggregation", AGGREGATIONS)
            if agg == "concat":
                v = _random_function(rng, knobs, np.concatenate([values[p] for p in parents], 1), d)
            else:
                parts = np.stack([_std(_random_function(rng, knobs, values[p], d)) for p in parents])
                v = {"sum": lambda a: a.sum(0), "product": lambda a: a.prod(0), "max": lambda a: a.max(0),
                     "logsumexp": lambda a: np.log(np.exp(a - a.max(0)).sum(0)) + a.max(0)}[agg](parts)
        v = _std(np.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0))
        values.append(v + rng.normal(size=v.shape) * noise)
    return values


def _categorical(rng: np.random.Generator, col: np.ndarray) -> np.ndarray:
    """Discretise a column into k categories with random integer codes (quantile or nearest-centre)."""
    k = int(rng.integers(2, 8))
    if rng.random() < 0.5:
        edges = np.quantile(col, np.sort(rng.uniform(0, 1, k - 1)))
        cat = np.searchsorted(edges, col)
    else:
        cat = np.abs(col[:, None] - col[rng.integers(len(col), size=k)][None]).argmin(1)
    return rng.permutation(k)[cat].astype(np.float64)


def _target(rng: np.random.Generator, node: np.ndarray, n_classes: int) -> np.ndarray:
    if node.shape[1] >= n_classes and rng.random() < 0.3:  # softmax discretiser: argmax over dims
        y = (node[:, :n_classes] * rng.uniform(0.5, 2)).argmax(1)
    else:
        col = node @ rng.normal(size=node.shape[1])
        if rng.random() < 0.5:  # random value boundaries between quantiles
            edges = np.quantile(col, np.sort(rng.uniform(0.02, 0.98, n_classes - 1)))
        else:  # balanced rank boundaries
            edges = np.quantile(col, np.arange(1, n_classes) / n_classes)
        y = np.searchsorted(edges, col)
    return rng.permutation(n_classes)[y]


def _y_predictable(X: np.ndarray, y: np.ndarray, seed: int, min_gain: float) -> bool:
    """True if a depth-3 tree fitted on half the rows beats the majority class on the other half."""
    n = len(y)
    half = n // 2
    tree = DecisionTreeClassifier(max_depth=3, random_state=seed).fit(X[:half], y[:half])
    acc = (tree.predict(X[half:]) == y[half:]).mean()
    majority = (y[half:] == np.bincount(y[:half]).argmax()).mean()
    return acc > majority + min_gain


def _y_predictable_regression(X: np.ndarray, y: np.ndarray, seed: int, min_gain: float) -> bool:
    """True if a depth-3 regression tree fitted on half the rows has R^2 > min_gain on the other half."""
    half = len(y) // 2
    tree = DecisionTreeRegressor(max_depth=3, random_state=seed).fit(X[:half], y[:half])
    resid = ((tree.predict(X[half:]) - y[half:]) ** 2).sum()
    total = ((y[half:] - y[:half].mean()) ** 2).sum()
    return total > 0 and 1 - resid / total > min_gain


def standardise_target(y: np.ndarray, n_train: int, clip: float = 4.0) -> np.ndarray:
    """z-score y with training statistics, pull |z| > clip to +-clip (outliers), re-standardise."""
    z = np.clip((y - y[:n_train].mean()) / (y[:n_train].std() + 1e-6), -clip, clip)
    return (z - z[:n_train].mean()) / (z[:n_train].std() + 1e-6)


def postprocess(X: np.ndarray, n_train: int, clip: float = 4.0) -> np.ndarray:
    """Standardise with training statistics, pull |z| > clip to +-clip, re-standardise, clip to +-100."""
    mu, sd = X[:n_train].mean(0), X[:n_train].std(0) + 1e-6
    Z = np.clip((X - mu) / sd, -clip, clip)
    mu, sd = Z[:n_train].mean(0), Z[:n_train].std(0) + 1e-6
    return np.clip((Z - mu) / sd, -100, 100)


def sample_dataset(seed: int, n_rows: int, n_features: int, n_train: int, n_classes: int | None = None,
                   cfg: PriorConfig | None = None, max_tries: int = 50,
                   task: str = "classification") -> tuple[np.ndarray, np.ndarray, int]:
    """One accepted dataset: ``X`` float32 (n_rows, n_features), ``y`` (n_rows,), and the number of tries.

    Rows ``[:n_train]`` are the training part. Classification: ``y`` int64, classes 0..n_classes-1, every class
    present in the training part. Regression: ``y`` float32, standardised with training statistics.
    Deterministic in ``seed``.
    """
    cfg = cfg or PriorConfig()
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if not 1 <= n_features:
        raise ValueError(f"n_features must be >= 1, got {n_features}")
    if not 2 <= n_train < n_rows:
        raise ValueError(f"need 2 <= n_train < n_rows, got n_train={n_train}, n_rows={n_rows}")
    rng = np.random.default_rng(seed)
    for tries in range(1, max_tries + 1):
        k = n_classes or int(rng.integers(2, cfg.max_classes + 1))
        k = min(k, max(2, n_train // 4))
        values = _scm_values(rng, cfg, n_rows)
        cols = np.concatenate(values, 1)
        node_of = np.concatenate([np.full(v.shape[1], i) for i, v in enumerate(values)])
        y_node = int(rng.integers(len(values)))
        if task == "regression":
            y = values[y_node] @ rng.normal(size=values[y_node].shape[1])
        else:
            y = _target(rng, values[y_node], k)
        candidates = np.flatnonzero(node_of != y_node)
        if len(candidates) == 0:
            continue
        pick = rng.choice(candidates, size=n_features, replace=len(candidates) < n_features)
        X = cols[:, pick] + rng.normal(size=(n_rows, n_features)) * 0.01  # duplicated columns differ slightly
        for j in range(n_features):
            if rng.random() < cfg.categorical_prob:
                X[:, j] = _categorical(rng, X[:, j])
        perm = rng.permutation(n_rows)
        X, y = X[perm], y[perm]
        if task == "regression":
            if (not np.isfinite(X).all() or not np.isfinite(y).all()
                    or not _y_predictable_regression(X[:n_train], y[:n_train], seed, cfg.min_tree_gain)):
                continue
            return postprocess(X, n_train).astype(np.float32), standardise_target(y, n_train).astype(np.float32), tries
        present = np.unique(y[:n_train])
        if len(present) < 2:
            continue
        # relabel to the classes seen in training (0..k'-1, random order) and drop rows of unseen classes
        keep = np.isin(y, present)
        if keep[n_train:].sum() < 1:
            continue
        remap = np.full(k, -1)
        remap[present] = rng.permutation(len(present))
        X, y = X[keep], remap[y[keep]]
        if not np.isfinite(X).all() or not _y_predictable(X[:n_train], y[:n_train], seed, cfg.min_tree_gain):
            continue
        # pad dropped test rows back with duplicates of kept test rows so the shape is fixed
        if len(y) < n_rows:
            extra = rng.integers(n_train, len(y), size=n_rows - len(y))
            X, y = np.concatenate([X, X[extra]]), np.concatenate([y, y[extra]])
        X = postprocess(X, n_train)
        return X.astype(np.float32), y.astype(np.int64), tries
    raise RuntimeError(f"prior: no acceptable dataset in {max_tries} tries (seed {seed})")


def sample_batch(seed: int, batch_size: int, n_rows: int, n_features: int, n_train: int,
                 cfg: PriorConfig | None = None, task: str = "classification") -> tuple[np.ndarray, np.ndarray]:
    """``batch_size`` datasets of one shape: X (B, n_rows, n_features) float32, y (B, n_rows) int64 (classes)
    or float32 (regression)."""
    ss = np.random.SeedSequence(seed)
    seeds = [int(s.generate_state(1)[0]) for s in ss.spawn(batch_size)]
    Xs, ys = zip(*[sample_dataset(s, n_rows, n_features, n_train, cfg=cfg, task=task)[:2] for s in seeds])
    return np.stack(Xs), np.stack(ys)


def prior_hash(X: np.ndarray, y: np.ndarray) -> str:
    """Content hash (sha256, 16 hex chars) of a batch, to name and verify pre-generated shards."""
    h = hashlib.sha256()
    for a in (X, y):
        h.update(str(a.shape).encode() + str(a.dtype).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]
