"""Plain, slow, obviously-correct versions of Janus-LoRA's pieces: the ground truth for tests.

Shapes: A (r, d_in), B (d_out, r), V (d_in, k) with orthonormal columns, dA like A, dB like B.
"""

from __future__ import annotations

import torch


def composite_update(A: torch.Tensor, B: torch.Tensor, dA: torch.Tensor, dB: torch.Tensor) -> torch.Tensor:
    """First-order change of B A under (dA, dB): B dA + dB A (the paper's composite update, without scaling)."""
    return B @ dA + dB @ A


def null_space_violation(dW: torch.Tensor, V: torch.Tensor) -> float:
    """NV = ||dW V||_F / ||dW||_F (0 when the update leaves the protected inputs' outputs unchanged)."""
    dW = dW.double()
    V = V.to(dW)
    norm = torch.linalg.matrix_norm(dW)
    if V.shape[1] == 0 or float(norm) == 0.0:
        return 0.0
    return float(torch.linalg.matrix_norm(dW @ V) / norm)


def rectify_min_norm_reference(A, B, V, dA0, dB0):
    """min ||dA - dA0||^2 + ||dB - dB0||^2 s.t. (B dA + dB A) V = 0, by building the constraint matrix explicitly
    (one column per factor entry) and projecting with a pseudo-inverse. float64."""
    A, B, V, dA0, dB0 = (t.double() for t in (A, B, V, dA0, dB0))
    r, d = A.shape
    o = B.shape[0]
    n = r * d + o * r

    def constraint(x: torch.Tensor) -> torch.Tensor:
        dA, dB = x[: r * d].reshape(r, d), x[r * d:].reshape(o, r)
        return (composite_update(A, B, dA, dB) @ V).reshape(-1)

    L = torch.stack([constraint(e) for e in torch.eye(n, dtype=torch.float64)], dim=1)  # (o*k, n)
    x0 = torch.cat([dA0.reshape(-1), dB0.reshape(-1)])
    x = x0 - torch.linalg.pinv(L, rtol=1e-10) @ (L @ x0)
    return x[: r * d].reshape(r, d), x[r * d:].reshape(o, r)


def energy_basis_reference(X: torch.Tensor, tau: float, V_old: torch.Tensor | None = None) -> torch.Tensor:
    """GPM's basis update (Saha et al., 2021) from stored representations X (n, d): keep V_old, then add the fewest
    top left-singular directions of the residual (X P)^T such that the captured energy reaches tau of ||X||_F^2."""
    X = X.double()
    d = X.shape[1]
    V_old = torch.zeros(d, 0, dtype=torch.float64) if V_old is None else V_old.double()
    total = float((X ** 2).sum())
    captured = float(((X @ V_old) ** 2).sum())
    residual = X - X @ V_old @ V_old.T
    U, S, _ = torch.linalg.svd(residual.T, full_matrices=False)
    k = 0
    while captured < tau * total - 1e-12 * total and k < len(S):
        captured += float(S[k] ** 2)
        k += 1
    return torch.cat([V_old, U[:, :k]], dim=1)


def dml_reference(features: torch.Tensor, prototypes: torch.Tensor, margin: float) -> torch.Tensor:
    """L_DML = mean_i sum_c max(0, cos(f_i, mu_c) - m), looping over samples and old-class prototypes."""
    if prototypes.shape[0] == 0:
        return features.sum() * 0.0
    total = features.new_zeros(())
    for f in features:
        for mu in prototypes:
            cos = torch.dot(f, mu) / (f.norm() * mu.norm())
            total = total + torch.clamp(cos - margin, min=0.0)
    return total / features.shape[0]
