"""Loading a local Minari dataset (HDF5 storage) into the D4RL layout, by path or by id under the Minari root, and
clear errors for malformed or unsupported files."""

import numpy as np
import pytest

from icml26.rl.datasets import DatasetError, load_minari

h5py = pytest.importorskip("h5py")


def _write(path, episodes):
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        for i, ep in episodes.items():
            g = f.create_group(f"episode_{i}")
            for k, v in ep.items():
                g.create_dataset(k, data=v)


def _episode(t, obs0, term, trunc):
    obs = obs0 + np.arange(t + 1, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    return {"observations": obs, "actions": np.full((t, 1), obs0, np.float32),
            "rewards": np.arange(t, dtype=np.float32) + obs0, "terminations": np.eye(t)[-1] * term,
            "truncations": np.eye(t)[-1] * trunc}


def test_minari_episodes_become_d4rl_transitions(tmp_path, monkeypatch):
    # episode ids out of order on purpose: "episode_10" after "episode_2" in id order, not in string order
    eps = {10: _episode(2, 100.0, 0, 1), 2: _episode(3, 0.0, 1, 0)}
    _write(tmp_path / "root" / "toy" / "medium-v0" / "data" / "main_data.hdf5", eps)
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "root"))
    data = load_minari("toy/medium-v0")
    np.testing.assert_array_equal(data["observations"][:, 0], [0, 1, 2, 100, 101])
    np.testing.assert_array_equal(data["next_observations"][:, 0], [1, 2, 3, 101, 102])
    np.testing.assert_array_equal(data["rewards"], [0, 1, 2, 100, 101])
    np.testing.assert_array_equal(data["actions"][:, 0], [0, 0, 0, 100, 100])
    np.testing.assert_array_equal(data["terminals"], [0, 0, 1, 0, 0])
    np.testing.assert_array_equal(data["timeouts"], [0, 0, 0, 0, 1])
    same = load_minari(tmp_path / "root" / "toy" / "medium-v0")
    assert all(np.array_equal(data[k], same[k]) for k in data)


def test_malformed_minari_files_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="Minari"):
        load_minari("nope-v0", root=tmp_path)
    bad = _episode(3, 0.0, 1, 0)
    bad["observations"] = bad["observations"][:-1]
    _write(tmp_path / "a.hdf5", {0: bad})
    with pytest.raises(DatasetError, match="T \\+ 1"):
        load_minari(tmp_path / "a.hdf5")
    missing = _episode(3, 0.0, 1, 0)
    del missing["truncations"]
    _write(tmp_path / "b.hdf5", {0: missing})
    with pytest.raises(DatasetError, match="truncations"):
        load_minari(tmp_path / "b.hdf5")
    nan = _episode(3, 0.0, 1, 0)
    nan["rewards"][1] = np.nan
    _write(tmp_path / "c.hdf5", {0: nan})
    with pytest.raises(DatasetError, match="rewards"):
        load_minari(tmp_path / "c.hdf5")
    with h5py.File(tmp_path / "d.hdf5", "w") as f:
        g = f.create_group("episode_0")
        g.create_group("observations").create_dataset("pos", data=np.zeros((4, 2)))
        for k, v in _episode(3, 0.0, 1, 0).items():
            if k != "observations":
                g.create_dataset(k, data=v)
    with pytest.raises(DatasetError, match="Dict space"):
        load_minari(tmp_path / "d.hdf5")
