"""TabICLClassifier through scikit-learn's own API (clone, params, cross_val_score, estimator checks, pickling)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.datasets import load_iris
from sklearn.model_selection import cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import FunctionTransformer

from icml26.methods.tabicl2.config import TabICLConfig
from icml26.methods.tabicl2.estimator import TabICLClassifier, default_checkpoint
from icml26.methods.tabicl2.pretrain import export_checkpoint
from icml26.methods.tabicl2.reference import TabICL

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    cfg = TabICLConfig(embed_dim=16, col_nhead=2, row_nhead=2, icl_nhead=2, col_num_inds=4, icl_num_blocks=1,
                       row_num_blocks=1, ssmax_hidden=8)
    return str(export_checkpoint(TabICL(cfg), tmp_path_factory.mktemp("ck") / "tiny.pt", {"untrained": True}))


def _data(n=60, H=4, k=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, H))
    y = (X[:, 0] > 0).astype(int) + (X[:, 1] > 0.5).astype(int) * (k > 2)
    return X, y


def test_fit_predict_shapes_and_api(tiny_ckpt):
    X, y = _data()
    clf = TabICLClassifier(n_estimators=3, model_path=tiny_ckpt)
    assert clf.get_params()["n_estimators"] == 3
    clf.fit(X[:40], y[:40])
    p = clf.predict_proba(X[40:])
    assert p.shape == (20, 3)
    np.testing.assert_allclose(p.sum(1), 1, rtol=1e-9)
    assert set(clf.predict(X[40:])) <= set(clf.classes_)
    assert clf.n_features_in_ == 4
    c2 = clone(clf)
    assert not hasattr(c2, "model_") and c2.get_params() == clf.get_params()


def test_string_labels_and_class_order(tiny_ckpt):
    X, y = _data()
    names = np.array(["zeta", "alpha", "mid"])[y]
    clf = TabICLClassifier(n_estimators=2, model_path=tiny_ckpt).fit(X, names)
    assert list(clf.classes_) == ["alpha", "mid", "zeta"]
    assert set(clf.predict(X)) <= set(clf.classes_)


def test_deterministic_and_test_row_independent(tiny_ckpt):
    X, y = _data()
    a = TabICLClassifier(n_estimators=4, model_path=tiny_ckpt, random_state=3).fit(X[:40], y[:40])
    b = TabICLClassifier(n_estimators=4, model_path=tiny_ckpt, random_state=3).fit(X[:40], y[:40])
    np.testing.assert_array_equal(a.predict_proba(X[40:]), b.predict_proba(X[40:]))
    # predictions for a row do not depend on which other rows are predicted with it
    np.testing.assert_allclose(a.predict_proba(X[40:45]), a.predict_proba(X[40:])[:5], atol=1e-6)
    small = TabICLClassifier(n_estimators=4, model_path=tiny_ckpt, random_state=3, test_batch_size=3)
    np.testing.assert_allclose(small.fit(X[:40], y[:40]).predict_proba(X[40:]), a.predict_proba(X[40:]), atol=1e-6)


def test_class_shift_unshifts_logits(tiny_ckpt):
    """A member with a class shift must report logits in the original class order: with one member and a
    shift, probabilities equal those of the unshifted network run on shifted labels, mapped back."""
    X, y = _data()
    clf = TabICLClassifier(n_estimators=2, norm_methods=["none"], feat_shuffle=False, model_path=tiny_ckpt)
    clf.fit(X[:40], y[:40])
    m = clf.members_[1]
    assert m["shift"] == 1
    table = torch.as_tensor(np.concatenate([clf.X_train_, clf._standardise(X[40:])]), dtype=torch.float32)[None]
    with torch.no_grad():
        raw = clf.model_(table, torch.as_tensor((clf.y_train_ + 1) % 3)[None])[0, :, :3].numpy()
        raw0 = clf.model_(table, torch.as_tensor(clf.y_train_)[None])[0, :, :3].numpy()
    expected = (raw0 + raw[:, [1, 2, 0]]) / 2
    np.testing.assert_allclose(clf.predict_logits(X[40:]), expected, atol=1e-5)


def test_missing_values_categorical_and_pickle(tiny_ckpt):
    X, y = _data()
    Xn = X.copy()
    Xn[::7, 1] = np.nan
    Xn[:, 3] = np.nan  # an all-missing column
    clf = TabICLClassifier(n_estimators=2, model_path=tiny_ckpt).fit(Xn, y)
    p = clf.predict_proba(Xn)
    assert np.isfinite(p).all()
    obj = np.empty((60, 2), dtype=object)
    obj[:, 0] = X[:, 0]
    obj[:, 1] = np.array(["red", "green", "blue"])[y]
    clf2 = TabICLClassifier(n_estimators=2, model_path=tiny_ckpt).fit(obj, y)
    obj_test = obj[:5].copy()
    obj_test[0, 1] = "purple"  # unseen category -> treated as missing
    assert np.isfinite(clf2.predict_proba(obj_test)).all()
    clf3 = pickle.loads(pickle.dumps(clf))
    np.testing.assert_allclose(clf3.predict_proba(Xn), p)


def test_pandas_input(tiny_ckpt):
    pd = pytest.importorskip("pandas")
    X, y = _data()
    df = pd.DataFrame(X, columns=list("abcd"))
    df["colour"] = np.array(["red", "green", "blue"])[y]
    clf = TabICLClassifier(n_estimators=2, model_path=tiny_ckpt).fit(df, y)
    assert clf.predict_proba(df).shape == (60, 3)
    with pytest.raises(ValueError):
        clf.predict_proba(df[["a", "b"]])


def test_clear_errors(tiny_ckpt):
    X, y = _data()
    clf = TabICLClassifier(model_path=tiny_ckpt, n_estimators=2)
    with pytest.raises(ValueError, match="2D|2-D|Expected 2D"):
        clf.fit(X[:, 0], y)
    with pytest.raises(ValueError, match="inconsistent"):
        clf.fit(X, y[:-1])
    with pytest.raises(ValueError, match="at least 2 classes"):
        clf.fit(X, np.zeros(60, dtype=int))
    # more than 10 classes is supported (class tree): tests/methods/test_tabicl2_many_classes.py
    assert clf.fit(np.random.default_rng(0).normal(size=(40, 3)), np.arange(40) % 12).n_classes_ == 12
    Xi = X.copy()
    Xi[0, 0] = np.inf
    with pytest.raises(ValueError, match="infinite|infinity"):
        clf.fit(Xi, y)
    with pytest.raises(ValueError, match="n_estimators"):
        TabICLClassifier(n_estimators=0, model_path=tiny_ckpt).fit(X, y)
    with pytest.raises(FileNotFoundError, match="rebuild"):
        TabICLClassifier(model_path="/nonexistent/ck.pt").fit(X, y)
    clf.fit(X, y)
    with pytest.raises(ValueError, match="features"):
        clf.predict(X[:, :3])
    from sklearn.exceptions import NotFittedError
    with pytest.raises(NotFittedError):
        TabICLClassifier().predict(X)


def test_sklearn_estimator_checks(tiny_ckpt):
    from sklearn.utils.estimator_checks import check_estimator
    # an untrained network cannot reach the accuracy check_classifiers_train asks for; the shipped one is tested
    # for accuracy below
    failed = check_estimator(TabICLClassifier(n_estimators=2, model_path=tiny_ckpt), on_fail=None,
                             expected_failed_checks={"check_classifiers_train": "untrained test network"})
    bad = [r for r in failed if r["status"] == "failed"]
    assert not bad, [(r["check_name"], str(r["exception"])[:200]) for r in bad]


def test_cross_val_score_in_pipeline(tiny_ckpt):
    X, y = _data(n=90)
    pipe = make_pipeline(FunctionTransformer(), TabICLClassifier(n_estimators=2, model_path=tiny_ckpt))
    scores = cross_val_score(pipe, X, y, cv=3)
    assert scores.shape == (3,) and np.isfinite(scores).all()


def test_shipped_checkpoint_works_offline_and_beats_chance():
    assert default_checkpoint().exists(), "the shipped checkpoint is missing"
    assert default_checkpoint().stat().st_size < 20 * 2 ** 20
    X, y = load_iris(return_X_y=True)
    rng = np.random.default_rng(0)
    idx = rng.permutation(150)
    clf = TabICLClassifier(n_estimators=2).fit(X[idx[:75]], y[idx[:75]])
    acc = (clf.predict(X[idx[75:]]) == y[idx[75:]]).mean()
    assert acc > 0.6  # chance is 1/3


def test_official_format_checkpoint_is_refused_clearly(tmp_path):
    """A checkpoint written in the official package's format ({"config": the official TabICL constructor's keyword
    arguments, "state_dict": official parameter names}) is recognised and refused with a message that says why,
    before any model is built; unknown config fields are refused too. (Official weights cannot be downloaded
    here; this checkpoint is written locally with random tensors.)"""
    from icml26.methods.tabicl2.estimator import load_model
    official_cfg = {"max_classes": 10, "num_quantiles": 999, "embed_dim": 16, "col_num_blocks": 1, "col_nhead": 2,
                    "col_num_inds": 8, "col_affine": False, "col_feature_group": "same", "col_feature_group_size": 3,
                    "col_target_aware": True, "col_ssmax": "qassmax-mlp-elementwise", "row_num_blocks": 1,
                    "row_nhead": 2, "row_num_cls": 4, "row_rope_base": 100000, "row_rope_interleaved": False,
                    "icl_num_blocks": 1, "icl_nhead": 2, "icl_ssmax": "qassmax-mlp-elementwise", "ff_factor": 2,
                    "dropout": 0.0, "activation": "gelu", "norm_first": True, "bias_free_ln": False,
                    "zero_init": False, "recompute": False}
    sd = {"col_embedder.in_linear.weight": torch.randn(16, 3), "icl_predictor.decoder.2.weight": torch.randn(10, 128)}
    torch.save({"config": official_cfg, "state_dict": sd}, tmp_path / "official.ckpt")
    with pytest.raises(ValueError, match="official TabICL checkpoint.*not implemented"):
        load_model(tmp_path / "official.ckpt")
    with pytest.raises(ValueError, match="official TabICL checkpoint"):
        TabICLClassifier(model_path=str(tmp_path / "official.ckpt")).fit(np.random.rand(20, 3), np.arange(20) % 2)
    torch.save({"config": {**TabICLConfig().to_dict(), "mystery": 1}, "state_dict": {}}, tmp_path / "odd.pt")
    with pytest.raises(ValueError, match="mystery"):
        load_model(tmp_path / "odd.pt")
