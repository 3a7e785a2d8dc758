"""CalM: simulator statistics (rates, AR(1) kernel recovered, determinism + content hash), tokenisation and
patch shapes, the dual-axis model's causality (no future leak along time, neural mixing present / absent by switch),
metrics against loop references, the scratch reduction switch, config ValueErrors and a smoke run of the claim."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icml26.methods.calm import (SPECS, CalM, CalMConfig, PatchTokenizer, patchify, poco_score, r2_score, ridge_fit,
                                 ridge_predict, simulate_session)
from icml26.methods.calm.experiments import adapt, init_model, run_seed
from icml26.methods.calm.reference import (ar1_calcium_loop, fit_ar1, patchify_loop, poco_score_reference,
                                           r2_reference)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def session():
    return simulate_session(0, 3, n_neurons=24, n_frames=2000)


# ------------------------------------------------------------------------------------------------------ simulator
def test_simulator_rates_and_shapes(session):
    assert session.dff.shape == session.spikes.shape == (24, 2000)
    assert session.latents.shape == (2000, 6) and session.behavior.shape == (2000,)
    rate_hz = session.spikes.mean(1) * session.fs
    assert 0.1 < rate_hz.mean() < 5.0 and (rate_hz > 0).all()
    # the spike counts follow the simulated intensity: their mean matches the mean rate / fs (Poisson)
    assert abs(session.spikes.mean() - session.rates_hz.mean() / session.fs) < 0.02
    np.testing.assert_allclose(session.dff.mean(1), 0.0, atol=1e-4)
    np.testing.assert_allclose(session.dff.std(1), 1.0, atol=1e-3)
    # a shared latent drives the population: neurons are correlated beyond chance
    c = np.corrcoef(session.dff)
    assert np.abs(c[np.triu_indices(24, 1)]).mean() > 0.05


def test_simulator_ar1_kernel_recovered_and_matches_loop(session):
    np.testing.assert_allclose(session.calcium, ar1_calcium_loop(session.spikes, session.gamma), atol=1e-9)
    est = np.mean([fit_ar1(session.calcium[n], session.spikes[n]) for n in range(5)])
    assert abs(est - session.gamma) < 1e-6
    assert 0.8 < session.gamma < 0.95  # tau 0.8-1.5 s at 10 Hz (GCaMP6s-like decay)


def test_simulator_deterministic_hash_and_families():
    a, b = simulate_session(1, 7, n_frames=300), simulate_session(1, 7, n_frames=300)
    assert a.content_hash == b.content_hash and np.array_equal(a.dff, b.dff)
    assert simulate_session(1, 8, n_frames=300).content_hash != a.content_hash
    assert simulate_session(2, 7, n_frames=300).gamma != a.gamma  # families differ in indicator decay
    with pytest.raises(ValueError, match="n_neurons"):
        simulate_session(0, 0, n_neurons=1)


# --------------------------------------------------------------------------------------------------- tokenisation
@pytest.mark.parametrize("T,P", [(64, 8), (67, 8), (30, 5), (9, 3)])
def test_patchify_matches_loop(T, P):
    x = np.random.default_rng(0).standard_normal((5, T))
    np.testing.assert_array_equal(patchify(torch.as_tensor(x), P).numpy(), patchify_loop(x, P))


def test_tokenizer_codebook_recovers_clusters_and_shapes():
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 8, generator=g) * 5
    pts = centers[torch.arange(400) % 4] + 0.01 * torch.randn(400, 8, generator=g)
    tok = PatchTokenizer.fit(pts, 4, seed=0)
    codes = tok.encode(pts.reshape(20, 20, 8))
    assert codes.shape == (20, 20) and codes.dtype == torch.int64
    assert (tok.decode(codes).reshape(400, 8) - pts).abs().max() < 0.1
    with pytest.raises(ValueError, match="codebook_size"):
        PatchTokenizer.fit(pts[:3], 4)


def _model(**kw):
    cfg = CalMConfig(patch_len=4, codebook_size=8, d_model=16, n_blocks=2, n_heads=2, **kw)
    tok = PatchTokenizer.fit(torch.randn(200, 4, generator=torch.Generator().manual_seed(1)), 8, seed=0)
    torch.manual_seed(0)
    return CalM(cfg, tok if cfg.tokenizer == "vq" else None).eval()


@pytest.mark.parametrize("tokenizer", ["vq", "continuous"])
def test_model_shapes_and_no_future_leak(tokenizer):
    m = _model(tokenizer=tokenizer)
    x = torch.randn(2, 5, 24)  # B=2, N=5, 6 patches of 4 frames
    inp = m.inputs_from_traces(x)
    assert inp.shape == ((2, 5, 6) if tokenizer == "vq" else (2, 5, 6, 4))
    out = m(inp)
    assert out.shape == ((2, 5, 6, 8) if tokenizer == "vq" else (2, 5, 6, 4))
    x2 = x.clone()
    x2[:, :, 16:] = torch.randn(2, 5, 8)  # change patches 4 and 5 of every neuron
    out2 = m(m.inputs_from_traces(x2))
    torch.testing.assert_close(out[:, :, :4], out2[:, :, :4])  # positions < 4 cannot see the future
    assert not torch.allclose(out[:, :, 5], out2[:, :, 5])
    assert m.forecast(x[:, :, :16], 2).shape == (2, 5, 8)
    assert m.pooled_features(x).shape == (2, 6, 16)
    assert torch.isfinite(m.loss(x))


def test_neural_axis_switch():
    x = torch.randn(1, 4, 24)
    x2 = x.clone()
    x2[:, 3] = torch.randn(24)  # change neuron 3 only
    for axis, mixes in (("bidirectional", True), ("none", False)):
        m = _model(neural_axis=axis)
        a, b = m(m.inputs_from_traces(x)), m(m.inputs_from_traces(x2))
        assert (not torch.allclose(a[:, 0], b[:, 0])) == mixes
        assert sum(p.numel() for p in m.parameters()) > 0
    assert _model(neural_axis="none").blocks[0].attn_n is None


# -------------------------------------------------------------------------------------------------------- metrics
def test_metrics_match_reference():
    rng = np.random.default_rng(0)
    target, pred, last = rng.standard_normal((6, 3, 5)), rng.standard_normal((6, 3, 5)), rng.standard_normal((6, 3))
    assert abs(poco_score(pred, target, last) - poco_score_reference(pred, target, last)) < 1e-12
    assert poco_score(np.repeat(last[..., None], 5, -1), target, last) == pytest.approx(0.0)
    assert poco_score(target, target, last) == 1.0
    assert abs(r2_score(pred, target) - r2_reference(pred, target)) < 1e-12
    X = rng.standard_normal((200, 4))
    Y = X @ np.array([[1.0], [-2.0], [0.5], [0.0]]) + 3.0
    W = ridge_fit(X, Y, 1e-8)
    np.testing.assert_allclose(ridge_predict(W, X), Y, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kw,field", [({"patch_len": 0}, "patch_len"), ({"codebook_size": 1}, "codebook_size"),
                                      ({"d_model": 30, "n_heads": 4}, "d_model"), ({"tokenizer": "fsq"}, "tokenizer"),
                                      ({"neural_axis": "raster"}, "neural_axis"), ({"n_blocks": 2.0}, "n_blocks")])
def test_config_rejects_bad_values(kw, field):
    with pytest.raises(ValueError, match=field):
        CalMConfig(**kw)


def test_vq_model_needs_matching_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        CalM(CalMConfig(codebook_size=8, patch_len=4), None)


# ------------------------------------------------------------------------------------------- reduction + smoke
def test_zero_pretraining_is_scratch_exactly():
    cfg = {**SPECS[0].tiers["smoke"], "finetune_steps": 3}
    train = simulate_session(0, 5, n_neurons=6, n_frames=200).dff
    P = cfg["patch_len"]
    tok = PatchTokenizer.fit(patchify(torch.as_tensor(train), P).reshape(-1, P), cfg["codebook_size"], seed=11)
    unpretrained = init_model(tok, cfg, 11)  # "pretrained" for zero steps
    a, b = adapt(unpretrained, train, cfg, 1e-3, 11), adapt(None, train, cfg, 1e-3, 11)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(va, vb, rtol=0, atol=0, msg=k)
    assert not torch.equal(a.out.weight, unpretrained.out.weight)  # training did happen


def test_smoke_run_has_every_arm():
    spec = SPECS[0]
    cfg = spec.tiers["smoke"]
    full = run_seed(cfg, 0, spec.prepare(cfg))
    assert set(full["arms"]) == set(spec.arms)
    assert all(np.isfinite(v["score"]) for v in full["arms"].values())
    assert full["arms"]["copy_last"]["score"] == 0.0
    assert np.isfinite(full["statistics"][spec.comparator.statistic])


def test_null_arm_is_rejected_by_the_comparator():
    """calm switched back to the baseline (trained from scratch at scratch's rate): gain <= 0, never > 0."""
    spec = SPECS[0]
    cfg = {**spec.tiers["smoke"], "null": True}
    out = run_seed(cfg, 0, spec.prepare(spec.tiers["smoke"]))
    assert out["arms"]["calm"]["score"] == out["arms"]["scratch"]["score"]
    value = out["statistics"][spec.comparator.statistic]
    assert value <= 0.0 and not spec.comparator.holds(value)
    assert spec.null_value == 0.0 and not spec.comparator.holds(spec.null_value)


def test_pretraining_check_and_per_arm_grids():
    spec = SPECS[0]
    check = next(c for c in spec.checks if c.name == "pretrain_ce_below_uniform")
    assert check.evaluate([0.86])["passed"] is False and check.evaluate([1.2])["passed"] is True
    quick = spec.tiers["quick"]
    assert quick["lr_grid_size"] == 3 and quick["calm_lr_center"] != quick["scratch_lr_center"]
