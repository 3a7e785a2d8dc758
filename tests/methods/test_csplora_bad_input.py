"""CSPLoRA bad input: a NaN/inf in the probe's statistics raises a ValueError naming the module(s) (it used to give
a uniform or quietly wrong plan); zero budgets, negative ranks, empty module lists, per-batch (not per-sample)
losses and empty probe batches get clear errors, raised before the model or the plan changes; so do wrong types,
probe-helper shapes and label ranges, and malformed plan files. The card's Usage snippet runs verbatim."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from icml26.methods.csplora import (CSPLoRAConfig, CSPLoRAPlanner, ProbeOutput, ProbeScores, RankPlan,
                                    allocate_ranks, check_ranks, classification_probe, exact_target_regex,
                                    per_sample_scores, sequence_probe)

pytestmark = pytest.mark.usefixtures("one_thread")


class TwoBranch(nn.Module):
    """``side`` reads the input on its own branch, so a non-finite gradient there leaves the others finite."""

    def __init__(self):
        super().__init__()
        self.inp, self.side, self.out = nn.Linear(5, 6), nn.Linear(5, 3), nn.Linear(6, 4)
        self.poison = False

    def forward(self, x):
        logits = self.out(torch.tanh(self.inp(x)))
        if self.poison:  # + 0 * sqrt(0 * relu(side(x))): the value is unchanged, its gradient is 0 * inf = NaN
            logits = logits + 0.0 * torch.sqrt(0.0 * torch.relu(self.side(x))).sum(-1, keepdim=True)
        else:
            logits = logits + 0.0 * self.side(x).sum(-1, keepdim=True)
        return logits


def _case(seed: int = 0):
    torch.manual_seed(seed)
    model = TwoBranch().double()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(7, 5, generator=gen, dtype=torch.float64), torch.randint(0, 4, (7,), generator=gen)
    return model, [(x[:4], y[:4]), (x[4:], y[4:])]


def probe(m, b):
    return classification_probe(m(b[0]), b[1])


def _snapshot(model: nn.Module):
    return {n: (p.detach().clone(), p.requires_grad, p.grad) for n, p in model.named_parameters()}


def _assert_unchanged(model: nn.Module, snap) -> None:
    for n, p in model.named_parameters():
        value, flag, grad = snap[n]
        assert torch.equal(p, value) and p.requires_grad == flag and p.grad is grad, n


# ---------------------------------------------------------------------------------------- non-finite importance
def test_nan_gradient_in_one_module_raises_naming_it():
    model, batches = _case()
    planner = CSPLoRAPlanner(CSPLoRAConfig())
    names = ["inp", "side", "out"]
    healthy = planner.plan(model, batches, probe, names)
    assert all(math.isfinite(p) for p in healthy.proportions.values())
    model.poison = True
    snap = _snapshot(model)
    with pytest.raises(ValueError, match=r"non-finite importance .* 1 module\(s\): \['side'\]"):
        planner.plan(model, batches, probe, names)
    _assert_unchanged(model, snap)
    assert model.training  # the planner's eval mode was undone


def test_nan_weights_everywhere_raise_instead_of_the_uniform_plan():
    model, batches = _case()
    with torch.no_grad():
        model.inp.weight[0, 0] = math.nan
    with pytest.raises(ValueError, match=r"3 module\(s\): \['inp', 'side', 'out'\]"):
        CSPLoRAPlanner().plan(model, batches, probe, ["inp", "side", "out"])
    with torch.no_grad():
        model.inp.weight[0, 0] = 0.0
        model.out.weight[0, 0] = math.inf  # infinite logits: NaN log-probabilities
    with pytest.raises(ValueError, match="non-finite importance"):
        CSPLoRAPlanner().plan(model, batches, probe, ["inp", "side", "out"])


def test_probe_scores_refuse_non_finite_values_they_are_given_or_edited_to():
    good = dict(names=["a", "b"], shapes={"a": (4, 4), "b": (4, 4)}, per_sample=torch.ones(3, 2, dtype=torch.float64),
                confidence=torch.full((3,), 0.5, dtype=torch.float64), entropy=None, seconds=0.0, importance="fisher")
    scores = ProbeScores(**good)
    scores.per_sample = scores.per_sample.clone()
    scores.per_sample[1, 1] = math.inf  # edited after construction: plan() checks the module scores again
    with pytest.raises(ValueError, match=r"\['b'\]"):
        scores.plan(CSPLoRAConfig())
    with pytest.raises(ValueError, match=r"\['a'\]"):
        ProbeScores(**{**good, "per_sample": torch.tensor([[math.nan, 1.0]] * 3, dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"non-finite confidence for probe sample\(s\) \[2\]"):
        ProbeScores(**{**good, "confidence": torch.tensor([0.5, 0.5, math.nan], dtype=torch.float64)})
    with pytest.raises(ValueError, match="non-finite entropy"):
        ProbeScores(**{**good, "entropy": torch.tensor([0.5, math.inf, 0.1], dtype=torch.float64)})
    with pytest.raises(ValueError, match="0 samples"):
        ProbeScores(**{**good, "per_sample": torch.ones(0, 2), "confidence": torch.ones(0)})
    with pytest.raises(ValueError, match="empty module list"):
        ProbeScores(**{**good, "names": [], "per_sample": torch.ones(3, 0)})


# ---------------------------------------------------------------------------------------------- budgets, ranks
def test_zero_or_negative_budget_raises():
    plan = RankPlan.uniform({"a": (8, 8), "b": (8, 16)})
    for kwargs in (dict(mean_rank=0), dict(mean_rank=-2), dict(total_params=0), dict(mean_rank=math.nan)):
        with pytest.raises(ValueError, match="mean_rank|total_params"):
            plan.ranks_for_budget(**kwargs)
        with pytest.raises(ValueError, match="mean_rank|total_params"):
            plan.to_adapter_config(**kwargs)
    with pytest.raises(ValueError, match="budget must be a positive int"):
        allocate_ranks([0.5, 0.5], [16, 24], 0, [0, 0], [8, 8])


def test_negative_ranks_raise():
    plan = RankPlan.uniform({"a": (8, 8), "b": (8, 16)})
    with pytest.raises(ValueError, match="r_min must be an int >= 0"):
        plan.ranks_for_budget(mean_rank=2, r_min=-1)
    with pytest.raises(ValueError, match="r_max must be None or an int"):
        plan.ranks_for_budget(mean_rank=2, r_max=0)
    with pytest.raises(ValueError, match="r_min"):
        RankPlan.uniform({"a": (8, 8)}, r_min=-1)
    with pytest.raises(ValueError, match="r_min"):
        CSPLoRAConfig(r_min=-1)
    for method in (plan.num_params, plan.rank_pattern, lambda r: plan.alphas_for(r, 2.0)):
        with pytest.raises(ValueError, match="ranks must be ints >= 0"):
            method({"a": -1, "b": 2})
    with pytest.raises(ValueError, match="not in the plan"):
        plan.num_params({"a": 1, "b": 2, "c": 3})
    with pytest.raises(ValueError, match="ranks must be ints >= 0"):
        check_ranks(TwoBranch(), {"inp": -2})
    with pytest.raises(ValueError, match="lower rank bounds must be ints >= 0"):
        allocate_ranks([0.5, 0.5], [16, 24], 80, [-1, 1], [8, 8])


# ------------------------------------------------------------------------------------- modules, probe batches
def test_empty_module_list_raises_before_probing():
    model, batches = _case()
    calls = []

    def counting_probe(m, b):
        calls.append(1)
        return probe(m, b)

    for empty in ([], (), ""):
        with pytest.raises(ValueError, match="target_modules is empty"):
            CSPLoRAPlanner().plan(model, batches, counting_probe, empty)
    assert calls == []
    with pytest.raises(ValueError, match="at least one target module"):
        per_sample_scores(model, batches[0], probe, [])
    with pytest.raises(ValueError, match="at least one module name"):
        exact_target_regex([])
    with pytest.raises(ValueError, match="empty"):
        RankPlan.uniform({})


def test_batch_mean_loss_and_empty_batch_raise():
    model, batches = _case()
    snap = _snapshot(model)

    def mean_probe(m, b):
        out = probe(m, b)
        return ProbeOutput(loss=out.loss.mean(), confidence=out.confidence)

    with pytest.raises(ValueError, match=r"one loss per sample, shape \(B,\)"):
        CSPLoRAPlanner().plan(model, batches, mean_probe, ["inp", "out"])
    x, y = batches[0]
    with pytest.raises(ValueError, match="probe batch is empty"):
        CSPLoRAPlanner().plan(model, [(x[:0], y[:0])], probe, ["inp", "out"])
    with pytest.raises(ValueError, match="no batches"):
        CSPLoRAPlanner().plan(model, [], probe, ["inp", "out"])
    with pytest.raises(TypeError, match="ProbeOutput"):
        CSPLoRAPlanner().plan(model, batches, lambda m, b: m(b[0]), ["inp", "out"])
    _assert_unchanged(model, snap)


# --------------------------------------------------------------------------- types, probe helpers, plan files
def test_wrong_types_raise_before_probing():
    model, batches = _case()
    snap = _snapshot(model)
    with pytest.raises(TypeError, match="config must be a CSPLoRAConfig, got dict"):
        CSPLoRAPlanner({"kappa": 1.0})
    with pytest.raises(TypeError, match="model must be an nn.Module, got str"):
        CSPLoRAPlanner().plan("model", batches, probe, ["inp"])
    with pytest.raises(TypeError, match="probe_fn must be a function"):
        CSPLoRAPlanner().plan(model, batches, 3, ["inp"])
    with pytest.raises(ValueError, match=r"target_modules \['nope'\] matched no nn.Linear"):
        CSPLoRAPlanner().plan(model, batches, probe, ["nope"])
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        check_ranks("model", {"inp": 1})
    for field in ("gamma", "kappa", "alpha_ratio"):
        with pytest.raises(ValueError, match=field):
            CSPLoRAConfig(**{field: True})
    _assert_unchanged(model, snap)
    assert model.training


def test_probe_helpers_check_shapes_dtypes_and_label_range():
    logits = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"logits \(B, K\) and labels \(B,\), got \(4, 3\) and \(5,\)"):
        classification_probe(logits, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        classification_probe(logits, torch.tensor([0, 1, 2, 7]))  # it used to fail inside gather
    with pytest.raises(TypeError, match="integer class ids"):
        classification_probe(logits, torch.tensor([0.0, 1.0, 2.0, 1.0]))
    seq = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match=r"logits \(B, T, V\) and labels \(B, T\)"):
        sequence_probe(seq, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\)"):
        sequence_probe(seq, torch.tensor([[-100, 1, 9], [2, -100, -100]]))
    out = sequence_probe(seq, torch.tensor([[-100, 1, 4], [2, -100, -100]]))  # ignore_index is not a label
    assert out.loss.shape == (2,)


def test_budgets_for_alphas_and_plan_files_are_checked(tmp_path):
    plan = RankPlan.uniform({"a": (8, 8), "b": (8, 16)})
    ranks = plan.ranks_for_budget(mean_rank=2)
    for mean_rank in (-1, 0, math.nan, True):
        with pytest.raises(ValueError, match="mean_rank must be a positive finite number"):
            plan.alphas_for(ranks, mean_rank)
    with pytest.raises(ValueError, match="mean_rank"):
        plan.ranks_for_budget(mean_rank=True)
    data = plan.to_dict()
    with pytest.raises(ValueError, match=r"lacks \['r_min'\]"):
        RankPlan.from_dict({k: v for k, v in data.items() if k != "r_min"})
    with pytest.raises(ValueError, match="'modules' must be a list"):
        RankPlan.from_dict({**data, "modules": [{"name": "a"}]})
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        RankPlan.from_dict([data])
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(ValueError):  # json.JSONDecodeError is a ValueError
        RankPlan.load(path)


def test_readme_usage_snippet_runs(tmp_path, monkeypatch, run_card_snippet):
    """Executes the card's Usage block verbatim (it writes plan.json into the working folder)."""
    pytest.importorskip("peft")
    readme = Path(__file__).resolve().parents[2] / "src/icml26/methods/csplora/README.md"
    monkeypatch.chdir(tmp_path)
    scope = run_card_snippet(readme, "## Usage\n")
    assert RankPlan.load(tmp_path / "plan.json").proportions == scope["plan"].proportions
    assert sum(scope["ranks"].values()) > 0 and set(scope["ranks"]) == {"q_proj", "v_proj"}
    assert {n: m.r for n, m in scope["model2"].named_modules() if hasattr(m, "lora_A")} == scope["ranks"]
