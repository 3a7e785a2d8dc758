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
