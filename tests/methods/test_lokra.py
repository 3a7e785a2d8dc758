"""LoKRA / LoKRA+: Kruskal-rank tools on hand-made cases, fast forms against reference.py, LoRA reduction, layouts,
the penalty (ours and the peft route), config validation, and a real SmolLM2 run."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from icml26.core.adapters import AdapterConfig, LoRALinear, adapter_layers, inject_adapters
from icml26.core.testing import assert_close, tiny_tensor
from icml26.methods.lokra import (LoKRAConfig, LoKRAPlusLinear, coherence_lower_bound, coherence_penalty,
                                  effective_rank, khatri_rao, khatri_rao_kruskal_bound, kruskal_penalty, kruskal_rank,
                                  lokra_make, lokra_plus_make, mutual_coherence, plus_layout, update_diagnostics)
from icml26.methods.lokra.reference import (coherence_penalty_reference, khatri_rao_reference, kruskal_rank_reference,
                                            lokra_plus_delta_reference, mutual_coherence_reference)

S2, S3 = math.sqrt(2.0), math.sqrt(3.0)
e = torch.eye(4, dtype=torch.float64)


def T(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# (name, X with columns as vectors, exact k-rank, mutual coherence, coherence lower bound)
HAND_MADE = [
    ("identity", e[:3, :3], 3, 0.0, 3),
    ("duplicate_column", torch.stack([e[:3, 0], e[:3, 1], e[:3, 0]], 1), 1, 1.0, 1),
    ("zero_column", torch.stack([e[:3, 0], e[:3, 1], torch.zeros(3, dtype=torch.float64)], 1), 0, None, 0),
    ("e1_e2_sum_in_R2", T([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]), 2, 1 / S2, 2),
    # full rank 3, but {e1, e2, e1+e2} is dependent: the rank says 3, the k-rank says 2
    ("rank3_krank2", torch.stack([e[:3, 0], e[:3, 1], e[:3, 2], e[:3, 0] + e[:3, 1]], 1), 2, 1 / S2, 2),
    # three unit vectors 120 degrees apart: mu = 1/2 exactly, where a careless ceil(1/mu) would claim 3
    ("frame_120deg", T([[1.0, -0.5, -0.5], [0.0, S3 / 2, -S3 / 2]]), 2, 0.5, 2),
    # rank 4 from four orthogonal columns, yet a scaled copy of e1 makes the k-rank 1
    ("scaled_copy", torch.stack([e[:, 0], e[:, 1], e[:, 2], e[:, 3], 2 * e[:, 0]], 1), 1, 1.0, 1),
    # every 3 columns of a Vandermonde matrix with distinct nodes are independent: k-rank 3 (= rows)
    ("vandermonde_3x5", T([[1.0] * 5, [1.0, 2, 3, 4, 5], [1.0, 4, 9, 16, 25]]), 3, None, None),
    ("single_column", T([[2.0], [1.0]]), 1, 0.0, 1),
]


@pytest.mark.parametrize("name, X, krank, mu, bound", HAND_MADE, ids=[c[0] for c in HAND_MADE])
def test_kruskal_tools_on_hand_made_cases(name, X, krank, mu, bound):
    assert kruskal_rank(X) == krank
    assert kruskal_rank_reference(X) == krank
    if mu is not None:
        assert mutual_coherence(X) == pytest.approx(mu, abs=1e-12)
        assert mutual_coherence_reference(X) == pytest.approx(mu, abs=1e-12)
    lower = coherence_lower_bound(X)
    if bound is not None:
        assert lower == bound
    assert lower <= krank <= int(torch.linalg.matrix_rank(X.double()))


def _structured(seed: int) -> list[torch.Tensor]:
    """Random small matrices, with duplicated, scaled and summed columns planted so every k-rank value occurs."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for m, n in [(3, 5), (4, 7), (2, 6), (5, 5), (4, 8)]:
        X = torch.randn(m, n, generator=gen, dtype=torch.float64)
        out.append(X)
        Y = X.clone()
        Y[:, -1] = 3.0 * Y[:, 0]
        out.append(Y)
        Z = X.clone()
        Z[:, -1] = Z[:, 0] - 2.0 * Z[:, 1]
        out.append(Z)
        out.append(torch.randn(m, 2, generator=gen, dtype=torch.float64) @ torch.randn(2, n, generator=gen,
                                                                                        dtype=torch.float64))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_fast_kruskal_rank_equals_brute_force_and_bound_holds(seed):
    seen = set()
    for X in _structured(seed):
        exact = kruskal_rank_reference(X)
        assert kruskal_rank(X) == exact
        assert coherence_lower_bound(X) <= exact
        assert mutual_coherence(X) == pytest.approx(mutual_coherence_reference(X), abs=1e-12)
        seen.add(exact)
    assert {1, 2, 3} <= seen


def test_kruskal_rank_refuses_too_many_subsets():
    X = tiny_tensor(6, 40, seed=3, dtype=torch.float64)
    X[:, 39] = X[:, 0] + X[:, 1] + X[:, 2] + X[:, 3] + X[:, 4]
    with pytest.raises(ValueError, match="max_subsets"):
        kruskal_rank(X, max_subsets=1000)


@pytest.mark.parametrize("p, q, n", [(2, 3, 5), (3, 3, 7), (1, 4, 3)])
def test_khatri_rao_matches_reference_and_sidiropoulos_bro_bound(p, q, n):
    U, V = tiny_tensor(p, n, seed=1, dtype=torch.float64), tiny_tensor(q, n, seed=2, dtype=torch.float64)
    U[:, -1] = U[:, 0]  # lower k(U) so that the bound is not trivially n
    kr = khatri_rao(U, V)
    assert_close("khatri-rao", khatri_rao_reference(U, V), kr, 1e-15)
    k_u, k_v = kruskal_rank(U), kruskal_rank(V)
    assert kruskal_rank(kr) >= khatri_rao_kruskal_bound(k_u, k_v, n)
    assert khatri_rao_kruskal_bound(0, 3, n) == 0


def test_khatri_rao_beats_the_product_bound():
    """The point of LoKRA+: a product BA has k-rank <= r, Khatri-Rao factors of the same size can exceed it."""
    gen = torch.Generator().manual_seed(0)
    r, d = 3, 9
    A, B = torch.randn(r, d, generator=gen, dtype=torch.float64), torch.randn(d, r, generator=gen, dtype=torch.float64)
    U, V = torch.randn(r, d, generator=gen, dtype=torch.float64), torch.randn(r, d, generator=gen, dtype=torch.float64)
    assert kruskal_rank(B @ A) == r
    assert kruskal_rank(khatri_rao(U, V)) >= khatri_rao_kruskal_bound(kruskal_rank(U), kruskal_rank(V), d) == 2 * r - 1


@pytest.mark.parametrize("kind", ["mean_square", "soft_max"])
@pytest.mark.parametrize("shape", [(3, 11), (9, 4), (5, 5)], ids=["wide", "tall", "square"])
def test_coherence_penalty_matches_reference_value_and_gradient(kind, shape):
    X = tiny_tensor(*shape, seed=4, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        X[:, 1] = 0.0  # a zero column, as in a zero-initialised factor
    fast = coherence_penalty(X, kind=kind, tau=0.2, eps=1e-3)
    (g_fast,) = torch.autograd.grad(fast, X)
    ref = coherence_penalty_reference(X, kind=kind, tau=0.2, eps=1e-3)
    (g_ref,) = torch.autograd.grad(ref, X)
    assert_close("penalty", ref, fast, 1e-10)
    assert_close("grad", g_ref, g_fast, 1e-9)
    assert torch.isfinite(g_fast).all() and float(g_fast[:, 1].abs().max()) == 0.0


def test_penalty_descent_lowers_coherence_and_raises_the_certificate():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4, 1, generator=gen, dtype=torch.float64)
    X = (base + 0.3 * torch.randn(4, 6, generator=gen, dtype=torch.float64)).requires_grad_(True)
    before_mu, before_bound = mutual_coherence(X), coherence_lower_bound(X)
    opt = torch.optim.Adam([X], lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        coherence_penalty(X, kind="soft_max", tau=0.05).backward()
        opt.step()
    assert mutual_coherence(X) < before_mu - 0.3
    assert coherence_lower_bound(X) > before_bound


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 16), nn.GELU(), nn.Linear(16, 6)).double()


def test_lam_zero_trains_exactly_like_lora():
    x = tiny_tensor(32, 10, seed=5, dtype=torch.float64)
    y = torch.randint(0, 6, (32,), generator=torch.Generator().manual_seed(6))
    results = []
    for make, penalised in [(lambda lin, r, a, n: LoRALinear(lin, r, a), False),
                            (lokra_make(LoKRAConfig(lam=0.0)), True)]:
        model = _mlp()
        torch.manual_seed(7)
        inject_adapters(model, AdapterConfig(r=3, alpha=6.0, target_modules=["0", "2"]), make)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(8):
            loss = nn.functional.cross_entropy(model(x), y)
            if penalised:
                loss = loss + kruskal_penalty(model)
            opt.zero_grad()
            loss.backward()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters() if p.requires_grad])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("d_out, d_in, axis", [(7, 5, "columns"), (5, 11, "rows"), (6, 6, "rows"), (9, 4, "auto")])
@pytest.mark.parametrize("init", ["zero_u", "zero_v"])
def test_lokra_plus_forward_and_gradients_match_reference(d_out, d_in, axis, init):
    torch.manual_seed(0)
    base = nn.Linear(d_in, d_out).double()
    layer = LoKRAPlusLinear(base, 2, 3.0, config=LoKRAConfig(kr_axis=axis, plus_init=init, plus_budget="grow"))
    zero = layer.lokrap_U if init == "zero_u" else layer.lokrap_V
    assert float(zero.detach().abs().max()) == 0.0
    x = tiny_tensor(3, 4, d_in, seed=1, dtype=torch.float64)
    assert_close("fresh", base(x), layer(x), 1e-12)
    with torch.no_grad():
        layer.lokrap_U.copy_(tiny_tensor(*layer.lokrap_U.shape, seed=2, dtype=torch.float64))
        layer.lokrap_V.copy_(tiny_tensor(*layer.lokrap_V.shape, seed=3, dtype=torch.float64))
    U = layer.lokrap_U.detach().clone().requires_grad_(True)
    V = layer.lokrap_V.detach().clone().requires_grad_(True)
    delta = lokra_plus_delta_reference(U, V, d_out, d_in, layer.layout.axis, layer.scaling)
    ref = base(x) + x @ delta.T
    out = layer(x)
    assert_close("forward", ref, out, 1e-12)
    assert_close("adapter_forward", ref - base(x), layer.adapter_forward(x), 1e-12)
    w = tiny_tensor(*out.shape, seed=4, dtype=torch.float64)
    gU, gV = torch.autograd.grad((ref * w).sum(), (U, V))
    (out * w).sum().backward()
    assert_close("grad U", gU, layer.lokrap_U.grad, 1e-12)
    assert_close("grad V", gV, layer.lokrap_V.grad, 1e-12)


@pytest.mark.parametrize("d_out, d_in, r, axis, p, q", [
    (64, 64, 8, "columns", 8, 8),       # digits MLP hidden layer: exactly LoRA-8's 1024 parameters
    (192, 64, 8, "columns", 16, 16),    # tiny LM fused qkv_proj
    (576, 576, 24, "columns", 24, 24),  # SmolLM2 q_proj
    (192, 576, 24, "rows", 48, 48),     # SmolLM2 v_proj: vectors along the longer input side
])
def test_plus_layout_fits_the_lora_budget(d_out, d_in, r, axis, p, q):
    lay = plus_layout(d_out, d_in, r)
    assert (lay.axis, lay.p, lay.q) == (axis, p, q)
    assert lay.p * lay.q >= lay.length == max(d_out, d_in)
    assert lay.n_params <= r * (d_in + d_out)


def test_plus_layout_strict_budget_raises_and_grow_fits():
    with pytest.raises(ValueError, match="r >= 24"):
        plus_layout(576, 576, 8)
    lay = plus_layout(576, 576, 8, budget="grow")
    assert (lay.p, lay.q) == (24, 24)
    with pytest.raises(ValueError, match="kr_axis"):
        plus_layout(4, 4, 2, kr_axis="diagonal")


def test_update_diagnostics_see_the_higher_rank_of_khatri_rao_updates():
    torch.manual_seed(0)
    lora = LoRALinear(nn.Linear(16, 16), 4, 8.0)
    plus = LoKRAPlusLinear(nn.Linear(16, 16), 4, 8.0)
    with torch.no_grad():
        for p in (*lora.parameters(), *plus.parameters()):
            if p.requires_grad:
                p.normal_()
    d_lora, d_plus = update_diagnostics(lora), update_diagnostics(plus, exact_max_subsets=100_000)
    assert d_lora["erank"] <= 4 + 1e-9 < d_plus["erank"]
    assert d_plus["kr_bound"] >= 1 and d_plus["delta_krank"] >= d_plus["delta_kbound"]
    assert plus.expected_trainable() == lora.expected_trainable() == 128


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_penalty_is_the_lambda_weighted_sum_and_the_peft_route_agrees():
    peft = pytest.importorskip("peft")
    ours = _tiny_llama()
    peft_model = peft.get_peft_model(copy.deepcopy(ours), peft.LoraConfig(r=4, lora_alpha=8,
                                                                           target_modules=["q_proj", "v_proj"]))
    config = LoKRAConfig(lam=0.3)
    inject_adapters(ours, AdapterConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"]), lokra_make(config))
    ours_layers = dict(adapter_layers(ours))
    gen = torch.Generator().manual_seed(1)
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and isinstance(module.lora_A, nn.ModuleDict):
            key = name.split("base_model.model.", 1)[1]
            with torch.no_grad():
                module.lora_A["default"].weight.normal_(generator=gen)
                module.lora_B["default"].weight.normal_(generator=gen)
                ours_layers[key].lokra_A.copy_(module.lora_A["default"].weight)
                ours_layers[key].lokra_B.copy_(module.lora_B["default"].weight)
    total = kruskal_penalty(ours)
    by_hand = sum(0.3 * layer.penalty() for layer in ours_layers.values())
    assert len(ours_layers) == 4
    assert_close("sum", by_hand, total, 1e-6)
    assert_close("mean", by_hand / 4, kruskal_penalty(ours, reduction="mean"), 1e-6)
    assert_close("peft route", total, kruskal_penalty(peft_model, peft_config=config), 1e-6)
    kruskal_penalty(peft_model).backward()
    assert all(p.grad is not None for n, p in peft_model.named_parameters() if "lora_" in n)
    with pytest.raises(ValueError, match="no LoKRA"):
        kruskal_penalty(nn.Linear(3, 3))


@pytest.mark.parametrize("kwargs, field", [
    ({"lam": -0.1}, "lam"), ({"lam": float("nan")}, "lam"), ({"coherence": "max"}, "coherence"),
    ({"tau": 0.0}, "tau"), ({"penalty_on": "rows"}, "penalty_on"), ({"norm_eps": -1.0}, "norm_eps"),
    ({"kr_axis": "diag"}, "kr_axis"), ({"plus_init": "random"}, "plus_init"), ({"plus_budget": "loose"}, "plus_budget"),
])
def test_bad_config_raises_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoKRAConfig(**kwargs)


def test_bad_penalty_arguments_raise():
    with pytest.raises(ValueError, match="kind"):
        coherence_penalty(torch.randn(3, 4), kind="median")
    with pytest.raises(ValueError, match="reduction"):
        kruskal_penalty(nn.Linear(2, 2), reduction="max")
    with pytest.raises(ValueError, match="same number of columns"):
        khatri_rao(torch.randn(2, 3), torch.randn(2, 4))
    with pytest.raises(ValueError, match="zero column"):
        mutual_coherence(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    assert effective_rank(torch.zeros(3, 3)) == 0.0
    assert effective_rank(torch.eye(5)) == pytest.approx(5.0)


def test_lokra_and_lokra_plus_on_smollm2():
    from icml26.models.smollm2 import load_smollm2, smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 weights not installed")
    model, tok = load_smollm2()
    ids = tok("To be, or not to be", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        before = model(input_ids=ids).logits
    cfg = AdapterConfig(r=24, alpha=48.0, target_modules=["layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj",
                                                          "layers.1.self_attn.q_proj"])
    inject_adapters(model, cfg, lokra_plus_make())
    plus = [layer for _, layer in adapter_layers(model)]
    assert [lay.layout.axis for lay in plus] == ["columns", "rows", "columns"]
    with torch.no_grad():
        assert_close("fresh", before, model(input_ids=ids).logits, 1e-6)
    loss = model(input_ids=ids, labels=ids).loss + kruskal_penalty(model)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_digits_claim_runs_at_smoke_tier_with_equal_budgets(tmp_path):
    from icml26.harness.runner import run_spec
    from icml26.methods.lokra.experiments import SPECS

    spec = next(s for s in SPECS if s.id == "digits_lokra")
    result = run_spec(spec, "smoke", tmp_path)
    arms = result["arms"]
    assert result["status"] == "complete" and set(arms) == {"lora", "lokra", "lokra_plus"}
    assert arms["lora"]["n_trainable"]["mean"] == arms["lokra"]["n_trainable"]["mean"] == 2640
    assert 0.99 <= result["statistics"]["param_ratio_lokra_plus"]["mean"] <= 1.0
    assert all(math.isfinite(v["mean"]) for v in result["statistics"].values())
    assert arms["lora"]["penalty"]["mean"] == 0.0 < arms["lokra"]["penalty"]["mean"]
    assert {c["name"] for c in result["mechanism_checks"]} >= {"factor_msc_drop_lokra", "tuned_inside_grid"}


def test_default_lambda_and_its_value_share_one_training():
    """The lr tuning trains the LoKRA arms at the default penalty weight (lam=None) and the lambda list lists that
    value again: both are one memoised run, and training at the spelled-out value from scratch gives the same
    model as the default did (so reusing it changes no number)."""
    from icml26.methods.lokra import experiments

    source = next(s for s in experiments.SPECS if s.id == "digits_lokra")
    config = dict(source.tiers["smoke"])
    default = LoKRAConfig(**config.get("lokra", {})).lam
    lr = config["lr_centers"]["lokra"]
    by_default = experiments.train_arm("lokra", config, 7, lr)
    assert experiments.train_arm("lokra", config, 7, lr, default) is by_default
    assert experiments.train_arm("lora", config, 7, lr, 0.5) is experiments.train_arm("lora", config, 7, lr)
    saved = dict(experiments._RUNS)
    experiments._RUNS.clear()
    try:
        fresh = experiments.train_arm("lokra", config, 7, lr, default)
    finally:
        experiments._RUNS.clear()
        experiments._RUNS.update(saved)
    assert fresh["final"] == by_default["final"] and fresh["penalty"] == by_default["penalty"]


def test_null_arm_method_switched_back_to_lora_fails_every_comparator():
    """Both method arms built as LoRA (same init, same rate, no penalty): every spec's statistic is its null
    value, which its comparator rejects. ``run_seed`` computes every statistic on any task, so one digits smoke
    run serves all specs (the tiny-LM and SmolLM2 smoke tiers pretrain or load an LM, minutes under load)."""
    from icml26.methods.lokra.experiments import SPECS, run_seed

    source = next(s for s in SPECS if s.id == "digits_lokra")
    config = dict(source.tiers["smoke"], as_baseline=["lokra", "lokra_plus"])
    lr = config["lr_centers"]["lora"]
    prepared = {"tuning": {"lr": {"chosen": {a: lr for a in ("lora", "lokra", "lokra_plus")}},
                           "lam": {"chosen": {"lokra": 0.1, "lokra_plus": 0.1}}}}
    stats = run_seed(config, 0, prepared)["statistics"]
    for spec in SPECS:
        value = stats[spec.comparator.statistic]
        assert value == pytest.approx(spec.null_value, abs=1e-9), spec.id
        assert not spec.comparator.holds(value), spec.id


def test_every_tiny_lm_tier_builds_every_arm():
    """Each tier's adapters fit its model for every arm (the tiny-LM full tier once asked LoKRA+ for r=8 on a
    384x128 projection, which cannot hold LoRA's budget, and failed at its first launch)."""
    from icml26.methods.lokra.experiments import SPECS, _inject
    from icml26.models.tiny_lm import TinyLM, TinyLMConfig

    for spec in (s for s in SPECS if s.id.startswith("tiny_lm")):
        for tier, config in spec.tiers.items():
            for arm in spec.arms:
                model = TinyLM(TinyLMConfig(d_model=config["d_model"], n_layers=config["n_layers"],
                                            n_heads=config["n_heads"], max_seq_len=config["seq_len"]))
                _inject(model, arm, config, 0)
                assert sum(p.requires_grad for p in model.parameters()) > 0, (spec.id, tier, arm)
