"""Runner: result files, verdict rules, skip/force, resume after an interrupt; report output."""

from __future__ import annotations

import json

import pytest

from icml26.harness.report import write_report
from icml26.harness.runner import ResultFileError, run_spec
from icml26.harness.spec import Comparator, ExperimentSpec, MechanismCheck, judge

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
    assert "Student t" in on_disk["verdict_rule"] and (tmp_path / "toyroom" / "toy.png").exists()
    assert on_disk["bound"]["confidence"] == 0.9 and on_disk["bound"]["lower"] > 0.5
    assert {"threads", "device", "cpu_count"} <= set(on_disk["run_info"])
    # tells machines apart; the instruction set torch uses is read only when a room has loaded torch (this one has not)
    assert on_disk["run_info"]["cpu_model"] and "cpu_capability" in on_disk["run_info"]


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
    ([0.6, 0.7, 0.8], "quick", "reproduced"),       # lower 90% bound 0.62 > 0.5
    ([0.1, 0.2, 0.3], "quick", "not_reproduced"),   # upper bound 0.28 < 0.5
    ([0.1, 0.2, 0.9], "quick", "inconclusive"),     # mean fails, but the seeds are too spread to exclude 0.5
    ([0.6, 0.4, 0.7], "quick", "inconclusive"),     # mean passes, lower bound 0.45 does not
    ([0.9, 0.9, 0.9], "smoke", "inconclusive"),
    ([0.9], "quick", "inconclusive"),
    ([float("nan"), 0.9, 0.9], "quick", "inconclusive"),
])
def test_verdict_rule(values, tier, verdict):
    assert judge(CMP, values, tier)["verdict"] == verdict


def test_verdict_bound_is_the_student_t_bound():
    out = judge(CMP, [0.6, 0.7, 0.8], "quick")
    # mean 0.7, std 0.1, t(0.9, 2) = 1.8856: bounds 0.7 -/+ 1.8856 * 0.1 / sqrt(3)
    assert out["lower"] == pytest.approx(0.7 - 0.108866, abs=1e-5)
    assert out["upper"] == pytest.approx(0.7 + 0.108866, abs=1e-5)
    less = Comparator("loss", "<=", 0.5, "loss <= 0.5")
    assert judge(less, [0.1, 0.2, 0.3], "quick")["verdict"] == "reproduced"
    assert judge(less, [0.6, 0.7, 0.8], "quick")["verdict"] == "not_reproduced"


@pytest.mark.parametrize("values", [[0.6, 0.7, 0.8], [0.1, 0.2, 0.3]])
def test_a_failed_mechanism_check_can_only_give_inconclusive(values):
    failed = [MechanismCheck("clip_fraction", ">=", 0.01, "Clip_B clipped tokens").evaluate([0.0, 0.02, 0.0])]
    assert failed[0]["passed"] is False
    out = judge(CMP, values, "quick", checks=failed)
    assert out["verdict"] == "inconclusive" and out["rule"].startswith("mechanism did not act: clip_fraction")
    assert out["failed_checks"] == ["clip_fraction"]


def test_mechanism_check_reductions_and_missing_values():
    check = MechanismCheck("moved", ">", 0.1, "mixing moved")
    assert check.evaluate([0.2, 0.3])["passed"] and not check.evaluate([0.2, 0.05])["passed"]
    assert not check.evaluate([0.2, float("nan")])["passed"] and not check.evaluate([])["passed"]
    assert MechanismCheck("moved", ">", 0.1, "", reduce="mean").evaluate([0.25, 0.0])["passed"]
    with pytest.raises(ValueError, match="reduce"):
        MechanismCheck("x", ">", 0, "", reduce="median")


def test_runner_records_checks_and_turns_a_failed_one_into_inconclusive(tmp_path):
    def run(config, seed, prepared):
        return {"arms": {"method": {"x": 1.0}, "baseline": {"x": 0.0}}, "statistics": {"gain": 1.0 + 0.1 * seed},
                "checks": {"acted": 0.0 if seed == 1 else 1.0}}

    res = run_spec(_spec(run, checks=(MechanismCheck("acted", ">", 0.5, "the mechanism acted"),)), "quick", tmp_path)
    assert res["verdict"] == "inconclusive" and "mechanism did not act" in res["verdict_rule"]
    assert res["mechanism_checks"][0]["values"] == [1.0, 0.0, 1.0]
    assert "✗ acted" in write_report(tmp_path)[1].read_text()


def test_null_value_that_the_comparator_accepts_is_refused():
    with pytest.raises(ValueError, match="null value"):
        _spec(_toy_run([]), null_value=0.6)
    assert _spec(_toy_run([]), null_value=0.0).null_value == 0.0


def test_judged_tiers_need_three_seeds():
    with pytest.raises(ValueError, match="at least"):
        _spec(_toy_run([]), seeds={"smoke": 1, "quick": 2})


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


def test_report_has_a_summary_picture_and_a_row_and_a_plot_per_claim(tmp_path):
    run_spec(_spec(_toy_run([])), "quick", tmp_path)
    run_spec(_spec(_toy_run([]), id="toy2", claim="second claim"), "smoke", tmp_path)
    page, md = write_report(tmp_path)
    text = md.read_text()
    assert text.count("| toyroom |") == 2 and "**reproduced**" in text and "**inconclusive**" in text
    assert "`toy2`" in text and ">= 0.5" in text and "90% one-sided bounds" in text
    assert "gain = 1 (n=1)" in text  # a single seed prints no "± 0"
    html = page.read_text()
    assert html.count("data:image/png;base64,") == 3 and "second claim" in html  # summary + two claims
    assert (tmp_path / "summary.png").exists()
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path / "empty")


def test_report_draws_claims_whose_statistic_is_undefined_on_some_seeds(tmp_path):
    # A seed whose statistic is nan is stored as the string "nan"; an all-nan claim has no finite mean.
    def run(config, seed, prepared):
        gain = float("nan") if seed == 1 else 1.0 + 0.1 * seed
        return {"arms": {"method": {"loss": gain}, "baseline": {"loss": 1.0}}, "statistics": {"gain": gain}}

    def all_nan(config, seed, prepared):
        return {"arms": {"method": {"loss": 1.0}, "baseline": {"loss": 1.0}}, "statistics": {"gain": float("nan")}}

    run_spec(_spec(run), "quick", tmp_path)
    run_spec(_spec(all_nan, id="undefined"), "quick", tmp_path)
    page, md = write_report(tmp_path)
    text = md.read_text()
    assert "`toy`" in text and "`undefined`" in text and "gain = n/a" in text
    assert (tmp_path / "summary.png").exists() and "summary of every claim" in page.read_text()


def test_corrupt_result_file_is_named_and_replaced_with_force(tmp_path):
    spec = _spec(_toy_run([]))
    path = tmp_path / "toyroom" / "toy.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"spec": "toy", "status": "runn')
    with pytest.raises(ResultFileError, match="toy.json"):
        run_spec(spec, "quick", tmp_path)
    run_spec(_spec(_toy_run([]), id="other"), "quick", tmp_path)
    (tmp_path / "benchmarks").mkdir()  # `make bench` JSON beside the rooms is not a result, so not listed
    (tmp_path / "benchmarks" / "bench.json").write_text('{"rows": []}')
    page, md = write_report(tmp_path)
    assert "Unreadable result file" in md.read_text() and "toy.json" in page.read_text()
    assert "bench.json" not in md.read_text()
    assert run_spec(spec, "quick", tmp_path, force=True)["status"] == "complete"
    assert json.loads(path.read_text())["verdict"] == "reproduced"


def test_resumed_run_logs_no_seed_twice(tmp_path):
    from icml26.core.logging import log_metrics, read_jsonl

    state = {"interrupt": True}

    def run(config, seed, prepared):
        log_metrics(0, loss=float(seed))
        if seed == 1 and state.pop("interrupt", False):
            raise KeyboardInterrupt
        return {"arms": {"method": {"x": 1.0}, "baseline": {"x": 0.0}}, "statistics": {"gain": 1.0}}

    spec = _spec(run)
    with pytest.raises(KeyboardInterrupt):
        run_spec(spec, "quick", tmp_path)
    run_spec(spec, "quick", tmp_path)
    records = read_jsonl(tmp_path / "toyroom" / "toy.metrics.jsonl")
    assert sorted(r["seed"] for r in records) == [0, 1, 2]


def test_cli_errors_are_one_line(tmp_path):
    from icml26.cli import main

    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["reproduce", "salaad", "--tier", "smoke", "--out", str(afile)]) == 2
    assert main(["reproduce", "salaad", "--tier", "smoke", "--out", str(tmp_path / "r"), "--spec", "nope"]) == 2


def test_plot_legend_names_an_arm_hidden_under_another():
    import numpy as np

    from icml26.harness.plots import hidden_arms

    x = np.arange(4.0)
    curves = {"grpo": (x, np.array([3.0, 2.0, 1.5, 1.2])), "clip_b": (x, np.array([3.0, 2.0, 1.5, 1.2])),
              "other": (x, np.array([3.0, 2.5, 2.0, 1.9]))}
    assert hidden_arms(curves) == {"grpo": "clip_b"}


def test_precision_runs_the_spec_under_autocast_and_is_part_of_the_identity(tmp_path):
    import torch

    seen = []

    def run(config, seed, prepared):
        seen.append((torch.ones(2, 2) @ torch.ones(2, 2)).dtype)  # a matmul inside the spec
        return {"arms": {"method": {"loss": 0.0}, "baseline": {"loss": 1.0}}, "statistics": {"gain": 1.0}}

    fp32 = run_spec(_spec(run), "smoke", tmp_path)
    bf16 = run_spec(_spec(run), "smoke", tmp_path, precision="bf16")
    assert seen == [torch.float32, torch.bfloat16]  # a different precision is a different result, not a skip
    assert fp32["run_info"]["precision"] == "fp32" and bf16["run_info"]["precision"] == "bf16"
    assert fp32["config_hash"] != bf16["config_hash"]
    with pytest.raises(ValueError, match="precision"):
        run_spec(_spec(run), "smoke", tmp_path, precision="int8")


def test_device_becomes_the_default_device_and_is_recorded(tmp_path):
    import torch

    seen = []

    def run(config, seed, prepared):
        seen.append(torch.zeros(2).device.type)  # a tensor made without naming a device
        return {"arms": {"method": {"x": 1.0}, "baseline": {"x": 0.0}}, "statistics": {"gain": 1.0}}

    res = run_spec(_spec(run), "smoke", tmp_path, device="meta")
    assert seen == ["meta"] and res["run_info"]["device"] == "meta"
    assert torch.zeros(1).device.type == "cpu"  # restored afterwards
    from icml26.cli import main

    assert main(["reproduce", "salaad", "--tier", "smoke", "--out", str(tmp_path), "--device", "nonsense"]) == 2


SMALL_SPECS = ("budget_curve", "high_budget", "teacher_student")


def test_jobs_run_rooms_in_worker_processes_with_the_same_results_as_in_process(tmp_path):
    """``jobs=2`` runs each room in its own process (one torch thread each on 2 cores) and returns the results
    in spec order; the smoke claims of salaad and scalora are small enough to run twice here."""
    import os

    from icml26.harness.runner import reproduce

    serial = reproduce(["salaad", "scalora"], "smoke", tmp_path / "serial", spec_ids=SMALL_SPECS)
    parallel = reproduce(["salaad", "scalora"], "smoke", tmp_path / "parallel", spec_ids=SMALL_SPECS, jobs=2)
    assert [r["spec"] for r in parallel] == [r["spec"] for r in serial] == list(SMALL_SPECS)
    for a, b in zip(serial, parallel):
        assert b["status"] == "complete" and b["verdict"] == a["verdict"]
        assert b["statistics"].keys() == a["statistics"].keys()
        for name in a["statistics"]:
            assert b["statistics"][name]["per_seed"] == pytest.approx(a["statistics"][name]["per_seed"], rel=1e-4,
                                                                      abs=1e-6, nan_ok=True)
        assert b["run_info"]["threads"] == max(1, (os.cpu_count() or 1) // 2)
        assert (tmp_path / "parallel" / b["room"] / f"{b['spec']}.json").exists()
    with pytest.raises(ValueError, match="jobs"):
        reproduce(["salaad"], "smoke", tmp_path / "x", jobs=0)


def test_seed_jobs_run_seeds_in_worker_processes_with_the_same_results_and_metrics(tmp_path):
    """``seed_jobs=2`` runs the seeds of one spec in two worker processes after the prepare phase: the same
    per-seed results as one after another here, every seed's metric records in SPEC.metrics.jsonl (none
    interleaved, no worker file left behind), and a bad count is refused."""
    import itertools

    from icml26.core.logging import read_jsonl
    from icml26.harness.runner import reproduce

    spec_ids = ["teacher_student"]
    serial = reproduce(["scalora"], "smoke", tmp_path / "serial", spec_ids=spec_ids, n_seeds=2)[0]
    parallel = reproduce(["scalora"], "smoke", tmp_path / "parallel", spec_ids=spec_ids, n_seeds=2,
                         seed_jobs=2)[0]
    assert parallel["status"] == "complete" and [r["seed"] for r in parallel["seed_results"]] == [0, 1]
    for name in serial["statistics"]:
        assert parallel["statistics"][name]["per_seed"] == pytest.approx(
            serial["statistics"][name]["per_seed"], rel=1e-4, abs=1e-6, nan_ok=True)
    folder = tmp_path / "parallel" / "scalora"
    records = read_jsonl(folder / "teacher_student.metrics.jsonl")
    seeded = [r for r in records if r.get("phase") != "prepare"]  # (the tuning was memoised by the serial run)
    blocks = [seed for seed, _ in itertools.groupby(r["seed"] for r in seeded)]
    assert sorted(blocks) == [0, 1]  # one contiguous block of records per seed
    trained = {arm for arm in parallel["arms"] if arm in {r.get("arm") for r in seeded}}
    assert trained and {(r["seed"], r["arm"]) for r in seeded} == {(s, a) for s in (0, 1) for a in trained}
    assert not list(folder.glob("*.part"))
    with pytest.raises(ValueError, match="seed_jobs"):
        reproduce(["scalora"], "smoke", tmp_path / "x", spec_ids=spec_ids, seed_jobs=0)


def test_ahead_gets_only_the_seeds_still_to_run_and_only_with_seed_workers(tmp_path):
    """A spec's ``ahead`` hook runs before its seeds with the room's workers open (where ``run_ahead`` finds them),
    for the seeds a resumed run still lacks; with ``seed_jobs=1`` it is never called (each seed trains its own)."""
    from icml26.harness.runner import _ROOM_SEED_WORKERS

    calls, seen = [], []

    def ahead(config, seeds, prepared):
        seen.append((list(seeds), _ROOM_SEED_WORKERS.get() is not None))

    run_spec(_spec(_toy_run(calls), ahead=ahead), "quick", tmp_path, n_seeds=2)
    assert seen == [] and calls == [0, 1]
    # the same spec with a third seed resumes: only seed 2 is left (and one seed runs here, so the toy room, which
    # registers no specs for a worker to find, is enough)
    result = run_spec(_spec(_toy_run(calls), ahead=ahead), "quick", tmp_path, n_seeds=3, seed_jobs=2)
    assert seen == [([2], True)] and calls == [0, 1, 2] and result["status"] == "complete"


def test_a_rooms_specs_share_their_seed_workers(tmp_path):
    """lockin's three claims read the same trainings (memoised per seed in the process that ran them). With
    ``seed_jobs=2`` each seed goes to the same worker for every spec, so the second and third specs train
    nothing (no training records in their metrics) and give the serial run's numbers."""
    from icml26.core.logging import read_jsonl
    from icml26.harness.runner import reproduce

    serial = reproduce(["lockin"], "smoke", tmp_path / "serial", n_seeds=2)
    parallel = reproduce(["lockin"], "smoke", tmp_path / "parallel", n_seeds=2, seed_jobs=2)
    assert [r["spec"] for r in parallel] == [r["spec"] for r in serial] == ["collapse", "drift_paradox", "escape"]
    for a, b in zip(serial, parallel):
        assert b["status"] == "complete"
        for name in a["statistics"]:
            assert b["statistics"][name]["per_seed"] == pytest.approx(a["statistics"][name]["per_seed"],
                                                                      rel=1e-6, nan_ok=True)
    trained = {spec: {r["seed"] for r in read_jsonl(tmp_path / "parallel" / "lockin" / f"{spec}.metrics.jsonl")
                      if "seed" in r} for spec in ("collapse", "drift_paradox", "escape")}
    assert trained == {"collapse": {0, 1}, "drift_paradox": set(), "escape": set()}


def test_cli_rejects_a_bad_jobs_count(capsys):
    from icml26.cli import main

    with pytest.raises(SystemExit):
        main(["reproduce", "salaad", "--jobs", "0"])
    assert "positive integer" in capsys.readouterr().err


def test_a_spec_that_pins_torch_threads_does_not_change_them_for_the_next(tmp_path):
    import torch

    def run(config, seed, prepared):
        torch.set_num_threads(1)
        return {"arms": {"method": {"x": 1.0}, "baseline": {"x": 0.0}}, "statistics": {"gain": 1.0}}

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_spec(_spec(run), "smoke", tmp_path)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_prepare_killed_mid_grid_resumes_its_tuning_and_cleans_up(tmp_path):
    """The resumed tuning scores only the missing points, and the metrics log has every point's lines once: those
    of the points the checkpoint replays are kept, those of the point the kill interrupted are logged afresh."""
    from icml26.core.logging import log_metrics, read_jsonl
    from icml26.harness.tuning import LogGrid, tune_per_arm

    scored = []
    state = {"die_at": 4}

    def prepare(config):
        def score(arm, lr, seed):
            log_metrics(1, arm=arm, lr=lr)
            if len(scored) == state["die_at"]:
                raise KeyboardInterrupt
            scored.append((arm, lr))
            return -abs(lr - 0.1)
        return {"tuning": tune_per_arm({"method": LogGrid(center=0.1), "baseline": LogGrid(center=0.1)}, score,
                                       mode="max")}

    def run(config, seed, prepared):
        return {"arms": {"method": {"x": 1.0}, "baseline": {"x": 0.0}}, "statistics": {"gain": 1.0 + 0.1 * seed}}

    spec = _spec(run, prepare=prepare)
    ckpt = tmp_path / "toyroom" / "toy.tuning.ckpt"
    with pytest.raises(KeyboardInterrupt):
        run_spec(spec, "quick", tmp_path)
    assert ckpt.exists() and len(scored) == 4
    state["die_at"] = None
    res = run_spec(spec, "quick", tmp_path)
    assert len(scored) == 6 and len(set(scored)) == 6  # the 2 missing points only, none scored twice
    assert res["status"] == "complete" and res["prepared"]["tuning"]["chosen"] == {"method": 0.1, "baseline": 0.1}
    assert not ckpt.exists()
    metrics = tmp_path / "toyroom" / "toy.metrics.jsonl"
    assert sorted((r["arm"], r["lr"]) for r in read_jsonl(metrics)) == sorted(scored)
    run_spec(spec, "quick", tmp_path, force=True)
    assert len(scored) == 12  # a forced rerun tunes afresh
    assert sorted((r["arm"], r["lr"]) for r in read_jsonl(metrics)) == sorted(scored[6:])
