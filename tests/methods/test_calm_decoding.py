"""CalM decoding: the task head pools over neurons without caring about their order, the contrastive encoder's
InfoNCE is ln B at chance and ~0 when positives are recoverable, the LoRA arm leaves the pretrained backbone
untouched, the decoding claim runs end to end at smoke size and its null arm cannot pass."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from icml26.methods.calm import SPECS
from icml26.methods.calm.decoding import ContrastiveEncoder, DecodingHead, PatchGRU, PatchMLP
from icml26.methods.calm.experiments import (_dcfg, _decode_arm, _decode_data, _decode_setup, _label_windows,
                                             _n_labels, _probe_features, init_model, run_decode_seed, tune_decoders)
from icml26.methods.calm.model import PatchTokenizer
from icml26.methods.calm.simulator import simulate_session

pytestmark = pytest.mark.usefixtures("one_thread")
SPEC = next(s for s in SPECS if s.id == "decode_low_label")


def test_head_is_neuron_permutation_invariant_and_shapes():
    torch.manual_seed(0)
    head = DecodingHead(16, 4)
    h = torch.randn(2, 7, 5, 16)
    out = head(h)
    assert out.shape == (2, 5)
    torch.testing.assert_close(head(h[:, torch.randperm(7)]), out, rtol=1e-5, atol=1e-5)
    assert PatchMLP(7)(torch.randn(9, 7)).shape == (9,)
    gru = PatchGRU(7)
    x = torch.randn(9, 7)
    y = gru(x)
    x2 = x.clone()
    x2[6:] += 1.0
    torch.testing.assert_close(gru(x2)[:6], y[:6])  # causal: the future does not change the past


def test_contrastive_loss_by_hand():
    enc = ContrastiveEncoder(3, dim=2)
    with torch.no_grad():  # a constant embedding: every candidate equally likely -> InfoNCE = ln B
        for p in enc.net.parameters():
            p.zero_()
        enc.net[2].bias.fill_(1.0)
    x, idx = torch.randn(10, 3), torch.arange(8)
    assert float(enc.loss(x, idx).detach()) == pytest.approx(math.log(8), abs=1e-5)


def test_lora_arm_keeps_backbone_and_smoke_run():
    cfg = SPEC.tiers["smoke"]
    backbone, data, acted = _decode_setup(cfg, 0)
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    out = run_decode_seed(cfg, 0, None)
    assert set(out["arms"]) == set(SPEC.arms)
    assert all(np.isfinite(v) for a in out["arms"].values() for v in a.values())
    assert set(out["checks"]) == {c.name for c in SPEC.checks}
    assert np.isfinite(out["statistics"][SPEC.comparator.statistic])
    for arm in ("calm_lora", "calm_head"):  # both arms train a deep copy: the shared backbone never changes
        r2 = _decode_arm(arm, 1e-2, data[0], 4, backbone, {**cfg, "decode_steps": 3}, 0)
        assert np.isfinite(r2)
    for k, v in backbone.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert data[0]["x"].shape[0] == data[0]["y"].shape[0] and np.isfinite(acted)


def test_null_arm_is_rejected():
    cfg = {**SPEC.tiers["smoke"], "null": True, "arms": ["calm_head", "ridge_raw"]}
    out = run_decode_seed(cfg, 0, None)
    assert out["arms"]["calm_head"] == out["arms"]["ridge_raw"]
    value = out["statistics"][SPEC.comparator.statistic]
    assert value <= 0.0 and not SPEC.comparator.holds(value) and not SPEC.comparator.holds(SPEC.null_value)


def test_decode_config_errors():
    with pytest.raises(ValueError, match="unknown config"):
        _dcfg(decode_step=3)
    from icml26.methods.calm.simulator import simulate_session
    with pytest.raises(ValueError, match="multiple of the backbone window"):
        _decode_data(simulate_session(0, 0, n_neurons=4, n_frames=400), {**SPEC.tiers["smoke"],
                                                                          "target_train_frames": 200})


def test_probe_claim_smoke_and_null():
    spec = next(s for s in SPECS if s.id == "probe_latents")
    cfg = spec.tiers["smoke"]
    out = spec.run(cfg, 0, None)
    assert set(out["arms"]) == set(spec.arms) and all(np.isfinite(a["score"]) for a in out["arms"].values())
    null = spec.run({**cfg, "null": True}, 0, None)
    assert null["statistics"]["probe_gain"] == 0.0 and not spec.comparator.holds(0.0)
    assert null["arms"]["raw_probe"] == out["arms"]["raw_probe"]


def test_probe_r2_recovers_a_linear_latent():
    from icml26.methods.calm.experiments import _probe_r2
    rng = np.random.default_rng(0)
    lat = rng.standard_normal((200, 3))
    feats = lat @ rng.standard_normal((3, 8)) + 5.0  # a linear, offset image of the latent
    assert _probe_r2(feats, lat, 100, 1e-6) > 0.999
    assert _probe_r2(rng.standard_normal((200, 8)), lat, 100, 1.0) < 0.1


def test_random_label_subsets_are_nested_shared_and_seeded():
    cfg = {**SPEC.tiers["smoke"], "label_order": "random"}
    sess = simulate_session(0, 0, n_neurons=4, n_frames=512)
    d = _decode_data(sess, cfg, 7)
    assert sorted(d["order"].tolist()) == list(range(d["n_train"]))  # a permutation of the train patches
    assert torch.equal(_decode_data(sess, cfg, 7)["order"], d["order"])  # same seed: same subsets for every arm
    assert not torch.equal(_decode_data(sess, cfg, 8)["order"], d["order"])
    assert torch.equal(_decode_data(sess, {**cfg, "label_order": "first"}, 7)["order"], torch.arange(d["n_train"]))
    lab = d["order"][:5].sort().values  # nested: a 5-label subset is the head of every larger one
    assert set(lab.tolist()) <= set(d["order"][:9].tolist())


def test_label_windows_point_at_the_labelled_patches():
    lab = torch.tensor([1, 3, 17, 40, 41, 63])  # 16 patches per window: windows 0, 1, 2, 3
    wins, pos = _label_windows(lab, 16)
    assert wins.tolist() == [0, 1, 2, 3]
    flat = torch.arange(64).reshape(4, 16)[wins].flatten()  # what a head's flattened output over those windows holds
    assert torch.equal(flat[pos], lab)
    wins, pos = _label_windows(torch.tensor([5, 50]), 16)  # a window without labels (1) is skipped
    assert wins.tolist() == [0, 3] and torch.equal(torch.arange(64).reshape(4, 16)[wins].flatten()[pos],
                                                   torch.tensor([5, 50]))


def test_probe_concat_features_keep_each_neuron_in_its_own_columns():
    cfg = {**SPEC.tiers["smoke"], "codebook_size": 8}
    sess = simulate_session(0, 0, n_neurons=3, n_frames=512)
    d = _decode_data(sess, cfg)
    tok = PatchTokenizer.fit(torch.randn(200, cfg["patch_len"], generator=torch.Generator().manual_seed(0)), 8)
    model = init_model(tok, cfg, 0).eval()
    cat = _probe_features("calm_probe", d, model, model, "concat")
    mean = _probe_features("calm_probe", d, model, model, "mean")
    D = cfg["d_model"]
    with torch.no_grad():
        h = model.features(model.inputs_from_traces(d["windows"]))  # (n_win, N, T_p, d)
    assert cat.shape == (h.shape[0] * h.shape[2], 3 * D) and mean.shape == (cat.shape[0], D)
    np.testing.assert_allclose(cat[:, D:2 * D], h[:, 1].reshape(-1, D).numpy(), rtol=1e-6)
    np.testing.assert_allclose(mean, cat.reshape(-1, 3, D).mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(_probe_features("raw_probe", d, model, model), d["x"].numpy())


def test_per_fraction_tuning_keys_and_values_reach_each_fraction():
    cfg = {**SPEC.tiers["smoke"], "arms": ["ridge_raw"], "label_fractions": [0.05, 1.0]}
    assert SPEC.tiers["full"]["tune_per_fraction"] and "tune_per_fraction" not in next(
        s for s in SPECS if s.id == "probe_latents").tiers["full"]  # the probe's config (and hash) is unchanged
    tuned = tune_decoders({**cfg, "tune_per_fraction": True})["tuning"]
    assert set(tuned["chosen"]) == {"ridge_raw@5pct", "ridge_raw@100pct"}
    prepared = {"tuning": {"chosen": {"ridge_raw@5pct": 1e6, "ridge_raw@100pct": 1e-3}}}
    out = run_decode_seed(cfg, 0, prepared)
    _, data, _ = _decode_setup(cfg, 0)
    for frac, alpha in ((0.05, 1e6), (1.0, 1e-3)):  # each fraction is decoded with its own penalty
        want = np.mean([_decode_arm("ridge_raw", alpha, d, _n_labels(d, frac), None, cfg, i)
                        for i, d in enumerate(data)])
        assert out["arms"]["ridge_raw"][f"r2_{int(100 * frac)}pct"] == pytest.approx(want, abs=1e-12)
