"""LoKRA and LoKRA+ adapter layers, the Kruskal-rank penalty trainers add to the loss, and update diagnostics.

Shapes: x (..., d_in) -> y (..., d_out); base weight W0 (d_out, d_in); s = alpha / r.

* LoKRA:  dW = s B A, A (r, d_in), B (d_out, r), exactly LoRA's layer; the method is the loss term
  lambda (R(A) + R(Bᵀ)) with R a coherence surrogate of low Kruskal rank over the columns (one per channel).
* LoKRA+: dW = s (U ⊙ V)[:L] (Khatri-Rao vectors as columns) or its transpose (as rows), U (p, n), V (q, n),
  p q >= L, with penalty lambda (R(U) + R(V)). By Sidiropoulos-Bro, k(U ⊙ V) >= min(k(U) + k(V) - 1, n), while a
  LoRA product only has k(BA) <= k(A) <= r.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ...core.adapters import AdapterLinear, LoRALinear, peft_lora_adapters
from .config import LoKRAConfig
from .kruskal import (coherence_lower_bound, coherence_penalty, effective_rank, khatri_rao, khatri_rao_kruskal_bound,
                      kruskal_rank, mutual_coherence)


def _factor_penalty(factors: list[torch.Tensor], config: LoKRAConfig) -> torch.Tensor:
    # In float32 at least: cosines of bf16 columns lose the small off-diagonal values the penalty is about.
    dtype = torch.promote_types(factors[0].dtype, torch.float32)
    return sum(coherence_penalty(f.to(dtype), kind=config.coherence, tau=config.tau, eps=config.norm_eps)
               for f in factors)


class LoKRALinear(AdapterLinear):
    """LoKRA: a LoRA layer whose factors A and Bᵀ carry a Kruskal-rank penalty (add :func:`kruskal_penalty`).

    Parameters: ``lokra_A`` A (r, d_in), Kaiming-uniform(a=sqrt 5); ``lokra_B`` B (d_out, r), zero. Same creation
    and initialisation order as :class:`~icml26.core.adapters.LoRALinear`, so with ``lam=0`` training is LoRA's,
    bit for bit. dW = (alpha / r) B A.
    """

    prefix = "lokra_"

    def __init__(self, base: nn.Linear, r: int, alpha: float, *, config: LoKRAConfig | None = None):
        super().__init__(base, r, alpha)
        self.config = config if config is not None else LoKRAConfig()
        dtype, device = base.weight.dtype, base.weight.device
        self.lokra_A = nn.Parameter(torch.empty(r, base.in_features, dtype=dtype, device=device))
        self.lokra_B = nn.Parameter(torch.zeros(base.out_features, r, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.lokra_A, a=math.sqrt(5))

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def delta_weight(self) -> torch.Tensor:
        return self.scaling * self.lokra_B @ self.lokra_A

    def adapter_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaling * F.linear(F.linear(x, self.lokra_A), self.lokra_B)

    def penalty_factors(self) -> list[torch.Tensor]:
        """The matrices whose columns the penalty spreads: [A (r, d_in), Bᵀ (r, d_out)] for 'channels',
        [Aᵀ (d_in, r), B (d_out, r)] for 'components'."""
        if self.config.penalty_on == "channels":
            return [self.lokra_A, self.lokra_B.T]
        return [self.lokra_A.T, self.lokra_B]

    def penalty(self) -> torch.Tensor:
        """R(A) + R(Bᵀ), unweighted (0-d tensor); :func:`kruskal_penalty` multiplies by lambda."""
        return _factor_penalty(self.penalty_factors(), self.config)

    def expected_trainable(self) -> int:
        return self.r * (self.in_features + self.out_features)


@dataclass(frozen=True)
class PlusLayout:
    """Where LoKRA+'s Khatri-Rao vectors lie and how big the factors are.

    axis: "columns" (dW[:, j] = s (u_j ⊗ v_j)[:d_out], one vector per input channel) or "rows" (dW[i, :] =
    s (u_i ⊗ v_i)[:d_in], one per output channel). length L: the vectors' length after truncation; n: their
    number; p <= q: rows of U and V, p q >= L.
    """

    axis: str
    length: int
    n: int
    p: int
    q: int

    @property
    def n_params(self) -> int:
        return (self.p + self.q) * self.n


def _smallest_sum(length: int) -> int:
    """Smallest s = p + q with floor(s/2) ceil(s/2) >= length (the balanced split maximises p q)."""
    s = 2
    while (s // 2) * (s - s // 2) < length:
        s += 1
    return s


def plus_layout(d_out: int, d_in: int, r: int, *, kr_axis: str = "auto", budget: str = "strict") -> PlusLayout:
    """LoKRA+ factor sizes with at most LoRA-r's parameters r (d_in + d_out).

    The vectors lie along the longer side for ``kr_axis="auto"`` (KRAdapter's choice, which needs the smallest
    budget). With n vectors, p + q = floor(r (d_in + d_out) / n), split evenly (p <= q), since the Khatri-Rao
    bound p + q - 1 depends only on the sum. If p q < L the budget cannot reach the layer: ``budget="strict"``
    raises ValueError with the smallest r that can, ``"grow"`` uses the smallest feasible factors instead.
    """
    axis = ("columns" if d_out >= d_in else "rows") if kr_axis == "auto" else kr_axis
    if axis not in ("columns", "rows"):
        raise ValueError(f"kr_axis must be 'auto', 'columns' or 'rows', got {kr_axis!r}")
    length, n = (d_out, d_in) if axis == "columns" else (d_in, d_out)
    s = r * (d_in + d_out) // n
    need = _smallest_sum(length)
    if s < need:
        if budget == "strict":
            r_min = math.ceil(need * n / (d_in + d_out))
            raise ValueError(f"LoKRA+ with r={r} on a {d_out}x{d_in} layer ({axis}) cannot fit Khatri-Rao vectors of "
                             f"length {length} into LoRA-r's budget: p+q={s} gives at most {(s // 2) * (s - s // 2)}; "
                             f"use r >= {r_min} or plus_budget='grow'")
        s = need
    return PlusLayout(axis, length, n, s // 2, s - s // 2)


def plus_factors(layout: PlusLayout, config: LoKRAConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LoKRA+'s initial factors U (p, n) and V (q, n): the one named by ``config.plus_init`` is zero (so dW = 0),
    the other uniform in +-1/sqrt(its rows). Shared by our layer and the peft layer, so both draw the same numbers."""
    U = torch.zeros(layout.p, layout.n, dtype=dtype, device=device)
    V = torch.zeros(layout.q, layout.n, dtype=dtype, device=device)
    # Each per-channel vector of the random factor gets entries of size ~1/sqrt(its length), so the Khatri-Rao
    # columns start with comparable norms whatever the layer's width.
    random = V if config.plus_init == "zero_u" else U
    bound = 1.0 / math.sqrt(random.shape[0])
    random.uniform_(-bound, bound)
    return U, V


def plus_delta(U: torch.Tensor, V: torch.Tensor, layout: PlusLayout, scaling: float) -> torch.Tensor:
    """dW (d_out, d_in) = s (U ⊙ V)[:L] for Khatri-Rao columns, or its transpose for rows."""
    kr = khatri_rao(U, V)[: layout.length]
    return scaling * (kr if layout.axis == "columns" else kr.T)


class LoKRAPlusLinear(AdapterLinear):
    """LoKRA+: dW built from a Khatri-Rao product, with the Kruskal-rank penalty on its factors' columns.

    Parameters: ``lokrap_U`` U (p, n) and ``lokrap_V`` V (q, n) (:func:`plus_layout`); one of them starts at zero
    (``plus_init``), the other uniform in +-1/sqrt(rows). dW = (alpha / r) (U ⊙ V)[:L] for Khatri-Rao columns, or
    its transpose for rows. ``r`` is the LoRA rank whose parameter budget the layer matches.

    The forward adds dW to W0 and does one matmul: the update is a dense (d_out, d_in) matrix anyway, and one
    product with (W0 + dW) is cheaper than two.
    """

    prefix = "lokrap_"

    def __init__(self, base: nn.Linear, r: int, alpha: float, *, config: LoKRAConfig | None = None):
        super().__init__(base, r, alpha)
        self.config = config if config is not None else LoKRAConfig()
        self.layout = plus_layout(base.out_features, base.in_features, r, kr_axis=self.config.kr_axis,
                                  budget=self.config.plus_budget)
        U, V = plus_factors(self.layout, self.config, dtype=base.weight.dtype, device=base.weight.device)
        self.lokrap_U, self.lokrap_V = nn.Parameter(U), nn.Parameter(V)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def delta_weight(self) -> torch.Tensor:
        return plus_delta(self.lokrap_U, self.lokrap_V, self.layout, self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return self.base(x)
        weight = self.base.weight + self.delta_weight().to(self.base.weight.dtype)
        return F.linear(x, weight, self.base.bias)

    def penalty_factors(self) -> list[torch.Tensor]:
        """[U (p, n), V (q, n)]: their per-channel columns are what the Khatri-Rao bound is about."""
        return [self.lokrap_U, self.lokrap_V]

    def penalty(self) -> torch.Tensor:
        """R(U) + R(V), unweighted (0-d tensor)."""
        return _factor_penalty(self.penalty_factors(), self.config)

    def expected_trainable(self) -> int:
        return self.layout.n_params

    def extra_repr(self) -> str:
        lay = self.layout
        return f"{super().extra_repr()}, kr={lay.axis}, p={lay.p}, q={lay.q}, n={lay.n}"


LOKRA_LAYERS = (LoKRALinear, LoKRAPlusLinear)


def _stored_lokra_config(model: nn.Module, adapter: str) -> LoKRAConfig | None:
    """The LoKRAConfig that a ``LoKRAPeftConfig`` of a peft model stores for ``adapter`` (None otherwise)."""
    configs = getattr(model, "peft_config", None)
    config = configs.get(adapter) if isinstance(configs, dict) else None
    return getattr(config, "lokra_config", None)


def kruskal_penalty(model: nn.Module, *, peft_config: LoKRAConfig | None = None, reduction: str = "sum"
                    ) -> torch.Tensor:
    """The LoKRA loss term: sum (or mean) over adapted layers of lambda_l (R(A_l) + R(B_lᵀ)); add it to the loss.

    LoKRA and LoKRA+ layers (ours, and peft's ``LoKRAPlusPeftLinear``) use their own config. Vanilla Hugging Face
    peft LoRA layers are penalised with ``peft_config`` if given, else with the LoKRAConfig stored in the model's
    ``LoKRAPeftConfig``, else with the default :class:`LoKRAConfig`: any peft LoRA run becomes LoKRA this way.
    Raises ValueError when the model has none of these layers.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    terms: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, LOKRA_LAYERS):
            terms.append(module.config.lam * module.penalty())
        elif hasattr(module, "lokra_penalty_terms"):
            terms += module.lokra_penalty_terms()
    for _, lora in peft_lora_adapters(model):
        config = peft_config or _stored_lokra_config(model, lora.adapter) or LoKRAConfig()
        factors = [lora.A, lora.B.T] if config.penalty_on == "channels" else [lora.A.T, lora.B]
        terms.append(config.lam * _factor_penalty(factors, config))
    if not terms:
        raise ValueError("kruskal_penalty found no LoKRA, LoKRA+ or peft LoRA layer in the model")
    total = torch.stack(terms).sum()
    return total / len(terms) if reduction == "mean" else total


def lokra_make(config: LoKRAConfig | None = None) -> Callable[[nn.Linear, int, float, str], LoKRALinear]:
    """``make`` for :func:`~icml26.core.adapters.inject_adapters`: every targeted Linear becomes a LoKRALinear."""
    return lambda linear, r, alpha, name: LoKRALinear(linear, r, alpha, config=config)


def lokra_plus_make(config: LoKRAConfig | None = None) -> Callable[[nn.Linear, int, float, str], LoKRAPlusLinear]:
    """``make`` for :func:`~icml26.core.adapters.inject_adapters` building LoKRAPlusLinear layers."""
    return lambda linear, r, alpha, name: LoKRAPlusLinear(linear, r, alpha, config=config)


@torch.no_grad()
def update_diagnostics(layer: AdapterLinear, *, exact_max_subsets: int = 0) -> dict[str, float]:
    """What the paper's argument is about, measured on one trained layer (LoRA, LoKRA or LoKRA+).

    Keys: ``erank`` (Roy-Vetterli effective rank of dW), ``delta_mu`` / ``delta_msc`` (max / mean-squared cosine
    between dW's columns, one per input channel), ``delta_kbound`` (coherence lower bound on their Kruskal rank),
    ``factor_mu`` / ``factor_msc`` / ``factor_kbound`` (the same for the per-channel factor columns: A and Bᵀ,
    or U and V; averaged over the two factors), and for LoKRA+ ``kr_bound`` = min(k_lb(U) + k_lb(V) - 1, n).
    With ``exact_max_subsets > 0`` also ``delta_krank``, the exact Kruskal rank of dW's columns (NaN if too big).
    """
    delta = layer.delta_weight().detach().double()
    if isinstance(layer, LoKRAPlusLinear):
        factors = [layer.lokrap_U, layer.lokrap_V]
    elif isinstance(layer, LoKRALinear):
        factors = [layer.lokra_A, layer.lokra_B.T]
    elif isinstance(layer, LoRALinear):
        factors = [layer.lora_A, layer.lora_B.T]
    else:
        raise TypeError(f"no diagnostics for {type(layer).__name__}")
    factors = [f.detach().double() for f in factors]

    def mu(x: torch.Tensor) -> float:
        return mutual_coherence(x) if coherence_lower_bound(x) > 0 else 1.0

    out = {
        "erank": effective_rank(delta),
        "delta_mu": mu(delta),
        "delta_msc": float(coherence_penalty(delta, eps=0.0)) if coherence_lower_bound(delta) > 0 else 1.0,
        "delta_kbound": float(coherence_lower_bound(delta)),
        "factor_mu": sum(mu(f) for f in factors) / 2,
        "factor_msc": sum(float(coherence_penalty(f, eps=1e-12)) for f in factors) / 2,
        "factor_kbound": sum(coherence_lower_bound(f) for f in factors) / 2,
    }
    if isinstance(layer, LoKRAPlusLinear):
        out["kr_bound"] = float(khatri_rao_kruskal_bound(coherence_lower_bound(factors[0]),
                                                         coherence_lower_bound(factors[1]), layer.layout.n))
    if exact_max_subsets:
        try:
            out["delta_krank"] = float(kruskal_rank(delta, max_subsets=exact_max_subsets))
        except ValueError:
            out["delta_krank"] = math.nan
    return out
