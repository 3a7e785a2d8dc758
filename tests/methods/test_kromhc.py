"""KromHC and the hyper-connection family: fast path == reference, exact double stochasticity, Kronecker structure,
parameter counts, refusals, initialisation, reduction to the plain residual, and the TinyLM plug."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from icml26.core.testing import assert_close
from icml26.methods.kromhc import (HC, MHC, HyperConnectionConfig, HyperResidual, KromHC, MHCLite, composite,
                                   doubly_stochastic_error, hyper_connection, mixing_report, parameter_count,
                                   record_mixing, sinkhorn_log)
from icml26.methods.kromhc.fast import DepthConnection, NormedProjection, StreamMix
from icml26.methods.kromhc.reference import reference_coefficients, reference_forward, sinkhorn_plain, use_reference
from icml26.models.tiny_lm import PlainResidual, TinyLM, TinyLMConfig


def _randomize(module: nn.Module, scale: float, seed: int = 0) -> nn.Module:
    """Move every parameter off its initial value (zero-init projections would hide most of the math)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return module


def _stream(*shape: int, dtype=torch.float64, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=dtype)


CASES = [("hc", 3), ("mhc", 3), ("mhc_lite", 3), ("mhc_lite", 4), ("kromhc", 2), ("kromhc", 4), ("kromhc", 8)]


# -- fast path == reference ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, n", CASES)
def test_fast_layer_matches_reference_outputs_and_gradients(kind, n):
    dim = 7  # odd width, odd batch and time: (3, 5, n, 7)
    branch = nn.Sequential(nn.Linear(dim, dim), nn.Tanh()).double()
    layer = _randomize(hyper_connection(kind, n, dim, branch, home_stream=n - 1).double(), 0.5)
    x = _stream(3, 5, n, dim).requires_grad_()
    out = layer(x)
    grad_out = _stream(*out.shape, seed=2)
    inputs = [x, *layer.parameters()]
    grads = torch.autograd.grad(out, inputs, grad_out)
    ref = reference_forward(layer, x)
    ref_grads = torch.autograd.grad(ref, inputs, grad_out)
    assert_close("output", ref, out, 1e-12)
    names = ["x", *(name for name, _ in layer.named_parameters())]
    for name, r, g in zip(names, ref_grads, grads):
        assert_close(f"grad {name}", r, g, 1e-10)


@pytest.mark.parametrize("kind, n", [("mhc", 4), ("kromhc", 4)])
def test_fast_layer_matches_reference_in_float32(kind, n):
    layer = _randomize(hyper_connection(kind, n, 6, nn.Linear(6, 6)), 0.3)
    x = _stream(2, 3, n, 6, dtype=torch.float32).requires_grad_()
    out, ref = layer(x), reference_forward(layer, x)
    assert_close("output", ref, out, 1e-5)
    g, g_ref = torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(ref.sum(), x)[0]
    assert_close("grad x", g_ref, g, 1e-5)


def test_custom_autograd_functions_pass_gradcheck():
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    assert torch.autograd.gradcheck(NormedProjection.apply, (leaf(5, 9), leaf(9), leaf(9, 4)))
    assert torch.autograd.gradcheck(StreamMix.apply, (leaf(3, 4, 5), leaf(3, 4, 5)))
    assert torch.autograd.gradcheck(DepthConnection.apply, (leaf(3, 4, 5), leaf(3, 4), leaf(3, 5)))


def test_tiny_lm_fast_path_matches_reference_model():
    config = TinyLMConfig(d_model=16, n_layers=2, n_heads=2, max_seq_len=16)
    torch.manual_seed(0)
    model = _randomize(TinyLM(config, residual=HyperResidual(4, 16, kind="kromhc")).double(), 0.05)
    idx, tgt = torch.randint(0, 256, (2, 5)), torch.randint(0, 256, (2, 5))
    logits, loss = model(idx, tgt)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    with use_reference(model):
        ref_logits, ref_loss = model(idx, tgt)
        ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()))
    assert_close("logits", ref_logits, logits, 1e-12)
    for (name, _), r, g in zip(model.named_parameters(), ref_grads, grads):
        assert_close(name, r, g, 1e-10, atol=1e-14)


# -- Sinkhorn (mHC) ------------------------------------------------------------------------------------------------
def test_log_domain_sinkhorn_equals_plain_loop_rows_exact_columns_approximate():
    logits = _stream(64, 4, 4) * 3
    fast = sinkhorn_log(logits, 20)
    plain = torch.stack([sinkhorn_plain(m, 20) for m in logits])
    assert_close("sinkhorn", plain, fast, 1e-12)
    assert (fast.sum(-1) - 1).abs().max() < 1e-12
    errors = [float((sinkhorn_log(logits, t).sum(-2) - 1).abs().max()) for t in (1, 3, 10, 20)]
    assert errors[0] > errors[1] > errors[2] > errors[3] > 0  # columns converge but are never exact


# -- KromHC: double stochasticity and structure --------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_kromhc_residual_matrices_are_doubly_stochastic_in_float32(n):
    layer = _randomize(KromHC(n, 8, nn.Identity()), 3.0)  # large logits: factors far from the identity
    with torch.no_grad():
        layer.residual_scale.fill_(5.0)
        h = layer.coefficients(_stream(4, 9, n, 8, dtype=torch.float32) * 10)[1]
    assert h.dtype == torch.float32
    assert doubly_stochastic_error(h) < 1e-6 and h.min() >= 0
    assert torch.linalg.matrix_norm(h, ord=2).max() <= 1 + 1e-6
    assert (h - torch.eye(n)).abs().max() > 0.1  # genuinely mixing, not a trivial pass


@pytest.mark.parametrize("n", [4, 16])
def test_products_of_kromhc_matrices_over_layers_stay_doubly_stochastic_in_float32(n):
    config = TinyLMConfig(d_model=8, n_layers=12, n_heads=2, max_seq_len=16, mlp_hidden=8)
    torch.manual_seed(0)
    model = TinyLM(config, residual=HyperResidual(n, 8, kind="kromhc"))
    for layer in model.modules():
        if isinstance(layer, KromHC):
            _randomize(layer, 2.0, seed=layer.home_stream)
    with torch.no_grad(), record_mixing(model) as records:
        model(torch.randint(0, 256, (2, 7)))
    mats = [r["h_res"] for r in records]
    assert len(mats) == 24 and all(m.dtype == torch.float32 for m in mats)
    assert max(doubly_stochastic_error(m) for m in mats) < 1e-6
    for depth in range(2, 25):
        assert doubly_stochastic_error(composite(mats[:depth])) < 1e-6
    report = mixing_report(records)
    assert report["ds_error_composite"] < 1e-6 and abs(report["amax_gain_composite"] - 1) < 1e-6


@pytest.mark.parametrize("n", [2, 4, 8])
def test_kromhc_equals_kronecker_product_of_its_2x2_factors(n):
    layer = _randomize(KromHC(n, 5, nn.Identity()), 1.0)
    stream = _stream(2, 3, n, 5, dtype=torch.float32)
    with torch.no_grad():
        factors = layer.factors(stream)
        h = layer.coefficients(stream)[1]
    assert factors.shape == (2, 3, int(math.log2(n)), 2, 2)
    p = factors[..., 0, 0]
    assert torch.equal(factors[..., 1, 1], p) and torch.equal(factors[..., 0, 1], 1 - p)
    assert torch.equal(factors[..., 1, 0], 1 - p)
    for i in range(2):
        for t in range(3):
            expected = factors[i, t, 0]
            for k in range(1, factors.shape[2]):
                expected = torch.kron(expected, factors[i, t, k])
            assert_close("kron", expected, h[i, t], 1e-7)


def test_kromhc_with_two_streams_equals_mhc_lite_with_the_same_parameters():
    krom = _randomize(KromHC(2, 6, nn.Linear(6, 6)), 0.7)
    lite = MHCLite(2, 6, krom.branch)
    lite.load_state_dict(krom.state_dict())  # same names and shapes: both are convex combinations of I and swap
    x = _stream(3, 4, 2, 6, dtype=torch.float32)
    assert_close("n=2", lite(x), krom(x), 1e-6)


def test_mhc_lite_is_exact_and_mhc_is_only_approximately_doubly_stochastic():
    x = _stream(8, 4, 4, 6, dtype=torch.float32)
    with torch.no_grad():
        lite = _randomize(MHCLite(4, 6), 2.0).coefficients(x)[1]
        mhc = _randomize(MHC(4, 6), 2.0).coefficients(x)[1]
    assert doubly_stochastic_error(lite) < 1e-6
    assert (mhc.sum(-1) - 1).abs().max() < 1e-6 and (mhc.sum(-2) - 1).abs().max() > 1e-6


# -- parameter counts and refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 8, 16])
@pytest.mark.parametrize("kind", ["hc", "mhc", "mhc_lite", "kromhc"])
def test_parameter_counts_match_the_formulas(kind, n):
    dim = 12
    if kind == "mhc_lite" and n > 7:  # refused (see below); the formula still gives the count it would have
        with pytest.raises(ValueError, match="infeasible"):
            hyper_connection(kind, n, dim)
    else:
        layer = hyper_connection(kind, n, dim)
        assert sum(p.numel() for p in layer.parameters()) == parameter_count(kind, n, dim)
    k = int(math.log2(n))
    closed_form = {"hc": dim * (n + 3) + n * (n + 2) + 2, "mhc": n * dim * (n + 1) ** 2 + (n + 1) ** 2 + 2,
                   "mhc_lite": n * dim * (2 * n + 1 + math.factorial(n)) + 2 * n + math.factorial(n) + 3,
                   "kromhc": n * dim * (2 * n + 1 + 2 * k) + 2 * n + 2 * k + 3}[kind]
    assert parameter_count(kind, n, dim) == closed_form


def test_kromhc_needs_fewer_residual_parameters_than_mhc_and_mhc_lite():
    for n in (4, 8, 16):
        assert parameter_count("kromhc", n, 512) < parameter_count("mhc", n, 512)
    assert parameter_count("kromhc", 4, 512) < parameter_count("mhc_lite", 4, 512)
    # The research note's dynamic-projection counts at C = 512: 24,576 (KromHC) vs 49,152 (mHC) at n = 4.
    assert parameter_count("kromhc", 4, 512) - (4 * 512 + 4 + 4 + 4 + 3) == 24_576
    assert parameter_count("mhc", 4, 512) - (4 * 512 + 20 + 4 + 3) == 49_152


@pytest.mark.parametrize("n", [3, 5, 6, 12])
def test_kromhc_rejects_stream_counts_that_are_not_powers_of_two(n):
    for build in (lambda: KromHC(n, 8), lambda: HyperResidual(n, 8, kind="kromhc"),
                  lambda: HyperConnectionConfig(kind="kromhc", num_streams=n)):
        with pytest.raises(ValueError, match=r"num_streams must be a power of two for KromHC.*got " + str(n)):
            build()


@pytest.mark.parametrize("n", [8, 16])
def test_mhc_lite_refuses_infeasible_stream_counts(n):
    for build in (lambda: MHCLite(n, 8), lambda: HyperResidual(n, 8, kind="mhc_lite"),
                  lambda: HyperConnectionConfig(kind="mhc_lite", num_streams=n)):
        with pytest.raises(ValueError, match=rf"num_streams={n} is infeasible for mHC-lite.*n! = [\d,]+ .*KromHC"):
            build()
    assert MHCLite(8, 4, max_permutations=40_320).dynamic_alpha_fn.shape == (32, 8 + 40_320)


# -- initialisation ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer_cls", [MHC, MHCLite, KromHC])
def test_constrained_variants_start_near_identity_with_official_gates(layer_cls):
    layer = layer_cls(4, 6, home_stream=2)
    h_pre, h_res, h_post = layer.coefficients(_stream(3, 4, 6, dtype=torch.float32))
    home = torch.tensor([False, False, True, False])
    s1, sm1 = torch.sigmoid(torch.tensor(1.0)), torch.sigmoid(torch.tensor(-1.0))
    assert torch.allclose(h_pre[..., home], s1) and torch.allclose(h_pre[..., ~home], sm1)
    assert torch.allclose(h_post[..., home], 2 * s1) and torch.allclose(h_post[..., ~home], 2 * sm1)
    # Every non-identity term starts with weight ~ e^-8 = 3.4e-4: n - 1 per row for mHC, n! - 1 for mHC-lite,
    # and 1 - p^K for KromHC's K factors.
    bound = {MHC: 3 * 3.4e-4, MHCLite: 23 * 3.4e-4, KromHC: 2 * 3.4e-4}[layer_cls]
    assert (h_res - torch.eye(4)).abs().max() < bound * 1.01
    if layer_cls is KromHC:  # each 2x2 factor's swap weight is softmax((0, -8))[1] = sigmoid(-8) ~ 3.4e-4
        q = torch.sigmoid(torch.tensor(-8.0))
        assert torch.allclose(layer.factors(_stream(1, 4, 6, dtype=torch.float32))[..., 0, 1], q, rtol=1e-3)


def test_hc_starts_as_identity_mixing_with_one_hot_pre_and_unit_post():
    layer = HC(4, 6, home_stream=1)
    h_pre, h_res, h_post = layer.coefficients(_stream(3, 4, 6, dtype=torch.float32))
    assert torch.equal(h_pre, torch.tensor([0.0, 1.0, 0.0, 0.0]).expand(3, 4))
    assert torch.equal(h_res, torch.eye(4).expand(3, 4, 4)) and torch.equal(h_post, torch.ones(3, 4))


# -- reduction to the plain residual and the TinyLM plug -----------------------------------------------------------
def _lm(residual, seed: int = 0, norm_eps: float = 1e-6) -> TinyLM:
    torch.manual_seed(seed)
    config = TinyLMConfig(d_model=16, n_layers=2, n_heads=2, max_seq_len=32, norm_eps=norm_eps)
    return TinyLM(config, residual=residual)


@pytest.mark.parametrize("residual", [HyperResidual(4, 16, kind="kromhc", disable=True),
                                      HyperResidual(4, 16, kind="residual"), HyperResidual(1, 16, kind="mhc")],
                         ids=["disable", "kind_residual", "one_stream"])
def test_switch_reduces_exactly_to_the_plain_residual(residual):
    plain, switched = _lm(PlainResidual()), _lm(residual)
    assert switched.state_dict().keys() == plain.state_dict().keys()
    idx, tgt = torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 9))
    (logits_p, loss_p), (logits_s, loss_s) = plain(idx, tgt), switched(idx, tgt)
    assert torch.equal(logits_p, logits_s)
    loss_p.backward()
    loss_s.backward()
    for p, s in zip(plain.parameters(), switched.parameters()):
        assert torch.equal(p.grad, s.grad)


def test_hc_at_initialisation_computes_the_plain_residual_function():
    # All streams start equal, H_res = I, H_pre = e_k0 and H_post = 1 keep them equal; the final RMSNorm removes the
    # factor n of the stream sum (exactly so with a negligible norm eps). So HC at init is the plain model.
    plain, hc = _lm(PlainResidual(), norm_eps=1e-12), _lm(HyperResidual(4, 16, kind="hc"), norm_eps=1e-12)
    idx = torch.randint(0, 256, (2, 9))
    assert_close("logits", plain(idx)[0], hc(idx)[0], 1e-5)


def test_residual_wrappers_do_not_touch_the_global_rng_so_base_weights_agree():
    base = _lm(PlainResidual()).state_dict()
    for kind in ("hc", "mhc", "mhc_lite", "kromhc"):
        state = _lm(HyperResidual(4, 16, kind=kind)).state_dict()
        for name, value in base.items():
            assert torch.equal(state[name], value), (kind, name)


def test_home_streams_cyclic_and_seeded_random():
    cyclic = HyperResidual(4, 8, home_stream="cyclic")
    assert [cyclic.home_stream(layer, kind) for layer in range(3) for kind in ("attn", "mlp")] == [0, 1, 2, 3, 0, 1]
    a, b = HyperResidual(4, 8, seed=3), HyperResidual(4, 8, seed=3)
    draws = [a.home_stream(layer, "mlp") for layer in range(16)]
    assert draws == [b.home_stream(layer, "mlp") for layer in range(16)] and len(set(draws)) > 1


@pytest.mark.parametrize("kind", ["hc", "kromhc"])
def test_tiny_lm_with_hyper_connections_generates_with_cache_and_round_trips(kind):
    model = _randomize(_lm(HyperResidual(4, 16, kind=kind)), 0.02)
    prompt = torch.randint(0, 256, (2, 4))
    cached = model.generate(prompt, 6, temperature=0)
    assert torch.equal(cached, model.generate(prompt, 6, temperature=0, use_cache=False))
    clone = _lm(HyperResidual(4, 16, kind=kind), seed=1)
    clone.load_state_dict(model.state_dict())
    assert torch.equal(clone(prompt)[0], model(prompt)[0])


def test_lucidrains_style_branchless_call_returns_input_and_adder():
    layer = _randomize(KromHC(4, 6), 0.3)
    branch = nn.Linear(6, 6)
    layer_with_branch = KromHC(4, 6, branch)
    layer_with_branch.load_state_dict(layer.state_dict(), strict=False)
    x = _stream(2, 3, 4, 6, dtype=torch.float32)
    branch_input, add_residual = layer(x)
    assert branch_input.shape == (2, 3, 6)
    assert torch.equal(add_residual(branch(branch_input)), layer_with_branch(x))


def test_reference_coefficients_agree_with_layer_coefficients():
    layer = _randomize(MHC(3, 5), 0.8).double()
    x = _stream(2, 2, 3, 5)
    for fast, ref in zip(layer.coefficients(x), reference_coefficients(layer, x)):
        assert_close("coefficient", ref, fast, 1e-12)


# -- configuration -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({"kind": "xhc"}, "kind"), ({"num_streams": 0}, "num_streams"), ({"num_streams": 2.0}, "num_streams"),
    ({"sinkhorn_iters": 0}, "sinkhorn_iters"), ({"scale_init": float("nan")}, "scale_init"),
    ({"res_logit_gap": -1.0}, "res_logit_gap"), ({"hc_tanh": 1}, "hc_tanh"), ({"home_stream": "first"}, "home_stream"),
    ({"seed": -1}, "seed"), ({"max_permutations": 1}, "max_permutations"),
])
def test_bad_config_values_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        HyperConnectionConfig(**kwargs)


def test_config_builds_the_residual_and_marks_the_plain_cases():
    config = HyperConnectionConfig(kind="mhc", num_streams=4, sinkhorn_iters=7, home_stream="cyclic")
    residual = HyperResidual.from_config(config, 16)
    layer = residual.wrap(nn.Identity(), 1, "mlp")
    assert isinstance(layer, MHC) and layer.sinkhorn_iters == 7 and layer.home_stream == 3
    assert HyperConnectionConfig(kind="residual").disabled and HyperConnectionConfig(num_streams=1).disabled
    assert not HyperConnectionConfig().disabled


def test_layer_rejects_bad_shapes_and_home_streams():
    with pytest.raises(ValueError, match="home_stream"):
        KromHC(4, 6, home_stream=4)
    with pytest.raises(ValueError, match="stream must have shape"):
        KromHC(4, 6, nn.Identity())(torch.zeros(2, 3, 6))


def _micro(spec):
    return {**spec.tiers["smoke"], "steps": 2, "eval_every": 1, "n_val_batches": 1, "seq_len": 16}


def _fixed_lrs(spec, lr=1e-2):
    return {"tuning": {"chosen": {arm: lr for arm in spec.arms}, "on_edge": []}}


@pytest.mark.parametrize("index", [0, 1])
def test_claim_runs_end_to_end_on_a_micro_config(index):
    from icml26.methods.kromhc.experiments import SPECS

    spec = SPECS[index]
    result = spec.run(_micro(spec), 0, _fixed_lrs(spec))
    assert set(result["arms"]) == set(spec.arms)
    for arm, metrics in result["arms"].items():
        assert metrics["extra_params"] == metrics["extra_params_formula"], arm
        assert math.isfinite(metrics["final_val_loss"])
    assert result["checks"]["kromhc_ds_error"] < 1e-6 and result["checks"]["param_ratio"] < 1
    assert math.isfinite(result["statistics"]["retained_gain"])


@pytest.mark.parametrize("index", [0, 1])
def test_null_arm_kromhc_switched_off_fails_the_comparator(index):
    """KromHC replaced by the plain residual (its mechanism switched off): retained_gain = -max(g_B, 0)/2 <= 0."""
    from icml26.methods.kromhc.experiments import SPECS, seed_result

    spec = SPECS[index]
    result = seed_result(_micro(spec), 0, _fixed_lrs(spec), spec.baseline, method_kind="residual")
    value = result["statistics"]["retained_gain"]
    assert result["statistics"]["gain_kromhc_vs_residual"] == 0.0
    assert value <= 0 and not spec.comparator.holds(value)
    assert not spec.comparator.holds(spec.null_value)
    assert result["checks"]["kromhc_mixing_learned"] == 0.0  # and the mechanism check would flag it


def test_tuning_gives_every_arm_the_same_grid(monkeypatch):
    from icml26.methods.kromhc import experiments

    seen = {}
    monkeypatch.setattr(experiments, "train_arm",
                        lambda arm, config, seed, lr: seen.setdefault(arm, []).append((seed, lr)) or
                        {"final_val_loss": (math.log(lr) - math.log(config["lr_center"])) ** 2})
    out = experiments.prepare(experiments.TIERS["quick"], "mhc_lite")
    assert set(seen) == {"kromhc", "mhc_lite", "residual"}
    assert len({tuple(v) for v in seen.values()}) == 1 and all(s >= 1000 for v in seen.values() for s, _ in v)
    assert out["tuning"]["on_edge"] == []
