"""Plain, loop-based versions that the tests hold the fast code to."""

from __future__ import annotations

import numpy as np


def ar1_calcium_loop(spikes: np.ndarray, gamma: float) -> np.ndarray:
    """c_t = gamma * c_{t-1} + s_t, one neuron at a time; spikes (N, T)."""
    c = np.zeros(spikes.shape, dtype=float)
    for n in range(spikes.shape[0]):
        prev = 0.0
        for t in range(spikes.shape[1]):
            prev = gamma * prev + spikes[n, t]
            c[n, t] = prev
    return c


def fit_ar1(trace: np.ndarray, spikes: np.ndarray) -> float:
    """Least-squares AR(1) coefficient of a 1-D calcium trace with known spikes:
    argmin_g sum_t (c_t - s_t - g c_{t-1})^2."""
    x, y = trace[:-1], trace[1:] - spikes[1:]
    return float(x @ y / (x @ x))


def patchify_loop(traces: np.ndarray, patch_len: int) -> np.ndarray:
    """(N, T) -> (N, T // P, P): non-overlapping patches, the tail dropped."""
    n_p = traces.shape[1] // patch_len
    out = np.zeros((traces.shape[0], n_p, patch_len))
    for n in range(traces.shape[0]):
        for p in range(n_p):
            for k in range(patch_len):
                out[n, p, k] = traces[n, p * patch_len + k]
    return out


def poco_score_reference(pred: np.ndarray, target: np.ndarray, last: np.ndarray) -> float:
    """1 - MSE(pred)/MSE(copy-last) with explicit sums; pred/target (..., H), last (...)."""
    se, se_copy, count = 0.0, 0.0, 0
    for idx in np.ndindex(*target.shape):
        se += (pred[idx] - target[idx]) ** 2
        se_copy += (last[idx[:-1]] - target[idx]) ** 2
        count += 1
    return 1.0 - (se / count) / (se_copy / count)


def r2_reference(pred: np.ndarray, target: np.ndarray) -> float:
    """Coefficient of determination over all entries (one pooled mean per column)."""
    target = target.reshape(len(target), -1)
    pred = pred.reshape(len(pred), -1)
    ss_res = float(((target - pred) ** 2).sum())
    ss_tot = float(((target - target.mean(0)) ** 2).sum())
    return 1.0 - ss_res / ss_tot


def ar2_calcium_loop(spikes: np.ndarray, g1: float, g2: float) -> np.ndarray:
    """c_t = g1 * c_{t-1} + g2 * c_{t-2} + s_t (zero initial state), one neuron at a time; spikes (N, T)."""
    c = np.zeros(spikes.shape, dtype=float)
    for n in range(spikes.shape[0]):
        p1 = p2 = 0.0
        for t in range(spikes.shape[1]):
            cur = g1 * p1 + g2 * p2 + spikes[n, t]
            c[n, t] = cur
            p1, p2 = cur, p1
    return c


def percentile_at(f: np.ndarray, centre: int, window: int, q: float) -> np.ndarray:
    """The q-th percentile of each row of f over the centred window [centre - window//2, centre + window//2]."""
    half = window // 2
    return np.array([np.percentile(row[max(0, centre - half):centre + half + 1], q) for row in f])
