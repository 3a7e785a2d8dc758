"""Shared adapter machinery (a small version of peft's BaseTuner): inject, merge/unmerge, save/load, count.

A method subclasses :class:`AdapterLinear`, declares its parameter ``prefix`` and implements ``delta_weight``
(and, where it is cheaper, ``adapter_forward``). Everything else lives here, so every adapter room gets the
same contract, checked by ``tests/families/test_adapters_common.py``. :class:`PeftLoRA` /
:func:`peft_lora_adapters` show the adapters of a Hugging Face peft LoRA model through the same small surface, so
code that acts on LoRA factors (a penalty, an optimizer) also works on peft models.
"""

from .base import AdapterConfig, AdapterLinear, LoRALinear
from .inject import (adapter_layers, adapter_state_dict, count_trainable_parameters, find_target_modules,
                     inject_adapters, load_adapters, merge_adapters, merge_and_unload, save_adapters,
                     unmerge_adapters)
from .peft_lora import PeftLoRA, peft_lora_adapters

__all__ = ["AdapterConfig", "AdapterLinear", "LoRALinear", "PeftLoRA", "adapter_layers", "adapter_state_dict",
           "count_trainable_parameters", "find_target_modules", "inject_adapters", "load_adapters",
           "merge_adapters", "merge_and_unload", "peft_lora_adapters", "save_adapters",
           "unmerge_adapters"]
