"""Plain, slow, obviously-correct versions of what the benchmark computes: the ground truth for the tests."""

from __future__ import annotations

import itertools
import math

import numpy as np


def ls_periodogram(t: np.ndarray, y: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    """Least-squares periodogram: at each frequency fit a + b cos + c sin; the explained variance fraction."""
    y = np.asarray(y, float)
    total = np.sum((y - y.mean()) ** 2)
    power = np.empty(len(freqs))
    for i, f in enumerate(freqs):
        X = np.column_stack([np.ones_like(t), np.cos(2 * np.pi * f * t), np.sin(2 * np.pi * f * t)])
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        power[i] = 1.0 - np.sum((y - X @ coef) ** 2) / total
    return power


def adjusted_rand(a: np.ndarray, b: np.ndarray) -> float:
    """Hubert-Arabie ARI from the contingency table."""
    comb2 = lambda n: n * (n - 1) / 2
    cont = np.array([[np.sum((a == i) & (b == j)) for j in np.unique(b)] for i in np.unique(a)])
    index = sum(comb2(n) for n in cont.ravel())
    rows, cols, total = sum(comb2(n) for n in cont.sum(1)), sum(comb2(n) for n in cont.sum(0)), comb2(len(a))
    expected = rows * cols / total
    return float((index - expected) / (0.5 * (rows + cols) - expected))


def auroc(neg: np.ndarray, pos: np.ndarray) -> float:
    """P(pos score > neg score) + 0.5 P(tie), by counting every pair."""
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return float(wins / (len(pos) * len(neg)))


def hungarian_accuracy(y: np.ndarray, cluster: np.ndarray) -> float:
    """Best accuracy over every one-to-one map of clusters to labels (brute force; small k only)."""
    labels, clusters = list(np.unique(y)), list(np.unique(cluster))
    best = 0
    for perm in itertools.permutations(labels, min(len(labels), len(clusters))):
        best = max(best, sum(np.sum((cluster == c) & (y == l)) for c, l in zip(clusters, perm)))
    return best / len(y)


def sinusoid_peak_to_peak(amplitude: float) -> float:
    return 2.0 * amplitude if math.isfinite(amplitude) else float("nan")
