"""Hand-crafted light-curve features (the paper's domain baseline): period, amplitude, Fourier shape, statistics.

Our own compact stand-in for the FATS + light_curve list of the paper (notes 4.3): Lomb-Scargle period and power,
amplitudes and relative phases of 4 harmonics at the best period, and variability statistics. 24 features.
"""

from __future__ import annotations

import math

import numpy as np

from .base import CurveEmbedder
from .data import LightCurve

FEATURE_NAMES = ("log_period", "ls_power", "amplitude", "A1", "R21", "R31", "R41", "cos_phi21", "sin_phi21",
                 "cos_phi31", "sin_phi31", "fourier_residual", "std", "skew", "kurtosis", "beyond1std", "eta",
                 "stetson_k", "mad", "q31", "percent_ratio", "linear_slope", "log_n", "median_err")


def frequency_grid(span: float, f_max: float = 10.0, oversample: float = 1.5) -> np.ndarray:
    return np.arange(1.0 / span, f_max, 1.0 / (oversample * span))


def best_period(lc: LightCurve, f_max: float = 10.0) -> tuple[float, float]:
    """Lomb-Scargle (astropy, error-weighted) best period in days (searched down to 1/f_max = 0.1 d) and its power."""
    from astropy.timeseries import LombScargle

    span = max(lc.t[-1] - lc.t[0], 1.0)
    freqs = frequency_grid(span, f_max)
    if len(freqs) < 2:
        raise ValueError(f"f_max = {f_max} per day leaves no frequency grid above 1/span = {1 / span:.3g} per day")
    model = LombScargle(lc.t, lc.mag, lc.err)
    power = model.power(freqs, method="fast", assume_regular_frequency=True)
    k = int(np.argmax(power))
    # refine the coarse peak on a 20x finer local grid (one coarse step either side)
    step = freqs[1] - freqs[0]
    fine = np.clip(freqs[k] + np.linspace(-step, step, 41), freqs[0], None)
    fine_power = model.power(fine, method="cython")
    j = int(np.argmax(fine_power))
    return 1.0 / fine[j], float(fine_power[j])


def fourier_fit(t: np.ndarray, y: np.ndarray, period: float,
                n_harmonics: int = 4) -> tuple[np.ndarray, np.ndarray, float]:
    """Least-squares y ~ c + sum_k a_k cos(2 pi k t / P + phi_k); returns amplitudes a_k, phases phi_k, residual std."""
    cols = [np.ones_like(t)]
    for k in range(1, n_harmonics + 1):
        w = 2 * np.pi * k * t / period
        cols += [np.cos(w), np.sin(w)]
    X = np.column_stack(cols)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    c, s = coef[1::2], coef[2::2]
    # a cos(w + phi) = a cos(phi) cos(w) - a sin(phi) sin(w)
    return np.hypot(c, s), np.arctan2(-s, c), float(np.std(y - X @ coef))


def extract(lc: LightCurve, f_max: float = 10.0) -> np.ndarray:
    """The 24 features of one light curve, in FEATURE_NAMES order (periods searched down to 1/f_max days).

    Raises ValueError for constant magnitudes: the periodogram power and Stetson K are 0/0 there.
    """
    t, y, e = lc.t, lc.mag, lc.err
    if np.ptp(y) == 0:
        raise ValueError(f"the light curve's magnitudes are all equal ({y[0]}): the periodogram power and Stetson K "
                         f"are undefined for a constant light curve")
    period, power = best_period(lc, f_max)
    amps, phases, resid = fourier_fit(t, y, period)
    a1 = max(amps[0], 1e-9)
    phi21 = phases[1] - 2 * phases[0]
    phi31 = phases[2] - 3 * phases[0]
    std = float(np.std(y)) + 1e-12
    z = (y - y.mean()) / std
    q = np.percentile(y, [5, 25, 40, 60, 75, 95])
    n = len(y)
    delta = np.sqrt(n / (n - 1)) * (y - y.mean()) / e
    return np.array([
        np.log10(period), power, 0.5 * (q[5] - q[0]), a1, amps[1] / a1, amps[2] / a1, amps[3] / a1,
        np.cos(phi21), np.sin(phi21), np.cos(phi31), np.sin(phi31), resid / std, std, np.mean(z ** 3),
        np.mean(z ** 4) - 3, np.mean(np.abs(z) > 1), np.sum(np.diff(y) ** 2) / ((n - 1) * std ** 2),
        np.mean(np.abs(delta)) / np.sqrt(np.mean(delta ** 2)), np.median(np.abs(y - np.median(y))),
        q[4] - q[1], (q[3] - q[2]) / max(q[5] - q[0], 1e-9), np.polyfit(t - t[0], y, 1)[0] * 365.25, np.log10(n),
        np.median(e)])


class HandCraftedEmbedder(CurveEmbedder):
    """The domain baseline as a scikit-learn transformer: ``transform(curves) -> [n, 24]`` (FEATURE_NAMES order).

    Stateless (``fit`` only validates), so ``transform`` also works unfitted, like ``FunctionTransformer``.

    Args:
        f_max: highest Lomb-Scargle frequency searched, in 1/day (shortest period 1/f_max; default 10 -> 0.1 d).
    """

    name = "handcrafted"
    _requires_fit = False

    def __init__(self, f_max: float = 10.0):
        self.f_max = f_max

    def _check_params(self) -> None:
        if isinstance(self.f_max, bool) or not isinstance(self.f_max, (int, float)) or not (
                math.isfinite(self.f_max) and self.f_max > 0):
            raise ValueError(f"f_max must be a positive finite frequency in 1/day, got {self.f_max!r}")

    def _fit(self, curves: list) -> int:
        return len(FEATURE_NAMES)

    def _embed(self, curves: list) -> np.ndarray:
        rows = []
        for i, lc in enumerate(curves):
            try:
                row = extract(lc, self.f_max)
            except ValueError as err:
                raise ValueError(f"light curve {i}: {err}") from None
            if not np.all(np.isfinite(row)):
                names = [n for n, v in zip(FEATURE_NAMES, row) if not np.isfinite(v)]
                raise ValueError(f"light curve {i}: non-finite hand-crafted features {names} (a degenerate curve: "
                                 f"too few distinct epochs for the period search and the Fourier fit)")
            rows.append(row)
        return np.stack(rows)

    def _width(self) -> int:
        return len(FEATURE_NAMES)

    def get_feature_names_out(self, input_features=None) -> np.ndarray:
        """The 24 feature names, FEATURE_NAMES."""
        return np.asarray(FEATURE_NAMES, dtype=object)
