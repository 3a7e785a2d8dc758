"""FiX (fine-grained forget gates in softmax attention) and its baselines FoX and softmax + RoPE, for TinyLM.

``FixLMConfig`` and ``FixForCausalLM`` (Hugging Face models, registered as "icml26_fix") load lazily from
``.hf``, so importing the room does not import transformers.
"""

from __future__ import annotations

from typing import Any

from .chunked import fix_attention_chunked, fox_attention_chunked
from .config import FixConfig
from .layers import FiXAttention, FoXAttention, HeadRMSNorm, attention_factory, build_tiny_lm

__all__ = ["FiXAttention", "FixConfig", "FixForCausalLM", "FixLMConfig", "FoXAttention", "HeadRMSNorm",
           "attention_factory", "build_tiny_lm", "fix_attention_chunked", "fox_attention_chunked"]


def __getattr__(name: str) -> Any:
    if name in ("FixLMConfig", "FixForCausalLM"):
        from . import hf

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
