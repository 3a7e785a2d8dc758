"""StarEmbed room: dataset determinism, feature correctness on sinusoids, metric correctness, bad inputs."""

from __future__ import annotations

import numpy as np
import pytest

from icml26.methods.starembed import (HandCraftedEmbedder, LightCurve, RandomEmbedder, StarEmbedConfig, TSFMEmbedder,
                                      best_period, build_dataset, clustering_task, evaluate, extract, fourier_fit,
                                      hungarian_macro_f1, ood_task, tokenize)
from icml26.methods.starembed import reference as ref
from icml26.methods.starembed.experiments import SPECS
from icml26.methods.starembed.features import FEATURE_NAMES

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(n_stars=70, n_ood=15, max_points=50, rf_trees=10, iforest_trees=10)


def _sinusoid(period=0.37, amp=0.4, n=150, noise=0.005, seed=0):
    rng = np.random.default_rng(seed)
    t = np.sort(rng.uniform(0, 600, n))
    mag = 15 + amp * np.cos(2 * np.pi * t / period + 0.3) + rng.normal(0, noise, n)
    return LightCurve(t=t, mag=mag, err=np.full(n, noise))


@pytest.fixture(scope="module")
def small():
    return build_dataset(StarEmbedConfig(**SMALL), seed=3)


def test_dataset_is_deterministic_and_seed_dependent(small):
    again = build_dataset(StarEmbedConfig(**SMALL), seed=3)
    assert small.content_hash() == again.content_hash()
    assert build_dataset(StarEmbedConfig(**SMALL), seed=4).content_hash() != small.content_hash()
    parts = set(small.split)
    assert parts == {"train", "val", "test", "ood"}
    # every ID class appears in train and test (stratified), OOD classes only in "ood"
    for part in ("train", "test"):
        assert set(small.subset(part)[1]) == {"RRab", "RRc", "RRd", "Cep_F", "Cep_1O", "Mira", "SRV"}
    assert set(small.subset("ood")[1]) == {"DSCT", "T2Cep", "aCep"}


def test_hash_changes_when_one_magnitude_changes(small):
    before = small.content_hash()
    lc = small.curves[0]
    small.curves[0] = LightCurve(t=lc.t, mag=lc.mag + np.r_[1e-9, np.zeros(len(lc.mag) - 1)], err=lc.err)
    try:
        assert small.content_hash() != before
    finally:
        small.curves[0] = lc


@pytest.mark.parametrize("period,amp", [(0.37, 0.4), (2.9, 0.15), (55.0, 1.2)])
def test_features_recover_period_and_amplitude(period, amp):
    lc = _sinusoid(period, amp)
    p, power = best_period(lc)
    assert abs(p / period - 1) < 3e-3 and power > 0.99  # ~11 cycles of a 55 d period in 600 d limit precision
    amps, phases, resid = fourier_fit(lc.t, lc.mag, p)
    assert amps[0] == pytest.approx(amp, rel=0.02)
    assert np.all(amps[1:] < 0.01) and resid < 0.03 * amp + 0.01
    f = dict(zip(FEATURE_NAMES, extract(lc)))
    assert f["log_period"] == pytest.approx(np.log10(period), abs=1e-3)
    assert f["amplitude"] == pytest.approx(amp, rel=0.05)  # half the 5-95 percentile range of a pure cosine ~ amp


def test_fourier_fit_recovers_harmonic_phase():
    t = np.linspace(0, 10, 400)
    y = 1.0 * np.cos(2 * np.pi * t + 0.5) + 0.3 * np.cos(4 * np.pi * t - 1.0)
    amps, phases, _ = fourier_fit(t, y, 1.0)
    np.testing.assert_allclose(amps[:2], [1.0, 0.3], atol=1e-9)
    np.testing.assert_allclose(phases[:2], [0.5, -1.0], atol=1e-9)


def test_astropy_periodogram_matches_reference():
    from astropy.timeseries import LombScargle

    lc = _sinusoid(1.7, 0.3, n=80, noise=0.05, seed=1)
    freqs = np.linspace(0.05, 2.0, 300)
    # unweighted floating-mean Lomb-Scargle is exactly the least-squares fraction of variance explained
    fast = LombScargle(lc.t, lc.mag).power(freqs, method="cython")
    np.testing.assert_allclose(fast, ref.ls_periodogram(lc.t, lc.mag, freqs), atol=1e-8)
    fine = np.linspace(1 / 1.75, 1 / 1.65, 400)
    assert abs(1 / fine[np.argmax(ref.ls_periodogram(lc.t, lc.mag, fine))] / best_period(lc)[0] - 1) < 1e-3


def test_metrics_match_references():
    from sklearn.metrics import adjusted_rand_score, roc_auc_score

    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 60).astype(str)
    cl = np.where(rng.random(60) < 0.6, y, rng.integers(0, 4, 60).astype(str))
    assert adjusted_rand_score(y, cl) == pytest.approx(ref.adjusted_rand(y, cl), abs=1e-12)
    neg, pos = rng.normal(0, 1, 30), rng.normal(1, 1, 20)
    assert roc_auc_score(np.r_[np.zeros(30), np.ones(20)], np.r_[neg, pos]) == pytest.approx(ref.auroc(neg, pos))
    # Hungarian F1 is invariant to relabelling the clusters and equals 1 for a perfect permuted clustering
    perm = {"0": "c", "1": "a", "2": "d", "3": "b"}
    assert hungarian_macro_f1(y, np.array([perm[v] for v in y])) == pytest.approx(1.0)
    # the optimal matching reaches the brute-force best accuracy, so its F1 is at least that of any fixed map
    assert ref.hungarian_accuracy(y, cl) >= np.mean(y == cl)


def test_tasks_separate_informative_from_random_embeddings():
    rng = np.random.default_rng(0)
    y = np.repeat(np.array(["a", "b", "c"]), 40)
    centres = {"a": [0, 0], "b": [6, 0], "c": [0, 6]}
    X = np.array([centres[v] for v in y]) + rng.normal(0, 0.5, (120, 2))
    assert clustering_task(X, y, 0)["kmeans_ari"] > 0.9
    assert clustering_task(rng.normal(size=(120, 2)), y, 0)["kmeans_ari"] < 0.1
    cfg = StarEmbedConfig(iforest_trees=50)
    far = rng.normal(20, 0.5, (30, 2))
    assert ood_task(X, y, X[:30], far, cfg, 0)["ood_auroc"] > 0.95


def test_tokenize_left_pads_and_keeps_last_context():
    ids = tokenize(np.arange(10.0), 16)
    assert ids.shape == (16,) and (ids[:6] == 128).all() and (ids[6:] < 128).all()
    assert (tokenize(np.arange(300.0), 200) < 128).all()
    assert tokenize(np.arange(10.0), 16)[-1] > tokenize(np.arange(10.0), 16)[6]  # monotone values, monotone bins


def test_evaluate_runs_every_embedder(small):
    cfg = StarEmbedConfig(**SMALL)
    for emb in (HandCraftedEmbedder(), RandomEmbedder(8), TSFMEmbedder(64, pretrain_steps=2, n_series=8)):
        out = evaluate(emb, small, cfg, seed=0)
        assert {"rf_macro_f1", "knn_acc", "kmeans_ari", "kmeans_nmi", "ood_auroc"} <= set(out)
        assert all(np.isfinite(v) for v in out.values())


def test_bad_inputs_raise(small):
    with pytest.raises(ValueError, match="n_stars"):
        StarEmbedConfig(n_stars=5)
    with pytest.raises(ValueError, match="split"):
        StarEmbedConfig(split=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="min_points"):
        StarEmbedConfig(min_points=300, max_points=100)
    with pytest.raises(ValueError, match="outlier_rate"):
        StarEmbedConfig(outlier_rate=0.9)
    with pytest.raises(ValueError, match="same length"):
        LightCurve(t=np.arange(6.0), mag=np.zeros(5), err=np.ones(5))
    with pytest.raises(ValueError, match="sorted"):
        LightCurve(t=np.array([0.0, 2, 1, 3, 4]), mag=np.zeros(5), err=np.ones(5))
    with pytest.raises(ValueError, match="finite"):
        LightCurve(t=np.arange(5.0), mag=np.array([0, 1, np.nan, 0, 1]), err=np.ones(5))

    class NaNEmbedder:
        def fit(self, curves, labels=None):
            return self

        def transform(self, curves):
            return np.full((len(curves), 3), np.nan)

    with pytest.raises(ValueError, match="NaN"):
        evaluate(NaNEmbedder(), small, StarEmbedConfig(**SMALL))
    with pytest.raises(TypeError, match="transform"):
        evaluate(object(), small, StarEmbedConfig(**SMALL))


def test_specs_are_well_formed():
    assert [s.id for s in SPECS] == ["classification", "clustering", "ood"]
    for s in SPECS:
        assert s.baseline == "handcrafted" and set(s.arms) == {"tsfm", "handcrafted", "random"}
        assert s.seeds["quick"] == 5 and {"smoke", "quick"} <= set(s.tiers)
        assert s.null_value == 0.0 and not s.comparator.holds(s.null_value)
        assert {"tsfm_auroc_over_chance", "tsfm_f1_over_random"} <= {c.name for c in s.checks}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.id)
def test_null_arm_is_rejected_by_every_comparator(spec):
    """The method switched back to the baseline (tsfm arm = hand-crafted embedder): statistic 0, comparator fails."""
    out = spec.run({**spec.tiers["smoke"], "null": True}, 0, None)
    value = out["statistics"][spec.comparator.statistic]
    assert value == pytest.approx(0.0, abs=1e-12)
    assert not spec.comparator.holds(value)


def test_simulated_benchmark_fails_the_observed_data_check():
    """Classification is judged only on observed light curves; the simulator reports 0, so the check fails."""
    spec = SPECS[0]
    out = spec.run(spec.tiers["smoke"], 0, None)
    check = next(c for c in spec.checks if c.name == "observed_light_curves")
    assert not check.evaluate([out["checks"]["observed_light_curves"]])["passed"]
