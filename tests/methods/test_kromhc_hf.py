"""KromHC / HC / mHC / mHC-lite TinyLMs as Hugging Face causal LMs: Auto classes, save/load, generate, Trainer."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402

from icml26.methods.kromhc import HyperResidual, KromHC, MHCLite  # noqa: E402
from icml26.methods.kromhc.hf import KromHCForCausalLM, KromHCLMConfig  # noqa: E402
from icml26.models.hf import TinyLMForCausalLM, TinyLMHFConfig  # noqa: E402
from icml26.models.tiny_lm import TinyLM  # noqa: E402

SMALL = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_seq_len=32)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _model(seed: int = 0, **fields) -> KromHCForCausalLM:
    torch.manual_seed(seed)
    config = AutoConfig.for_model("icml26_kromhc", **{**SMALL, **fields})
    return AutoModelForCausalLM.from_config(config).eval()


def _tokens(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (b, t), generator=torch.Generator().manual_seed(seed))


def _perturb_hyper_connections(model: torch.nn.Module) -> None:
    """Zero-init projections would make a broken save/load look fine; move every HC parameter."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".branch." not in name and "blocks" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def test_from_config_builds_the_hyper_connected_tiny_lm():
    model = _model(residual_kind="kromhc", num_streams=4, home_stream="cyclic")
    assert type(model) is KromHCForCausalLM and type(model.config) is KromHCLMConfig
    assert isinstance(model.model.blocks[1].mlp, KromHC) and model.model.blocks[1].mlp.home_stream == 3
    torch.manual_seed(0)
    reference = TinyLM(model.config.tiny_lm_config(), residual=HyperResidual(4, 16, home_stream="cyclic"))
    idx = _tokens(2, 9)
    assert torch.equal(model(idx).logits, reference(idx)[0])


def test_residual_kind_residual_is_the_plain_hf_model():
    plain = (torch.manual_seed(0), AutoModelForCausalLM.from_config(TinyLMHFConfig(**SMALL)))[1].eval()
    switched = _model(residual_kind="residual")
    idx = _tokens(2, 9)
    assert type(plain) is TinyLMForCausalLM and torch.equal(plain(idx).logits, switched(idx).logits)


@pytest.mark.parametrize("kind", ["kromhc", "mhc_lite"])
def test_save_and_from_pretrained_round_trip(tmp_path, kind):
    model = _model(residual_kind=kind, num_streams=4, res_logit_gap=4.0)
    _perturb_hyper_connections(model)
    idx = _tokens(2, 9)
    expected = model(idx).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is KromHCForCausalLM and loaded.config.residual_kind == kind
    assert loaded.config.res_logit_gap == 4.0
    if kind == "mhc_lite":  # the permutation matrices are a non-persistent buffer: rebuilt, not left empty
        assert isinstance(loaded.model.blocks[0].attn, MHCLite)
        assert torch.equal(loaded.model.blocks[0].attn.perms, model.model.blocks[0].attn.perms)
    assert torch.equal(loaded(idx).logits, expected)


def test_greedy_generate_equals_tiny_lm_cached_greedy():
    model = _model(residual_kind="kromhc", num_streams=4)
    _perturb_hyper_connections(model)
    prompt = _tokens(2, 4, seed=7)
    out = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, model.model.generate(prompt, 6, temperature=0, use_cache=True))


def test_trainer_trains_the_hyper_connection_parameters(tmp_path):
    model = _model(residual_kind="kromhc", num_streams=4).train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in _tokens(8, 12, seed=11)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=1e-2)
    result = Trainer(model=model, args=args, train_dataset=data).train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    changed = {name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])}
    # Not block 0's attention: its input streams are identical copies of the embedding, which every doubly
    # stochastic H_res leaves unchanged, so its residual logits get exactly zero gradient.
    for name in ("static_alpha", "dynamic_alpha_fn", "residual_scale", "dynamic_beta_fn", "h_post_scale"):
        assert f"model.blocks.1.attn.{name}" in changed


def test_plain_checkpoint_loads_into_a_kromhc_model_with_fresh_hyper_connections(tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(TinyLMHFConfig(**SMALL)).save_pretrained(tmp_path)
    loaded, info = KromHCForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert "model.blocks.0.attn.static_alpha" in info["missing_keys"]
    layer = loaded.model.blocks[0].attn
    assert torch.equal(layer.dynamic_alpha_fn, torch.zeros_like(layer.dynamic_alpha_fn))
    assert torch.equal(layer.static_alpha[4:], torch.tensor([0.0, -8.0, 0.0, -8.0]))


@pytest.mark.parametrize("fields, match", [({"residual_kind": "kromhc", "num_streams": 6}, "power of two"),
                                           ({"residual_kind": "mhc_lite", "num_streams": 8}, "infeasible"),
                                           ({"residual_kind": "xhc"}, "kind")])
def test_invalid_residual_fields_fail_at_config_construction(fields, match):
    with pytest.raises(ValueError, match=match):
        KromHCLMConfig(**SMALL, **fields)
