"""Tests for the Hugging Face wrappers of TinyLM: Auto classes, loss, save/load, tying, generate, Trainer, registry."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402

from icml26.models.hf import TinyLMForCausalLM, TinyLMHFConfig, register_tiny_lm  # noqa: E402
from icml26.models.tiny_lm import CausalSelfAttention, TinyLM, TinyLMConfig  # noqa: E402

SMALL = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def make_model(seed: int = 0, **overrides) -> TinyLMForCausalLM:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(TinyLMHFConfig(**{**SMALL, **overrides})).eval()


def tokens(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (b, t), generator=torch.Generator().manual_seed(seed))


class GainAttention(nn.Module):
    """Softmax attention scaled by a learned gain whose special initial value (0.5) must survive HF loading."""

    def __init__(self, config: TinyLMConfig, layer_idx: int, gain: float) -> None:
        super().__init__()
        self.inner = CausalSelfAttention(config, layer_idx)
        self.gain = nn.Parameter(torch.full((1,), gain))

    def forward(self, x: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        return self.gain * self.inner(x, cache=cache)


class GainConfig(TinyLMHFConfig):
    model_type = "icml26_test_gain"
    attention: str = "gain"
    gain_init: float = 0.5


class GainForCausalLM(TinyLMForCausalLM):
    config_class = GainConfig

    def build_attention_factory(self, config: GainConfig):
        return lambda tiny_config, layer_idx: GainAttention(tiny_config, layer_idx, config.gain_init)


def test_from_config_builds_the_tiny_lm_and_matches_its_logits():
    model = make_model()
    assert type(model) is TinyLMForCausalLM and isinstance(model.model, TinyLM)
    assert model.config.hidden_size == 32 and model.config.tie_word_embeddings is True
    idx = tokens(2, 12)
    out = model(idx)
    logits, _ = model.model(idx)
    assert out.loss is None and out.logits.shape == (2, 12, 32)
    torch.testing.assert_close(out.logits, logits, rtol=0, atol=0)


def test_hf_init_keeps_tiny_lm_initialisation():
    # post_init must not redraw weights: the wrapper holds exactly what TinyLM draws from the same seed.
    model = make_model(seed=3)
    torch.manual_seed(3)
    reference = TinyLM(TinyLMConfig(**SMALL))
    expected = reference.state_dict()
    actual = model.model.state_dict()
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=0, msg=name)
    assert model.model.lm_head.weight is model.model.tok_emb.weight


def test_invalid_sizes_fail_at_config_construction():
    with pytest.raises(ValueError, match="divisible"):
        TinyLMHFConfig(d_model=30, n_heads=4)


def test_loss_is_the_shifted_tiny_lm_loss():
    model = make_model()
    idx = tokens(3, 10)
    loss = model(idx, labels=idx).loss
    _, expected = model.model(idx[:, :-1], targets=idx[:, 1:])
    torch.testing.assert_close(loss, expected)

    labels = idx.clone()
    labels[0, 4:] = -100
    labels[2, :3] = -100
    logits = model(idx).logits
    shift_logits, shift_labels = logits[:, :-1].reshape(-1, 32), labels[:, 1:].reshape(-1)
    keep = shift_labels != -100
    torch.testing.assert_close(model(idx, labels=labels).loss, F.cross_entropy(shift_logits[keep], shift_labels[keep]))
    # Trainer's gradient-accumulation path: token sum over its own count.
    summed = model(idx, labels=labels, num_items_in_batch=torch.tensor(7)).loss
    torch.testing.assert_close(summed, F.cross_entropy(shift_logits[keep], shift_labels[keep], reduction="sum") / 7)

    assert model(idx, labels=idx, return_dict=False)[0] == loss


def test_padding_and_transformers_caches_are_rejected():
    model = make_model()
    idx = tokens(1, 6)
    model(idx, attention_mask=torch.ones_like(idx))
    with pytest.raises(ValueError, match="padding"):
        model(idx, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="padding"):
        model.generate(idx, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="cache"):
        model(idx, past_key_values=transformers.DynamicCache())


@pytest.mark.parametrize("tie", [True, False])
def test_save_and_from_pretrained_round_trip(tmp_path, tie):
    model = make_model(tie_embeddings=tie)
    idx = tokens(2, 9)
    expected = model(idx).logits
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    # A tied head is stored once, under the embedding.
    assert ("model.lm_head.weight" in saved) is not tie and "model.tok_emb.weight" in saved

    rng_before = torch.get_rng_state()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert type(loaded) is TinyLMForCausalLM and loaded.config.tie_embeddings is tie
    assert (loaded.model.lm_head.weight is loaded.model.tok_emb.weight) is tie
    # The RoPE tables are non-persistent: they must be recomputed, not left as transformers' empty placeholders.
    attn = loaded.model.blocks[1].attn.branch.fn
    torch.testing.assert_close(attn.rope_cos, model.model.blocks[1].attn.branch.fn.rope_cos, rtol=0, atol=0)
    torch.testing.assert_close(loaded(idx).logits, expected, rtol=0, atol=0)
    if tie:
        # Still one parameter after loading: a step on the embedding moves the head.
        with torch.no_grad():
            loaded.model.tok_emb.weight.add_(1.0)
        torch.testing.assert_close(loaded.model.lm_head.weight, loaded.model.tok_emb.weight, rtol=0, atol=0)


@pytest.mark.parametrize("use_cache", [None, True, False])
def test_greedy_generate_equals_tiny_lm_greedy(use_cache):
    model = make_model(seed=5)
    prompt = tokens(2, 5, seed=7)
    kwargs = {} if use_cache is None else {"use_cache": use_cache}
    out = model.generate(prompt, max_new_tokens=12, do_sample=False, **kwargs)
    expected = model.model.generate(prompt, 12, temperature=0, use_cache=False)
    assert out.shape == (2, 17)
    assert torch.equal(out, expected)


def test_trainer_updates_weights(tmp_path):
    model = make_model()
    model.train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in tokens(8, 16, seed=11)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    result = Trainer(model=model, args=args, train_dataset=data).train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    changed = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert "model.tok_emb.weight" in changed and len(changed) == len(before)
    assert model.model.lm_head.weight is model.model.tok_emb.weight


def test_subclass_registers_and_round_trips(tmp_path):
    register_tiny_lm(GainForCausalLM.config_class, GainForCausalLM)
    register_tiny_lm(GainConfig, GainForCausalLM)  # a second call is a no-op
    config = AutoConfig.for_model("icml26_test_gain", gain_init=0.25, **SMALL)
    assert type(config) is GainConfig and config.attention == "gain"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert type(model) is GainForCausalLM
    attn = model.model.blocks[0].attn.branch.fn
    assert isinstance(attn, GainAttention) and attn.gain.item() == 0.25

    with torch.no_grad():
        attn.gain.fill_(1.5)
    idx = tokens(2, 8)
    expected = model(idx).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is GainForCausalLM and loaded.config.gain_init == 0.25
    assert loaded.model.blocks[0].attn.branch.fn.gain.item() == 1.5
    torch.testing.assert_close(loaded(idx).logits, expected, rtol=0, atol=0)


def test_weights_missing_from_a_checkpoint_get_their_module_init(tmp_path):
    # A plain TinyLM checkpoint loaded into the subclass: the new gains are absent and must take the module's
    # own init (0.5), not transformers' uninitialised placeholders.
    register_tiny_lm(GainConfig, GainForCausalLM)
    make_model().save_pretrained(tmp_path)
    loaded, info = GainForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert "model.blocks.0.attn.branch.fn.gain" in info["missing_keys"]
    gains = [block.attn.branch.fn.gain.item() for block in loaded.model.blocks]
    assert gains == [0.5, 0.5]
    assert torch.isfinite(loaded(tokens(1, 5)).logits).all()


def test_register_rejects_conflicts():
    class OtherConfig(TinyLMHFConfig):
        model_type = TinyLMHFConfig.model_type

    class OtherForCausalLM(TinyLMForCausalLM):
        config_class = OtherConfig

    class StrayForCausalLM(TinyLMForCausalLM):
        pass

    class LlamaTypeConfig(TinyLMHFConfig):
        model_type = "llama"

    class LlamaTypeForCausalLM(TinyLMForCausalLM):
        config_class = LlamaTypeConfig

    register_tiny_lm(TinyLMHFConfig, TinyLMForCausalLM)
    with pytest.raises(ValueError, match="already registered"):
        register_tiny_lm(OtherConfig, OtherForCausalLM)
    with pytest.raises(ValueError, match="already registered"):
        register_tiny_lm(TinyLMHFConfig, StrayForCausalLM)
    with pytest.raises(ValueError, match="already registered"):
        register_tiny_lm(LlamaTypeConfig, LlamaTypeForCausalLM)
    with pytest.raises(ValueError, match="config_class"):
        register_tiny_lm(GainConfig, TinyLMForCausalLM)
    # The failed calls left the registry alone.
    assert type(AutoConfig.for_model(TinyLMHFConfig.model_type)) is TinyLMHFConfig
    assert type(AutoModelForCausalLM.from_config(TinyLMHFConfig(**SMALL))) is TinyLMForCausalLM
