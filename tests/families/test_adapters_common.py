"""The adapter contract, checked for every adapter method (peft-style case matrix).

An adapter room joins by exporting ``ADAPTER_CASES`` from its package: a list of ``(case_id, make)`` rows where
``make(linear, rank, alpha, name) -> AdapterLinear`` and ``case_id`` starts with the room name, so
``pytest -k <room>`` selects its rows. Rows are collected from every room folder that exists on disk.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from icml26.core.adapters import (AdapterConfig, LoRALinear, adapter_layers, count_trainable_parameters,
                                  inject_adapters, load_adapters, merge_adapters, merge_and_unload, save_adapters,
                                  unmerge_adapters)
from icml26.core.testing import assert_close

from icml26.core.registry import ROOMS


def _collect_cases() -> list:
    cases = [("lora", lambda linear, r, alpha, name: LoRALinear(linear, r, alpha))]
    for room in ROOMS:
        if (room.folder / "__init__.py").exists():
            cases += list(getattr(importlib.import_module(room.import_path), "ADAPTER_CASES", []))
    return cases


ADAPTER_CASES = _collect_cases()


def _mlp() -> tuple[nn.Module, torch.Tensor, list[str]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 9), nn.GELU(), nn.Linear(9, 4))
    return model, torch.randn(5, 12), ["0", "2"]


def _tiny_lm() -> tuple[nn.Module, torch.Tensor, list[str]]:
    from icml26.models.tiny_lm import TinyLM, TinyLMConfig

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16))
    attn = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and "attn" in n]
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in attn})[:2]
    return model, torch.randint(0, 256, (2, 11)), suffixes


def _hf_llama() -> tuple[nn.Module, torch.Tensor, list[str]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).eval(), torch.randint(0, 50, (2, 7)), ["q_proj", "v_proj"]


MODELS = {"mlp": _mlp, "tiny_lm": _tiny_lm, "hf_llama": _hf_llama}


def _out(model, x):
    with torch.no_grad():
        out = model(x)
    if isinstance(out, tuple):
        out = out[0]
    return getattr(out, "logits", out)


def _randomise_adapters(model, seed=1):
    """Stand-in for training: give every adapter parameter a non-trivial value."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


@pytest.fixture(params=list(MODELS), ids=list(MODELS))
def model_case(request):
    return MODELS[request.param]()


@pytest.mark.parametrize("case_id, make", ADAPTER_CASES, ids=[c[0] for c in ADAPTER_CASES])
class TestAdapterContract:
    def _inject(self, model, targets, make, r=3):
        return inject_adapters(model, AdapterConfig(r=r, alpha=6.0, target_modules=targets), make)

    def test_fresh_adapter_leaves_output_unchanged(self, case_id, make, model_case):
        model, x, targets = model_case
        before = _out(model, x)
        self._inject(model, targets, make)
        assert_close("fresh", before, _out(model, x), 1e-6)

    def test_merge_equals_unmerged_and_unmerge_restores(self, case_id, make, model_case):
        model, x, targets = model_case
        original = {k: v.clone() for k, v in model.state_dict().items()}
        names = self._inject(model, targets, make)
        _randomise_adapters(model)
        unmerged = _out(model, x)
        merge_adapters(model)
        assert_close("merged", unmerged, _out(model, x), 1e-5)
        unmerge_adapters(model)
        assert_close("unmerged again", unmerged, _out(model, x), 1e-5)
        for name, layer in adapter_layers(model):
            assert_close(f"{name} weight", original[f"{name}.weight"], layer.base.weight, 1e-6)
        assert len(names) >= 2

    def test_trainable_count_matches_formula(self, case_id, make, model_case):
        model, _, targets = model_case
        self._inject(model, targets, make)
        layers = list(adapter_layers(model))
        assert count_trainable_parameters(model) == sum(layer.expected_trainable() for _, layer in layers) > 0
        assert all(n.rsplit(".", 1)[-1].startswith(type(layer).prefix)
                   for name, layer in layers for n, p in layer.named_parameters() if p.requires_grad)

    def test_save_load_round_trip(self, case_id, make, model_case, tmp_path):
        model, x, targets = model_case
        self._inject(model, targets, make)
        _randomise_adapters(model)
        expected = _out(model, x)
        save_adapters(model, tmp_path / "adapter.safetensors")
        _randomise_adapters(model, seed=2)
        load_adapters(model, tmp_path / "adapter.safetensors")
        assert_close("reloaded", expected, _out(model, x), 1e-6)

    def test_merge_and_unload_restores_the_plain_layout(self, case_id, make, model_case):
        model, x, targets = model_case
        plain_keys = set(model.state_dict())
        self._inject(model, targets, make)
        _randomise_adapters(model)
        expected = _out(model, x)
        merge_and_unload(model)
        assert not list(adapter_layers(model)) and set(model.state_dict()) == plain_keys
        assert_close("merged and unloaded", expected, _out(model, x), 1e-5)

    def test_bad_configs_raise(self, case_id, make, model_case):
        model, _, targets = model_case
        for kwargs, field in [({"r": 0}, "r "), ({"r": -2}, "r "), ({"alpha": 0.0}, "alpha"),
                              ({"alpha": float("inf")}, "alpha"),
                              ({"target_modules": []}, "target_modules")]:
            with pytest.raises(ValueError, match=field):
                AdapterConfig(**{"target_modules": targets, **kwargs})
        with pytest.raises(ValueError, match="matched no nn.Linear"):
            inject_adapters(model, AdapterConfig(target_modules=["no_such_module"]), make)
        with pytest.raises(ValueError, match="rank_pattern"):
            inject_adapters(model, AdapterConfig(target_modules=targets, rank_pattern={"nowhere": 2}), make)
        self._inject(model, targets, make)
        with pytest.raises(ValueError, match="already have an adapter"):
            self._inject(model, targets, make)
        with pytest.raises(ValueError, match="already have an adapter"):
            self._inject(model, ".*", make)


def test_rank_pattern_follows_peft_key_rule():
    cfg = AdapterConfig(r=4, target_modules=["q"], rank_pattern={"layers.0.q": 2, r"^blk\.1\.q$": 6})
    assert cfg.rank_for("model.layers.0.q") == 2 and cfg.rank_for("layers.0.q") == 2
    assert cfg.rank_for("model.layers.10.q") == 4  # "layers.0.q" must match a whole dotted suffix
    assert cfg.rank_for("blk.1.q") == 6 and cfg.rank_for("x.blk.1.q") == 4


def test_merged_llama_saves_a_checkpoint_plain_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, x, targets = _hf_llama()
    inject_adapters(model, AdapterConfig(r=2, alpha=4.0, target_modules=targets),
                    lambda linear, r, alpha, name: LoRALinear(linear, r, alpha))
    _randomise_adapters(model)
    expected = _out(model, x)
    merge_and_unload(model).save_pretrained(tmp_path)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert_close("from_pretrained after merge_and_unload", expected, _out(reloaded, x), 1e-5)


def test_a_rank_above_the_layer_dims_is_refused_before_the_model_changes():
    model, x, _ = _mlp()  # layers 12->20, 20->9, 9->4
    before = _out(model, x)
    flags = [p.requires_grad for p in model.parameters()]
    with pytest.raises(ValueError, match=r"exceeds min\(in_features, out_features\) = 4"):
        inject_adapters(model, AdapterConfig(r=6, target_modules=["0", "2", "4"]),
                        lambda linear, r, alpha, name: LoRALinear(linear, r, alpha))
    assert not list(adapter_layers(model)) and [p.requires_grad for p in model.parameters()] == flags
    assert_close("untouched", before, _out(model, x), 0.0)
