"""FiX / FoX / softmax TinyLMs as Hugging Face models: Auto classes, save/load, generate, Trainer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402

from icml26.methods.fix_attention import FiXAttention, FoXAttention  # noqa: E402
from icml26.methods.fix_attention.hf import FixForCausalLM, FixLMConfig  # noqa: E402
from icml26.models.tiny_lm import CausalSelfAttention  # noqa: E402

SMALL = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)
KINDS = {"fix": FiXAttention, "fox": FoXAttention, "softmax": CausalSelfAttention}


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(attention: str, seed: int = 0, **options) -> FixForCausalLM:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(FixLMConfig(attention=attention, **SMALL, **options)).eval()


def _tokens(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention", sorted(KINDS))
def test_from_config_save_from_pretrained_and_generate(attention, tmp_path):
    model = _model(attention, gate_rank=4)
    assert type(model) is FixForCausalLM
    assert isinstance(model.model.blocks[0].attn.branch.fn, KINDS[attention])
    idx = _tokens(2, 11)
    expected = model(idx).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is FixForCausalLM and loaded.config.attention == attention
    assert loaded.config.gate_rank == 4
    torch.testing.assert_close(loaded(idx).logits, expected, rtol=0, atol=0)
    prompt = _tokens(2, 4, seed=3)
    out = loaded.generate(prompt, max_new_tokens=8, do_sample=False)
    # transformers recomputes the prefix each step; TinyLM's own generate uses the layer's decode cache.
    assert torch.equal(out, loaded.model.generate(prompt, 8, temperature=0, use_cache=True))


def test_auto_config_and_validation():
    config = AutoConfig.for_model("icml26_fix", attention="fox", **SMALL)
    assert type(config) is FixLMConfig and config.attention_config().attention == "fox"
    with pytest.raises(ValueError, match="gate_form"):
        FixLMConfig(gate_form="cubic", **SMALL)
    with pytest.raises(ValueError, match="attention"):
        FixLMConfig(attention="linear", **SMALL)


def test_trainer_three_steps_update_every_weight(tmp_path):
    model = _model("fix")
    model.train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in _tokens(8, 24, seed=11)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=1e-2)
    result = Trainer(model=model, args=args, train_dataset=data).train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    unchanged = [name for name, p in model.named_parameters() if torch.equal(p.detach(), before[name])]
    assert not unchanged, f"not trained: {unchanged}"
