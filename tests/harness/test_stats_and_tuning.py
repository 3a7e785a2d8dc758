"""The verdict rule's t quantiles and the per-arm tuning rule."""

from __future__ import annotations

import math

import pytest

from icml26.harness.stats import mean_and_bounds, student_t_quantile
from icml26.harness.tuning import ListGrid, LogGrid, tune_per_arm, tuning_check


@pytest.mark.parametrize("p, df, expected", [
    (0.9, 1, 3.077684), (0.9, 2, 1.885618), (0.9, 4, 1.533206), (0.95, 10, 1.812461), (0.975, 30, 2.042272),
    (0.9, 1000, 1.282399),
])
def test_student_t_quantiles_match_tables(p, df, expected):
    assert student_t_quantile(p, df) == pytest.approx(expected, abs=1e-5)
    assert student_t_quantile(1 - p, df) == pytest.approx(-expected, abs=1e-5)


def test_bounds_need_two_values_and_zero_spread_gives_the_mean():
    with pytest.raises(ValueError, match="at least 2"):
        mean_and_bounds([1.0], 0.9)
    assert mean_and_bounds([2.0, 2.0, 2.0], 0.9) == (2.0, 0.0, 2.0, 2.0)


def test_each_arm_is_tuned_around_its_own_scale_with_equal_budget():
    optimum = {"sgd": 0.1, "adam": 1e-3}
    score = lambda arm, lr, seed: (math.log(lr) - math.log(optimum[arm])) ** 2  # noqa: E731
    out = tune_per_arm({"sgd": LogGrid(0.1), "adam": LogGrid(1e-3)}, score)
    assert out["chosen"] == {"sgd": pytest.approx(0.1), "adam": pytest.approx(1e-3)}
    assert out["on_edge"] == [] and out["evaluations"] == {"sgd": 3, "adam": 3} and out["seeds"] == [1000]
    with pytest.raises(ValueError, match="same size"):
        tune_per_arm({"a": LogGrid(1.0, size=3), "b": LogGrid(1.0, size=5)}, score)


def test_an_edge_choice_extends_the_grid_until_interior_or_spent():
    calls = []

    def score(arm, lr, seed):
        calls.append(lr)
        return abs(math.log(lr / 0.05))  # best at 0.05, two factor-3 steps above the grid's centre 1e-2 / 3

    out = tune_per_arm({"a": LogGrid(1e-2 / 3)}, score, max_extensions=3)
    assert out["chosen"]["a"] == pytest.approx(0.03)  # 0.03 and 0.09 were added; 0.03 is interior and best
    assert out["on_edge"] == [] and out["evaluations"]["a"] > 3
    spent = tune_per_arm({"a": LogGrid(1e-6)}, score, max_extensions=1)
    assert spent["on_edge"] == ["a"] and spent["evaluations"]["a"] == 4
    check = tuning_check({"tuning": spent})
    assert check["passed"] is False and check["values"] == ["a"]
    assert tuning_check({"tuning": {"x": out}})["passed"] is True and tuning_check({"lr": 1}) is None


def test_a_hard_limit_counts_as_interior_and_divergence_loses():
    out = tune_per_arm({"a": LogGrid(0.5, factor=2, upper=1.0)}, lambda arm, v, s: -v)
    assert out["chosen"]["a"] == 1.0 and out["on_edge"] == []
    out = tune_per_arm({"a": LogGrid(1.0)}, lambda arm, v, s: math.nan if v > 2 else v, mode="max")
    assert out["chosen"]["a"] == pytest.approx(1.0)


def test_list_grid_options_choose_by_score_without_extension():
    out = tune_per_arm({"a": ListGrid(("x", "y", "z"))}, lambda arm, v, s: {"x": 3, "y": 1, "z": 2}[v])
    assert out["chosen"]["a"] == "y" and out["evaluations"]["a"] == 3 and out["on_edge"] == []
