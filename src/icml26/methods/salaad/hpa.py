"""Deployment-time truncation of one trained L + S to any parameter budget (official HPA / UIA).

Official code: ``salaad/uia.py`` (allocation), ``salaad/operators.py`` (``opt_slr``: truncation), ``salaad/utils.py``
(``cal_nr_params``: the count), driven by ``scripts/resave_model.py --target_params P --gamma 0.5``.

Per block (m, n):
  rank_i = how many leading singular values of L reach ``energy`` (0.999) of their *unsquared* sum,
  nnz_i = #{|S| > max|S| / rate}.
Totals P_L = sum rank_i (m + n), P_S = sum nnz_i, P = rest + P_L + P_S. For a target T < P the reduction P - T is split
gamma : (1 - gamma) between L and S (with spill-over when one side runs out), and every block's rank ratio is scaled
by (1 - reduction_L / P_L), every density by (1 - reduction_S / P_S). If the official count then falls short of T,
every density is raised by the shortfall / sum(m n). Block i is deployed as the rank-int(min(m, n) q_i) SVD of L
plus the int(m n d_i) largest-|.| entries of S. Where float rounding makes that count overshoot T by a few
parameters, single sparse entries are dropped from the fullest block until it fits (not in the official code).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .admm import SALAAD, energy_rank
from .budget import CompressionReport, block_cost, count_parameters, replace_weights, target_params
from .config import SALAADConfig


@dataclass
class HPAPlan:
    """The allocation for one target (official UIA output after ``post_allocate``).

    Attributes:
        target: target parameter count T.
        rank_quantile / density: per block q_i and d_i after allocation.
        ranks / keep: per block int(min(m, n) q_i) and int(m n d_i).
        planned_params: the official count ``cal_nr_params`` of this allocation (after the overshoot repair).
        surrogate_params: P = rest + P_L + P_S, the size of the untruncated surrogate.
        status: official return flag: 0 split as asked, 1 no reduction needed, 2 both sides exhausted,
            3 L exhausted (rest taken from S), 4 S exhausted (rest taken from L).
    """

    target: int
    rank_quantile: dict[str, float]
    density: dict[str, float]
    ranks: dict[str, int]
    keep: dict[str, int]
    planned_params: int
    surrogate_params: int
    status: int


def official_count(dense_params: int, dims: Mapping[str, tuple[int, int]], rank_quantile: Mapping[str, float],
                   density: Mapping[str, float]) -> int:
    """``cal_nr_params``: dense count minus, per block, m n - (m + n) int(min(m, n) q) plus int(m n d)."""
    total = dense_params
    for name, q in rank_quantile.items():
        m, n = dims[name]
        rank = int(min(m, n) * q)
        total -= m * n - (m + n) * rank
        total += int(m * n * density[name])
    return total


def plan_hpa(components: Mapping[str, tuple[torch.Tensor, torch.Tensor]], dense_params: int, target: int, *,
             gamma: float = 0.5, energy: float = 0.999, density_rate: float = 1e8) -> HPAPlan:
    """Allocate ranks and sparse entries per block for ``target`` parameters (see the module docstring).

    Args:
        components: {block name: (L, S)}, both (m, n).
        dense_params: parameter count of the dense model (blocks included).
        target: the budget T in parameters.
    """
    dims, q0, d0 = {}, {}, {}
    p_layers = p_l = p_s = 0
    for name, (low, sparse) in components.items():
        m, n = low.shape
        dims[name] = (m, n)
        eps = float(sparse.abs().max()) / density_rate if sparse.numel() else 0.0
        nnz = int((sparse.abs() > eps).sum())
        rank = energy_rank(torch.linalg.svdvals(low.float()), energy, squared=False)
        q0[name], d0[name] = rank / min(m, n), nnz / (m * n)
        p_layers += m * n
        p_l += int(rank * (m + n))
        p_s += nnz
    p_total = dense_params - p_layers + p_l + p_s
    if target >= p_total:
        q, d, status = dict(q0), dict(d0), 1
    else:
        diff = p_total - target
        diff_l = int(diff * gamma)
        diff_s = diff - diff_l
        cap_l, cap_s = p_l - diff_l, p_s - diff_s
        if cap_l >= 0 and cap_s >= 0:
            status = 0
        elif cap_l < 0 and cap_s < 0:
            status, diff_l, diff_s = 2, p_l, p_s
        elif cap_l < 0:
            status, diff_l, diff_s = 3, p_l, min(p_s, diff_s - cap_l)
        else:
            status, diff_s, diff_l = 4, p_s, min(p_l, diff_l - cap_s)
        ratio_l = 1.0 if p_l == 0 else float(np.clip(1 - diff_l / p_l, 0.0, 1.0))
        ratio_s = 1.0 if p_s == 0 else float(np.clip(1 - diff_s / p_s, 0.0, 1.0))
        q = {k: v * ratio_l for k, v in q0.items()}
        d = {k: v * ratio_s for k, v in d0.items()}
    # post_allocate: spend what flooring left over on density, spread evenly over all block entries.
    shortfall = target - official_count(dense_params, dims, q, d) - 1
    if shortfall > 0:
        d = {k: v + shortfall / p_layers for k, v in d.items()}
    ranks = {k: int(min(dims[k]) * q[k]) for k in q}
    keep = {k: int(dims[k][0] * dims[k][1] * d[k]) for k in d}
    rest = dense_params - p_layers
    planned = rest + sum(ranks[k] * sum(dims[k]) + keep[k] for k in ranks)
    # The official float arithmetic (int(m n d) of a product of ratios) can overshoot the target by a few
    # parameters; drop single sparse entries (then single ranks) from the fullest block until the count fits.
    while planned > target >= rest:
        name = max(keep, key=lambda k: keep[k])
        if keep[name] > 0:
            keep[name] -= 1
            planned -= 1
        else:
            name = max(ranks, key=lambda k: ranks[k] * sum(dims[k]))
            ranks[name] -= 1
            planned -= sum(dims[name])
    return HPAPlan(target, q, d, ranks, keep, planned, p_total, status)


def truncate_block(low: torch.Tensor, sparse: torch.Tensor, rank: int, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_k, S_k): the rank-``rank`` SVD of L and the ``keep`` largest-|.| entries of S (ties at the cut kept)."""
    u, s, vh = torch.linalg.svd(low.float(), full_matrices=False)
    low_k = (u[:, :rank] * s[:rank]) @ vh[:rank]
    if keep >= sparse.numel():
        sparse_k = sparse.float()
    elif keep <= 0:
        sparse_k = torch.zeros_like(sparse, dtype=torch.float32)
    else:
        threshold = torch.topk(sparse.abs().flatten(), keep).values[-1]
        sparse_k = torch.where(sparse.abs() >= threshold, sparse, torch.zeros_like(sparse)).float()
    return low_k, sparse_k


def _components(source: Any, model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{name: (L, S)} from ``source``, checked against ``model``: parameter names, shapes, finite values."""
    if isinstance(source, SALAAD):
        comps = source.components()
    elif isinstance(source, Mapping) and "blocks" in source:
        comps = {name: (b["L"], b["S"]) for name, b in source["blocks"].items()}
    elif isinstance(source, Mapping) and all(isinstance(v, (tuple, list)) and len(v) == 2 for v in source.values()):
        comps = {name: (pair[0], pair[1]) for name, pair in source.items()}
    else:
        raise ValueError("components must be a SALAAD hook, its state_dict(), or {name: (L, S)}")
    if not comps:
        raise ValueError("components is empty: there is no block to truncate")
    params = dict(model.named_parameters())
    unknown = [name for name in comps if name not in params]
    if unknown:
        raise ValueError(f"components {unknown} are not parameters of the model; its 2-D parameters are "
                         f"{[n for n, p in params.items() if p.ndim == 2][:6]}")
    for name, (low, sparse) in comps.items():
        if not isinstance(low, torch.Tensor) or not isinstance(sparse, torch.Tensor):
            raise ValueError(f"components[{name!r}] must be a pair of tensors (L, S)")
        shape = tuple(params[name].shape)
        if tuple(low.shape) != shape or tuple(sparse.shape) != shape:
            raise ValueError(f"components[{name!r}]: L {tuple(low.shape)} and S {tuple(sparse.shape)} must both "
                             f"have the parameter's shape {shape}")
        if not (bool(torch.isfinite(low).all()) and bool(torch.isfinite(sparse).all())):
            raise ValueError(f"components[{name!r}] has NaN or inf entries in L or S")
    return comps


def truncate_to_budget(model: nn.Module, fraction: float, *, components: Any,
                       config: SALAADConfig | None = None, method: str = "hpa") -> tuple[nn.Module, CompressionReport]:
    """HPA: compress ``model`` to ``fraction`` of its dense parameter count from one trained L + S.

    Args:
        model: the trained model (not modified); parameters outside the blocks are kept as they are.
        fraction: budget in (0, 1] of the dense parameter count.
        components: a :class:`SALAAD` hook, its ``state_dict()``, or {parameter name: (L, S)} (m, n) each, e.g. an
            RPCA decomposition of the weights.
        config: HPA knobs (gamma, energy, density rate); default :class:`SALAADConfig`.
        method: the label written into the report.

    Raises ValueError, before any work, for a fraction outside (0, 1] and for components that are empty, name no
    parameter of ``model``, have another shape than the parameter, or hold NaN/inf.

    Returns:
        A deep copy of ``model`` (same architecture) whose blocks hold L_k + S_k, and its :class:`CompressionReport`
        (``extra`` carries the official planned count, the status flag and the untruncated surrogate size).
    """
    config = config or SALAADConfig()
    if not isinstance(config, SALAADConfig):
        raise TypeError(f"config must be a SALAADConfig, got {type(config).__name__}")
    if not isinstance(method, str) or not method:
        raise TypeError(f"method (the report's label) must be a non-empty str, got {method!r}")
    target = target_params(model, fraction)
    comps = _components(components, model)
    dense = count_parameters(model)
    plan = plan_hpa(comps, dense, target, gamma=config.hpa_gamma, energy=config.hpa_energy,
                    density_rate=config.hpa_density_rate)
    weights, blocks = {}, {}
    for name, (low, sparse) in comps.items():
        low_k, sparse_k = truncate_block(low, sparse, plan.ranks[name], plan.keep[name])
        weights[name] = low_k + sparse_k
        nnz = int(torch.count_nonzero(sparse_k))
        shape = tuple(low.shape)
        blocks[name] = {"shape": shape, "rank": plan.ranks[name], "nnz": nnz,
                        "cost": block_cost(shape, plan.ranks[name], nnz)}
    params = dense + sum(b["cost"] - b["shape"][0] * b["shape"][1] for b in blocks.values())
    report = CompressionReport(method, float(fraction), target, dense, params, blocks,
                               {"planned_params": plan.planned_params, "status": plan.status,
                                "surrogate_params": plan.surrogate_params})
    return replace_weights(model, weights), report
