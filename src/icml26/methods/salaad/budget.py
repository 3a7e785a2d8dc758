"""Parameter budgets shared by HPA and the post-hoc baselines: one honest count for every compressed model.

A compressed block of shape (m, n) that stores a rank-k factor pair and nnz sparse entries costs
``min(k (m + n) + nnz, m n)``: factors count k (m + n) scalars (the official ``cal_nr_params`` convention, singular
values folded into a factor), sparse entries count one scalar each (no index overhead, as in the official count), and
a block never costs more than storing it dense. Parameters outside the compressed blocks stay dense.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn


def count_parameters(model: nn.Module) -> int:
    """Distinct scalars of ``model`` (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


def block_cost(shape: tuple[int, int], rank: int, nnz: int) -> int:
    """Scalars to store a (m, n) block as a rank-``rank`` factor pair plus ``nnz`` sparse entries, or dense if less."""
    m, n = shape
    return min(rank * (m + n) + nnz, m * n)


def target_params(model: nn.Module, fraction: float) -> int:
    """int(fraction * dense parameter count); ``fraction`` in (0, 1]."""
    if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
        raise ValueError(f"fraction (of the dense parameter count) must lie in (0, 1], got {fraction!r}")
    return int(fraction * count_parameters(model))


@dataclass
class CompressionReport:
    """What a compression produced.

    Attributes:
        method: "hpa", "svd", "magnitude", ...
        fraction: requested budget as a fraction of ``dense_params``.
        target_params: int(fraction * dense_params).
        dense_params: distinct scalars of the uncompressed model.
        params: honest count of the compressed model (see the module docstring); never above ``target_params``
            unless even the uncompressed rest exceeds it.
        blocks: per block name: {"shape", "rank", "nnz", "cost"}.
        extra: method-specific facts (HPA: the official planned count and return flag).
    """

    method: str
    fraction: float
    target_params: int
    dense_params: int
    params: int
    blocks: dict[str, dict] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @property
    def achieved_fraction(self) -> float:
        return self.params / self.dense_params


def replace_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> nn.Module:
    """A deep copy of ``model`` with the named parameters overwritten (same architecture, same dtypes)."""
    out = copy.deepcopy(model)
    params = dict(out.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            if name not in params:
                raise ValueError(f"{name!r} is not a parameter of the model")
            if tuple(params[name].shape) != tuple(value.shape):
                raise ValueError(f"{name}: shape {tuple(value.shape)} != parameter shape {tuple(params[name].shape)}")
            params[name].copy_(value.to(params[name].dtype))
    return out


def rest_params(model: nn.Module, names: list[str] | set[str]) -> int:
    """Scalars of ``model`` outside the blocks ``names``."""
    params = dict(model.named_parameters())
    return count_parameters(model) - sum(params[n].numel() for n in names)
