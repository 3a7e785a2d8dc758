"""Hugging Face peft LoRA layers seen through the same small surface as our :class:`LoRALinear`.

Methods that act on LoRA factors (a penalty on them, an optimizer that rescales them) should work on a peft model
as well as on ours. peft keeps one ``lora_A[adapter]`` / ``lora_B[adapter]`` pair of ``nn.Linear`` per adapter on
each ``LoraLayer``; :class:`PeftLoRA` exposes one such pair as ``A`` (r, d_in), ``B`` (d_out, r), ``scaling``,
``merged`` and the base weight as a (d_out, d_in) view, whichever way the base layer stores it (GPT-2's
``Conv1D`` stores (d_in, d_out), peft's ``fan_in_fan_out``). Found by duck typing, so peft is never imported here.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn


class PeftLoRA:
    """One adapter of a peft ``LoraLayer``: W = W0 + s B A with A (r, d_in), B (d_out, r), s = ``scaling``.

    Only vanilla LoRA qualifies: an adapter that uses a peft LoRA variant (DoRA, aLoRA, ...) computes something
    else from the same factors, and :func:`peft_lora_adapters` refuses it.
    """

    def __init__(self, module: nn.Module, adapter: str):
        self.module, self.adapter = module, adapter

    @property
    def A(self) -> nn.Parameter:
        return self.module.lora_A[self.adapter].weight

    @property
    def B(self) -> nn.Parameter:
        return self.module.lora_B[self.adapter].weight

    @property
    def scaling(self) -> float:
        return float(self.module.scaling[self.adapter])

    @property
    def merged(self) -> bool:
        return self.adapter in getattr(self.module, "merged_adapters", [])

    @property
    def base_weight(self) -> torch.Tensor:
        """The base layer's weight as a (d_out, d_in) view; in-place updates of the view reach the stored tensor."""
        weight = self.module.get_base_layer().weight
        return weight.T if getattr(self.module, "fan_in_fan_out", False) else weight

    def delta_weight(self) -> torch.Tensor:
        """s B A (d_out, d_in)."""
        return self.scaling * self.B @ self.A


def peft_lora_adapters(model: nn.Module) -> Iterator[tuple[str, PeftLoRA]]:
    """``(name, PeftLoRA)`` for every active adapter of every peft LoRA layer in ``model``, in module order.

    ``name`` is ``"<module name>[<adapter name>]"``. Raises ValueError for an adapter that uses a LoRA variant,
    whose output is not W0 + s B A.
    """
    for module_name, module in model.named_modules():
        lora_A, lora_B = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if not (isinstance(lora_A, nn.ModuleDict) and isinstance(lora_B, nn.ModuleDict)):
            continue
        variants = getattr(module, "lora_variant", {}) or {}
        for adapter in getattr(module, "active_adapters", list(lora_A.keys())):
            if adapter not in lora_A or adapter not in lora_B:
                continue
            if adapter in variants:
                raise ValueError(f"peft adapter {adapter!r} of {module_name!r} uses the LoRA variant "
                                 f"{type(variants[adapter]).__name__}, whose update is not s B A; only vanilla "
                                 "LoRA adapters are supported here")
            yield f"{module_name}[{adapter}]", PeftLoRA(module, adapter)
