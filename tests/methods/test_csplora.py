"""CSPLoRA: batched importance == per-sample reference, budget-exact rounding, plan I/O, and deployment on peft
LoRA/DoRA and on our own adapters with every module at its planned rank."""

from __future__ import annotations

import json
import math
import random
import warnings

import pytest
import torch
from torch import nn

from icml26.core.adapters import LoRALinear, count_trainable_parameters, inject_adapters
from icml26.core.testing import assert_close
from icml26.methods.csplora import (CSPLoRAConfig, CSPLoRAPlanner, RankPlan, adapted_ranks, allocate_ranks,
                                    anchored_key, check_ranks, classification_probe, normalise_weights,
                                    sample_uncertainty, sequence_probe)
from icml26.methods.csplora.reference import reference_importance, reference_proportions, reference_weights


# -- models and probes ----------------------------------------------------------------------------------------
class SharedMLP(nn.Module):
    """Odd sizes, and ``mid`` is applied twice per forward: its per-sample gradient must sum both calls."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 9)
        self.mid = nn.Linear(9, 9, bias=False)
        self.out = nn.Linear(9, 5)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(torch.tanh(self.mid(h))))
        return self.out(h)


def _mlp_case():
    torch.manual_seed(0)
    model = SharedMLP().double()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(11, 7, generator=gen, dtype=torch.float64), torch.randint(0, 5, (11,), generator=gen)
    batches = [(x[:6], y[:6]), (x[6:], y[6:])]
    return model, batches, lambda m, b: classification_probe(m(b[0]), b[1]), ["inp", "mid", "out"]


def _tiny_lm_case():
    from icml26.models.tiny_lm import TinyLM, TinyLMConfig

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(d_model=16, n_layers=2, n_heads=2, max_seq_len=16, vocab_size=40)).double()
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 40, (5, 9), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[:, :3] = -100  # a "prompt" that does not count
    batches = [(tokens[:3, :-1], labels[:3]), (tokens[3:, :-1], labels[3:])]
    return model, batches, lambda m, b: sequence_probe(m(b[0])[0], b[1]), ["qkv_proj", "out_proj", "down_proj"]


CASES = {"mlp": _mlp_case, "tiny_lm": _tiny_lm_case}


def _hf_llama(layers: int = 2):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).eval()


def _random_plan(shapes: dict, seed: int = 0, **kw) -> RankPlan:
    rng = random.Random(seed)
    return RankPlan({n: rng.random() ** 2 for n in shapes}, shapes, **kw)


def _llama_shapes(layers: int, d: int, kv: int, ff: int) -> dict:
    shapes = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj": (d, d), p + "self_attn.k_proj": (d, kv), p + "self_attn.v_proj": (d, kv),
                       p + "self_attn.o_proj": (d, d), p + "mlp.gate_proj": (d, ff), p + "mlp.up_proj": (d, ff),
                       p + "mlp.down_proj": (ff, d)})
    return shapes


# -- importance: batched == reference --------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("importance", ["fisher", "taylor"])
@pytest.mark.parametrize("weighting", ["focal", "entropy", "none"])
def test_batched_importance_equals_per_sample_reference(case, importance, weighting):
    model, batches, probe, targets = CASES[case]()
    config = CSPLoRAConfig(importance=importance, weighting=weighting, gamma=1.5, size_norm="sqrt", kappa=1.3)
    scores = CSPLoRAPlanner(config).score(model, batches, probe, targets)
    plan = scores.plan(config)
    ref, ref_w = reference_importance(model, batches, probe, scores.names, config)
    names = scores.names
    assert_close("I_m", torch.tensor([ref[n] for n in names]),
                 torch.tensor([plan.metadata["raw_importance"][n] for n in names]), 1e-10)
    w = normalise_weights(sample_uncertainty(scores.confidence, scores.entropy, config))
    assert_close("w", torch.tensor(ref_w, dtype=torch.float64), w, 1e-12)
    ref_pi = reference_proportions(ref, scores.shapes, config)
    assert_close("pi", torch.tensor([ref_pi[n] for n in names]), torch.tensor([plan.proportions[n] for n in names]),
                 1e-10)


def test_gram_and_explicit_fisher_paths_agree(monkeypatch):
    """Long sequences take the explicit per-sample matrix; short ones the Gram identity. Both must agree."""
    import icml26.methods.csplora.planner as planner

    x = torch.randn(3, 5, 4, dtype=torch.float64)
    g = torch.randn(3, 5, 6, dtype=torch.float64)
    w = torch.randn(6, 4, dtype=torch.float64)
    explicit = torch.einsum("bto,bti->boi", g, x).pow(2).sum((1, 2))
    assert_close("fisher", explicit, planner._per_sample_linear_scores(x, g, w, "fisher"), 1e-12)
    monkeypatch.setattr(planner, "_CHUNK_ELEMENTS", 1)  # one sample per chunk
    taylor = (torch.einsum("bto,bti->boi", g, x) * w).abs().sum((1, 2))
    assert_close("taylor", taylor, planner._per_sample_linear_scores(x, g, w, "taylor"), 1e-12)


def test_probe_leaves_the_model_as_it_was():
    model, batches, probe, targets = _mlp_case()
    model.train()
    model.mid.weight.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    CSPLoRAPlanner().score(model, batches, probe, targets)
    assert model.training and not model.mid.weight.requires_grad and model.inp.weight.requires_grad
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_plan_is_invariant_to_the_loss_scale_and_unweighted_means_unit_weights():
    model, batches, probe, targets = _mlp_case()

    def scaled(m, b):
        out = probe(m, b)
        out.loss = 3.0 * out.loss
        return out

    config = CSPLoRAConfig()
    plain = CSPLoRAPlanner(config).plan(model, batches, probe, targets).proportions
    big = CSPLoRAPlanner(config).plan(model, batches, scaled, targets).proportions
    assert_close("pi", torch.tensor(list(plain.values())), torch.tensor(list(big.values())), 1e-12)
    u = sample_uncertainty(torch.tensor([0.1, 0.9, 1.0]), None, CSPLoRAConfig(weighting="none"))
    assert torch.equal(u, torch.ones(3, dtype=torch.float64))


def test_weights_favour_hard_samples_and_fall_back_when_all_are_certain():
    conf = torch.tensor([0.99, 0.5, 0.01], dtype=torch.float64)
    w = normalise_weights(sample_uncertainty(conf, None, CSPLoRAConfig(gamma=2.0)))
    assert w[0] < w[1] < w[2] and math.isclose(float(w.mean()), 1.0)
    assert reference_weights([0.99, 0.5, 0.01], None, CSPLoRAConfig(gamma=2.0)) == pytest.approx(w.tolist())
    assert torch.equal(normalise_weights(torch.zeros(4, dtype=torch.float64)), torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="entropy"):
        sample_uncertainty(conf, None, CSPLoRAConfig(weighting="entropy"))


def test_probe_helpers():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    out = classification_probe(logits, torch.tensor([0, 2]))
    p = logits.softmax(-1)
    assert_close("c", torch.stack([p[0, 0], p[1, 2]]), out.confidence, 1e-6)
    assert_close("H", (-(p * p.log()).sum(-1) / math.log(3)), out.entropy, 1e-6)
    seq = torch.randn(2, 4, 5)
    labels = torch.tensor([[1, -100, 3, 0], [-100, -100, 2, -100]])
    out = sequence_probe(seq, labels)
    logp = seq.log_softmax(-1)
    want0 = -(logp[0, 0, 1] + logp[0, 2, 3] + logp[0, 3, 0]) / 3
    assert_close("loss", torch.stack([want0, -logp[1, 2, 2]]), out.loss, 1e-6)
    with pytest.raises(ValueError, match="target token"):
        sequence_probe(seq, torch.full((2, 4), -100))


# -- budgets and rounding ---------------------------------------------------------------------------------------
SHAPE_SETS = {
    "tiny_lm": {f"blocks.{i}.{n}": s for i in range(2) for n, s in
                {"qkv": (64, 192), "out": (64, 64), "gate": (64, 160), "up": (64, 160), "down": (160, 64)}.items()},
    "mnist_mlp": {"layers.0": (784, 128), "layers.1": (128, 128), "layers.2": (128, 128), "layers.3": (128, 128),
                  "head": (128, 10)},
    "smollm2": _llama_shapes(30, 576, 192, 1536),
}


@pytest.mark.parametrize("shapes", list(SHAPE_SETS))
def test_ranks_spend_uniform_lora_parameter_count_at_every_budget(shapes):
    """Exact on transformer shapes; on the MLP (costs 912, 256 and 138) never above and at most 5% below."""
    exact = shapes != "mnist_mlp"
    shapes = SHAPE_SETS[shapes]
    for seed in range(4 if len(shapes) > 20 else 12):
        plan = _random_plan(shapes, seed)
        for mean_rank in (1, 2, 4, 8):
            ranks = plan.ranks_for_budget(mean_rank=mean_rank)
            spent, budget = plan.num_params(ranks), plan.uniform_params(mean_rank)
            assert spent == budget if exact else 0.95 * budget <= spent <= budget
            assert all(1 <= ranks[n] <= min(shapes[n]) for n in shapes)


def test_bounded_shift_keeps_the_plan_where_an_exact_count_would_undo_it():
    """On the MNIST MLP every exact allocation at mean rank 4 has rank 4 on layers.0 and on the head."""
    shapes = SHAPE_SETS["mnist_mlp"]
    plan = RankPlan({"layers.0": 0.006, "layers.1": 0.018, "layers.2": 0.015, "layers.3": 0.019, "head": 0.942},
                    shapes)
    ranks = plan.ranks_for_budget(mean_rank=4)
    assert ranks["head"] == 10 and plan.num_params(ranks) == 7044 < plan.uniform_params(4) == 7272
    wide = plan.ranks_for_budget(mean_rank=4, max_shift=6)
    assert plan.num_params(wide) == 7272 and wide["head"] == wide["layers.0"] == 4


def test_uniform_plan_and_kappa_zero_reproduce_uniform_lora():
    shapes = SHAPE_SETS["mnist_mlp"]
    for mean_rank in (1, 3, 4, 8):
        assert set(RankPlan.uniform(shapes).ranks_for_budget(mean_rank=mean_rank).values()) == {mean_rank}
    model, batches, probe, targets = _mlp_case()
    plan = CSPLoRAPlanner(kappa=0.0).plan(model, batches, probe, targets)
    assert set(plan.ranks_for_budget(mean_rank=3).values()) == {3}


def test_allocation_follows_the_plan_and_respects_bounds():
    shapes = dict.fromkeys(["a", "b", "c", "d"], (64, 64))
    plan = RankPlan({"a": 0.4, "b": 0.3, "c": 0.2, "d": 0.1}, shapes)
    ranks = plan.ranks_for_budget(mean_rank=10)
    assert ranks == {"a": 16, "b": 12, "c": 8, "d": 4}  # exactly proportional when the costs are equal
    capped = plan.ranks_for_budget(mean_rank=10, r_max=13)  # water-filling hands a's excess to the others
    assert capped["a"] == 13 and max(capped.values()) == 13 and plan.num_params(capped) == plan.uniform_params(10)
    dropped = RankPlan({"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.0}, shapes, r_min=0).ranks_for_budget(mean_rank=2)
    assert dropped == {"a": 4, "b": 4, "c": 0, "d": 0}
    assert plan.ranks_for_budget(total_params=128 * 7) == {"a": 3, "b": 2, "c": 1, "d": 1}
    with pytest.raises(ValueError, match="outside"):
        plan.ranks_for_budget(mean_rank=65)
    with pytest.raises(ValueError, match="exactly one"):
        plan.ranks_for_budget()


def test_rounding_never_exceeds_the_budget_on_adversarial_shapes():
    rng = random.Random(3)
    for _ in range(60):
        n = rng.randint(1, 6)
        costs = [rng.choice([10, 19, 71, 106, 256, 912]) for _ in range(n)]
        upper = [rng.choice([3, 8, 64]) for _ in range(n)]
        lower = [min(rng.choice([0, 1]), u) for u in upper]
        budget = rng.randint(sum(lo * c for lo, c in zip(lower, costs)), sum(u * c for u, c in zip(upper, costs)))
        ranks, targets = allocate_ranks([rng.random() for _ in range(n)], costs, budget, lower, upper)
        assert sum(r * c for r, c in zip(ranks, costs)) <= budget
        assert all(lo <= r <= u for r, lo, u in zip(ranks, lower, upper))
        greedy, _ = allocate_ranks([1.0] * n, costs, budget, lower, upper, max_shift=0)
        assert sum(r * c for r, c in zip(greedy, costs)) <= budget


# -- plan object ------------------------------------------------------------------------------------------------
def test_plan_json_round_trip(tmp_path):
    model, batches, probe, targets = _mlp_case()
    plan = CSPLoRAPlanner(r_min=0, alpha_mode="constant").plan(model, batches, probe, targets, task="unit")
    path = tmp_path / "plans" / "plan.json"
    plan.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]  # atomic write: no temporary left behind
    data = json.loads(path.read_text())
    assert data["format"] == "icml26.csplora.RankPlan" and [m["name"] for m in data["modules"]] == targets
    again = RankPlan.load(path)
    assert again.proportions == plan.proportions and again.shapes == plan.shapes
    assert (again.r_min, again.alpha_mode, again.metadata["task"]) == (0, "constant", "unit")
    assert again.ranks_for_budget(mean_rank=3) == plan.ranks_for_budget(mean_rank=3)
    with pytest.raises(ValueError, match="not a CSPLoRA plan"):
        RankPlan.from_dict({**data, "format": "other"})
    with pytest.raises(ValueError, match="sum to 0"):
        RankPlan({"a": 0.0}, {"a": (2, 2)})
    with pytest.raises(ValueError, match="shapes"):
        RankPlan({"a": 1.0}, {"a": (2, 0)})


# -- deployment -------------------------------------------------------------------------------------------------
def test_peft_lora_and_dora_get_every_planned_rank_with_anchored_keys():
    peft = pytest.importorskip("peft")
    model = _hf_llama(layers=12)  # layers.1 and layers.11: an unanchored "layers.1.…" key would hit both
    shapes = {n: (m.in_features, m.out_features) for n, m in model.named_modules()
              if isinstance(m, nn.Linear) and n.startswith("model.layers.") and n.endswith(("q_proj", "v_proj"))}
    plan = _random_plan(shapes, seed=5)
    ranks = plan.ranks_for_budget(mean_rank=3)
    assert len(set(ranks.values())) > 1
    config = plan.to_peft_config(mean_rank=3, lora_dropout=0.0)
    assert set(config.rank_pattern) == {anchored_key(n) for n in shapes} and all(k.startswith("^")
                                                                                 for k in config.alpha_pattern)
    uniform_lora = count_trainable_parameters(peft.get_peft_model(_hf_llama(12), peft.LoraConfig(
        r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"])))
    for use_dora in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # peft warns when a pattern key matches nothing
            peft_model = peft.get_peft_model(_hf_llama(12), plan.to_peft_config(mean_rank=3, use_dora=use_dora))
        check_ranks(peft_model, ranks, plan.alphas_for(ranks, 3))
        d_out = sum(s[1] for s in shapes.values()) if use_dora else 0  # DoRA's magnitude vectors
        assert count_trainable_parameters(peft_model) == uniform_lora + d_out
        with torch.no_grad():
            peft_model(torch.randint(0, 50, (1, 5)))
    with pytest.raises(ValueError, match="do not follow the plan"):
        check_ranks(peft_model, plan.ranks_for_budget(mean_rank=5))
    with pytest.raises(ValueError, match="sets"):
        plan.to_peft_config(mean_rank=3, r=4)


def test_same_plan_deploys_on_our_lora_adapters():
    model = _hf_llama(layers=2)
    shapes = {n: (m.in_features, m.out_features) for n, m in model.named_modules()
              if isinstance(m, nn.Linear) and n.startswith("model.layers.")}
    plan = _random_plan(shapes, seed=1, r_min=0)
    ranks = plan.ranks_for_budget(mean_rank=4)
    names = inject_adapters(model, plan.to_adapter_config(mean_rank=4),
                            lambda linear, r, alpha, name: LoRALinear(linear, r, alpha))
    assert set(names) == {n for n, r in ranks.items() if r > 0}
    check_ranks(model, ranks, plan.alphas_for(ranks, 4))
    assert {n: r for n, (r, _) in adapted_ranks(model).items()} == {n: r for n, r in ranks.items() if r > 0}
    assert count_trainable_parameters(model) == plan.num_params(ranks) == plan.uniform_params(4)
    for _, layer in model.named_modules():
        if isinstance(layer, LoRALinear):
            assert layer.scaling == 2.0  # alpha_mode="proportional": alpha / r as in uniform LoRA


# -- config -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("weighting", "softmax"), ("gamma", -1.0), ("importance", "svd"), ("size_norm", "rows"), ("kappa", -0.5),
    ("kappa", math.inf), ("r_min", -1), ("r_min", 1.5), ("r_max", 0), ("alpha_mode", "rslora"), ("alpha_ratio", 0.0),
])
def test_bad_config_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        CSPLoRAConfig(**{field: value})


# -- experiments --------------------------------------------------------------------------------------------------
def test_specs_share_tier_configs_and_keep_budgets_equal():
    from icml26.methods.csplora.experiments import ARMS, SPECS, _check_equal_budgets

    assert len({s.id for s in SPECS}) == len(SPECS)
    for prefix in ("mnist", "smollm2"):
        group = [s for s in SPECS if s.id.startswith(prefix)]
        assert len(group) == 3 and all(s.tiers is group[0].tiers for s in group)  # one computation per seed
        for spec in group:
            assert set(spec.arms) <= set(ARMS) and spec.comparator.threshold == 0.0
            assert all(spec.baseline in cfg["arms"] for cfg in spec.tiers.values())
    _check_equal_budgets({"csplora_low": {"trainable_params": 97}, "uniform_low": {"trainable_params": 100}})
    for planned in (101, 94):
        with pytest.raises(RuntimeError, match="equal budget"):
            _check_equal_budgets({"unweighted": {"trainable_params": planned}, "uniform": {"trainable_params": 100}})


def test_every_mnist_tier_splits_within_the_fine_tuning_pool():
    """Train, validation and test digits of every tier fit the images left after pretraining (the full tier once
    asked for 2,900 of 2,500 and failed at its first launch)."""
    from icml26.methods.csplora.experiments import _MNIST_TIERS, _mnist

    n_images = len(_mnist()[0])
    for tier, config in _MNIST_TIERS.items():
        assert config["n_train"] + config["n_val"] + config["n_test"] <= n_images - config["n_pretrain"], tier


@pytest.mark.parametrize("claim", ["vs_uniform", "vs_unweighted", "transfer"])
def test_null_arm_plan_switched_back_to_its_baseline_fails_the_comparator(claim):
    """The CSPLoRA plan replaced by its baseline's plan (same rate, same seed): every gain is exactly 0, which the
    comparator rejects. The SmolLM2 specs share these comparators and null values."""
    from icml26.methods.csplora.experiments import _NULL_PLAN, ARMS, SPECS, run_claim

    spec = next(s for s in SPECS if s.id == f"mnist_{claim}")
    config = dict(spec.tiers["smoke"], as_baseline=_NULL_PLAN[claim])
    prepared = {"tuning": {"planner": {"chosen": {"csplora": "numel"}}, "lr": {"chosen": dict.fromkeys(ARMS, 3e-3)}}}
    value = run_claim(claim, spec.arms)(config, 0, prepared)["statistics"][spec.comparator.statistic]
    assert value == pytest.approx(spec.null_value)
    assert not spec.comparator.holds(value)
    twin = next(s for s in SPECS if s.id == f"smollm2_{claim}")
    assert twin.comparator == spec.comparator and twin.null_value == spec.null_value


def test_mnist_claims_run_at_smoke_tier_with_checks(tmp_path):
    from icml26.harness.runner import run_spec
    from icml26.methods.csplora.experiments import SPECS

    result = run_spec(SPECS[1], "smoke", tmp_path)
    assert result["status"] == "complete" and result["verdict"] == "inconclusive"
    names = {c["name"] for c in result["mechanism_checks"]}
    assert names >= {"rank_distance_vs_unweighted", "uniform_gain_over_frozen", "tuned_inside_grid"}
