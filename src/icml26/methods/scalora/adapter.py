"""The ScaLoRA adapter layer and the two weight-preserving restarts: ScaLoRA's rescale and ReLoRA's re-init.

Convention (the repo's LoRA layout, transposed from the paper's): the effective weight of a layer is

    W = W0 + s * B @ A,   W0 (m, n) frozen base, B (m, r), A (r, n), s = alpha / r,

so the paper's ``A`` (m x r) is our ``B`` and its ``B`` (n x r) is our ``A^T``. Component i of the update is
``s * b_i a_i^T`` with b_i = B[:, i] and a_i = A[i, :].
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import nn

from ...core.adapters import AdapterLinear, LoRALinear, PeftLoRA, peft_lora_adapters


class ScaLoRALinear(AdapterLinear):
    """LoRA's parameterization under its own prefix, with ScaLoRA's merge-and-rescale as a method.

    ``delta_weight() = s * scalora_B @ scalora_A``; ``scalora_A`` (r, d_in) is Kaiming-uniform and ``scalora_B``
    (d_out, r) is zero at initialisation, exactly as :class:`~icml26.core.adapters.LoRALinear`, so a fresh layer
    computes the same function and a ScaLoRA run starts where a LoRA run starts. Training changes only in the
    optimizer wrapper (:class:`~icml26.methods.scalora.ScaLoRAOptimizer`), which calls :meth:`rescale_`.

    Shapes: x (..., d_in) -> y (..., d_out).
    """

    prefix = "scalora_"

    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__(base, r, alpha)
        dtype, device = base.weight.dtype, base.weight.device
        self.scalora_A = nn.Parameter(torch.empty(r, base.in_features, dtype=dtype, device=device))
        self.scalora_B = nn.Parameter(torch.zeros(base.out_features, r, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.scalora_A, a=math.sqrt(5))

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def delta_weight(self) -> torch.Tensor:
        return self.scaling * self.scalora_B @ self.scalora_A

    def adapter_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaling * nn.functional.linear(nn.functional.linear(x, self.scalora_A), self.scalora_B)

    def expected_trainable(self) -> int:
        return self.r * (self.in_features + self.out_features)

    def rescale_(self, u: torch.Tensor, v: torch.Tensor) -> None:
        """ScaLoRA's restart: ``B <- B diag(u)``, ``A <- diag(v) A``, base absorbs the difference (see
        :func:`merge_rescale_`)."""
        merge_rescale_(self, u, v)


LoRALike = LoRALinear | ScaLoRALinear | PeftLoRA


def lora_factors(layer: LoRALike) -> tuple[nn.Parameter, nn.Parameter, float]:
    """``(A (r, d_in), B (d_out, r), s)`` of a :class:`LoRALinear`, :class:`ScaLoRALinear` or one adapter of a
    Hugging Face peft LoRA layer (:class:`~icml26.core.adapters.PeftLoRA`)."""
    if isinstance(layer, ScaLoRALinear):
        return layer.scalora_A, layer.scalora_B, layer.scaling
    if isinstance(layer, LoRALinear):
        return layer.lora_A, layer.lora_B, layer.scaling
    if isinstance(layer, PeftLoRA):
        return layer.A, layer.B, layer.scaling
    raise TypeError(f"expected a LoRALinear, ScaLoRALinear or PeftLoRA, got {type(layer).__name__}")


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALike]]:
    """Every LoRA-parameterized adapter of ``model``: our LoRALinear / ScaLoRALinear layers in module order, then
    the active adapters of peft LoRA layers (named ``"<module>[<adapter>]"``; a peft LoRA variant such as DoRA
    raises ValueError)."""
    for name, module in model.named_modules():
        if isinstance(module, (LoRALinear, ScaLoRALinear)):
            yield name, module
    yield from peft_lora_adapters(model)


def _base_weight(layer: LoRALike, *, for_update: bool = False) -> torch.Tensor:
    """The frozen weight W0 as a (d_out, d_in) tensor or view (peft's GPT-2 Conv1D stores it transposed).

    ``for_update=True`` marks our layers ``base_modified``, so that ``save_adapters`` saves W0 with the factors.
    """
    if isinstance(layer, PeftLoRA):
        return layer.base_weight
    if for_update:
        layer.base_modified = True
    return layer.base.weight


@torch.no_grad()
def merge_rescale_(layer: LoRALike, u: torch.Tensor, v: torch.Tensor) -> None:
    """Merge the update into the base and restart it with column-scaled factors; W is unchanged.

    ``W0 <- W0 + s B (I - diag(u * v)) A``, then ``B <- B diag(u)`` and ``A <- diag(v) A``, so that
    ``W0 + s B A`` is the same matrix before and after (paper: W~_pt <- W~_pt + A B^T - A~ B~^T). Where
    u_i v_i = 1 the base is untouched and component i is only rebalanced between its two factors.

    Args:
        layer: an unmerged LoRA-parameterized layer.
        u: (r,) multipliers of the columns of B (the paper's scaling of its A).
        v: (r,) multipliers of the rows of A (the paper's scaling of its B).
    """
    if layer.merged:
        raise RuntimeError("merge_rescale_ needs an unmerged adapter; call unmerge() first")
    A, B, s = lora_factors(layer)
    u = u.to(device=B.device, dtype=B.dtype)
    v = v.to(device=A.device, dtype=A.dtype)
    coef = s * (1.0 - u * v)
    if bool((coef != 0).any()):
        weight = _base_weight(layer, for_update=True)
        weight.addmm_((B * coef).to(weight.dtype), A.to(weight.dtype))
    A.mul_(v[:, None])
    B.mul_(u[None, :])


@torch.no_grad()
def merge_reinit_(layer: LoRALike, generator: torch.Generator | None = None) -> None:
    """ReLoRA's restart: ``W0 <- W0 + s B A``, then A re-drawn Kaiming-uniform and B zeroed; W is unchanged."""
    if layer.merged:
        raise RuntimeError("merge_reinit_ needs an unmerged adapter; call unmerge() first")
    A, B, s = lora_factors(layer)
    weight = _base_weight(layer, for_update=True)
    weight.addmm_((s * B).to(weight.dtype), A.to(weight.dtype))
    # Kaiming-uniform with a = sqrt(5), as nn.init does for LoRA's A: bound = 1 / sqrt(fan_in).
    bound = 1.0 / math.sqrt(A.shape[1])
    A.copy_(torch.rand(A.shape, generator=generator, dtype=A.dtype, device="cpu").mul_(2 * bound).sub_(bound))
    B.zero_()


def effective_weight(layer: LoRALike) -> torch.Tensor:
    """``W0 + s B A`` (d_out, d_in), detached; what the layer multiplies its input with."""
    with torch.no_grad():
        weight = _base_weight(layer).detach().clone()
        return weight if layer.merged else weight + layer.delta_weight().to(weight.dtype)


def effective_rank(matrix: torch.Tensor) -> float:
    """Roy & Vetterli's effective rank ``exp(H(p))``, p = sigma / sum(sigma), of a 2-D tensor (0 for a zero matrix).

    It equals k for k equal nonzero singular values and never exceeds the rank, so a rank-r update has
    effective rank <= r.
    """
    sigma = torch.linalg.svdvals(matrix.detach().double())
    total = sigma.sum()
    if total <= 0:
        return 0.0
    p = sigma / total
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))
