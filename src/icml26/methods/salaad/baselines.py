"""Post-hoc compression of a normally trained model to a parameter budget: the baselines SALAAD is compared with.

* :func:`svd_truncate`: keep leading singular triplets of each block.
* :func:`magnitude_prune`: keep the largest-|w| entries.
* :func:`ialm_rpca` + :func:`rpca_components`: robust PCA of each block by the inexact augmented Lagrange multiplier
  method (Lin, Chen & Ma 2010, as in the official ``salaad/ialm.py`` ``fit_torch`` used by ``static_rpca.py``),
  then the same HPA truncation as SALAAD (``hpa.truncate_to_budget(..., components=rpca_components(...))``).

Every method counts parameters with :func:`icml26.methods.salaad.budget.block_cost` and stays within the budget.
Each has one discrete choice ("allocation" across blocks, or the RPCA lambda scale), so every arm gets the same
number of settings to tune.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from .budget import CompressionReport, block_cost, count_parameters, replace_weights, rest_params, target_params

SVD_ALLOCATIONS = ("uniform", "global", "energy")
MAGNITUDE_ALLOCATIONS = ("uniform", "global", "normalized")


def _weights(model: nn.Module, blocks: Sequence[str]) -> dict[str, torch.Tensor]:
    if isinstance(blocks, str):
        raise TypeError(f"blocks must be a list of parameter names, got the str {blocks!r}")
    if not blocks:
        raise ValueError("blocks is empty: name at least one 2-D parameter to compress")
    params = dict(model.named_parameters())
    missing = [b for b in blocks if b not in params]
    if missing:
        raise ValueError(f"blocks {missing} are not parameters of the model")
    bad = [b for b in blocks if params[b].ndim != 2]
    if bad:
        raise ValueError(f"blocks {bad} are not 2-D weights")
    nonfinite = [b for b in blocks if not bool(torch.isfinite(params[b]).all())]
    if nonfinite:
        raise ValueError(f"blocks {nonfinite} have NaN or inf entries")
    return {b: params[b].detach().float() for b in blocks}


def _rank_costs(shapes: dict[str, tuple[int, int]], ranks: dict[str, int]) -> int:
    return sum(block_cost(shapes[k], ranks[k], 0) for k in ranks)


def _levels_reached(levels: list[float], c: float) -> int:
    """How many of the increasing ``levels`` are needed to reach ``c`` (0 for c <= 0), at most all of them."""
    if c <= 0:
        return 0
    return min(sum(1 for v in levels if v < c - 1e-12) + 1, len(levels))


def svd_truncate(model: nn.Module, fraction: float, blocks: Sequence[str], *,
                 allocation: str = "uniform") -> tuple[nn.Module, CompressionReport]:
    """Replace each block X (m, n) by its rank-k_i SVD, with sum_i min(k_i (m + n), m n) within the budget.

    allocation: "uniform" (the largest common ratio k_i / min(m, n)), "global" (singular values of all blocks
    taken greedily in decreasing order while they fit), "energy" (the largest common fraction of each block's
    squared spectrum).
    """
    if allocation not in SVD_ALLOCATIONS:
        raise ValueError(f"allocation must be one of {SVD_ALLOCATIONS}, got {allocation!r}")
    weights = _weights(model, blocks)
    dense, target = count_parameters(model), target_params(model, fraction)
    budget = target - rest_params(model, list(blocks))
    svds = {k: torch.linalg.svd(w, full_matrices=False) for k, w in weights.items()}
    shapes = {k: tuple(w.shape) for k, w in weights.items()}
    full = {k: min(shapes[k]) for k in shapes}
    if allocation in ("uniform", "energy"):
        if allocation == "uniform":
            # Every achievable ratio r / min(m, n) is a candidate; ranks are floor(c * min(m, n)).
            candidates = sorted({r / full[k] for k in full for r in range(full[k] + 1)})
            levels = {k: [r / full[k] for r in range(1, full[k] + 1)] for k in full}
        else:
            # Cumulative squared-spectrum fractions; rank = how many singular values reach the common fraction c.
            levels = {k: (torch.cumsum(svds[k][1].double() ** 2, 0) / (svds[k][1].double() ** 2).sum()).tolist()
                      for k in full}
            candidates = sorted({0.0, *[v for k in levels for v in levels[k]]})
        # The cost grows with c, so bisect for the largest candidate that fits.
        lo, hi = -1, len(candidates) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            trial = {k: _levels_reached(levels[k], candidates[mid]) for k in full}
            if _rank_costs(shapes, trial) <= budget:
                lo = mid
            else:
                hi = mid - 1
        ranks = {k: _levels_reached(levels[k], candidates[lo]) if lo >= 0 else 0 for k in full}
    else:
        ranks = {k: 0 for k in full}
        order = sorted(((float(s), k) for k in full for s in svds[k][1]), key=lambda t: -t[0])
        spent = 0
        for _, k in order:
            extra = block_cost(shapes[k], ranks[k] + 1, 0) - block_cost(shapes[k], ranks[k], 0)
            if ranks[k] < full[k] and spent + extra <= budget:
                ranks[k] += 1
                spent += extra
    new, report_blocks = {}, {}
    for k, (u, s, vh) in svds.items():
        r = ranks[k]
        new[k] = (u[:, :r] * s[:r]) @ vh[:r]
        report_blocks[k] = {"shape": shapes[k], "rank": r, "nnz": 0, "cost": block_cost(shapes[k], r, 0)}
    params = dense - sum(m * n for m, n in shapes.values()) + sum(b["cost"] for b in report_blocks.values())
    return replace_weights(model, new), CompressionReport("svd", float(fraction), target, dense, params, report_blocks,
                                                          {"allocation": allocation})


def magnitude_prune(model: nn.Module, fraction: float, blocks: Sequence[str], *,
                    allocation: str = "uniform") -> tuple[nn.Module, CompressionReport]:
    """Keep the largest-|w| entries of the blocks (one scalar per kept entry) within the budget.

    allocation: "uniform" (the same density in every block), "global" (one |w| threshold for all blocks),
    "normalized" (one threshold on |w| / rms(block), so blocks of different scale compete fairly).
    """
    if allocation not in MAGNITUDE_ALLOCATIONS:
        raise ValueError(f"allocation must be one of {MAGNITUDE_ALLOCATIONS}, got {allocation!r}")
    weights = _weights(model, blocks)
    dense, target = count_parameters(model), target_params(model, fraction)
    budget = max(target - rest_params(model, list(blocks)), 0)
    sizes = {k: w.numel() for k, w in weights.items()}
    total = sum(sizes.values())
    if allocation == "uniform":
        keep = {k: min(budget * n // total, n) for k, n in sizes.items()}
    else:
        scale = {k: w.pow(2).mean().sqrt().clamp_min(1e-30) if allocation == "normalized" else 1.0
                 for k, w in weights.items()}
        scores = {k: w.abs().flatten() / scale[k] for k, w in weights.items()}
        flat = torch.cat([scores[k] for k in weights])
        owner = torch.cat([torch.full((sizes[k],), i, device=flat.device) for i, k in enumerate(weights)])
        top = torch.topk(flat, min(budget, total)).indices
        counts = torch.bincount(owner[top], minlength=len(weights))
        keep = {k: int(counts[i]) for i, k in enumerate(weights)}
    new, report_blocks = {}, {}
    for k, w in weights.items():
        mask = torch.zeros(sizes[k], dtype=torch.bool, device=w.device)
        if keep[k] > 0:
            mask[torch.topk(w.abs().flatten(), keep[k]).indices] = True
        new[k] = w * mask.view_as(w)
        shape = tuple(w.shape)
        report_blocks[k] = {"shape": shape, "rank": 0, "nnz": keep[k], "cost": block_cost(shape, 0, keep[k])}
    params = dense - total + sum(b["cost"] for b in report_blocks.values())
    return replace_weights(model, new), CompressionReport("magnitude", float(fraction), target, dense, params,
                                                          report_blocks, {"allocation": allocation})


def _shrink(x: torch.Tensor, tau: float) -> torch.Tensor:
    return torch.sign(x) * torch.clamp_min(x.abs() - tau, 0.0)


def _check_alm_options(eps1: float, eps2: float, max_iter: int) -> None:
    for name, value in (("eps1", eps1), ("eps2", eps2)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if not isinstance(max_iter, int) or isinstance(max_iter, bool) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive int, got {max_iter!r}")


@torch.no_grad()
def ialm_rpca(d: torch.Tensor, lam: float | None = None, *, eps1: float = 1e-7, eps2: float = 1e-5,
              mu: float | None = None, rho: float = 1.6,
              max_iter: int = 1000) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Robust PCA D = A + E, min ||A||_* + lam ||E||_1, by inexact ALM (official ``ialm.fit_torch`` schedule).

    Args:
        d: data matrix (m, n).
        lam: weight of the l1 term; default 1 / sqrt(m) (``static_rpca.py`` passes 1 / sqrt(max(m, n))).
        eps1: stop when ||D - A - E||_F / ||D||_F < eps1 (and the mu test below passed this iteration).
        eps2: mu grows by ``rho`` only in iterations where mu ||E_new - E_old||_F < eps2 ||D||_F.
        mu: initial penalty; default 1.25 / ||D||_2.

    Returns:
        (A, E, iterations), A and E (m, n) in D's dtype.
    """
    if not isinstance(d, torch.Tensor) or d.ndim != 2 or not d.is_floating_point():
        raise ValueError(f"d must be a 2-D floating tensor (m, n), got "
                         f"{tuple(d.shape) if isinstance(d, torch.Tensor) else type(d).__name__}")
    if d.numel() == 0:
        raise ValueError(f"d is empty, shape {tuple(d.shape)}")
    if not bool(torch.isfinite(d).all()):
        raise ValueError("d has NaN or inf entries")
    if lam is not None and not (isinstance(lam, (int, float)) and math.isfinite(lam)):
        raise ValueError(f"lam must be None or a finite number (<= 0 means the default), got {lam!r}")
    _check_alm_options(eps1, eps2, max_iter)
    if mu is not None and not (isinstance(mu, (int, float)) and math.isfinite(mu) and mu > 0):
        raise ValueError(f"mu must be None or a positive finite number, got {mu!r}")
    if not (isinstance(rho, (int, float)) and math.isfinite(rho) and rho >= 1):
        raise ValueError(f"rho (mu's growth factor) must be a finite number >= 1, got {rho!r}")
    if not bool(d.any()):  # D = 0 + 0 exactly; the ALM scales below would divide by ||D|| = 0
        return torch.zeros_like(d), torch.zeros_like(d), 0
    m, n = d.shape
    lam = 1.0 / math.sqrt(m) if lam is None or lam <= 0 else float(lam)
    norm_two = float(torch.linalg.matrix_norm(d, ord=2))
    norm_inf = float(d.abs().sum(dim=1).max()) / lam
    y = d / max(norm_two, norm_inf)
    a, e = torch.zeros_like(d), torch.zeros_like(d)
    d_norm = float(torch.linalg.matrix_norm(d))
    tol_proj = eps2 * d_norm
    mu = 1.25 / norm_two if mu is None else float(mu)
    it = 0
    converged = False
    while not converged and it < max_iter:
        it += 1
        e_new = _shrink(d - a + y / mu, lam / mu)
        u, s, vh = torch.linalg.svd(d - e_new + y / mu, full_matrices=False)
        svp = int((s > 1.0 / mu).sum())
        a = (u[:, :svp] * (s[:svp] - 1.0 / mu)) @ vh[:svp] if svp > 0 else torch.zeros_like(d)
        z = d - a - e_new
        y = y + mu * z
        # The official code grows mu only when E has settled (the exact-ALM outer test), not every iteration.
        grow = mu * float(torch.linalg.matrix_norm(e - e_new)) < tol_proj
        if grow:
            mu *= rho
        e = e_new
        converged = grow and float(torch.linalg.matrix_norm(z)) / d_norm < eps1
    return a, e, it


def rpca_components(model: nn.Module, blocks: Sequence[str], *, lam_scale: float = 1.0, eps1: float = 1e-2,
                    eps2: float = 1e-2, max_iter: int = 1000) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{block: (A, E)}: IALM-RPCA of each block with lam = lam_scale / sqrt(max(m, n)) (``static_rpca.py``
    defaults: lam_scale 1, eps1 = eps2 = 1e-2), ready for ``hpa.truncate_to_budget(..., components=...)``."""
    if not (isinstance(lam_scale, (int, float)) and math.isfinite(lam_scale) and lam_scale > 0):
        raise ValueError(f"lam_scale must be a finite number > 0, got {lam_scale!r}")
    weights = _weights(model, blocks)
    _check_alm_options(eps1, eps2, max_iter)
    out = {}
    for name, w in weights.items():
        a, e, _ = ialm_rpca(w, lam_scale / math.sqrt(max(w.shape)), eps1=eps1, eps2=eps2, max_iter=max_iter)
        out[name] = (a, e)
    return out
