"""Plot helpers that claim figures share (each ``ExperimentSpec.plot`` draws onto one matplotlib axis)."""

from __future__ import annotations

import numpy as np


def plot_mean_curves(result: dict, ax, *, xlabel: str, ylabel: str = "validation loss", target: str | None = None,
                     target_label: str = "target", log_y: bool = False, skip_first: bool = False) -> None:
    """One line per arm: the seed mean of ``seed_results[i]["curves"][arm]``, a list of ``[x, y]`` points.

    Args:
        target: name of a per-seed statistic drawn as a dotted horizontal line (its mean over seeds).
        skip_first: leave out each curve's first point (e.g. the untrained model's loss, which hides the rest).
    """
    seeds = result["seed_results"]
    drawn: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for arm in result["arms_order"]:
        runs = [r["curves"][arm] for r in seeds if arm in r.get("curves", {})]
        if not runs:
            continue
        n = min(len(r) for r in runs)
        start = 1 if skip_first else 0
        x = np.array([p[0] for p in runs[0][start:n]], dtype=float)
        y = np.array([[p[1] for p in r[start:n]] for r in runs], dtype=float).mean(0)
        drawn[arm] = (x, y)
    hidden = hidden_arms(drawn)
    for arm, (x, y) in drawn.items():
        ax.plot(x, y, label=f"{arm} (under {hidden[arm]})" if arm in hidden else arm)
    if target is not None:
        ax.axhline(float(np.mean([r["statistics"][target] for r in seeds])), color="k", ls=":", lw=1,
                   label=target_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log_y:
        ax.set_yscale("log")
    ax.legend(fontsize=8)


def hidden_arms(curves: dict[str, tuple[np.ndarray, np.ndarray]], rtol: float = 1e-3) -> dict[str, str]:
    """Arms whose curve lies on an earlier-drawn arm's curve (within ``rtol`` of the plotted range), mapped to
    that arm: the legend names them, since a reader cannot see a line drawn under another one."""
    hidden, names = {}, list(curves)
    for i, arm in enumerate(names):
        x, y = curves[arm]
        for other in names[i + 1:]:
            ox, oy = curves[other]
            if other in hidden or ox.shape != x.shape or not np.allclose(ox, x):
                continue
            span = float(np.nanmax(y) - np.nanmin(y)) if y.size else 0.0
            if np.allclose(oy, y, rtol=0, atol=rtol * max(span, 1e-12), equal_nan=True):
                hidden[arm] = other
                break
    return hidden
