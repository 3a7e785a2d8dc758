"""StarEmbed bad input on the benchmark side, through the public API (the embedders' own checks live in
test_starembed_sklearn.py): configs, seeds, datasets, split names and embedder outputs get a ValueError/TypeError
naming the problem, before any embedder is fitted. Also runs the card's first python snippet verbatim."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from icml26.methods.starembed import LightCurveDataset, StarEmbedConfig, build_dataset, evaluate

README = Path(__file__).resolve().parents[2] / "src/icml26/methods/starembed/README.md"
SMALL = dict(n_stars=70, n_ood=15, max_points=50, rf_trees=10, iforest_trees=10)


@pytest.fixture(scope="module")
def data():
    return build_dataset(StarEmbedConfig(**SMALL), seed=0)


class Recorder:
    """An Embedder that returns ``out(curves)`` and records whether it was fitted."""

    def __init__(self, out):
        self.out, self.fitted = out, False

    def fit(self, curves, labels=None):
        self.fitted = True
        return self

    def transform(self, curves):
        return self.out(curves)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_ood=2), "n_ood must be at least 3"), (dict(split_seed=-1), "split_seed"),
    (dict(split_seed=1.5), "split_seed"), (dict(split="abc"), "split must be three positive fractions"),
    (dict(split=(math.nan, 0.5, 0.5)), "split"), (dict(span_days="10"), "span_days must be a number"),
    (dict(noise_floor=None), "noise_floor must be a number"), (dict(outlier_rate=0.7), "outlier_rate"),
    (dict(n_stars=0), "n_stars"), (dict(knn_k=True), "knn_k"), (dict(min_points=5), "min_points"),
])
def test_config_names_the_bad_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StarEmbedConfig(**{**SMALL, **kwargs})


@pytest.mark.parametrize("seed", [-1, 1.5, "0", 2 ** 32, True])
def test_bad_seeds_raise_before_building_or_fitting(seed, data):
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32\)"):
        build_dataset(StarEmbedConfig(**SMALL), seed=seed)
    emb = Recorder(lambda curves: np.random.default_rng(0).normal(size=(len(curves), 3)))
    with pytest.raises(ValueError, match="seed must be an integer"):
        evaluate(emb, data, StarEmbedConfig(**SMALL), seed=seed)
    assert not emb.fitted


def test_wrong_types_raise_before_the_embedder_is_fitted(data):
    cfg = StarEmbedConfig(**SMALL)
    emb = Recorder(lambda curves: np.zeros((len(curves), 3)))
    with pytest.raises(TypeError, match="cfg must be a StarEmbedConfig, got dict"):
        build_dataset({"n_stars": 70}, seed=0)
    with pytest.raises(TypeError, match="cfg must be a StarEmbedConfig"):
        evaluate(emb, data, {"knn_k": 5})
    with pytest.raises(TypeError, match="data must be a LightCurveDataset"):
        evaluate(emb, [data.curves, data.labels], cfg)
    with pytest.raises(TypeError, match="embedder must have fit"):
        evaluate(object(), data, cfg)
    no_ood = LightCurveDataset(curves=data.curves, labels=data.labels,
                               split=np.where(data.split == "ood", "val", data.split), periods=data.periods)
    with pytest.raises(ValueError, match=r"no light curve in split\(s\) \['ood'\]"):
        evaluate(emb, no_ood, cfg)
    assert not emb.fitted


def test_dataset_and_split_names_are_checked(data):
    with pytest.raises(ValueError, match="unknown split 'training'"):
        data.subset("training")
    n = len(data.curves)
    with pytest.raises(ValueError, match=f"one entry per curve \\({n}\\)"):
        LightCurveDataset(curves=data.curves, labels=data.labels[:-1], split=data.split, periods=data.periods)
    with pytest.raises(TypeError, match=r"curves\[0\] must be a LightCurve, got ndarray"):
        LightCurveDataset(curves=[np.zeros(5)] + data.curves[1:], labels=data.labels, split=data.split,
                          periods=data.periods)
    with pytest.raises(ValueError, match=r"split names must be among .* got \['holdout'\]"):
        LightCurveDataset(curves=data.curves, labels=data.labels, split=np.where(data.split == "val", "holdout",
                                                                                  data.split), periods=data.periods)


@pytest.mark.parametrize("out, error, match", [
    (lambda c: np.full((len(c), 3), np.nan), ValueError, "train embeddings contains NaN or inf"),
    (lambda c: np.zeros((len(c) + 1, 3)), ValueError, "one row per light curve"),
    (lambda c: np.zeros(len(c)), ValueError, "must be a 2-D array"),
    (lambda c: np.zeros((len(c), 0)), ValueError, "have 0 features"),
    (lambda c: ..., TypeError, "must be a numeric array, got ellipsis"),
    (lambda c: None, TypeError, "must be a numeric array"),
    (lambda c: np.ones((len(c), 3)) * 1j, TypeError, "must be real, got complex"),
    (lambda c: np.array([["a", "b"]] * len(c)), TypeError, "must be a numeric array"),
])
def test_bad_embeddings_are_named(out, error, match, data):
    with pytest.raises(error, match=match):
        evaluate(Recorder(out), data, StarEmbedConfig(**SMALL))


def test_readme_benchmark_snippet_runs(capsys, run_card_snippet):
    """Executes the card's first python block ('What the room gives you') verbatim."""
    scope = run_card_snippet(README, "## What the room gives you")
    metrics = scope["metrics"]
    assert set(metrics) == {"rf_acc", "rf_macro_f1", "knn_acc", "knn_macro_f1", "logreg_acc", "logreg_macro_f1",
                            "kmeans_ari", "kmeans_nmi", "kmeans_hungarian_f1", "ood_auroc"}
    assert all(math.isfinite(v) for v in metrics.values())
    assert len(capsys.readouterr().out.strip()) == 64  # the sha256 hex digest
