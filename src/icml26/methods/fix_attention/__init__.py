"""FiX (fine-grained forget gates in softmax attention) and its baselines FoX and softmax + RoPE.

For TinyLM: the layers, the factory and the kernels. For Hugging Face (when ``transformers`` is installed):
``FixLMConfig`` / ``FixForCausalLM`` (TinyLM models, type "icml26_fix") and :func:`convert_to_fix`, which turns a
Llama / Mistral / Qwen2 / Qwen3 causal LM into FiX or FoX attention (types "icml26_fix_llama", ...).

Importing this package registers all of them with ``AutoConfig`` / ``AutoModelForCausalLM``, so a saved model
reloads with ``AutoModelForCausalLM.from_pretrained(dir)`` after ``import icml26.methods.fix_attention`` (or only
``import icml26``, whose deferred entries import this package when transformers first needs the classes:
icml26.models.auto). This package therefore imports transformers when it is installed; without it the TinyLM parts
work alone.
"""

from __future__ import annotations

import importlib.util

from .chunked import fix_attention_chunked, fox_attention_chunked
from .config import FixConfig
from .layers import FiXAttention, FoXAttention, HeadRMSNorm, attention_factory, build_tiny_lm

__all__ = ["FiXAttention", "FixConfig", "FoXAttention", "HeadRMSNorm", "attention_factory", "build_tiny_lm",
           "fix_attention_chunked", "fox_attention_chunked"]

if importlib.util.find_spec("transformers") is not None:
    # Registration happens on import: a checkpoint's model_type is only known to transformers once its classes are.
    from .dropin import convert_to_fix, drop_in_config
    from .hf import FixForCausalLM, FixLMConfig

    __all__ += ["FixForCausalLM", "FixLMConfig", "convert_to_fix", "drop_in_config"]
