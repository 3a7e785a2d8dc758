"""SHERPA: Fisher ratios, restricted attention and KL against plain references; FRS picks separating channels; the
guidance weight at 0 is plain fine-tuning; LoRA starts as the base model; data and segmenter shapes; config
validation; the null arm of each claim."""

from __future__ import annotations

import pytest
import torch

from icml26.core.testing import assert_close
from icml26.methods.sherpa import reference as ref
from icml26.methods.sherpa.config import SherpaConfig
from icml26.methods.sherpa.data import GENERAL_VARIANTS, general_batch, nuclei_batch
from icml26.methods.sherpa.method import (attention_kl, finetune, fisher_ratio, frs_channels, restricted_attention,
                                          token_labels)
from icml26.methods.sherpa.model import LARGE, SMALL, LoRALinear, PromptableSegmenter, add_lora, seg_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def test_fisher_ratio_matches_reference_and_finds_the_separating_channel():
    g = torch.Generator().manual_seed(0)
    labels = torch.rand(40, generator=g) > 0.5
    feats = torch.randn(40, 5, generator=g)
    feats[:, 3] += 3.0 * labels
    fast = fisher_ratio(feats, labels)
    assert_close("fisher ratio", ref.fisher_ratio(feats, labels).float(), fast, 1e-5)
    assert int(fast.argmax()) == 3
    with pytest.raises(ValueError, match="at least 2"):
        fisher_ratio(feats[:3], torch.tensor([True, False, False]))


def test_restricted_attention_and_kl_match_reference():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 7, 6, generator=g), torch.randn(2, 7, 6, generator=g)
    U = torch.tensor([1, 4, 5])
    fast = restricted_attention(q, k, U)
    for b in range(2):
        assert_close("attention", ref.restricted_attention(q[b], k[b], U.tolist()).float(), fast[b], 1e-5)
    t = torch.softmax(torch.randn(2, 7, 7, generator=g), -1)
    want = sum(ref.attention_kl(t[b], fast[b]) for b in range(2)) / 2
    assert attention_kl(t, fast).item() == pytest.approx(want, rel=1e-5)
    assert attention_kl(t, t).abs().item() < 1e-6


def test_token_labels_match_reference():
    m = nuclei_batch(3, 0).mask
    fast = token_labels(m, 4)
    for b in range(3):
        assert fast[b].tolist() == ref.token_labels(m[b], 4)


def test_data_and_segmenter_shapes():
    for v in GENERAL_VARIANTS:
        b = general_batch(4, 0, v)
        assert b.image.shape == (4, 1, 32, 32) and b.mask.shape == (4, 32, 32)
        assert all(b.mask[i, int(b.point[i, 0]), int(b.point[i, 1])] == 1 for i in range(4))
    n = nuclei_batch(4, 0)
    for size in (SMALL, LARGE):
        model = PromptableSegmenter(size)
        out = model(n.image, n.point, n.box)
        assert out.shape == (4, 32, 32)
        seg_loss(out, n.mask).backward()
        assert model.blocks[-1].attention_map().shape == (4, 64, 64)


def test_lora_starts_as_the_base_model_and_trains_only_adapters_and_decoder():
    torch.manual_seed(0)
    model = PromptableSegmenter(SMALL)
    b = nuclei_batch(2, 0)
    before = model(b.image, b.point)
    params = add_lora(model, 2)
    assert torch.allclose(model(b.image, b.point), before, atol=1e-6)
    assert isinstance(model.blocks[0].attn.q, LoRALinear)
    ids = {id(p) for p in params}
    assert id(model.blocks[0].attn.q.A) in ids and id(model.blocks[0].attn.q.base.weight) not in ids
    assert id(model.hyper[0].weight) in ids and id(model.patch_embed.weight) not in ids


def test_frs_picks_top_channels_and_random_ablation_differs():
    torch.manual_seed(0)
    model = PromptableSegmenter(SMALL)
    data = nuclei_batch(16, 0)
    U, scores = frs_channels(model, data, SherpaConfig(k_frac=0.25, m_samples=16))
    assert len(U) == 8 and set(U.tolist()) == set(scores.topk(8).indices.tolist())
    Ur, _ = frs_channels(model, data, SherpaConfig(k_frac=0.25, m_samples=16, frs_features="random"), seed=3)
    assert len(Ur) == 8 and set(Ur.tolist()) != set(U.tolist())


@pytest.mark.parametrize("update", ["lora", "full", "decoder"])
def test_guidance_weight_zero_is_plain_finetuning(update):
    torch.manual_seed(0)
    large, small = PromptableSegmenter(SMALL), PromptableSegmenter(SMALL)
    data = nuclei_batch(16, 1)
    common = dict(steps=3, batch=4, lr=1e-2, seed=5)
    plain = finetune(large, data, cfg=SherpaConfig(lambda_g=0.0, update=update), **common)
    guided_off = finetune(large, data, cfg=SherpaConfig(lambda_g=0.0, update=update), guide=small,
                          channels=torch.arange(4), **common)
    guided_on = finetune(large, data, cfg=SherpaConfig(lambda_g=1.0, update=update), guide=small,
                         channels=torch.arange(4), **common)
    sd_p, sd_o, sd_g = plain.state_dict(), guided_off.state_dict(), guided_on.state_dict()
    assert all(torch.equal(sd_p[k], sd_o[k]) for k in sd_p)
    # guidance acts on the encoder's attention: it moves LoRA and full updates, and cannot reach a frozen encoder
    assert any(not torch.equal(sd_p[k], sd_g[k]) for k in sd_p) == (update != "decoder")


@pytest.mark.parametrize("kw,field", [(dict(lambda_g=-1.0), "lambda_g"), (dict(k_frac=0.0), "k_frac"),
                                      (dict(m_samples=1), "m_samples"), (dict(frs_features="x"), "frs_features"),
                                      (dict(update="x"), "update"), (dict(lora_rank=0), "lora_rank"),
                                      (dict(lambda_p=-0.1), "lambda_p"), (dict(lambda_sp=-1.0), "lambda_sp")])
def test_config_rejects_bad_values(kw, field):
    with pytest.raises(ValueError, match=field):
        SherpaConfig(**kw)


def test_null_arms_cannot_pass_the_comparators():
    """Sherpa switched back to each claim's baseline (lambda_g = 0 with LoRA is lora; lambda_g = 0 with full updates
    at the same learning rate is full_ft) gives a statistic of exactly 0, which neither comparator accepts."""
    from icml26.methods.sherpa import experiments as ex

    prepared = {"tuning": {"lr": {"chosen": {"lora": 3e-3, "full_ft": 3e-3}},
                           "weight": {"chosen": {"sherpa": 0.0, "kd_full": 0.0}}}}
    res = ex.run_seed({**ex.TIERS["smoke"], "arms": ["sherpa", "lora"]}, 0, prepared)
    assert res["statistics"]["dice_gain_vs_lora"] == 0.0
    assert not ex.SPECS[0].comparator.holds(res["statistics"]["dice_gain_vs_lora"])
    res = ex.run_seed({**ex.TIERS["smoke"], "arms": ["sherpa", "full_ft"], "sherpa_update": "full"}, 0, prepared)
    assert res["statistics"]["retention_gain_vs_full_ft"] == 0.0
    assert not ex.SPECS[1].comparator.holds(res["statistics"]["retention_gain_vs_full_ft"])


def test_decoder_only_leaves_the_image_encoder_untouched():
    torch.manual_seed(0)
    model = PromptableSegmenter(SMALL)
    out = finetune(model, nuclei_batch(16, 2), steps=3, batch=4, lr=1e-2, seed=0, cfg=SherpaConfig(update="decoder"))
    before, after = model.state_dict(), out.state_dict()
    enc = [k for k in before if k.startswith(("blocks.", "patch_embed.", "pos"))]
    assert enc and all(torch.equal(before[k], after[k]) for k in enc)
    assert not torch.equal(before["hyper.0.weight"], after["hyper.0.weight"])


def test_l2sp_penalty_is_the_squared_distance_to_the_start_and_pulls_weights_back():
    from icml26.methods.sherpa.method import l2sp_penalty

    a, b = torch.tensor([1.0, 2.0]), torch.tensor([[0.5]])
    assert l2sp_penalty([a + torch.tensor([3.0, -1.0]), b + 2], [a, b]).item() == pytest.approx(9 + 1 + 4)
    torch.manual_seed(0)
    model, data = PromptableSegmenter(SMALL), nuclei_batch(16, 3)
    common = dict(steps=4, batch=4, lr=1e-2, seed=1)

    def drift(m):
        return sum(((p - q) ** 2).sum() for p, q in zip(m.parameters(), model.parameters())).item()

    plain = finetune(model, data, cfg=SherpaConfig(update="full"), **common)
    pulled = finetune(model, data, cfg=SherpaConfig(update="full", lambda_sp=100.0), **common)
    assert drift(pulled) < drift(plain)


def test_finetune_rejects_bad_channels_before_training():
    model = PromptableSegmenter(SMALL)
    for bad in (torch.tensor([0, SMALL.dim]), torch.tensor([], dtype=torch.long), torch.tensor([-1])):
        with pytest.raises(ValueError, match="channels"):
            finetune(model, nuclei_batch(4, 0), steps=1, batch=2, lr=1e-3, seed=0, cfg=SherpaConfig(),
                     guide=model, channels=bad)


def test_pretraining_resumes_after_a_kill_exactly(tmp_path, monkeypatch):
    from icml26.methods.sherpa import pretrain

    monkeypatch.setattr(pretrain, "CHECKPOINT_EVERY", 2)
    monkeypatch.setattr(pretrain, "_monitor", lambda model, n=64: {})
    kw = dict(steps=4, batch=2, lr=1e-3, seed=3)
    whole = pretrain.train_general(SMALL, **kw, checkpoint=tmp_path / "a.ckpt")
    real, calls = pretrain.general_batch, []

    def dying(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(pretrain, "general_batch", dying)
    with pytest.raises(KeyboardInterrupt):
        pretrain.train_general(SMALL, **kw, checkpoint=tmp_path / "b.ckpt")
    assert torch.load(tmp_path / "b.ckpt", weights_only=True)["step"] == 2
    monkeypatch.setattr(pretrain, "general_batch", real)
    resumed = pretrain.train_general(SMALL, **kw, checkpoint=tmp_path / "b.ckpt")
    sa, sb = whole.state_dict(), resumed.state_dict()
    assert all(torch.allclose(sa[k], sb[k], atol=1e-6) for k in sa)


def test_committed_weights_load_without_building(monkeypatch):
    from icml26.methods.sherpa import pretrain

    def no_build(*a, **k):
        raise AssertionError("pretrained() tried to rebuild committed weights")

    monkeypatch.setattr(pretrain, "train_general", no_build)
    for name in ("small", "large"):
        assert (pretrain.WEIGHTS_DIR / pretrain.weights_name(name, steps=20)).exists()
        assert isinstance(pretrain.pretrained(name, steps=20), PromptableSegmenter)
    with pytest.raises(ValueError, match="small"):
        pretrain.pretrained("huge")
    # the default recipe names its whole chain (v2 continues v1), an explicit short one starts from scratch
    assert pretrain.weights_name("large").endswith("_mix_from_s1000_b32_seed12345_base.safetensors")
    assert "_from_" not in pretrain.weights_name("large", steps=20)


def test_general_variants_and_mix_and_bad_variant():
    b = general_batch(6, 0, "mix")
    assert b.image.shape == (6, 1, 32, 32)
    assert all(b.mask[i, int(b.point[i, 0]), int(b.point[i, 1])] == 1 for i in range(6))
    with pytest.raises(ValueError, match="variant"):
        general_batch(2, 0, "foggy")


def test_stardist_held_out_image_or_a_clear_error(monkeypatch):
    import importlib.util

    from icml26.core.assets import MissingAssetError
    from icml26.methods.sherpa.data import stardist_batch

    with pytest.raises(ValueError, match="downsample"):
        stardist_batch(downsample=0)
    if importlib.util.find_spec("stardist") is not None:
        b = stardist_batch()
        assert len(b) > 100 and b.image.shape[1:] == (1, 32, 32)
        assert all(b.mask[i, int(b.point[i, 0]), int(b.point[i, 1])] == 1 for i in range(len(b)))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(MissingAssetError, match="pip install --no-deps stardist"):
        stardist_batch()


def test_example_figure_round_trips_masks():
    from icml26.methods.sherpa import experiments as ex

    m = nuclei_batch(1, 0).mask[0]
    packed = ex._pack_mask(m)
    assert torch.equal(torch.tensor([c == "1" for c in packed]).reshape(32, 32).float(), m)
