"""Kruskal rank, mutual coherence, the Khatri-Rao product, effective rank and the differentiable coherence penalty.

Conventions: a matrix ``X`` of shape (m, n) is read as n columns x_1..x_n in R^m. The Kruskal rank (k-rank)
k(X) is the largest k such that *every* set of k columns is linearly independent (0 when a column is zero).
Facts used here (standard, see the README):

* k(X) <= rank(X) <= min(m, n).
* Mutual coherence mu(X) = max_{i != j} |<x_i, x_j>| / (||x_i|| ||x_j||). Donoho-Elad: spark(X) >= 1 + 1/mu, so
  k(X) = spark(X) - 1 >= min(n, ceil(1 / mu)).
* Sidiropoulos-Bro: for U (p, n) and V (q, n) with k(U), k(V) >= 1, k(U ⊙ V) >= min(k(U) + k(V) - 1, n).

Everything exact (``kruskal_rank``) enumerates column subsets and is meant for small matrices (tests, hand-made
cases, the learned factors of tiny adapters); :func:`coherence_lower_bound` is the cheap certificate for big ones.
"""

from __future__ import annotations

import itertools
import math

import torch

# 1/mu is rounded up after subtracting this, so that a coherence computed a hair below an exact 1/k (e.g. 0.5 for
# three vectors 120 degrees apart in R^2) cannot round the certified bound past the true k-rank.
_BOUND_SLACK = 1e-6


def _unit_columns(X: torch.Tensor, tol: float) -> torch.Tensor | None:
    """Columns scaled to unit norm in float64, or None when some column is (numerically) zero.

    A column is zero when its norm is at most ``tol`` times the largest column norm, so the test is scale-free.
    """
    if X.ndim != 2:
        raise ValueError(f"expected a matrix (m, n), got shape {tuple(X.shape)}")
    X = X.detach().to(torch.float64)
    norms = X.norm(dim=0)
    if X.shape[1] == 0 or norms.max() == 0 or bool((norms <= tol * norms.max()).any()):
        return None
    return X / norms


def mutual_coherence(X: torch.Tensor) -> float:
    """mu(X) = max_{i != j} |cos(x_i, x_j)| over the n columns of ``X`` (m, n); 0.0 when n < 2.

    Zero columns make the cosine undefined: ValueError.
    """
    if X.ndim != 2:
        raise ValueError(f"expected a matrix (m, n), got shape {tuple(X.shape)}")
    if X.shape[1] < 2:
        return 0.0
    unit = _unit_columns(X, 0.0)
    if unit is None:
        raise ValueError("mutual coherence is undefined for a matrix with a zero column")
    gram = (unit.T @ unit).abs()
    gram.fill_diagonal_(0.0)
    return float(gram.max())


def coherence_lower_bound(X: torch.Tensor, *, tol: float = 1e-6) -> int:
    """A certified lower bound on the Kruskal rank of ``X`` (m, n): min(n, ceil(1 / mu(X))); 0 with a zero column.

    From spark(X) >= 1 + 1/mu (Donoho and Elad, 2003). It is exact for, e.g., three vectors at 120 degrees in R^2
    (mu = 1/2, bound 2) and for any set of orthogonal columns (mu = 0, bound n).
    """
    unit = _unit_columns(X, tol)
    if unit is None:
        return 0
    n = unit.shape[1]
    if n == 1:
        return 1
    gram = (unit.T @ unit).abs()
    gram.fill_diagonal_(0.0)
    mu = float(gram.max())
    if mu <= 1e-12:
        return n
    return min(n, math.ceil(1.0 / mu - _BOUND_SLACK))


def _numerical_rank(unit: torch.Tensor, tol: float) -> int:
    return int((torch.linalg.svdvals(unit) > tol).sum())


def kruskal_rank(X: torch.Tensor, *, tol: float = 1e-6, max_subsets: int = 2_000_000, chunk: int = 4096) -> int:
    """Exact Kruskal rank of ``X`` (m, n) by checking column subsets, pruned by the coherence bound.

    A set of columns counts as dependent when the smallest singular value of its column-normalised submatrix is at
    most ``tol``; columns with norm <= ``tol`` times the largest are zero (k-rank 0). Sizes up to the coherence
    bound are independent by theorem and are skipped; sizes above the numerical rank cannot be independent. The
    remaining sizes are checked in batches of ``chunk`` subsets with one batched SVD each, stopping at the first
    dependent subset.

    Raises ValueError when more than ``max_subsets`` subsets would have to be checked (use
    :func:`coherence_lower_bound` and the matrix rank as bounds instead).
    """
    unit = _unit_columns(X, tol)
    if unit is None:
        return 0
    n = unit.shape[1]
    rank = _numerical_rank(unit, tol)
    lower = coherence_lower_bound(X, tol=tol)
    if rank == n or lower >= rank:
        return rank
    sizes = range(lower + 1, rank + 1)
    total = sum(math.comb(n, k) for k in sizes)
    if total > max_subsets:
        raise ValueError(f"exact Kruskal rank of a {tuple(X.shape)} matrix needs {total} subset checks "
                         f"(> max_subsets={max_subsets}); the certified range is [{lower}, {rank}]")
    for k in sizes:
        subsets = itertools.combinations(range(n), k)
        while batch := list(itertools.islice(subsets, chunk)):
            index = torch.tensor(batch)                       # (b, k)
            blocks = unit[:, index].permute(1, 0, 2)          # (b, m, k)
            if bool((torch.linalg.svdvals(blocks)[:, -1] <= tol).any()):
                return k - 1
    return rank


def khatri_rao(U: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Column-wise Kronecker product U ⊙ V: (p, n) and (q, n) -> (p q, n), column j = u_j ⊗ v_j.

    Entry (a q + b, j) is U[a, j] V[b, j] (u's index is the slow one, as in ``torch.kron``).
    """
    if U.ndim != 2 or V.ndim != 2 or U.shape[1] != V.shape[1]:
        raise ValueError(f"Khatri-Rao needs two matrices with the same number of columns, got {tuple(U.shape)} "
                         f"and {tuple(V.shape)}")
    return (U[:, None, :] * V[None, :, :]).reshape(U.shape[0] * V.shape[0], U.shape[1])


def khatri_rao_kruskal_bound(k_u: int, k_v: int, n: int) -> int:
    """Sidiropoulos-Bro: k(U ⊙ V) >= min(k(U) + k(V) - 1, n) for factors with n columns (0 if a factor has k = 0)."""
    if min(k_u, k_v) <= 0:
        return 0
    return min(k_u + k_v - 1, n)


def effective_rank(M: torch.Tensor) -> float:
    """Roy-Vetterli effective rank exp(H(p)), p_i = sigma_i / sum(sigma); 0.0 for the zero matrix."""
    s = torch.linalg.svdvals(M.detach().to(torch.float64))
    total = s.sum()
    if total <= 0:
        return 0.0
    p = s[s > 0] / total
    return float(torch.exp(-(p * p.log()).sum()))


def _normalise(X: torch.Tensor, eps: float) -> torch.Tensor:
    # eps keeps the gradient finite at zero columns (a zero-initialised factor); for ||x|| >> eps this is x / ||x||.
    return X * torch.rsqrt(X.pow(2).sum(0, keepdim=True) + eps * eps)


def coherence_penalty(X: torch.Tensor, *, kind: str = "mean_square", tau: float = 0.1, eps: float = 1e-4
                      ) -> torch.Tensor:
    """Differentiable coherence of the n columns of ``X`` (m, n), a surrogate for a low Kruskal rank.

    With x̂_j = x_j / sqrt(||x_j||^2 + eps^2) and G = X̂ᵀX̂ (n, n):

    * ``"mean_square"``: R = sum_{i != j} G_ij^2 / (n (n - 1)), in [0, 1]. Computed through the (m, m) Gram X̂X̂ᵀ
      when m < n, since ||X̂ᵀX̂||_F = ||X̂X̂ᵀ||_F: O(m^2 n) instead of O(m n^2).
    * ``"soft_max"``: R = tau * log(mean_{i != j} exp(|G_ij| / tau)), a smooth stand-in for mu(X) (tends to the
      max as tau -> 0, to the mean |G_ij| as tau -> inf). Needs the full (n, n) Gram.

    Returns a 0-d tensor (0 when n < 2). Scale-invariant in each column.
    """
    n = X.shape[1]
    if n < 2:
        return X.sum() * 0.0
    Xh = _normalise(X, eps)
    if kind == "mean_square":
        if X.shape[0] < n:
            diag = Xh.pow(2).sum(0)
            off = (Xh @ Xh.T).pow(2).sum() - diag.pow(2).sum()
        else:
            gram = Xh.T @ Xh
            off = gram.pow(2).sum() - torch.diagonal(gram).pow(2).sum()
        return off / (n * (n - 1))
    if kind == "soft_max":
        gram = (Xh.T @ Xh).abs()
        mask = ~torch.eye(n, dtype=torch.bool, device=X.device)
        return tau * (torch.logsumexp(gram[mask] / tau, 0) - math.log(n * (n - 1)))
    raise ValueError(f"kind must be 'mean_square' or 'soft_max', got {kind!r}")
