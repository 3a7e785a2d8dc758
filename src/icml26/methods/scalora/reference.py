"""Brute-force ScaLoRA: form the full gradient G and the 2r step matrices explicitly, solve with lstsq.

Everything here costs O(m n r) memory or more and exists only as ground truth for the tests of the fast path
(``scaling.py`` and ``optimizer.py``), which never forms G.
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch

from .scaling import DEGENERATE_RTOL


def basis_sgd(G: torch.Tensor, A: torch.Tensor, B: torch.Tensor, s: float) -> torch.Tensor:
    """The 2r matrices of the 'sgd' proxy as columns of (m n, 2r): F_i = s^2 G a_i a_i^T, H_k = s^2 b_k b_k^T G."""
    cols = [s**2 * G @ torch.outer(A[i], A[i]) for i in range(A.shape[0])]
    cols += [s**2 * torch.outer(B[:, k], B[:, k]) @ G for k in range(B.shape[1])]
    return torch.stack([c.reshape(-1) for c in cols], 1)


def basis_adam(A: torch.Tensor, B: torch.Tensor, PA: torch.Tensor, PB: torch.Tensor, s: float) -> torch.Tensor:
    """The 2r matrices of the 'adam' proxy as columns of (m n, 2r): F_i = s P_B[:, i] a_i^T, H_k = s b_k P_A[k]^T."""
    cols = [s * torch.outer(PB[:, i], A[i]) for i in range(A.shape[0])]
    cols += [s * torch.outer(B[:, k], PA[k]) for k in range(B.shape[1])]
    return torch.stack([c.reshape(-1) for c in cols], 1)


def lstsq_coefficients(M: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Unconstrained ``argmin_c ||target - M c||`` with ``torch.linalg.lstsq`` (float64); target is (m, n)."""
    y = target.reshape(-1, 1).double()
    return torch.linalg.lstsq(M.double(), y, driver="gelsd").solution.squeeze(1)


def nnls_bruteforce(M: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``argmin_{c >= 0} ||target - M c||`` by trying every support (2^p lstsq solves; p = 2r <= 8 or so)."""
    M, y = M.double(), target.reshape(-1).double()
    p = M.shape[1]
    best, best_res = torch.zeros(p, dtype=torch.float64), float(y @ y)
    for size in range(1, p + 1):
        for support in itertools.combinations(range(p), size):
            idx = list(support)
            sol = torch.linalg.lstsq(M[:, idx], y[:, None], driver="gelsd").solution.squeeze(1)
            if bool((sol < 0).any()):
                continue
            c = torch.zeros(p, dtype=torch.float64)
            c[idx] = sol
            res = float(((y - M @ c) ** 2).sum())
            if res < best_res - 1e-15 * max(best_res, 1.0):
                best, best_res = c, res
    return best


def reference_multipliers(M: torch.Tensor, target: torch.Tensor, *, proxy: str, nonneg: str,
                          bounds: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, v) from the explicit basis, with the same conventions as the fast path: degenerate columns (squared
    norm below 1e-12 of the largest) keep multiplier 1; 'sgd' takes square roots; 'adam' matches the norm of
    the c = 1 step; everything is clamped to ``bounds``."""
    norms = (M.double() ** 2).sum(0)
    mask = norms > DEGENERATE_RTOL * norms.max()
    idx = mask.nonzero().squeeze(1)
    c = torch.zeros(M.shape[1], dtype=torch.float64)
    solve = nnls_bruteforce if nonneg == "nnls" else lstsq_coefficients
    c[idx] = solve(M[:, idx], target)
    if proxy == "sgd":
        m = c.clamp_min(0).sqrt()
    else:
        ones = mask.double()
        m = c * ((M.double() @ ones).norm() / (M.double() @ c).norm())
    m = torch.where(mask, m.clamp(*bounds), torch.ones_like(m))
    r = M.shape[1] // 2
    return m[r:], m[:r]


class ReferenceScaLoRA:
    """Dense ScaLoRA with SGD (+ heavy-ball momentum) on one weight W = W0 + s B A, 'sgd' proxy.

    Each step: G = dl/dW by autograd on the explicit W; factor gradients by the chain rule from G;
    multipliers from the explicit basis (lstsq / brute-force NNLS); W0, A, B, their gradients and momentum
    buffers rescaled; then buf <- mu buf + grad, p <- p - lr buf. ``optimizer.ScaLoRAOptimizer`` wrapping
    ``torch.optim.SGD(momentum=mu)`` must produce the same tensors.
    """

    def __init__(self, W0: torch.Tensor, A: torch.Tensor, B: torch.Tensor, s: float, *, lr: float,
                 momentum: float = 0.0, every: int = 1, nonneg: str = "nnls", target_scale: float = 1.0,
                 bounds: tuple[float, float] = (1e-2, 1e2)):
        self.W0, self.A, self.B = W0.clone(), A.clone(), B.clone()
        self.s, self.lr, self.momentum, self.every = s, lr, momentum, every
        self.nonneg, self.target_scale, self.bounds = nonneg, target_scale, bounds
        self.buf_A: torch.Tensor | None = None
        self.buf_B: torch.Tensor | None = None
        self.t = 0

    @property
    def weight(self) -> torch.Tensor:
        return self.W0 + self.s * self.B @ self.A

    def step(self, loss_of_weight: Callable[[torch.Tensor], torch.Tensor]) -> None:
        W = self.weight.clone().requires_grad_(True)
        G = torch.autograd.grad(loss_of_weight(W), W)[0]
        gA, gB = self.s * self.B.T @ G, self.s * G @ self.A.T
        if self.t % self.every == 0:
            M = basis_sgd(G, self.A, self.B, self.s)
            u, v = reference_multipliers(M, self.target_scale * G, proxy="sgd", nonneg=self.nonneg,
                                         bounds=self.bounds)
            u, v = u.to(self.A.dtype), v.to(self.A.dtype)
            new_A, new_B = v[:, None] * self.A, self.B * u[None, :]
            self.W0 = self.W0 + self.s * (self.B @ self.A - new_B @ new_A)
            self.A, self.B = new_A, new_B
            gA, gB = u[:, None] * gA, gB * v[None, :]
            if self.buf_A is not None:
                self.buf_A, self.buf_B = u[:, None] * self.buf_A, self.buf_B * v[None, :]
        if self.momentum:
            self.buf_A = gA.clone() if self.buf_A is None else self.momentum * self.buf_A + gA
            self.buf_B = gB.clone() if self.buf_B is None else self.momentum * self.buf_B + gB
            gA, gB = self.buf_A, self.buf_B
        self.A = self.A - self.lr * gA
        self.B = self.B - self.lr * gB
        self.t += 1
