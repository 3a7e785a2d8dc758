"""The verdict rule's t quantiles and the per-arm tuning rule."""

from __future__ import annotations

import math

import pytest

from icml26.harness.stats import mean_and_bounds, student_t_quantile
from icml26.harness.tuning import ListGrid, LogGrid, tune_per_arm, tuning_check, tuning_checkpoint


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


def test_an_arm_that_never_scores_finite_fails_the_tuning_check():
    # EWC-like: too strong at every strength tried, so it never reaches the target (inf) and its "choice" is
    # only the first of equals; an arm that is tuned fine beside it must not hide that.
    out = tune_per_arm({"ok": LogGrid(1.0), "never": LogGrid(1.0)},
                       lambda arm, v, s: math.inf if arm == "never" else abs(math.log(v)))
    assert out["no_finite_score"] == ["never"] and out["on_edge"] == []
    check = tuning_check({"tuning": {"strengths": out}})
    assert check["passed"] is False and check["values"] == ["strengths:never (no finite score)"]
    listed = tune_per_arm({"a": ListGrid(("x", "y"))}, lambda arm, v, s: math.nan)
    assert listed["no_finite_score"] == ["a"] and tuning_check({"tuning": listed})["passed"] is False
    assert tuning_check({"tuning": tune_per_arm({"ok": LogGrid(1.0)}, lambda arm, v, s: abs(math.log(v)))})["passed"]


def test_an_unscored_arm_searches_its_declared_side_with_the_same_budget():
    # A penalty that never reaches its target above 0.05 (too strong) and is best near 0.01.
    def score(arm, v, s):
        return math.inf if v > 0.05 else math.log(v / 0.01) ** 2

    found = tune_per_arm({"ewc": LogGrid(1.0, unscored_toward=-1)}, score, max_extensions=4)
    assert [float(k) for k in found["scores"]["ewc"]][-4:] == pytest.approx([1 / 9, 1 / 27, 1 / 81, 1 / 243])
    assert found["chosen"]["ewc"] == pytest.approx(1 / 81) and found["no_finite_score"] == []
    assert found["on_edge"] == [] and tuning_check({"tuning": found})["passed"]
    short = tune_per_arm({"ewc": LogGrid(1.0, unscored_toward=-1)}, score, max_extensions=1)  # 1/9 still fails
    assert short["no_finite_score"] == ["ewc"] and short["evaluations"]["ewc"] == 4
    undeclared = tune_per_arm({"ewc": LogGrid(1.0)}, score, max_extensions=4)
    assert undeclared["no_finite_score"] == ["ewc"] and undeclared["evaluations"]["ewc"] == 3
    with pytest.raises(ValueError, match="unscored_toward"):
        LogGrid(1.0, unscored_toward=2)


def test_list_grid_options_choose_by_score_without_extension():
    out = tune_per_arm({"a": ListGrid(("x", "y", "z"))}, lambda arm, v, s: {"x": 3, "y": 1, "z": 2}[v])
    assert out["chosen"]["a"] == "y" and out["evaluations"]["a"] == 3 and out["on_edge"] == []


def _grids():
    return {"sgd": LogGrid(center=0.1), "adam": LogGrid(center=1e-3)}


def _loss(arm, lr, seed):
    best = 0.3 if arm == "sgd" else 1e-2  # adam's best lies past its grid: one extension
    return (math.log(lr) - math.log(best)) ** 2 + 0.01 * (seed - 1000)


def test_a_killed_tuning_resumes_from_its_checkpoint_with_the_same_choice(tmp_path):
    plain = tune_per_arm(_grids(), _loss, mode="min", seeds=(1000, 1001))
    ckpt = tmp_path / "spec.tuning.ckpt"
    calls = []

    def dies_after_five(arm, lr, seed):
        if len(calls) == 5:
            raise KeyboardInterrupt
        calls.append((arm, lr, seed))
        return _loss(arm, lr, seed)

    with pytest.raises(KeyboardInterrupt), tuning_checkpoint(ckpt, "hash-a"):
        tune_per_arm(_grids(), dies_after_five, mode="min", seeds=(1000, 1001))
    assert ckpt.exists() and len(calls) == 5
    again = []

    def counted(arm, lr, seed):
        again.append((arm, lr, seed))
        return _loss(arm, lr, seed)

    with tuning_checkpoint(ckpt, "hash-a"):
        resumed = tune_per_arm(_grids(), counted, mode="min", seeds=(1000, 1001))
    assert resumed == plain
    total = sum(plain["evaluations"].values()) * 2
    assert not set(again) & set(calls) and len(again) == total - 5
    # Another identity (a changed config) does not reuse the scores; neither does a damaged file.
    fresh = []
    with tuning_checkpoint(ckpt, "hash-b"):
        tune_per_arm(_grids(), lambda a, v, s: fresh.append(1) or _loss(a, v, s), mode="min", seeds=(1000, 1001))
    assert len(fresh) == total
    ckpt.write_text("{not json")
    with tuning_checkpoint(ckpt, "hash-b"):
        assert tune_per_arm(_grids(), _loss, mode="min", seeds=(1000, 1001)) == plain


def test_two_tunings_in_one_phase_keep_their_scores_apart(tmp_path):
    ckpt = tmp_path / "spec.tuning.ckpt"
    with tuning_checkpoint(ckpt, "h"):
        first = tune_per_arm({"a": LogGrid(center=1.0)}, lambda a, v, s: (v - 3.0) ** 2, mode="min")
        second = tune_per_arm({"a": LogGrid(center=1.0)}, lambda a, v, s: (v - 1.0) ** 2, mode="min")
    assert first["chosen"]["a"] == pytest.approx(3.0) and second["chosen"]["a"] == pytest.approx(1.0)
    with tuning_checkpoint(ckpt, "h"):  # replayed from the file alone, each call from its own entries
        assert tune_per_arm({"a": LogGrid(center=1.0)}, lambda a, v, s: math.nan, mode="min") == first
        assert tune_per_arm({"a": LogGrid(center=1.0)}, lambda a, v, s: math.nan, mode="min") == second
