"""CalM: simulator (legacy v1/v2 statistics and AR(1) kernel; v3 AR(2) kernel, dF/F baseline, switchable and
content-hashed ingredients), tokenisation (patchify, k-means, VQ-VAE, FSQ), the dual-axis model's causality for both
readings of the neural axis, baselines (shapes, neuron-permutation equivariance), metrics against loop references,
the scratch reduction switch, config ValueErrors and a smoke run of the claim with its null arm."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import numpy as np
import pytest
import torch

from icml26.methods.calm import (SPECS, CalM, CalMConfig, LearnedTokenizer, PatchTokenizer, SimConfig, build_baseline,
                                 fit_tokenizer, fsq_levels, patchify, poco_score, r2_score, reconstruction_r2,
                                 ridge_fit, ridge_predict, scalar_quantize, simulate_session)
from icml26.methods.calm.experiments import adapt, init_model, plateau_remaining, run_seed
from icml26.methods.calm.reference import (ar1_calcium_loop, ar2_calcium_loop, fit_ar1, patchify_loop,
                                           percentile_at, poco_score_reference, r2_reference)
from icml26.methods.calm.simulator import running_percentile

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def session():
    return simulate_session(0, 3, n_neurons=24, n_frames=2000, sim=SimConfig.legacy())


@pytest.fixture(scope="module")
def session_v3():
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
    c = np.corrcoef(session.dff)  # a shared latent drives the population: neurons correlate beyond chance
    assert np.abs(c[np.triu_indices(24, 1)]).mean() > 0.05


def test_simulator_ar1_kernel_recovered_and_matches_loop(session):
    np.testing.assert_allclose(session.calcium, ar1_calcium_loop(session.spikes, session.gamma), atol=1e-9)
    est = np.mean([fit_ar1(session.calcium[n], session.spikes[n]) for n in range(5)])
    assert abs(est - session.gamma) < 1e-6
    assert 0.8 < session.gamma < 0.95  # tau 0.8-1.5 s at 10 Hz (GCaMP6s-like decay)


def test_v3_ar2_kernel_matches_loop_and_gcamp_families(session_v3):
    g1, g2 = session_v3.kernel
    np.testing.assert_allclose(session_v3.calcium, ar2_calcium_loop(session_v3.spikes, g1, g2), atol=1e-9)
    # the two roots of 1 - g1 q - g2 q^2 are the decay and rise factors exp(-1/(f tau))
    roots = np.sort(np.roots([1.0, -g1, -g2]))
    tau = -1.0 / (session_v3.fs * np.log(roots))
    assert session_v3.indicator == "6s" and 0.1 <= tau[0] <= 0.2 + 1e-9 and 1.0 <= tau[1] <= 2.0
    fast = simulate_session(1, 3, n_neurons=4, n_frames=300)
    assert fast.indicator == "6f" and fast.gamma < session_v3.gamma  # GCaMP6f decays faster
    np.testing.assert_allclose(session_v3.dff.std(1), 1.0, atol=1e-3)
    assert np.isfinite(session_v3.dff).all()


def test_running_percentile_matches_numpy_at_evaluation_points():
    f = np.random.default_rng(0).standard_normal((3, 500)).cumsum(1)
    base = running_percentile(f, 100)
    for c in (0, 50, 250, 490):  # evaluation points (every window // 10 frames)
        np.testing.assert_allclose(base[:, c], percentile_at(f, c, 100, 8.0), atol=1e-9)


def test_every_ingredient_switches_and_is_hashed():
    ref = simulate_session(2, 5, n_neurons=6, n_frames=400)
    again = simulate_session(2, 5, n_neurons=6, n_frames=400)
    assert ref.content_hash == again.content_hash and np.array_equal(ref.dff, again.dff)
    switches = [{"dynamics": "switching"}, {"indicator": "ar1"}, {"saturation": False}, {"neuropil": False},
                {"drift_sd": 0.0}, {"bleaching": 0.0}, {"behavior_fraction": 0.0}, {"dff": "zscore"},
                {"burn_in": 50}, {"behavior_fraction": 1.0, "behavior_gain": 2.0}]
    hashes = {ref.content_hash}
    for kw in switches:
        s = simulate_session(2, 5, n_neurons=6, n_frames=400, sim=SimConfig(**kw))
        assert not np.array_equal(s.dff, ref.dff), kw
        hashes.add(s.content_hash)
    assert len(hashes) == len(switches) + 1
    assert simulate_session(2, 6, n_neurons=6, n_frames=400).content_hash != ref.content_hash


def test_post_v3_switches_keep_the_v3_hash_and_burn_in_drops_the_transient():
    """behavior_gain and burn_in arrived after v3: at their neutral values the hash v3 results cite is unchanged.
    burn_in simulates the latents that much longer and drops the start: the v3 start-up transient (x_0 ~ N(0, I),
    several times the stationary scale) no longer dominates the standardised latents."""
    assert SimConfig(behavior_gain=1.0, burn_in=0).hash == SimConfig().hash
    v3 = {k: v for k, v in asdict(SimConfig()).items() if k not in ("behavior_gain", "burn_in")}
    assert SimConfig().hash == hashlib.sha256(json.dumps(v3, sort_keys=True).encode()).hexdigest()[:16]
    plain = simulate_session(0, 1, n_neurons=6, n_frames=1000)
    burnt = simulate_session(0, 1, n_neurons=6, n_frames=1000, sim=SimConfig(burn_in=100))
    assert np.abs(plain.latents[:30]).max() > 2 * np.abs(plain.latents[200:]).max()
    assert np.abs(burnt.latents[:30]).max() < 1.5 * np.abs(burnt.latents[200:]).max()


def test_legacy_session_ignores_v3_streams():
    """SimConfig.legacy() draws only from the v1/v2 random stream: its latents equal the switching-dynamics
    latents of any other config, and its dF/F is the z-scored AR(1) calcium plus noise (v1/v2's formula)."""
    leg = simulate_session(1, 7, n_neurons=5, n_frames=300, sim=SimConfig.legacy())
    sw = simulate_session(1, 7, n_neurons=5, n_frames=300, sim=SimConfig(dynamics="switching"))
    np.testing.assert_array_equal(leg.latents, sw.latents)
    assert leg.indicator == "ar1" and len(leg.kernel) == 1
    resid = leg.dff - (leg.calcium - leg.calcium.mean(1, keepdims=True)) / leg.dff.std(1, keepdims=True).clip(1e-6)
    assert np.corrcoef(leg.dff.ravel(), leg.calcium.ravel())[0, 1] > 0.5 and np.isfinite(resid).all()


@pytest.mark.parametrize("kw,field", [({"dynamics": "lds"}, "dynamics"), ({"indicator": "ar3"}, "indicator"),
                                      ({"dff": "raw"}, "dff"), ({"bleaching": 1.0}, "bleaching"),
                                      ({"drift_sd": -1.0}, "drift_sd"), ({"latent_dim": 5}, "latent_dim"),
                                      ({"behavior_gain": -1.0}, "behavior_gain"), ({"burn_in": -1}, "burn_in"),
                                      ({"burn_in": 2.5}, "burn_in")])
def test_sim_config_rejects_bad_values(kw, field):
    with pytest.raises(ValueError, match=field):
        SimConfig(**kw)
    with pytest.raises(ValueError, match="n_neurons"):
        simulate_session(0, 0, n_neurons=1)


# --------------------------------------------------------------------------------------------------- tokenisation
@pytest.mark.parametrize("T,P", [(64, 8), (67, 8), (30, 5), (9, 3)])
def test_patchify_matches_loop(T, P):
    x = np.random.default_rng(0).standard_normal((5, T))
    np.testing.assert_array_equal(patchify(torch.as_tensor(x), P).numpy(), patchify_loop(x, P))


def _clusters(n=600, P=8):
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(4, P, generator=g) * 3
    return centers, centers[torch.arange(n) % 4] + 0.01 * torch.randn(n, P, generator=g)


def test_kmeans_tokenizer_recovers_clusters_and_shapes():
    _, pts = _clusters(400)
    tok = PatchTokenizer.fit(pts, 4, seed=0)
    codes = tok.encode(pts.reshape(20, 20, 8))
    assert codes.shape == (20, 20) and codes.dtype == torch.int64
    assert (tok.decode(codes).reshape(400, 8) - pts).abs().max() < 0.1
    with pytest.raises(ValueError, match="codebook_size"):
        PatchTokenizer.fit(pts[:3], 4)


@pytest.mark.parametrize("kind", ["vqvae", "fsq", "rvq"])
def test_learned_tokenizer_table_equals_decoder_path(kind):
    centers, pts = _clusters()
    tok = LearnedTokenizer.fit(pts, 16, kind=kind, seed=0, steps=80, batch=128)  # rvq: 2 stages of 4 codes
    codes = tok.encode(pts[:50].reshape(5, 10, 8))
    assert codes.shape == (5, 10) and int(codes.min()) >= 0 and int(codes.max()) < 16
    with torch.no_grad():  # decode = the codebook table = the decoder applied to the quantised latent
        z = tok.enc(pts[:50])
        zq = tok._fsq(z)[0] if kind == "fsq" else tok._quantize(z)[0]
        torch.testing.assert_close(tok.decode(codes).reshape(50, 8), tok.dec(zq), rtol=1e-5, atol=1e-5)
    assert all(not p.requires_grad for p in tok.parameters())
    if kind == "vqvae":  # four planted clusters: each gets its own code(s), never shared with another cluster
        all_codes = tok.encode(pts).reshape(-1, 4)  # column j = cluster j
        sets = [set(all_codes[:, j].tolist()) for j in range(4)]
        assert all(not (sets[i] & sets[j]) for i in range(4) for j in range(i))
        assert reconstruction_r2(tok.decode(tok.encode(pts)), pts) > 0.8


def test_rvq_token_is_the_greedy_residual_code_sum():
    """RVQ by hand: stage 0 takes the nearest code to z, stage 1 the nearest to what is left; the token is
    i0 + k i1 and its table row decodes e0[i0] + e1[i1]. Also: K must be a power of the stage size."""
    _, pts = _clusters()
    tok = LearnedTokenizer.fit(pts, 64, kind="rvq", stages=3, seed=1, steps=30, batch=64)
    assert tok.k == 4 and tok.embed.shape[:2] == (3, 4)
    with torch.no_grad():
        z = tok.enc(pts[:20])
        want_zq, want_tok = torch.zeros_like(z), torch.zeros(20, dtype=torch.long)
        r = z.clone()
        for s in range(3):
            i = ((r[:, None] - tok.embed[s][None]) ** 2).sum(-1).argmin(1)
            want_zq, r, want_tok = want_zq + tok.embed[s][i], r - tok.embed[s][i], want_tok + i * 4 ** s
        assert torch.equal(tok.encode(pts[:20]), want_tok)
        torch.testing.assert_close(tok.decode(want_tok), tok.dec(want_zq), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="power"):
        LearnedTokenizer(8, 60, kind="rvq", stages=2)
    with pytest.raises(ValueError, match="rvq_stages"):
        CalMConfig(tokenizer="rvq", codebook_size=60)
    assert CalMConfig(tokenizer="rvq", codebook_size=512, rvq_stages=3).rvq_stages == 3


def test_fsq_levels_and_fit_tokenizer_dispatch():
    assert fsq_levels(64) == (8, 8) and fsq_levels(16) == (8, 2) and np.prod(fsq_levels(240)) == 240
    with pytest.raises(ValueError, match="prime factor"):
        fsq_levels(22)
    with pytest.raises(ValueError, match="tokenizer"):
        fit_tokenizer("pq", torch.randn(100, 8), 8)
    x = torch.linspace(-1, 1, 9).reshape(1, 9)
    expect = [[-0.75, -0.75, -0.25, -0.25, 0.25, 0.25, 0.75, 0.75, 0.75]]  # bins of width 0.5, top edge closed
    np.testing.assert_allclose(scalar_quantize(x, 4, -1.0, 1.0).numpy(), expect, atol=1e-6)


def _model(**kw):
    cfg = CalMConfig(patch_len=4, codebook_size=8, d_model=16, n_blocks=2, n_heads=2, **kw)
    tok = PatchTokenizer.fit(torch.randn(200, 4, generator=torch.Generator().manual_seed(1)), 8, seed=0)
    torch.manual_seed(0)
    return CalM(cfg, tok if cfg.tokenizer != "continuous" else None).eval()


@pytest.mark.parametrize("tokenizer", ["kmeans", "continuous"])
def test_model_shapes_and_no_future_leak(tokenizer):
    m = _model(tokenizer=tokenizer)
    x = torch.randn(2, 5, 24)  # B=2, N=5, 6 patches of 4 frames
    inp = m.inputs_from_traces(x)
    assert inp.shape == ((2, 5, 6) if tokenizer == "kmeans" else (2, 5, 6, 4))
    out = m(inp)
    assert out.shape == ((2, 5, 6, 8) if tokenizer == "kmeans" else (2, 5, 6, 4))
    x2 = x.clone()
    x2[:, :, 16:] = torch.randn(2, 5, 8)  # change patches 4 and 5 of every neuron
    out2 = m(m.inputs_from_traces(x2))
    torch.testing.assert_close(out[:, :, :4], out2[:, :, :4])  # positions < 4 cannot see the future
    assert not torch.allclose(out[:, :, 5], out2[:, :, 5])
    assert m.forecast(x[:, :, :16], 2).shape == (2, 5, 8)
    assert m.pooled_features(x).shape == (2, 6, 16)
    assert torch.isfinite(m.loss(x))


@pytest.mark.parametrize("tokenizer", ["kmeans", "continuous"])
def test_raster_reading_sees_earlier_neurons_next_token_only(tokenizer):
    """Reading (ii): logits at (n, t) may depend on X[n', t+1] for n' < n, never on X[n', t+1] for n' >= n nor on
    anything at t+2 or later; with the teacher-forced next tokens of the loss."""
    m = _model(tokenizer=tokenizer, neural_axis="raster")
    x = torch.randn(2, 5, 28)  # 7 patches
    X = m.inputs_from_traces(x)
    t = 2
    for n in range(5):
        x2 = x.clone()
        x2[:, n:, (t + 1) * 4:(t + 2) * 4] += 3 * torch.randn(2, 5 - n, 4)  # X[n..N-1, t+1]
        x2[:, :, (t + 2) * 4:] = torch.randn(2, 5, 28 - (t + 2) * 4)  # everything after t+1
        X2 = m.inputs_from_traces(x2)
        a, b = m(X[:, :, :-1], X[:, :, 1:]), m(X2[:, :, :-1], X2[:, :, 1:])
        torch.testing.assert_close(a[:, :, :t + 1][:, :n + 1], b[:, :, :t + 1][:, :n + 1])
        torch.testing.assert_close(a[:, :, :t], b[:, :, :t])
        if n < 4 and tokenizer == "continuous":  # neuron n+1 reads neuron n's next patch
            assert not torch.allclose(a[:, n + 1, t], b[:, n + 1, t])
    assert m.forecast(x[:, :, :16], 2).shape == (2, 5, 8)
    assert torch.isfinite(m.loss(x))


def test_neural_axis_switch():
    x = torch.randn(1, 4, 24)
    x2 = x.clone()
    x2[:, 3] = torch.randn(24)  # change neuron 3 only
    for axis, mixes in (("bidirectional", True), ("none", False)):
        m = _model(neural_axis=axis)
        a, b = m(m.inputs_from_traces(x)), m(m.inputs_from_traces(x2))
        assert (not torch.allclose(a[:, 0], b[:, 0])) == mixes
    assert _model(neural_axis="none").blocks[0].attn_n is None


# ------------------------------------------------------------------------------------------------------ baselines
@pytest.mark.parametrize("name", ["nlinear", "tsmixer", "gru", "poco"])
def test_baselines_shapes_and_neuron_permutation(name):
    torch.manual_seed(0)
    m = build_baseline(name, 12, 5, 7).eval()
    x = torch.randn(3, 7, 12)
    y = m(x)
    assert y.shape == (3, 7, 5) and torch.isfinite(y).all()
    if name != "tsmixer":  # no neuron identity: permuting neurons permutes the forecasts (any N works)
        perm = torch.randperm(7)
        torch.testing.assert_close(m(x[:, perm]), y[:, perm], rtol=1e-5, atol=1e-5)
        assert m(torch.randn(2, 11, 12)).shape == (2, 11, 5)
    else:
        with pytest.raises(ValueError, match="neurons"):
            m(torch.randn(3, 6, 12))
    with torch.no_grad():  # NLinear with a zero map is copy-last exactly
        if name == "nlinear":
            m.lin.weight.zero_(), m.lin.bias.zero_()
            torch.testing.assert_close(m(x), x[..., -1:].expand(-1, -1, 5))
    with pytest.raises(ValueError, match="baseline"):
        build_baseline("lstm", 12, 5, 7)


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
    np.testing.assert_allclose(ridge_predict(ridge_fit(X, Y, 1e-8), X), Y, atol=1e-6)
    # plateau statistic by hand: CE 4, 3, 2, 2, 2 (x2 steps each): windows [6, 8) = 2 and [8, 10) = 2 -> 0
    assert plateau_remaining([4, 4, 3, 3, 2, 2, 2, 2, 2, 2], np.log(64)) == 0.0
    assert plateau_remaining([4] * 6 + [3, 3, 2, 2], 4.0) == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kw,field", [({"patch_len": 0}, "patch_len"), ({"codebook_size": 1}, "codebook_size"),
                                      ({"d_model": 30, "n_heads": 4}, "d_model"), ({"tokenizer": "pq"}, "tokenizer"),
                                      ({"neural_axis": "causal"}, "neural_axis"), ({"n_blocks": 2.0}, "n_blocks")])
def test_config_rejects_bad_values(kw, field):
    with pytest.raises(ValueError, match=field):
        CalMConfig(**kw)


def test_discrete_model_needs_matching_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        CalM(CalMConfig(codebook_size=8, patch_len=4), None)


# ------------------------------------------------------------------------------------------- reduction + smoke
def test_zero_pretraining_is_scratch_exactly():
    cfg = {**SPECS[0].tiers["smoke"], "finetune_steps": 3}
    train = simulate_session(0, 5, n_neurons=6, n_frames=200).dff
    P = cfg["patch_len"]
    tok = fit_tokenizer("vqvae", patchify(torch.as_tensor(train), P).reshape(-1, P), cfg["codebook_size"], steps=5)
    unpretrained = init_model(tok, cfg, 11)  # "pretrained" for zero steps
    a, b = adapt(unpretrained, train, cfg, 1e-3, 11), adapt(None, train, cfg, 1e-3, 11, tok)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(va, vb, rtol=0, atol=0, msg=k)
    assert not torch.equal(a.out.weight, unpretrained.out.weight)  # training did happen


@pytest.fixture(scope="module")
def smoke_prepared():
    return SPECS[0].prepare(SPECS[0].tiers["smoke"])


def test_smoke_run_has_every_arm(smoke_prepared):
    spec = SPECS[0]
    full = run_seed(spec.tiers["smoke"], 0, smoke_prepared)
    assert set(full["arms"]) == set(spec.arms)
    assert all(np.isfinite(v["score"]) for v in full["arms"].values())
    assert full["arms"]["copy_last"]["score"] == 0.0
    assert np.isfinite(full["statistics"][spec.comparator.statistic])
    assert set(full["checks"]) == {c.name for c in spec.checks}
    assert set(smoke_prepared["tuning"]["chosen"]) == {"calm", "scratch", "nlinear", "tsmixer", "gru", "poco"}


def test_null_arm_is_rejected_by_the_comparator(smoke_prepared):
    """calm switched back to the baseline (trained from scratch at scratch's rate): gain <= 0, never > 0."""
    spec = SPECS[0]
    cfg = {**spec.tiers["smoke"], "null": True, "arms": ["calm", "scratch", "copy_last"]}
    out = run_seed(cfg, 0, smoke_prepared)
    assert out["arms"]["calm"]["score"] == out["arms"]["scratch"]["score"]
    value = out["statistics"][spec.comparator.statistic]
    assert value <= 0.0 and not spec.comparator.holds(value)
    assert spec.null_value == 0.0 and not spec.comparator.holds(spec.null_value)


def test_mechanism_checks_and_per_arm_grids():
    spec = SPECS[0]
    checks = {c.name: c for c in spec.checks}
    assert checks["pretrain_plateau"].evaluate([0.3])["passed"] is False
    assert checks["pretrain_plateau"].evaluate([0.03])["passed"] is True
    assert checks["pretraining_acted"].evaluate([0.1])["passed"] is False
    assert checks["data_reward_learning"].evaluate([0.0, 0.01])["passed"] is False
    quick = spec.tiers["quick"]
    assert quick["lr_grid_size"] == 3 and quick["calm_lr_center"] != quick["scratch_lr_center"]
    with pytest.raises(ValueError, match="unknown config"):
        from icml26.methods.calm.experiments import _cfg
        _cfg(pretrain_step=3)


def test_pretraining_resumes_bit_identical_after_a_kill(tmp_path, monkeypatch):
    """A pretraining run killed mid-way (after its step-4 checkpoint) and restarted ends with the same weights and
    losses as an uninterrupted run."""
    import icml26.methods.calm.experiments as ex
    cfg = {**SPECS[0].tiers["smoke"], "pretrain_steps": 7, "checkpoint_every": 2}
    pre = [simulate_session(0, 1, n_neurons=6, n_frames=300)]
    P = cfg["patch_len"]
    tok = fit_tokenizer("kmeans", patchify(torch.as_tensor(pre[0].dff), P).reshape(-1, P), cfg["codebook_size"])
    ref, ref_losses = ex._pretrain(pre, tok, cfg, 3)
    calls = {"n": 0}
    real = ex._calm_loss

    def dying(model, batch):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt("simulated kill")
        return real(model, batch)

    monkeypatch.setattr(ex, "_calm_loss", dying)
    with pytest.raises(KeyboardInterrupt):
        ex._pretrain(pre, tok, {**cfg, "checkpoint_dir": str(tmp_path)}, 3)
    monkeypatch.setattr(ex, "_calm_loss", real)
    assert len(list(tmp_path.glob("*.pt"))) == 1
    resumed, losses = ex._pretrain(pre, tok, {**cfg, "checkpoint_dir": str(tmp_path)}, 3)
    assert losses == ref_losses
    for (k, a), b in zip(ref.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
