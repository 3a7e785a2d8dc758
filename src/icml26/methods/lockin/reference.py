"""Plain, slow, obviously-correct versions of the probes: explicit Hessian, explicit Fisher, explicit projectors.

Only for tiny models (P up to a few thousand); the tests compare geometry.py, probe.py and curves.py with these.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn
from torch.func import functional_call

from .geometry import LossFn, double_backward_ok


def dense_hessian(model: nn.Module, loss_fn: LossFn, batch: Any) -> torch.Tensor:
    """The full (P, P) Hessian of ``loss_fn(model, batch)`` over all parameters, in ``model.parameters()`` order."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [math.prod(s) for s in shapes]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss_of_flat(flat: torch.Tensor) -> torch.Tensor:
        params = {n: c.view(s) for n, c, s in zip(names, flat.split(sizes), shapes)}

        class _View(nn.Module):  # loss_fn calls model(...): route the call through functional_call
            def __call__(self, *args, **kwargs):
                return functional_call(model, params, args, kwargs)

        return loss_fn(_View(), batch)

    with double_backward_ok():
        return torch.autograd.functional.hessian(loss_of_flat, theta, vectorize=True)


def dense_gradient_rows(model: nn.Module, loss_fn: LossFn, examples: Sequence[Any]) -> torch.Tensor:
    """(N, P) matrix of per-example gradients, one independent backward per example."""
    rows = []
    for ex in examples:
        model.zero_grad(set_to_none=True)
        loss_fn(model, ex).backward()
        rows.append(torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
                               for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    return torch.stack(rows)


def dense_fisher(grads: torch.Tensor) -> torch.Tensor:
    """Explicit empirical Fisher F = (1/N) sum_i g_i g_i^T, shape (P, P)."""
    return sum(torch.outer(g, g) for g in grads) / grads.shape[0]


def top_eigs_dense(matrix: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest-k eigenpairs of a symmetric matrix by full eigendecomposition, largest first."""
    evals, evecs = torch.linalg.eigh(matrix)
    order = torch.argsort(evals, descending=True)[:k]
    return evals[order], evecs[:, order]


def projector(basis: torch.Tensor) -> torch.Tensor:
    """Orthogonal projector onto the column space of an orthonormal basis (P, k): U U^T, shape (P, P)."""
    return basis @ basis.T


def overlap_dense(u: torch.Tensor, v: torch.Tensor) -> float:
    """trace(P_U P_V) / q with explicit projectors."""
    return float(torch.trace(projector(u) @ projector(v)) / u.shape[1])


def principal_angles_dense(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Principal angles from the eigenvalues of P_U P_V P_U, which are cos^2 of the angles (ascending angles)."""
    pu, pv = projector(u), projector(v)
    cos2 = torch.linalg.eigvalsh(pu @ pv @ pu).flip(0)[: min(u.shape[1], v.shape[1])]
    return torch.arccos(cos2.clamp(0.0, 1.0).sqrt())


def project_out_dense(delta: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """(I - P_U) delta with the explicit (P, P) projector."""
    return (torch.eye(basis.shape[0], dtype=basis.dtype) - projector(basis)) @ delta


def taylor_change_dense(grad: torch.Tensor, hessian: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
    """First- and second-order predicted loss change of the step v: (g^T v, 1/2 v^T H v)."""
    return float(grad @ v), float(0.5 * v @ hessian @ v)


def first_crossing_reference(x: Sequence[float], y: Sequence[float], level: float, *, decreasing: bool) -> float:
    """Walk the checkpoints one by one until x reaches ``level``; interpolate within that segment."""
    def reached(value: float) -> bool:
        return value <= level if decreasing else value >= level

    if reached(x[0]):
        return float(y[0])
    for i in range(1, len(x)):
        if reached(x[i]):
            frac = (level - x[i - 1]) / (x[i] - x[i - 1])
            return float(y[i - 1] + frac * (y[i] - y[i - 1]))
    return math.nan
