"""Read logits from whatever a causal LM returns, so trainers accept TinyLM, Hugging Face models and plain modules."""

from __future__ import annotations

import torch
from torch import nn


def causal_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) of ``model`` on token ids (B, T).

    Accepts a module returning a tensor, a tuple whose first item is the logits (TinyLM's ``(logits, loss)``), or an
    object with ``.logits`` (Hugging Face ``CausalLMOutput``).
    """
    out = model(ids)
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    return out.logits
