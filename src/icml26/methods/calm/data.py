"""Users' own recordings: per-session dF/F arrays (neurons x frames) with a frame rate, from NumPy (.npy / .npz) or
HDF5, checked and normalised the way the room's models expect (per-neuron z-score, POCO's convention).

    rec = load_session("mouse1_day3.h5", fs=10.0, key="dff")          # one session
    recs = load_sessions(["a.npz", "b.npz"], fs=10.0)                  # several; every frame rate must agree
    tokens = model.inputs_from_traces(torch.as_tensor(rec.dff)[None])  # (1, N, T // P)

Every check raises before anything is returned: NaN or infinite traces, zero-variance (dead) neurons, wrong
dimensionality, too few frames, and sessions whose frame rates differ (the model's patches are P frames, so a
different rate changes what a token means; resample first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Recording:
    """One session: ``dff`` (N, T) float32, z-scored per neuron; ``fs`` in Hz; ``source`` the file it came from."""

    dff: np.ndarray
    fs: float
    source: str

    @property
    def n_neurons(self) -> int:
        return self.dff.shape[0]

    @property
    def n_frames(self) -> int:
        return self.dff.shape[1]


def _read(path: Path, key: str | None) -> tuple[np.ndarray, float | None]:
    """The array (and a stored frame rate, if the file has one under ``fs``)."""
    suffix = path.suffix.lower()
    if suffix == ".npy":
        return np.load(path, allow_pickle=False), None
    if suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            name = key or ("dff" if "dff" in z.files else (z.files[0] if len(z.files) == 1 else None))
            if name is None or name not in z.files:
                raise ValueError(f"{path}: cannot tell which array holds dF/F (arrays {z.files}); pass key=")
            return z[name], (float(z["fs"]) if "fs" in z.files else None)
    if suffix in (".h5", ".hdf5"):
        import h5py

        with h5py.File(path, "r") as f:
            name = key or ("dff" if "dff" in f else None)
            if name is None or name not in f:
                raise ValueError(f"{path}: no dataset {key or 'dff'!r} (datasets {list(f.keys())}); pass key=")
            fs = f[name].attrs.get("fs", f.attrs.get("fs"))
            return np.asarray(f[name]), (float(fs) if fs is not None else None)
    raise ValueError(f"{path}: unsupported file type {suffix!r}; use .npy, .npz, .h5 or .hdf5")


def check_dff(dff: np.ndarray, *, name: str = "dff", min_frames: int = 2) -> np.ndarray:
    """Validate a (N, T) dF/F array and return it z-scored per neuron as float32 (raises ValueError/TypeError)."""
    if not isinstance(dff, np.ndarray):
        raise TypeError(f"{name} must be a numpy array (neurons x frames), got {type(dff).__name__}")
    if dff.ndim != 2:
        raise ValueError(f"{name} must be 2-D (neurons x frames), got shape {dff.shape}")
    if not np.issubdtype(dff.dtype, np.number):
        raise TypeError(f"{name} must be numeric, got dtype {dff.dtype}")
    if dff.shape[1] < min_frames:
        raise ValueError(f"{name} has {dff.shape[1]} frames, fewer than the {min_frames} needed; is it frames x "
                         f"neurons? (shape {dff.shape})")
    bad = np.where(~np.isfinite(dff).all(1))[0]
    if len(bad):
        raise ValueError(f"{name}: neurons {bad[:10].tolist()}{' ...' if len(bad) > 10 else ''} contain NaN or "
                         f"infinite values ({len(bad)} of {dff.shape[0]}); interpolate or drop them first")
    sd = dff.std(1)
    dead = np.where(sd < 1e-8 * max(1.0, float(np.abs(dff).max())))[0]
    if len(dead):
        raise ValueError(f"{name}: neurons {dead[:10].tolist()}{' ...' if len(dead) > 10 else ''} have zero "
                         f"variance ({len(dead)} of {dff.shape[0]}); drop them first")
    return ((dff - dff.mean(1, keepdims=True)) / sd[:, None]).astype(np.float32)


def load_session(path: str | os.PathLike, *, fs: float | None = None, key: str | None = None,
                 frames_first: bool = False, min_frames: int = 64) -> Recording:
    """Load one session's dF/F (neurons x frames; ``frames_first=True`` for frames x neurons).

    ``fs`` is required unless the file stores it (``fs`` array in .npz, ``fs`` attribute in HDF5); when both are
    given they must agree."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"no such file: {path}")
    if fs is not None and not (isinstance(fs, (int, float)) and np.isfinite(fs) and fs > 0):
        raise ValueError(f"fs must be a positive frame rate in Hz, got {fs!r}")
    arr, stored = _read(path, key)
    if stored is not None and fs is not None and not np.isclose(stored, fs):
        raise ValueError(f"{path}: the file says fs={stored:g} Hz but fs={fs:g} was passed")
    rate = fs if fs is not None else stored
    if rate is None:
        raise ValueError(f"{path}: the file stores no frame rate; pass fs=")
    arr = np.asarray(arr)
    dff = check_dff(arr.T if frames_first else arr, name=str(path), min_frames=min_frames)
    return Recording(dff=dff, fs=float(rate), source=str(path))


def load_sessions(paths: Sequence[str | os.PathLike], *, fs: float | None = None, key: str | None = None,
                  frames_first: bool = False, min_frames: int = 64) -> list[Recording]:
    """Load several sessions; all must share one frame rate (checked before any is returned)."""
    if not paths:
        raise ValueError("load_sessions needs at least one path")
    recs = [load_session(p, fs=fs, key=key, frames_first=frames_first, min_frames=min_frames) for p in paths]
    rates = sorted({r.fs for r in recs})
    if len(rates) > 1:
        by = {r.source: r.fs for r in recs}
        raise ValueError(f"sessions have different frame rates {rates} Hz ({by}); resample to one rate first")
    return recs
