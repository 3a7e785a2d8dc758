"""Omni-fMRI: dynamic patching against the plain recursive rule, coverage, the tau extremes, the variance gate, the
dual-path embedding and MAE loss against per-token references (outputs and gradients), zero-init equivalence,
masking, the NIfTI round trip and loader errors, the simulator, config validation, and the null arm of the claim."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("nibabel")
pytest.importorskip("nilearn")

from icml26.core.testing import assert_close  # noqa: E402
from icml26.methods.omni_fmri import reference as ref  # noqa: E402
from icml26.methods.omni_fmri.config import OmniFMRIConfig  # noqa: E402
from icml26.methods.omni_fmri.model import OmniMAE, strided_conv  # noqa: E402
from icml26.methods.omni_fmri.nifti import load_run, mni_on_grid, save_run  # noqa: E402
from icml26.methods.omni_fmri.patching import foreground_maps, tokenize  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def small_cfg(**kw) -> OmniFMRIConfig:
    base = dict(in_frames=3, embed_dim=16, depth=1, num_heads=2, decoder_embed_dim=16, decoder_depth=1,
                decoder_num_heads=2, patch_size=2)
    return OmniFMRIConfig(**{**base, **kw})


def textured_batch(B=2, T=3, shape=(8, 12, 16), seed=0) -> torch.Tensor:
    """Chunks with a zero background, flat regions and textured regions, so every branch of the rule is taken."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(B, T, *shape)
    D, H, W = shape
    x[:, :, : D // 2 + 2, 2:, 4:] = 0.5 + 0.01 * torch.randn(B, T, D // 2 + 2, H - 2, W - 4, generator=g)
    x[:, :, 4:, 4:10, 8:] += torch.randn(B, T, D - 4, 6, W - 8, generator=g)
    return x


def token_set(tokens, b):
    return {(int(s), tuple(int(v) for v in c)) for s, c, ok in
            zip(tokens.scale[b], tokens.coords[b], tokens.valid[b]) if ok}


@pytest.mark.parametrize("K,thresholds,shape", [(2, (0.05,), (8, 12, 16)), (2, (0.3,), (8, 12, 16)),
                                                 (3, (0.05, 0.4), (8, 16, 24))])
def test_selection_matches_plain_recursive_rule(K, thresholds, shape):
    cfg = small_cfg(num_scales=K, thresholds=thresholds)
    x = textured_batch(shape=shape)
    tokens = tokenize(x, cfg)
    for b in range(x.shape[0]):
        want = {(s, c) for s, c in ref.select_tokens(x[b].numpy(), cfg)}
        assert token_set(tokens, b) == want
    assert len({int(s) for s in tokens.scale[tokens.valid]}) > 1  # more than one scale is exercised


@pytest.mark.parametrize("K", [2, 3])
def test_every_foreground_base_patch_is_covered_exactly_once(K):
    cfg = small_cfg(num_scales=K, thresholds=(0.2,) * (K - 1))
    x = textured_batch(shape=(8, 16, 24) if K == 3 else (8, 12, 16))
    tokens = tokenize(x, cfg)
    fg0 = foreground_maps(x, cfg)[0]
    cover = torch.zeros_like(fg0, dtype=torch.long)
    for s, m in enumerate(tokens.masks):
        f = 2 ** s
        cover += m.long().repeat_interleave(f, 1).repeat_interleave(f, 2).repeat_interleave(f, 3)
    assert (cover[fg0] == 1).all()
    assert (cover <= 1).all()


def test_tau_zero_is_uniform_base_patching_and_inf_uniform_coarse():
    x = textured_batch()
    cfg0 = small_cfg(thresholds=(0.0,))
    t0 = tokenize(x, cfg0)
    assert (t0.scale[t0.valid] == 0).all()
    assert torch.equal(t0.count(), foreground_maps(x, cfg0)[0].flatten(1).sum(1))
    t_all = tokenize(x, small_cfg(thresholds=(0.0,), bg_threshold=-1.0))
    assert (t_all.count() == 4 * 6 * 8).all()  # every base patch of the (8, 12, 16) grid
    t_inf = tokenize(x, small_cfg(thresholds=(math.inf,), bg_threshold=-1.0))
    assert (t_inf.scale[t_inf.valid] == 1).all() and (t_inf.count() == 2 * 3 * 4).all()


def test_variance_gate_merges_flat_regions_and_splits_textured_ones():
    cfg = small_cfg(thresholds=(0.1,))
    x = torch.zeros(1, 3, 8, 8, 8)
    x[:, :, :4] = 1.0  # flat, foreground
    x[:, :, 4:] = torch.randn(1, 3, 4, 8, 8, generator=torch.Generator().manual_seed(1))  # textured
    tokens = tokenize(x, cfg)
    coarse = {tuple(c.tolist()) for c in tokens.coords[0][(tokens.scale[0] == 1) & tokens.valid[0]]}
    assert coarse == {(0, 0, 0), (0, 0, 4), (0, 4, 0), (0, 4, 4)}
    assert tokens.count(1).item() == 4 and tokens.count(0).item() == 32  # 64 base patches -> 36 tokens
    assert tokenize(x, small_cfg(thresholds=(0.0,))).count().item() == 64


def test_strided_conv_equals_conv3d():
    conv = torch.nn.Conv3d(3, 5, 2, 2)
    x = torch.randn(2, 3, 4, 6, 8)
    assert_close("strided conv", torch.nn.functional.conv3d(x, conv.weight, conv.bias, stride=2),
                 strided_conv(x, conv), 1e-5)


@pytest.mark.parametrize("K", [2, 3])
def test_embedding_matches_per_token_reference_outputs_and_gradients(K):
    shape = (8, 16, 24) if K == 3 else (8, 12, 16)
    cfg = small_cfg(num_scales=K, thresholds=(0.3,) * (K - 1), zero_init=False)
    torch.manual_seed(0)
    model = OmniMAE(cfg, shape)
    x = textured_batch(shape=shape)
    tokens = tokenize(x, cfg)
    fast = model.embed_tokens(x, tokens)
    rows = []
    for b in range(x.shape[0]):
        for s, c, ok in zip(tokens.scale[b], tokens.coords[b], tokens.valid[b]):
            rows.append(ref.embed_token(model.embed_tokens, x[b], int(s), tuple(int(v) for v in c)) if ok
                        else torch.zeros(cfg.embed_dim))
    slow = torch.stack(rows).view_as(fast)
    assert_close("embedding", slow, fast, 1e-5)
    w = torch.randn_like(fast)
    g_fast = torch.autograd.grad((fast * w).sum(), list(model.embed_tokens.parameters()))
    g_slow = torch.autograd.grad((slow * w).sum(), list(model.embed_tokens.parameters()))
    for a, b in zip(g_slow, g_fast):
        assert_close("embedding grad", a, b, 1e-4)


def test_zero_init_starts_from_the_low_frequency_embedding():
    shape = (8, 12, 16)
    x = textured_batch(shape=shape)
    torch.manual_seed(0)
    dual = OmniMAE(small_cfg(thresholds=(0.3,)), shape)
    low_only = OmniMAE(small_cfg(thresholds=(0.3,), coarse_embed="downsample_only"), shape)
    low_only.load_state_dict(dual.state_dict())
    tokens = tokenize(x, dual.cfg)
    assert tokens.count(1).sum() > 0
    assert torch.equal(dual.embed_tokens(x, tokens), low_only.embed_tokens(x, tokens))
    # and the detail path does get a gradient, so training can leave the low-frequency start
    dual.embed_tokens(x, tokens).sum().backward()
    assert dual.embed_tokens.zero_linear.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("loss_norm", ["pooled", "per_scale"])
def test_mae_loss_matches_per_token_reference(loss_norm):
    shape = (8, 12, 16)
    cfg = small_cfg(thresholds=(0.3,), loss_norm=loss_norm)
    torch.manual_seed(0)
    model = OmniMAE(cfg, shape)
    x = textured_batch(shape=shape)
    out = model(x, generator=torch.Generator().manual_seed(3))
    tokens, masked = out["tokens"], out["masked"]
    preds, targets, scales = [], [], []
    for s in range(cfg.num_scales):
        sel = masked & (tokens.scale == s)
        bs = torch.arange(x.shape[0])[:, None].expand_as(sel)[sel]
        p = cfg.patch_sizes[s]
        for row, (b, c) in enumerate(zip(bs.tolist(), tokens.coords[sel].tolist())):
            tgt = x[b, :, c[0]:c[0] + p, c[1]:c[1] + p, c[2]:c[2] + p].flatten()
            assert torch.equal(out["target"][s][row], tgt)
            preds.append(out["pred"][s][row])
            targets.append(tgt)
            scales.append(s)
    want = ref.token_loss(preds, targets, scales, cfg.num_scales, loss_norm)
    assert_close("loss", want.reshape(1), out["loss"].reshape(1), 1e-6)
    assert {int(s) for s in scales} == {0, 1}


def test_masking_keeps_a_quarter_and_reconstruction_shapes():
    shape = (8, 12, 16)
    cfg = small_cfg(thresholds=(0.3,))
    model = OmniMAE(cfg, shape)
    x = textured_batch(shape=shape)
    out = model(x, generator=torch.Generator().manual_seed(0))
    n = out["tokens"].lengths
    assert torch.equal(out["masked"].sum(1), n - (n.float() * 0.25).long().clamp_min(1))
    assert not (out["masked"] & ~out["tokens"].valid).any()
    for s, p in enumerate(cfg.patch_sizes):
        if out["pred"][s] is not None:
            assert out["pred"][s].shape[1] == cfg.in_frames * p ** 3
    recon, vox = model.reconstruct(x, generator=torch.Generator().manual_seed(0))
    assert recon.shape == x.shape and vox.shape == x.shape and vox.any()
    assert torch.equal(recon[~vox], x[~vox])
    emb = model.embed(x)
    assert emb.shape == (2, cfg.embed_dim) and torch.isfinite(emb).all()
    out["loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_model_rejects_wrong_input():
    model = OmniMAE(small_cfg(), (8, 12, 16))
    with pytest.raises(ValueError, match="expected chunks"):
        model(torch.zeros(1, 4, 8, 12, 16))
    with pytest.raises(ValueError, match="divisible"):
        OmniMAE(small_cfg(), (8, 12, 10))


@pytest.mark.parametrize("kw,field", [(dict(thresholds=(0.1, 0.2)), "thresholds"), (dict(method="sobel"), "method"),
                                      (dict(embed_dim=10, num_heads=4), "embed_dim"), (dict(mask_ratio=1.0), "mask"),
                                      (dict(loss_norm="x"), "loss_norm"), (dict(patch_size=0), "patch_size"),
                                      (dict(thresholds=(-1.0,)), "thresholds"),
                                      (dict(bg_threshold=float("nan")), "bg_threshold")])
def test_config_rejects_bad_values(kw, field):
    with pytest.raises(ValueError, match=field):
        OmniFMRIConfig(**kw)


# --- NIfTI ------------------------------------------------------------------------------------------------------

def test_mni_mask_is_real_and_on_the_grid():
    mask, t1, aff = mni_on_grid((32, 40, 32), 6.0)
    assert mask.shape == (32, 40, 32) and 0.1 < mask.mean() < 0.4
    assert np.allclose(np.diag(aff)[:3], 6.0) and t1[mask].mean() > t1[~mask].mean()


def test_nifti_round_trip_keeps_data_affine_and_tr(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.normal(size=(8, 8, 8, 12)).astype(np.float32) * 3 + 5
    data[:2] = 0.0
    aff = np.array([[-3.0, 0, 0, 90], [0, 3, 0, -126], [0, 0, 3, -72], [0, 0, 0, 1]])
    path = save_run(tmp_path / "run.nii.gz", data, aff, tr=0.75)
    run = load_run(path, multiple=8)
    assert np.allclose(run.affine, aff) and run.tr == pytest.approx(0.75) and run.data.shape == (12, 8, 8, 8)
    m = np.abs(data).max(-1) > 0
    z = (data - data[m].mean()) / data[m].std()
    assert np.allclose(np.moveaxis(run.data, 0, -1)[m], z[m], atol=1e-4)
    assert (run.data[:, ~m] == 0).all() and (run.mask == m).all()
    assert run.chunks(5).shape == (2, 5, 8, 8, 8)


def test_loader_resamples_tr_pads_and_resamples_space(tmp_path):
    data = np.random.default_rng(1).normal(size=(6, 7, 5, 10)).astype(np.float32) + 10
    aff = np.diag([4.0, 4.0, 4.0, 1.0])
    path = save_run(tmp_path / "slow.nii", data, aff, tr=2.0)
    run = load_run(path, multiple=4)
    assert run.tr == pytest.approx(0.72) and run.source_tr == 2.0 and run.data.shape[0] == 26  # 18 s / 0.72 + 1
    assert run.data.shape[1:] == (8, 8, 8)
    target = ((8, 8, 8), np.diag([3.0, 3.0, 3.0, 1.0]))
    run2 = load_run(path, target=target, multiple=8)
    assert run2.data.shape == (26, 8, 8, 8) and np.allclose(run2.affine, target[1])


def test_loader_errors_are_clear(tmp_path):
    aff = np.eye(4)
    good = save_run(tmp_path / "good.nii", np.ones((4, 4, 4, 6), np.float32), aff, tr=0.72)
    nib = pytest.importorskip("nibabel")
    nib.save(nib.Nifti1Image(np.ones((4, 4, 4), np.float32), aff), str(tmp_path / "vol.nii"))
    with pytest.raises(ValueError, match="4-D"):
        load_run(tmp_path / "vol.nii")
    shifted = nib.Nifti1Image(np.ones((4, 4, 4), np.uint8), np.diag([2.0, 2.0, 2.0, 1.0]))
    with pytest.raises(ValueError, match="affine"):
        load_run(good, mask=shifted)
    with pytest.raises(ValueError, match="empty"):
        load_run(good, mask=np.zeros((4, 4, 4), bool))
    img = nib.Nifti1Image(np.ones((4, 4, 4, 6), np.float32), aff)
    img.header.set_zooms((1, 1, 1, 0))
    with pytest.raises(ValueError, match="no TR"):
        load_run(img)
    with pytest.raises(ValueError, match="outside the range"):
        load_run(good, tr=720.0)


# --- simulator and claim -------------------------------------------------------------------------------------------

def test_simulator_z_scored_inside_the_real_mask():
    from icml26.methods.omni_fmri.simulate import SimSpec, simulate

    ds = simulate(2, 2, 0, SimSpec(frames=6))
    x = ds.tensor()
    assert x.shape == (4, 6, 32, 40, 32)
    inside = x[:, :, torch.from_numpy(ds.mask)]
    assert inside.mean().abs() < 1e-3 and (inside.std() - 1).abs() < 1e-2
    assert (x[:, :, ~torch.from_numpy(ds.mask)] == 0).all()
    assert set(ds.trait.tolist()) == {0, 1} and ds.state.max() < 4


def test_null_arm_cannot_pass_the_comparator():
    from icml26.methods.omni_fmri.experiments import PATCHING, SPECS, TIERS, run_seed

    spec = SPECS[0]
    config = {**TIERS["smoke"], "arms": ["dynamic", "uniform4"],
              "patching_override": {"dynamic": PATCHING["uniform4"], "uniform4": PATCHING["uniform4"]}}
    res = run_seed(config, 0, None)
    assert res["statistics"]["state_gain"] == 0.0
    assert not spec.comparator.holds(res["statistics"]["state_gain"])


def test_layout_picture_for_a_users_nifti(tmp_path):
    from icml26.methods.omni_fmri.viz import main

    data = np.zeros((16, 16, 16, 6), np.float32)
    data[2:14, 2:14, 2:14] = np.random.default_rng(0).normal(size=(12, 12, 12, 6)) + 3
    path = save_run(tmp_path / "run.nii.gz", data, np.diag([6.0, 6.0, 6.0, 1.0]), tr=0.72)
    out = tmp_path / "layout.png"
    main([str(path), "--native", "--frames", "6", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- v2 readout, ablation helpers, more loader errors, reconstruction pictures -----------------------------------

def test_region_pooling_matches_a_per_token_loop_and_global_mean():
    from icml26.methods.omni_fmri.train import TokenCache, embeddings

    shape = (8, 12, 16)
    cfg = small_cfg(thresholds=(0.3,))
    torch.manual_seed(0)
    model = OmniMAE(cfg, shape)
    x = textured_batch(B=3, shape=shape)
    x[..., :4, :6, :8] = 0.0  # one box of the 2x2x2 split is all background
    cache = TokenCache(lambda idx: x[torch.as_tensor(idx)], 3, cfg)
    assert cache.counts()[:, 1].sum() > 0  # coarse tokens are pooled by their centre too
    glob = embeddings(model, lambda idx: x[torch.as_tensor(idx)], 3, cache, batch=2)
    with torch.no_grad():
        assert_close("global pool", model.embed(x), torch.from_numpy(glob), 1e-5)
        h, tokens = model.encode(x)
    r = 2
    pooled = embeddings(model, lambda idx: x[torch.as_tensor(idx)], 3, cache, batch=2, regions=r)
    assert pooled.shape == (3, r ** 3 * cfg.embed_dim)
    want = torch.zeros(3, r ** 3, cfg.embed_dim)
    n = torch.zeros(3, r ** 3)
    for b in range(3):
        for i, (s, c, ok) in enumerate(zip(tokens.scale[b], tokens.coords[b], tokens.valid[b])):
            if not ok:
                continue
            p = cfg.patch_sizes[int(s)]
            box = [min(int((int(c[a]) + p / 2) / shape[a] * r), r - 1) for a in range(3)]
            k = (box[0] * r + box[1]) * r + box[2]
            want[b, k] += h[b, 1 + i]
            n[b, k] += 1
    want = want / n.clamp_min(1)[..., None]
    assert (n == 0).any()  # an empty box (background corner) gives zeros
    assert_close("region pool", want.flatten(1), torch.from_numpy(pooled), 1e-5)
    with pytest.raises(ValueError, match="regions"):
        embeddings(model, lambda idx: x[torch.as_tensor(idx)], 3, cache, regions=0)


def test_raw_features_are_the_average_pooled_chunks():
    from icml26.methods.omni_fmri.train import raw_features

    x = torch.randn(5, 3, 8, 8, 8)
    f = raw_features(lambda idx: x[torch.as_tensor(idx)], 5, pool=4, batch=2)
    assert f.shape == (5, 3 * 8)
    assert np.allclose(f[1].reshape(3, 2, 2, 2)[2, 1, 0, 1], x[1, 2, 4:8, 0:4, 4:8].mean().item(), atol=1e-6)


def test_matched_threshold_gives_the_target_coarse_count():
    from icml26.methods.omni_fmri.experiments import matched_threshold

    x = textured_batch(B=2, shape=(8, 12, 16))
    cfg = small_cfg(thresholds=(0.0,))
    n_fg = int(foreground_maps(x, cfg)[1].sum())
    for k in (0, 1, 3, n_fg - 1, n_fg):
        tau = matched_threshold(x, cfg, k)
        assert tokenize(x, small_cfg(thresholds=(tau,))).count(1).sum() == k
    # ties (a flat volume: every coarse score equal): the count closest to the target that the ties allow
    flat = torch.ones(1, 3, 8, 8, 8)
    tau = matched_threshold(flat, cfg, 3)
    assert tokenize(flat, small_cfg(thresholds=(tau,))).count(1).item() in (0, 8)


def test_ablation_arms_switch_only_the_metric_or_tau():
    from icml26.methods.omni_fmri.experiments import ABLATION_ARMS, TIERS, ablation_config, model_config

    c = TIERS["smoke"]
    base = model_config(c, "dynamic")
    assert ablation_config(c, "std") == base
    assert ablation_config(c, "tau0").thresholds == (0.0,)
    e = ablation_config(c, "entropy", 0.7)
    assert e.method == "entropy" and e.thresholds == (0.7,) and e.embed_dim == base.embed_dim
    assert len(set(ABLATION_ARMS)) == len(ABLATION_ARMS)
    with pytest.raises(ValueError, match="unknown ablation arm"):
        ablation_config(c, "sobel")


def test_loader_more_errors_and_time_units(tmp_path):
    nib = pytest.importorskip("nibabel")
    aff = np.eye(4)
    good = save_run(tmp_path / "good.nii", np.ones((4, 4, 4, 6), np.float32), aff, tr=0.72)
    with pytest.raises(ValueError, match="mask array shape"):
        load_run(good, mask=np.ones((4, 4, 5), bool))
    nib.save(nib.Nifti1Image(np.ones((4, 4, 4, 1, 6), np.float32), aff), str(tmp_path / "five.nii"))
    with pytest.raises(ValueError, match="4-D"):
        load_run(tmp_path / "five.nii")
    with pytest.raises(ValueError, match="at least 2"):
        load_run(save_run(tmp_path / "one.nii", np.ones((4, 4, 4, 1), np.float32), aff, tr=0.72))
    far = nib.Nifti1Image(np.ones((4, 4, 4), np.uint8), np.array([[1.0, 0, 0, 500], [0, 1, 0, 0], [0, 0, 1, 0],
                                                                   [0, 0, 0, 1]]))
    with pytest.raises(ValueError, match="empty"):  # a mask in another place of the world: no overlap on the target
        load_run(good, mask=far, target=((4, 4, 4), aff))
    img = nib.Nifti1Image(np.random.default_rng(0).normal(size=(4, 4, 4, 6)).astype(np.float32) + 3, aff)
    img.header.set_xyzt_units("mm", "msec")
    img.header.set_zooms((1, 1, 1, 720.0))
    assert load_run(img).source_tr == pytest.approx(0.72)


def test_layout_and_reconstruction_picture_for_a_users_nifti(tmp_path):
    from icml26.methods.omni_fmri.viz import main

    data = np.zeros((16, 16, 16, 8), np.float32)
    data[2:14, 2:14, 2:14] = np.random.default_rng(0).normal(size=(12, 12, 12, 8)) + 3
    path = save_run(tmp_path / "run.nii.gz", data, np.diag([6.0, 6.0, 6.0, 1.0]), tr=0.72)
    opts = ["--native", "--frames", "4", "--width", "16", "--depth", "1", "--reconstruct"]
    out = tmp_path / "recon.png"
    main([str(path), *opts, "--steps", "2", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cfg = OmniFMRIConfig(in_frames=4, embed_dim=16, depth=1, num_heads=4, decoder_embed_dim=16, decoder_depth=1,
                         decoder_num_heads=4)
    torch.save(OmniMAE(cfg, (16, 16, 16)).state_dict(), tmp_path / "w.pt")
    main([str(path), *opts, "--weights", str(tmp_path / "w.pt"), "--out", str(tmp_path / "w.png")])
    assert (tmp_path / "w.png").exists()
    with pytest.raises(ValueError, match="steps"):
        main([str(path), *opts, "--steps", "0", "--out", str(tmp_path / "x.png")])
    with pytest.raises(ValueError, match="does not fit"):  # weights of another width
        main([str(path), *opts[:-3], "--width", "32", "--reconstruct", "--weights", str(tmp_path / "w.pt"),
              "--out", str(tmp_path / "y.png")])
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "y.png").exists()
