"""D4RL-layout offline datasets: validation, content hash, NPZ / HDF5 load and save.

A dataset is a plain ``dict`` of numpy arrays with D4RL's keys, all with the same first dimension N:

=====================  ==========  ==============================================================
key                    shape       meaning
=====================  ==========  ==============================================================
observations           (N, obs)    s_t
actions                (N, act)    a_t
rewards                (N,)        r_t
next_observations      (N, obs)    s_{t+1} (the true next state, also at a timeout)
terminals              (N,)        1 when s_{t+1} is terminal (no bootstrap), e.g. the goal is reached
timeouts               (N,)        1 when the episode was cut by the time limit (bootstrap still valid)
=====================  ==========  ==============================================================

Terminals and timeouts are kept apart, as in D4RL: a TD target bootstraps through a timeout but not through a
terminal. ``load_dataset`` reads a user's own D4RL-format ``.npz`` or ``.hdf5`` (h5py needed for the latter),
``load_minari`` a local Minari dataset (HDF5 storage); both refuse malformed files with an error naming the
problem (missing key, mismatched lengths, non-finite values).
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import numpy as np

from ..core.io import atomic_write_bytes

KEYS = ("observations", "actions", "rewards", "next_observations", "terminals", "timeouts")
FLAG_KEYS = ("terminals", "timeouts")


class DatasetError(ValueError):
    """A dataset file or dict that does not follow the D4RL layout; the message names the problem."""


def validate(data: dict, *, source: str = "dataset") -> dict:
    """Check the D4RL layout and return a clean copy (float32 arrays, flags as float32 0/1).

    Raises:
        DatasetError: a key is missing, lengths differ, shapes are wrong, a value is NaN/inf, or a flag is not 0/1.
    """
    missing = [k for k in KEYS if k not in data]
    if missing:
        raise DatasetError(f"{source}: missing D4RL key(s) {missing}; found {sorted(data)}")
    out = {k: np.asarray(data[k]) for k in KEYS}
    n = len(out["observations"])
    lengths = {k: len(v) for k, v in out.items()}
    if len(set(lengths.values())) != 1:
        raise DatasetError(f"{source}: every key needs the same number of rows, got {lengths}")
    if n == 0:
        raise DatasetError(f"{source}: the dataset is empty")
    for k in ("observations", "next_observations", "actions"):
        if out[k].ndim != 2:
            raise DatasetError(f"{source}: '{k}' must be 2-D (N, dim), got shape {out[k].shape}")
    if out["observations"].shape != out["next_observations"].shape:
        raise DatasetError(f"{source}: observations {out['observations'].shape} and next_observations "
                           f"{out['next_observations'].shape} differ in shape")
    for k in ("rewards", *FLAG_KEYS):
        out[k] = out[k].reshape(-1) if out[k].ndim == 2 and out[k].shape[1] == 1 else out[k]
        if out[k].ndim != 1:
            raise DatasetError(f"{source}: '{k}' must be 1-D (N,), got shape {out[k].shape}")
    for k in KEYS:
        arr = out[k].astype(np.float32)
        bad = ~np.isfinite(arr)
        if bad.any():
            raise DatasetError(f"{source}: '{k}' has {int(bad.sum())} non-finite value(s) (NaN or inf), first at "
                               f"row {int(np.argwhere(bad)[0][0])}")
        out[k] = arr
    for k in FLAG_KEYS:
        if not np.isin(out[k], (0.0, 1.0)).all():
            raise DatasetError(f"{source}: '{k}' must hold only 0/1 flags")
    return out


def content_hash(data: dict) -> str:
    """SHA-256 (first 16 hex digits) over the keys' dtypes, shapes and bytes, in D4RL key order."""
    h = hashlib.sha256()
    for k in KEYS:
        arr = np.ascontiguousarray(data[k])
        h.update(f"{k}:{arr.dtype.str}:{arr.shape};".encode())
        h.update(arr.tobytes())
    return h.hexdigest()[:16]


def save_dataset(data: dict, path: str | os.PathLike, *, metadata: dict | None = None) -> Path:
    """Validate and write ``data`` atomically as ``.npz`` (default) or ``.hdf5`` (needs h5py). ``metadata``
    (JSON-able scalars and strings) is stored next to the arrays under ``metadata/<key>`` (npz: ``meta_<key>``)."""
    clean = validate(data)
    path = Path(path)
    metadata = dict(metadata or {}, content_hash=content_hash(clean))
    if path.suffix in (".hdf5", ".h5"):
        h5py = _h5py()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with h5py.File(tmp, "w") as f:
            for k, v in clean.items():
                f.create_dataset(k, data=v)
            for k, v in metadata.items():
                f.attrs[k] = v
        os.replace(tmp, path)
        return path
    buf = io.BytesIO()
    np.savez_compressed(buf, **clean, **{f"meta_{k}": np.asarray(v) for k, v in metadata.items()})
    return atomic_write_bytes(path, buf.getvalue())


def load_dataset(path: str | os.PathLike) -> tuple[dict, dict]:
    """Read a D4RL-format ``.npz`` or ``.hdf5`` file; returns ``(data, metadata)`` with data validated.

    A D4RL HDF5 file written by ``d4rl`` / ``gym.get_dataset()`` (top-level datasets with the six keys, extra keys
    such as ``infos/*`` ignored) loads directly. A stored content hash, when present, is checked.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no dataset file at {path}")
    if path.suffix in (".hdf5", ".h5"):
        h5py = _h5py()
        with h5py.File(path, "r") as f:
            raw = {k: f[k][()] for k in KEYS if k in f}
            meta = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
    elif path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as f:
                raw = {k: f[k] for k in KEYS if k in f.files}
                meta = {k[5:]: f[k].item() for k in f.files if k.startswith("meta_")}
        except (ValueError, OSError) as err:
            raise DatasetError(f"{path}: not a readable .npz file ({err})") from err
    else:
        raise DatasetError(f"{path}: unsupported file type {path.suffix!r}; use .npz or .hdf5")
    data = validate(raw, source=str(path))
    stored = meta.get("content_hash")
    if stored is not None and stored != content_hash(data):
        raise DatasetError(f"{path}: content hash {content_hash(data)} does not match the stored {stored}; "
                           "the file was modified or truncated")
    return data, meta


def minari_root() -> Path:
    """Minari's local dataset root: ``$MINARI_DATASETS_PATH`` or ``~/.minari/datasets`` (Minari's default)."""
    return Path(os.environ.get("MINARI_DATASETS_PATH", Path.home() / ".minari" / "datasets"))


def load_minari(dataset: str | os.PathLike, *, root: str | os.PathLike | None = None) -> dict:
    """A local Minari dataset (HDF5 storage, Box observations and actions) as a validated D4RL-layout dict, read
    with h5py alone (the ``minari`` package is not needed).

    ``dataset``: a dataset id under ``root`` (default :func:`minari_root`), e.g. ``"mujoco/hopper/medium-v0"``, a
    dataset directory, or its ``data/main_data.hdf5``. Minari stores one group ``episode_<i>`` per episode with
    ``observations`` (T+1, obs: the first and the last observation included), ``actions`` (T, act), ``rewards``,
    ``terminations`` and ``truncations`` (T,); episodes are concatenated in id order, ``observations[:-1]`` /
    ``[1:]`` become observations / next_observations, terminations -> terminals, truncations without a
    termination -> timeouts. Dict observation spaces and Minari's Arrow storage raise a clear error.
    """
    path = Path(dataset)
    if not path.exists():
        path = Path(root) if root is not None else minari_root()
        path = path / str(dataset)
    if path.is_dir():
        path = path / "data" / "main_data.hdf5"
    if not path.exists():
        raise FileNotFoundError(f"no Minari HDF5 dataset at {path} (give a dataset id under the Minari root, a "
                                "dataset directory or its data/main_data.hdf5; Arrow-format datasets are not read)")
    h5py = _h5py()
    parts = []
    with h5py.File(path, "r") as f:
        names = sorted((k for k in f.keys() if k.startswith("episode_")), key=lambda k: int(k.split("_")[1]))
        if not names:
            raise DatasetError(f"{path}: no episode_<i> groups; not a Minari HDF5 dataset")
        for name in names:
            ep = f[name]
            for key in ("observations", "actions", "rewards", "terminations", "truncations"):
                if key not in ep:
                    raise DatasetError(f"{path}: {name} has no {key!r}")
                if not isinstance(ep[key], h5py.Dataset):
                    raise DatasetError(f"{path}: {name}/{key} is a group (a Dict space); only Box observations "
                                       "and actions are supported")
            obs, n = np.asarray(ep["observations"]), len(ep["actions"])
            if len(obs) != n + 1:
                raise DatasetError(f"{path}: {name} has {len(obs)} observations for {n} actions; Minari stores "
                                   "T + 1 (the first and the last)")
            term = np.asarray(ep["terminations"], dtype=np.float32)
            parts.append({"observations": obs[:-1], "next_observations": obs[1:],
                          "actions": np.asarray(ep["actions"]), "rewards": np.asarray(ep["rewards"]),
                          "terminals": term,
                          "timeouts": np.asarray(ep["truncations"], dtype=np.float32) * (1 - term)})
    return validate({k: np.concatenate([p[k] for p in parts]) for k in KEYS}, source=str(path))


def _h5py():
    from ..core.assets import require

    return require("h5py", "pip install h5py", purpose="D4RL-format HDF5 datasets (.npz needs nothing extra)")


def episode_returns(data: dict) -> np.ndarray:
    """Undiscounted return of each episode (episodes end at a terminal or a timeout; a trailing partial one too)."""
    ends = np.flatnonzero((data["terminals"] > 0) | (data["timeouts"] > 0))
    if len(ends) == 0 or ends[-1] != len(data["rewards"]) - 1:
        ends = np.append(ends, len(data["rewards"]) - 1)
    csum = np.concatenate(([0.0], np.cumsum(data["rewards"], dtype=np.float64)))
    starts = np.concatenate(([0], ends[:-1] + 1))
    return csum[ends + 1] - csum[starts]


def concatenate(parts: list[dict]) -> dict:
    """Stack several D4RL-layout dicts (e.g. the noise levels of a medium-replay mix)."""
    return validate({k: np.concatenate([p[k] for p in parts]) for k in KEYS})


def return_to_go(data: dict, discount: float, *, reward_scale: float = 1.0, reward_bias: float = 0.0,
                 sparse_failure_reward: float | None = None) -> np.ndarray:
    """Per-transition discounted Monte-Carlo return-to-go of r' = scale r + bias within each episode (episodes end
    at a terminal or a timeout): Cal-QL's calibration lower bound (CORL ``get_return_to_go``). (N,) float32.

    ``sparse_failure_reward``: CORL's sparse-reward rule; an episode whose last (transformed) reward equals it
    never reached the goal, and every step gets r' / (1 - discount), the value of failing forever, instead of the
    truncated sum.
    """
    if not 0 <= discount < 1:
        raise ValueError(f"discount must be in [0, 1), got {discount}")
    r = np.asarray(data["rewards"], dtype=np.float64) * reward_scale + reward_bias
    term = np.asarray(data["terminals"]) > 0
    ends = term | (np.asarray(data["timeouts"]) > 0)
    ends[-1] = True
    out = np.zeros_like(r)
    start = 0
    for end in np.flatnonzero(ends):
        seg = slice(start, end + 1)
        if sparse_failure_reward is not None and r[end] == sparse_failure_reward:
            out[seg] = r[seg] / (1 - discount)
        else:
            g = 0.0
            for i in range(end, start - 1, -1):
                g = r[i] + discount * g * (1.0 - term[i])
                out[i] = g
        start = end + 1
    return out.astype(np.float32)
