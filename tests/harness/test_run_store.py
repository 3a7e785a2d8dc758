"""run_store / stored_run: finished trainings kept on disk across processes and specs, read back exactly."""

from __future__ import annotations

import json
import math

import pytest

from icml26.core.logging import log_metrics, read_jsonl
from icml26.harness.run_store import current_run_store, run_store, stored_run
from icml26.harness.runner import run_spec
from icml26.harness.spec import Comparator, ExperimentSpec

CALLS: list[tuple] = []


@stored_run
def _training(config: dict, seed: int, lr: float) -> dict:
    """A stand-in training: counts its calls; returns a tuple, an int, inf and nan to test the JSON round trip."""
    CALLS.append((seed, lr))
    return {"curve": (1.5, 0.1 + seed), "n": 3, "diverged": float("inf"), "spread": float("nan"),
            "loss": config["scale"] * lr / 3}


@pytest.fixture(autouse=True)
def _fresh_calls():
    CALLS.clear()


def _same(a, b) -> bool:
    return all(math.isnan(x) and math.isnan(y) or x == y for x, y in zip(_leaves(a), _leaves(b)))


def _leaves(obj):
    if isinstance(obj, dict):
        for key in sorted(obj):
            yield from _leaves(obj[key])
    elif isinstance(obj, list):
        for item in obj:
            yield from _leaves(item)
    else:
        yield obj


def test_outside_a_store_every_call_runs_and_the_result_is_json_normalised(tmp_path):
    a = _training({"scale": 1.0}, 0, 0.3)
    b = _training({"scale": 1.0}, 0, 0.3)
    assert len(CALLS) == 2 and a["curve"] == [1.5, 0.1] and _same(a, b)  # a list, as when read from a store
    assert current_run_store() is None and not list(tmp_path.iterdir())


def test_a_stored_run_is_read_back_exactly_instead_of_rerun(tmp_path):
    with run_store(tmp_path / "runs"):
        fresh = _training({"scale": 2.0}, 1, 1e-3)
        again = _training({"scale": 2.0}, 1, 1e-3)
        other = _training({"scale": 2.0}, 2, 1e-3)  # another seed is another run
    assert CALLS == [(1, 1e-3), (2, 1e-3)]
    assert _same(fresh, again) and again["loss"] == 2.0 * 1e-3 / 3 and math.isinf(again["diverged"])
    assert list(again) == list(fresh) == ["curve", "n", "diverged", "spread", "loss"]  # the result's own order
    assert other["curve"] == [1.5, 2.1]
    files = sorted((tmp_path / "runs").glob("training-*.json"))
    assert len(files) == 2
    record = json.loads(files[0].read_text())
    assert record["call"]["function"].endswith("_training") and {"git_sha", "cpu_model"} <= set(record["written_by"])


def test_read_false_recomputes_and_overwrites(tmp_path):
    with run_store(tmp_path / "runs"):
        _training({"scale": 1.0}, 0, 0.5)
    with run_store(tmp_path / "runs", read=False):
        _training({"scale": 1.0}, 0, 0.5)
    assert len(CALLS) == 2 and len(list((tmp_path / "runs").iterdir())) == 1


def test_a_damaged_or_foreign_file_costs_only_its_run(tmp_path):
    with run_store(tmp_path / "runs"):
        _training({"scale": 1.0}, 0, 0.5)
    (path,) = (tmp_path / "runs").iterdir()
    path.write_text('{"call": {"function": "tru')  # truncated
    with run_store(tmp_path / "runs"):
        res = _training({"scale": 1.0}, 0, 0.5)
    assert len(CALLS) == 2 and res["loss"] == pytest.approx(0.5 / 3)
    record = json.loads(path.read_text())
    record["call"]["args"][1] = 7  # a file whose call differs from its name is not trusted
    path.write_text(json.dumps(record))
    with run_store(tmp_path / "runs"):
        _training({"scale": 1.0}, 0, 0.5)
    assert len(CALLS) == 3


def test_editing_the_functions_package_retrains(tmp_path, monkeypatch):
    from icml26.harness import run_store as module

    with run_store(tmp_path / "runs"):
        _training({"scale": 1.0}, 0, 0.5)
        monkeypatch.setattr(module, "source_fingerprint", lambda package_dir: "edited")
        _training({"scale": 1.0}, 0, 0.5)
    assert len(CALLS) == 2 and len(list((tmp_path / "runs").iterdir())) == 2


def test_the_fingerprint_follows_the_source_files(tmp_path):
    from icml26.harness.run_store import source_fingerprint

    (tmp_path / "train.py").write_text("x = 1\n")
    before = source_fingerprint(str(tmp_path))
    source_fingerprint.cache_clear()
    (tmp_path / "train.py").write_text("x = 2\n")
    assert source_fingerprint(str(tmp_path)) != before


def test_arguments_that_are_not_json_are_refused_by_name(tmp_path):
    with run_store(tmp_path / "runs"), pytest.raises(TypeError, match="_training: arguments must be JSON"):
        _training({"scale": object()}, 0, 0.5)
    assert not CALLS


class _Trained:
    """A stand-in for a trained model: a tensor and a count, which is what its ``save`` keeps."""

    def __init__(self, weight, steps: int) -> None:
        self.weight, self.steps = weight, steps


@stored_run(save=lambda t: {"weight": t.weight, "steps": t.steps},
            load=lambda saved, config, seed: _Trained(saved["weight"].clone(), saved["steps"]))
def _model_training(config: dict, seed: int) -> _Trained:
    import torch

    CALLS.append(("model", seed))
    return _Trained(torch.randn(3, 5, generator=torch.Generator().manual_seed(seed)) * config["scale"], 7)


def test_a_training_that_returns_a_model_is_stored_as_tensors_and_rebuilt(tmp_path):
    import torch

    outside = _model_training({"scale": 2.0}, 1)  # outside a store: rebuilt through save/load all the same
    with run_store(tmp_path / "runs"):
        fresh = _model_training({"scale": 2.0}, 1)
        again = _model_training({"scale": 2.0}, 1)
    assert CALLS == [("model", 1), ("model", 1)]
    assert torch.equal(fresh.weight, again.weight) and torch.equal(outside.weight, again.weight)
    assert again.steps == 7 and fresh is not again
    (path,) = (tmp_path / "runs").glob("model_training-*.pt")
    record = torch.load(path, weights_only=True)  # tensors and plain values only: no pickled code
    assert record["call"]["args"] == [{"scale": 2.0}, 1] and "cpu_model" in record["written_by"]
    path.write_bytes(path.read_bytes()[:40])  # a truncated checkpoint costs only its run
    with run_store(tmp_path / "runs"):
        _model_training({"scale": 2.0}, 1)
    assert len(CALLS) == 3


def test_save_without_load_is_refused():
    with pytest.raises(TypeError, match="both save and load"):
        stored_run(save=lambda result: result)


def _spec(spec_id: str) -> ExperimentSpec:
    """Two specs of one room that share their trainings, as fix_attention's and kromhc's do."""
    def run(config, seed, prepared):
        method, base = _training(config, seed, 0.3), _training(config, seed, 0.1)
        gain = method["loss"] - base["loss"] + 0.01 * seed
        return {"arms": {"method": {"loss": method["loss"]}, "baseline": {"loss": base["loss"]}},
                "statistics": {"gain": gain}}
    return ExperimentSpec(id=spec_id, room="toyroom", claim="c", paper_ref="none", metric="m",
                          arms=("method", "baseline"), baseline="baseline",
                          comparator=Comparator("gain", ">", 0.0, "gain > 0"), run=run,
                          tiers={"smoke": {"scale": 1.0}, "quick": {"scale": 1.0}}, seeds={"smoke": 1, "quick": 3})


def test_the_runner_shares_trainings_across_specs_and_processes_and_force_recomputes(tmp_path):
    first = run_spec(_spec("first"), "quick", tmp_path)
    assert len(CALLS) == 6 and len(list((tmp_path / "toyroom" / "runs").glob("*.json"))) == 6
    # the second spec, as in a new process (no in-process memo here at all): every training is read back
    second = run_spec(_spec("second"), "quick", tmp_path)
    assert len(CALLS) == 6 and second["statistics"] == first["statistics"]
    run_spec(_spec("second"), "quick", tmp_path, force=True)
    assert len(CALLS) == 12
    # a run placed on another device keeps its own trainings
    run_spec(_spec("first"), "quick", tmp_path / "placed", device="cpu", precision="bf16")
    assert len(CALLS) == 18 and len(list((tmp_path / "placed" / "toyroom" / "runs-cpu-bf16").glob("*.json"))) == 6


def test_seed_workers_train_the_tuning_grid_and_the_seeds_into_the_parent_store(tmp_path, monkeypatch):
    """With ``seed_jobs=2`` kromhc's tuning grid is trained ahead in the room's 2 worker processes (``run_ahead``)
    and the reported seeds in the same workers; every training lands in OUT/ROOM/runs, this process trains none
    of them, and the statistics equal a run in one process (kromhc smoke: 3 arms x 3 lrs x 2 tuning seeds, then
    3 arms x 2 seeds)."""
    from icml26.harness.runner import reproduce
    from icml26.methods.kromhc import experiments

    built = []

    def build_model_here(*args, **kwargs):
        built.append(args)
        raise AssertionError("a training ran in the parent process")

    monkeypatch.setattr(experiments, "build_model", build_model_here)
    (parallel,) = reproduce(["kromhc"], "smoke", tmp_path / "two", spec_ids=["tiny_lm_vs_mhc_lite"], n_seeds=2,
                            seed_jobs=2)
    assert built == []  # the workers import the room afresh: the patched builder is this process's only
    calls = [json.loads(p.read_text())["call"]["args"] for p in (tmp_path / "two" / "kromhc" / "runs").glob("*.json")]
    arms = ("kromhc", "mhc_lite", "residual")
    assert sorted((args[2], args[0]) for args in calls if args[2] in (0, 1)) == [(s, a) for s in (0, 1) for a in arms]
    assert len([args for args in calls if args[2] not in (0, 1)]) >= 3 * 3 * 2  # the tuning grid, and extensions
    monkeypatch.undo()
    (serial,) = reproduce(["kromhc"], "smoke", tmp_path / "one", spec_ids=["tiny_lm_vs_mhc_lite"], n_seeds=2)
    assert [r["statistics"] for r in parallel["seed_results"]] == [r["statistics"] for r in serial["seed_results"]]
    assert parallel["prepared"] == serial["prepared"]


_PROBE = '''
import torch

from icml26.harness.run_store import stored_run


@stored_run
def where(tag: str) -> dict:
    """Where a call computes: the device of a new tensor and the dtype of a matmul."""
    x = torch.ones(3, 5)
    return {"device": str(x.device), "matmul_dtype": str((x @ x.T).dtype)}
'''


def test_run_ahead_workers_compute_under_the_runs_device_and_precision(tmp_path, monkeypatch):
    """A run placed with ``--device`` / ``--precision`` trains its tuning grid (and salaad's seeds) in the room's
    workers through ``run_ahead``: they must compute there too, not on the CPU in fp32 into the placed store. The
    probe, a stored run in a module the spawned workers import, reports a new tensor's device (torch's default
    device "meta" here) and a matmul's dtype (bf16 under CPU autocast)."""
    import importlib

    import torch

    from icml26.harness.run_store import run_ahead
    from icml26.harness.runner import _placed, room_seed_workers

    (tmp_path / "placement_probe.py").write_text(_PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))  # a spawned worker gets this process's sys.path
    probe = importlib.import_module("placement_probe")
    with room_seed_workers(2), run_store(tmp_path / "runs"):
        with _placed("meta", None):
            assert run_ahead(probe.where, [(("meta",), {})]) == 1
        with _placed(None, "bf16"):
            assert run_ahead(probe.where, [(("bf16",), {})]) == 1
        assert run_ahead(probe.where, [(("plain",), {})]) == 1
        ran = {tag: probe.where(tag) for tag in ("meta", "bf16", "plain")}  # read back from the store
    assert ran["meta"] == {"device": "meta", "matmul_dtype": "torch.float32"}
    assert ran["bf16"] == {"device": "cpu", "matmul_dtype": "torch.bfloat16"}
    assert ran["plain"] == {"device": "cpu", "matmul_dtype": "torch.float32"}
    assert torch.get_default_device().type == "cpu" and not torch.is_autocast_enabled("cpu")


@stored_run
def _logged_training(config: dict, seed: int, lr: float) -> dict:
    """A stand-in training that logs two steps, as a room's training loop does."""
    CALLS.append((seed, lr))
    for step in (1, 2):
        log_metrics(step, loss=lr / step, lr=lr)
    return {"loss": config["scale"] * lr}


def _logging_spec(kill_seed: dict) -> ExperimentSpec:
    """Two stored trainings per seed; ``kill_seed`` ({"seed": s}, used once) interrupts seed s between them."""
    def run(config, seed, prepared):
        method = _logged_training(config, seed, 0.3)
        if kill_seed.get("seed") == seed:
            kill_seed.clear()
            raise KeyboardInterrupt
        base = _logged_training(config, seed, 0.1)
        return {"arms": {"method": {"loss": method["loss"]}, "baseline": {"loss": base["loss"]}},
                "statistics": {"gain": method["loss"] - base["loss"]}}
    return ExperimentSpec(id="logged", room="toyroom", claim="c", paper_ref="none", metric="m",
                          arms=("method", "baseline"), baseline="baseline",
                          comparator=Comparator("gain", ">", 0.0, "gain > 0"), run=run,
                          tiers={"smoke": {"scale": 1.0}, "quick": {"scale": 1.0}}, seeds={"smoke": 1, "quick": 3})


def _lines(path) -> list[tuple]:
    return sorted((r["seed"], r["lr"], r["step"]) for r in read_jsonl(path))


def test_a_resumed_run_has_every_stored_trainings_log_lines_once(tmp_path):
    """Seed 1 is killed after its first training. The resumed run reads that training back, which logs nothing, so
    its lines must survive the resume's clean-up of the unfinished seed: every training's lines are in
    SPEC.metrics.jsonl exactly once (before, they were dropped and lost). A forced rerun recomputes and logs each
    training once more in place of the old lines."""
    spec = _logging_spec({"seed": 1})
    with pytest.raises(KeyboardInterrupt):
        run_spec(spec, "quick", tmp_path)
    run_spec(spec, "quick", tmp_path)
    assert len(CALLS) == 6  # no training ran twice
    metrics = tmp_path / "toyroom" / "logged.metrics.jsonl"
    every_line_once = sorted((s, lr, step) for s in range(3) for lr in (0.3, 0.1) for step in (1, 2))
    assert _lines(metrics) == every_line_once
    stored = {p.name for p in (tmp_path / "toyroom" / "runs").iterdir()}
    assert {r["run"] for r in read_jsonl(metrics)} == stored and len(stored) == 6  # each line names its training
    run_spec(spec, "quick", tmp_path, force=True)
    assert len(CALLS) == 12 and _lines(metrics) == every_line_once


def test_worker_logs_left_by_a_killed_run_keep_only_stored_trainings_lines(tmp_path):
    """A run killed outright leaves its workers' part files (SPEC.metrics.jsonl.seedN.part / .aheadN.part). The next
    run appends their lines of trainings whose results are stored (they will not run again) and drops the rest (an
    unfinished training is rerun and logs again), so a part reused by a new worker never brings old lines along."""
    spec = _logging_spec({})
    run_spec(spec, "quick", tmp_path, n_seeds=1)
    folder = tmp_path / "toyroom"
    stored_name = next((folder / "runs").iterdir()).name
    left = [{"step": 7, "seed": 5, "lr": 0.5, "run": stored_name},       # a stored training: kept
            {"step": 8, "seed": 5, "lr": 0.5, "run": "logged_training-unfinished.json"},  # not stored: dropped
            {"step": 9, "seed": 5, "lr": 0.5}]                             # logged outside a stored call: dropped
    for name in ("logged.metrics.jsonl.seed1.part", "logged.metrics.jsonl.ahead2.part"):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in left))
    run_spec(spec, "quick", tmp_path, n_seeds=2)  # resumes: seed 0 is done, seed 1 runs
    assert [line for line in _lines(folder / "logged.metrics.jsonl") if line[0] == 5] == [(5, 0.5, 7), (5, 0.5, 7)]
    assert not list(folder.glob("*.part"))
