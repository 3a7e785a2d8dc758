"""lockin: matrix-free curvature (HVP, Fisher products, Lanczos) == explicit dense Hessian/Fisher on odd shapes,
subspace probes == explicit projectors, the probe's Taylor terms, the stabilisers' exact reductions to plain,
the projection invariant, state_dict round trips, the matched-spread statistics and config validation."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from icml26.core.testing import assert_close, tiny_tensor, tiny_tokens
from icml26.methods.lockin import (LockInConfig, LockInProbe, StabilisedFineTuner, first_crossing,
                                   fisher_top_directions, fisher_vp, fit_degradation_curve, hvp, lanczos_top_eigs,
                                   matched_spread, per_example_grads, principal_angles, project_out, subspace_overlap,
                                   top_subspace)
from icml26.methods.lockin import reference as ref
from icml26.methods.lockin.experiments import TIERS, claim_statistics, train_arm
from icml26.methods.lockin.geometry import flatten, split_examples
from icml26.models.tiny_lm import TinyLM, TinyLMConfig


pytestmark = pytest.mark.usefixtures("one_thread")


def mse_loss(model, batch):
    return (model(batch[0]) - batch[1]).pow(2).mean()


def lm_loss(model, batch):
    return model(batch[0], batch[1])[1]


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()  # P = 32


def _mlp_batch(n: int = 7, seed: int = 1):
    return tiny_tensor(n, 3, seed=seed, dtype=torch.float64), tiny_tensor(n, 2, seed=seed + 1, dtype=torch.float64)


def _tiny_lm(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(TinyLMConfig(vocab_size=11, d_model=8, n_layers=1, n_heads=2, max_seq_len=8, mlp_hidden=6)).double()


def _lm_batch(n: int = 3, t: int = 5, seed: int = 2):
    tok = tiny_tokens(n, t + 1, 11, seed=seed)
    return tok[:, :-1], tok[:, 1:]


# TinyLM's RMSNorm and RoPE tables compute in float32 even for a float64 model: float32-level tolerance there.
CASES = [("mlp", _mlp, _mlp_batch, mse_loss, 1e-9), ("tiny_lm", _tiny_lm, _lm_batch, lm_loss, 2e-5)]


# ------------------------------------------------------------------------------------------ curvature parity
@pytest.mark.parametrize("name,make,batch,loss,tol", CASES, ids=[c[0] for c in CASES])
def test_hvp_equals_dense_hessian_products(name, make, batch, loss, tol):
    model, b = make(), batch()
    params = list(model.parameters())
    dense = ref.dense_hessian(model, loss, b)
    p = dense.shape[0]
    assert_close("H symmetric", dense, dense.T, tol)
    vs = tiny_tensor(3, p, seed=5, dtype=torch.float64)
    value, grad, hv = hvp(model, loss, b, params, vs)
    assert_close("Hv", vs @ dense, hv, tol)
    model.zero_grad()
    loss(model, b).backward()
    assert_close("grad", flatten([q.grad for q in params]), grad, 1e-12)
    assert math.isclose(value, float(loss(model, b).detach()), rel_tol=1e-12)


@pytest.mark.parametrize("name,make,batch,loss,tol", CASES, ids=[c[0] for c in CASES])
def test_fisher_products_and_top_directions_equal_dense(name, make, batch, loss, tol):
    model, b = make(), batch()
    params = list(model.parameters())
    grads = per_example_grads(model, loss, b, params)
    assert_close("per-example grads", ref.dense_gradient_rows(model, loss, split_examples(b)), grads, 1e-12)
    dense = ref.dense_fisher(grads)
    v = tiny_tensor(2, grads.shape[1], seed=8, dtype=torch.float64)
    assert_close("Fv", v @ dense, fisher_vp(grads, v), 1e-10)
    k = 2
    evals, u = fisher_top_directions(grads, k)
    d_evals, d_u = ref.top_eigs_dense(dense, k)
    assert_close("fisher eigenvalues", d_evals, evals, 1e-8)
    assert subspace_overlap(d_u, u) == pytest.approx(1.0, abs=1e-8)


def test_lanczos_top_eigs_equal_dense_eigendecomposition_of_the_tiny_lm_hessian():
    model, b = _tiny_lm(), _lm_batch()
    params = list(model.parameters())
    dense = ref.dense_hessian(model, lm_loss, b)
    p = dense.shape[0]
    k = 3
    evals, u = lanczos_top_eigs(lambda v: hvp(model, lm_loss, b, params, v)[2], p, k, iters=60,
                                generator=torch.Generator().manual_seed(0))
    d_evals, d_u = ref.top_eigs_dense(dense, k)
    assert_close("eigenvalues", d_evals, evals, 2e-5)
    assert subspace_overlap(d_u, u) == pytest.approx(1.0, abs=1e-4)
    assert_close("orthonormal", torch.eye(k, dtype=u.dtype), u.T @ u, 1e-10, atol=1e-10)


# -------------------------------------------------------------------------------------------- subspace parity
@pytest.mark.parametrize("p,q1,q2", [(37, 3, 3), (37, 3, 5), (11, 1, 4)])
def test_overlap_and_principal_angles_equal_projector_versions(p, q1, q2):
    u = torch.linalg.qr(tiny_tensor(p, q1, seed=1, dtype=torch.float64))[0]
    # V shares part of U's span so that angles are spread over (0, pi/2)
    mix = torch.cat([u[:, :1] + 0.3 * tiny_tensor(p, 1, seed=2, dtype=torch.float64),
                     tiny_tensor(p, q2 - 1, seed=3, dtype=torch.float64)], dim=1)
    v = torch.linalg.qr(mix)[0]
    if q1 == q2:
        assert subspace_overlap(u, v) == pytest.approx(ref.overlap_dense(u, v), abs=1e-12)
    assert_close("angles", ref.principal_angles_dense(u, v), principal_angles(u, v), 1e-6, atol=1e-6)
    assert subspace_overlap(u, u) == pytest.approx(1.0, abs=1e-12)
    assert float(principal_angles(u, u).max()) < 1e-6


def test_top_subspace_spans_the_updates_and_project_out_equals_dense_projector():
    updates = tiny_tensor(23, 2, seed=4, dtype=torch.float64) @ tiny_tensor(2, 6, seed=5, dtype=torch.float64)
    u = top_subspace(updates, 2)  # rank-2 updates: their top-2 subspace reproduces them exactly
    assert_close("span", updates, u @ (u.T @ updates), 1e-10)
    basis = torch.linalg.qr(tiny_tensor(23, 4, seed=6, dtype=torch.float64))[0]
    delta = tiny_tensor(23, seed=7, dtype=torch.float64)
    out = project_out(delta, basis)
    assert_close("projection", ref.project_out_dense(delta, basis), out, 1e-12)
    assert float((basis.T @ out).abs().max()) < 1e-12


# ------------------------------------------------------------------------------------------------------ probe
@pytest.mark.parametrize("curvature", ["hessian", "fisher"])
def test_probe_taylor_terms_equal_dense_formulas_at_theta_prev(curvature):
    model, b = _mlp(), _mlp_batch()
    probe = LockInProbe(model, mse_loss, mse_loss, LockInConfig(q=1, window=2, curvature=curvature))
    probe.observe(0, model, b, b)
    theta_prev = flatten(model.parameters()).clone()
    prev_model = copy.deepcopy(model)
    with torch.no_grad():
        for p, d in zip(model.parameters(), tiny_tensor(32, seed=9, dtype=torch.float64, scale=0.05).split(
                [p.numel() for p in model.parameters()])):
            p.add_(d.view_as(p))
    rec = probe.observe(1, model, b, b)
    v = flatten(model.parameters()) - theta_prev
    prev_model.zero_grad()
    mse_loss(prev_model, b).backward()
    g = flatten([p.grad for p in prev_model.parameters()])
    if curvature == "hessian":
        c = ref.dense_hessian(prev_model, mse_loss, b)
    else:
        c = ref.dense_fisher(ref.dense_gradient_rows(prev_model, mse_loss, split_examples(b)))
    first, second = ref.taylor_change_dense(g, c, v)
    assert rec["harm_first_order"] == pytest.approx(first, rel=1e-9)
    assert rec["harm_second_order"] == pytest.approx(second, rel=1e-9)
    assert rec["harm_rayleigh"] == pytest.approx(2 * second / float(v @ v), rel=1e-9)
    assert rec["drift"] == pytest.approx(float(v.norm()), rel=1e-12)
    # the probe restored theta_t after evaluating at theta_prev
    assert torch.equal(flatten(model.parameters()), theta_prev + v)


def test_probe_second_order_prediction_is_exact_on_a_quadratic_loss():
    model = nn.Linear(4, 1, bias=False).double()
    a = tiny_tensor(9, 4, seed=3, dtype=torch.float64)

    def quad(m, batch):
        return 0.5 * m(batch[0]).pow(2).mean() + m.weight.sum()

    probe = LockInProbe(model, quad, quad, LockInConfig(q=1, window=3))
    probe.observe(0, model, (a,), (a,))
    with torch.no_grad():
        model.weight.add_(tiny_tensor(1, 4, seed=4, dtype=torch.float64))
    rec = probe.observe(1, model, (a,), (a,))
    assert rec["harm_first_order"] + rec["harm_second_order"] == pytest.approx(rec["broad_change"], rel=1e-10)


def test_probe_subspace_overlap_detects_lock_in():
    """Updates confined to one fixed 2-D plane give overlap 1 between windows; fresh random updates do not."""
    def run(locked: bool) -> list[float]:
        model = nn.Linear(40, 5).double()  # P = 205
        probe = LockInProbe(model, lambda m, b: m(b[0]).sum(), lambda m, b: m(b[0]).pow(2).mean(),
                            LockInConfig(q=2, window=4))
        x = (tiny_tensor(3, 40, seed=1, dtype=torch.float64),)
        plane = tiny_tensor(2, 205, seed=2, dtype=torch.float64)
        for step in range(13):
            probe.observe(step, model, x, x)
            coeff = tiny_tensor(2, seed=100 + step, dtype=torch.float64)
            d = coeff @ plane if locked else tiny_tensor(205, seed=200 + step, dtype=torch.float64)
            with torch.no_grad():
                for p, c in zip(model.parameters(), d.split([p.numel() for p in model.parameters()])):
                    p.add_(0.01 * c.view_as(p))
        return [v for _, v in probe.series("overlap")]

    locked, free = run(True), run(False)
    assert len(locked) == 2 and min(locked) == pytest.approx(1.0, abs=1e-9)
    assert max(free) < 0.3


def test_probe_state_dict_round_trip_continues_identically():
    model, b = _mlp(), _mlp_batch()
    cfg = LockInConfig(q=1, window=2)
    probe = LockInProbe(model, mse_loss, mse_loss, cfg)

    def nudge(step):
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.add_(0.01 * tiny_tensor(*p.shape, seed=10 * step + i, dtype=torch.float64))

    for step in range(4):  # saved mid-window: one update buffered, one subspace stored
        probe.observe(step, model, b, b)
        nudge(step)
    resumed = LockInProbe(model, mse_loss, mse_loss, cfg)
    resumed.load_state_dict(copy.deepcopy(probe.state_dict()))
    r1, r2 = probe.observe(4, model, b, b), resumed.observe(4, model, b, b)
    assert r1 == r2 and "overlap" in r1


# ---------------------------------------------------------------------------------------------------- trainer
def _train(cfg: LockInConfig, steps: int = 6, seed: int = 0):
    model = _tiny_lm(seed)
    trainer = StabilisedFineTuner(model, lm_loss, cfg, broad_loss=lm_loss, broad_batch=_lm_batch(6, seed=11))
    for s in range(steps):
        trainer.step(_lm_batch(4, seed=100 + s))
    return model, trainer


@pytest.mark.parametrize("neutral", [dict(stabiliser="low_lr", low_lr_factor=1.0), dict(stabiliser="l2sp", l2sp=0.0),
                                     dict(stabiliser="ewc", ewc=0.0), dict(stabiliser="project", project_k=0)],
                         ids=["low_lr", "l2sp", "ewc", "project"])
def test_stabilisers_reduce_exactly_to_plain_at_their_neutral_value(neutral):
    plain, _ = _train(LockInConfig(stabiliser="plain", fisher_examples=6))
    other, _ = _train(LockInConfig(fisher_examples=6, **neutral))
    for p, q in zip(plain.parameters(), other.parameters()):
        assert torch.equal(p, q)


def test_stabilisers_change_the_trajectory_when_switched_on():
    plain, _ = _train(LockInConfig(stabiliser="plain", fisher_examples=6))
    base = flatten(plain.parameters())
    for kw in (dict(stabiliser="low_lr"), dict(stabiliser="l2sp", l2sp=50.0), dict(stabiliser="ewc", ewc=50.0),
               dict(stabiliser="project", project_k=3)):
        model, _ = _train(LockInConfig(fisher_examples=6, **kw))
        assert not torch.allclose(flatten(model.parameters()), base), kw


@pytest.mark.parametrize("curvature", ["fisher", "hessian"])
def test_project_removes_the_top_curvature_directions_from_every_update(curvature):
    cfg = LockInConfig(stabiliser="project", project_k=3, project_curvature=curvature, refresh_every=0,
                       fisher_examples=6, lanczos_iters=30)
    model = _tiny_lm()
    trainer = StabilisedFineTuner(model, lm_loss, cfg, broad_loss=lm_loss, broad_batch=_lm_batch(6, seed=11))
    theta0 = flatten(model.parameters()).clone()
    for s in range(4):
        trainer.step(_lm_batch(4, seed=100 + s))
    delta = flatten(model.parameters()) - theta0
    assert float(delta.norm()) > 0
    assert float((trainer.basis.T @ delta).abs().max()) < 1e-10 * float(delta.norm())
    # the basis is the dense top-k eigenspace of the broad curvature at theta_0
    fresh = _tiny_lm()
    b = tuple(t[:6] for t in _lm_batch(6, seed=11))
    if curvature == "fisher":
        dense = ref.dense_fisher(ref.dense_gradient_rows(fresh, lm_loss, split_examples(b)))
    else:
        dense = ref.dense_hessian(fresh, lm_loss, b)
    assert subspace_overlap(ref.top_eigs_dense(dense, 3)[1], trainer.basis) == pytest.approx(1.0, abs=1e-5)


def test_freeze_keeps_frozen_parameters_and_ewc_uses_the_normalised_diagonal_fisher():
    model, trainer = _train(LockInConfig(stabiliser="freeze", freeze=("tok_emb",), fisher_examples=6))
    fresh = _tiny_lm()
    assert torch.equal(model.tok_emb.weight, fresh.tok_emb.weight)
    assert not torch.equal(model.norm_f.weight, fresh.norm_f.weight)
    with pytest.raises(ValueError, match="freeze"):
        StabilisedFineTuner(_tiny_lm(), lm_loss, LockInConfig(stabiliser="freeze", freeze=("nope",)))
    _, ewc = _train(LockInConfig(stabiliser="ewc", fisher_examples=6), steps=0)
    rows = ref.dense_gradient_rows(fresh, lm_loss, split_examples(tuple(t[:6] for t in _lm_batch(6, seed=11))))
    diag = rows.pow(2).mean(0)
    assert_close("ewc diag", diag / diag.mean(), flatten(ewc.fisher_diag), 1e-10)


@pytest.mark.parametrize("stabiliser", ["l2sp", "project"])
def test_trainer_state_dict_round_trip_continues_identically(stabiliser):
    cfg = LockInConfig(stabiliser=stabiliser, project_k=2, refresh_every=3, fisher_examples=6)
    model, trainer = _train(cfg, steps=4)
    clone = copy.deepcopy(model)
    resumed = StabilisedFineTuner(clone, lm_loss, cfg, broad_loss=lm_loss, broad_batch=_lm_batch(6, seed=11))
    resumed.load_state_dict(copy.deepcopy(trainer.state_dict()))
    for s in range(4, 8):
        trainer.step(_lm_batch(4, seed=100 + s))
        resumed.step(_lm_batch(4, seed=100 + s))
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)


def test_trainer_requires_broad_data_for_curvature_stabilisers():
    with pytest.raises(ValueError, match="broad_batch"):
        StabilisedFineTuner(_tiny_lm(), lm_loss, LockInConfig(stabiliser="project"))


# ----------------------------------------------------------------------------------------------------- curves
def test_first_crossing_equals_reference_on_non_monotone_curves():
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = (3.0 - np.cumsum(rng.uniform(-0.1, 0.3, size=9))).tolist()
        y = rng.normal(size=9).tolist()
        for level in np.linspace(min(x) - 0.1, x[0] + 0.1, 7):
            a = first_crossing(x, y, float(level), decreasing=True)
            b = ref.first_crossing_reference(x, y, float(level), decreasing=True)
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-12)


def test_matched_spread_is_zero_for_one_curve_at_different_speeds_and_positive_for_shifted_curves():
    curve = lambda t: 3.0 - t, lambda t: 2.0 + 0.5 * t ** 2  # task falls, broad rises along one curve
    fast = ([curve[0](t) for t in np.linspace(0, 1, 11)], [curve[1](t) for t in np.linspace(0, 1, 11)])
    slow = ([curve[0](t) for t in np.linspace(0, 0.6, 31)], [curve[1](t) for t in np.linspace(0, 0.6, 31)])
    same = matched_spread({"a": fast, "b": slow}, decreasing=True, n_levels=10)
    assert same["score"] == pytest.approx(0.0, abs=1e-2)  # only chord-interpolation error of the parabola
    assert same["common_level"] == pytest.approx(2.4)
    worse = (fast[0], [y + 0.1 * (x0 - x) for x, y, x0 in zip(fast[0], fast[1], [3.0] * 11)])
    shifted = matched_spread({"a": fast, "b": worse}, decreasing=True, n_levels=10, reference="a")
    # spread 0.1 t at t = 0.1 .. 1 (mean 0.055) over the mean increase (0.5 + 0.6) / 2 at t = 1
    assert shifted["score"] == pytest.approx(0.055 / 0.55) and shifted["coverage"] == pytest.approx(1.0)
    short = matched_spread({"a": fast, "b": (fast[0][:2], fast[1][:2])}, decreasing=True, reference="a")
    assert short["coverage"] == pytest.approx(0.1) and math.isnan(short["score"])


def test_degradation_curve_fit_is_exact_on_a_quadratic():
    pts = [(x, 1.0 + 2.0 * x - 0.5 * x * x) for x in np.linspace(0, 2, 9)]
    fit = fit_degradation_curve(pts, 2)
    assert fit["r2"] == pytest.approx(1.0) and fit["coef"] == pytest.approx([-0.5, 2.0, 1.0])


def _synthetic(broad_slope: dict, reach: dict) -> dict:
    """(task, broad, drift, step) curves: task falls from 3 to 3 - reach, broad rises by slope * progress."""
    return {a: [[3.0 - r * t, 2.0 + broad_slope[a] * r * t, t, i] for i, t in enumerate(np.linspace(0, 1, 11))]
            for a, r in reach.items()}


def test_claim_statistics_on_synthetic_trajectories():
    arms = ("project", "plain", "low_lr", "l2sp", "ewc", "freeze")
    cfg = TIERS["quick"]
    # every stabiliser on one curve (slope 1) at different speeds; project at half the damage
    curves = _synthetic({**{a: 1.0 for a in arms}, "project": 0.5},
                        {"project": 1.0, "plain": 1.0, "low_lr": 0.5, "l2sp": 0.7, "ewc": 0.8, "freeze": 0.6})
    stats = claim_statistics(curves, cfg)
    assert stats["collapse_share"] == pytest.approx(1.0, abs=1e-9)  # no spread left at matched task loss
    # L* = 3 - 0.75 * 1 = 2.25: broad 2.75 for every stabiliser that gets there, 2.375 for project
    assert stats["escape_gain"] == pytest.approx(0.5) and stats["escape_reached"] == 1.0
    # at drift t the arms are at different task progress, so broad loss differs at matched drift
    # spread(t) = (1.0 - 0.5) t over levels t = 0.05 .. 1, divided by the mean increase 0.72 at t = 1
    assert stats["drift_spread"] == pytest.approx(0.5 * np.mean(np.arange(1, 21) / 20) / 0.72)
    # an escape that never reaches L* counts as no escape
    stats = claim_statistics(_synthetic({**{a: 1.0 for a in arms}, "project": 0.1},
                                        {"project": 0.3, "plain": 1.0, "low_lr": 0.5, "l2sp": 0.7, "ewc": 0.8,
                                         "freeze": 0.6}), cfg)
    assert stats["escape_gain"] == 0.0 and stats["escape_reached"] == 0.0
    # stabilisers on different curves at the same speed: nothing collapses
    stats = claim_statistics(_synthetic({"project": 1.0, "plain": 1.0, "low_lr": 1.5, "l2sp": 2.0, "ewc": 0.5,
                                         "freeze": 1.2}, {a: 1.0 for a in arms}), cfg)
    # spread grows like t on both axes; the 20 task-loss levels (mean t 0.525) and 10 steps (mean t 0.55) differ
    assert stats["collapse_share"] == pytest.approx(1 - 0.525 / 0.55)


@pytest.mark.parametrize("spec_id", ["collapse", "drift_paradox", "escape"])
def test_null_arm_is_rejected_by_every_comparator(spec_id):
    """Every stabiliser and the escape switched back to plain: each statistic is exactly 0, which fails."""
    from icml26.methods.lockin.experiments import SPECS

    spec = next(s for s in SPECS if s.id == spec_id)
    out = spec.run({**spec.tiers["smoke"], "null": True}, 0, None)
    value = out["statistics"][spec.comparator.statistic]
    assert value == 0.0 and not spec.comparator.holds(value)
    assert spec.null_value == 0.0 and not spec.comparator.holds(spec.null_value)
    assert {c.name for c in spec.checks} <= set(out["checks"])


def test_tuning_gives_every_arm_three_candidates():
    from icml26.methods.lockin.experiments import SPECS

    prepared = SPECS[0].prepare(TIERS["smoke"])
    assert set(prepared["tuning"]["chosen"]) == {"low_lr", "l2sp", "ewc", "freeze", "project"}
    assert TIERS["quick"]["grid_size"] == 3 and len(TIERS["quick"]["project_k_grid"]) == 3
    out = SPECS[2].run(TIERS["smoke"], 0, prepared)
    assert math.isfinite(out["statistics"]["escape_gain"])


def test_smoke_arm_is_deterministic_and_finite():
    a = train_arm("ewc", TIERS["smoke"], seed=0)
    b = train_arm("ewc", TIERS["smoke"], seed=0)
    assert a["curve"] == b["curve"]
    assert all(math.isfinite(v) for point in a["curve"] for v in point)


# ----------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kwargs,field", [
    (dict(q=0), "q"), (dict(window=0), "window"), (dict(q=6, window=5), "q"), (dict(curvature="gauss"), "curvature"),
    (dict(stabiliser="adamw"), "stabiliser"), (dict(lr=0.0), "lr"), (dict(lr=float("nan")), "lr"),
    (dict(low_lr_factor=-1.0), "low_lr_factor"), (dict(l2sp=-0.1), "l2sp"), (dict(ewc=float("inf")), "ewc"),
    (dict(freeze="tok_emb"), "freeze"), (dict(freeze=("",)), "freeze"), (dict(project_k=-1), "project_k"),
    (dict(project_curvature="ggn"), "project_curvature"), (dict(refresh_every=1.5), "refresh_every"),
    (dict(fisher_examples=0), "fisher_examples"), (dict(lanczos_iters=0), "lanczos_iters"),
    (dict(stabiliser="project", project_k=65), "project_k"),
])
def test_bad_config_raises_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LockInConfig(**kwargs)
