"""ScaLoRA: fast scaling solve == brute force, W unchanged by every restart, dense-reference parity, the LoRA
reduction, moment equivariance, the rank claim on a toy, ReLoRA mechanics, configs, and real models."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from icml26.core.adapters import AdapterConfig, LoRALinear, inject_adapters
from icml26.core.testing import assert_close
from icml26.methods.scalora import (ReLoRAOptimizer, ScaLoRALinear, ScaLoRAOptimizer, effective_rank, effective_weight,
                                    gram_adam, gram_sgd, lora_factors, lora_layers, merge_reinit_, merge_rescale_,
                                    solve_coefficients)
from icml26.methods.scalora.reference import (ReferenceScaLoRA, basis_adam, basis_sgd, lstsq_coefficients,
                                              nnls_bruteforce, reference_multipliers)
from icml26.methods.scalora.scaling import multipliers_from_coefficients

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _factors(m: int, n: int, r: int, seed: int):
    """Random G (m, n), A (r, n), B (m, r) and the factor gradients LoRA's backward would give."""
    G, A, B = _rand(m, n, seed=seed), _rand(r, n, seed=seed + 1), _rand(m, r, seed=seed + 2)
    s = 1.7
    return G, A, B, s, s * B.T @ G, s * G @ A.T


def _inject(model: nn.Module, targets, r: int = 3, layer=ScaLoRALinear) -> list[str]:
    return inject_adapters(model, AdapterConfig(r=r, alpha=2.0 * r, target_modules=targets),
                           lambda linear, rank, alpha, name: layer(linear, rank, alpha))


def _mlp(seed: int = 0, dtype=F64) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(9, 13), nn.Tanh(), nn.Linear(13, 6)).to(dtype)
    _inject(model, ["0", "2"])
    return model


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _data(dtype=F64, n: int = 32, d_in: int = 9, d_out: int = 6, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=gen, dtype=dtype), torch.randn(n, d_out, generator=gen, dtype=dtype)


def _train(model, opt, x, y, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# -- the scaling solve -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("m, n, r", [(7, 5, 3), (4, 11, 2), (6, 6, 1)])
def test_normal_equations_equal_the_explicit_basis(m, n, r):
    """K = M^T M and g = M^T vec(target) for the 2r explicit step matrices, without ever forming G."""
    G, A, B, s, gA, gB = _factors(m, n, r, seed=m * n)
    K, g = gram_sgd(A, B, gA, gB, s, target_scale=1.3)
    M = basis_sgd(G, A, B, s)
    assert_close("K sgd", M.T @ M, K, 1e-12)
    assert_close("g sgd", M.T @ (1.3 * G).reshape(-1), g, 1e-12)
    PA, PB = _rand(r, n, seed=7), _rand(m, r, seed=8)
    K, g = gram_adam(A, B, gA, gB, PA, PB, s)
    M = basis_adam(A, B, PA, PB, s)
    assert_close("K adam", M.T @ M, K, 1e-12)
    assert_close("g adam", M.T @ G.reshape(-1), g, 1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_unconstrained_solve_matches_lstsq(seed):
    G, A, B, s, gA, gB = _factors(8, 5, 3, seed=10 * seed)
    K, g = gram_sgd(A, B, gA, gB, s)
    c, mask = solve_coefficients(K, g, nonneg="clamp", ridge=0.0)
    assert bool(mask.all())
    assert_close("c", lstsq_coefficients(basis_sgd(G, A, B, s), G), c, 1e-8)


def test_nnls_solve_matches_bruteforce_over_all_supports():
    """On random 'adam'-proxy systems (random directions make negative unconstrained solutions common), the
    active-set solve equals the best of all 2^(2r) lstsq supports; several cases exercise the constraint."""
    constrained = 0
    for seed in range(40):
        G, A, B, s, gA, gB = _factors(6, 5, 2, seed=seed)
        PA, PB = _rand(2, 5, seed=100 + seed), _rand(6, 2, seed=200 + seed)
        K, g = gram_adam(A, B, gA, gB, PA, PB, s)
        c, _ = solve_coefficients(K, g, nonneg="nnls", ridge=0.0)
        expected = nnls_bruteforce(basis_adam(A, B, PA, PB, s), G)
        assert_close(f"nnls seed {seed}", expected, c, 1e-7, atol=1e-10)
        constrained += int((expected == 0).any())
    assert constrained >= 5


def test_batched_solve_equals_one_by_one_and_multipliers_match_reference():
    systems = [_factors(7, 4, 2, seed=s) for s in (1, 2, 3)]
    Ks, gs = zip(*(gram_sgd(A, B, gA, gB, s) for _, A, B, s, gA, gB in systems))
    c_batch, mask = solve_coefficients(torch.stack(Ks), torch.stack(gs))
    for i, (G, A, B, s, _, _) in enumerate(systems):
        c_one, _ = solve_coefficients(Ks[i], gs[i])
        assert_close("batched", c_one, c_batch[i], 1e-12)
        u, v = multipliers_from_coefficients(c_batch[i], mask[i], proxy="sgd", bounds=(1e-2, 1e2))
        u_ref, v_ref = reference_multipliers(basis_sgd(G, A, B, s), G, proxy="sgd", nonneg="nnls",
                                             bounds=(1e-2, 1e2))
        assert_close("u", u_ref, u, 1e-7)
        assert_close("v", v_ref, v, 1e-7)


def test_zero_B_leaves_the_B_multipliers_at_one():
    """At LoRA's initialisation (B = 0) every H_k is zero, so u is undetermined and kept at 1."""
    G, A, _, s, _, _ = _factors(5, 4, 2, seed=4)
    B = torch.zeros(5, 2, dtype=F64)
    K, g = gram_sgd(A, B, s * B.T @ G, s * G @ A.T, s)
    c, mask = solve_coefficients(K, g)
    u, v = multipliers_from_coefficients(c, mask, proxy="sgd", bounds=(1e-2, 1e2))
    assert mask.tolist() == [True, True, False, False] and torch.equal(u, torch.ones(2, dtype=F64))
    assert bool((v != 1).all())


def test_sgd_step_after_rescale_is_the_fitted_combination_and_beats_lora():
    """The first-order change of W under an SGD step after the rescale is exactly -eta * sum_k c_k M_k, and it
    is closer to the full fine-tuning step -eta G than plain LoRA's step (all multipliers 1)."""
    torch.manual_seed(0)
    layer = ScaLoRALinear(nn.Linear(6, 5, bias=False).double(), 2, 4.0)
    with torch.no_grad():
        layer.scalora_B.normal_()
    x, y = _data(n=16, d_in=6, d_out=5)
    W = effective_weight(layer).requires_grad_(True)
    G = torch.autograd.grad(nn.functional.mse_loss(x @ W.T, y), W)[0]

    def step_change(multipliers: bool) -> torch.Tensor:
        model = copy.deepcopy(layer)
        nn.functional.mse_loss(model(x), y).backward()
        opt = ScaLoRAOptimizer(model, torch.optim.SGD(_trainable(model), lr=1e-7),
                               scale_bounds=(1e-2, 1e2) if multipliers else (1.0, 1.0))
        before = effective_weight(model)
        opt.step()
        return (effective_weight(model) - before) / -1e-7

    A, B, s = lora_factors(layer)
    M = basis_sgd(G, A.detach(), B.detach(), s)
    u, v = reference_multipliers(M, G, proxy="sgd", nonneg="nnls", bounds=(1e-2, 1e2))
    fitted = (M @ torch.cat([v**2, u**2])).reshape(G.shape)
    scalora, lora = step_change(True), step_change(False)
    assert_close("first-order step", fitted, scalora, 1e-5)
    assert (scalora - G).norm() < 0.99 * (lora - G).norm()


# -- the merge-rescale invariant and the optimizer ---------------------------------------------------------------
@pytest.mark.parametrize("dtype, tol", [(F64, 1e-12), (torch.float32, 1e-6)])
def test_merge_rescale_keeps_the_effective_weight(dtype, tol):
    layer = ScaLoRALinear(nn.Linear(11, 7).to(dtype), 3, 6.0)
    with torch.no_grad():
        layer.scalora_B.normal_()
    before = effective_weight(layer)
    gen = torch.Generator().manual_seed(0)
    u, v = torch.rand(3, generator=gen, dtype=F64) * 3, torch.rand(3, generator=gen, dtype=F64) * 3
    merge_rescale_(layer, u, v)
    assert_close("W", before, effective_weight(layer), tol)
    assert not torch.equal(before, layer.base.weight)


@pytest.mark.parametrize("proxy", ["adam", "sgd"])
def test_every_merge_rescale_in_training_keeps_the_effective_weight(proxy):
    model = _mlp()
    opt = ScaLoRAOptimizer(model, torch.optim.AdamW(_trainable(model), lr=1e-2), proxy=proxy)
    x, y = _data()
    layers = dict(lora_layers(model))
    checked, moved = 0, 0
    inner = opt.merge_rescale

    def checked_merge_rescale():
        nonlocal checked, moved
        before = {n: (effective_weight(layer), layer.base.weight.clone()) for n, layer in layers.items()}
        inner()
        for n, layer in layers.items():
            assert_close(f"{n} W", before[n][0], effective_weight(layer), 1e-6)
            moved += int(not torch.equal(before[n][1], layer.base.weight))
        checked += 1

    opt.merge_rescale = checked_merge_rescale
    losses = _train(model, opt, x, y, 25)
    assert checked == 25 and moved >= 40  # the base really absorbs updates (not a no-op rescale)
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("every, nonneg", [(1, "nnls"), (3, "clamp")])
def test_optimizer_equals_dense_reference_with_sgd_momentum(every, nonneg):
    """ScaLoRAOptimizer(SGD with momentum) == the dense reference that forms G and solves with lstsq."""
    torch.manual_seed(1)
    base = nn.Linear(8, 6, bias=False).double()
    layer = ScaLoRALinear(base, 3, 6.0)
    model = nn.Sequential(layer)
    x, y = _data(n=20, d_in=8, d_out=6)
    ref = ReferenceScaLoRA(base.weight.detach(), layer.scalora_A.detach(), layer.scalora_B.detach(),
                           layer.scaling, lr=0.05, momentum=0.9, every=every, nonneg=nonneg)
    opt = ScaLoRAOptimizer(model, torch.optim.SGD(_trainable(model), lr=0.05, momentum=0.9), every=every,
                           nonneg=nonneg)
    for _ in range(9):
        _train(model, opt, x, y, 1)
        ref.step(lambda W: nn.functional.mse_loss(x @ W.T, y))
    assert opt.proxy == "sgd"
    assert_close("A", ref.A, layer.scalora_A, 1e-9)
    assert_close("B", ref.B, layer.scalora_B, 1e-9)
    assert_close("W0", ref.W0, layer.base.weight, 1e-9)


def test_unit_scale_bounds_reduce_exactly_to_lora():
    """scale_bounds=(1, 1) forces u = v = 1: bit-identical to LoRA + AdamW on a LoRALinear copy."""
    torch.manual_seed(0)
    lora_model = nn.Sequential(nn.Linear(9, 13), nn.Tanh(), nn.Linear(13, 6)).double()
    scalora_model = copy.deepcopy(lora_model)
    _inject(lora_model, ["0", "2"], layer=LoRALinear)
    _inject(scalora_model, ["0", "2"])
    for (_, a), (_, b) in zip(lora_layers(lora_model), lora_layers(scalora_model)):
        with torch.no_grad():
            for p, q in zip(lora_factors(a)[:2], lora_factors(b)[:2]):
                q.copy_(p)
    x, y = _data()
    plain = torch.optim.AdamW(_trainable(lora_model), lr=1e-2, weight_decay=0.01)
    wrapped = ScaLoRAOptimizer(scalora_model, torch.optim.AdamW(_trainable(scalora_model), lr=1e-2,
                                                                weight_decay=0.01), scale_bounds=(1.0, 1.0))
    _train(lora_model, plain, x, y, 10)
    _train(scalora_model, wrapped, x, y, 10)
    for p, q in zip(lora_model.parameters(), scalora_model.parameters()):
        assert torch.equal(p, q)


def test_equivariant_moments_leave_the_adam_step_in_factor_space_unchanged():
    """After a rescale with carried-over moments, Adam moves A~ and B~ exactly as it would have moved A and B
    (eps ~ 0): the gradient and both moments scale together. Resetting the moments breaks this."""
    model = _mlp()
    x, y = _data()
    opt = torch.optim.Adam(_trainable(model), lr=1e-2, eps=1e-30)
    _train(model, opt, x, y, 4)
    nn.functional.mse_loss(model(x), y).backward()

    def factor_step(rescale: str | None) -> list[torch.Tensor]:
        m = copy.deepcopy(model)
        o = torch.optim.Adam(_trainable(m), lr=1e-2, eps=1e-30)
        o.load_state_dict(copy.deepcopy(opt.state_dict()))
        for p, q in zip(_trainable(m), _trainable(model)):
            p.grad = q.grad.clone()
        wrapper = ScaLoRAOptimizer(m, o, moment_transfer=rescale or "equivariant", scale_bounds=(0.3, 3.0))
        if rescale is not None:
            wrapper.merge_rescale()
            assert any(bool((u != 1).any()) for u, _ in wrapper.last_multipliers.values())
        before = [p.detach().clone() for p in _trainable(m)]
        o.step()
        return [p.detach() - b for p, b in zip(_trainable(m), before)]

    plain = factor_step(None)
    for moved, expected in zip(factor_step("equivariant"), plain):
        assert_close("factor step", expected, moved, 1e-9)
    assert any((a - b).norm() > 1e-3 * b.norm() for a, b in zip(factor_step("reset"), plain))


def test_accumulated_update_is_high_rank_for_scalora_and_rank_r_for_lora():
    torch.manual_seed(0)
    d, r = 12, 2
    W0 = torch.randn(d, d, dtype=F64) / math.sqrt(d)
    target = W0 + torch.randn(d, d, dtype=F64) / math.sqrt(d)
    x = torch.randn(64, d, dtype=F64)
    ranks = {}
    for name, layer_type in (("lora", LoRALinear), ("scalora", ScaLoRALinear)):
        base = nn.Linear(d, d, bias=False).double()
        with torch.no_grad():
            base.weight.copy_(W0)
        model = nn.Sequential(layer_type(base, r, 2.0 * r))
        opt = torch.optim.AdamW(_trainable(model), lr=2e-2, weight_decay=0.0)
        if name == "scalora":
            opt = ScaLoRAOptimizer(model, opt)
        _train(model, opt, x, x @ target.T, 60)
        ranks[name] = effective_rank(effective_weight(model[0]) - W0)
    # LoRA's update B A is rank r; ScaLoRA's already exceeds r after 60 steps (the claim's "well above r" is
    # measured at experiment scale).
    assert ranks["lora"] <= r + 1e-9
    assert ranks["scalora"] > r + 0.5


# -- ReLoRA --------------------------------------------------------------------------------------------------------
def test_relora_restart_keeps_w_reinitialises_prunes_and_rewarms():
    model = _mlp()
    x, y = _data()
    inner = torch.optim.AdamW(_trainable(model), lr=1e-2)
    opt = ReLoRAOptimizer(model, inner, every=5, rewarmup_steps=4, prune_ratio=0.75, seed=3)
    _train(model, opt, x, y, 4)
    layers = dict(lora_layers(model))
    lrs = []
    original = inner.step

    def spy_step(*args, **kwargs):
        lrs.append(inner.param_groups[0]["lr"])
        return original(*args, **kwargs)

    inner.step = spy_step
    _train(model, opt, x, y, 1)  # the 5th step triggers the restart after the inner step
    assert opt.num_restarts == 1
    for n, layer in layers.items():
        A, B, _ = lora_factors(layer)
        # Re-initialised like LoRA: the base now holds the whole update and s B A = 0.
        assert torch.count_nonzero(B) == 0 and torch.count_nonzero(A) == A.numel()
        assert torch.equal(effective_weight(layer), layer.base.weight)
        for key in ("exp_avg", "exp_avg_sq"):
            state = inner.state[A][key]
            assert torch.count_nonzero(state) <= math.ceil(0.25 * state.numel())
    _train(model, opt, x, y, 5)
    assert lrs[0] == 1e-2 and [round(v / 1e-2, 6) for v in lrs[1:]] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert inner.param_groups[0]["lr"] == 1e-2


def test_merge_reinit_keeps_the_effective_weight():
    layer = ScaLoRALinear(nn.Linear(7, 5).double(), 2, 4.0)
    with torch.no_grad():
        layer.scalora_B.normal_()
    before = effective_weight(layer)
    merge_reinit_(layer, torch.Generator().manual_seed(0))
    assert_close("W", before, effective_weight(layer), 1e-12)
    assert torch.count_nonzero(layer.scalora_B) == 0


# -- configuration, state, integration ------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({"every": 0}, "every"), ({"every": 1.5}, "every"), ({"proxy": "newton"}, "proxy"), ({"nonneg": "abs"}, "nonneg"),
    ({"target_scale": 0.0}, "target_scale"), ({"scale_bounds": (0.0, 10.0)}, "scale_bounds"),
    ({"scale_bounds": (2.0, 10.0)}, "scale_bounds"), ({"scale_bounds": (0.1,)}, "scale_bounds"),
    ({"moment_transfer": "drop"}, "moment_transfer"), ({"ridge": -1.0}, "ridge"),
])
def test_bad_scalora_options_raise_value_error_naming_the_field(kwargs, field):
    model = _mlp()
    with pytest.raises(ValueError, match=field):
        ScaLoRAOptimizer(model, torch.optim.AdamW(_trainable(model)), **kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"every": 0}, "every"), ({"rewarmup_steps": -1}, "rewarmup_steps"), ({"prune_ratio": 1.5}, "prune_ratio"),
    ({"seed": -1}, "seed"),
])
def test_bad_relora_options_raise_value_error_naming_the_field(kwargs, field):
    model = _mlp()
    with pytest.raises(ValueError, match=field):
        ReLoRAOptimizer(model, torch.optim.AdamW(_trainable(model)), **kwargs)


def test_wrappers_reject_models_and_optimizers_that_do_not_fit():
    model = _mlp()
    with pytest.raises(ValueError, match="no LoRALinear"):
        ScaLoRAOptimizer(nn.Linear(3, 3), torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1))
    first = list(dict(lora_layers(model)).values())[0]
    with pytest.raises(ValueError, match="does not train the factors"):
        ScaLoRAOptimizer(model, torch.optim.AdamW(list(first.parameters())))
    with pytest.raises(ValueError, match="proxy='adam'"):
        ScaLoRAOptimizer(model, torch.optim.SGD(_trainable(model), lr=0.1), proxy="adam")
    with pytest.raises(ValueError, match="optimizer state entry"):
        opt = ScaLoRAOptimizer(model, torch.optim.Adadelta(_trainable(model)))
        _train(model, opt, *_data(), 2)


def test_state_dict_round_trip_resumes_identically():
    model = _mlp()
    x, y = _data()
    opt = ScaLoRAOptimizer(model, torch.optim.AdamW(_trainable(model), lr=1e-2), every=2)
    _train(model, opt, x, y, 3)
    clone = copy.deepcopy(model)
    resumed = ScaLoRAOptimizer(clone, torch.optim.AdamW(_trainable(clone), lr=1e-2), every=2)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert resumed.num_steps == 3 and resumed.num_rescales == 2
    _train(model, opt, x, y, 4)
    _train(clone, resumed, x, y, 4)
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    return model, lambda m: m(input_ids=ids, labels=ids).loss, ["q_proj", "v_proj"]


def _tiny_lm():
    from icml26.models.tiny_lm import TinyLM, TinyLMConfig

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16))
    ids = torch.randint(0, 256, (4, 13), generator=torch.Generator().manual_seed(1))
    return model, lambda m: m(ids[:, :-1], ids[:, 1:])[1], ["qkv_proj", "out_proj"]


@pytest.mark.parametrize("build, wrapper", [(_hf_llama, "scalora"), (_tiny_lm, "scalora"), (_tiny_lm, "relora")],
                         ids=["hf_llama-scalora", "tiny_lm-scalora", "tiny_lm-relora"])
def test_trains_real_models(build, wrapper):
    model, loss_fn, targets = build()
    names = _inject(model, targets, r=4)
    inner = torch.optim.AdamW(_trainable(model), lr=1e-2)
    opt = (ScaLoRAOptimizer(model, inner, every=2) if wrapper == "scalora"
           else ReLoRAOptimizer(model, inner, every=5, rewarmup_steps=2))
    losses = []
    for _ in range(10):
        loss = loss_fn(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert len(names) >= 4 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]


def test_teacher_student_claim_runs_at_smoke_tier(tmp_path):
    """The room is still 'planned' in the registry, so tests/claims does not run its specs yet; this one does."""
    from icml26.harness.runner import run_spec
    from icml26.methods.scalora.experiments import SPECS

    spec = next(s for s in SPECS if s.id == "teacher_student")
    result = run_spec(spec, "smoke", tmp_path)
    assert result["status"] == "complete" and result["verdict"] == "inconclusive"
    assert set(result["arms"]) == set(spec.arms)
    assert all(math.isfinite(result["arms"][arm]["final_val_loss"]["mean"]) for arm in spec.arms)
    assert result["arms"]["lora"]["erank_mean"]["mean"] <= 4 + 1e-6
    assert (tmp_path / "scalora" / "teacher_student.png").exists()
    assert {c["name"] for c in result["mechanism_checks"]} >= {"erank_scalora_over_r", "tuned_inside_grid"}


@pytest.mark.parametrize("spec_id", ["teacher_student", "teacher_student_vs_relora", "mlp_digits_rotated",
                                     "mlp_digits_rotated_vs_relora", "smollm2_folio"])
def test_null_arm_scalora_switched_back_to_its_baseline_fails_the_comparator(spec_id):
    """ScaLoRA's arm built as the spec's baseline (same seed, same rate): the statistic is exactly 0, rejected."""
    from icml26.methods.scalora.experiments import SPECS, run_seed

    spec = next(s for s in SPECS if s.id == spec_id)
    config = dict(spec.tiers["smoke"], as_baseline={"scalora": spec.baseline})
    lr = 1e-3  # a rate at which ReLoRA's 30 smoke steps end below its start (so its race is defined)
    prepared = {"tuning": {"lr": {"chosen": {a: lr for a in config["arms"]}},
                           "proxy": {"chosen": {"scalora": "adam"}}}}
    value = run_seed(config, 0, prepared)["statistics"][spec.comparator.statistic]
    assert value == pytest.approx(spec.null_value)
    assert not spec.comparator.holds(value)


def test_default_proxy_and_its_name_share_one_training():
    """The lr tuning trains ScaLoRA with the default proxy (proxy=None) and the proxy list names it again ("adam"):
    both are one memoised run, and training "adam" from scratch gives the same curve (so reusing it changes no
    number). Arms without a proxy ignore the argument."""
    from icml26.methods.scalora import experiments

    config = dict(next(s for s in experiments.SPECS if s.id == "teacher_student").tiers["smoke"])
    lr = config["lr_centers"]["scalora"]
    by_default = experiments.train_arm("scalora", config, 7, lr)
    assert experiments.train_arm("scalora", config, 7, lr, experiments.DEFAULT_PROXY) is by_default
    assert experiments.train_arm("lora", config, 7, lr, "sgd") is experiments.train_arm("lora", config, 7, lr)
    saved = dict(experiments._RUNS)
    experiments._RUNS.clear()
    try:
        fresh = experiments.train_arm("scalora", config, 7, lr, experiments.DEFAULT_PROXY)
    finally:
        experiments._RUNS.clear()
        experiments._RUNS.update(saved)
    assert fresh["curve"] == by_default["curve"]
