"""CalM users' data loader: NumPy and HDF5 round trips, per-neuron z-scoring, and a clear error (raised before
anything is returned) for NaN traces, zero-variance neurons, wrong shapes and mismatched frame rates."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from icml26.methods.calm.data import check_dff, load_session, load_sessions


@pytest.fixture
def dff():
    return np.random.default_rng(0).standard_normal((7, 130)) * 3 + 1


def test_npy_npz_h5_round_trip_and_zscore(tmp_path, dff):
    np.save(tmp_path / "a.npy", dff)
    np.savez(tmp_path / "b.npz", dff=dff, fs=10.0)
    with h5py.File(tmp_path / "c.h5", "w") as f:
        f.create_dataset("traces", data=dff.T).attrs["fs"] = 10.0
    a = load_session(tmp_path / "a.npy", fs=10.0)
    b = load_session(tmp_path / "b.npz")
    c = load_session(tmp_path / "c.h5", key="traces", frames_first=True)
    expect = (dff - dff.mean(1, keepdims=True)) / dff.std(1, keepdims=True)
    for r in (a, b, c):
        assert r.dff.dtype == np.float32 and r.fs == 10.0 and (r.n_neurons, r.n_frames) == (7, 130)
        np.testing.assert_allclose(r.dff, expect, rtol=1e-5, atol=1e-5)
    assert len(load_sessions([tmp_path / "a.npy", tmp_path / "b.npz"], fs=10.0)) == 2


def test_bad_traces_raise_naming_the_neurons(tmp_path, dff):
    nan = dff.copy()
    nan[3, 10] = np.nan
    with pytest.raises(ValueError, match=r"neurons \[3\].*NaN"):
        check_dff(nan)
    dead = dff.copy()
    dead[[1, 5]] = 2.0
    with pytest.raises(ValueError, match=r"neurons \[1, 5\].*zero variance"):
        check_dff(dead)
    with pytest.raises(ValueError, match="2-D"):
        check_dff(dff[0])
    with pytest.raises(TypeError, match="numpy array"):
        check_dff(dff.tolist())
    np.save(tmp_path / "short.npy", dff[:, :10])
    with pytest.raises(ValueError, match="frames"):
        load_session(tmp_path / "short.npy", fs=10.0)


def test_frame_rate_errors(tmp_path, dff):
    np.savez(tmp_path / "a.npz", dff=dff, fs=10.0)
    np.savez(tmp_path / "b.npz", dff=dff, fs=30.0)
    np.save(tmp_path / "c.npy", dff)
    with pytest.raises(ValueError, match="different frame rates"):
        load_sessions([tmp_path / "a.npz", tmp_path / "b.npz"])
    with pytest.raises(ValueError, match="says fs=10"):
        load_session(tmp_path / "a.npz", fs=30.0)
    with pytest.raises(ValueError, match="pass fs="):
        load_session(tmp_path / "c.npy")
    with pytest.raises(ValueError, match="positive frame rate"):
        load_session(tmp_path / "c.npy", fs=0)
    with pytest.raises(ValueError, match="unsupported"):
        (tmp_path / "d.csv").write_text("1,2")
        load_session(tmp_path / "d.csv", fs=10.0)
