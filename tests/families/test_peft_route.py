"""LoKRA, LoKRA+ and ScaLoRA through Hugging Face peft's own API, offline on tiny transformers models.

Each route is checked against our own adapters: same seed (or copied weights) -> same logits, after a few
training steps, after ``save_pretrained`` / ``PeftModel.from_pretrained`` and after ``merge_and_unload``. GPT-2's
``Conv1D`` projections are supported by the peft route and refused by name by our own injection. The README
peft blocks of both rooms are executed as written.
"""

from __future__ import annotations

import copy
import pathlib
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from icml26.core.adapters import AdapterConfig, adapter_layers, inject_adapters, merge_and_unload  # noqa: E402
from icml26.core.testing import assert_close  # noqa: E402
from icml26.methods.lokra import (LoKRAConfig, LoKRALinear, LoKRAPeftConfig, LoKRAPlusPeftLinear,  # noqa: E402
                                  kruskal_penalty, lokra_make, lokra_plus_make)
from icml26.methods.scalora import ScaLoRALinear, ScaLoRAOptimizer, effective_weight, lora_layers  # noqa: E402

ROOT = pathlib.Path(__file__).parents[2]
TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).eval(), torch.randint(0, 50, (2, 7))


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval(), torch.randint(0, 50, (2, 7))


def _logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def _train(model, x, steps=3, *, penalty=False, wrap=None, lr=1e-2):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    if wrap is not None:
        opt = wrap(model, opt)
    for _ in range(steps):
        loss = model(input_ids=x, labels=x).loss
        if penalty:
            loss = loss + kruskal_penalty(model)
        loss.backward()
        opt.step()
        opt.zero_grad()


# ------------------------------------------------------------------------------------------------------- LoKRA+
def test_lokra_plus_through_peft_trains_saves_reloads_and_merges_like_our_layer(tmp_path):
    base, x = _llama()
    lokra = LoKRAConfig(lam=0.1, plus_budget="grow")
    ours = copy.deepcopy(base)
    torch.manual_seed(1)
    inject_adapters(ours, AdapterConfig(r=2, alpha=4.0, target_modules=TARGETS), lokra_plus_make(lokra))
    torch.manual_seed(1)
    model = peft.get_peft_model(copy.deepcopy(base), LoKRAPeftConfig(r=2, lora_alpha=4.0, target_modules=TARGETS,
                                                                     lokra_plus=True, lokra=lokra))
    layers = [m for m in model.modules() if isinstance(m, LoKRAPlusPeftLinear)]
    assert len(layers) == 4
    # Same seed -> the same factors, and only they train.
    ours_params = [p for p in ours.parameters() if p.requires_grad]
    peft_params = [p for p in model.parameters() if p.requires_grad]
    assert len(ours_params) == len(peft_params) == 8
    assert all(torch.equal(a, b) for a, b in zip(ours_params, peft_params))
    assert_close("penalty", kruskal_penalty(ours), kruskal_penalty(model), 1e-6)

    _train(ours, x, penalty=True)
    _train(model, x, penalty=True)
    expected = _logits(ours, x)
    assert (expected - _logits(base, x)).abs().max() > 1e-2  # training moved the function
    assert_close("trained through peft", expected, _logits(model, x), 1e-6)

    model.save_pretrained(tmp_path / "adapter")
    config = LoKRAPeftConfig.from_pretrained(tmp_path / "adapter")
    assert config.lokra_plus and config.lokra_config == lokra
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter", config=config)
    assert_close("PeftModel.from_pretrained", expected, _logits(reloaded, x), 1e-6)

    merged = reloaded.merge_and_unload()
    assert not any(isinstance(m, LoKRAPlusPeftLinear) for m in merged.modules())
    merged.save_pretrained(tmp_path / "merged")
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert_close("merge_and_unload + vanilla from_pretrained", expected, _logits(plain, x), 1e-5)
    assert_close("ours merged", _logits(merge_and_unload(ours), x), _logits(plain, x), 1e-5)


def test_lokra_plus_peft_layer_disables_merges_and_unmerges():
    base, x = _llama()
    model = peft.get_peft_model(base, LoKRAPeftConfig(r=2, lora_alpha=4.0, target_modules=TARGETS, lokra_plus=True,
                                                      lokra={"plus_budget": "grow", "plus_init": "zero_v"}))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)
    plain, adapted = None, _logits(model, x)
    with model.disable_adapter():
        plain = _logits(model, x)
    assert (adapted - plain).abs().max() > 1e-3
    model.merge_adapter()
    assert_close("merged", adapted, _logits(model, x), 1e-5)
    model.unmerge_adapter()
    assert_close("unmerged", adapted, _logits(model, x), 1e-5)


# -------------------------------------------------------------------------------------------------------- LoKRA
def test_lokra_through_peft_is_vanilla_lora_plus_the_stored_penalty(tmp_path):
    base, x = _llama()
    lokra = LoKRAConfig(lam=0.3, coherence="soft_max")
    model = peft.get_peft_model(copy.deepcopy(base), LoKRAPeftConfig(r=2, lora_alpha=4.0, target_modules=TARGETS,
                                                                     lokra=lokra))
    assert sum(type(m) is peft.tuners.lora.Linear for m in model.modules()) == 4
    ours = copy.deepcopy(base)
    inject_adapters(ours, AdapterConfig(r=2, alpha=4.0, target_modules=TARGETS), lokra_make(lokra))
    with torch.no_grad():  # the same weights: peft's A, B into our LoKRA layers (peft's B made non-zero first)
        for (_, peft_lora), (_, layer) in zip(lora_layers(model), adapter_layers(ours)):
            peft_lora.B.normal_(0, 0.1)
            layer.lokra_A.copy_(peft_lora.A)
            layer.lokra_B.copy_(peft_lora.B)
    assert all(isinstance(layer, LoKRALinear) for _, layer in adapter_layers(ours))
    # The penalty reads lam / coherence from the LoKRAPeftConfig stored on the peft model.
    assert_close("stored-config penalty", kruskal_penalty(ours), kruskal_penalty(model), 1e-6)
    assert not torch.allclose(kruskal_penalty(model), kruskal_penalty(model, peft_config=LoKRAConfig()))

    _train(ours, x, penalty=True)
    _train(model, x, penalty=True)
    expected = _logits(ours, x)
    assert_close("trained through peft", expected, _logits(model, x), 1e-6)

    # A LoKRA checkpoint is a LoRA checkpoint: peft alone loads it, warning about our two config keys.
    model.save_pretrained(tmp_path / "adapter")
    with pytest.warns(UserWarning, match="lokra"):
        reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter")
    assert_close("plain peft reload", expected, _logits(reloaded, x), 1e-6)
    assert_close("merge_and_unload", expected, _logits(reloaded.merge_and_unload(), x), 1e-5)


# ------------------------------------------------------------------------------------------------------ ScaLoRA
def test_scalora_optimizer_on_a_peft_lora_model_trains_exactly_like_our_layer(tmp_path):
    base, x = _llama()
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS))
    ours = copy.deepcopy(base)
    inject_adapters(ours, AdapterConfig(r=2, alpha=4.0, target_modules=TARGETS),
                    lambda linear, r, alpha, name: ScaLoRALinear(linear, r, alpha))
    with torch.no_grad():
        for (_, peft_lora), (_, layer) in zip(lora_layers(model), lora_layers(ours)):
            layer.scalora_A.copy_(peft_lora.A)
            layer.scalora_B.copy_(peft_lora.B)

    _train(ours, x, wrap=ScaLoRAOptimizer)
    with pytest.warns(UserWarning, match="merge_and_unload"):
        _train(model, x, wrap=ScaLoRAOptimizer)
    expected = _logits(ours, x)
    assert_close("ScaLoRA on peft", expected, _logits(model, x), 1e-6)
    for (name, peft_lora), (_, layer) in zip(lora_layers(model), lora_layers(ours)):
        assert_close(f"{name} base", layer.base.weight, peft_lora.base_weight, 1e-6)
        assert not torch.equal(layer.base.weight, base.get_submodule(name.split("[")[0].removeprefix(
            "base_model.model.")).weight)  # the merges reached the base

    model.merge_and_unload().save_pretrained(tmp_path / "merged")
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert_close("merge_and_unload + vanilla from_pretrained", expected, _logits(plain, x), 1e-5)


def test_scalora_refuses_a_peft_lora_variant():
    base, _ = _llama()
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS, use_dora=True))
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(ValueError, match="variant"):
        ScaLoRAOptimizer(model, torch.optim.AdamW(params, lr=1e-2))


# ------------------------------------------------------------------------------------------ GPT-2's Conv1D layers
def test_our_injection_refuses_conv1d_by_name():
    model, x = _gpt2()
    before = _logits(model, x)
    with pytest.raises(ValueError, match=r"c_attn \(Conv1D\).*peft route"):
        inject_adapters(model, AdapterConfig(r=2, target_modules=["c_attn"]), lokra_make())
    assert not list(adapter_layers(model)) and all(p.requires_grad for p in model.parameters())
    assert_close("untouched", before, _logits(model, x), 0.0)


def test_lokra_plus_peft_on_conv1d_equals_the_dense_update():
    base, x = _gpt2()
    model = peft.get_peft_model(copy.deepcopy(base), LoKRAPeftConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                                     lokra_plus=True, lokra={"plus_budget": "grow"}))
    reference = copy.deepcopy(base)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoKRAPlusPeftLinear):
                module.lora_kr_U["default"].normal_(0, 0.3)
                dense = module._delta("default")                             # (d_out, d_in) = (96, 32)
                target = reference.get_submodule(name.removeprefix("base_model.model."))
                assert dense.shape == (96, 32) and target.weight.shape == (32, 96)
                target.weight += dense.T                                     # Conv1D stores (d_in, d_out)
    expected = _logits(reference, x)
    assert (expected - _logits(base, x)).abs().max() > 1e-3
    assert_close("LoKRA+ on Conv1D", expected, _logits(model, x), 1e-5)
    assert_close("merged", expected, _logits(model.merge_and_unload(), x), 1e-5)


def test_scalora_on_peft_conv1d_rescales_without_changing_the_function():
    base, x = _gpt2()
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"],
                                                      fan_in_fan_out=True))
    with torch.no_grad():
        for _, lora in lora_layers(model):
            lora.B.normal_(0, 0.2)
    params = [p for p in model.parameters() if p.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        opt = ScaLoRAOptimizer(model, torch.optim.SGD(params, lr=1e-2), proxy="sgd")
    before = _logits(model, x)
    bases = {name: lora.base_weight.clone() for name, lora in lora_layers(model)}
    weights = {name: effective_weight(lora) for name, lora in lora_layers(model)}
    model(input_ids=x, labels=x).loss.backward()
    opt.merge_rescale()  # the rescale alone: W0 absorbs s B (I - diag(uv)) A, the factors compensate
    assert_close("function kept", before, _logits(model, x), 1e-5)
    for name, lora in lora_layers(model):
        assert lora.base_weight.shape == (96, 32)  # a (d_out, d_in) view of Conv1D's (d_in, d_out) weight
        assert (lora.base_weight - bases[name]).abs().max() > 1e-6
        assert_close(f"{name} W0 + s B A", weights[name], effective_weight(lora), 1e-6)


# ---------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, error, match", [
    ({"lokra": {"lam": -1.0}}, ValueError, "lam"),
    ({"lokra": {"no_such_field": 1}}, ValueError, "no_such_field"),
    ({"lokra": 3}, TypeError, "lokra must be"),
    ({"lokra_plus": True, "use_dora": True}, ValueError, "use_dora"),
    ({"lokra_plus": True, "init_lora_weights": "gaussian"}, ValueError, "init_lora_weights"),
])
def test_bad_peft_configs_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        LoKRAPeftConfig(r=2, target_modules=TARGETS, **kwargs)


def test_lokra_plus_budget_error_names_the_minimum_rank():
    base, _ = _llama()
    with pytest.raises(ValueError, match="use r >="):
        peft.get_peft_model(base, LoKRAPeftConfig(r=1, target_modules=TARGETS, lokra_plus=True))


# ------------------------------------------------------------------------------------------------ README blocks
def _readme_block(room: str) -> str:
    text = (ROOT / f"src/icml26/methods/{room}/README.md").read_text()
    marker = text.index("<!-- tests/families/test_peft_route.py runs this block -->")
    return re.search(r"```python\n(.*?)```", text[marker:], re.S).group(1)


@pytest.mark.parametrize("room", ["lokra", "scalora"])
def test_readme_peft_block_runs(room, tmp_path, monkeypatch):
    """Executes the room README's peft block as written (it asserts its own results)."""
    monkeypatch.chdir(tmp_path)
    exec(compile(_readme_block(room), f"{room} README peft block", "exec"), {})
