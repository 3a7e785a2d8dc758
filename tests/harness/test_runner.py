"""Runner: result files, verdict rules, skip/force, resume after an interrupt; report output."""

from __future__ import annotations

import json

import pytest

from icml26.harness.report import write_report
from icml26.harness.runner import run_spec
from icml26.harness.spec import Comparator, ExperimentSpec, judge

CMP = Comparator("gain", ">=", 0.5, "gain >= 0.5")


def _spec(run, **kw) -> ExperimentSpec:
    base = dict(id="toy", room="toyroom", claim="method beats baseline", paper_ref="none", metric="gain",
                arms=("method", "baseline"), baseline="baseline", comparator=CMP, run=run,
                tiers={"smoke": {"scale": 1.0}, "quick": {"scale": 1.0}}, seeds={"smoke": 1, "quick": 3})
    return ExperimentSpec(**{**base, **kw})


def _toy_run(calls):
    def run(config, seed, prepared):
        calls.append(seed)
        gain = config["scale"] * (1.0 + 0.1 * seed)
        return {"arms": {"method": {"loss": 1.0 - gain / 10}, "baseline": {"loss": 1.0}},
                "statistics": {"gain": gain}}
    return run


def test_result_file_has_provenance_metrics_and_verdict(tmp_path):
    calls = []
    res = run_spec(_spec(_toy_run(calls)), "quick", tmp_path)
    on_disk = json.loads((tmp_path / "toyroom" / "toy.json").read_text())
    assert on_disk["status"] == "complete" and on_disk["verdict"] == res["verdict"] == "reproduced"
    assert set(on_disk["run_info"]) >= {"git_sha", "git_dirty", "packages", "config", "python"}
    assert on_disk["run_info"]["config"] == {"scale": 1.0}
    assert on_disk["arms"]["method"]["loss"]["per_seed"] == pytest.approx([0.9, 0.89, 0.88])
    assert on_disk["arms"]["method"]["loss"]["mean"] == pytest.approx(0.89)
    assert on_disk["statistics"]["gain"]["std"] == pytest.approx(0.1)
    assert on_disk["wall_time_s"] >= 0 and on_disk["peak_rss_bytes"] > 0
    assert "2/3" in on_disk["verdict_rule"] and (tmp_path / "toyroom" / "toy.png").exists()


def test_complete_results_are_skipped_unless_forced(tmp_path):
    calls = []
    spec = _spec(_toy_run(calls))
    run_spec(spec, "quick", tmp_path)
    run_spec(spec, "quick", tmp_path)
    assert calls == [0, 1, 2]
    run_spec(spec, "quick", tmp_path, force=True)
    assert calls == [0, 1, 2, 0, 1, 2]
    # Another seed count reuses the finished seeds of the same config and runs only the new ones.
    res = run_spec(spec, "quick", tmp_path, n_seeds=4)
    assert calls[6:] == [3] and res["seeds"] == [0, 1, 2, 3] and res["status"] == "complete"


def test_interrupt_marks_cancelled_and_rerun_resumes(tmp_path):
    calls = []
    inner = _toy_run(calls)

    def flaky(config, seed, prepared):
        if seed == 2 and len(calls) < 3:
            calls.append("interrupted")
            raise KeyboardInterrupt
        return inner(config, seed, prepared)

    spec = _spec(flaky)
    with pytest.raises(KeyboardInterrupt):
        run_spec(spec, "quick", tmp_path)
    partial = json.loads((tmp_path / "toyroom" / "toy.json").read_text())
    assert partial["status"] == "cancelled" and [r["seed"] for r in partial["seed_results"]] == [0, 1]
    res = run_spec(spec, "quick", tmp_path)
    assert calls == [0, 1, "interrupted", 2] and res["status"] == "complete"
    assert [r["seed"] for r in res["seed_results"]] == [0, 1, 2]


def test_prepare_runs_once_and_is_stored(tmp_path):
    prepared_calls = []

    def prepare(config):
        prepared_calls.append(1)
        return {"lr": 0.1}

    def run(config, seed, prepared):
        assert prepared == {"lr": 0.1}
        return {"arms": {"method": {"x": 1.0}, "baseline": {"x": 0.0}}, "statistics": {"gain": 1.0}}

    res = run_spec(_spec(run, prepare=prepare), "quick", tmp_path)
    assert prepared_calls == [1] and res["prepared"] == {"lr": 0.1}


@pytest.mark.parametrize("values, tier, verdict", [
    ([0.6, 0.7, 0.8], "quick", "reproduced"),
    ([0.1, 0.2, 0.9], "quick", "not_reproduced"),
    ([0.6, 0.4, 0.7], "quick", "reproduced"),  # the mean and 2 of 3 seeds pass
    ([0.9, 0.45, 0.45], "quick", "inconclusive"),
    ([0.9, 0.9, 0.9], "smoke", "inconclusive"),
    ([0.9], "quick", "inconclusive"),
    ([float("nan"), 0.9], "quick", "inconclusive"),
])
def test_verdict_rule(values, tier, verdict):
    assert judge(CMP, values, tier)[0] == verdict


def test_spec_and_override_validation(tmp_path):
    with pytest.raises(ValueError, match="op"):
        Comparator("gain", "==", 1.0, "")
    with pytest.raises(ValueError, match="smoke"):
        _spec(_toy_run([]), tiers={"quick": {}})
    with pytest.raises(ValueError, match="baseline"):
        _spec(_toy_run([]), baseline="other")
    with pytest.raises(ValueError, match="no config field"):
        run_spec(_spec(_toy_run([])), "quick", tmp_path, overrides={"nope": 1})
    with pytest.raises(ValueError, match="tier"):
        run_spec(_spec(_toy_run([])), "full", tmp_path)


def test_report_has_a_row_and_a_plot_per_claim(tmp_path):
    run_spec(_spec(_toy_run([])), "quick", tmp_path)
    run_spec(_spec(_toy_run([]), id="toy2", claim="second claim"), "smoke", tmp_path)
    page, md = write_report(tmp_path)
    text = md.read_text()
    assert text.count("| toyroom |") == 2 and "**reproduced**" in text and "**inconclusive**" in text
    html = page.read_text()
    assert html.count("data:image/png;base64,") == 2 and "second claim" in html
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path / "empty")
