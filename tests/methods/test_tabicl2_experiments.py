"""tabicl2 claims: the smoke tier runs through the harness, and the null arm (method = baseline) is rejected."""

from __future__ import annotations

import pytest

from icml26.harness.runner import run_spec
from icml26.methods.tabicl2.experiments import ARMS, SPECS, TIERS

pytestmark = pytest.mark.usefixtures("one_thread")


def test_smoke_tier_runs(tmp_path):
    spec = SPECS[0]
    result = run_spec(spec, "smoke", tmp_path)
    seed = result["seed_results"][0]
    assert set(seed["arms"]) == set(ARMS)
    for arm in ARMS:
        assert 0.0 <= seed["arms"][arm]["auc"] <= 1.0
    assert set(seed["checks"]) == {"pretrained_gain", "above_chance"}
    assert "hgb_tuned" in result["prepared"]["tuning"]["chosen"]


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_null_arm_is_rejected(spec, tmp_path):
    result = run_spec(spec, "smoke", tmp_path, overrides={"null": True})
    stat = spec.comparator.statistic
    values = result["seed_results"][0]["statistics"][stat]
    assert values == spec.null_value == 0.0
    assert not spec.comparator.holds(values)


def test_regression_smoke_tier_runs(tmp_path):
    from icml26.methods.tabicl2.experiments import REG_ARMS
    spec = next(s for s in SPECS if s.id == "r2_vs_hgb_default")
    result = run_spec(spec, "smoke", tmp_path)
    seed = result["seed_results"][0]
    assert set(seed["arms"]) == set(REG_ARMS)
    for arm in REG_ARMS:
        assert seed["arms"][arm]["r2"] <= 1.0 and seed["arms"][arm]["rmse"] >= 0
    assert set(seed["checks"]) == {"pretrained_gain", "above_mean_predictor"}
    assert set(result["prepared"]["tuning"]["chosen"]) == {"hgb_tuned", "ridge"}


def test_regression_tables_load_and_split():
    import numpy as np
    from icml26.methods.tabicl2.experiments import REG_TABLES, load_regression_table, split_regression
    for name in REG_TABLES:
        X, y = load_regression_table(name)
        assert X.ndim == 2 and len(X) == len(y) and np.isfinite(X).all() and np.isfinite(y).all() and y.std() > 0
    Xtr, ytr, Xte, yte = split_regression("diabetes", 0, 100, 50)
    assert len(ytr) == 100 and len(yte) == 50
    again = split_regression("diabetes", 0, 100, 50)
    np.testing.assert_array_equal(again[1], ytr)
    # bupa_drinks: the target column is not among the features
    X, y = load_regression_table("bupa_drinks")
    assert X.shape[1] == 5 and not any(np.array_equal(X[:, j], y) for j in range(5))
