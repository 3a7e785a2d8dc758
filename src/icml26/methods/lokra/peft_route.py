"""LoKRA and LoKRA+ through Hugging Face peft: ``get_peft_model(model, LoKRAPeftConfig(...))``.

* **LoKRA** is LoRA's layer plus a loss term, so ``LoKRAPeftConfig(lokra_plus=False)`` gives vanilla peft LoRA
  layers, and :func:`~icml26.methods.lokra.kruskal_penalty` (which reads the ``LoKRAConfig`` stored in this config)
  adds the term. The checkpoint is a plain peft LoRA checkpoint.
* **LoKRA+** needs its own layer: ``lokra_plus=True`` registers :class:`LoKRAPlusPeftLinear` for ``nn.Linear`` and
  transformers' ``Conv1D`` through peft's custom-module API (``LoraConfig._register_custom_module``, documented as
  experimental in peft's "Custom models" guide). peft does not persist that registration, so reload with
  ``PeftModel.from_pretrained(base, path, config=LoKRAPeftConfig.from_pretrained(path))``.

Both are ``LoraConfig`` subclasses with ``peft_type=LORA``, so the rest of peft (training, ``save_pretrained``,
``merge_and_unload``, ``disable_adapter``, several adapters) works unchanged. The LoKRA options travel in the
``adapter_config.json`` (field ``lokra``). This module imports peft; ``icml26.methods.lokra`` imports it lazily.

Checked against peft 0.21.2 (``peft/tuners/lora/layer.py``, ``model.py``, ``config.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from peft import LoraConfig
from peft.tuners.lora.layer import LoraLayer
from peft.tuners.tuners_utils import check_adapters_to_merge
from torch import nn
from torch.nn import functional as F
from transformers.pytorch_utils import Conv1D

from .adapter import _factor_penalty, plus_delta, plus_factors, plus_layout
from .config import LoKRAConfig


@dataclass
class LoKRAPeftConfig(LoraConfig):
    """peft's ``LoraConfig`` for LoKRA (``lokra_plus=False``) or LoKRA+ (``lokra_plus=True``).

    ``r`` and ``lora_alpha`` are the sizes (LoKRA+ matches LoRA-r's parameter budget, as in our
    :class:`~icml26.methods.lokra.LoKRAPlusLinear`); ``lokra`` holds the :class:`LoKRAConfig` (a LoKRAConfig or a
    dict of its fields; stored as a dict so it round-trips through ``adapter_config.json``). LoKRA+ layers support
    neither DoRA, ``lora_bias`` nor peft's alternative initialisations: they raise ValueError here.
    """

    lokra_plus: bool = field(default=False, metadata={
        "help": "False: LoKRA (vanilla peft LoRA layers; add kruskal_penalty(model) to the loss). True: LoKRA+ "
                "(Khatri-Rao layers LoKRAPlusPeftLinear on nn.Linear and transformers Conv1D)"})
    lokra: Any = field(default_factory=dict, metadata={
        "help": "the LoKRAConfig (penalty and LoKRA+ layout), as a LoKRAConfig or a dict of its fields"})

    def __post_init__(self) -> None:
        if isinstance(self.lokra, LoKRAConfig):
            self.lokra = dataclasses.asdict(self.lokra)
        if not isinstance(self.lokra, dict):
            raise TypeError(f"lokra must be a LoKRAConfig or a dict of its fields, got {type(self.lokra).__name__}")
        unknown = sorted(set(self.lokra) - {f.name for f in dataclasses.fields(LoKRAConfig)})
        if unknown:
            raise ValueError(f"lokra has unknown LoKRAConfig fields {unknown}")
        LoKRAConfig(**self.lokra)  # validates every field, raising ValueError that names it
        if self.lokra_plus:
            unsupported = [name for name, bad in (("use_dora", self.use_dora), ("lora_bias", self.lora_bias),
                                                  ("init_lora_weights", self.init_lora_weights is not True))
                           if bad]
            if unsupported:
                raise ValueError(f"LoKRA+ layers do not support {unsupported}; leave them at their defaults")
        super().__post_init__()
        if self.lokra_plus:
            # LoraConfig.__post_init__ resets the registry, so register afterwards.
            self._register_custom_module({nn.Linear: LoKRAPlusPeftLinear, Conv1D: LoKRAPlusPeftLinear})

    @property
    def lokra_config(self) -> LoKRAConfig:
        return LoKRAConfig(**self.lokra)

    @classmethod
    def from_peft_type(cls, **kwargs) -> "LoKRAPeftConfig":
        """Keep this class when loading (peft would build a plain LoraConfig from ``peft_type=LORA``)."""
        return cls(**kwargs)


class LoKRAPlusPeftLinear(nn.Module, LoraLayer):
    """LoKRA+ as a peft LoRA layer: y = base(x) + dropout(x) dWᵀ, dW = s (U ⊙ V)[:L] (or its transpose).

    Per adapter: ``lora_kr_U[adapter]`` U (p, n) and ``lora_kr_V[adapter]`` V (q, n), sized by
    :func:`~icml26.methods.lokra.plus_layout` and initialised by :func:`~icml26.methods.lokra.plus_factors`, the
    same functions :class:`~icml26.methods.lokra.LoKRAPlusLinear` uses, so equal factors give equal outputs. The
    base layer is an ``nn.Linear`` (weight (d_out, d_in)) or a transformers ``Conv1D`` (weight (d_in, d_out)).
    Names start with ``lora_`` because peft marks only such parameters trainable.
    """

    adapter_layer_names = ("lora_kr_U", "lora_kr_V")
    other_param_names = ("r", "lora_alpha", "scaling", "lora_dropout", "kr_layout", "kr_config")

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, r: int = 0,
                 lora_alpha: float = 1, **kwargs) -> None:
        super().__init__()
        LoraLayer.__init__(self, base_layer, **kwargs)
        self.fan_in_fan_out = isinstance(self.get_base_layer(), Conv1D)
        self.lora_kr_U = nn.ParameterDict({})
        self.lora_kr_V = nn.ParameterDict({})
        self.kr_layout: dict = {}
        self.kr_config: dict[str, LoKRAConfig] = {}
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def update_layer(self, adapter_name: str, r: int, lora_alpha: float, config: LoraConfig, **kwargs) -> None:
        if not isinstance(r, int) or r <= 0:
            raise ValueError(f"r must be a positive int, got {r!r}")
        lokra = config.lokra_config if isinstance(config, LoKRAPeftConfig) else LoKRAConfig()
        # Sized before anything is stored, so a budget error leaves the layer as it was.
        layout = plus_layout(self.out_features, self.in_features, r, kr_axis=lokra.kr_axis,
                             budget=lokra.plus_budget)
        weight = self.get_base_layer().weight
        U, V = plus_factors(layout, lokra, dtype=weight.dtype, device=weight.device)
        self.r[adapter_name], self.lora_alpha[adapter_name] = r, lora_alpha
        self.scaling[adapter_name] = lora_alpha / (math.sqrt(r) if config.use_rslora else r)
        self.use_rslora[adapter_name] = config.use_rslora
        self.lora_bias[adapter_name] = False
        dropout = nn.Dropout(p=config.lora_dropout) if config.lora_dropout > 0 else nn.Identity()
        self.lora_dropout.update(nn.ModuleDict({adapter_name: dropout}))
        self.lora_kr_U[adapter_name], self.lora_kr_V[adapter_name] = nn.Parameter(U), nn.Parameter(V)
        self.kr_layout[adapter_name], self.kr_config[adapter_name] = layout, lokra
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def _delta(self, adapter: str) -> torch.Tensor:
        """dW (d_out, d_in) of ``adapter``."""
        return plus_delta(self.lora_kr_U[adapter], self.lora_kr_V[adapter], self.kr_layout[adapter],
                          self.scaling[adapter])

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """dW in the base weight's layout: (d_out, d_in), or (d_in, d_out) for a Conv1D base."""
        delta = self._delta(adapter)
        return delta.T if self.fan_in_fan_out else delta

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        for adapter in check_adapters_to_merge(self, adapter_names):
            if adapter not in self.lora_kr_U:
                continue
            weight = self.get_base_layer().weight
            merged = weight.data + self.get_delta_weight(adapter).to(weight.dtype)
            if safe_merge and not torch.isfinite(merged).all():
                raise ValueError(f"NaNs detected in the merged weights. The adapter {adapter} seems to be broken")
            weight.data = merged
            self.merged_adapters.append(adapter)

    def unmerge(self) -> None:
        while self.merged_adapters:
            adapter = self.merged_adapters.pop()
            if adapter in self.lora_kr_U:
                weight = self.get_base_layer().weight
                weight.data -= self.get_delta_weight(adapter).to(weight.dtype)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.pop("adapter_names", None) is not None:
            raise ValueError("LoKRAPlusPeftLinear does not support mixed adapter batches (adapter_names=...)")
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return result
        for adapter in self.active_adapters:
            if adapter not in self.lora_kr_U:
                continue
            delta = self._delta(adapter)
            x_in = self._cast_input_dtype(x, delta.dtype)
            result = result + F.linear(self.lora_dropout[adapter](x_in), delta).to(result.dtype)
        return result

    def lokra_penalty_terms(self) -> list[torch.Tensor]:
        """lambda (R(U) + R(V)) of each active adapter, for :func:`~icml26.methods.lokra.kruskal_penalty`."""
        return [self.kr_config[a].lam * _factor_penalty([self.lora_kr_U[a], self.lora_kr_V[a]], self.kr_config[a])
                for a in self.active_adapters if a in self.lora_kr_U]

    def __repr__(self) -> str:
        return "lokra_plus." + super().__repr__()
