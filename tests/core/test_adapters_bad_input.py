"""Adapter layers built directly (not through AdapterConfig) refuse the same bad ranks and alphas."""

from __future__ import annotations

import math

import pytest
import torch.nn as nn

from icml26.core.adapters.base import LoRALinear


@pytest.mark.parametrize("r", [0, -2, 2.0, True])
def test_a_direct_layer_refuses_a_bad_rank(r):
    with pytest.raises(ValueError, match="rank r must be a positive int"):
        LoRALinear(nn.Linear(6, 5), r=r, alpha=4.0)


@pytest.mark.parametrize("alpha", [math.inf, math.nan, 0.0, -1.0, "8"])
def test_a_direct_layer_refuses_a_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
        LoRALinear(nn.Linear(6, 5), r=2, alpha=alpha)


def test_a_direct_layer_with_good_arguments_starts_as_its_base():
    import torch

    base = nn.Linear(6, 5)
    layer = LoRALinear(base, r=2, alpha=4)
    x = torch.randn(3, 6)
    assert torch.equal(layer(x), base(x))
