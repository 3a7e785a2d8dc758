"""Plain, slow, obviously-correct versions: the ground truth the fast forms in ``kruskal.py`` and ``adapter.py``
are tested against. Loops over columns and pairs, brute force over every column subset; no shortcuts."""

from __future__ import annotations

import itertools

import torch


def unit_columns_reference(X: torch.Tensor, tol: float) -> list[torch.Tensor] | None:
    """Columns of ``X`` (m, n) in float64, each divided by its norm; None if a norm is <= tol * the largest norm."""
    cols = [X[:, j].detach().double() for j in range(X.shape[1])]
    norms = [float(c.norm()) for c in cols]
    if not cols or max(norms) == 0 or any(v <= tol * max(norms) for v in norms):
        return None
    return [c / v for c, v in zip(cols, norms)]


def kruskal_rank_reference(X: torch.Tensor, *, tol: float = 1e-6) -> int:
    """Largest k such that every k columns of ``X`` are independent, by checking every subset of every size.

    A subset of k columns is dependent when its column-normalised submatrix has fewer than k singular values above
    ``tol`` (always so when k exceeds the number of rows).
    """
    cols = unit_columns_reference(X, tol)
    if cols is None:
        return 0
    n = len(cols)
    for k in range(1, n + 1):
        for subset in itertools.combinations(range(n), k):
            block = torch.stack([cols[j] for j in subset], dim=1)
            if int((torch.linalg.svdvals(block) > tol).sum()) < k:  # fewer than k singular values above tol
                return k - 1
    return n


def mutual_coherence_reference(X: torch.Tensor) -> float:
    """max over pairs i < j of |cos(x_i, x_j)|, pair by pair."""
    cols = unit_columns_reference(X, 0.0)
    if X.shape[1] < 2:
        return 0.0
    assert cols is not None, "zero column"
    return max(abs(float(cols[i] @ cols[j])) for i, j in itertools.combinations(range(len(cols)), 2))


def khatri_rao_reference(U: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """U ⊙ V column by column: column j is torch.kron(U[:, j], V[:, j])."""
    return torch.stack([torch.kron(U[:, j], V[:, j]) for j in range(U.shape[1])], dim=1)


def coherence_penalty_reference(X: torch.Tensor, *, kind: str = "mean_square", tau: float = 0.1, eps: float = 1e-4
                                ) -> torch.Tensor:
    """The penalty from its definition, with the full (n, n) Gram of the normalised columns and every i != j pair.

    Differentiable (built from tensor ops), so gradients of the fast form can be checked against it.
    """
    n = X.shape[1]
    cols = [X[:, j] / torch.sqrt(X[:, j].pow(2).sum() + eps * eps) for j in range(n)]
    off = [cols[i] @ cols[j] for i in range(n) for j in range(n) if i != j]
    if not off:
        return X.sum() * 0.0
    values = torch.stack(off)
    if kind == "mean_square":
        return values.pow(2).mean()
    return tau * torch.log(torch.exp(values.abs() / tau).mean())


def lokra_plus_delta_reference(U: torch.Tensor, V: torch.Tensor, d_out: int, d_in: int, axis: str,
                               scaling: float) -> torch.Tensor:
    """LoKRA+'s dW (d_out, d_in) built vector by vector: each Khatri-Rao vector kron(u_j, v_j), truncated to the
    layer's length, is placed as column j ('columns') or row j ('rows')."""
    delta = torch.zeros(d_out, d_in, dtype=U.dtype)
    for j in range(U.shape[1]):
        vec = torch.kron(U[:, j], V[:, j])
        if axis == "columns":
            delta[:, j] = vec[:d_out]
        else:
            delta[j, :] = vec[:d_in]
    return scaling * delta
