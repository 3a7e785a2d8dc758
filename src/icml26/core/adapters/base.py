"""AdapterConfig and the AdapterLinear base class; LoRA as the reference adapter every method is compared with."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import torch
from torch import nn


@dataclass
class AdapterConfig:
    """Where adapters go and how big they are.

    Attributes:
        r: rank (or the method's size parameter) of every adapter, unless ``rank_pattern`` overrides it.
        alpha: scale numerator; the update is multiplied by ``alpha / r`` (LoRA convention).
        target_modules: a list of names matched as suffixes (``"q_proj"`` matches ``"...layers.0.q_proj"``), or
            one regex string that must match the whole module name.
        rank_pattern / alpha_pattern: per-module overrides keyed by a regex matched against the end of the module
            name (peft's ``(.*\\.)?key$`` rule); ``^``-anchored keys must match the whole name.
    """

    r: int = 8
    alpha: float = 16.0
    target_modules: Sequence[str] | str = ("q_proj", "v_proj")
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r <= 0:
            raise ValueError(f"r (adapter rank) must be a positive int, got {self.r!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"alpha must be a finite number > 0, got {self.alpha!r}")
        if not self.target_modules:
            raise ValueError("target_modules is empty: name at least one module (suffix list or regex)")
        for key, rank in self.rank_pattern.items():
            if not isinstance(rank, int) or rank <= 0:
                raise ValueError(f"rank_pattern[{key!r}] must be a positive int, got {rank!r}")
        for key, alpha in self.alpha_pattern.items():
            if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
                raise ValueError(f"alpha_pattern[{key!r}] must be a finite number > 0, got {alpha!r}")

    @staticmethod
    def _pattern_matches(key: str, name: str) -> bool:
        """peft's rule: an unanchored key matches a name ending in ``.key``; ``^key`` must match the whole name."""
        if key.startswith("^"):
            return re.fullmatch(key[1:].removesuffix("$"), name) is not None
        return re.fullmatch(rf"(.*\.)?{key}", name) is not None

    def _lookup(self, patterns: dict, name: str, default):
        for key, value in patterns.items():
            if self._pattern_matches(key, name):
                return value
        return default

    def rank_for(self, name: str) -> int:
        return self._lookup(self.rank_pattern, name, self.r)

    def alpha_for(self, name: str) -> float:
        return self._lookup(self.alpha_pattern, name, self.alpha)


class AdapterLinear(nn.Module):
    """An ``nn.Linear`` with a trainable additive update: ``y = base(x) + x @ delta_weight().T``.

    The base layer is frozen. Subclasses set ``prefix`` (every adapter parameter name starts with it, so state
    dicts of different methods never collide), create their parameters in ``__init__`` such that the initial
    update is zero, and implement :meth:`delta_weight`. :meth:`merge` folds the update into the base weight.

    Shapes: base weight W0 (d_out, d_in); ``delta_weight()`` (d_out, d_in); x (..., d_in) -> y (..., d_out).
    """

    prefix: ClassVar[str] = "adapter_"
    rank_limited: ClassVar[bool] = False
    """True for B A factorisations, whose rank cannot exceed min(d_in, d_out): a larger r is refused."""

    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"{type(self).__name__} wraps nn.Linear, got {type(base).__name__}")
        # The same rules as AdapterConfig, for layers built directly rather than through inject_adapters.
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise ValueError(f"{type(self).__name__} rank r must be a positive int, got {r!r}")
        if isinstance(alpha, bool) or not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"{type(self).__name__} alpha must be a finite number > 0, got {alpha!r}")
        limit = min(base.in_features, base.out_features)
        if self.rank_limited and r > limit:
            raise ValueError(f"{type(self).__name__} rank r={r} exceeds min(in_features, out_features) = {limit} "
                             f"of a ({base.out_features}, {base.in_features}) layer; a B A update cannot use it")
        self.base = base
        self.base.weight.requires_grad_(False)
        if self.base.bias is not None:
            self.base.bias.requires_grad_(False)
        self.r, self.alpha = r, alpha
        self.merged = False
        # Set by anything that folds updates into the frozen weight while training (ScaLoRA's merge-rescale,
        # ReLoRA's restarts): the adapter tensors alone then no longer describe the layer, so save_adapters also
        # writes this layer's base weight.
        self.base_modified = False

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The frozen base weight (so code that reads ``.weight`` of a Linear keeps working)."""
        return self.base.weight

    def delta_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def adapter_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update applied to ``x``; override when a factored product is cheaper than forming the matrix."""
        return nn.functional.linear(x, self.delta_weight().to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        return out if self.merged else out + self.adapter_forward(x)

    @torch.no_grad()
    def merge(self) -> None:
        if self.merged:
            raise RuntimeError("adapter is already merged")
        self.base.weight += self.delta_weight().to(self.base.weight.dtype)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            raise RuntimeError("adapter is not merged")
        self.base.weight -= self.delta_weight().to(self.base.weight.dtype)
        self.merged = False

    def expected_trainable(self) -> int:
        """The method's parameter-count formula for this layer (checked against the real count in tests)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, alpha={self.alpha}, merged={self.merged}"


class LoRALinear(AdapterLinear):
    """LoRA (Hu et al., 2021): delta W = (alpha / r) B A, A (r, d_in) Kaiming-uniform, B (d_out, r) zero."""

    prefix = "lora_"
    rank_limited = True

    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__(base, r, alpha)
        dtype, device = base.weight.dtype, base.weight.device
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def delta_weight(self) -> torch.Tensor:
        return self.scaling * self.lora_B @ self.lora_A

    def adapter_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaling * nn.functional.linear(nn.functional.linear(x, self.lora_A), self.lora_B)

    def expected_trainable(self) -> int:
        return self.r * (self.in_features + self.out_features)
