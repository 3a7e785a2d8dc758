"""Degradation curves: broad loss as a function of task loss (or of drift), matched across trajectories.

A trajectory is a sequence of checkpoints (x_i, y_i): x is the progress coordinate (task loss, which falls, or
drift ||theta - theta_0||, which grows) and y the broad loss. Because x need not be monotone, the broad loss "at
level L" is read at the *first crossing*: the first segment [i, i+1] whose x reaches L, linearly interpolated.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np


def first_crossing(x: Sequence[float], y: Sequence[float], level: float, *, decreasing: bool) -> float:
    """y where x first reaches ``level`` (x <= level when ``decreasing``, else x >= level), interpolated linearly;
    NaN when the trajectory never gets there."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    s = -1.0 if decreasing else 1.0
    xs, lv = s * x, s * level  # now "reach" means xs >= lv
    if xs[0] >= lv:
        return float(y[0])
    hit = np.nonzero(xs >= lv)[0]
    if len(hit) == 0:
        return math.nan
    j = int(hit[0])
    t = (lv - xs[j - 1]) / (xs[j] - xs[j - 1])
    return float(y[j - 1] + t * (y[j] - y[j - 1]))


def matched_spread(curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], *, decreasing: bool,
                   n_levels: int = 20, reference: str | None = None, min_coverage: float = 0.3) -> dict:
    """How far apart trajectories are in y at matched x (the lock-in / collapse statistic).

    Levels: ``n_levels`` evenly spaced points from the common start x0 (the mean of the first x) to the deepest
    level *every* curve reaches, excluding x0 itself. At each level the spread is max - min of y over curves.

    Returns a dict with ``levels``, ``values`` (arm -> list), ``spread`` (list), ``delta`` (mean over curves of
    y at the deepest common level minus the mean starting y: the degradation reached), ``coverage`` (how much of
    ``reference``'s own x range the common range covers; 1 without a reference) and
    ``score = mean(spread) / delta`` (NaN when the coverage is below ``min_coverage`` or delta <= 0).
    """
    if len(curves) < 2:
        raise ValueError("matched_spread needs at least two curves")
    if n_levels < 1:
        raise ValueError(f"n_levels must be >= 1, got {n_levels}")
    x0 = float(np.mean([c[0][0] for c in curves.values()]))
    y0 = float(np.mean([c[1][0] for c in curves.values()]))
    reach = {a: (min(c[0]) if decreasing else max(c[0])) for a, c in curves.items()}
    common = max(reach.values()) if decreasing else min(reach.values())
    span = (x0 - common) if decreasing else (common - x0)
    if reference is not None:
        own = (x0 - reach[reference]) if decreasing else (reach[reference] - x0)
        coverage = span / own if own > 0 else 0.0
    else:
        coverage = 1.0
    out = {"x0": x0, "y0": y0, "common_level": common, "coverage": float(coverage), "levels": [], "values": {},
           "spread": [], "delta": math.nan, "score": math.nan}
    if span <= 0:
        return out
    direction = -1.0 if decreasing else 1.0
    levels = [x0 + direction * span * (i + 1) / n_levels for i in range(n_levels)]
    values = {a: [first_crossing(c[0], c[1], lv, decreasing=decreasing) for lv in levels] for a, c in curves.items()}
    spread = [max(v[i] for v in values.values()) - min(v[i] for v in values.values()) for i in range(n_levels)]
    delta = float(np.mean([v[-1] for v in values.values()])) - y0
    out.update(levels=levels, values=values, spread=spread, delta=delta)
    if coverage >= min_coverage and delta > 0:
        out["score"] = float(np.mean(spread)) / delta
    return out


def fit_degradation_curve(points: Sequence[tuple[float, float]], degree: int = 2) -> dict:
    """Least-squares polynomial y = p(x) through pooled (x, y) points of many trajectories.

    Returns ``coef`` (highest power first, numpy convention) and ``r2``, the share of the variance of y that one
    shared curve explains (1 = every trajectory lies on the curve).
    """
    pts = np.asarray(points, dtype=float)
    if pts.ndim != 2 or pts.shape[1] != 2 or len(pts) <= degree:
        raise ValueError(f"need more than degree={degree} (x, y) points, got shape {pts.shape}")
    coef = np.polyfit(pts[:, 0], pts[:, 1], degree)
    resid = pts[:, 1] - np.polyval(coef, pts[:, 0])
    total = float(((pts[:, 1] - pts[:, 1].mean()) ** 2).sum())
    return {"coef": coef.tolist(), "r2": 1.0 - float((resid ** 2).sum()) / total if total > 0 else math.nan}
