"""ScaLoRA / ReLoRA adapter checkpoints: ``save_adapters`` + ``load_adapters`` restore the trained function exactly.

Both optimizers fold updates into the frozen base weights, so the factors alone describe a different function
(the old file reloaded a model whose output was off by about 0.3). The checkpoint now carries the changed base
weights; a file without them is refused for a model whose bases changed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from icml26.core.adapters import (AdapterConfig, LoRALinear, adapter_layers, inject_adapters, load_adapters,
                                  save_adapters)
from icml26.core.testing import assert_close
from icml26.methods.scalora import ReLoRAOptimizer, ScaLoRALinear, ScaLoRAOptimizer

MAKERS = {"scalora": lambda linear, r, alpha, name: ScaLoRALinear(linear, r, alpha),
          "lora": lambda linear, r, alpha, name: LoRALinear(linear, r, alpha)}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 9), nn.GELU(), nn.Linear(9, 4))


def _adapted(base, kind):
    model = copy.deepcopy(base)
    torch.manual_seed(1)
    inject_adapters(model, AdapterConfig(r=3, alpha=6.0, target_modules=["0", "2"]), MAKERS[kind])
    return model


def _train(model, wrap, steps=6):
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 12, generator=gen), torch.randn(16, 4, generator=gen)
    opt = wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2))
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


WRAPS = {"scalora": ScaLoRAOptimizer, "relora": lambda model, opt: ReLoRAOptimizer(model, opt, every=2)}


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("wrap", list(WRAPS))
def test_trained_adapters_round_trip_exactly_into_a_fresh_model(kind, wrap, tmp_path):
    torch.set_num_threads(1)
    base = _mlp()
    x = torch.randn(5, 12)
    model = _adapted(base, kind)
    _train(model, WRAPS[wrap])
    assert all(layer.base_modified for _, layer in adapter_layers(model))
    expected = model(x).detach()
    save_adapters(model, tmp_path / "adapter.safetensors")
    assert {"0.base.weight", "2.base.weight"} <= set(load_file(tmp_path / "adapter.safetensors"))

    fresh = _adapted(base, kind)
    assert (fresh(x) - expected).abs().max() > 1e-2  # the untrained model is far off
    load_adapters(fresh, tmp_path / "adapter.safetensors")
    assert torch.equal(fresh(x).detach(), expected)
    assert all(layer.base_modified for _, layer in adapter_layers(fresh))


def test_a_file_without_the_changed_bases_is_refused_before_anything_loads(tmp_path):
    base = _mlp()
    model = _adapted(base, "scalora")
    save_adapters(model, tmp_path / "untrained.safetensors")   # factors only: no base had changed yet
    assert not any(k.endswith("base.weight") for k in load_file(tmp_path / "untrained.safetensors"))
    _train(model, WRAPS["scalora"])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="changed in training"):
        load_adapters(model, tmp_path / "untrained.safetensors")
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    load_adapters(_adapted(base, "scalora"), tmp_path / "untrained.safetensors")  # a fresh model takes it


def test_untouched_bases_are_not_saved_and_a_model_without_adapters_is_refused(tmp_path):
    model = _adapted(_mlp(), "scalora")
    save_adapters(model, tmp_path / "a.safetensors")
    assert set(load_file(tmp_path / "a.safetensors")) == {"0.scalora_A", "0.scalora_B", "2.scalora_A", "2.scalora_B"}
    with pytest.raises(ValueError, match="no icml26 adapter layer"):
        save_adapters(_mlp(), tmp_path / "b.safetensors")
