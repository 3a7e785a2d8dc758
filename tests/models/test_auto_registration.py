"""Saved icml26 models reload with transformers' Auto classes after a plain ``import icml26`` (icml26.models.auto).

The reload checks run in fresh interpreters: in this test process the rooms are already imported, so their
classes are registered for real and would hide a missing deferred registration.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from icml26.methods.fix_attention import FixLMConfig, convert_to_fix  # noqa: E402
from icml26.methods.kromhc import convert_to_hyper_connections  # noqa: E402
from icml26.methods.kromhc.hf import KromHCLMConfig  # noqa: E402
from icml26.models.auto import DEFERRED_MODEL_TYPES, DeferredConfig  # noqa: E402
from icml26.models.hf import TinyLMForCausalLM, TinyLMHFConfig  # noqa: E402

TINY = dict(vocab_size=40, d_model=32, n_layers=1, n_heads=2, max_seq_len=64)
LLAMA = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()


def _save_all(root) -> torch.Tensor:
    """Save one model of each kind under ``root/<name>`` with its logits on shared ids; return the ids."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    models = {
        "tiny_lm": TinyLMForCausalLM(TinyLMHFConfig(**TINY)),
        "fix": AutoModelForCausalLM.from_config(FixLMConfig(**TINY, attention="fix")),
        "kromhc": AutoModelForCausalLM.from_config(KromHCLMConfig(**TINY, residual_kind="kromhc", num_streams=4)),
        "fix_llama": convert_to_fix(_llama(1), "fix"),
        "kromhc_llama": convert_to_hyper_connections(_llama(2), "kromhc"),
    }
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    for name, model in models.items():
        model.eval().save_pretrained(root / name)
        with torch.no_grad():
            torch.save(model(ids).logits, root / name / "expected_logits.pt")
    torch.save(ids, root / "ids.pt")
    return ids


RELOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
root = sys.argv[1]
ids = torch.load(root + "/ids.pt")
for name in ("tiny_lm", "fix", "kromhc", "fix_llama", "kromhc_llama"):
    model = AutoModelForCausalLM.from_pretrained(root + "/" + name).eval()
    with torch.no_grad():
        # Not bit-exact: this interpreter may use another thread count than the one that saved (float sums).
        torch.testing.assert_close(model(ids).logits, torch.load(root + "/" + name + "/expected_logits.pt"),
                                   rtol=1e-5, atol=1e-6)
    print(name, type(model).__name__)
"""


def _run(script: str, root) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, env=env,
                          timeout=300)


EXPECTED_CLASSES = ["tiny_lm TinyLMForCausalLM", "fix FixForCausalLM", "kromhc KromHCForCausalLM",
                    "fix_llama FixLlamaForCausalLM", "kromhc_llama KromHCLlamaForCausalLM"]


def test_plain_import_is_cheap_and_saved_models_reload_with_equal_logits(tmp_path):
    _save_all(tmp_path)
    script = ("import sys\nimport icml26\n"
              "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'import icml26 is not cheap'\n"
              + RELOAD)
    done = _run(script, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:5] == EXPECTED_CLASSES
    assert "upgrad" not in (done.stdout + done.stderr).lower()


def test_import_after_transformers_also_registers_and_without_it_loading_fails(tmp_path):
    """transformers' Auto classes imported first: loading fails until ``import icml26`` (so the reload above is
    really due to icml26's registration), then works."""
    _save_all(tmp_path)
    script = RELOAD.replace(
        "root = sys.argv[1]\n",
        "root = sys.argv[1]\n"
        "try:\n"
        "    AutoModelForCausalLM.from_pretrained(root + '/fix')\n"
        "except (ValueError, KeyError) as error:\n"
        "    print('without icml26:', type(error).__name__)\n"
        "else:\n"
        "    raise SystemExit('loaded an icml26 model without importing icml26')\n"
        "import icml26\n")
    done = _run(script, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")
    assert lines[0].startswith("without icml26:") and lines[1:6] == EXPECTED_CLASSES


def test_deferred_entries_name_real_registered_classes():
    """Every deferred entry points at a class that exists, carries that model_type, and is what AutoConfig holds
    once its room is imported (the rooms are imported above, so their own registration replaced the entries)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type, (module, name) in DEFERRED_MODEL_TYPES.items():
        real = DeferredConfig(model_type, module, name).resolve()
        assert real.model_type == model_type and real.__name__ == name
        assert CONFIG_MAPPING[model_type] is real
    deferred = DeferredConfig("icml26_fix", *DEFERRED_MODEL_TYPES["icml26_fix"])
    config = deferred(**TINY, attention="fox")  # calling the entry builds the real config
    assert type(config) is FixLMConfig and config.attention == "fox"
    assert AutoConfig.for_model("icml26_fix", **TINY).attention == "fix"
